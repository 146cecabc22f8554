"""Comparing and capturing model state in checks: shared by the conformance kit, the matrix and the demo."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from .._lightning import pl


class SaveAfterRestore(pl.Callback):
    """Saves a checkpoint right after a resumed run restored its state, before its first step.

    Comparing that file with the checkpoint the run resumed from shows exactly what the restore carried over.

    Args:
        path: Where to save.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def max_state_difference(left: Mapping[str, Any], right: Mapping[str, Any]) -> tuple[float, str]:
    """Largest absolute difference over the tensors of two states, and where; infinite where keys or shapes differ.

    Args:
        left: A state dict (DTensor values are compared by their full value).
        right: Another state dict.

    Returns:
        The largest difference and the key it was found at (or what differs).
    """
    if set(left) != set(right):
        differing = sorted(set(left) ^ set(right))
        return float("inf"), f"keys only on one side: {differing[:3]}"
    worst, worst_key = 0.0, ""
    for key, value in left.items():
        other = right[key]
        if not isinstance(value, Tensor) or not isinstance(other, Tensor):
            continue
        # A module that stays sharded after an in-process run (FSDP2) holds DTensors: compare their full values.
        value, other = (getattr(t, "full_tensor", lambda t=t: t)() for t in (value, other))
        if value.shape != other.shape:
            return float("inf"), f"{key} (shapes {tuple(value.shape)} and {tuple(other.shape)})"
        difference = float((value.double() - other.double()).abs().max()) if value.numel() else 0.0
        if difference > worst:
            worst, worst_key = difference, key
    return worst, worst_key
