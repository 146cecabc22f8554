"""How the bytes of a checkpoint file reach the kernel: in slices, and paced while a write runs beside training.

A background write (``async_save=True``) runs at the lowest CPU priority (``strategies.background_priority``), and yet
two of its costs reach the training steps beside it; this module bounds both.

* **Slices.** A kernel built without preemption of kernel code (``preempt=none``, the default of many cloud and VM
  kernels) keeps a thread on its core for the whole copy of one ``write`` system call into the page cache, whatever
  the thread's priority, and ``torch.save`` gives each tensor's bytes in one ``write``. So every file written here
  reaches the kernel in slices of at most :data:`WRITE_SLICE_BYTES` (:class:`SlicedFile`). Measured on the benchmark
  machine (6.18 kernel, ``preempt=none``): a thread that woke on the core of a ``SCHED_IDLE`` writer waited up to
  18.7 ms behind 16 MB writes (99 % within 4.0 ms), and up to 1.4 ms behind 256 KB slices (99 % within 0.5 ms);
  writing 50 MB took 11.6 ms instead of 10.9 ms.
* **Pacing.** A core that training leaves idle is not free where cores share a physical core (SMT siblings; the vCPUs
  of many VMs): a thread that runs there slows the thread on its sibling. On the benchmark machine a busy loop on one
  vCPU slowed a loop on the other 1.76x, so a writer that used the idle vCPU in bursts slowed the ranks' steps by
  10-15 % for as long as it ran. A background writer is therefore paced (:class:`Pacing`): after each slice it pauses
  :data:`PAUSE_PER_SECOND_WORKED` times as long as it worked since its last pause (its share of a core is at most a
  third), within a budget of time that keeps it clear of the next save, and as soon as the step loop waits for the
  write (the next save, the end of training), it is hurried: it pauses no more. Writes in the foreground are never
  paced.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

#: The most bytes one ``write`` system call of a checkpoint file is given.
WRITE_SLICE_BYTES = 256 * 1024

#: Seconds a paced writer pauses per second it worked (2: it runs at most a third of the time).
PAUSE_PER_SECOND_WORKED = 2.0


class Pacing:
    """The pace of one background write: the pauses between its slices, until it is hurried.

    Created where the write starts; the thread that runs the write enters :func:`paced` with it, and the step loop
    calls :meth:`hurry` when it waits for the write. A pause is :data:`PAUSE_PER_SECOND_WORKED` times the paced
    thread's CPU time since its last pause (the time it waited for a core is no work), and never longer than keeps the
    write on schedule to end within ``budget_s`` of its start (its progress is the bytes written of
    ``expected_bytes``): paced writes take longer, and the budget keeps them from running into the next save.

    Args:
        budget_s: Seconds from the start the write should be done within; ``0``: it pauses never (only slices).
        expected_bytes: About how many bytes the write writes (its tensors' bytes).
    """

    def __init__(self, budget_s: float, expected_bytes: int) -> None:
        self._budget_s = budget_s
        self._expected_bytes = max(expected_bytes, 1)
        self._hurried = threading.Event()
        self._started = time.perf_counter()
        self._worked_before = 0.0  # the paced thread's CPU time (time.thread_time) at its last pause
        self._written = 0
        #: Seconds the write paused in all (what pacing added to its duration).
        self.paused_s = 0.0

    @property
    def budget_s(self) -> float:
        """Seconds from the start the write should be done within; ``0``: it pauses never."""
        return self._budget_s

    @property
    def hurried(self) -> bool:
        """Whether the step loop waits for the write (it pauses no more)."""
        return self._hurried.is_set()

    def hurry(self) -> None:
        """The step loop waits for the write now: a pause under way ends, and no other starts."""
        self._hurried.set()

    def start(self) -> None:
        """The paced thread starts its work: its CPU time counts from here (:func:`paced` calls it)."""
        self._worked_before = time.thread_time()

    def pause(self, written: int) -> None:
        """After ``written`` more bytes: pauses as the class says; returns at once once hurried."""
        self._written += written
        worked = time.thread_time() - self._worked_before
        on_schedule = min(1.0, self._written / self._expected_bytes) * self._budget_s
        allowed = min(worked * PAUSE_PER_SECOND_WORKED, on_schedule - (time.perf_counter() - self._started))
        if allowed > 0 and not self._hurried.is_set():
            began = time.perf_counter()
            self._hurried.wait(allowed)
            self.paused_s += time.perf_counter() - began
        self._worked_before = time.thread_time()


class _CurrentPacing(threading.local):
    pacing: Pacing | None = None


_current = _CurrentPacing()


@contextlib.contextmanager
def paced(pacing: Pacing) -> Iterator[None]:
    """Within: the files the calling thread writes through :class:`SlicedFile` pause between slices by ``pacing``."""
    previous, _current.pacing = _current.pacing, pacing
    pacing.start()
    try:
        yield
    finally:
        _current.pacing = previous


def pause_if_paced(written: int) -> None:
    """After the calling thread wrote ``written`` bytes: pauses it when it runs a paced write (:func:`paced`);
    elsewhere returns at once."""
    pacing = _current.pacing
    if pacing is not None:
        pacing.pause(written)


class SlicedFile(io.BufferedWriter):
    """A buffered binary file whose large writes reach the kernel in slices of at most :data:`WRITE_SLICE_BYTES`; in
    a paced write (:func:`paced`) it may pause after each :data:`WRITE_SLICE_BYTES` written. A drop-in for
    ``open(path, "wb")``."""

    def __init__(self, raw: io.RawIOBase) -> None:
        super().__init__(raw)
        self._since_pause = 0  # bytes written since the last pause

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), WRITE_SLICE_BYTES):
            # The buffered file takes it all (it retries the kernel's partial writes).
            self._since_pause += super().write(view[start : start + WRITE_SLICE_BYTES])
            if self._since_pause >= WRITE_SLICE_BYTES:  # not after each of the small writes of a pickle
                pause_if_paced(self._since_pause)
                self._since_pause = 0
        return len(view)


def open_sliced(file: int | str | os.PathLike[str]) -> SlicedFile:
    """``file`` (a path, truncated, or an open file descriptor, closed with the result) as a :class:`SlicedFile`."""
    return SlicedFile(open(file, "wb", buffering=0))
