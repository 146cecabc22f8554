"""Failure handling: when one rank fails, every rank goes down and none waits for the process-group timeout."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed

from .._lightning import _distributed_is_initialized
from .._torch_private import abort_process_group

#: Environment variable that sets the default ``failure_timeout`` (seconds) of every strategy of this package.
FAILURE_TIMEOUT_ENV = "LIGHTNING_STRATEGIES_FAILURE_TIMEOUT"
DEFAULT_FAILURE_TIMEOUT = 10.0


def default_failure_timeout() -> float:
    """``$LIGHTNING_STRATEGIES_FAILURE_TIMEOUT`` in seconds if set, else 10.

    Raises:
        ValueError: The variable is set but not a positive number.
    """
    text = os.environ.get(FAILURE_TIMEOUT_ENV)
    if text is None:
        return DEFAULT_FAILURE_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{FAILURE_TIMEOUT_ENV}={text!r} must be a positive number of seconds, e.g. 10.")
    return value


_leaving_at_exit = False


def leave_the_process_group_at_exit() -> None:
    """Destroys the default process group when the interpreter exits, before C++ statics are torn down.

    A process that ends with its gloo process group alive (a spawned worker, or the user's script after ``fit``)
    aborted now and then at exit ("terminate called without an active exception", SIGABRT): the group's threads
    were still joinable when their objects were destroyed. Leaving the group from ``atexit`` joins them in order.
    """
    global _leaving_at_exit
    if _leaving_at_exit:
        return
    _leaving_at_exit = True

    def leave() -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    atexit.register(leave)


def leave_the_process_group_now() -> None:
    """Leaves the default process group at once, so that no later collective of this process can wait on a peer.

    Once this process has left, every peer's pending or next collective fails ("Connection closed by peer").
    """
    if not _distributed_is_initialized():
        return
    if torch.distributed.get_backend() == "nccl":
        # NCCL's graceful shutdown waits for the pending collective, which a dead peer never joins.
        abort_process_group()
    else:
        torch.distributed.destroy_process_group()


def stop_started_ranks(children: Sequence[subprocess.Popen[Any]], timeout: float, owner: str) -> None:
    """Waits up to ``timeout`` seconds in all for the ranks this process started, then kills those still running.

    Args:
        children: The processes of local ranks 1, 2, ... in order.
        timeout: Seconds to wait for all of them together.
        owner: Who started them, for the message printed before a kill.
    """
    deadline = time.monotonic() + timeout
    for local_rank, child in enumerate(children, start=1):
        try:
            child.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            print(
                f"[{owner}] local rank {local_rank} (pid {child.pid}) did not end within failure_timeout={timeout:g} s"
                " after this run failed; killing it.",
                file=sys.stderr,
                flush=True,
            )
            child.kill()
            child.wait()
