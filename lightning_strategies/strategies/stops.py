"""Saving when a run stops: only when every rank stopped at the same point, never by pairing up wrong collectives.

A save gathers or writes sharded state with collectives, which pair up by order. When an exception (or a signal that
Lightning turns into one, ``SIGTERM``) stops every rank at the same point, the next collectives of every rank are the
save's, and the save works as any other. When it stops some ranks only, the others wait in a collective of the step
(a gradient reduction, a ``sync_dist`` log): a save's collective would pair up with theirs and hang or write garbage.

So the ranks first compare where they stopped through the process group's key-value store, which pairs nothing up:
each posts its exception type, global step and collective sequence number, and waits a few seconds for the others'.
Equal records on every rank: the save goes ahead (and the ranks keep their process group, so ``trainer.save_checkpoint``
after ``fit`` raised works too). Otherwise the save is refused at once with :class:`CheckpointRefusedError`, which says
why and names the last complete checkpoint of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed

from .._lightning import REQUEUE_HANDLER_ATTRIBUTE, _distributed_is_initialized, last_saved_checkpoint, signal_connector
from .._torch_private import collectives_run, default_store

#: Seconds a rank that stopped waits for the others to report that they stopped too. Ranks that stop together report
#: within milliseconds (Lightning raises ``SIGTERMException`` on every rank after a barrier); a rank that stopped alone
#: waits this long before it refuses to save, while its peers wait in a collective.
STOP_AGREEMENT_TIMEOUT_S = 5.0
_STORE_PREFIX = "lightning_strategies/stop"


class CheckpointRefusedError(RuntimeError):
    """A checkpoint cannot be written: the run's ranks did not all stop at the same point (or left their process group).

    Raised before any collective and before anything is written: the checkpoints already on disk are unchanged.
    """


@dataclass(frozen=True)
class StopVerdict:
    """Whether every rank stopped at the same point, and if not, why not (for the error message)."""

    together: bool
    reason: str = ""


def _sequence_number() -> int | None:
    """How many collectives this rank has run on the default group (``None`` where the backend does not count)."""
    try:
        return collectives_run()
    except (RuntimeError, AttributeError, ValueError):
        return None


def stop_record(exception: BaseException, global_step: int, between_steps: bool) -> dict[str, Any]:
    """What this rank reports about where it stopped: equal records on every rank mean their collectives line up.

    Args:
        exception: What stopped it.
        global_step: The Trainer's global step.
        between_steps: Whether it stopped outside every ``*_step`` and optimizer step (inside one, sharded parameters
            may be gathered and the optimizer state half updated).
    """
    kind = type(exception)
    name = f"{kind.__module__}.{kind.__qualname__}"
    return {"exception": name, "step": global_step, "collectives": _sequence_number(), "between_steps": between_steps}


def _describe(rank: int, record: dict[str, Any]) -> str:
    name = str(record.get("exception", "?")).rsplit(".", 1)[-1]
    step, collectives = record.get("step"), record.get("collectives")
    where = "between steps" if record.get("between_steps") else "inside a step"
    return f"rank {rank} stopped with {name} {where} at global step {step} after {collectives} collectives"


def agree_on_stop(record: dict[str, Any], episode: int, timeout: float = STOP_AGREEMENT_TIMEOUT_S) -> StopVerdict:
    """Compares ``record`` with every other rank's through the store (no collective); waits up to ``timeout`` seconds.

    Args:
        record: This rank's :func:`stop_record`.
        episode: How many stops this process handled before (the same on ranks that stop together).
        timeout: Seconds to wait for the other ranks' records.
    """
    if not _distributed_is_initialized():
        return StopVerdict(False, "this process is not in the run's process group any more")
    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if world_size < 2:
        return StopVerdict(True)
    prefix = f"{_STORE_PREFIX}/{episode}/"
    keys = [f"{prefix}{peer}" for peer in range(world_size)]
    try:
        store = default_store()
        store.set(keys[rank], json.dumps(record))
    except Exception as error:  # the store's host (rank 0) is gone
        return StopVerdict(False, f"the other ranks cannot be reached ({type(error).__name__}: {error})")
    done = [f"{prefix}done/{peer}" for peer in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:  # a timeout: some ranks did not stop
        missing = _missing(store, keys)
        _set_quietly(store, done[rank])  # decided: rank 0 need not wait for this rank to read
        return StopVerdict(
            False,
            f"rank {rank} stopped ({_describe(rank, record)}), but rank(s) {missing} did not stop within {timeout:g} s:"
            " they are still running (waiting in a collective of the step, or computing), so the exception happened"
            " on some ranks only",
        )
    try:
        records = [json.loads(store.get(key)) for key in keys]
        store.set(done[rank], "1")
        if rank == 0:  # rank 0 hosts the store: it stays until every rank decided, so that all reach one verdict
            store.wait(done, timedelta(seconds=timeout))
    except Exception as error:
        return StopVerdict(False, f"the other ranks cannot be reached ({type(error).__name__}: {error})")
    if all(other == records[0] for other in records):
        if records[0].get("between_steps"):
            return StopVerdict(True)
        return StopVerdict(
            False,
            f"every rank stopped inside a step ({_describe(rank, record)}): the sharded parameters may be gathered and"
            " the optimizer state half updated there, so no consistent checkpoint exists (a SIGTERM stops every rank"
            " between steps instead)",
        )
    return StopVerdict(
        False,
        "the ranks stopped at different points: "
        + "; ".join(_describe(peer, other) for peer, other in enumerate(records)),
    )


def _set_quietly(store: Any, key: str) -> None:
    with contextlib.suppress(Exception):  # the store's host is gone: nobody waits for the key
        store.set(key, "1")


def _missing(store: Any, keys: Sequence[str]) -> list[int]:
    missing = []
    for peer, key in enumerate(keys):
        try:
            if not store.check([key]):
                missing.append(peer)
        except Exception:
            missing.append(peer)
    return missing


def refusal_message(reason: str, last_checkpoints: Sequence[str], where: str | None = None) -> str:
    """The :class:`CheckpointRefusedError` message: why nothing can be written, and where the last checkpoint is
    (``where`` says it instead of ``last_checkpoints`` when given)."""
    if where is None and last_checkpoints:
        where = f"The last complete checkpoint of this run is {last_checkpoints[0]!r}: resume from it."
        if len(last_checkpoints) > 1:
            where += f" (Others: {', '.join(repr(path) for path in last_checkpoints[1:])}.)"
    elif where is None:
        where = "This run has no complete checkpoint: it wrote none and resumed from none."
    return (
        f"Cannot save a checkpoint: {reason}. A save needs every rank at the same point (it gathers or writes the"
        f" sharded state with collectives, which would hang or pair up wrongly), so nothing was written and the"
        f" checkpoints on disk are unchanged. {where}"
    )


def last_checkpoints(trainer: Any) -> list[str]:
    """The complete checkpoints this run knows of, the most recent first: what its checkpoint callbacks saved last and
    best, then the checkpoint it resumed from (those that exist)."""
    candidates: list[str] = []
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        candidates.append(last_saved_checkpoint(callback))
        for attribute in ("last_model_path", "best_model_path"):
            candidates.append(str(getattr(callback, attribute, "") or ""))
    candidates.append(str(getattr(trainer, "ckpt_path", "") or ""))
    found: list[str] = []
    for path in candidates:
        if path and path not in found and os.path.exists(path):
            found.append(path)
    return found


class RequeueAtStepBoundary:
    """Makes SLURM's requeue signal (``SLURMEnvironment(auto_requeue=True)``) save at the next training batch's start.

    Lightning saves the checkpoint inside the signal handler, wherever each rank is then: in a forward, a backward, a
    gradient reduction. A sharded save's collectives would pair up with those of the step on the other ranks. Here the
    handler only notes the signal; at the start of each training batch the ranks compare notes (one all-reduce of one
    number, only while auto-requeue is on), and when any rank got the signal every rank runs Lightning's handler there:
    the checkpoint is saved between steps, then rank 0 requeues the job.
    """

    _ATTRIBUTE = REQUEUE_HANDLER_ATTRIBUTE

    def __init__(self) -> None:
        self._handler: Any = None
        self._connector: Any = None
        self._signal = 0

    def install(self, trainer: Any, enabled: bool) -> None:
        """Takes the place of Lightning's requeue handler for ``trainer``'s run (before it registers its handlers)."""
        connector = signal_connector(trainer)
        handler = getattr(connector, self._ATTRIBUTE, None)
        if not enabled or handler is None or self._ATTRIBUTE in vars(connector):
            return
        self._handler, self._connector, self._signal = handler, connector, 0
        vars(connector)[self._ATTRIBUTE] = self._note

    def _note(self, signum: int, frame: Any) -> None:
        self._signal = int(signum)

    def at_step_boundary(self, device: torch.device) -> None:
        """Runs Lightning's requeue handler on every rank when any rank got the signal (a collective, if installed)."""
        if self._handler is None or not _distributed_is_initialized():
            return
        received = torch.tensor([self._signal], device=device)
        torch.distributed.all_reduce(received, op=torch.distributed.ReduceOp.MAX)
        signum = int(received.item())
        if signum:
            self._signal = 0
            self._handler(signum, None)

    def remove(self) -> None:
        """Gives Lightning's handler back (the run ended)."""
        if self._connector is not None:
            vars(self._connector).pop(self._ATTRIBUTE, None)
        self._handler, self._connector, self._signal = None, None, 0
