"""The hand-written side of each comparison: the same wrapper as the strategy, driven with its own API only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
from fairscale.optim import OSS
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.optim import Optimizer

from lightning_strategies.checkpoint.atomic import atomic_torch_save
from lightning_strategies.fairscale import cpu as fairscale_cpu

from .models import LEARNING_RATE, BenchModule, shard_like_fsdp2

_FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _nothing() -> None:
    return None


@dataclass
class Wrapped:
    """A module wrapped by hand (or by a strategy) and the optimizer that trains it.

    Attributes:
        strategy: The strategy whose wrapper this is (``ddp_sharded``, ``fsdp_fairscale`` or ``fsdp2``).
        module: The unwrapped module.
        wrapper: What is called in a step (the module itself for FSDP2, which shards in place).
        optimizer: The optimizer over the parameters that train.
        close: Undoes what wrapping installed (fairscale's CPU patches).
    """

    strategy: str
    module: nn.Module
    wrapper: nn.Module
    optimizer: Optimizer
    close: Callable[[], None] = field(default=_nothing)


def wrap(strategy: str, module: BenchModule) -> Wrapped:
    """Wraps ``module`` the way the strategy does with its default options, by hand (``fsdp2``: also each block of
    ``module.block_classes()``, as ``FSDP2Strategy(shard_module_classes=...)`` does), with the module's optimizer.

    Raises:
        ValueError: An unknown strategy name.
    """
    if strategy == "ddp_sharded":
        oss = OSS(module.parameters(), optim=module.optimizer_class, lr=LEARNING_RATE)
        sharded = ShardedDataParallel(module, oss, reduce_buffer_size=0)  # the strategy's default
        return Wrapped(strategy, module, sharded, oss)
    if strategy == "fsdp_fairscale":
        patched = fairscale_cpu.install()  # what the strategy installs on CPU; fairscale FSDP needs it there
        fsdp = FullyShardedDataParallel(module, compute_device=torch.device("cpu"), state_dict_on_rank_0_only=True)
        optimizer = module.optimizer_class(fsdp.parameters(), lr=LEARNING_RATE)
        return Wrapped(strategy, module, fsdp, optimizer, fairscale_cpu.uninstall if patched else _nothing)
    if strategy == "fsdp2":
        shard_like_fsdp2(module, init_device_mesh("cpu", (dist.get_world_size(),)))
        optimizer = module.optimizer_class(module.parameters(), lr=LEARNING_RATE)
        return Wrapped(strategy, module, module, optimizer)
    raise ValueError(f"No hand-written wrapper for strategy {strategy!r}; known: ddp_sharded, fsdp_fairscale, fsdp2.")


def train_step(wrapped: Wrapped, x: Tensor, y: Tensor, loss_of: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """One optimisation step, in the order Lightning's automatic optimisation takes (forward, zero_grad, backward,
    step)."""
    loss = loss_of(wrapped.wrapper(x), y)
    wrapped.optimizer.zero_grad()
    loss.backward()
    wrapped.optimizer.step()
    return loss


def full_state(wrapped: Wrapped) -> dict[str, Any] | None:
    """Model and optimizer state gathered with the wrapper's own API: on rank 0 the whole state, elsewhere ``None``."""
    rank0 = dist.get_rank() == 0
    model_state: dict[str, Any]
    optimizer_state: dict[str, Any] | None
    if wrapped.strategy == "ddp_sharded":
        if not isinstance(wrapped.optimizer, OSS):
            raise TypeError(f"ddp_sharded trains with fairscale OSS, got {type(wrapped.optimizer).__name__}.")
        model_state = wrapped.module.state_dict()  # replicated parameters: rank 0 reads its own
        wrapped.optimizer.consolidate_state_dict(recipient_rank=0)
        optimizer_state = wrapped.optimizer.state_dict() if rank0 else None
        wrapped.optimizer._all_states = []
    elif wrapped.strategy == "fsdp_fairscale":
        if not isinstance(wrapped.wrapper, FullyShardedDataParallel):
            raise TypeError(f"fsdp_fairscale wraps with fairscale FSDP, got {type(wrapped.wrapper).__name__}.")
        model_state = wrapped.wrapper.state_dict()
        # fairscale 0.4.13 turns Adam's `step` tensors into Python floats inside the live optimizer's state (its
        # state_dict() shares the per-parameter dicts), and asserts on floats the next time: put the tensors back.
        steps = [(entries, entries["step"]) for entries in wrapped.optimizer.state.values() if "step" in entries]
        try:
            optimizer_state = wrapped.wrapper.gather_full_optim_state_dict(wrapped.optimizer)
        finally:
            for entries, step in steps:
                entries["step"] = step
    else:
        model_state = get_model_state_dict(wrapped.module, options=_FULL_ON_CPU)
        optimizer_state = dict(get_optimizer_state_dict(wrapped.module, wrapped.optimizer, options=_FULL_ON_CPU))
    if not rank0:
        return None
    return {"state_dict": model_state, "optimizer_states": [optimizer_state]}


def save(wrapped: Wrapped, path: Path, atomic: bool = False) -> None:
    """Gathers the full state with the wrapper's API and ``torch.save``-s it on rank 0 (every rank must call it).

    ``atomic=True`` writes the way the strategies' checkpoint IO does (temporary file, fsync, rename), to tell the
    cost of a durable write from the cost of the strategy.
    """
    state = full_state(wrapped)
    if state is not None:
        if atomic:
            atomic_torch_save(state, path)
        else:
            torch.save(state, path)


def load(wrapped: Wrapped, path: Path) -> None:
    """``torch.load`` of a file written by :func:`save` on every rank, loaded with the wrapper's own API."""
    checkpoint = torch.load(path, weights_only=True)
    model_state, optimizer_state = checkpoint["state_dict"], checkpoint["optimizer_states"][0]
    if wrapped.strategy == "ddp_sharded":
        wrapped.module.load_state_dict(model_state)
        wrapped.optimizer.load_state_dict(optimizer_state)
    elif wrapped.strategy == "fsdp_fairscale":
        if not isinstance(wrapped.wrapper, FullyShardedDataParallel):
            raise TypeError(f"fsdp_fairscale wraps with fairscale FSDP, got {type(wrapped.wrapper).__name__}.")
        wrapped.wrapper.load_state_dict(model_state)
        wrapped.optimizer.load_state_dict(wrapped.wrapper.get_shard_from_optim_state_dict(optimizer_state))
    else:
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(wrapped.module, model_state, options=options)
        set_optimizer_state_dict(wrapped.module, wrapped.optimizer, optimizer_state, options=options)
