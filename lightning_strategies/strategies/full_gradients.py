"""Complete gradients on every rank, for hooks that read them (``grad_norm`` in ``on_before_optimizer_step``).

After backward a sharding strategy leaves each rank part of the gradients: ``ddp_sharded`` keeps each parameter's
gradient on the rank that owns its optimizer state only, FSDP keeps a shard of every gradient (``fsdp2`` as DTensors,
fairscale as flat shards that the LightningModule does not even hold as parameters). Lightning's ``grad_norm(self)``
then logs one rank's share, fails, or logs nothing. Each context manager here makes the LightningModule's parameters
hold their complete gradients on every rank for the duration of the block, as under ``ddp``, and afterwards puts
back the sharded gradients, with what the block changed in place written into this rank's part (a hook that scales
or clips gradients itself still trains as under ``ddp``). It costs one collective and one full copy of the gradients
(fairscale: and of the parameters) while the block runs, so strategies enter it only when a hook is there to read.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module, Parameter

from lightning_strategies.checkpoint.flat import local_shard, split_full

from .gather import all_gather_flat


@contextmanager
def owners_gradients_on_every_rank(
    params: Sequence[Tensor], owner_of: dict[Tensor, int], rank: int
) -> Generator[None, None, None]:
    """``ddp_sharded``: each parameter's reduced gradient, held by the rank that owns it, lent to every other rank.

    One all-reduce of all gradients (owners contribute theirs, the others zeros) and a presence flag per parameter, so
    a parameter without a gradient (unused this step) stays without one everywhere.

    Args:
        params: The trainable parameters, in the same order on every rank.
        owner_of: The rank whose optimizer shard owns each parameter.
        rank: This rank.
    """
    if not params:
        yield None
        return
    sizes = [param.numel() for param in params]
    device = params[0].device
    buffer = torch.zeros(sum(sizes) + len(params), dtype=torch.float32, device=device)
    values, present = torch.split(buffer[: sum(sizes)], sizes), buffer[sum(sizes) :]
    for index, param in enumerate(params):
        if owner_of[param] == rank and param.grad is not None:
            values[index].copy_(param.grad.detach().reshape(-1))
            present[index] = 1.0
    dist.all_reduce(buffer)
    lent: list[tuple[Tensor, Tensor | None, Tensor]] = []
    for index, param in enumerate(params):
        if owner_of[param] != rank and present[index] > 0:
            complete = values[index].view_as(param).to(param.dtype)
            lent.append((param, param.grad, complete))
            param.grad = complete
    try:
        yield None
    finally:
        for param, own, _ in lent:
            param.grad = own  # the owner applied the same hook to the gradient that counts


@contextmanager
def full_dtensor_gradients(params: Iterable[Tensor]) -> Generator[None, None, None]:
    """``fsdp2``: each DTensor parameter's gradient as one plain, full tensor (an all-gather per parameter)."""
    from torch.distributed.tensor import DTensor, Shard

    lent: list[tuple[Tensor, Any, Tensor]] = []
    try:
        for param in params:
            grad = param.grad
            if isinstance(grad, DTensor):
                full = grad.full_tensor()
                lent.append((param, grad, full))
                param.grad = full
        yield None
    finally:
        for param, sharded, _ in lent:
            current = param.grad
            if current is not None:
                mesh = sharded.device_mesh
                local = sharded.to_local()
                if sharded.placements == (Shard(0),):
                    part = current.chunk(mesh.size(), dim=0)[mesh.get_local_rank()]
                    if part.shape == local.shape:
                        local.copy_(part)
            param.grad = sharded if current is not None else None


class FairScaleUnitView:
    """What :func:`full_fairscale_parameters` needs of one fairscale unit (a flat or sharded parameter).

    Args:
        param: The parameter the optimizer steps (``FlatParameter`` or a sharded original parameter).
        shapes: The full shapes of the original parameters it holds.
        owners: ``(module, attribute)`` of each original parameter, in order; for a sharded original parameter, the
            one entry is unused.
        shared: ``(module, attribute, index)``: further attributes that hold original parameter ``index`` (tied).
        rank: This rank in the unit's process group.
        world_size: The size of the unit's process group.
        group: The unit's process group.
        flat: Whether ``param`` is a flat parameter.
    """

    def __init__(
        self,
        param: Parameter,
        shapes: Sequence[torch.Size],
        owners: Sequence[tuple[Module, str]],
        shared: Sequence[tuple[Module, str, int]],
        rank: int,
        world_size: int,
        group: Any,
        flat: bool,
    ) -> None:
        self.param = param
        self.shapes = list(shapes)
        self.owners = list(owners)
        self.shared = list(shared)
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.flat = flat

    @property
    def numel(self) -> int:
        return sum(shape.numel() for shape in self.shapes)


_MISSING = object()


@contextmanager
def full_fairscale_parameters(units: Sequence[FairScaleUnitView]) -> Generator[None, None, None]:
    """``fsdp_fairscale``: the original parameters, full and with full gradients, back on their modules.

    Flattening removes the original parameters from their modules; for the block they are registered again (the full
    values, with the full gradients), so ``self.named_parameters()`` lists what the plain module would. The flat
    parameters' own gradients are set aside meanwhile, so nothing is counted twice.
    """
    restores: list[tuple[Module, str, Any]] = []
    restored_data: list[tuple[Parameter, Tensor]] = []
    write_backs: list[tuple[FairScaleUnitView, Tensor, list[Parameter]]] = []
    hidden: list[tuple[Parameter, Tensor | None]] = []
    try:
        for unit in units:
            sharded_grad = unit.param.grad
            if sharded_grad is None:
                continue
            full_values = all_gather_flat(unit.param.data, unit.numel, unit.group)
            full_grads = all_gather_flat(sharded_grad, unit.numel, unit.group)
            if not unit.flat:
                hidden.append((unit.param, sharded_grad))
                original_data = unit.param.data
                unit.param.data = full_values.view(unit.shapes[0])
                unit.param.grad = full_grads.view(unit.shapes[0])
                restored_data.append((unit.param, original_data))
                write_backs.append((unit, sharded_grad, [unit.param]))
                continue
            hidden.append((unit.param, sharded_grad))
            unit.param.grad = None
            stand_ins = []
            for (owner, name), value, grad in zip(
                unit.owners,
                split_full(full_values, unit.shapes, copy=False),
                split_full(full_grads, unit.shapes, copy=False),
                strict=True,
            ):
                stand_in = Parameter(value, requires_grad=unit.param.requires_grad)
                stand_in.grad = grad
                restores.append((owner, name, vars(owner).get(name, _MISSING)))
                vars(owner).pop(name, None)
                owner.register_parameter(name, stand_in)
                stand_ins.append(stand_in)
            for owner, name, index in unit.shared:
                restores.append((owner, name, vars(owner).get(name, _MISSING)))
                vars(owner).pop(name, None)
                owner.register_parameter(name, stand_ins[index])
            write_backs.append((unit, sharded_grad, stand_ins))
        yield None
    finally:
        for unit, sharded_grad, shown in write_backs:
            grads = [
                param.grad if param.grad is not None else torch.zeros(shape, dtype=sharded_grad.dtype)
                for param, shape in zip(shown, unit.shapes, strict=True)
            ]
            sharded_grad.copy_(local_shard(grads, unit.rank, unit.world_size)[: sharded_grad.numel()])
        for sharded_param, data in restored_data:
            sharded_param.data = data
        for owner, name, previous in reversed(restores):
            owner._parameters.pop(name, None)
            if previous is not _MISSING:
                vars(owner)[name] = previous
        for flat_param, set_aside in hidden:
            flat_param.grad = set_aside
