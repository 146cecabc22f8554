"""PNG plots of a summary (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use("Agg"): no display needed
from matplotlib.axes import Axes

from .config import UPSTREAM_FSDP, UPSTREAM_LABELS, UPSTREAM_PAIRS

#: Bar colours by a series label, or else by its first word.
COLORS = {
    "ours": "#1f77b4",
    "hand": "#ff7f0e",
    "hand-written": "#ff7f0e",
    "upstream": "#7f7f7f",
    UPSTREAM_LABELS[UPSTREAM_FSDP]: "#bcbd22",
    "fresh": "#2ca02c",
    "resume": "#1f77b4",
    "synchronous": "#ff7f0e",
}


def _bars(
    axes: Axes, groups: Sequence[str], series: dict[str, list[dict[str, float]]], scale: float, unit: str
) -> None:
    """Grouped bars of medians with min-max whiskers; ``series`` maps a label to one stats dict per group."""
    width = 0.8 / max(1, len(series))
    for index, (label, rows) in enumerate(series.items()):
        positions = [group + (index - (len(series) - 1) / 2) * width for group in range(len(groups))]
        medians = [row["median"] * scale for row in rows]
        lower = [(row["median"] - row["min"]) * scale for row in rows]
        upper = [(row["max"] - row["median"]) * scale for row in rows]
        color = COLORS.get(label, COLORS.get(label.split()[0]))
        axes.bar(positions, medians, width, label=label, color=color, yerr=[lower, upper], capsize=3)
    axes.set_xticks(range(len(groups)), groups)
    axes.set_ylabel(unit)
    axes.legend()


_NONE = {"median": 0.0, "min": 0.0, "max": 0.0}


def _plot_against_hand(axes: Axes, summary: dict[str, Any]) -> None:
    variants = summary["variants"]
    strategies = list(summary["ratios"])
    _bars(
        axes,
        [*strategies, "ddp"],
        {
            "ours (Trainer)": [variants[f"ours:{s}"]["step_s"] for s in strategies]
            + [variants["upstream:ddp"]["step_s"]],
            "hand-written loop": [variants[f"hand:{s}"]["step_s"] for s in strategies] + [_NONE],
        },
        1e3,
        "step time, ms (median, min-max)",
    )
    axes.set_title("MLP: Trainer + strategy vs hand-written loop")


def _plot_against_model_parallel(axes: Axes, summary: dict[str, Any]) -> None:
    """``fsdp2``, its hand-written loop and upstream's ``ModelParallelStrategy``, per model, relative to ``fsdp2``."""
    variants = summary["variants"]
    suffixes = {"MLP": "", "GPT-2": "@gpt2"}
    models = [model for model, suffix in suffixes.items() if f"upstream:model_parallel{suffix}" in variants]

    def relative(name: str, model: str) -> dict[str, float]:
        row = variants.get(f"{name}{suffixes[model]}")
        if row is None:
            return _NONE
        base = variants[f"ours:fsdp2{suffixes[model]}"]["step_s"]["median"]
        return {key: row["step_s"][key] / base for key in ("median", "min", "max")}

    _bars(
        axes,
        models,
        {
            "ours (fsdp2)": [relative("ours:fsdp2", model) for model in models],
            "hand-written fully_shard loop": [relative("hand:fsdp2", model) for model in models],
            "upstream ModelParallelStrategy": [relative("upstream:model_parallel", model) for model in models],
        },
        1.0,
        "step time / fsdp2's (median, min-max)",
    )
    axes.set_title("fsdp2 vs upstream ModelParallelStrategy")


def plot_overhead(summary: dict[str, Any], path: Path) -> None:
    panels = [
        plot
        for plot, present in (
            (_plot_against_hand, bool(summary["ratios"])),
            (_plot_against_model_parallel, bool(summary.get("vs_upstream"))),
        )
        if present
    ]
    figure, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 4), squeeze=False)
    for plot, ax in zip(panels, axes[0], strict=False):
        plot(ax, summary)
    figure.suptitle("Step time, 2 CPU ranks")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _against_upstream(axes: Axes, rows: dict[str, dict[str, dict[str, Any]]], key: str | None, title: str) -> None:
    """Per checkpoint kind (full, sharded), ``fsdp2`` and each upstream strategy, in ms: ``rows`` is keyed by upstream
    strategy, then kind, and holds ``ours`` and ``upstream`` (their stats, or dicts holding them under ``key``)."""
    peers = [peer for peer in UPSTREAM_PAIRS if peer in rows]
    kinds = list(rows[peers[0]])

    def pick(row: dict[str, Any]) -> dict[str, float]:
        picked: dict[str, float] = row[key] if key else row
        return picked

    series = {"ours (fsdp2)": [pick(rows[peers[0]][kind]["ours"]) for kind in kinds]}
    for peer in peers:
        series[UPSTREAM_LABELS[peer]] = [pick(rows[peer][kind]["upstream"]) for kind in kinds]
    _bars(axes, kinds, series, 1e3, "ms (median, min-max)")
    axes.set_title(title)


def plot_save(summary: dict[str, Any], path: Path) -> None:
    strategies = list(summary)
    upstream = summary.get("fsdp2", {}).get("vs_upstream")
    figure, axes = plt.subplots(1, 3 if upstream else 2, figsize=(15 if upstream else 10, 4))
    left, right = axes[0], axes[1]
    if upstream:
        _against_upstream(axes[2], upstream, "seconds", "Save (MLP), fsdp2 vs upstream strategies")
    _bars(
        left,
        strategies,
        {
            "ours (trainer.save_checkpoint)": [summary[s]["ours"]["seconds"] for s in strategies],
            "hand (wrapper API + torch.save)": [summary[s]["hand"]["seconds"] for s in strategies],
            "hand + atomic write (fsync)": [summary[s]["hand_atomic"]["seconds"] for s in strategies],
        },
        1e3,
        "save time, ms",
    )
    left.set_title("Full checkpoint save")
    positions = range(len(strategies))
    right.bar(
        [p - 0.2 for p in positions],
        [summary[s]["rss_rank0_per_checkpoint_byte"] for s in strategies],
        0.4,
        label="rank 0",
    )
    right.bar(
        [p + 0.2 for p in positions],
        [summary[s]["rss_other_per_checkpoint_byte"] for s in strategies],
        0.4,
        label="rank 1",
    )
    right.axhline(1.25, color="#1f77b4", linestyle="--", linewidth=1, label="goal rank 0")
    right.axhline(0.10, color="#ff7f0e", linestyle="--", linewidth=1, label="goal rank 1")
    right.set_xticks(list(positions), strategies)
    right.set_ylabel("peak RSS added / checkpoint bytes")
    right.set_title("Memory added while saving (ours)")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_resume(summary: dict[str, Any], path: Path) -> None:
    strategies = list(summary)
    upstream = summary.get("fsdp2", {}).get("vs_upstream")
    figure, panels = plt.subplots(1, 2 if upstream else 1, figsize=(12 if upstream else 7, 4), squeeze=False)
    axes = panels[0][0]
    if upstream:
        _against_upstream(panels[0][1], upstream, None, "Resumed fit to first step (MLP), fsdp2 vs upstream")
    _bars(
        axes,
        strategies,
        {
            "fresh fit": [summary[s]["fresh"] for s in strategies],
            "resumed fit": [summary[s]["resume"] for s in strategies],
            "hand load": [summary[s]["hand"] for s in strategies],
        },
        1e3,
        "ms to the first step / to load",
    )
    axes.set_title("Resume: fit start to first step, and torch.load + load by hand")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_memory(summary: dict[str, Any], path: Path) -> None:
    strategies = list(summary)
    ticks = [f"upstream {name}" if name in UPSTREAM_LABELS else name for name in strategies]
    figure, axes = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(strategies)
    for part in ("params", "grads", "optimizer"):
        values = [max(rank[part] for rank in summary[s]["per_rank"]) / 1e6 for s in strategies]
        axes.bar(ticks, values, 0.6, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes.set_ylabel("MB per rank (largest rank)")
    axes.set_title("Parameters + gradients + optimizer state per rank, world size 2")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_scaling(summary: dict[str, Any], path: Path) -> None:
    figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for operation, ax in zip(("save_s", "load_s"), axes, strict=True):
        for strategy, row in summary.items():
            sizes = [point["params"] for point in row["points"]]
            times = [point[operation]["median"] for point in row["points"]]
            slope = row[f"{operation}_slope_upper"]
            ax.loglog(sizes, times, marker="o", label=f"{strategy} (slope {slope:.2f})")
        if summary:
            first = next(iter(summary.values()))["points"]
            sizes = [point["params"] for point in first]
            anchor = first[-1][operation]["median"]
            ax.loglog(sizes, [anchor * size / sizes[-1] for size in sizes], "k:", linewidth=1, label="linear")
        ax.set_xlabel("parameters")
        ax.set_title("save" if operation == "save_s" else "load (strategy's restore path)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("seconds (median)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_async_save(summary: dict[str, Any], path: Path) -> None:
    """The step loop blocked per save, synchronous against ``async_save=True``, per strategy and format."""
    variants = list(summary)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.4 * len(variants)), 4))
    _bars(
        axes,
        variants,
        {
            "synchronous": [summary[v]["sync"] for v in variants],
            "ours async_save": [summary[v]["async"] for v in variants],
        },
        1e3,
        "ms blocked per save (median, min-max)",
    )
    axes.set_title("Step loop blocked per save")
    axes.tick_params(axis="x", labelsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


PLOTS = {
    "overhead": plot_overhead,
    "save": plot_save,
    "resume": plot_resume,
    "memory": plot_memory,
    "scaling": plot_scaling,
    "async_save": plot_async_save,
}


def write_plots(summary: dict[str, Any], directory: Path) -> list[Path]:
    """One ``<benchmark>.png`` per summarised benchmark in ``directory``."""
    paths = []
    for name, plot in PLOTS.items():
        if name in summary:
            path = directory / f"{name}.png"
            plot(summary[name], path)
            paths.append(path)
    return paths
