"""``FSDP2Strategy``'s sharding plan: which submodules get their own ``fully_shard``, with which options, and what a
step that bypasses them is told."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import Module

from .._torch_private import composable_activation_checkpoint


def is_sharded(module: Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module``."""
    return isinstance(module, FSDPModule)


def can_be_sharded_alone(submodule: Module, uses: Counter[int]) -> bool:
    """Whether ``fully_shard(submodule)`` keeps the model's meaning.

    Not for containers without a ``forward`` (``ModuleList``, ``ModuleDict``: ``fully_shard`` refuses them, since
    it gathers parameters in a forward hook), nor for a submodule whose parameters are also used outside it (a tied
    weight: ``fully_shard`` refuses to put one parameter in two groups). Their parameters go to the nearest sharded
    ancestor that holds every user (in the end the root), as fairscale's auto-wrapping of this package does.
    """
    if type(submodule).forward is Module.forward:
        return False
    inside = Counter(id(param) for _, param in submodule.named_parameters(remove_duplicate=False))
    return all(count == uses[key] for key, count in inside.items())


def on_device(module: Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``module`` is on ``device``."""
    return all(tensor.device == device for tensor in chain(module.parameters(), module.buffers()))


def shard_kwargs(
    mesh: DeviceMesh,
    reshard_after_forward: bool | None,
    mixed_precision: MixedPrecisionPolicy,
    cpu_offload: bool,
    device: torch.device,
) -> dict[str, Any]:
    """The keyword arguments of every ``fully_shard`` call (offloaded memory is pinned on CUDA only)."""
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    return {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mixed_precision,
        "offload_policy": offload,
    }


def shard_module(
    module: Module,
    kwargs: dict[str, Any],
    classes: tuple[type[Module], ...],
    min_num_params: int | None,
    activation_checkpointing: Sequence[type[Module]],
) -> None:
    """Applies ``fully_shard`` to the chosen submodules of ``module``, bottom-up, then to ``module`` itself.

    A submodule is chosen by class (``classes``) or by the parameters it holds that no submodule below it sharded
    (``min_num_params``), where sharding it alone keeps the model's meaning (:func:`can_be_sharded_alone`). Modules
    of the ``activation_checkpointing`` classes recompute their activations in backward. A module the user sharded
    already is left as it is.
    """
    if is_sharded(module):
        return  # sharded by the user in configure_model, or by an earlier run in this process
    checkpoint = composable_activation_checkpoint()  # present: the constructor refused the option otherwise
    for submodule in module.modules():
        if checkpoint is not None and isinstance(submodule, tuple(activation_checkpointing)):
            checkpoint(submodule)
    uses = Counter(id(param) for _, param in module.named_parameters(remove_duplicate=False))

    def chosen(submodule: Module) -> bool:
        if is_sharded(submodule) or not can_be_sharded_alone(submodule, uses):
            return False
        if classes and isinstance(submodule, classes):
            return True
        if min_num_params is None:
            return False
        unsharded = sum(p.numel() for p in submodule.parameters() if not isinstance(p, DTensor))
        return unsharded >= min_num_params

    # Post-order (children before their parents), so a parent only takes what its children left unsharded.
    for submodule in reversed(list(module.modules())[1:]):
        if chosen(submodule):
            fully_shard(submodule, **kwargs)
    fully_shard(module, **kwargs)


def step_bypassed_the_module(strategy_name: str, module: Module, method_name: str) -> str:
    """The error message for a step that computed with parameters still sharded (it bypassed a sharded module)."""
    units = [repr(name) for name, submodule in module.named_modules() if name and is_sharded(submodule)]
    named = ", ".join(units[:5]) + (" ..." if len(units) > 5 else "")
    inner = (
        f" The modules sharded on their own below the LightningModule ({named}) gather their parameters only in"
        " their own forward: a step that calls a submodule or method of one of them (`self.model.encoder(x)`)"
        " leaves them sharded. Call the sharded module itself (`self.model(x)`), or choose other units"
        " (shard_module_classes, min_num_params, or fully_shard in configure_model)."
        if units
        else ""
    )
    return (
        f"{strategy_name}: {method_name} computed with parameters that are still sharded.{inner} Parameters"
        f" used directly (`x @ self.encoder.weight`): call their module (`self(...)`, `self.encoder(x)`) in"
        f" {method_name} instead, not their `forward` methods."
    )
