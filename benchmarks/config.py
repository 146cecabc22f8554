"""What a benchmark run does: sizes, repeats and the compared strategies."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

#: The strategies of this package that the benchmarks compare with hand-written loops.
STRATEGIES: tuple[str, ...] = ("ddp_sharded", "fsdp_fairscale", "fsdp2")
#: Benchmarks in the order they run.
BENCHMARKS: tuple[str, ...] = ("overhead", "save", "resume", "memory", "scaling")


@dataclass(frozen=True)
class Config:
    """Sizes and repeats of one run; the same object reaches every rank (as JSON).

    Attributes:
        smoke: A tiny run that only checks that everything works.
        repeats: Repeats of each compared variant (overhead, save, resume); variants alternate within a repeat.
        warmup_steps: Steps of each fit that are not timed.
        timed_steps: Timed steps of each fit in the overhead benchmark.
        width: Width of the benchmark MLP (overhead, save, resume, memory).
        depth: Linear layers of the benchmark MLP.
        batch_size: Samples per rank and step.
        scaling_params: Approximate parameter counts of the scaling benchmark's models.
        scaling_width: Width of the scaling models (depth grows with size, so tensors grow in number and size).
        scaling_repeats: Save/load repeats per model size.
        strategies: Strategies of this package to compare.
        benchmarks: Benchmarks to run.
    """

    smoke: bool = False
    repeats: int = 5
    warmup_steps: int = 3
    timed_steps: int = 20
    width: int = 1024
    depth: int = 4
    batch_size: int = 64
    scaling_params: tuple[int, ...] = (1_000_000, 10_000_000, 50_000_000, 100_000_000)
    scaling_width: int = 1024
    scaling_repeats: int = 2
    strategies: tuple[str, ...] = STRATEGIES
    benchmarks: tuple[str, ...] = BENCHMARKS

    def to_json(self) -> dict[str, Any]:
        """The configuration as JSON-compatible values."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Config:
        """Reads what :meth:`to_json` wrote."""
        tuples = {key: tuple(value) for key, value in data.items() if isinstance(value, list)}
        return cls(**{**data, **tuples})

    def write(self, path: Path) -> None:
        """Writes the configuration to ``path`` for the workers."""
        path.write_text(json.dumps(self.to_json()))

    @classmethod
    def read(cls, path: Path) -> Config:
        """Reads a configuration written by :meth:`write`."""
        return cls.from_json(json.loads(path.read_text()))


FULL = Config()
SMOKE = Config(
    smoke=True,
    repeats=1,
    warmup_steps=1,
    timed_steps=2,
    width=64,
    depth=2,
    batch_size=8,
    scaling_params=(20_000, 40_000, 80_000),
    scaling_width=64,
    scaling_repeats=1,
)


def config_for(
    smoke: bool, benchmarks: tuple[str, ...] | None = None, strategies: tuple[str, ...] | None = None
) -> Config:
    """The full or smoke configuration, optionally restricted to some benchmarks and strategies."""
    config = SMOKE if smoke else FULL
    if benchmarks:
        config = replace(config, benchmarks=benchmarks)
    if strategies:
        config = replace(config, strategies=strategies)
    return config
