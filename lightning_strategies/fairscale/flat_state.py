"""``fsdp_fairscale``'s flat shards as canonical state and back: gathered to global rank 0 (collectives), cut into
this rank's shards, and handed back to the module as full parameters when an in-process run ends."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel
from fairscale.nn.misc.flatten_params_wrapper import FlatParameter
from torch import Tensor
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from lightning_strategies.checkpoint import canonical_keys
from lightning_strategies.checkpoint.flat import local_shard, split_full
from lightning_strategies.fairscale._private import forget_unflattened_views, lazy_init, param_infos, shared_param_infos
from lightning_strategies.fairscale.layout import (
    FlatUnit,
    OptimizerLayout,
    canonical_name,
    fsdp_instances,
    join_name,
    persistent_buffers,
)

from ..strategies.gather import gather_full, mark_fresh_copy


def expected_model_state(root: Module, units: Sequence[FlatUnit], aliases: Mapping[str, str]) -> dict[str, Any]:
    """Canonical keys with meta tensors of the canonical shapes and dtypes (no memory, no collective); a module's
    extra state (``get_extra_state``) as it is now."""
    expected: dict[str, Any] = {
        join_name(canonical_name(name), "_extra_state"): module.get_extra_state()
        for name, module in root.named_modules()
        if type(module).get_extra_state is not Module.get_extra_state
    }
    for unit in units:
        for name, shape in zip(unit.names, unit.shapes, strict=True):
            expected[name] = torch.empty(shape, dtype=unit.param.dtype, device="meta")
    for key, buffer in persistent_buffers(root):
        expected[key] = torch.empty(buffer.shape, dtype=buffer.dtype, device="meta")
    for alias, holder in aliases.items():  # a plain module's state_dict names a tied parameter each time
        expected[alias] = expected[holder]
    return expected


def local_model_state(
    root: FullyShardedDataParallel, units: Sequence[FlatUnit], state: Mapping[str, Any]
) -> dict[str, Any] | None:
    """This rank's ``local_state_dict()`` (canonical keys) cut from full canonical ``state``: each flat shard built
    from the part of its parameters this rank keeps (only that part of a mapped file is read), buffers as they are.

    fairscale's own ``load_state_dict`` gathers every full parameter on every rank and copies each whole tensor of the
    checkpoint into it. ``None`` (that path is taken) where the local state holds anything else: a module's extra
    state, a parameter the state lacks (non-strict loading), a shard of another size or dtype.
    """
    for _, instance in fsdp_instances(root):
        lazy_init(instance)  # local_state_dict and load_local_state_dict need every instance initialised
    current = canonical_keys(root.local_state_dict())
    key_of = {id(param): canonical_name(name) for name, param in root.named_parameters()}
    local: dict[str, tuple[FlatUnit, Tensor]] = {}
    for unit in units:
        key = key_of.get(id(unit.param), "")
        held = current.get(key)
        if not isinstance(held, Tensor) or any(name not in state for name in unit.names):
            return None
        if held.numel() != -(-unit.numel // unit.instance.world_size) or held.dtype != unit.param.dtype:
            return None
        local[key] = (unit, held)
    buffers = dict(persistent_buffers(root))
    if set(current) != set(local) | set(buffers) or any(key not in state for key in buffers):
        return None
    cut: dict[str, Any] = {key: state[key] for key in buffers}
    for key, (unit, held) in local.items():
        chunk = local_shard([state[name] for name in unit.names], unit.instance.rank, unit.instance.world_size)
        cut[key] = chunk.to(dtype=held.dtype).view(held.shape)
    return cut


def _on_cpu(full: Tensor) -> Tensor:
    """A gathered tensor on the CPU: itself there (recorded fresh by the gather), else a host copy, recorded too."""
    return full if full.device.type == "cpu" else mark_fresh_copy(full.cpu())


def gather_model_state(
    root: Module, units: Sequence[FlatUnit], aliases: Mapping[str, str], key_order: Sequence[str], is_global_zero: bool
) -> dict[str, Any]:
    """The canonical model state on global rank 0 (``{}`` elsewhere), gathered unit by unit (a collective).

    Each flat shard is gathered to rank 0 only and cut into the parameters it holds (fairscale's ``state_dict`` would
    gather every full parameter on every rank); buffers are whole on every rank.

    Args:
        root: The root wrapper.
        units: Its units.
        aliases: Tied parameters' other names, each mapped to the name that holds the parameter.
        key_order: The plain module's ``state_dict`` order (empty: as gathered).
        is_global_zero: Whether this is global rank 0.
    """
    state: dict[str, Any] = {}
    for unit in units:
        full = gather_full(unit.local_shard, unit.numel, unit.instance.process_group)
        if full is not None:
            state.update(zip(unit.names, split_full(_on_cpu(full), unit.shapes, copy=False), strict=True))
        del full  # on a GPU the gathered buffer goes before the next one is gathered (the parts are host copies)
    if not is_global_zero:
        return {}
    for key, buffer in persistent_buffers(root):
        state[key] = buffer.detach().cpu().clone()
    for alias, holder in aliases.items():  # the same tensor, as in a plain module's state_dict
        state[alias] = state[holder]
    if set(key_order) == set(state):
        state = {key: state[key] for key in key_order}
    return state


def gather_optimizer_state(optimizer: Optimizer, layout: OptimizerLayout, is_global_zero: bool) -> dict[str, Any]:
    """The canonical state of an optimizer over flat shards on global rank 0 (``{}`` elsewhere; a collective)."""
    index = layout.index
    state: dict[int, dict[str, Any]] = {}
    for unit in layout.flat_units:
        for key, value in optimizer.state.get(unit.param, {}).items():
            if isinstance(value, Tensor) and value.dim() > 0:
                full = gather_full(value, unit.numel, unit.instance.process_group)
                # Views of the gathered buffer: the canonical state adds no second full copy.
                parts = split_full(_on_cpu(full), unit.shapes, copy=False) if full is not None else []
                del full  # as above: one gathered GPU buffer at a time, not two
            else:  # a scalar such as Adam's step: one independent copy per parameter (steps count in place)
                parts = [value.detach().cpu().clone() if isinstance(value, Tensor) else value for _ in unit.names]
            for name, part in zip(unit.names, parts, strict=False):
                state.setdefault(index[name], {})[key] = part
    if not is_global_zero:
        return {}
    groups = [
        {**{key: value for key, value in group.items() if key != "params"}, "params": [index[n] for n in names]}
        for group, names in zip(optimizer.param_groups, layout.group_names, strict=True)
    ]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def load_optimizer_state(optimizer: Optimizer, layout: OptimizerLayout, state: Mapping[str, Any]) -> None:
    """Loads canonical optimizer state into an optimizer over flat shards: each rank cuts its own shards."""
    index = layout.index
    flat_state: dict[int, dict[str, Any]] = {}
    for flat_index, unit in enumerate(layout.flat_units):
        entries = [state["state"].get(index[name]) for name in unit.names]
        present = [entry for entry in entries if entry]
        if not present:
            continue
        flat_state[flat_index] = {}
        for key in dict.fromkeys(key for entry in present for key in entry):
            sample = next(entry[key] for entry in present if key in entry)
            if isinstance(sample, Tensor) and sample.dim() > 0:
                # A parameter that never had a gradient has no state in a plain optimizer: zeros stand in.
                tensors = [
                    entry[key] if entry and key in entry else torch.zeros(shape, dtype=sample.dtype)
                    for entry, shape in zip(entries, unit.shapes, strict=True)
                ]
                shard = local_shard(tensors, unit.instance.rank, unit.instance.world_size)
                flat_state[flat_index][key] = shard.to(unit.param.device)
            else:
                flat_state[flat_index][key] = sample.clone() if isinstance(sample, Tensor) else sample
    flat_groups = []
    position = 0
    for group, units in zip(state["param_groups"], layout.group_units, strict=True):
        hyper = {key: value for key, value in group.items() if key != "params"}
        flat_groups.append({**hyper, "params": list(range(position, position + len(units)))})
        position += len(units)
    optimizer.load_state_dict({"state": flat_state, "param_groups": flat_groups})


def unshard_into_module(
    root: FullyShardedDataParallel,
    units: Sequence[FlatUnit],
    original_children: Sequence[tuple[Module, str, Module]],
    module: Module,
) -> None:
    """Gives the LightningModule back its own full parameters and submodules, as before setup.

    The process goes on running the user's script (one script per rank, or a single process), so the module must
    work again: every rank gathers the full parameters once, the original parameters are registered again with
    them (tied ones as one parameter again), and the children the strategy wrapped (its own choice or marked
    with ``fairscale.nn.wrap``) replace their wrappers. Submodules wrapped in FSDP by hand stay wrapped.

    Args:
        root: The root wrapper.
        units: Its units.
        original_children: ``(parent, name, child)`` of every child in the module tree before wrapping.
        module: The LightningModule.
    """
    flattened: list[tuple[Module, str, Tensor, bool]] = []
    tied: list[tuple[Module, str, Module, str]] = []
    sharded: list[tuple[Parameter, Tensor]] = []
    with root.summon_full_params(recurse=True, volatile=True):
        for unit in units:
            if isinstance(unit.param, FlatParameter):
                for _, owner, name in param_infos(unit.param):
                    full = getattr(owner, name).detach().clone()
                    flattened.append((owner, name, full, unit.param.requires_grad))
                shared = shared_param_infos(unit.param)
                tied += [(owner, name, holder, of) for *_, owner, name, holder, of in shared]
            else:
                sharded.append((unit.param, unit.param.detach().clone()))
    for owner, name, full, requires_grad in flattened:
        if hasattr(owner, name):
            delattr(owner, name)
        owner.register_parameter(name, Parameter(full, requires_grad=requires_grad))
    for owner, name, holder, holder_name in tied:  # one parameter again, as before wrapping
        if hasattr(owner, name):
            delattr(owner, name)
        owner.register_parameter(name, getattr(holder, holder_name))
    for param, full in sharded:
        param.data = full
    for parent, name, child in original_children:
        if getattr(parent, name, None) is not child:
            setattr(parent, name, child)
        forget_unflattened_views(child)
    forget_unflattened_views(module)
