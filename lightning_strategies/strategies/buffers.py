"""DDP's ``broadcast_buffers`` for wrappers without it: every forward sees global rank 0's buffers.

Under ``ddp`` every rank's forward starts from rank 0's buffers (BatchNorm running statistics), and a checkpoint, which
rank 0 writes, holds rank 0's. fairscale FSDP and FSDP2 leave each rank with its own: validation after a resume then
differs from the uninterrupted run (the resumed ranks all start from rank 0's statistics, the uninterrupted ones from
their own). :class:`RankZeroBuffers` gives those strategies ``ddp``'s semantics at the cost of one broadcast per dtype
per step, and only for models whose buffers change in training: a model without such buffers pays one all-reduce per
fit and nothing per step.
"""

from __future__ import annotations

import torch
import torch.distributed
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn import Module

# A buffer by where it lives: wrappers may replace a buffer's tensor (fairscale casts buffers), never its owner.
_BufferSlot = tuple[Module, str]


def _slots(module: Module) -> list[_BufferSlot]:
    seen: set[int] = set()
    slots = []
    for owner in module.modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if id(buffer) not in seen:  # one tensor registered twice travels once
                seen.add(id(buffer))
                slots.append((owner, name))
    return slots


def _collective_device(tensor: Tensor) -> torch.device:
    """Where ``tensor`` travels: NCCL moves CUDA tensors only; buffers on the host (CPU offload) go via the GPU."""
    if torch.distributed.get_backend() == "nccl" and tensor.device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device


class RankZeroBuffers:
    """Broadcasts global rank 0's changing buffers to every rank before the first forward after a training step.

    Which buffers change is learnt in the first training step of each fit: the buffers whose value (or tensor) that
    step changed on any rank (the ranks agree with one all-reduce). Buffers that never change in training
    (``position_ids``, masks, rotary frequencies) never travel.

    Args:
        enabled: ``False`` keeps each rank's own buffers (no collective at all).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._changing: list[_BufferSlot] | None = None
        self._before_first_step: list[tuple[_BufferSlot, Tensor, Tensor]] = []
        self._stale = False

    def before_step(self, module: Module, training: bool) -> None:
        """Call before each step's forward, on every rank."""
        if not self.enabled:
            return
        if training and self._changing is None and not self._before_first_step:
            self._before_first_step = [
                (slot, tensor, tensor.detach().clone()) for slot in _slots(module) for tensor in [getattr(*slot)]
            ]
        if self._stale and self._changing:
            self._broadcast(self._changing)
        self._stale = False

    def after_step(self, module: Module, training: bool) -> None:
        """Call after each step, on every rank."""
        if not self.enabled or not training:
            return
        if self._changing is None:
            self._changing = self._agree_on_changed()
        self._stale = bool(self._changing)

    def _agree_on_changed(self) -> list[_BufferSlot]:
        snapshot, self._before_first_step = self._before_first_step, []
        if not snapshot:
            return []
        changed = [getattr(*slot) is not tensor or not torch.equal(tensor, before) for slot, tensor, before in snapshot]
        flags = torch.tensor(changed, dtype=torch.int32, device=_collective_device(snapshot[0][1]))
        torch.distributed.all_reduce(flags, op=ReduceOp.MAX)
        return [slot for (slot, _, _), flag in zip(snapshot, flags.tolist(), strict=True) if flag]

    @torch.no_grad()
    def _broadcast(self, slots: list[_BufferSlot]) -> None:
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for slot in slots:
            tensor: Tensor = getattr(*slot)
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for tensors in by_dtype.values():
            flat = torch.cat([tensor.reshape(-1) for tensor in tensors])  # one collective per dtype
            flat = flat.to(_collective_device(flat))
            torch.distributed.broadcast(flat, src=0)
            for tensor, synced in zip(tensors, torch.split(flat, [tensor.numel() for tensor in tensors]), strict=True):
                tensor.copy_(synced.view_as(tensor))
