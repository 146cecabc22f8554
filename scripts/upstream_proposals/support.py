"""What the upstream-style tests share: a Trainer as Lightning's tests build it, on two CPU ranks (gloo).

Upstream runs such tests with ``@RunIf(standalone=True)`` (each test its own ``torchrun``-like launch); here each rank
is a fork of the test process with ``RANK``/``WORLD_SIZE`` set (``tests/support/ranks.py``), which upstream's
``ModelParallelStrategy`` and ``FSDPStrategy`` take as ranks started from outside.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytorch_lightning as pl

from tests.support.ranks import run_as_ranks

T = TypeVar("T")


def on_two_ranks(function: Callable[[], T]) -> list[T]:
    """``function`` on two forked CPU ranks; what each returned, in rank order (a rank's error is raised)."""
    return run_as_ranks(function)


def trainer(strategy: Any, root: Path, **overrides: Any) -> pl.Trainer:
    """``Trainer(accelerator="cpu", devices=2, strategy=...)`` for two short epochs, nothing printed or logged."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": strategy,
        "default_root_dir": root,
        "max_epochs": 1,
        "limit_train_batches": 2,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    options.update(overrides)
    return pl.Trainer(**options)
