"""Rank agreement: the processes of one run compare what they were given before they run collectives on it.

A rank that wraps, resumes or saves differently from its peers pairs its collectives with theirs wrongly and waits
for ever; comparing first turns that deadlock into a :class:`RanksDisagreeError` on every rank.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed

from lightning_strategies.checkpoint.errors import CheckpointError, CheckpointFormatError, StoreError
from lightning_strategies.checkpoint.targets import SaveRefusal, refusal_error

from .._lightning import _PATH, _distributed_is_initialized, checkpoint_connector, pl


class RanksDisagreeError(RuntimeError):
    """The processes of one run were given different settings (strategy options, checkpoint paths).

    Raised on every rank, before the disagreement could pair up mismatched collectives (a deadlock).
    """


# Attributes that hold run state, not options: they may differ between processes without harm.
RUN_STATE_ATTRIBUTES = frozenset(
    {
        "_checkpoint_source",
        "_failure_timeout",
        "_failed",
        "_sharded_reader",  # the format restoring a sharded directory (each rank reads its own rank file)
        "_stop_verdict",
        "_inside_steps",
        "_stops",
        "_async_saves",  # the pending asynchronous save
        "_store_downloads",  # local copies of a stored save being restored
        "_resumed_store_save",
    }
)


class _NoValue:
    """Marks an object that has no value two processes could compare (a module, a process group, a plugin)."""


NO_VALUE: Any = _NoValue()


def comparable_value(value: Any, depth: int = 0) -> Any:
    """``value`` as plain data that two ranks with equal options compute alike; :data:`NO_VALUE` when it has none."""
    if value is None or isinstance(value, bool | int | float | str | timedelta):
        return value
    if depth > 8:
        return NO_VALUE
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    parts: list[tuple[str, Any]]
    if dataclasses.is_dataclass(value):
        parts = [(field.name, getattr(value, field.name)) for field in dataclasses.fields(value)]
        parts.insert(0, ("type", type(value).__qualname__))
    elif isinstance(value, Mapping):
        parts = sorted(((str(key), item) for key, item in value.items()), key=lambda pair: pair[0])
    elif isinstance(value, list | tuple | set | frozenset):
        items = [comparable_value(item, depth + 1) for item in value]
        if any(item is NO_VALUE for item in items):
            return NO_VALUE
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    else:
        return NO_VALUE
    converted = {key: comparable_value(item, depth + 1) for key, item in parts}
    return NO_VALUE if any(item is NO_VALUE for item in converted.values()) else converted


def options_fingerprint(strategy: Any, precision_plugin: Any) -> dict[str, Any]:
    """The class of ``strategy`` and every attribute of it that has a value to compare, plus its precision plugin."""
    options: dict[str, Any] = {"class": f"{type(strategy).__module__}.{type(strategy).__qualname__}"}
    for name, value in sorted(vars(strategy).items()):
        if name in RUN_STATE_ATTRIBUTES:
            continue
        comparable = comparable_value(value)
        if comparable is not NO_VALUE:
            options[name.lstrip("_")] = comparable
    options["precision"] = type(precision_plugin).__qualname__
    return options


def _gather_from_every_rank(value: Any) -> list[Any] | None:
    """Every rank's ``value`` in rank order (a collective); ``None`` when this process runs alone."""
    if not _distributed_is_initialized() or torch.distributed.get_world_size() < 2:
        return None
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, value)
    return everyone


def every_rank(value: Any) -> list[Any]:
    """Every rank's ``value`` in rank order (a collective); ``[value]`` when this process runs alone."""
    everyone = _gather_from_every_rank(value)
    return [value] if everyone is None else everyone


def this_rank() -> int:
    """The rank of this process in the default process group; 0 when it runs alone."""
    return torch.distributed.get_rank() if _distributed_is_initialized() else 0


def require_agreement(values: Mapping[str, Any], what: str, fix: str) -> None:
    """What ``DirectReferenceStrategy.require_agreement`` does (see there), for the default process group.

    Raises:
        RanksDisagreeError: On every rank, naming each value that differs from rank 0's and the ranks involved.
    """
    everyone = _gather_from_every_rank(dict(values))
    if everyone is not None:
        _require_same(everyone, what, fix)


def _require_same(everyone: list[dict[str, Any]], what: str, fix: str) -> None:
    """Raises :class:`RanksDisagreeError` (on every rank: each holds ``everyone``) unless all equal rank 0's."""
    reference: dict[str, Any] = everyone[0]
    differences = [
        f"{key}: rank 0 has {reference.get(key)!r}, rank {rank} has {theirs.get(key)!r}"
        for rank, theirs in enumerate(everyone)
        for key in sorted(set(reference) | set(theirs))
        if theirs.get(key) != reference.get(key)
    ]
    if differences:
        raise RanksDisagreeError(
            f"The processes of this run disagree on {what}, so they cannot work together; nothing was done."
            f"\n  " + "\n  ".join(differences[:10]) + f"\nEvery process must get the same values: {fix}."
        )


_SAVE_PATH = "where to save the checkpoint"
_SAVE_PATH_FIX = (
    "call trainer.save_checkpoint(path) with the same path on every rank (compute it on rank 0 and"
    " broadcast it with trainer.strategy.broadcast(path))"
)


def _refuse_as_rank_zero(everyone: list[dict[str, Any]]) -> None:
    """Raises rank 0's refusal of the save's path on every rank (each holds ``everyone``); else returns."""
    refusal = everyone[0].get("refusal")
    if refusal is not None:
        raise refusal_error(refusal)


def require_same_save_path(filepath: _PATH, refusal: SaveRefusal | None = None) -> None:
    """Checks that every rank saves to ``filepath`` (a collective): a rank's different path would be ignored.

    Args:
        filepath: This rank's path.
        refusal: On the rank that writes (rank 0): why the path must not be replaced
            (:func:`~lightning_strategies.checkpoint.targets.replace_problem`); raised on every rank.

    Raises:
        RanksDisagreeError: The ranks save to different paths.
        ForeignPathError: Rank 0 refused the path (it holds a user's files); nothing was written.
        StoreError: Rank 0 could not reach the store of a URL (no such bucket, credentials refused); nothing was
            written.
    """
    everyone = _gather_from_every_rank({"filepath": str(filepath), "refusal": refusal})
    if everyone is None:
        everyone = [{"refusal": refusal}]
    else:
        _require_same([{"filepath": values["filepath"]} for values in everyone], _SAVE_PATH, _SAVE_PATH_FIX)
    _refuse_as_rank_zero(everyone)


def agree_on_sharded_save(directory: _PATH, proposed_id: str, refusal: SaveRefusal | None = None) -> str:
    """:func:`require_same_save_path` for ``directory`` that also returns rank 0's ``proposed_id`` on every rank: the
    id of a sharded save (one all-gather, a collective).

    Raises:
        RanksDisagreeError: The ranks save to different directories.
        ForeignPathError: Rank 0 refused the directory (``refusal``); nothing was written.
        StoreError: Rank 0 could not reach the store of a URL (no such bucket, credentials refused); nothing was
            written.
    """
    everyone = _gather_from_every_rank({"filepath": str(directory), "save_id": proposed_id, "refusal": refusal})
    if everyone is None:
        _refuse_as_rank_zero([{"refusal": refusal}])
        return proposed_id
    _require_same([{"filepath": values["filepath"]} for values in everyone], _SAVE_PATH, _SAVE_PATH_FIX)
    _refuse_as_rank_zero(everyone)
    return str(everyone[0]["save_id"])


def agree_on_resume_path(
    trainer: pl.Trainer,
    require: Callable[[Mapping[str, Any], str, str], None],
    then: Callable[[str | None], None] | None = None,
) -> None:
    """Makes ``trainer`` check, on every rank, that all ranks resume from the same ``ckpt_path`` (or none).

    The check runs once, at the Trainer's next restore; :func:`forget_resume_path_check` undoes an unused one. ``then``
    is called with the agreed path (``None``: nothing is restored) before the restore starts.
    """
    connector = checkpoint_connector(trainer)
    resume_start = getattr(connector, "resume_start", None)
    if connector is None or resume_start is None or "resume_start" in vars(connector):
        return

    # The Trainer starts every restore (with a path or None) here on all ranks right after setup; a rank that
    # resumes while another starts afresh would otherwise wait in the load's collectives for ever.
    def agreeing_resume_start(checkpoint_path: _PATH | None = None, *args: Any, **kwargs: Any) -> Any:
        del vars(connector)["resume_start"]
        path = None if checkpoint_path is None else str(checkpoint_path)
        require({"ckpt_path": path}, "the checkpoint to resume from", "pass the same ckpt_path to fit() on every rank")
        if then is not None:
            then(path)
        return resume_start(checkpoint_path, *args, **kwargs)

    vars(connector)["resume_start"] = agreeing_resume_start


def forget_resume_path_check(trainer: pl.Trainer) -> None:
    """Removes the check :func:`agree_on_resume_path` installed, when the run ended before the Trainer restored."""
    connector = checkpoint_connector(trainer)
    if connector is not None:
        vars(connector).pop("resume_start", None)


def refuse_unless_every_rank_fits(problem: CheckpointError | None) -> None:
    """Raises on every rank when the sharded state of any rank does not fit (a collective: all ranks call it).

    Each rank validates its own shard; they agree before any of them loads, so a bad shard on one rank leaves the
    weights of every rank untouched.

    Args:
        problem: What is wrong with this rank's shard, or ``None`` when it fits.

    Raises:
        CheckpointError: This rank's ``problem``, or a :class:`CheckpointFormatError` naming the first rank that
            refused its shard.
    """
    everyone = _gather_from_every_rank(None if problem is None else str(problem))
    failed = [(rank, text) for rank, text in enumerate(everyone or []) if text is not None]
    if problem is None and failed:
        rank, text = failed[0]
        raise CheckpointFormatError(f"Rank {rank} refused its shard; nothing was loaded. {text}")
    if problem is not None:
        raise problem


def gather_uploads(uploaded: Mapping[str, int] | str) -> dict[str, int]:
    """Every rank's part of a save uploaded to a store: the files and sizes of all ranks, merged (a collective).

    Args:
        uploaded: This rank's uploaded files and their sizes, or why its upload failed.

    Raises:
        StoreError: On every rank, naming each rank whose upload failed (the save is left uncommitted).
    """
    everyone = _gather_from_every_rank(uploaded if isinstance(uploaded, str) else dict(uploaded))
    parts = [uploaded] if everyone is None else everyone
    failures = [f"rank {rank}: {part}" for rank, part in enumerate(parts) if isinstance(part, str)]
    if failures:
        raise StoreError("A save's upload failed, so it was not committed:\n  " + "\n  ".join(failures[:8]))
    return {name: size for part in parts if isinstance(part, Mapping) for name, size in part.items()}
