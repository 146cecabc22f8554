"""A fuzzing campaign: ``python3 dev.py fuzz --examples N --seed S`` (or ``python -m tests.fuzz``).

Draws ``N`` recipes with ``hypothesis`` from seed ``S`` (no shrinking: every recipe is run once and judged), runs
each under upstream ``ddp`` and each of our strategies, shows progress, and ends with a table of verdicts per
strategy, every kind of refusal with its message, and each failing recipe with the command that replays it.
``--replay "Recipe(...)"`` runs one recipe alone and prints its verdicts. ``--json PATH`` writes every verdict.
Exits 1 when any recipe ended different, crashed or hung.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # ddp's warning about find_unused_parameters, once per fit

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings

from tests.fuzz import recipes as recipe_names
from tests.fuzz.recipes import OURS, Recipe, recipes
from tests.fuzz.runner import Fuzzer, Report


def _quiet() -> None:
    # OMP_NUM_THREADS=1 is set before torch loads (tests/__init__.py); resizing torch's thread pool in the process the
    # ranks fork from makes torch 2.11's CUDA build abort in them ("Invalid thread pool!").
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)


def parse_recipe(text: str) -> Recipe:
    """A recipe from its ``repr`` (only this package's recipe classes are known to the expression)."""
    names = {name: getattr(recipe_names, name) for name in ("Recipe", "ModelSpec", "Automatic", "Manual", "Checkpoint")}
    recipe = eval(text, {"__builtins__": {}}, names)  # a recipe the user typed; no builtins reachable
    if not isinstance(recipe, Recipe):
        raise SystemExit(f"--replay takes a Recipe(...) expression, got {type(recipe).__name__}")
    return recipe


def _refusal_kind(message: str) -> str:
    """A refusal's message with numbers and quoted names taken out: refusals of one kind share it."""
    return re.sub(r"'[^']*'|\d+(\.\d+)?(e-?\d+)?", "…", message)[:160]


class Campaign:
    """Collects reports and prints progress and the summary."""

    def __init__(self, total: int, fuzzer: Fuzzer) -> None:
        self.total = total
        self.fuzzer = fuzzer
        self.reports: list[Report] = []
        self.started = time.perf_counter()
        self.interactive = sys.stdout.isatty()

    def run(self, recipe: Recipe) -> None:
        report = self.fuzzer.run(recipe)
        self.reports.append(report)
        bad = sum(not r.ok for r in self.reports)
        elapsed = time.perf_counter() - self.started
        line = f"[{len(self.reports)}/{self.total}] {elapsed:.0f} s, {bad} failing recipe(s)"
        if self.interactive:
            print(f"\r{line}", end="", flush=True)
        elif len(self.reports) % 10 == 0 or not report.ok:
            print(line, flush=True)
        if not report.ok:
            print(("\n" if self.interactive else "") + report.describe(), flush=True)

    def summary(self) -> str:
        counts: dict[str, Counter[str]] = defaultdict(Counter)
        refusals: dict[tuple[str, str], tuple[int, str]] = {}
        for report in self.reports:
            for verdict in report.verdicts:
                column = verdict.strategy if verdict.strategy in OURS else "checkpoint"
                counts[column][verdict.verdict] += 1
                if verdict.verdict == "refused" and column in OURS:
                    key = (column, _refusal_kind(verdict.detail))
                    seen, example = refusals.get(key, (0, verdict.detail))
                    refusals[key] = (seen + 1, example)
        verdicts = ["equal", "refused", "different", "crash", "hang"]
        columns = [*OURS, "checkpoint"]
        lines = [
            "",
            f"{len(self.reports)} recipes in {time.perf_counter() - self.started:.0f} s",
            "",
            "| verdict | " + " | ".join(columns) + " |",
            "|---|" + "---|" * len(columns),
        ]
        for verdict in verdicts:
            lines.append(f"| {verdict} | " + " | ".join(str(counts[c][verdict]) for c in columns) + " |")
        if refusals:
            lines += ["", "| strategy | refusals | message (one example) |", "|---|---|---|"]
            for (strategy, _), (seen, example) in sorted(refusals.items(), key=lambda item: -item[1][0]):
                lines.append(f"| {strategy} | {seen} | {example} |")
        failing = [report for report in self.reports if not report.ok]
        if failing:
            lines += ["", f"{len(failing)} failing recipe(s):"] + [report.describe() for report in failing]
        return "\n".join(lines)

    def as_json(self) -> list[dict[str, Any]]:
        return [{"recipe": repr(r.recipe), "verdicts": [vars(v) for v in r.verdicts], "ok": r.ok} for r in self.reports]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 dev.py fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=100, help="recipes to draw (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--replay", help="run one recipe, given as the Recipe(...) the fuzzer printed")
    parser.add_argument("--json", type=Path, help="write every recipe's verdicts to this file")
    args = parser.parse_args(argv)
    _quiet()
    fuzzer = Fuzzer()
    if args.replay:
        report = fuzzer.run(parse_recipe(args.replay))
        print(report.describe())
        return 0 if report.ok else 1
    campaign = Campaign(args.examples, fuzzer)

    @seed(args.seed)
    @settings(
        max_examples=args.examples,
        phases=[Phase.generate],
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(recipe=recipes())
    def draw(recipe: Recipe) -> None:
        campaign.run(recipe)

    draw()
    print(campaign.summary())
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "reports": campaign.as_json()}, indent=1))
    return 0 if all(report.ok for report in campaign.reports) else 1


if __name__ == "__main__":
    sys.exit(main())
