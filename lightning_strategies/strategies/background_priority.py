"""The CPU priority of the threads that do the background work of asynchronous saves.

The steps slow down beside a background write because the write's threads compete with the ranks for the cores, not
because of their own CPU time: on 2 cores with 2 ranks, a 50 MB ``torch.save`` takes about 40 ms of CPU, yet the steps
beside it lost several times that (docs/benchmarks.md, "Asynchronous saves"). So on Linux, where threads are scheduled
on their own, every thread that works for a background write runs under ``SCHED_IDLE``: it gets a core only while no
thread of normal priority wants it, and a rank that wakes up (a collective returned, a batch arrived) takes the core
back at once. A *nice* value is not enough: under the kernel's fair scheduler a thread at nice +10 keeps its core for
the rest of its time slice when a rank wakes, and a rank's step wakes up many times (every collective).

A thread under ``SCHED_IDLE`` that holds the GIL when a rank wakes keeps it until the rank's thread asks for it, which
the interpreter does only after its switch interval (5 ms by default): a rank wakes at every collective of its step, and
DCP plans a sharded save in Python. While a background write runs the interval is therefore shorter
(:func:`quick_gil_handoffs`), so the step loop gets the GIL back within :data:`BACKGROUND_SWITCH_INTERVAL_S`.

Two kinds of thread work for a write: the one that runs it (lowered by itself, :func:`lower_this_thread`), and the
threads of the gloo group the writes' collectives run on — gloo moves the bytes of every transfer on threads of its own,
which the group's creation starts (:func:`threads_started_by`, :func:`lower`). When the step loop waits for the write
(the next save, the end of training), the write is all that is left to do and its threads get the training thread's
priority back (:func:`restore`), where the system permits raising a priority (as root, with ``CAP_SYS_NICE``, or within
``RLIMIT_NICE``); elsewhere they finish in the cores' idle time, which is then all the time the step loop leaves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import TypeVar

log = logging.getLogger(__name__)

#: Nice value added where ``SCHED_IDLE`` is refused (about a tenth of a core when a rank wants the core: the kernel's
#: weights for nice 0 and 10 are 1024 and 110).
BACKGROUND_NICENESS = 10

#: The interpreter's switch interval while a background write runs (``sys.setswitchinterval``; 5 ms by default).
BACKGROUND_SWITCH_INTERVAL_S = 0.0005

Started = TypeVar("Started")


class _SwitchInterval:
    lock = threading.Lock()
    writers = 0  # background writes running in this process (one per strategy at most)
    previous = 0.0  # the interval before the first of them started


def _per_thread() -> bool:
    # Elsewhere the calls below would change the whole process, the training thread with it.
    return sys.platform.startswith("linux")


def _lower(native_id: int) -> bool:
    try:
        os.sched_setscheduler(native_id, os.SCHED_IDLE, os.sched_param(0))
        return True
    except OSError as idle_refused:
        try:
            niceness = os.getpriority(os.PRIO_PROCESS, native_id) + BACKGROUND_NICENESS
            os.setpriority(os.PRIO_PROCESS, native_id, niceness)
            return True
        except OSError as error:  # a sandbox that forbids both: the write runs at the training thread's priority
            log.debug("Could not lower the priority of thread %d: %s; %s", native_id, idle_refused, error)
            return False


def lower_this_thread() -> int | None:
    """Runs the calling (background) thread under ``SCHED_IDLE`` (at nice +:data:`BACKGROUND_NICENESS` where that is
    refused).

    Returns:
        The thread's native id, for :func:`restore`; ``None`` where nothing was changed (not Linux, or refused).
    """
    if not _per_thread():
        return None
    native_id = threading.get_native_id()
    return native_id if _lower(native_id) else None


def lower(native_ids: Iterable[int]) -> list[int]:
    """Lowers the threads ``native_ids`` of this process as :func:`lower_this_thread` does.

    Returns:
        The ids of the threads that were lowered (a thread that has ended meanwhile is skipped).
    """
    if not _per_thread():
        return []
    return [native_id for native_id in native_ids if _lower(native_id)]


def restore(native_ids: int | Collection[int] | None) -> None:
    """Gives the threads ``native_ids`` (lowered here) the calling thread's scheduling policy and priority: the step
    loop waits for them now. Where raising a priority again is not permitted, they go on at their low priority."""
    if native_ids is None:
        return
    policy = os.sched_getscheduler(0)
    parameters = os.sched_getparam(0)
    niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for native_id in [native_ids] if isinstance(native_ids, int) else native_ids:
        # Each on its own: a thread lowered by niceness alone may get its priority back where its policy call fails.
        with contextlib.suppress(OSError):  # not permitted, or the thread has just ended
            os.sched_setscheduler(native_id, policy, parameters)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, native_id, niceness)


def thread_ids() -> set[int]:
    """The native ids of this process's threads (empty where the system does not list them)."""
    with contextlib.suppress(OSError):
        return {int(name) for name in os.listdir("/proc/self/task")}
    return set()


def threads_started_by(start: Callable[[], Started]) -> tuple[Started, set[int]]:
    """Runs ``start`` (e.g. the creation of a gloo group) and returns its result with the native ids of the threads
    that appeared in this process meanwhile (the calling thread is blocked in ``start``: they are its)."""
    before = thread_ids()
    result = start()
    return result, thread_ids() - before


@contextlib.contextmanager
def quick_gil_handoffs() -> Iterator[None]:
    """Around a background write: the interpreter's switch interval is :data:`BACKGROUND_SWITCH_INTERVAL_S` until the
    last write running in this process ends, then what it was (unless something else changed it meanwhile)."""
    with _SwitchInterval.lock:
        if _SwitchInterval.writers == 0:
            _SwitchInterval.previous = sys.getswitchinterval()
            sys.setswitchinterval(min(_SwitchInterval.previous, BACKGROUND_SWITCH_INTERVAL_S))
        _SwitchInterval.writers += 1
    try:
        yield
    finally:
        with _SwitchInterval.lock:
            _SwitchInterval.writers -= 1
            ours = min(_SwitchInterval.previous, BACKGROUND_SWITCH_INTERVAL_S)
            if _SwitchInterval.writers == 0 and sys.getswitchinterval() == ours:
                sys.setswitchinterval(_SwitchInterval.previous)
