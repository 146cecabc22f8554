"""Every gather of tensors across ranks that the strategies run (collectives), in one place.

- To global rank 0 only, for the canonical state of full checkpoints: :func:`gather_full` (one flat shard per rank),
  :func:`gather_many_to_rank0` (DTensors, many per transfer), :func:`gather_owned_to_rank0` (each rank's whole tensors,
  many per transfer). No other rank ever holds a full tensor.
- To every rank, for hooks that read complete values: :func:`all_gather_flat`.

Tensors gathered for a checkpoint are private CPU copies that nothing else holds or changes. The gathers record them
(:func:`is_fresh_copy`), so that an asynchronous save shares them with its background write instead of copying
them again; a save forgets them when it ends (:func:`forget_fresh_copies`). An asynchronous save also holds back the
transfers of the gathers to rank 0 for its background thread (:class:`DeferredTransfers`): the step loop waits only for
each rank's CPU copy of what it sends. Cutting full tensors back into shards needs no communication and lives in
:mod:`lightning_strategies.checkpoint.flat`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from math import prod
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

#: Bytes of full tensors one transfer of :func:`gather_many_to_rank0` or :func:`gather_owned_to_rank0` carries at
#: most (a larger tensor travels alone): rank 0 holds at most one such buffer beyond the gathered tensors.
BUCKET_BYTES = 8 * 2**20
#: Tensors of at least this many bytes travel alone, straight into their own buffer: packing them with others would
#: cost a copy on every rank and another on rank 0 (measured: more than the round trip it saves), while a small
#: tensor's round trip costs far more than copying it.
ALONE_BYTES = 2**20

# ---------------------------------------------------------------------------------------------- fresh copies

# Weak references (keyed by the storage's address) to the storages of CPU tensors a gather allocated for a checkpoint.
# Weak: a storage nothing else holds is freed as usual; an expired one no longer counts.
_fresh_copies: dict[int, StorageWeakRef] = {}


def _weak_reference(tensor: Tensor) -> StorageWeakRef:
    """A weak reference to ``tensor``'s storage (its ``cdata`` names the storage while the reference lives)."""
    return StorageWeakRef(tensor.untyped_storage())  # type: ignore[no-untyped-call]  # untyped in torch


def mark_fresh_copy(tensor: Tensor) -> Tensor:
    """Records that ``tensor``'s storage is a private CPU copy a gather allocated (see :func:`is_fresh_copy`).

    Args:
        tensor: A CPU tensor that only the checkpoint being built holds. Other devices are not recorded.

    Returns:
        ``tensor`` itself.
    """
    if tensor.device.type == "cpu":
        reference = _weak_reference(tensor)
        _fresh_copies[reference.cdata] = reference
    return tensor


def is_fresh_copy(tensor: Tensor) -> bool:
    """Whether ``tensor`` (or the tensor it is a view of) is a CPU copy a gather of this save allocated.

    Such a tensor is not read or changed by training, so a background write may share it instead of copying it.

    Args:
        tensor: Any tensor.

    Returns:
        ``True`` only for a plain CPU tensor whose storage a gather recorded and which is still alive.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor) or tensor.device.type != "cpu" or not _fresh_copies:
        return False
    recorded = _fresh_copies.get(_weak_reference(tensor).cdata)
    return recorded is not None and not recorded.expired()  # type: ignore[no-untyped-call]  # untyped in torch


def forget_fresh_copies() -> None:
    """Forgets every recorded copy: called where a save starts and where it ends, so none counts for the next."""
    _fresh_copies.clear()


def fresh_copy_count() -> int:
    """How many storages are recorded as fresh copies (for tests: ``0`` once a save has ended)."""
    return len(_fresh_copies)


# ---------------------------------------------------------------------------------------------- deferred transfers


class DeferredTransfers:
    """The transfers of gathers to rank 0 that an asynchronous save holds back for its background thread.

    Inside :func:`deferring_transfers`, :func:`gather_full`, :func:`gather_many_to_rank0` and
    :func:`gather_owned_to_rank0` do on each rank only what must happen before training changes the live tensors: a
    rank copies what it will send to the CPU, and rank 0 copies its own part straight into the full tensors, which it
    allocates at once and returns as it would return the gathered ones. The transfers (and rank 0's cutting of what it
    receives into those tensors) are kept here, in the order of the calls, and run by :meth:`run` on a group of the
    same ranks: until then rank 0's full tensors hold its own parts only. Only CPU tensors on a group of every rank in
    rank order are held back (the background thread's gloo group stands in for that group); anything else is gathered
    at once, as outside.
    """

    def __init__(self) -> None:
        self._steps: list[Callable[[Any], None]] = []
        #: Bytes this rank copied to send later (what it holds for the transfers beyond rank 0's full tensors).
        self.staged_bytes = 0

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: Callable[[Any], None], sends: Tensor | None = None) -> None:
        """Holds back ``step``, a transfer that takes the process group it runs on; ``sends``: the copy it sends."""
        self._steps.append(step)
        if sends is not None:
            self.staged_bytes += sends.numel() * sends.element_size()

    def run(self, group: Any) -> None:
        """Runs the held transfers in order on ``group`` and forgets them (a collective: every rank runs its own).

        Args:
            group: A process group of every rank, in rank order (the background thread's gloo group).
        """
        steps, self._steps = self._steps, []
        for step in steps:
            step(group)

    def drop(self) -> None:
        """Forgets the held transfers without running them (every rank must drop its own: nothing was sent yet)."""
        self._steps.clear()
        self.staged_bytes = 0


# The transfers being held back (at most one), while a save's state is taken inside `deferring_transfers`.
_holding: list[DeferredTransfers] = []


@contextmanager
def deferring_transfers(deferred: DeferredTransfers) -> Iterator[DeferredTransfers]:
    """Within the block, gathers to rank 0 that can be hold back their transfers in ``deferred`` (see
    :class:`DeferredTransfers`); rank 0's results are complete only once ``deferred.run`` has run on every rank."""
    _holding.append(deferred)
    try:
        yield deferred
    finally:
        _holding.remove(deferred)


def _deferred_for(group: Any, device: torch.device) -> DeferredTransfers | None:
    """The transfers a gather on ``group`` over ``device`` holds back in, or ``None``: it transfers at once."""
    if not _holding or device.type != "cpu":
        return None
    if group is not None and dist.get_process_group_ranks(group) != list(range(dist.get_world_size())):
        return None  # a subgroup, or other ranks' order: the background group could not stand in for it
    return _holding[-1]


def _now_or_later(
    deferred: DeferredTransfers | None, step: Callable[[Any], None], group: Any, sends: Tensor | None = None
) -> None:
    """Runs ``step`` on ``group`` now, or holds it back in ``deferred`` (which later runs it on its own group)."""
    if deferred is None:
        step(group)
    else:
        deferred.add(step, sends)


# ---------------------------------------------------------------------------------------------- one flat shard


def gather_full(shard: Tensor, numel: int, group: Any = None) -> Tensor | None:
    """Gathers equal-sized shards to the group's rank 0 and returns the unpadded flat tensor there (``None`` elsewhere).

    Args:
        shard: This rank's 1-D chunk (all ranks' chunks have the same size).
        numel: Elements of the unpadded full tensor.
        group: The process group the tensor is sharded over (default: the world).

    Returns:
        The full flat tensor (on the shard's device; on the CPU recorded as a fresh copy) on the group's first rank,
        ``None`` on the others.
    """
    world_size = dist.get_world_size(group)
    destination = dist.get_global_rank(group, 0) if group is not None else 0
    is_destination = dist.get_rank() == destination
    deferred = _deferred_for(group, shard.device)
    if not is_destination:
        sent = shard.contiguous()
        if deferred is not None:  # sent later, when training has changed the live shard: a copy of it now
            sent = sent.clone()
        _now_or_later(deferred, partial(gather_into, sent, None, destination), group, sent)
        return None
    # The chunks are views of one buffer: the full tensor exists once, not once as chunks and again concatenated.
    full = torch.empty(world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
    chunks = list(full.chunk(world_size))
    own = shard.contiguous()
    if deferred is not None:  # this rank's part copied into its chunk now; the transfer later finds it in place
        own = chunks[dist.get_rank(group)]
        own.copy_(shard)
    _now_or_later(deferred, partial(gather_into, own, chunks, destination), group)
    return mark_fresh_copy(full[:numel])


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
            if chunk.data_ptr() != shard.data_ptr():  # packed in place already: nothing to copy
                chunk.copy_(shard)
        else:
            pending.append(dist.irecv(chunk, group=group, group_src=source))
    for work in pending:
        if work is not None:  # None only on a rank outside the group, which has no chunks to receive
            work.wait()


def all_gather_flat(shard: Tensor, numel: int, group: Any = None) -> Tensor:
    """Gathers equal-sized flat shards on every rank of the group (an all-gather) and returns the unpadded tensor.

    The result is lent to training (for hooks that read complete values), so it is not a fresh copy.

    Args:
        shard: This rank's 1-D chunk (all ranks' chunks have the same size).
        numel: Elements of the unpadded full tensor.
        group: The process group the tensor is sharded over (default: the world).

    Returns:
        The full flat tensor, on the shard's device, on every rank.
    """
    world_size = dist.get_world_size(group)
    full = torch.empty(world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
    dist.all_gather(list(full.chunk(world_size)), shard.contiguous(), group=group)
    return full[:numel]


# ---------------------------------------------------------------------------------------------- DTensors, in buckets


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _plain_copy(value: Tensor) -> Tensor | None:
    """A plain tensor is the same on every rank: rank 0 returns a fresh CPU copy, the others ``None``."""
    return mark_fresh_copy(value.detach().cpu().clone()) if _is_rank0() else None


def _gathers_in_buckets(value: Any) -> bool:
    """Whether a DTensor has FSDP2's layout (dim 0 sharded over a one-dimensional mesh), which buckets carry."""
    from torch.distributed.tensor import Shard

    return value.device_mesh.ndim == 1 and tuple(value.placements) == (Shard(0),) and value.ndim > 0


def _full_tensor_on_rank0(value: Any) -> Tensor | None:
    """Another layout: ``full_tensor()`` on every rank (it may return a rank's own data: not recorded as fresh)."""
    full = value.full_tensor()
    return full.cpu() if _is_rank0() else None


@dataclass
class _Bucket:
    """DTensors of one dtype, device and mesh whose padded shards travel in one transfer."""

    group: Any
    world_size: int
    positions: list[int] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)
    nbytes: int = 0  # of the padded full tensors

    @staticmethod
    def rows(value: Any, world_size: int) -> int:
        """Rows of each rank's padded shard: torch.chunk's chunk size (the first ranks hold that many rows each)."""
        return -(-int(value.shape[0]) // world_size)

    def piece(self, value: Any) -> int:
        """Elements of one rank's padded shard of ``value``."""
        return self.rows(value, self.world_size) * int(prod(value.shape[1:]))

    def add(self, position: int, value: Any) -> None:
        self.positions.append(position)
        self.values.append(value)
        self.nbytes += self.piece(value) * self.world_size * value.element_size()


class _Scratch:
    """One buffer per device that every bucket of one gather packs into (and rank 0 receives into), grown as needed:
    a new buffer per bucket would leave the allocator's heap fragmented (measured: 10 MB more at the peak of a save).

    While transfers are held back (:class:`DeferredTransfers`) every ``take`` is a buffer of its own instead: each
    bucket's buffer must stay as it is until its transfer runs.
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.device, Tensor] = {}
        self._private = bool(_holding)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype`` in the buffer (valid until the next ``take``)."""
        nbytes = numel * dtype.itemsize
        if self._private:
            return torch.empty(numel, dtype=dtype, device=device)
        buffer = self._buffers.get(device)
        if buffer is None or buffer.numel() < nbytes:
            self._buffers.pop(device, None)  # the smaller buffer goes before the larger one is allocated
            buffer = self._buffers[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer[:nbytes].view(dtype)


def _packed_shards(bucket: _Bucket, into: Tensor | None, scratch: _Scratch, private: bool = False) -> Tensor:
    """This rank's shards of the bucket's DTensors, each padded to its chunk size, one after another: in ``into``
    when given, else in ``scratch`` (or, for one unpadded shard, the shard itself; a copy of it when ``private``)."""
    locals_: list[Tensor] = [value.to_local() for value in bucket.values]
    pieces = [bucket.piece(value) for value in bucket.values]
    if into is not None:
        packed = into
    elif len(locals_) == 1 and locals_[0].shape[0] == bucket.rows(bucket.values[0], bucket.world_size):
        shard = locals_[0].detach().contiguous().view(-1)  # one unpadded shard: sent as it is, no copy
        return shard.clone() if private else shard
    else:
        packed = scratch.take(sum(pieces), locals_[0].dtype, locals_[0].device)
    offset = 0
    for value, local, size in zip(bucket.values, locals_, pieces, strict=True):
        rows = bucket.rows(value, bucket.world_size)
        part = packed[offset : offset + size].view(rows, *value.shape[1:])
        part[: local.shape[0]].copy_(local.detach())
        part[local.shape[0] :].zero_()
        offset += size
    return packed


def _gather_bucket(bucket: _Bucket, scratch: _Scratch) -> list[Tensor] | None:
    """One transfer: every rank's packed shards to the group's first rank, which cuts out the full tensors (on the
    CPU, each in a storage of its own, recorded as fresh copies); ``None`` on the other ranks. While transfers are
    held back, the transfer and the cutting are (:class:`DeferredTransfers`)."""
    world_size = bucket.world_size
    destination = dist.get_global_rank(bucket.group, 0)
    first = bucket.values[0].to_local()
    deferred = _deferred_for(bucket.group, first.device)
    if dist.get_rank() != destination:
        packed = _packed_shards(bucket, None, scratch, private=deferred is not None)
        if packed.numel() > 0:
            _now_or_later(deferred, partial(gather_into, packed, None, destination), bucket.group, packed)
        return None
    size = sum(bucket.piece(value) for value in bucket.values)
    if len(bucket.values) == 1:  # received into a buffer of its own, which becomes the result
        received = torch.empty(world_size * size, dtype=first.dtype, device=first.device)
    else:  # received into the scratch buffer, cut out below
        received = scratch.take(world_size * size, first.dtype, first.device)
    chunks = [received[rank * size : (rank + 1) * size] for rank in range(world_size)]
    own = chunks[dist.get_rank(bucket.group)]
    packed = _packed_shards(bucket, own, scratch)  # this rank's part straight into its chunk
    if len(bucket.values) == 1:  # the received buffer is the padded full tensor: no copy on the CPU
        if size > 0:
            _now_or_later(deferred, partial(gather_into, packed, chunks, destination), bucket.group)
        value = bucket.values[0]
        full = received.view(world_size * bucket.rows(value, world_size), *value.shape[1:])[: value.shape[0]]
        return [mark_fresh_copy(full if full.device.type == "cpu" else full.cpu())]
    fulls = [torch.empty(value.shape, dtype=value.dtype, device="cpu") for value in bucket.values]

    def receive_and_cut(group: Any) -> None:
        if size > 0:
            gather_into(packed, chunks, destination, group)
        offset = 0
        for value, full in zip(bucket.values, fulls, strict=True):
            rows, row_shape = bucket.rows(value, world_size), tuple(value.shape[1:])
            for rank, chunk in enumerate(chunks):
                held = max(0, min(rows, int(value.shape[0]) - rank * rows))  # torch.chunk: the last ranks hold fewer
                if held:
                    part = chunk[offset : offset + held * prod(row_shape)].view(held, *row_shape)
                    full[rank * rows : rank * rows + held].copy_(part)
            offset += bucket.piece(value)

    _now_or_later(deferred, receive_and_cut, bucket.group)
    return [mark_fresh_copy(full) for full in fulls]


def gather_many_to_rank0(
    values: Sequence[Any], bucket_bytes: int = BUCKET_BYTES, alone_bytes: int = ALONE_BYTES
) -> list[Any]:
    """The full values of many tensors on global rank 0 (on the CPU), ``None`` for each on the other ranks.

    DTensors sharded on dim 0 of a one-dimensional mesh (FSDP2's layout) travel in buckets: one bucket holds tensors of
    one dtype, device and mesh, up to ``bucket_bytes`` of full tensors (a tensor of ``alone_bytes`` or more travels
    alone, without copies). Each rank packs its padded shards of a bucket into one buffer, sent to rank 0 in one
    transfer, and rank 0 cuts the full tensors out (a copy each, except for a bucket of one tensor, which is its own
    buffer): rank 0 holds at most one bucket beyond the gathered tensors, and no other rank ever holds a full tensor.
    Other DTensor layouts (and 0-dim DTensors) fall back to ``full_tensor()``, which every rank gathers. A plain tensor
    is the same on every rank: rank 0 returns a copy. Values that are not tensors are returned as they are on rank 0.
    Gathered CPU tensors (not the fallback's) are recorded as fresh copies (:func:`is_fresh_copy`).

    Args:
        values: Tensors, DTensors and other values, the same kinds, shapes and dtypes in the same order on every rank.
            Every rank must call this with them.
        bucket_bytes: Bytes of full tensors one transfer carries at most.
        alone_bytes: Bytes of a full tensor from which it travels alone.

    Returns:
        On rank 0 the full values, in the order given; on the other ranks ``None`` for each.
    """
    from torch.distributed.tensor import DTensor

    results: list[Any] = [None] * len(values)
    open_buckets: dict[tuple[Any, ...], _Bucket] = {}
    scratch = _Scratch()

    def flush(bucket: _Bucket) -> None:
        fulls = _gather_bucket(bucket, scratch)
        if fulls is not None:
            for position, full in zip(bucket.positions, fulls, strict=True):
                results[position] = full

    for position, value in enumerate(values):
        if not isinstance(value, Tensor):
            results[position] = value if _is_rank0() else None
        elif not isinstance(value, DTensor):
            results[position] = _plain_copy(value)
        elif not _gathers_in_buckets(value):
            results[position] = _full_tensor_on_rank0(value)
        else:
            group = value.device_mesh.get_group()
            # The same keys on every rank: the dtypes, devices and meshes of the values are the same everywhere.
            key = (value.dtype, value.to_local().device, id(group))
            bucket = open_buckets.get(key)
            if bucket is None:
                bucket = open_buckets[key] = _Bucket(group, value.device_mesh.size())
            size = bucket.piece(value) * bucket.world_size * value.element_size()
            if size >= alone_bytes:
                alone = _Bucket(group, bucket.world_size)
                alone.add(position, value)
                flush(alone)
                continue
            if bucket.positions and bucket.nbytes + size > bucket_bytes:
                flush(bucket)
                bucket = open_buckets[key] = _Bucket(group, bucket.world_size)
            bucket.add(position, value)
    for bucket in open_buckets.values():
        if bucket.positions:
            flush(bucket)
    return results


def gather_to_rank0(value: Tensor) -> Tensor | None:
    """The full value of one tensor on global rank 0 (on the CPU), ``None`` on the other ranks.

    :func:`gather_many_to_rank0` of one value; gather many at once where there are many (one transfer per bucket).

    Args:
        value: A plain tensor or a DTensor. Every rank must call this for every DTensor, in the same order.

    Returns:
        The full tensor on rank 0, ``None`` elsewhere.
    """
    gathered: Tensor | None = gather_many_to_rank0([value])[0]
    return gathered


# ---------------------------------------------------------------------------------------------- owners' whole tensors


class TensorSpec(NamedTuple):
    """What rank 0 needs to receive one whole tensor: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _buckets_of(specs: Sequence[TensorSpec], bucket_bytes: int, alone_bytes: int) -> list[list[int]]:
    """Positions of ``specs`` grouped into transfers: one dtype each, in order, up to ``bucket_bytes`` (a tensor of
    ``alone_bytes`` or more alone). Sender and receiver compute the same from the same specs."""
    buckets: list[list[int]] = []
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    for position, spec in enumerate(specs):
        size = prod(spec.shape) * spec.dtype.itemsize
        if size >= alone_bytes:
            buckets.append([position])
            continue
        positions, nbytes = open_.get(spec.dtype, ([], 0))
        if positions and nbytes + size > bucket_bytes:
            positions, nbytes = [], 0
        if not positions:
            buckets.append(positions)
        positions.append(position)
        open_[spec.dtype] = (positions, nbytes + size)
    return buckets


def gather_owned_to_rank0(
    owned: Sequence[Tensor],
    specs: Sequence[Sequence[TensorSpec]] | None,
    device: torch.device,
    bucket_bytes: int = BUCKET_BYTES,
    alone_bytes: int = ALONE_BYTES,
) -> list[list[Tensor]] | None:
    """Every rank's own whole tensors (a sharded optimizer's state, held by the parameters' owners) to global rank 0.

    Each rank packs its tensors of one dtype into buckets of up to ``bucket_bytes`` (a tensor of ``alone_bytes`` or
    more alone, without copies) and sends
    each bucket in one transfer; rank 0 receives the ranks' buckets one at a time and cuts them into CPU tensors
    (each in a storage of its own, recorded as fresh copies). Rank 0 holds at most one bucket beyond the result; the
    other ranks a packed copy of at most one bucket of their own tensors.

    Args:
        owned: This rank's tensors, in an order rank 0 knows from ``specs``.
        specs: On rank 0, the shape and dtype of every rank's ``owned`` tensors, in global rank order (rank 0's
            own included), as gathered with ``gather_object``; ``None`` on the other ranks.
        device: The device transfers run on (the process group's: buffers are packed and received there).
        bucket_bytes: Bytes one transfer carries at most.
        alone_bytes: Bytes of a tensor from which it travels alone.

    Returns:
        On rank 0 every rank's tensors on the CPU, in global rank order and each rank's order; ``None`` elsewhere.
    """
    rank = dist.get_rank()
    scratch = _Scratch()
    deferred = _deferred_for(None, device)
    if specs is None:
        own = [TensorSpec(tuple(tensor.shape), tensor.dtype) for tensor in owned]
        for positions in _buckets_of(own, bucket_bytes, alone_bytes):
            tensors = [owned[position].detach() for position in positions]
            if len(tensors) == 1 and tensors[0].device == device:
                packed = tensors[0].contiguous().view(-1)  # sent as it is, no copy (but for a later transfer)
                if deferred is not None:
                    packed = packed.clone()
            else:
                packed = scratch.take(sum(tensor.numel() for tensor in tensors), tensors[0].dtype, device)
                offset = 0
                for tensor in tensors:
                    packed[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
                    offset += tensor.numel()
            if packed.numel() > 0:
                _now_or_later(deferred, partial(_send_to_rank0, packed), None, packed)
        return None
    gathered: list[list[Tensor]] = []
    for source, ranks_specs in enumerate(specs):
        if source == rank:
            gathered.append([mark_fresh_copy(tensor.detach().cpu().clone()) for tensor in owned])
            continue
        received_tensors: list[Tensor | None] = [None] * len(ranks_specs)
        for positions in _buckets_of(ranks_specs, bucket_bytes, alone_bytes):
            sizes = [prod(ranks_specs[position].shape) for position in positions]
            dtype = ranks_specs[positions[0]].dtype
            if len(positions) == 1:  # received into a buffer of its own, which becomes the result on the CPU
                buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
            else:  # received into the scratch buffer, cut out below
                buffer = scratch.take(sum(sizes), dtype, device)
            if len(positions) == 1 and buffer.device.type == "cpu":  # the buffer is the tensor: no copy
                parts = [buffer]
            else:
                parts = [torch.empty(size, dtype=dtype, device="cpu") for size in sizes]
            _now_or_later(deferred, partial(_receive_from, source, buffer, parts, sizes), None)
            del buffer
            for position, part in zip(positions, parts, strict=True):
                received_tensors[position] = mark_fresh_copy(part.view(ranks_specs[position].shape))
        gathered.append([tensor for tensor in received_tensors if tensor is not None])
    return gathered


def _send_to_rank0(packed: Tensor, group: Any) -> None:
    dist.send(packed, dst=0, group=group)


def _receive_from(source: int, buffer: Tensor, parts: list[Tensor], sizes: list[int], group: Any) -> None:
    """Receives one bucket of ``source``'s tensors into ``buffer`` and copies it into ``parts`` (unless the buffer is
    the one part)."""
    if buffer.numel() > 0:
        dist.recv(buffer, src=source, group=group)
    if len(parts) == 1 and parts[0].data_ptr() == buffer.data_ptr():
        return
    for part, piece in zip(parts, torch.split(buffer, sizes), strict=True):
        part.copy_(piece)
