"""Models created on the meta device (``trainer.init_module(empty_init=True)``, ``with torch.device("meta")``).

A meta tensor has a shape and a dtype but no memory. ``fsdp2`` shards such a model first and then materialises it:
each rank allocates only its shards and runs the ``reset_parameters()`` of every module that owns a meta tensor, so no
rank ever holds the whole model. A module that owns a meta tensor and has no ``reset_parameters()`` would be left
holding uninitialised memory; that is refused at fit start unless a checkpoint restore then fills every such tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from itertools import chain

import torch
import torch.distributed
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import Module


def has_meta_tensors(module: Module) -> bool:
    """Whether any parameter or buffer of ``module`` (its submodules included) is on the meta device."""
    return any(tensor.is_meta for tensor in chain(module.parameters(), module.buffers()))


def _owned_meta_tensors(module: Module) -> list[str]:
    """Names of the meta tensors ``module`` owns itself (not its submodules')."""
    tensors = chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
    return [name for name, tensor in tensors if tensor.is_meta]


def _resets(module: Module) -> bool:
    return _reset_method(module) is not None


def _reset_method(module: Module) -> Callable[[], object] | None:
    method = getattr(module, "reset_parameters", None)
    return method if callable(method) else None


def uninitialised_meta_tensors(module: Module, restored: bool) -> dict[str, str]:
    """The meta tensors of ``module`` that materialisation would leave holding uninitialised memory.

    Args:
        module: The model (the LightningModule).
        restored: A checkpoint will be loaded into the model (strictly) right after setup: it fills every persistent
            tensor, so only non-persistent buffers are left.

    Returns:
        Qualified tensor name -> class name of the module that owns it, for the tensors whose owner has no
        ``reset_parameters()`` (and that a restore does not fill).
    """
    left: dict[str, str] = {}
    for prefix, owner in module.named_modules():
        if _resets(owner):
            continue
        non_persistent: set[str] = getattr(owner, "_non_persistent_buffers_set", set())
        for name in _owned_meta_tensors(owner):
            if restored and name not in non_persistent:
                continue
            left[f"{prefix}.{name}" if prefix else name] = type(owner).__name__
    return left


def refuse_uninitialised(left: Mapping[str, str], strategy_name: str) -> None:
    """Raises if materialising left meta tensors holding uninitialised memory (:func:`uninitialised_meta_tensors`).

    Every rank computes the same answer from its own module and the agreed resume path, so all ranks raise together.

    Args:
        left: Qualified tensor name -> class name of the module that owns it.
        strategy_name: Named in the error.

    Raises:
        RuntimeError: ``left`` is not empty; the message names each tensor, its module class and the fixes.
    """
    if not left:
        return
    tensors = ", ".join(f"{name!r} ({owner})" for name, owner in left.items())
    owners = ", ".join(sorted(set(left.values())))
    raise RuntimeError(
        f"{strategy_name}: the model has tensors on the meta device (trainer.init_module(empty_init=True) or"
        f" torch.device('meta')) that nothing would initialise: {tensors}. After sharding, {strategy_name} gives each"
        " meta tensor memory and calls the reset_parameters() of the module that owns it, and these modules"
        f" ({owners}) have none; a checkpoint restore (ckpt_path, loaded strictly) would fill them, except"
        f" non-persistent buffers. Define reset_parameters() on {owners} that initialises the module's own parameters"
        " and buffers, create these modules on a real device (outside init_module(empty_init=True) /"
        " torch.device('meta')), or resume from a checkpoint that holds them."
    )


def refuse_meta_tensors(module: Module, strategy_name: str) -> None:
    """Raises if ``module`` has tensors on the meta device, for strategies whose wrapper cannot shard them.

    Args:
        module: The model (the LightningModule).
        strategy_name: Named in the error.

    Raises:
        RuntimeError: Some tensor is on the meta device; the message names them and the fixes.
    """
    names = [name for name, tensor in chain(module.named_parameters(), module.named_buffers()) if tensor.is_meta]
    if not names:
        return
    shown = ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise RuntimeError(
        f"{strategy_name}: the model has tensors on the meta device, which {strategy_name} cannot shard or"
        f" initialise: {shown}. Create the model on a real device (trainer.init_module() without empty_init=True,"
        " no torch.device('meta') in your code or in configure_model), load real tensors into it first"
        " (load_state_dict(..., assign=True)), or train it with strategy='fsdp2', which shards meta tensors and then"
        " initialises each rank's shards with reset_parameters()."
    )


@contextmanager
def _shard_rng(mesh: DeviceMesh | None) -> Generator[None, None, None]:
    """Random initialisation of DTensor shards on a CPU mesh, each shard from its own stream.

    torch's DTensor random ops give each shard its part of one random full tensor only on accelerator meshes; on a
    CPU mesh every rank draws its shard from its own generator, and ranks seeded alike would hold equal shards (the
    rows of rank 0's half of a weight repeated in rank 1's). Here the CPU generator is seeded with the run's seed plus
    the rank's coordinate on the mesh, for the block only.
    """
    if mesh is None or mesh.device_type != "cpu":
        yield None
        return
    coordinate = mesh.get_local_rank() if mesh.ndim == 1 else mesh.get_rank()
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed((torch.initial_seed() + coordinate) % 2**64)
        yield None


@torch.no_grad()
def materialise_meta_tensors(module: Module, device: torch.device, mesh: DeviceMesh | None = None) -> None:
    """Gives every meta tensor of ``module`` memory on ``device`` and initialises it with ``reset_parameters()``.

    Tensors that are not on the meta device keep their values. Call it on the root after sharding: the new memory is
    each rank's shard only, and the root's ``_apply`` lets ``fully_shard`` take up the new shards. Modules' own
    ``reset_parameters()`` run children before parents, so a parent may re-initialise its children as its
    constructor would. Tensors that are not DTensors (buffers) are then broadcast from rank 0, so that every rank
    holds the same ones even where the initialisation draws random numbers.

    Args:
        module: The root module (sharded with ``fully_shard``, or plain).
        device: Where the memory goes.
        mesh: The data-parallel mesh the shards live on; ``None`` outside a process group (the launching process).
    """
    owners = [submodule for submodule in module.modules() if _owned_meta_tensors(submodule)]
    if not owners:
        return
    # Named before: _apply replaces buffers (and may replace parameters) with new objects.
    plain_parameters = [name for name, tensor in module.named_parameters() if _plain_meta(tensor)]
    plain_buffers = [name for name, tensor in module.named_buffers() if _plain_meta(tensor)]

    def allocate(tensor: Tensor) -> Tensor:
        return torch.empty_like(tensor, device=device) if tensor.is_meta else tensor

    sharded = any(isinstance(submodule, FSDPModule) for submodule in module.modules())

    # Outside inference mode (a `trainer.test` called inside `torch.inference_mode()`): there _apply cannot swap
    # DTensor parameters, and tensors created would be inference tensors that training cannot update.
    with torch.inference_mode(False):
        if sharded:
            # Through the root, so that fully_shard's own _apply takes up the new shards. DTensor parameters are
            # swapped in place, so a parameter shared by two modules (tied weights) stays one parameter.
            apply: Callable[[Callable[[Tensor], Tensor]], Module] = module._apply
            apply(allocate)
        else:
            _allocate_keeping_ties(module, device)
        with _shard_rng(mesh):
            for owner in reversed(owners):
                reset = _reset_method(owner)
                if reset is not None:
                    reset()
        if mesh is None or not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return
        for name in plain_parameters:
            torch.distributed.broadcast(module.get_parameter(name), src=0)
        for name in plain_buffers:
            torch.distributed.broadcast(module.get_buffer(name), src=0)


def _plain_meta(tensor: Tensor) -> bool:
    return tensor.is_meta and not isinstance(tensor, DTensor)


def _allocate_keeping_ties(module: Module, device: torch.device) -> None:
    """Gives each meta parameter and buffer of a plain module memory; one shared by several modules (tied weights)
    becomes one new tensor in all of them. (``Module.to_empty`` makes a new parameter per module: the tie breaks.)"""
    new: dict[int, Tensor] = {}
    old: list[Tensor] = []  # kept alive while their ids are the keys of `new`
    for owner in module.modules():
        for store in (owner._parameters, owner._buffers):
            for name, tensor in list(store.items()):
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in new:
                    empty = torch.empty_like(tensor, device=device)
                    new[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if store is owner._parameters else empty
                    old.append(tensor)
                store[name] = new[id(tensor)]  # type: ignore[assignment]
