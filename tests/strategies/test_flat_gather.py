"""Gathers of equal-sized shards to one rank (``gather_full``, ``gather_to_rank0``): exact values on the receiving
rank only, over the world and over a group that does not start at global rank 0, several gathers in a row; and the
way back, each rank cutting its part of a full tensor it holds (``local_part_like``) exactly as DTensor shards it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_strategies.checkpoint.flat import local_part_like, shard_size
from lightning_strategies.strategies.gather import gather_full, gather_to_rank0
from tests.support.ranks import run_as_ranks

WORLD_SIZE = 3
#: (numel, dtype, salt) of each gathered tensor: several dtypes, padded and unpadded, one element.
CASES = [(10, torch.float32, 1), (9, torch.float64, 2), (1, torch.int64, 3), (12, torch.bfloat16, 4)]


def _full(numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    return (torch.arange(numel) * 7 + salt).to(dtype)


def _shard(full: torch.Tensor, group_rank: int, group_size: int) -> torch.Tensor:
    size = shard_size(full.numel(), group_size)
    padded = torch.cat([full, full.new_zeros(size * group_size - full.numel())])
    return padded[group_rank * size : (group_rank + 1) * size].clone()


def _plain(tensor: torch.Tensor | None) -> tuple[str, list[Any]] | None:
    """A tensor as plain values, to send back from a rank (a tensor would go through shared memory)."""
    return None if tensor is None else (str(tensor.dtype), tensor.tolist())


def _gathers() -> list[Any]:
    """Each rank gathers in the world and, ranks 1 and 2, in their own group; returns what each gather gave."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pair = dist.new_group([1, 2])  # every rank takes part in creating it
    results: list[Any] = []
    # Back to back, in several dtypes and with padding: the point-to-point messages must not cross.
    for numel, dtype, salt in CASES:
        full = _full(numel, dtype, salt)
        results.append(_plain(gather_full(_shard(full, rank, WORLD_SIZE), numel)))
        if rank in (1, 2):
            results.append(_plain(gather_full(_shard(full, rank - 1, 2), numel, pair)))
    dist.destroy_process_group()
    return results


def test_gather_full_gives_the_exact_full_tensor_on_the_groups_first_rank_only() -> None:
    ranks = run_as_ranks(_gathers, world_size=WORLD_SIZE)
    world_results = ranks[0]
    pair_first = ranks[1][1::2]
    assert len(world_results) == len(CASES)
    for (numel, dtype, salt), world, pair in zip(CASES, world_results, pair_first, strict=True):
        expected = _plain(_full(numel, dtype, salt))
        assert world == expected
        assert pair == expected
    assert all(result is None for result in ranks[1][0::2])  # rank 1 is not the world's first rank
    assert all(result is None for result in ranks[2])  # rank 2 is first in neither group


def _gather_dtensors() -> list[Any]:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    results = []
    for rows in (7, 9, 2):  # uneven chunks (padded), even chunks, fewer rows than ranks
        whole = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3)
        results.append(_plain(gather_to_rank0(distribute_tensor(whole, mesh, [Shard(0)]))))
    dist.destroy_process_group()
    return results


def test_gather_to_rank0_gives_the_exact_full_dtensor_on_rank_0_only() -> None:
    ranks = run_as_ranks(_gather_dtensors, world_size=WORLD_SIZE)
    for rows, gathered in zip((7, 9, 2), ranks[0], strict=True):
        assert gathered == _plain(torch.arange(rows * 3, dtype=torch.float32).view(rows, 3))
    assert ranks[1] == [None, None, None] and ranks[2] == [None, None, None]


#: (shape, mesh shape, placements) cut locally: uneven and empty chunks, another dim, a 2-D mesh (HSDP's layout).
CUTS: list[tuple[tuple[int, ...], tuple[int, ...], list[Any]]] = [
    ((7, 3), (3,), [Shard(0)]),
    ((2, 5), (3,), [Shard(0)]),
    ((4, 8), (3,), [Shard(1)]),
    ((5,), (3,), [Replicate()]),
    ((6, 4), (1, 3), [Replicate(), Shard(0)]),
]


def _cuts() -> list[Any]:
    """Per case: whether the locally cut part equals DTensor's own (scattered) shard, in value, shape and placement."""
    dist.init_process_group("gloo")
    results = []
    for shape, mesh_shape, placements in CUTS:
        mesh = init_device_mesh("cpu", mesh_shape)
        full = torch.randn(shape, generator=torch.Generator().manual_seed(len(results)))
        scattered = distribute_tensor(full, mesh, placements)  # rank 0's values sent to every rank
        part = local_part_like(full, scattered)
        results.append(
            isinstance(part, DTensor)
            and part.placements == scattered.placements
            and part.shape == scattered.shape
            and torch.equal(part.to_local(), scattered.to_local())
            and part.to_local().untyped_storage().data_ptr() != full.untyped_storage().data_ptr()  # a copy
        )
    # Another shape than the DTensor's: not cut (the caller falls back to torch's loader).
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    results.append(local_part_like(torch.zeros(6, 2), distribute_tensor(torch.zeros(6, 3), mesh, [Shard(0)])))
    dist.destroy_process_group()
    return results


def test_local_part_like_cuts_each_ranks_part_exactly_as_dtensor_shards_it() -> None:
    for results in run_as_ranks(_cuts, world_size=WORLD_SIZE):
        assert results == [True] * len(CUTS) + [None]
