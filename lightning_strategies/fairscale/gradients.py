"""What ``fsdp_fairscale`` does about gradients around a step, so that parameters end each step as under ``ddp``.

- :func:`gradients_kept_as_ddp`: around a backward pass, gradients add up and frozen ones stay, as under ``ddp``
  (fairscale sets gradient shards aside and loses some); :func:`record_gradient_arrivals` notes which original
  parameters of a flat parameter a gradient reached.
- A flat parameter's gradient is one tensor: an original parameter that got no gradient in a step has a zero slice in
  it where ``ddp`` leaves its gradient ``None``. :class:`GradientlessCheck` decides before each optimizer step which
  such parameters the step would move (refused) or leaves alone (:func:`keep_untouched` puts them back).
- :func:`gradients_set_aside` takes the shards' gradients off the flat parameters for a step's forward.
- :data:`AGREEING_SCALERS`: the loss scalers both fairscale strategies keep as the user passed them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel
from fairscale.nn.misc.flatten_params_wrapper import FlatParameter
from fairscale.optim.grad_scaler import ShardedGradScaler as FairScaleShardedGradScaler
from torch import Tensor
from torch.amp.grad_scaler import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_strategies.fairscale._private import (
    param_infos,
    reshard,
    saved_grad_shard,
    set_saved_grad_shard,
    syncs_gradients,
)
from lightning_strategies.fairscale.layout import FlatUnit, OptimizerLayout, fsdp_instances

#: Loss scalers that all-reduce found-inf by themselves: torch's sharded scaler and fairscale's own.
AGREEING_SCALERS: tuple[type[GradScaler], ...] = (ShardedGradScaler, FairScaleShardedGradScaler)

_ARRIVED = "_lightning_strategies_arrived"


def _arrive(arrived: list[bool], index: int, grad: Tensor) -> None:
    arrived[index] = True


def _arrive_at_split(arrived: list[bool], grad_inputs: Any, grad_outputs: Any) -> None:
    for index, grad in enumerate(grad_outputs):
        if grad is not None:  # autograd passes None for a split output that no gradient reached
            arrived[index] = True


def record_gradient_arrivals(flat: Parameter) -> None:
    """Hooks the forward pass's views of ``flat``: each original parameter a gradient reaches is marked as having
    received one (reset by :func:`forget_gradient_arrivals` before a backward pass that starts from no gradient).

    Only flat parameters that hold several original parameters are tracked: a zero slice of a flat gradient cannot
    tell "no gradient" (which ddp leaves alone) from "a zero gradient" (which weight decay still moves). The views are
    ``flat.split(numels)`` reshaped: one hook on that split's backward node sees which of its outputs got a gradient
    (one hook per flat parameter and forward pass); where the graph looks otherwise, one hook per view.
    """
    infos = param_infos(flat)
    if not flat.requires_grad or len(infos) < 2:
        return
    arrived: list[bool] = vars(flat).setdefault(_ARRIVED, [False] * len(infos))
    views = [getattr(owner, name, None) for _, owner, name in (infos[0], infos[-1])]
    nodes = [_split_node(view) for view in views]
    if nodes[0] is not None and nodes[0] is nodes[1]:
        nodes[0].register_hook(partial(_arrive_at_split, arrived))
        return
    for index, (_, owner, name) in enumerate(infos):
        view = getattr(owner, name, None)
        if isinstance(view, Tensor) and view.requires_grad and view.grad_fn is not None:
            view.register_hook(partial(_arrive, arrived, index))  # type: ignore[no-untyped-call]


def _split_node(view: Any) -> Any:
    """The backward node of the split a parameter view was cut from, or ``None``."""
    node = getattr(view, "grad_fn", None)
    if node is None or type(node).__name__ != "ViewBackward0" or not node.next_functions:
        return None
    split = node.next_functions[0][0]
    return split if split is not None and type(split).__name__.startswith("SplitWithSizesBackward") else None


def gradient_arrivals(flat: Parameter) -> list[bool] | None:
    """For a tracked flat parameter, whether each original parameter it holds received a gradient on this rank since
    its gradient was last ``None`` (``None``: not tracked: one original parameter, or never in a forward pass)."""
    arrived: list[bool] | None = vars(flat).get(_ARRIVED)
    return arrived


def forget_gradient_arrivals(params: Iterator[Parameter] | list[Parameter]) -> None:
    """Before a backward pass: a flat parameter whose gradient is ``None`` (zeroed) starts with no arrivals again."""
    for param in params:
        arrived: list[bool] | None = vars(param).get(_ARRIVED)
        if arrived is not None and param.grad is None:
            arrived[:] = [False] * len(arrived)


@contextmanager
def gradients_kept_as_ddp(root: FullyShardedDataParallel) -> Iterator[None]:
    """Around one backward pass: each parameter's gradient ends as under ``ddp`` (new gradients added to the ones the
    optimizer has not zeroed, a frozen parameter's gradient left alone).

    Before its backward pass, fairscale sets aside every gradient shard still on a parameter (the new reduced
    gradient is added to it, then moved back to ``.grad``), but it moves it back only for parameters that require
    gradients. A parameter frozen during the pass (``toggle_optimizer`` of the other optimizer) loses its ``.grad``,
    and the shard set aside stays behind where ``zero_grad()`` cannot reach it: the next backward pass
    that gives it a gradient adds the new gradient to that stale one, and its optimizer steps on the sum (a GAN that
    zeroes gradients before its backward passes, as Lightning's docs do, trains silently wrong). So a shard a
    parameter holds no ``.grad`` for (zeroed since) is dropped before the pass, and a frozen parameter gets its own
    gradient back after it.
    """
    params = [(instance, param) for _, instance in fsdp_instances(root) for param in instance.params]
    forget_gradient_arrivals([param for _, param in params])
    synced_before = not getattr(root, "_lightning_strategies_unsynced", False)
    for _, param in params:
        if param.grad is None and saved_grad_shard(param) is not None:
            set_saved_grad_shard(param, None)  # zeroed by the optimizer after the pass that left it
        elif param.grad is not None and synced_before and param.numel() == 1 and param.grad.numel() == 1:
            # A one-element parameter's reduced gradient shard has its full shape, which fairscale takes for a local
            # gradient accumulated under no_sync: it would add the new local gradient to it and reduce the sum again.
            # Set it aside as fairscale does for every other shape.
            set_saved_grad_shard(param, param.grad.data)
            param.grad = None
    try:
        yield None
    finally:
        vars(root)["_lightning_strategies_unsynced"] = not syncs_gradients(root)
        for instance, param in params:
            saved = saved_grad_shard(param)
            if saved is None or param.requires_grad:
                continue
            set_saved_grad_shard(param, None)
            if param.grad is not None:
                continue
            if param.shape != saved.shape:
                # No post-backward hook resharded this frozen parameter of the root (the root keeps its frozen
                # parameters gathered after backward): do what the hook does, so it holds its shard again.
                reshard(instance, [param])
            param.grad = saved


# A flat parameter's gradient is one tensor: an original parameter that got no gradient in a step has a zero slice in
# it where ddp leaves its gradient None (and the optimizer skips it). Which optimizers then still step it as ddp does:
# - without weight decay, every update of these is proportional to the gradients the parameter had so far, so a
#   parameter that never had one does not move;
_ZERO_GRADIENT_INERT = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.RMSprop,
        torch.optim.Adagrad,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adadelta,
        torch.optim.Rprop,
    }
)
# - these do not count the steps a parameter took part in (momentum buffers and sums start from zero either way), so a
#   parameter that skipped steps moves as under ddp once it gets gradients (Adam's bias correction counts every step
#   of the flat parameter instead);
_STEP_COUNT_FREE = frozenset({torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad})


def moves_without_gradient(optimizer: Optimizer, group: Mapping[str, Any], had_gradient: bool) -> str | None:
    """Why a zero gradient slice moves a parameter (``None``: it does not), for a parameter of ``group``."""
    kind = type(optimizer)
    if group.get("weight_decay", 0):
        return f"weight_decay={group['weight_decay']}"
    if kind not in _ZERO_GRADIENT_INERT:
        return f"{kind.__name__} (not known to leave a parameter with zero gradients alone)"
    if had_gradient and not (
        kind is torch.optim.Adagrad or (kind in (torch.optim.SGD, torch.optim.RMSprop) and not group.get("momentum"))
    ):
        return "the momentum or running averages of its earlier gradients"
    return None


def counts_steps(optimizer: Optimizer, group: Mapping[str, Any]) -> bool:
    """Whether ``optimizer`` counts, for a parameter of ``group``, the steps it took without a gradient."""
    return type(optimizer) not in _STEP_COUNT_FREE or bool(group.get("lr_decay", 0))


class GradientlessCheck:
    """Which parameters sharing a flat parameter had gradients in the fit's steps so far, and the check that uses it.

    Attributes:
        history: Per original parameter of a shared flat parameter: 1 had a gradient at a step, 2 had none at a step.
        checked: Whether the fit's first optimizer step was checked.
    """

    def __init__(self) -> None:
        self.history: dict[str, int] = {}
        self.checked = False

    def before_step(
        self,
        optimizer: Optimizer,
        optimizers: Sequence[Optimizer],
        layouts: Mapping[int, OptimizerLayout],
        device: torch.device,
    ) -> None:
        """Before a step: a parameter that shares a flat parameter and got no gradient (on any rank) is left alone as
        under ddp when it never had one (:func:`keep_untouched`); every rank raises if it had one and the step would
        move it (momentum), or if a step-counting optimizer steps it after steps it skipped (see ``_STEP_COUNT_FREE``).


        Hooks on the module's parameter views record on each rank which parameters a gradient reached; one
        all-reduce of those flags per step (every rank, for every optimizer that steps shared flat parameters: the
        same decision everywhere) combines them. Checked at every step: a parameter used in some batches only
        (a conditional branch) is the same case as one never used.

        Args:
            optimizer: The optimizer about to step.
            optimizers: Every optimizer of the run.
            layouts: The layout of each optimizer over flat parameters, by ``id``.
            device: Where the flags are all-reduced.

        Raises:
            RuntimeError: On every rank, naming the parameters the step would move where ddp leaves them alone.
        """
        if id(optimizer) not in layouts:
            return
        # At the fit's first step every optimizer's parameters that hold gradients are judged, so that a refusal comes
        # before any optimizer stepped (a two-optimizer step gives both networks gradients in its first pass); later,
        # each optimizer's own parameters before its step.
        first = not self.checked
        self.checked = True
        judged = [candidate for candidate in optimizers if first or candidate is optimizer]
        tracked = [
            (candidate, unit, group)
            for candidate in judged
            if id(candidate) in layouts
            for group, units in zip(candidate.param_groups, layouts[id(candidate)].group_units, strict=True)
            for unit in units
            if isinstance(unit.param, FlatParameter) and len(unit.names) > 1
        ]
        if not tracked:  # decided by the wrapping alone: the same on every rank
            return
        flags = [
            flag for _, unit, _ in tracked for flag in (gradient_arrivals(unit.param) or [False] * len(unit.names))
        ]
        arrived = torch.tensor(flags, dtype=torch.float32, device=device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(arrived)
        combined = (arrived > 0).tolist()
        problems: list[str] = []
        untouched: list[tuple[FlatUnit, int]] = []
        position = 0
        for candidate, unit, group in tracked:
            got = combined[position : position + len(unit.names)]
            position += len(unit.names)
            stepped = candidate is optimizer  # the others' history is written at their own steps
            if unit.param.grad is None or not unit.param.requires_grad or all(got):
                if unit.param.grad is not None and stepped:
                    for name in unit.names:
                        self.history[name] = self.history.get(name, 0) | 1
                continue
            for name, has_gradient in zip(unit.names, got, strict=True):
                history = self.history.get(name, 0)
                if has_gradient:
                    if history & 2 and counts_steps(candidate, group):
                        problems.append(
                            f"{name!r} (gets a gradient after steps without one: {type(candidate).__name__} counted"
                            " those steps for it, ddp does not)"
                        )
                    if stepped:
                        self.history[name] = history | 1
                    continue
                why = moves_without_gradient(candidate, group, had_gradient=bool(history & 1))
                if why is not None and not history & 1:
                    if stepped:  # never had a gradient: put back what the step changes (see keep_untouched)
                        untouched.append((unit, unit.names.index(name)))
                elif why is not None:
                    problems.append(f"{name!r} (no gradient; {why} would move it)")
                if stepped:
                    self.history[name] = history | 2
        if problems:
            shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            raise RuntimeError(
                "fsdp_fairscale with flattened parameters cannot train parameters that had gradients and get none in"
                " a step while others flattened with them do (pass flatten_parameters=False to FairScaleFSDPStrategy,"
                f" or give every parameter a gradient in each step): {shown}. fairscale gives them a zero gradient"
                " slice where ddp gives them none and leaves them alone; this optimizer step was not taken."
            )
        if untouched:
            keep_untouched(optimizer, untouched)


def keep_untouched(optimizer: Optimizer, untouched: list[tuple[FlatUnit, int]]) -> None:
    """Around this step of ``optimizer``: parameters that never had a gradient end it as they began, as under ddp.

    Each is a slice of a flat parameter whose gradient slice is zero; the step (weight decay) would move it and
    write its optimizer state. This rank's part of each slice is copied before the step and written back after it
    (state that the step created is zeroed there: ddp has none). Exact while the parameter gets no gradient;
    Adam's step count, shared by the flat parameter, is refused once it does (``counts_steps``).
    """
    saved: list[tuple[Parameter, Tensor, slice, Tensor, dict[str, Tensor]]] = []
    for unit, index in untouched:
        shard = unit.local_shard
        start = unit.instance.rank * shard.numel()
        offset = sum(shape.numel() for shape in unit.shapes[:index])
        begin = max(offset, start) - start
        end = min(offset + unit.shapes[index].numel(), start + shard.numel()) - start
        if begin >= end:
            continue  # another rank holds it
        part = slice(begin, end)
        state = {
            key: value[part].clone()
            for key, value in optimizer.state.get(unit.param, {}).items()
            if isinstance(value, Tensor) and value.shape == shard.shape
        }
        saved.append((unit.param, shard, part, shard[part].clone(), state))
    if not saved:
        return

    def write_back(stepped: Optimizer, args: Any, kwargs: Any) -> None:
        handle.remove()
        for param, shard, part, values, state in saved:
            shard[part].copy_(values)
            for key, value in stepped.state.get(param, {}).items():
                if isinstance(value, Tensor) and value.shape == shard.shape:
                    value[part].copy_(state[key]) if key in state else value[part].zero_()

    handle = optimizer.register_step_post_hook(write_back)


@contextmanager
def gradients_set_aside(units: Sequence[FlatUnit]) -> Iterator[None]:
    """Takes the flat parameters' gradients off them for a step's forward and puts them back after.

    Between steps a flat parameter holds this rank's shard and the gradient of that shard; in forward its data is
    the full parameter while the gradient stays the shard's. ``torch.compile`` describes each parameter of a
    compiled submodule with its gradient, and fails on that one ("attempting to assign a gradient of size").
    A gradient accumulated under ``no_sync`` is the full one: it fits the gathered parameter and stays.
    """
    units = [unit for unit in units if unit.param.grad is not None and unit.param.grad.shape == unit.param.shape]
    gradients = [unit.param.grad for unit in units]
    for unit in units:
        unit.param.grad = None
    try:
        yield None
    finally:
        for unit, gradient in zip(units, gradients, strict=True):
            unit.param.grad = gradient


def clip_by_total_norm(units: Sequence[FlatUnit], clip_val: float, device: torch.device, group: Any) -> None:
    """Scales the units' gradient shards so that their norm, summed over every rank's shards, is at most
    ``clip_val`` (one all-reduce over ``group``)."""
    grads = [unit.param.grad for unit in units if unit.param.grad is not None]
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        squares += grad.detach().float().pow(2).sum().to(device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(squares, group=group)
    coefficient = torch.clamp(float(clip_val) / (squares.sqrt() + 1e-6), max=1.0)
    for grad in grads:
        grad.detach().mul_(coefficient.to(grad.device, grad.dtype))
