"""Turns the ranks' raw measurements into figures, goals and a Markdown table."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .config import (
    FSDP2_READ_WHOLE,
    MODEL_PARALLEL,
    UPSTREAM_FSDP,
    UPSTREAM_LABELS,
    UPSTREAM_PAIRS,
    UPSTREAM_PEER,
    Config,
    upstream_results_key,
)


@dataclass(frozen=True)
class Goal:
    """One figure measured against its goal (``informational`` figures have no goal)."""

    benchmark: str
    strategy: str
    figure: str
    value: float
    goal: float | None  # the figure must be <= goal
    unit: str = "x"
    note: str | None = None  # shown in place of the value: why there is none ("not supported: <error>")

    @property
    def met(self) -> bool | None:
        return None if self.goal is None else self.value <= self.goal

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}


def stats(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max (and count) of ``values``."""
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _max_over_ranks(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Element-wise maximum: a distributed operation takes as long as its slowest rank."""
    return [max(values) for values in zip(*per_rank, strict=True)]


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.inf


def _results(ranks: Sequence[dict[str, Any]], benchmark: str) -> list[Any]:
    return [rank["results"][benchmark] for rank in ranks]


def summarize_overhead(ranks: Sequence[dict[str, Any]], config: Config, goals: list[Goal]) -> dict[str, Any]:
    per_rank = _results(ranks, "overhead")
    variants: dict[str, Any] = {}
    for name in per_rank[0]["runs"]:
        summary: dict[str, Any] = {}
        for measure in ("step_s", "period_s"):
            run_medians = [
                statistics.median(_max_over_ranks([rank["runs"][name][run][measure] for rank in per_rank]))
                for run in range(len(per_rank[0]["runs"][name]))
            ]
            summary[measure] = {**stats(run_medians), "runs": run_medians}
        variants[name] = summary
    ratios: dict[str, Any] = {}
    for strategy in config.strategies:
        if f"ours:{strategy}" not in variants:
            continue  # the MLP did not run (``--models`` without ``mlp``)
        ours, hand, ddp = variants[f"ours:{strategy}"], variants[f"hand:{strategy}"], variants["upstream:ddp"]
        paired = [o / h for o, h in zip(ours["step_s"]["runs"], hand["step_s"]["runs"], strict=True)]
        ratios[strategy] = {
            "vs_hand": _ratio(ours["step_s"]["median"], hand["step_s"]["median"]),
            "vs_hand_paired": stats(paired),
            "loop_vs_hand": _ratio(ours["period_s"]["median"], hand["period_s"]["median"]),
            "vs_ddp": _ratio(ours["step_s"]["median"], ddp["step_s"]["median"]),
        }
        goals.append(Goal("overhead", strategy, "step time, Trainer / hand loop", ratios[strategy]["vs_hand"], 1.05))
        goals.append(
            Goal(
                "overhead", strategy, "step-to-step period, Trainer / hand loop", ratios[strategy]["loop_vs_hand"], None
            )
        )
        goals.append(Goal("overhead", strategy, "step time, ours / upstream ddp", ratios[strategy]["vs_ddp"], None))
    return {"variants": variants, "ratios": ratios, "vs_upstream": _overhead_vs_upstream(variants, goals)}


UPSTREAM_LABEL = UPSTREAM_LABELS[MODEL_PARALLEL]


def _overhead_vs_upstream(variants: dict[str, Any], goals: list[Goal]) -> dict[str, float]:
    """``fsdp2`` against upstream's ``ModelParallelStrategy`` (MLP, GPT-2) and against its hand loop (GPT-2)."""

    def median(name: str) -> float:
        value: float = variants[name]["step_s"]["median"]
        return value

    ratios: dict[str, float] = {}
    if "upstream:model_parallel" in variants:
        ratios["mlp_vs_model_parallel"] = _ratio(median("ours:fsdp2"), median("upstream:model_parallel"))
        goals.append(
            Goal(
                "overhead",
                UPSTREAM_PEER,
                f"MLP step time, ours / {UPSTREAM_LABEL}",
                ratios["mlp_vs_model_parallel"],
                1.0,
            )
        )
    if "ours:fsdp2@gpt2" in variants:
        ratios["gpt2_vs_hand"] = _ratio(median("ours:fsdp2@gpt2"), median("hand:fsdp2@gpt2"))
        ratios["gpt2_vs_model_parallel"] = _ratio(median("ours:fsdp2@gpt2"), median("upstream:model_parallel@gpt2"))
        goals.append(
            Goal("overhead", UPSTREAM_PEER, "GPT-2 step time, Trainer / hand loop", ratios["gpt2_vs_hand"], 1.05)
        )
        goals.append(
            Goal(
                "overhead",
                UPSTREAM_PEER,
                f"GPT-2 step time, ours / {UPSTREAM_LABEL}",
                ratios["gpt2_vs_model_parallel"],
                1.0,
            )
        )
    return ratios


def summarize_save(ranks: Sequence[dict[str, Any]], config: Config, goals: list[Goal]) -> dict[str, Any]:
    per_rank = _results(ranks, "save")
    summary: dict[str, Any] = {}
    for strategy in config.strategies:
        rows: dict[str, Any] = {}
        checkpoint_bytes = per_rank[0][strategy]["checkpoint_bytes"]
        for side in ("ours", "hand", "hand_atomic"):
            samples = [rank[strategy][side] for rank in per_rank]
            seconds = _max_over_ranks([[sample["seconds"] for sample in rank] for rank in samples])
            rss = [[sample["rss_added_bytes"] for sample in rank] for rank in samples]
            rows[side] = {
                "seconds": stats(seconds),
                "rss_added_rank0_bytes": stats(rss[0]),
                "rss_added_other_ranks_bytes": stats([value for rank in rss[1:] for value in rank]),
                "checkpoint_bytes": checkpoint_bytes[side],
            }
        ours = rows["ours"]
        size = float(checkpoint_bytes["ours"])
        rows["time_ratio"] = _ratio(ours["seconds"]["median"], rows["hand"]["seconds"]["median"])
        rows["time_ratio_vs_atomic"] = _ratio(ours["seconds"]["median"], rows["hand_atomic"]["seconds"]["median"])
        rows["rss_rank0_per_checkpoint_byte"] = ours["rss_added_rank0_bytes"]["max"] / size
        rows["rss_other_per_checkpoint_byte"] = ours["rss_added_other_ranks_bytes"]["max"] / size
        rows["hand_rss_rank0_per_checkpoint_byte"] = rows["hand"]["rss_added_rank0_bytes"]["max"] / size
        rows["hand_rss_other_per_checkpoint_byte"] = rows["hand"]["rss_added_other_ranks_bytes"]["max"] / size
        goals.append(Goal("save", strategy, "save time, trainer.save_checkpoint / by hand", rows["time_ratio"], 1.10))
        goals.append(
            Goal(
                "save",
                strategy,
                "save time, ours / by hand written atomically (fsync)",
                rows["time_ratio_vs_atomic"],
                None,
            )
        )
        goals.append(
            Goal(
                "save",
                strategy,
                "by hand: peak RSS added on rank 0 / checkpoint bytes",
                rows["hand_rss_rank0_per_checkpoint_byte"],
                None,
            )
        )
        goals.append(
            Goal(
                "save",
                strategy,
                "by hand: peak RSS added on rank 1 / checkpoint bytes",
                rows["hand_rss_other_per_checkpoint_byte"],
                None,
            )
        )
        goals.append(
            Goal(
                "save",
                strategy,
                "peak RSS added on rank 0 / checkpoint bytes",
                rows["rss_rank0_per_checkpoint_byte"],
                1.25,
            )
        )
        goals.append(
            Goal(
                "save",
                strategy,
                "peak RSS added on rank 1 / checkpoint bytes",
                rows["rss_other_per_checkpoint_byte"],
                0.10,
            )
        )
        summary[strategy] = rows
    for model, key in _upstream_keys(per_rank[0]):
        summary[UPSTREAM_PEER][key] = _save_vs_upstream([rank[key] for rank in per_rank], goals, model)
    return summary


#: The model column of the tables against upstream.
MODEL_NAMES = {"mlp": "MLP", "gpt2": "GPT-2"}


def _upstream_rows(benchmark: dict[str, Any]) -> list[tuple[str, str, str, dict[str, Any]]]:
    """``(model, upstream strategy, checkpoint kind, row)`` of a save or resume summary's comparisons with upstream."""
    compared = benchmark.get(UPSTREAM_PEER, {})
    return [
        (MODEL_NAMES[model], peer, kind, row)
        for model in MODEL_NAMES
        for peer, kinds in compared.get(upstream_results_key(model), {}).items()
        for kind, row in kinds.items()
    ]


#: How a figure against upstream names its model (the MLP's figures keep their names from before GPT-2's).
MODEL_PREFIXES = {"mlp": "", "gpt2": "GPT-2 "}


def _upstream_keys(results: dict[str, Any]) -> list[tuple[str, str]]:
    """``(model, key)`` of each comparison with upstream in one rank's results of a benchmark."""
    return [(model, upstream_results_key(model)) for model in MODEL_PREFIXES if upstream_results_key(model) in results]


#: Peak RSS below this counts as this much in ratios against upstream: at small sizes both sides add nothing
#: measurable (0 / 0), and a page more on one side would be an unbounded ratio.
RSS_FLOOR_BYTES = 1 << 20


def _save_side(samples: Sequence[Sequence[dict[str, float]]], checkpoint_bytes: int) -> dict[str, Any]:
    """Seconds (slowest rank per save) and the peak RSS added on rank 0 and on the other ranks, of one strategy."""
    rss = [[sample["rss_added_bytes"] for sample in rank] for rank in samples]
    return {
        "seconds": stats(_max_over_ranks([[sample["seconds"] for sample in rank] for rank in samples])),
        "rss_added_rank0_bytes": stats(rss[0]),
        "rss_added_other_ranks_bytes": stats([value for rank in rss[1:] for value in rank]),
        "checkpoint_bytes": checkpoint_bytes,
    }


def _rss_ratio(ours: float, upstream: float) -> float:
    return _ratio(max(ours, RSS_FLOOR_BYTES), max(upstream, RSS_FLOOR_BYTES))


def _save_vs_upstream(per_rank: Sequence[dict[str, Any]], goals: list[Goal], model: str) -> dict[str, Any]:
    """``fsdp2`` against each upstream strategy of :data:`UPSTREAM_PAIRS` on ``model``, per checkpoint kind: save
    time and peak RSS added. Keyed by upstream strategy, then checkpoint kind."""
    summary: dict[str, Any] = {}
    for peer, pairs in UPSTREAM_PAIRS.items():
        summary[peer] = {
            kind: _save_pair(per_rank, names, UPSTREAM_LABELS[peer], MODEL_PREFIXES[model] + kind, goals)
            for kind, names in pairs.items()
        }
    return summary


def _save_pair(
    per_rank: Sequence[dict[str, Any]], names: tuple[str, str], label: str, kind: str, goals: list[Goal]
) -> dict[str, Any]:
    """One checkpoint kind, ours against one upstream strategy (``label``): the rows and the three figures."""
    ours, upstream = (
        _save_side([rank["samples"][name] for rank in per_rank], per_rank[0]["checkpoint_bytes"][name])
        for name in names
    )
    rows: dict[str, Any] = {"strategies": list(names), "ours": ours, "upstream": upstream}
    rows["time_ratio"] = _ratio(ours["seconds"]["median"], upstream["seconds"]["median"])
    for where in ("rank0", "other_ranks"):
        key = f"rss_added_{where}_bytes"
        rows[f"rss_{where}_ratio"] = _rss_ratio(ours[key]["max"], upstream[key]["max"])
    goals.append(Goal("save", UPSTREAM_PEER, f"{kind} checkpoint save time, ours / {label}", rows["time_ratio"], 1.0))
    for where, rank in (("rank0", "rank 0"), ("other_ranks", "rank 1")):
        goals.append(
            Goal(
                "save",
                UPSTREAM_PEER,
                f"{kind} checkpoint: peak RSS added on {rank}, ours / {label}",
                rows[f"rss_{where}_ratio"],
                1.0,
            )
        )
    return rows


#: The goal of a resumed fit's time against upstream, per (model, upstream strategy, checkpoint kind); 1.0 elsewhere.
#: Issue 30: with the full file mapped, the GPT-2's full resume is to take at most 0.9x ``FSDPStrategy``'s.
RESUME_TIME_GOALS: dict[tuple[str, str, str], float] = {("gpt2", UPSTREAM_FSDP, "full"): 0.9}
#: The goal of the peak RSS a rank adds while restoring a full file, against the bytes of state it keeps.
RESUME_RSS_SHARE_GOAL = 1.0


def _restore_rss_share(samples: Sequence[Sequence[dict[str, float]]]) -> dict[str, Any]:
    """Per repeat, the largest ratio over the ranks of the peak RSS a restore added to the state the rank keeps."""
    ratios = [
        max(_ratio(sample["rss_added_bytes"], sample["share_bytes"]) for sample in ranks)
        for ranks in zip(*samples, strict=True)
    ]
    added = _max_over_ranks([[sample["rss_added_bytes"] for sample in rank] for rank in samples])
    shares = _max_over_ranks([[sample["share_bytes"] for sample in rank] for rank in samples])
    return {"ratio": stats(ratios), "rss_added_bytes": stats(added), "share_bytes": stats(shares)}


def _resume_vs_upstream(
    per_rank: Sequence[dict[str, Any]],
    goals: list[Goal],
    model: str,
    memory: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Resumed fit of ``model`` to first step, ``fsdp2`` against each upstream strategy of :data:`UPSTREAM_PAIRS`,
    per checkpoint kind, and (with ``memory``) the peak RSS each restore added per rank against its share. Keyed by
    upstream strategy, then checkpoint kind."""
    summary: dict[str, Any] = {}
    rss_goals: set[str] = set()
    for peer, pairs in UPSTREAM_PAIRS.items():
        summary[peer] = {}
        for kind, names in pairs.items():
            ours, upstream = (stats(_max_over_ranks([rank[name] for rank in per_rank])) for name in names)
            ratio = _ratio(ours["median"], upstream["median"])
            row: dict[str, Any] = {"strategies": list(names), "ours": ours, "upstream": upstream, "ratio": ratio}
            summary[peer][kind] = row
            goals.append(
                Goal(
                    "resume",
                    UPSTREAM_PEER,
                    f"{MODEL_PREFIXES[model]}{kind} checkpoint: resumed fit to first step, ours"
                    f" / {UPSTREAM_LABELS[peer]}",
                    ratio,
                    RESUME_TIME_GOALS.get((model, peer, kind), 1.0),
                )
            )
            if memory is None:
                continue
            row["ours_rss"], row["upstream_rss"] = (
                _restore_rss_share([rank[name] for rank in memory]) for name in names
            )
            if "fresh_fsdp2" in memory[0]:  # the same window of a fit that restores nothing (resume.FRESH)
                fresh = _max_over_ranks(
                    [[sample["rss_added_bytes"] for sample in rank["fresh_fsdp2"]] for rank in memory]
                )
                row["fresh_rss_added_bytes"] = stats(fresh)
            if kind != "full":
                continue
            for name, side, label in (
                (names[0], "ours_rss", "ours"),
                (names[1], "upstream_rss", UPSTREAM_LABELS[peer]),
            ):
                if name in rss_goals:
                    continue
                rss_goals.add(name)
                goals.append(
                    Goal(
                        "resume",
                        UPSTREAM_PEER,
                        f"{MODEL_PREFIXES[model]}full checkpoint: peak RSS a rank adds restoring / its share, {label}",
                        row[side]["ratio"]["max"],
                        RESUME_RSS_SHARE_GOAL if side == "ours_rss" else None,
                    )
                )
    if FSDP2_READ_WHOLE in per_rank[0]:  # fsdp2's full file read whole, as before it was mapped
        full = summary[UPSTREAM_FSDP]["full"]
        whole = stats(_max_over_ranks([rank[FSDP2_READ_WHOLE] for rank in per_rank]))
        full["read_whole"] = whole
        full["mapped_over_read_whole"] = _ratio(full["ours"]["median"], whole["median"])
        goals.append(
            Goal(
                "resume",
                UPSTREAM_PEER,
                f"{MODEL_PREFIXES[model]}full checkpoint: resumed fit to first step, file mapped / read whole",
                full["mapped_over_read_whole"],
                None,
            )
        )
        if memory is not None:
            full["read_whole_rss"] = _restore_rss_share([rank[FSDP2_READ_WHOLE] for rank in memory])
            goals.append(
                Goal(
                    "resume",
                    UPSTREAM_PEER,
                    f"{MODEL_PREFIXES[model]}full checkpoint: peak RSS a rank adds restoring / its share, read whole",
                    full["read_whole_rss"]["ratio"]["max"],
                    None,
                )
            )
    return summary


def summarize_resume(ranks: Sequence[dict[str, Any]], config: Config, goals: list[Goal]) -> dict[str, Any]:
    per_rank = _results(ranks, "resume")
    summary: dict[str, Any] = {}
    for strategy in config.strategies:
        sides = {
            side: _max_over_ranks([rank[strategy][side] for rank in per_rank]) for side in ("fresh", "resume", "hand")
        }
        added = [resumed - fresh for resumed, fresh in zip(sides["resume"], sides["fresh"], strict=True)]
        rows: dict[str, Any] = {side: stats(values) for side, values in sides.items()}
        rows["resume_minus_fresh"] = stats(added)
        rows["ratio"] = _ratio(rows["resume_minus_fresh"]["median"], rows["hand"]["median"])
        goals.append(Goal("resume", strategy, "(resumed - fresh first-step latency) / hand load", rows["ratio"], 1.2))
        summary[strategy] = rows
    for model, key in _upstream_keys(per_rank[0]):
        memory_key = f"{key}_memory"  # resume.memory_results_key (runs before it had no memory samples)
        memory = [rank[memory_key] for rank in per_rank] if memory_key in per_rank[0] else None
        summary[UPSTREAM_PEER][key] = _resume_vs_upstream([rank[key] for rank in per_rank], goals, model, memory)
    return summary


MEMORY_GOAL = {"fsdp_fairscale": 0.55, "fsdp2": 0.55}


def summarize_memory(ranks: Sequence[dict[str, Any]], config: Config, goals: list[Goal]) -> dict[str, Any]:
    per_rank = _results(ranks, "memory")
    summary: dict[str, Any] = {}
    for strategy in per_rank[0]:
        totals = [sum(rank[strategy].values()) for rank in per_rank]
        summary[strategy] = {"per_rank": [rank[strategy] for rank in per_rank], "total_per_rank": totals}
    ddp = max(summary["ddp"]["total_per_rank"])
    for strategy in config.strategies:
        ratio = _ratio(max(summary[strategy]["total_per_rank"]), ddp)
        summary[strategy]["vs_ddp"] = ratio
        goals.append(
            Goal("memory", strategy, "per-rank params+grads+optimizer bytes / ddp", ratio, MEMORY_GOAL.get(strategy))
        )
    if UPSTREAM_FSDP in summary and UPSTREAM_PEER in config.strategies:
        ratio = _ratio(max(summary[UPSTREAM_PEER]["total_per_rank"]), max(summary[UPSTREAM_FSDP]["total_per_rank"]))
        summary[UPSTREAM_PEER]["vs_upstream_fsdp"] = ratio
        label = UPSTREAM_LABELS[UPSTREAM_FSDP]
        goals.append(
            Goal("memory", UPSTREAM_PEER, f"per-rank params+grads+optimizer bytes, ours / {label}", ratio, 1.0)
        )
    return summary


def loglog_slope(sizes: Sequence[float], seconds: Sequence[float]) -> float:
    """Least-squares slope of log(seconds) against log(size): 1 is linear, 2 quadratic."""
    if len(sizes) < 2:
        return math.nan
    xs = [math.log(size) for size in sizes]
    ys = [math.log(max(value, 1e-9)) for value in seconds]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else math.nan


SCALING_SLOPE_GOAL = 1.2  # linear is 1.0; fixed costs pull it below 1, per-tensor quadratic work pushes it towards 2


def summarize_scaling(ranks: Sequence[dict[str, Any]], config: Config, goals: list[Goal]) -> dict[str, Any]:
    per_rank = _results(ranks, "scaling")
    summary: dict[str, Any] = {}
    for strategy in config.strategies:
        points = []
        for index, point in enumerate(per_rank[0][strategy]):
            save = _max_over_ranks([rank[strategy][index]["save_s"] for rank in per_rank])
            load = _max_over_ranks([rank[strategy][index]["load_s"] for rank in per_rank])
            points.append(
                {
                    **{k: point[k] for k in ("params", "tensors", "checkpoint_bytes")},
                    "save_s": stats(save),
                    "load_s": stats(load),
                }
            )
        upper = points[-3:] if len(points) >= 3 else points  # the sizes where fixed costs no longer dominate
        rows: dict[str, Any] = {"points": points}
        for operation in ("save_s", "load_s"):
            sizes = [float(point["params"]) for point in points]
            times = [point[operation]["median"] for point in points]
            rows[f"{operation}_slope_all"] = loglog_slope(sizes, times)
            rows[f"{operation}_slope_upper"] = loglog_slope(
                [float(point["params"]) for point in upper], [point[operation]["median"] for point in upper]
            )
            largest = points[-1]
            rows[f"{operation}_gb_per_s_largest"] = largest["checkpoint_bytes"] / 1e9 / largest[operation]["median"]
            name = operation.removesuffix("_s")
            goals.append(
                Goal(
                    "scaling",
                    strategy,
                    f"{name} time log-log slope (largest sizes)",
                    rows[f"{operation}_slope_upper"],
                    SCALING_SLOPE_GOAL,
                    "",
                )
            )
        summary[strategy] = rows
    return summary


#: Goal of the asynchronous save benchmark: the step loop blocked per save, asynchronous / synchronous.
ASYNC_BLOCKED_GOAL = 0.25
#: Goal of the asynchronous save benchmark: the steps during a background write / the steps without one.
ASYNC_STEP_GOAL = 1.10


def _steps_during_writes(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The asynchronous fit's step times (the slowest rank per step) split by whether a background write ran alongside:
    *during* — some rank's write was running when the step started (none starts within a step), whether it ended
    within the step or ran through it (counted apart: ``steps_wholly_during_write``); *without* — none was."""
    steps = _max_over_ranks([rank.get("step_s", []) for rank in per_rank])
    writing = list(zip(*(rank.get("writing_at", []) for rank in per_rank), strict=True))
    during = [seconds for seconds, at in zip(steps, writing, strict=True) if any(start for start, _ in at)]
    without = [seconds for seconds, at in zip(steps, writing, strict=True) if not any(start for start, _ in at)]
    rows = {"step_during_write": stats(during), "step_without_write": stats(without)}
    saves = max(len(rank.get("blocked_s", [])) for rank in per_rank)
    # What the writes cost the steps in all (a paced write slows more steps, each less): against the mean step without
    # a write, since a sum of step times is compared (the median of skewed step times would count their tail as cost).
    extra = sum(during) - len(during) * statistics.mean(without) if during and without else math.nan
    return {
        **rows,
        "step_extra_per_save_s": extra / saves if saves else math.nan,
        "steps_wholly_during_write": sum(any(start and end for start, end in at) for at in writing),
        "step_during_write_ratio": _ratio(rows["step_during_write"]["median"], rows["step_without_write"]["median"])
        if during
        else math.nan,
    }


def _steps_after_saves(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The control in the synchronous fit: the steps right after a save against the others (the slowest rank)."""
    steps = _max_over_ranks([rank.get("step_s", []) for rank in per_rank])
    after = per_rank[0].get("after_save", [False] * len(steps))  # every rank saves at the same steps
    return {
        "sync_step_after_save": stats([seconds for seconds, saved in zip(steps, after, strict=True) if saved]),
        "sync_step_not_after_save": stats([seconds for seconds, saved in zip(steps, after, strict=True) if not saved]),
    }


def async_rows(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One asynchronous-save variant's figures from each rank's results of it (``async_save.measure``)."""
    rows: dict[str, Any] = {}
    for side in ("sync", "async"):
        # A save blocks the run as long as its slowest rank blocks (the next collective waits for it).
        blocked = _max_over_ranks([rank[side]["blocked_s"] for rank in per_rank])
        rows[side] = stats(blocked)
        rows[f"{side}_end_of_fit"] = max(rank[side]["end_of_fit_s"] for rank in per_rank)
    rows["staged_bytes_per_rank"] = [rank["staged_bytes"] for rank in per_rank]
    rows["write_cpu_per_rank"] = [stats(rank["async"].get("write_cpu_s", [])) for rank in per_rank]
    rows["blocked_ratio"] = _ratio(rows["async"]["median"], rows["sync"]["median"])
    rows.update(_steps_during_writes([rank["async"] for rank in per_rank]))
    rows.update(_steps_after_saves([rank["sync"] for rank in per_rank]))
    return rows


def async_goals(benchmark: str, strategy: str, label: str, rows: dict[str, Any], goals: list[Goal]) -> None:
    """The goals of one asynchronous-save variant (:func:`async_rows`)."""
    goals.append(
        Goal(
            benchmark,
            strategy,
            f"{label}: step loop blocked per save, async_save=True / synchronous",
            rows["blocked_ratio"],
            ASYNC_BLOCKED_GOAL,
        )
    )
    if math.isfinite(rows["step_during_write_ratio"]):  # a smoke run's single save has no step after it
        goals.append(
            Goal(
                benchmark,
                strategy,
                f"{label}: step time during a background write / without",
                rows["step_during_write_ratio"],
                ASYNC_STEP_GOAL,
            )
        )
    goals.append(
        Goal(
            benchmark,
            strategy,
            f"{label}: CPU staging copy, rank 0 (MB)",
            rows["staged_bytes_per_rank"][0] / 1e6,
            None,
            " MB",
        )
    )


def summarize_async_save(ranks: Sequence[dict[str, Any]], config: Config, goals: list[Goal]) -> dict[str, Any]:
    per_rank = _results(ranks, "async_save")
    summary: dict[str, Any] = {}
    for variant in per_rank[0]:
        rows = async_rows([rank[variant] for rank in per_rank])
        summary[variant] = rows
        strategy, rest = variant.split("/", 1)
        kind, _, model = rest.partition("@")
        async_goals("async_save", strategy, f"{'GPT-2 ' if model == 'gpt2' else ''}{kind}", rows, goals)
    return summary


#: Goals of the store benchmark: a remote save over the faster plain upload of the same bytes, a remote resume's
#: restore over the plain download of what it reads; the peak RSS a remote full save adds on rank 0 over the file.
STORE_TIME_GOAL = 1.15
STORE_RSS_GOAL = 1.25


def _not_supported(goals: list[Goal], strategy: str, figure: str, goal: float, error: str) -> None:
    """A figure the package cannot measure yet: its error's type in the table (the message under the store's)."""
    goals.append(Goal("store", strategy, figure, math.nan, goal, note=f"not supported: {error.split(':', 1)[0]}"))


def summarize_store(ranks: Sequence[dict[str, Any]], config: Config, goals: list[Goal]) -> dict[str, Any]:
    """Per variant of ``benchmarks.store``: the sides' times (slowest rank), the ratios against the plain transfers,
    rank 0's peak RSS per checkpoint byte, and the asynchronous saves on the store."""
    per_rank = _results(ranks, "store")
    summary: dict[str, Any] = {}
    for variant, first in per_rank[0].items():
        strategy, kind = variant.split("/", 1)
        size = float(first["checkpoint_bytes"])
        rows: dict[str, Any] = {"checkpoint_bytes": size, "error": first["error"]}
        for side in first["save"]:
            samples = [rank[variant]["save"][side] for rank in per_rank]
            rows[side] = _save_side(samples, int(size))
        plain = min(rows["put_file"]["seconds"]["median"], rows["pipe"]["seconds"]["median"])
        rows["plain_upload_s"] = plain
        sides = {
            side: _max_over_ranks([rank[variant]["resume"][side] for rank in per_rank]) for side in first["resume"]
        }
        resume: dict[str, Any] = {side: stats(values) for side, values in sides.items()}
        for side in ("remote", "local"):
            if sides[side] and sides["fresh"]:
                restore = [resumed - fresh for resumed, fresh in zip(sides[side], sides["fresh"], strict=True)]
                resume[f"{side}_restore"] = stats(restore)
        rows["resume"] = resume
        rows["resume_error"] = first["resume_error"]
        save_figure = f"{kind}: remote save / plain upload of the same bytes"
        resume_figure = f"{kind}: remote resume (resumed - fresh first step) / plain download"
        rss_figure = "full: peak RSS added on rank 0 by a remote save / file size"
        if first["error"] is None:
            rows["save_ratio"] = _ratio(rows["remote"]["seconds"]["median"], plain)
            rows["save_over_local_plus_upload"] = _ratio(
                rows["remote"]["seconds"]["median"], rows["local"]["seconds"]["median"] + plain
            )
            goals.append(Goal("store", strategy, save_figure, rows["save_ratio"], STORE_TIME_GOAL))
            goals.append(
                Goal(
                    "store",
                    strategy,
                    f"{kind}: remote save / (local save + plain upload)",
                    rows["save_over_local_plus_upload"],
                    None,
                )
            )
            if kind == "full":
                rows["rss_rank0_per_checkpoint_byte"] = rows["remote"]["rss_added_rank0_bytes"]["max"] / size
                goals.append(Goal("store", strategy, rss_figure, rows["rss_rank0_per_checkpoint_byte"], STORE_RSS_GOAL))
        else:
            _not_supported(goals, strategy, save_figure, STORE_TIME_GOAL, first["error"])
            if kind == "full":
                _not_supported(goals, strategy, rss_figure, STORE_RSS_GOAL, first["error"])
        if first["resume_error"] is None:
            download = resume["download"]["median"]
            rows["resume_ratio"] = _ratio(resume["remote_restore"]["median"], download)
            rows["resume_store_part_ratio"] = _ratio(
                resume["remote_restore"]["median"] - resume["local_restore"]["median"], download
            )
            goals.append(Goal("store", strategy, resume_figure, rows["resume_ratio"], STORE_TIME_GOAL))
            goals.append(
                Goal(
                    "store",
                    strategy,
                    f"{kind}: remote resume - local resume, / plain download",
                    rows["resume_store_part_ratio"],
                    None,
                )
            )
            if resume.get("download_all", {}).get("n"):
                rows["resume_over_download_all"] = _ratio(
                    resume["remote_restore"]["median"], resume["download_all"]["median"]
                )
                goals.append(
                    Goal(
                        "store",
                        strategy,
                        f"{kind}: remote resume / plain download of every file by every rank",
                        rows["resume_over_download_all"],
                        None,
                    )
                )
        else:
            _not_supported(goals, strategy, resume_figure, STORE_TIME_GOAL, first["resume_error"])
        if "async" in first:
            if "error" in first["async"]:
                rows["async"] = {"error": first["async"]["error"]}
                for figure, goal in (
                    ("step loop blocked per save, async_save=True / synchronous", ASYNC_BLOCKED_GOAL),
                    ("step time during a background write / without", ASYNC_STEP_GOAL),
                ):
                    _not_supported(goals, strategy, f"{kind} on the store: {figure}", goal, first["async"]["error"])
            else:
                rows["async"] = async_rows([rank[variant]["async"] for rank in per_rank])
                async_goals("store", strategy, f"{kind} on the store", rows["async"], goals)
        summary[variant] = rows
    return summary


SUMMARIZERS = {
    "overhead": summarize_overhead,
    "save": summarize_save,
    "resume": summarize_resume,
    "memory": summarize_memory,
    "scaling": summarize_scaling,
    "async_save": summarize_async_save,
    "store": summarize_store,
}


def summarize(ranks: Sequence[dict[str, Any]], config: Config) -> tuple[dict[str, Any], list[Goal]]:
    """Summaries per benchmark and every figure against its goal, in benchmark order."""
    goals: list[Goal] = []
    summary = {name: SUMMARIZERS[name](ranks, config, goals) for name in config.benchmarks}
    return summary, goals


def _value(goal: Goal) -> str:
    if goal.note is not None:
        return goal.note.replace("|", "\\|")
    return f"{goal.value:.2f}{goal.unit}" if math.isfinite(goal.value) else str(goal.value)


def markdown_table(goals: Sequence[Goal]) -> str:
    """The goals as a Markdown table (informational figures say so)."""
    lines = ["| benchmark | strategy | figure | value | goal | met |", "|---|---|---|---|---|---|"]
    for goal in goals:
        target = "informational" if goal.goal is None else f"≤ {goal.goal:.2f}{goal.unit}"
        met = "" if goal.met is None else ("yes" if goal.met else ("-" if goal.note else "**no**"))
        lines.append(f"| {goal.benchmark} | `{goal.strategy}` | {goal.figure} | {_value(goal)} | {target} | {met} |")
    return "\n".join(lines)


def _peer_name(peer: str) -> str:
    """``ModelParallelStrategy`` for the upstream strategy whose label is ``upstream ModelParallelStrategy``."""
    return UPSTREAM_LABELS[peer].removeprefix("upstream ")


def _peers() -> str:
    """The upstream strategies ``fsdp2`` is compared with, for a table's title."""
    return "upstream " + " and ".join(_peer_name(peer) for peer in UPSTREAM_PAIRS)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def details_markdown(summary: dict[str, Any]) -> str:
    """Medians with min-max of the measured times, per benchmark (what the ratios are made of)."""
    parts: list[str] = []

    def span(row: dict[str, float]) -> str:
        return f"{_ms(row['median'])} ({_ms(row['min'])}-{_ms(row['max'])})"

    if "overhead" in summary:
        lines = ["| variant | step ms, median (min-max of run medians) | step-to-step ms |", "|---|---|---|"]
        for name, row in summary["overhead"]["variants"].items():
            lines.append(f"| `{name}` | {span(row['step_s'])} | {span(row['period_s'])} |")
        parts.append("**Step time**\n\n" + "\n".join(lines))
    if "save" in summary:
        lines = [
            "| strategy | ours ms | by hand ms | by hand + fsync ms | checkpoint MB"
            " | RSS added rank 0 / rank 1 MB, ours | by hand |",
            "|---|---|---|---|---|---|---|",
        ]

        def rss(row: dict[str, Any]) -> str:
            rank0, others = row["rss_added_rank0_bytes"]["max"], row["rss_added_other_ranks_bytes"]["max"]
            return f"{rank0 / 1e6:.1f} / {others / 1e6:.1f}"

        for strategy, row in summary["save"].items():
            ours = row["ours"]
            lines.append(
                f"| `{strategy}` | {span(ours['seconds'])} | {span(row['hand']['seconds'])} |"
                f" {span(row['hand_atomic']['seconds'])} | {ours['checkpoint_bytes'] / 1e6:.1f} | {rss(ours)} |"
                f" {rss(row['hand'])} |"
            )
        parts.append("**Full checkpoint save**\n\n" + "\n".join(lines))
        upstream_saves = _upstream_rows(summary["save"])
        if upstream_saves:
            lines = [
                "| model | upstream | checkpoint | strategies (ours / upstream) | ours ms | upstream ms"
                " | MB on disk, ours / upstream | RSS added rank 0 / rank 1 MB, ours | upstream |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for model, peer, kind, row in upstream_saves:
                ours, upstream = row["ours"], row["upstream"]
                lines.append(
                    f"| {model} | {_peer_name(peer)} | {kind} |"
                    f" {' / '.join(f'`{name}`' for name in row['strategies'])} |"
                    f" {span(ours['seconds'])} | {span(upstream['seconds'])} |"
                    f" {ours['checkpoint_bytes'] / 1e6:.1f} / {upstream['checkpoint_bytes'] / 1e6:.1f} |"
                    f" {rss(ours)} | {rss(upstream)} |"
                )
            parts.append(f"**Save against {_peers()}**\n\n" + "\n".join(lines))
    if "resume" in summary:
        lines = [
            "| strategy | fresh fit → first step ms | resumed fit → first step ms | load by hand ms |",
            "|---|---|---|---|",
        ]
        for strategy, row in summary["resume"].items():
            lines.append(f"| `{strategy}` | {span(row['fresh'])} | {span(row['resume'])} | {span(row['hand'])} |")
        parts.append("**Resume**\n\n" + "\n".join(lines))
        upstream_resumes = _upstream_rows(summary["resume"])
        if upstream_resumes:
            lines = [
                "| model | upstream | checkpoint | strategies (ours / upstream) | ours: resumed fit → first step ms"
                " | upstream ms | restore's peak RSS added / share per rank (MB), ours | upstream |",
                "|---|---|---|---|---|---|---|---|",
            ]

            def restore_rss(row: dict[str, Any] | None) -> str:
                if row is None:
                    return "-"
                added, share = row["rss_added_bytes"]["max"], row["share_bytes"]["max"]
                return f"{row['ratio']['max']:.2f}x ({added / 1e6:.1f} / {share / 1e6:.1f})"

            fresh_rows = [
                (model, row["fresh_rss_added_bytes"])
                for model, _, _, row in upstream_resumes
                if "fresh_rss_added_bytes" in row
            ]
            for model, peer, kind, row in upstream_resumes:
                names = " / ".join(f"`{name}`" for name in row["strategies"])
                lines.append(
                    f"| {model} | {_peer_name(peer)} | {kind} | {names} | {span(row['ours'])} |"
                    f" {span(row['upstream'])} | {restore_rss(row.get('ours_rss'))} |"
                    f" {restore_rss(row.get('upstream_rss'))} |"
                )
            for model, _, _, row in upstream_resumes:
                if "read_whole" in row:
                    rss_note = f", {restore_rss(row['read_whole_rss'])} RSS" if "read_whole_rss" in row else ""
                    lines.append(
                        f"\n{model}: `{FSDP2_READ_WHOLE}` (the same full file read whole, through Lightning's"
                        f" `TorchCheckpointIO`) {span(row['read_whole'])} ms{rss_note}."
                    )
            fresh_note = ", ".join(f"{model} {added['max'] / 1e6:.1f} MB" for model, added in dict(fresh_rows).items())
            if fresh_note:
                lines.append(
                    "\nThe same window of a fresh `fsdp2` fit (no restore, no optimizer state yet) adds up to"
                    f" {fresh_note}."
                )
            parts.append(f"**Resume against {_peers()}**\n\n" + "\n".join(lines))
    if "memory" in summary:
        lines = ["| strategy | rank 0 params / grads / optimizer MB | total MB per rank |", "|---|---|---|"]
        for strategy, row in summary["memory"].items():
            first = row["per_rank"][0]
            totals = " / ".join(f"{total / 1e6:.1f}" for total in row["total_per_rank"])
            name = f"`{strategy}`" + (f" ({UPSTREAM_LABELS[strategy]})" if strategy in UPSTREAM_LABELS else "")
            lines.append(
                f"| {name} | {first['params'] / 1e6:.1f} / {first['grads'] / 1e6:.1f} /"
                f" {first['optimizer'] / 1e6:.1f} | {totals} |"
            )
        parts.append("**Training state per rank**\n\n" + "\n".join(lines))
    if "scaling" in summary:
        lines = ["| strategy | parameters | checkpoint MB | save ms | load ms |", "|---|---|---|---|---|"]
        for strategy, row in summary["scaling"].items():
            for point in row["points"]:
                lines.append(
                    f"| `{strategy}` | {point['params'] / 1e6:.1f} M | {point['checkpoint_bytes'] / 1e6:.0f} |"
                    f" {_ms(point['save_s']['median'])} | {_ms(point['load_s']['median'])} |"
                )
        parts.append("**Scaling**\n\n" + "\n".join(lines))
    if "async_save" in summary:
        lines = [
            "| strategy / format | blocked per save, synchronous ms | asynchronous ms | async / sync"
            " | end of fit (last commit) ms, sync / async | staging copy MB, rank 0 / rank 1"
            " | step ms during a background write (steps) | step ms without (steps)"
            " | synchronous fit: step ms after a save (steps) | other steps ms (steps)"
            " | steps' extra time per save ms | background thread CPU ms per save, rank 0 / rank 1 |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]

        def steps(row: dict[str, float]) -> str:
            return f"{span(row)} ({row['n']})" if row["n"] else "-"

        for variant, row in summary["async_save"].items():
            staged = " / ".join(f"{value / 1e6:.1f}" for value in row["staged_bytes_per_rank"])
            cpu = " / ".join(
                _ms(rank["median"]) if rank.get("n") else "-" for rank in row.get("write_cpu_per_rank", [])
            )
            lines.append(
                f"| `{variant}` | {span(row['sync'])} | {span(row['async'])} | {row['blocked_ratio']:.2f} |"
                f" {_ms(row['sync_end_of_fit'])} / {_ms(row['async_end_of_fit'])} | {staged} |"
                f" {steps(row['step_during_write'])} | {steps(row['step_without_write'])} |"
                f" {steps(row['sync_step_after_save'])} | {steps(row['sync_step_not_after_save'])} |"
                f" {_ms(row.get('step_extra_per_save_s', math.nan))} | {cpu} |"
            )
        parts.append("**Asynchronous saves: the step loop blocked per save**\n\n" + "\n".join(lines))
    if "store" in summary:
        parts.append(store_markdown(summary["store"], span))
    return "\n\n".join(parts)


def store_markdown(summary: dict[str, Any], span: Any) -> str:
    """The store benchmark's tables: saves, resumes and asynchronous saves against the plain s3fs transfers."""

    def cell(row: dict[str, Any], side: str) -> str:
        return span(row[side]["seconds"]) if row[side]["seconds"]["n"] else "-"

    def times(row: dict[str, Any]) -> str:
        return span(row) if row["n"] else "-"

    def ratio(row: dict[str, Any], key: str) -> str:
        return f"{row[key]:.2f}" if key in row else "-"

    save = [
        "| strategy / format | checkpoint MB | remote save ms | local save ms | plain `put_file` ms | plain `pipe` ms"
        " | remote / plain | RSS added rank 0 / rank 1 MB, remote | rank 0 / file |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    resume = [
        "| strategy / format | fresh fit → first step ms | resumed from the store ms | from the local file ms"
        " | plain download ms | every file on every rank ms | restore from the store ms | restore from the file ms"
        " | store restore / download |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    background = [
        "| strategy / format | blocked per save, synchronous ms | asynchronous ms | async / sync"
        " | step ms during a background write (steps) | step ms without (steps) | during / without |",
        "|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for variant, row in summary.items():
        remote = row["remote"]
        rank0, others = remote["rss_added_rank0_bytes"]["max"], remote["rss_added_other_ranks_bytes"]["max"]
        rss = f"{rank0 / 1e6:.1f} / {others / 1e6:.1f}" if remote["seconds"]["n"] else "-"
        save.append(
            f"| `{variant}` | {row['checkpoint_bytes'] / 1e6:.1f} | {cell(row, 'remote')} | {cell(row, 'local')} |"
            f" {cell(row, 'put_file')} | {cell(row, 'pipe')} | {ratio(row, 'save_ratio')} | {rss} |"
            f" {ratio(row, 'rss_rank0_per_checkpoint_byte')} |"
        )
        sides = row["resume"]
        restore = {side: sides.get(f"{side}_restore") for side in ("remote", "local")}
        resume.append(
            f"| `{variant}` | {times(sides['fresh'])} | {times(sides['remote'])} | {times(sides['local'])} |"
            f" {times(sides['download'])} | {times(sides['download_all'])} |"
            f" {times(restore['remote']) if restore['remote'] else '-'} |"
            f" {times(restore['local']) if restore['local'] else '-'} | {ratio(row, 'resume_ratio')} |"
        )
        if row["error"] is not None:
            notes.append(f"`{variant}`: saves to the store not supported: {row['error']}")
        elif row["resume_error"] is not None:
            notes.append(f"`{variant}`: resumes from the store not supported: {row['resume_error']}")
        if "async" in row and "error" not in row["async"]:
            rows = row["async"]
            during = rows["step_during_write"]
            background.append(
                f"| `{variant}` | {span(rows['sync'])} | {span(rows['async'])} | {rows['blocked_ratio']:.2f} |"
                f" {times(during)} ({during['n']}) | {times(rows['step_without_write'])}"
                f" ({rows['step_without_write']['n']}) | {rows['step_during_write_ratio']:.2f} |"
            )
    text = "**Checkpoints on the store: saves**\n\n" + "\n".join(save)
    text += "\n\n**Checkpoints on the store: resumes**\n\n" + "\n".join(resume)
    if len(background) > 2:
        text += "\n\n**Checkpoints on the store: asynchronous saves**\n\n" + "\n".join(background)
    if notes:
        text += "\n\n" + "\n".join(f"- {note}" for note in notes)
    return text
