"""The CPU priority of the background thread of asynchronous saves.

The steps slow down beside a background write because the write competes with the ranks for the cores, not because of
its own CPU time: on 2 cores with 2 ranks, a 50 MB ``torch.save`` takes about 40 ms of CPU, yet the steps beside it lost
several times that (docs/benchmarks.md, "Asynchronous saves"). A thread of the training process competes as much as a
separate process at the same priority does, so the thread stays and runs at a lower priority instead (Linux schedules
threads on their own: a niced thread yields its core to the ranks). When the step loop waits for the write (the next
save, the end of training), the write is the only thing left to do, and its thread gets the training thread's priority
back, where the system lets a process raise a thread's priority again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

#: Nice value added to the background thread: about a tenth of a core's time when a rank wants the core (the kernel's
#: weights for nice 0 and 10 are 1024 and 110), all of it when the core is idle.
BACKGROUND_NICENESS = 10


def _per_thread() -> bool:
    # Elsewhere setpriority(PRIO_PROCESS, id) would renice the whole process, the training thread with it.
    return sys.platform.startswith("linux")


def lower_this_thread() -> int | None:
    """Lowers the calling (background) thread's priority by :data:`BACKGROUND_NICENESS`.

    Returns:
        The thread's native id, for :func:`restore`; ``None`` where nothing was changed (not Linux, or refused).
    """
    if not _per_thread():
        return None
    native_id = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, native_id, os.getpriority(os.PRIO_PROCESS, native_id) + BACKGROUND_NICENESS)
    except OSError as error:  # a sandbox that forbids it: the write runs at the training thread's priority
        log.debug("Could not lower the priority of the background write: %s", error)
        return None
    return native_id


def restore(native_id: int | None) -> None:
    """Gives the thread ``native_id`` (lowered by :func:`lower_this_thread`) the calling thread's priority: the step
    loop waits for it now. Where raising a priority again is not permitted (no ``CAP_SYS_NICE``, ``RLIMIT_NICE``), the
    thread goes on at its low priority and finishes in the cores' idle time."""
    if native_id is None:
        return
    with contextlib.suppress(OSError):  # not permitted, or the thread has just ended
        os.setpriority(os.PRIO_PROCESS, native_id, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
