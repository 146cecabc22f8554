"""Between canonical tensors and the flat, padded, per-rank shards that FSDP-style wrappers train.

A wrapper flattens a list of parameters (shapes ``s_1 .. s_n``) into one 1-D tensor, pads it to a multiple of the
world size and gives rank ``r`` the ``r``-th equal chunk. Optimizer state of such a parameter has the chunk's shape.
These functions go both ways without knowing the wrapper, and without communicating: the gathers that run
collectives live with the strategies (:mod:`lightning_strategies.strategies.gather`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_strategies.checkpoint.io import release_pages


def shard_size(numel: int, world_size: int) -> int:
    """Elements per rank for a flat tensor of ``numel`` elements padded to a multiple of ``world_size``."""
    return -(-numel // world_size)


def split_full(flat: Tensor, shapes: Sequence[torch.Size], *, copy: bool = True) -> list[Tensor]:
    """Cuts an unpadded full flat tensor into tensors of the given shapes.

    Args:
        flat: The full flat tensor.
        shapes: The shapes, in the order the tensors were flattened.
        copy: Return independent tensors. ``False`` returns views of ``flat`` (no second full copy in memory; for a
            ``flat`` nobody else holds, such as a gathered buffer).

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
            release_pages(tensor)  # read from a mapped checkpoint: only the chunk stays resident
        offset += tensor.numel()
    return chunk


def local_part_like(full: Tensor, like: Tensor, *, copy: bool = True) -> Tensor | None:
    """The inverse of a gather to rank 0 where every rank holds the full tensor (it read a full checkpoint): this
    rank's part of ``full``, as a DTensor placed like ``like``, cut out here without any communication.

    torch's full state-dict loaders scatter every tensor from rank 0 although each rank has it already; cutting
    locally sends nothing. The part is a copy on ``like``'s device, so ``full`` can be freed.

    Args:
        full: The whole tensor (same shape as ``like``), on any device.
        like: A DTensor whose mesh, placements and local shape the part takes.
        copy: ``False`` returns a view of ``full`` instead of a copy where ``full`` is on ``like``'s device, for a
            caller that copies it into storage of its own (no second copy of the part in memory).

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
    if copy or part.device != local.device:
        part = part.to(device=local.device, copy=True)
        release_pages(full)  # read from a mapped checkpoint: only the copy stays resident
    return DTensor.from_local(part, mesh, like.placements, shape=like.shape, stride=like.stride(), run_check=False)
