"""The benchmark command runs end to end at a tiny size (benchmarks are measured, not tested, elsewhere)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from benchmarks.config import BENCHMARKS, STRATEGIES

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = "upstream ModelParallelStrategy"
UPSTREAM_FSDP = "upstream FSDPStrategy"
#: fsdp2 against upstream's ModelParallelStrategy (step time and model state) and FSDPStrategy (model state), on the
#: MLP and on GPT-2, and, on GPT-2, against its hand-written loop.
UPSTREAM_FIGURES = {
    ("overhead", f"MLP step time, ours / {UPSTREAM}"),
    ("overhead", "GPT-2 step time, Trainer / hand loop"),
    ("overhead", f"GPT-2 step time, ours / {UPSTREAM}"),
    ("memory", f"per-rank params+grads+optimizer bytes, ours / {UPSTREAM_FSDP}"),
    *(
        figure
        for peer in (UPSTREAM, UPSTREAM_FSDP)
        for kind in ("full", "sharded", "GPT-2 full", "GPT-2 sharded")
        for figure in (
            ("save", f"{kind} checkpoint save time, ours / {peer}"),
            ("save", f"{kind} checkpoint: peak RSS added on rank 0, ours / {peer}"),
            ("save", f"{kind} checkpoint: peak RSS added on rank 1, ours / {peer}"),
            ("resume", f"{kind} checkpoint: resumed fit to first step, ours / {peer}"),
        )
    ),
}


def test_smoke_run_writes_every_benchmark_with_numbers_and_plots(tmp_path: Path) -> None:
    """Every benchmark and figure, the comparisons with upstream's ``ModelParallelStrategy`` and ``FSDPStrategy`` and
    GPT-2 included."""
    out = tmp_path / "results"
    subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--out", str(out), "--timeout", "170"],
        cwd=ROOT,
        check=True,
        timeout=240,
        capture_output=True,
    )
    results = json.loads((out / "results.json").read_text())
    assert set(results["summary"]) == set(BENCHMARKS)
    assert results["meta"]["versions"]["torch"] and results["meta"]["machine"]["cpu_model"]
    figures = {(goal["benchmark"], goal["strategy"]) for goal in results["goals"]}
    assert figures == {(benchmark, strategy) for benchmark in BENCHMARKS for strategy in STRATEGIES}
    fsdp2_figures = {(goal["benchmark"], goal["figure"]) for goal in results["goals"] if goal["strategy"] == "fsdp2"}
    assert fsdp2_figures >= UPSTREAM_FIGURES, UPSTREAM_FIGURES - fsdp2_figures
    assert {"upstream:model_parallel", "ours:fsdp2@gpt2", "hand:fsdp2@gpt2", "upstream:model_parallel@gpt2"} <= set(
        results["summary"]["overhead"]["variants"]
    )
    assert {"ddp", *STRATEGIES, "fsdp"} == set(results["summary"]["memory"])
    # At the smoke size a ratio may be 0 (no memory measurably added) or negative (a resume difference within the
    # noise); it must still be a number.
    not_numbers = [goal for goal in results["goals"] if not math.isfinite(goal["value"])]
    assert not not_numbers, not_numbers
    for benchmark in BENCHMARKS:
        assert (out / f"{benchmark}.png").stat().st_size > 0, benchmark
    assert "| benchmark |" in (out / "results.md").read_text()


def test_store_smoke_run_measures_every_cell_or_says_why_not(tmp_path: Path) -> None:
    """``--store s3`` against its own SeaweedFS server, ``fsdp2``'s full and sharded checkpoints only (a smoke run
    leaves out upstream ``ddp``'s reference): every figure is a number or names what the package does not support
    yet."""
    out = tmp_path / "results"
    subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--store", "s3", "--strategies", "fsdp2", "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=120,
        capture_output=True,
    )
    results = json.loads((out / "results.json").read_text())
    assert set(results["summary"]) == {"store"}
    assert set(results["summary"]["store"]) == {"fsdp2/full", "fsdp2/sharded"}
    assert results["meta"]["config"]["store_url"].startswith("s3://")
    goals = results["goals"]
    assert {goal["strategy"] for goal in goals} == {"fsdp2"}
    unexplained = [
        goal
        for goal in goals
        if not math.isfinite(goal["value"]) and not (goal["note"] or "").startswith("not supported: ")
    ]
    assert not unexplained, unexplained
    full = {goal["figure"] for goal in goals if goal["strategy"] == "fsdp2" and goal["figure"].startswith("full")}
    assert "full: remote save / plain upload of the same bytes" in full
    assert "full: peak RSS added on rank 0 by a remote save / file size" in full
    assert "full on the store: step loop blocked per save, async_save=True / synchronous" in full
    assert "**Checkpoints on the store: saves**" in (out / "results.md").read_text()
