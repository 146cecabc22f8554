"""The Lightning package these tests run under, and our classes bound to it.

Tests under ``tests/both_packages`` import Lightning and ``lightning_strategies`` only from here, so they run once
in an environment with ``pytorch_lightning`` and once in one with only ``lightning``. Where both are installed,
``LIGHTNING_STRATEGIES_TEST_PACKAGE=lightning`` picks the second.
"""

from __future__ import annotations

import importlib
import os
from importlib.util import find_spec
from types import ModuleType

PACKAGE = os.environ.get("LIGHTNING_STRATEGIES_TEST_PACKAGE") or (
    "pytorch_lightning" if find_spec("pytorch_lightning") is not None else "lightning"
)
if PACKAGE not in ("pytorch_lightning", "lightning"):
    raise ValueError(f"LIGHTNING_STRATEGIES_TEST_PACKAGE={PACKAGE!r}: expected 'pytorch_lightning' or 'lightning'")

pl: ModuleType = importlib.import_module("pytorch_lightning" if PACKAGE == "pytorch_lightning" else "lightning.pytorch")
ours: ModuleType = importlib.import_module(
    "lightning_strategies" if PACKAGE == "pytorch_lightning" else "lightning_strategies.lightning"
)
testing: ModuleType = importlib.import_module(f"{ours.__name__}.testing")
matrix: ModuleType = importlib.import_module(f"{ours.__name__}.testing.matrix")
