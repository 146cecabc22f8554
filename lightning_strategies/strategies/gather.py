"""Gathers of sharded tensors to global rank 0 only (collectives), for the strategies' canonical state.

The wrappers' own APIs give every rank a full copy; these send every shard to rank 0 only, so no other rank ever
holds a full tensor. Cutting full tensors back into shards needs no communication and lives in
:mod:`lightning_strategies.checkpoint.flat`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


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
