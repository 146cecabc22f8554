"""The conformance kit passes for strategies that keep the contract and fails, readably, for one that does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.flavour import ours, testing
from tests.support.naive_strategies import NaiveShardedStrategy

ShardedDDPStrategy = ours.ShardedDDPStrategy
ConformanceError, assert_strategy_conforms, check_strategy = (
    testing.ConformanceError,
    testing.assert_strategy_conforms,
    testing.check_strategy,
)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_ddp_sharded_fork_conforms(tmp_path: Path, optimizer: str) -> None:
    assert_strategy_conforms(lambda: "ddp_sharded_fork", tmp_path, optimizer=optimizer)


def test_ddp_sharded_with_gradient_buckets_conforms(tmp_path: Path) -> None:
    assert_strategy_conforms(lambda: ShardedDDPStrategy(start_method="fork", reduce_buffer_size=2**20), tmp_path)


def test_upstream_ddp_fork_conforms(tmp_path: Path) -> None:
    assert_strategy_conforms(lambda: "ddp_fork", tmp_path)


def test_upstream_single_device_conforms(tmp_path: Path) -> None:
    assert_strategy_conforms(lambda: "single_device", tmp_path, devices=1)


def test_naive_strategy_fails_and_the_report_names_each_broken_check(tmp_path: Path) -> None:
    report = check_strategy(lambda: NaiveShardedStrategy(start_method="fork"), tmp_path)

    failed = {result.name for result in report.failures}
    assert {"checkpoint_keys", "optimizer_state_plain"} <= failed
    text = str(report)
    assert "FAIL  checkpoint_keys" in text
    assert "'module.'" in text  # names the wrapper prefix that leaked into the keys
    assert "param group 0" in text or "parameter group" in text


def test_naive_strategy_raises_conformance_error_with_the_report(tmp_path: Path) -> None:
    with pytest.raises(ConformanceError, match=r"Conformance of NaiveShardedStrategy: FAILS"):
        assert_strategy_conforms(lambda: NaiveShardedStrategy(start_method="fork"), tmp_path)
