"""Failure handling: when one rank fails, every rank goes down and none waits for the process-group timeout.

:class:`FailureHandling` is the strategy's side of it (``DirectReferenceStrategy`` inherits it): ``on_exception``
leaves the process group unless every rank stopped at the same point (:mod:`.stops` decides), ``failure_timeout``
bounds how long the launching process waits for the ranks it started, and ``require_save_possible`` refuses a save
that cannot be written whole, before any collective.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed
from typing_extensions import override

from .._lightning import ParallelStrategy, _distributed_is_initialized, _SubprocessScriptLauncher, trainer_of
from .._torch_private import abort_process_group
from .launcher import CanonicalStateLauncher
from .stops import CheckpointRefusedError, StopVerdict, agree_on_stop, last_checkpoints, refusal_message, stop_record

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


class FailureHandling(ParallelStrategy):
    """What a strategy does when its run fails or stops: every rank goes down, and a save is written whole or refused.

    Not a strategy of its own: ``DirectReferenceStrategy`` inherits it and keeps the state declared below.
    """

    if TYPE_CHECKING:  # set by DirectReferenceStrategy
        _failure_timeout: float | None
        _failed: bool
        _stop_verdict: StopVerdict | None
        _stops: int
        _inside_steps: int  # > 0 inside a *_step or an optimizer step; stays > 0 when one raised

    @property
    def failure_timeout(self) -> float:
        """Seconds the launching process of a failed run waits for the ranks it started before it kills them.

        Defaults to ``$LIGHTNING_STRATEGIES_FAILURE_TIMEOUT`` or 10. It bounds only the failure path: collectives keep
        the process-group ``timeout`` (long, so a slow gather of a large checkpoint is not mistaken for a failure).
        A rank that waits in a collective with this process is only released when this process ends (gloo keeps the
        connections of a destroyed group open while a wrapper still holds the group), so it is killed then.
        """
        return self._failure_timeout if self._failure_timeout is not None else default_failure_timeout()

    @failure_timeout.setter
    def failure_timeout(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"failure_timeout must be a positive number of seconds, got {seconds!r}.")
        self._failure_timeout = seconds

    @property
    def failed(self) -> bool:
        """Whether the current run ended with an exception in this process (then teardown runs no collective)."""
        return self._failed

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Leaves the process group at once and stops the ranks this process started.

        A rank that raised must not enter another collective: its peers may wait in a different one, and gloo pairs
        them up wrongly or waits for the whole process-group timeout (the fairscale FSDP teardown gathered parameters
        and hung here). Once this process ends, every peer's pending or next collective fails at once ("Connection
        closed by peer"), so the peers raise and go down too; the ranks this process started (subprocess launcher)
        get ``failure_timeout`` seconds to end on their own and are killed after that.
        """
        super().on_exception(exception)
        if self._stopped_together(exception):
            return  # every rank stopped here: the group stays, and saves and teardown work as after a fit
        self._leave_after_failure()

    def _leave_after_failure(self) -> None:
        if self._failed:
            return
        self._failed = True
        leave_the_process_group_now()
        launcher = self.launcher
        children = list(launcher.procs) if isinstance(launcher, _SubprocessScriptLauncher) else []
        stop_started_ranks(children, self.failure_timeout, owner=type(self).__name__)

    def _stopped_together(self, exception: BaseException) -> bool:
        """Whether every rank stopped with ``exception`` at the same point (see :mod:`.stops`); decided once per run."""
        if self._stop_verdict is None:
            module = self.lightning_module
            trainer = trainer_of(module) if module is not None else None
            step = trainer.global_step if trainer is not None else -1
            record = stop_record(exception, step, between_steps=self._inside_steps == 0)
            self._stop_verdict = agree_on_stop(record, self._stops)
            self._stops += 1
        return self._stop_verdict.together

    def require_save_possible(self) -> None:
        """Refuses a save that cannot be written whole, before any collective (every save starts here).

        After an exception a save goes ahead only when every rank stopped at the same point; otherwise, or when this
        process left the process group, or when it is the launching process of a fork/spawn run whose workers failed
        (it holds none of their state), :class:`~lightning_strategies.strategies.stops.CheckpointRefusedError` says
        why and where the last complete checkpoint is. A refusing rank leaves the process group at once, so that the
        ranks waiting for it in a collective go down instead of hanging.

        Raises:
            CheckpointRefusedError: The save cannot be written; nothing was.
        """
        launcher = self.launcher
        failed_workers = isinstance(launcher, CanonicalStateLauncher) and launcher.workers_failed
        if failed_workers and not _distributed_is_initialized():
            raise CheckpointRefusedError(
                refusal_message(
                    "the run failed in its worker processes, and this launching process holds none of their state (it"
                    " would save the weights it started with)",
                    [],
                    where="Resume from the last checkpoint the workers wrote (their ModelCheckpoint's dirpath).",
                )
            )
        module = self.lightning_module
        trainer = trainer_of(module) if module is not None else None
        if trainer is None or (not trainer.interrupted and not self._failed and self._stop_verdict is None):
            return  # no exception in this run: the common case costs nothing
        reason = ""
        if self._stop_verdict is None and trainer.interrupted and not self._failed:
            exception = sys.exc_info()[1]  # an on_exception hook (OnExceptionCheckpoint) runs inside Lightning's except
            if exception is not None and not self._stopped_together(exception):
                reason = self._stop_verdict.reason if self._stop_verdict is not None else ""
        elif self._stop_verdict is not None and not self._stop_verdict.together:
            reason = self._stop_verdict.reason
        elif self._failed:
            reason = "this process left the run's process group when the run failed"
        if not reason:
            return
        self._leave_after_failure()
        raise CheckpointRefusedError(refusal_message(reason, last_checkpoints(trainer)))
