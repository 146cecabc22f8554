"""Gathers of equal-sized shards to one rank (``gather_full``, ``gather_to_rank0``): exact values on the receiving
rank only, over the world and over a group that does not start at global rank 0, several gathers in a row."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_strategies.checkpoint.flat import gather_full, gather_to_rank0, shard_size
from tests.ranks import run_as_ranks

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
