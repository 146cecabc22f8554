"""Canonical optimizer state: what a plain optimizer over the unwrapped module's parameters returns.

That is torch's integer-keyed layout: ``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``,
with indices counting parameters through the param groups in order. Upstream ``single_device``/``ddp`` checkpoints
use it, so they and ours are interchangeable. States are checked against the optimizers before any is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_strategies.checkpoint.errors import OptimizerStateMismatchError
from lightning_strategies.checkpoint.model_state import unusable_tensor

# Per-parameter state entries that have the parameter's own shape in torch's optimizers. Others (Adafactor's
# factored row/column statistics, scalars such as "step") are not shape-checked.
PARAM_SHAPED_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum", "exp_inf", "ax"}
)


def param_group_shapes(optimizer: Optimizer) -> list[list[torch.Size]]:
    """Returns the shapes of the parameters of each param group of a plain (unsharded) optimizer."""
    return [[param.shape for param in group["params"]] for group in optimizer.param_groups]


def check_optimizer_state(
    state: Any,
    optimizer: Optimizer,
    group_shapes: Sequence[Sequence[torch.Size]],
    *,
    name: str = "optimizer 0",
    source: str = "the checkpoint",
) -> None:
    """Checks that canonical ``state`` can be loaded into ``optimizer``.

    Args:
        state: A canonical optimizer state (one entry of ``checkpoint["optimizer_states"]``).
        optimizer: The optimizer it will be loaded into (its class and defaults are compared).
        group_shapes: Canonical shapes of the parameters of each of the optimizer's param groups.
        name: How to name the optimizer in error messages.
        source: How to name the checkpoint in error messages.

    Raises:
        OptimizerStateMismatchError: Naming the group, parameter index or hyper-parameter that does not fit.
    """
    where = f"{source}, {name} ({type(optimizer).__name__})"
    if not isinstance(state, Mapping) or "state" not in state or "param_groups" not in state:
        found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise OptimizerStateMismatchError(
            f"{where}: expected a canonical optimizer state with 'state' and 'param_groups', found {found}."
            " An empty dict means the state was only kept on another rank; save from all ranks with this package."
        )
    groups = state["param_groups"]
    if len(groups) != len(group_shapes):
        raise OptimizerStateMismatchError(
            f"{where}: the checkpoint has {len(groups)} param group(s), the optimizer has {len(group_shapes)}."
            " configure_optimizers() must build the same param groups as in the run that saved the checkpoint."
        )
    shape_of_index: dict[Any, torch.Size] = {}
    required = sorted(key for key in optimizer.defaults if key != "params")
    for group_index, (group, shapes) in enumerate(zip(groups, group_shapes, strict=True)):
        params = group.get("params", [])
        if len(params) != len(shapes):
            raise OptimizerStateMismatchError(
                f"{where}: param group {group_index} has {len(params)} parameter(s) in the checkpoint and"
                f" {len(shapes)} in the optimizer. A checkpoint holding one rank's shard of a sharded optimizer looks"
                " like this; save it again with a strategy that writes canonical state."
            )
        lacking = [key for key in required if key not in group]
        if lacking:
            raise OptimizerStateMismatchError(
                f"{where}: param group {group_index} lacks {', '.join(map(repr, lacking))}, which"
                f" {type(optimizer).__name__} needs; the state was probably written by another optimizer type."
            )
        shape_of_index.update(zip(params, shapes, strict=True))
    for index, param_state in state["state"].items():
        if index not in shape_of_index:
            raise OptimizerStateMismatchError(
                f"{where}: state for parameter index {index!r}, which no param group lists"
                f" (valid indices: 0..{len(shape_of_index) - 1})."
            )
        if not isinstance(param_state, Mapping):
            raise OptimizerStateMismatchError(f"{where}: state of parameter {index!r} is not a dict.")
        for key, value in param_state.items():
            if isinstance(value, Tensor) and unusable_tensor(value):
                raise OptimizerStateMismatchError(
                    f"{where}: state {key!r} of parameter {index!r} {unusable_tensor(value)}."
                )
            if key in PARAM_SHAPED_STATE and isinstance(value, Tensor) and value.shape != shape_of_index[index]:
                raise OptimizerStateMismatchError(
                    f"{where}: state {key!r} of parameter {index!r} has shape {tuple(value.shape)}, the parameter has"
                    f" shape {tuple(shape_of_index[index])}. A flattened or sharded optimizer state looks like this."
                )


def check_optimizer_states(
    states: Any,
    optimizers: Sequence[Optimizer],
    group_shapes: Sequence[Sequence[Sequence[torch.Size]]],
    *,
    source: str = "the checkpoint",
) -> None:
    """Checks ``checkpoint["optimizer_states"]`` against all optimizers, including their count.

    Args:
        states: The checkpoint's list of optimizer states.
        optimizers: The optimizers returned by ``configure_optimizers``, in order.
        group_shapes: For each optimizer, the canonical parameter shapes of each param group.
        source: How to name the checkpoint in error messages.

    Raises:
        OptimizerStateMismatchError: On the first state that does not fit.
    """
    if not isinstance(states, Sequence):
        raise OptimizerStateMismatchError(
            f"{source}: 'optimizer_states' should be a list, found {type(states).__name__}."
        )
    if len(states) != len(optimizers):
        names = ", ".join(type(optimizer).__name__ for optimizer in optimizers) or "none"
        raise OptimizerStateMismatchError(
            f"{source} holds {len(states)} optimizer state(s), but configure_optimizers() returned"
            f" {len(optimizers)} optimizer(s) ({names}). Return the same optimizers as the run that saved it, or load"
            " only the weights (LightningModule.load_from_checkpoint) and start a new optimizer."
        )
    for index, (state, optimizer, shapes) in enumerate(zip(states, optimizers, group_shapes, strict=True)):
        check_optimizer_state(state, optimizer, shapes, name=f"optimizer {index}", source=source)


def shallow_copy_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Copies the containers of an optimizer state (not its tensors), for loaders that mutate their input."""
    return {
        **state,
        "state": {index: dict(param_state) for index, param_state in state["state"].items()},
        "param_groups": [dict(group) for group in state["param_groups"]],
    }


def numbered_through_groups(state: Any) -> Any:
    """``state`` with its parameters numbered 0, 1, ... through the param groups, as torch's ``state_dict()`` does.

    torch's own ``load_state_dict`` reads the numbers only as labels matched through the groups' ``params`` lists, so
    any numbering means the same state. Upstream Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy`` number
    parameters in the module's parameter order in their full files; with param groups in another order (the usual
    no-weight-decay groups) or a frozen parameter left out, their numbers differ from the canonical ones, and are
    renumbered here. Anything that is not a plain numbering (repeated or unlisted numbers) is returned unchanged, for
    the checks to name.
    """
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups"), Sequence):
        return state
    groups = state["param_groups"]
    if not all(isinstance(group, Mapping) and isinstance(group.get("params"), Sequence) for group in groups):
        return state
    numbers = [number for group in groups for number in group["params"]]
    if numbers == list(range(len(numbers))) or len(set(numbers)) != len(numbers):
        return state
    position = {number: index for index, number in enumerate(numbers)}
    entries = state.get("state", {})
    if not isinstance(entries, Mapping) or any(key not in position for key in entries):
        return state
    return {
        **state,
        "state": {position[key]: value for key, value in sorted(entries.items(), key=lambda item: position[item[0]])},
        "param_groups": [{**group, "params": [position[number] for number in group["params"]]} for group in groups],
    }


def name_keyed_to_canonical(by_name: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """Re-keys an optimizer state keyed by parameter name (torch's full state-dict API) into the canonical layout.

    Args:
        by_name: ``{"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}]}``.
        names: Every parameter's name in param-group order: the canonical index of ``names[i]`` is ``i``.

    Returns:
        ``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``, state sorted by index.
    """
    index = {name: position for position, name in enumerate(names)}
    state = {index[name]: entries for name, entries in by_name["state"].items()}
    groups = [
        {
            **{key: value for key, value in group.items() if key != "params"},
            "params": [index[n] for n in group["params"]],
        }
        for group in by_name["param_groups"]
    ]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def canonical_to_name_keyed(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of :func:`name_keyed_to_canonical`: integer indices become the parameters' names.

    Args:
        state: A canonical optimizer state.
        names: Every parameter's name in param-group order.

    Returns:
        The same state keyed by parameter name.
    """
    return {
        "state": {names[index]: entries for index, entries in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]} for group in state["param_groups"]
        ],
    }
