"""Training state around the weights: what a resume needs besides the model, and what to do when it is missing.

Two situations share this module. After a fit with a fork or spawn launcher, the main process holds the training
state of the end of fit (handed back by the workers) and completes its own saves with it. And a checkpoint that holds
no optimizer state at all (a ``ModelCheckpoint(save_weights_only=True)`` file, or a save from a main process that had
only the weights) resumes the weights and the training progress, with one warning naming what starts fresh.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn

#: Keys that Lightning's checkpoint dump reads from the Trainer's state (as opposed to the model): the loops and the
#: counters derived from them. A weights-only dump holds these too.
PROGRESS_KEYS = ("epoch", "global_step", "loops")


def complete_with_end_of_fit_state(checkpoint: dict[str, Any], end_of_fit: Mapping[str, Any]) -> dict[str, Any]:
    """A main process's checkpoint completed with the training state handed back at the end of a fit.

    The main process dumps its own weights (the trained ones) but stale training state: no optimizers, loops that
    never ran, callbacks that never saw a step. The end-of-fit entries replace them. A full dump (one with
    ``optimizer_states``) takes every end-of-fit entry; a weights-only dump takes only the entries it holds itself
    (the progress counters), so it stays weights-only.

    Args:
        checkpoint: What ``Trainer.save_checkpoint`` dumped in the main process.
        end_of_fit: What global rank 0 dumped at the end of fit, without its ``state_dict``.

    Returns:
        A new dict; ``checkpoint`` is not changed.
    """
    if "optimizer_states" in checkpoint:
        return {**checkpoint, **end_of_fit}
    return {**checkpoint, **{key: value for key, value in end_of_fit.items() if key in checkpoint}}


def holds_optimizer_state(checkpoint: Mapping[str, Any]) -> bool:
    """Whether ``checkpoint`` holds any optimizer state: an ``optimizer_states`` entry that is not an empty list."""
    states = checkpoint.get("optimizer_states")
    return not (states is None or (isinstance(states, Sequence) and len(states) == 0))


def missing_training_state(
    checkpoint: Mapping[str, Any], num_optimizers: int, scheduler_names: Sequence[str]
) -> list[str]:
    """What a fit cannot restore from a checkpoint that holds no optimizer state; ``[]`` when nothing is missing.

    Args:
        checkpoint: The loaded checkpoint.
        num_optimizers: How many optimizers the run has.
        scheduler_names: Class names of the run's LR schedulers.
    """
    if holds_optimizer_state(checkpoint) or num_optimizers == 0:
        return []
    missing = [f"the state of the {num_optimizers} optimizer(s)"]
    if scheduler_names and not checkpoint.get("lr_schedulers"):
        missing.append(f"the state of LR scheduler(s) {', '.join(scheduler_names)}")
    if "callbacks" not in checkpoint:
        missing.append("the callbacks' state")
    return missing


def missing_optimizer_state_warning(checkpoint: Mapping[str, Any], missing: Sequence[str], source: str) -> str:
    """The one warning a resume without optimizer state gives: what is restored, what is not, what starts fresh."""
    progress = (
        f"training progress (epoch {checkpoint['epoch']}, global step {checkpoint['global_step']})"
        if "loops" in checkpoint and "epoch" in checkpoint and "global_step" in checkpoint
        else "no training progress (the loops start at zero)"
    )
    return (
        f"{source} holds no optimizer state (written with ModelCheckpoint(save_weights_only=True), with"
        " trainer.save_checkpoint(path, weights_only=True), or by a process that only had the weights)."
        f" Restored: the model weights and {progress}. Not restored: {'; '.join(missing)}."
        " The optimizer starts fresh, so training does not continue the original run exactly; resume from a"
        " complete checkpoint for that."
    )


def resume_without_optimizer_state(
    checkpoint: Mapping[str, Any], num_optimizers: int, scheduler_names: Sequence[str], source: str
) -> None:
    """Prepares a fit's resume from a checkpoint without optimizer state: one warning (rank 0), then, in place, empty
    lists for the missing optimizer and LR-scheduler states.

    Lightning refuses to resume a checkpoint that lacks the ``optimizer_states`` or ``lr_schedulers`` entry with a
    ``KeyError`` after the weights were loaded; with empty lists it restores the rest and leaves the optimizers and
    schedulers as they were built.

    Args:
        checkpoint: The loaded checkpoint; given the missing entries in place.
        num_optimizers: How many optimizers the run has.
        scheduler_names: Class names of the run's LR schedulers.
        source: How to name the checkpoint in the warning.
    """
    missing = missing_training_state(checkpoint, num_optimizers, scheduler_names)
    if missing:
        rank_zero_warn(missing_optimizer_state_warning(checkpoint, missing, source))
    if isinstance(checkpoint, MutableMapping):  # Lightning passes its own dict of the loaded checkpoint
        checkpoint.setdefault("optimizer_states", [])
        checkpoint.setdefault("lr_schedulers", [])
