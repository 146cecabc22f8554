"""The benchmark command runs end to end at a tiny size (benchmarks are measured, not tested, elsewhere)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from benchmarks.config import BENCHMARKS, STRATEGIES

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_run_writes_every_benchmark_with_numbers_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "results"
    subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--out", str(out), "--timeout", "120"],
        cwd=ROOT,
        check=True,
        timeout=180,
        capture_output=True,
    )
    results = json.loads((out / "results.json").read_text())
    assert set(results["summary"]) == set(BENCHMARKS)
    assert results["meta"]["versions"]["torch"] and results["meta"]["machine"]["cpu_model"]
    figures = {(goal["benchmark"], goal["strategy"]) for goal in results["goals"]}
    assert figures == {(benchmark, strategy) for benchmark in BENCHMARKS for strategy in STRATEGIES}
    # At the smoke size a ratio may be 0 (no memory measurably added) or negative (a resume difference within the
    # noise); it must still be a number.
    not_numbers = [goal for goal in results["goals"] if not math.isfinite(goal["value"])]
    assert not not_numbers, not_numbers
    for benchmark in BENCHMARKS:
        assert (out / f"{benchmark}.png").stat().st_size > 0, benchmark
    assert "| benchmark |" in (out / "results.md").read_text()
