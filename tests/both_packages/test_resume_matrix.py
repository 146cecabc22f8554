"""Every strategy resumes every other strategy's checkpoint: the matrix, world-size changes, a broken variant."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import MATRIX_PROPERTY
from tests.support.flavour import matrix as matrix_module
from tests.support.naive_strategies import NaiveShardedStrategy

MatrixStrategy, default_strategies, run_matrix = (
    matrix_module.MatrixStrategy,
    matrix_module.default_strategies,
    matrix_module.run_matrix,
)


# Under `lightning` the Adam matrix shows every strategy of the binding resumes every other; the SGD, bf16 and 2 -> 3
# matrices vary what the strategies do, not the package they run under.
@pytest.mark.parametrize("optimizer", ["adam", pytest.param("sgd", marks=pytest.mark.flavour_independent)])
def test_every_strategy_resumes_every_strategys_checkpoint(
    tmp_path: Path, record_property: Callable[[str, object], None], optimizer: str
) -> None:
    matrix = run_matrix(default_strategies(), tmp_path, optimizer=optimizer)
    record_property(MATRIX_PROPERTY, f"{matrix.table()}\n({len(matrix.cells)} cells in {matrix.seconds:.1f} s)")

    assert len(matrix.cells) == 25
    assert not matrix.failures, matrix.table()


@pytest.mark.flavour_independent
def test_bf16_mixed_precision_checkpoints_cross_between_strategies(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    strategies = [
        dataclasses.replace(strategy, label=f"{strategy.label} bf16", precision="bf16-mixed")
        for strategy in default_strategies()
        if strategy.label in ("single_device", "ddp", "ddp_sharded", "fsdp_fairscale", "fsdp2")
    ]
    matrix = run_matrix(strategies, tmp_path)
    record_property(MATRIX_PROPERTY, matrix.table())

    assert not matrix.failures, matrix.table()


@pytest.mark.flavour_independent
def test_full_checkpoints_move_from_two_processes_to_three(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    ours = [
        strategy for strategy in default_strategies() if strategy.label in ("ddp_sharded", "fsdp_fairscale", "fsdp2")
    ]
    three = [MatrixStrategy(f"{strategy.label} x3", strategy.factory, devices=3) for strategy in ours]
    matrix = run_matrix(three, tmp_path, rows=ours)
    record_property(MATRIX_PROPERTY, matrix.table())

    assert len(matrix.cells) == 9
    assert not matrix.failures, matrix.table()


def test_a_strategy_that_saves_wrong_state_fails_the_matrix_naming_the_cell(tmp_path: Path) -> None:
    naive = MatrixStrategy("naive_sharded", lambda: NaiveShardedStrategy(start_method="fork"))
    columns = [strategy for strategy in default_strategies() if strategy.label in ("ddp", "fsdp2")]
    matrix = run_matrix(columns, tmp_path, rows=[naive])

    failed = {(cell.saved_by, cell.resumed_by) for cell in matrix.failures}
    assert {("naive_sharded", "ddp"), ("naive_sharded", "fsdp2"), ("naive_sharded", "(plain load)")} <= failed
    table = matrix.table()
    assert "| naive_sharded | FAIL: resume raised" in table
    assert "module." in table  # the wrapper prefix that leaked into the keys is named
