"""Gathers of many tensors per transfer (``gather_many_to_rank0``, ``gather_owned_to_rank0``) on two gloo ranks:
exact values on rank 0 only, in the order given, across uneven and empty shards, mixed dtypes, 0-dim and empty
tensors, layouts that fall back to ``full_tensor()``, values that are not tensors, and buckets small enough to split;
one transfer per bucket; every gathered tensor in a storage of its own, recorded as a fresh copy."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lightning_strategies.strategies import gather
from lightning_strategies.strategies.gather import (
    TensorSpec,
    forget_fresh_copies,
    gather_many_to_rank0,
    gather_owned_to_rank0,
    is_fresh_copy,
)
from tests.support.ranks import run_as_ranks

WORLD_SIZE = 2


def _whole(shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    return (
        (torch.arange(max(1, torch.Size(shape).numel())) * 3 + salt)[: torch.Size(shape).numel()].view(shape).to(dtype)
    )


#: (shape, dtype, placement) of each DTensor; ``None``: a plain tensor.
DTENSORS: list[tuple[tuple[int, ...], torch.dtype, Any]] = [
    ((7, 3), torch.float32, Shard(0)),  # uneven: 4 rows and 3
    ((1, 4), torch.float32, Shard(0)),  # rank 1 holds no row
    ((5,), torch.float64, Shard(0)),  # another dtype in between: its own bucket, order kept
    ((0, 3), torch.float32, Shard(0)),  # no rows at all
    ((4, 2), torch.bfloat16, Shard(0)),
    ((6, 2), torch.float32, Shard(1)),  # another layout: full_tensor() on every rank
    ((), torch.float32, Replicate()),  # 0-dim
    ((3,), torch.int64, None),  # plain: the same on every rank
    ((8, 2, 2), torch.float32, Shard(0)),
    ((), torch.int64, None),  # a plain scalar (Adam's step)
]
EXTRA = "not a tensor"


def _values() -> list[Any]:
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    values: list[Any] = []
    for salt, (shape, dtype, placement) in enumerate(DTENSORS):
        whole = _whole(shape, dtype, salt)
        values.append(whole if placement is None else distribute_tensor(whole, mesh, [placement]))
    values.insert(3, EXTRA)
    return values


def _expected() -> list[Any]:
    expected: list[Any] = [_whole(shape, dtype, salt) for salt, (shape, dtype, _) in enumerate(DTENSORS)]
    expected.insert(3, EXTRA)
    return expected


def _plain(value: Any) -> Any:
    """A tensor as plain values, to send back from a rank (a tensor would go through shared memory)."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), tuple(value.shape), value.float().tolist())
    return value


def _count_into(function: Any, calls: list[int]) -> Any:
    """``function``, appending to ``calls`` at each call (the transfers one rank makes)."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return function(*args, **kwargs)

    return counted


def _gather_many(bucket_bytes: int, alone_bytes: int) -> dict[str, Any]:
    dist.init_process_group("gloo")
    forget_fresh_copies()
    transfers: list[int] = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(gather, "gather_into", _count_into(gather.gather_into, transfers))
        gathered = gather_many_to_rank0(_values(), bucket_bytes=bucket_bytes, alone_bytes=alone_bytes)
    fresh = [isinstance(value, torch.Tensor) and is_fresh_copy(value) for value in gathered]
    tensors = [value for value in gathered if isinstance(value, torch.Tensor) and value.numel() > 0]
    storages = {value.untyped_storage().data_ptr() for value in tensors}
    dist.destroy_process_group()
    return {
        "values": [_plain(value) for value in gathered],
        "fresh": fresh,
        "transfers": len(transfers),
        "own_storages": len(storages)
        == sum(isinstance(value, torch.Tensor) and value.numel() > 0 for value in gathered),
    }


@pytest.mark.parametrize(
    ("bucket_bytes", "alone_bytes", "transfers"),
    [(gather.BUCKET_BYTES, gather.ALONE_BYTES, 3), (64, gather.ALONE_BYTES, 5), (gather.BUCKET_BYTES, 64, 5)],
)
def test_gather_many_gives_every_full_value_on_rank_0_only_one_transfer_per_bucket(
    bucket_bytes: int, alone_bytes: int, transfers: int
) -> None:
    first, second = run_as_ranks(lambda: _gather_many(bucket_bytes, alone_bytes), world_size=WORLD_SIZE)

    assert first["values"] == [_plain(value) for value in _expected()]
    assert second["values"] == [None] * len(_expected())  # no other rank holds a full tensor
    # float32 (the empty tensor travels with the others), float64, bfloat16: one transfer each; with 64-byte buckets
    # float32 takes three ((7, 3) alone, (1, 4) with (0, 3), (8, 2, 2) alone); the same when tensors of 64 bytes or
    # more travel alone.
    assert first["transfers"] == second["transfers"] == transfers
    fallback = [index for index, (_, _, placement) in enumerate(DTENSORS) if placement in (Shard(1), Replicate())]
    fallback = [index + (index >= 3) for index in fallback]  # the value that is not a tensor sits at position 3
    assert [index for index, fresh in enumerate(first["fresh"]) if not fresh] == [3, *fallback]
    assert first["own_storages"]  # each gathered tensor in a storage of its own: saved as compactly as before


#: Each rank's own whole tensors (an OSS owner's optimizer state): mixed dtypes, 0-dim, empty, in an order to keep.
OWNED = [
    [((3, 2), torch.float32), ((), torch.int64), ((5,), torch.float32)],
    [((4,), torch.float32), ((2, 2), torch.float64), ((), torch.float32), ((0,), torch.float32), ((9,), torch.float32)],
]


def _owned(rank: int) -> list[torch.Tensor]:
    return [_whole(shape, dtype, 10 * rank + salt) for salt, (shape, dtype) in enumerate(OWNED[rank])]


def _gather_owned(bucket_bytes: int, alone_bytes: int) -> dict[str, Any]:
    dist.init_process_group("gloo")
    forget_fresh_copies()
    rank = dist.get_rank()
    owned = _owned(rank)
    specs: list[Any] | None = [None] * WORLD_SIZE if rank == 0 else None
    dist.gather_object([TensorSpec(tuple(tensor.shape), tensor.dtype) for tensor in owned], specs, dst=0)
    sent: list[int] = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(dist, "send", _count_into(dist.send, sent))
        gathered = gather_owned_to_rank0(owned, specs, torch.device("cpu"), bucket_bytes, alone_bytes)
    dist.destroy_process_group()
    if gathered is None:
        return {"gathered": None, "sends": len(sent)}
    return {
        "gathered": [[_plain(tensor) for tensor in ranks] for ranks in gathered],
        "fresh": all(is_fresh_copy(tensor) for ranks in gathered for tensor in ranks),
        "sends": len(sent),
    }


@pytest.mark.parametrize(
    ("bucket_bytes", "alone_bytes", "sends"),
    [(gather.BUCKET_BYTES, gather.ALONE_BYTES, 2), (16, gather.ALONE_BYTES, 4), (gather.BUCKET_BYTES, 16, 4)],
)
def test_gather_owned_gives_every_ranks_tensors_on_rank_0_in_order_one_send_per_bucket(
    bucket_bytes: int, alone_bytes: int, sends: int
) -> None:
    first, second = run_as_ranks(lambda: _gather_owned(bucket_bytes, alone_bytes), world_size=WORLD_SIZE)

    assert first["gathered"] == [[_plain(tensor) for tensor in _owned(rank)] for rank in range(WORLD_SIZE)]
    assert first["fresh"]
    assert second["gathered"] is None
    # Rank 1's float32 tensors (the empty one among them) in one send, its float64 in another; with 16-byte buckets
    # float32 takes three ((4,) alone, the scalar with the empty one, (9,) alone); with tensors of 16 bytes or more
    # alone: (4,), (2, 2), the scalar with the empty one, (9,).
    assert second["sends"] == sends
