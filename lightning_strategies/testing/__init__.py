"""Conformance kit: check any Lightning strategy (ours, upstream's, yours) against the direct-reference contract."""

from .conformance import (
    CheckResult,
    ConformanceError,
    ConformanceReport,
    Launch,
    StrategyFactory,
    assert_strategy_conforms,
    check_strategy,
)
from .models import ConformanceModel, make_dataset, probe_input
from .state import SaveAfterRestore, max_state_difference

__all__ = [
    "CheckResult",
    "ConformanceError",
    "ConformanceModel",
    "ConformanceReport",
    "Launch",
    "SaveAfterRestore",
    "StrategyFactory",
    "assert_strategy_conforms",
    "check_strategy",
    "make_dataset",
    "max_state_difference",
    "probe_input",
]
