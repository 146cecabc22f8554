"""Between canonical tensors and the flat, padded, per-rank shards that FSDP-style wrappers train.

A wrapper flattens a list of parameters (shapes ``s_1 .. s_n``) into one 1-D tensor, pads it to a multiple of the
world size and gives rank ``r`` the ``r``-th equal chunk. Optimizer state of such a parameter has the chunk's shape.
These functions go both ways without knowing the wrapper; the gather sends every shard to rank 0 only, so no other
rank ever holds a full tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def shard_size(numel: int, world_size: int) -> int:
    """Elements per rank for a flat tensor of ``numel`` elements padded to a multiple of ``world_size``."""
    return -(-numel // world_size)


def split_full(flat: Tensor, shapes: Sequence[torch.Size], *, copy: bool = True) -> list[Tensor]:
    """Cuts an unpadded full flat tensor into tensors of the given shapes.

    Args:
        flat: The full flat tensor.
        shapes: The shapes, in the order the tensors were flattened.
        copy: Return independent tensors. ``False`` returns views of ``flat`` (no second full copy in memory; for a
            ``flat`` nobody else holds, such as the buffer :func:`gather_full` returns).

    Returns:
        One tensor per shape.
    """
    numels = [shape.numel() for shape in shapes]
    if flat.numel() != sum(numels):
        raise ValueError(f"flat tensor has {flat.numel()} elements, the shapes {list(shapes)} need {sum(numels)}")
    parts = [part.view(shape) for part, shape in zip(torch.split(flat, numels), shapes, strict=True)]
    return [part.clone() for part in parts] if copy else parts


def local_shard(tensors: Sequence[Tensor], rank: int, world_size: int) -> Tensor:
    """Rank ``rank``'s padded chunk of the tensors flattened one after another.

    Only the chunk is built: each tensor's overlap with it is copied in (concatenating and padding the whole flat
    tensor on every rank cost two full copies per tensor loaded, which dominated loading large models).
    """
    numel = sum(tensor.numel() for tensor in tensors)
    size = shard_size(numel, world_size)
    start, end = rank * size, (rank + 1) * size
    dtype = functools.reduce(torch.promote_types, (tensor.dtype for tensor in tensors))
    chunk = torch.zeros(size, dtype=dtype, device=tensors[0].device)
    offset = 0
    for tensor in tensors:
        low, high = max(start, offset), min(end, offset + tensor.numel())
        if low < high:
            chunk[low - start : high - start] = tensor.reshape(-1)[low - offset : high - offset]
        offset += tensor.numel()
    return chunk


def gather_full(shard: Tensor, numel: int, group: Any = None) -> Tensor | None:
    """Gathers equal-sized shards to the group's rank 0 and returns the unpadded flat tensor there (``None`` elsewhere).

    Args:
        shard: This rank's 1-D chunk (all ranks' chunks have the same size).
        numel: Elements of the unpadded full tensor.
        group: The process group the tensor is sharded over (default: the world).

    Returns:
        The full flat tensor (on the shard's device) on the group's first rank, ``None`` on the others.
    """
    world_size = dist.get_world_size(group)
    destination = dist.get_global_rank(group, 0) if group is not None else 0
    is_destination = dist.get_rank() == destination
    if not is_destination:
        gather_into(shard.contiguous(), None, destination, group)
        return None
    # The chunks are views of one buffer: the full tensor exists once, not once as chunks and again concatenated.
    full = torch.empty(world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
    gather_into(shard.contiguous(), list(full.chunk(world_size)), destination, group)
    return full[:numel]


def gather_into(shard: Tensor, chunks: list[Tensor] | None, destination: int, group: Any = None) -> None:
    """``dist.gather`` of equal-sized contiguous shards straight into ``chunks`` on ``destination``.

    gloo's gather (CPU tensors) receives into a temporary tensor as large as all chunks together and then copies it
    into them: a second full copy on the destination for the length of the call. CPU shards are therefore sent
    point to point, each received directly into its chunk; other devices keep ``dist.gather`` (NCCL receives in
    place, and point-to-point would open a communicator per pair).

    Args:
        shard: This rank's contiguous chunk.
        chunks: On ``destination``, one contiguous tensor per group rank (views of one buffer); ``None`` elsewhere.
        destination: Global rank that receives.
        group: The process group (default: the world).
    """
    if shard.device.type != "cpu":
        dist.gather(shard, chunks, dst=destination, group=group)
        return
    if chunks is None:
        dist.send(shard, dst=destination, group=group)
        return
    own = dist.get_rank(group)
    pending = []
    for source, chunk in enumerate(chunks):
        if source == own:
            chunk.copy_(shard)
        else:
            pending.append(dist.irecv(chunk, group=group, group_src=source))
    for work in pending:
        if work is not None:  # None only on a rank outside the group, which has no chunks to receive
            work.wait()


def gather_to_rank0(value: Tensor) -> Tensor | None:
    """The full value of a tensor on global rank 0 (on the CPU), ``None`` on the other ranks.

    A DTensor sharded on dim 0 of a one-dimensional mesh (FSDP2's layout) is gathered to rank 0 only, one padded
    chunk per rank, so no other rank ever holds the full tensor. Other DTensor layouts fall back to
    ``full_tensor()`` (every rank gathers). A plain tensor is the same on every rank: rank 0 returns a copy.

    Args:
        value: A plain tensor or a DTensor. Every rank must call this for every DTensor, in the same order.

    Returns:
        The full tensor on rank 0, ``None`` elsewhere.
    """
    from torch.distributed.tensor import DTensor, Shard

    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if not isinstance(value, DTensor):
        return value.detach().cpu().clone() if is_rank0 else None
    mesh = value.device_mesh
    if mesh.ndim != 1 or tuple(value.placements) != (Shard(0),) or value.ndim == 0:
        full = value.full_tensor()
        return full.cpu() if is_rank0 else None
    group = mesh.get_group()
    world_size = mesh.size()
    local = value.to_local()
    rows = -(-value.shape[0] // world_size)  # torch.chunk's chunk size: the first ranks hold `rows` rows each
    if local.shape[0] == rows:
        padded = local.contiguous()
    else:
        padded = local.new_zeros((rows, *value.shape[1:]))
        padded[: local.shape[0]].copy_(local)
    destination = dist.get_global_rank(group, 0)
    if dist.get_rank() != destination:
        gather_into(padded, None, destination, group)
        return None
    full = torch.empty((rows * world_size, *value.shape[1:]), dtype=local.dtype, device=local.device)
    gather_into(padded, list(full.chunk(world_size)), destination, group)
    return full[: value.shape[0]].cpu()


def local_part_like(full: Tensor, like: Tensor) -> Tensor | None:
    """The inverse of :func:`gather_to_rank0` where every rank holds the full tensor (it read a full checkpoint):
    this rank's part of ``full``, as a DTensor placed like ``like``, cut out here without any communication.

    torch's full state-dict loaders scatter every tensor from rank 0 although each rank has it already; cutting
    locally sends nothing. The part is a copy on ``like``'s device, so ``full`` can be freed.

    Args:
        full: The whole tensor (same shape as ``like``), on any device.
        like: A DTensor whose mesh, placements and local shape the part takes.

    Returns:
        The part, or ``None`` where this cannot cut it the way ``like`` is sharded (a shape other than ``like``'s, or
        placements other than ``Shard`` and ``Replicate``, such as tensor parallelism's strided shards): the caller
        then loads through torch's state-dict API.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(like, DTensor) or full.shape != like.shape:
        return None
    mesh = like.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    part = full.detach()
    for mesh_dim, placement in enumerate(like.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            return None
        dim = placement.dim % full.ndim
        # DTensor's Shard splits like torch.chunk; ranks past the last chunk hold an empty part.
        pieces = torch.chunk(part, mesh.size(mesh_dim), dim=dim)
        index = coordinate[mesh_dim]
        part = pieces[index] if index < len(pieces) else part.narrow(dim, 0, 0)
    local = like.to_local()
    if part.shape != local.shape:
        return None
    return DTensor.from_local(
        part.to(device=local.device, copy=True),
        mesh,
        like.placements,
        shape=like.shape,
        stride=like.stride(),
        run_check=False,
    )
