"""Conformance kit: check any Lightning strategy (ours, upstream's, yours) against the direct-reference contract."""

from lightning_strategies.testing.conformance import (
    CheckResult,
    ConformanceError,
    ConformanceReport,
    StrategyFactory,
    assert_strategy_conforms,
    check_strategy,
)
from lightning_strategies.testing.models import ConformanceModel, make_dataset, probe_input

__all__ = [
    "CheckResult",
    "ConformanceError",
    "ConformanceModel",
    "ConformanceReport",
    "StrategyFactory",
    "assert_strategy_conforms",
    "check_strategy",
    "make_dataset",
    "probe_input",
]
