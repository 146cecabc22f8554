"""Hypothesis settings for the property tests: fast, and the same examples on every run (no new ones in CI)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

#: 100 examples per property, no per-example deadline (2 shared cores), derandomized, no example database.
PROPERTY = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
