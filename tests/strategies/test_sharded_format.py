"""What a strategy's ShardedFormat must implement: the three save methods; the six restore methods only when it reads
its own directories in place (the worked example, docs/examples/zero1_strategy.py, is a write-only format whose
directories are consolidated: tests/strategies/test_worked_example_zero1.py resumes them)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from torch.optim import Optimizer

from lightning_strategies.strategies.sharded_format import ShardedFormat


class WriteOnly(ShardedFormat):
    def model_state(self) -> dict[str, Any]:
        return {}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}

    def write(self, checkpoint: Mapping[str, Any], directory: Path, staging: Path, save_id: str) -> None:
        pass


class ClaimsToReadInPlace(WriteOnly):
    def reads_in_place(self, sharded: Any) -> bool:
        return True


def test_a_format_with_only_the_save_methods_is_write_only() -> None:
    assert WriteOnly().reads_in_place(object()) is False  # type: ignore[arg-type]


def test_a_format_that_reads_in_place_without_open_names_the_method_and_the_fix() -> None:
    with pytest.raises(NotImplementedError, match=r"ClaimsToReadInPlace.reads_in_place\(\) returned True but open\(\)"):
        ClaimsToReadInPlace().open(object())  # type: ignore[arg-type]


def test_a_format_without_the_save_methods_cannot_be_made() -> None:
    class NoWrite(ShardedFormat):
        def model_state(self) -> dict[str, Any]:
            return {}

        def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
            return {}

    with pytest.raises(TypeError, match="write"):
        NoWrite()  # type: ignore[abstract]
