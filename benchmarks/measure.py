"""Clocks and memory readings used inside the workers (no dependencies beyond torch and /proc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

_PAGE_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int:
    with open(_PAGE_STATUS) as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{_PAGE_STATUS} has no {field} line; RSS readings need Linux.")


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Highest resident set size since the process started or since :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Resets VmHWM to the current RSS (Linux >= 4.0: writing 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


_LIBC_NAME = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_NAME) if _LIBC_NAME else None


def release_free_memory() -> None:
    """Collects garbage and returns freed heap memory to the OS, so RSS before a measurement holds no dead pages that
    the measured code could reuse without raising the peak (glibc keeps freed chunks unless trimmed)."""
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def barrier() -> None:
    """All ranks meet (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def timed(action: Callable[[], Any]) -> float:
    """Seconds from all ranks starting ``action`` together to all of them having finished it."""
    barrier()
    start = time.perf_counter()
    action()
    barrier()
    return time.perf_counter() - start


def timed_with_peak(action: Callable[[], Any]) -> tuple[float, int]:
    """Like :func:`timed`, plus the RSS this rank added at its peak during ``action`` (bytes above the start)."""
    release_free_memory()
    barrier()
    before = rss_bytes()
    reset_peak_rss()
    start = time.perf_counter()
    action()
    barrier()
    seconds = time.perf_counter() - start
    return seconds, max(0, peak_rss_bytes() - before)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local shard's storage; FSDP1's original
    parameters with ``use_orig_params=True``, and their gradients, are views into the local shard of their flat
    parameter and of its gradient, so each shard counts once, with its padding, and a parameter held by the other rank
    is an empty tensor)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def training_state_bytes(parameters: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, their gradients and the optimizer state (each counted once)."""
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    inner = getattr(optimizer, "optim", optimizer)  # fairscale OSS keeps the state of its shard in .optim
    state = [
        value
        for entries in inner.state.values()
        for value in entries.values()
        if isinstance(value, Tensor) and value.dim() > 0
    ]
    return {"params": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": storage_bytes(state)}
