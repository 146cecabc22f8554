"""Benchmark 1: step time of Trainer + strategy against a hand-written loop with the same wrapper and data.

The MLP runs under every strategy of ours, its hand-written loop, upstream ``ddp`` and upstream
``ModelParallelStrategy``; the GPT-2 under ``fsdp2``, its hand-written loop and ``ModelParallelStrategy``, all three
sharded per transformer block and then at the root.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import by_hand
from .config import MODEL_PARALLEL, UPSTREAM_PEER, Config, shards_itself
from .lightning_side import StepTimer, strategy_for, trainer
from .measure import barrier, release_free_memory
from .models import hand_loader, lightning_loader, workload


@dataclass(frozen=True)
class Variant:
    """One measured way of training: who drives the steps, with which strategy, on which model.

    Attributes:
        side: ``ours`` (Trainer + our strategy), ``hand`` (hand-written loop) or ``upstream`` (Trainer + upstream's).
        strategy: The strategy's name (``ddp`` and ``model_parallel`` for upstream's).
        model: ``mlp`` or ``gpt2``.
    """

    side: str
    strategy: str
    model: str = "mlp"

    @property
    def name(self) -> str:
        """``side:strategy`` for the MLP, ``side:strategy@model`` for another model."""
        base = f"{self.side}:{self.strategy}"
        return base if self.model == "mlp" else f"{base}@{self.model}"


def _periods(starts: list[float]) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(starts)]


def run_lightning(config: Config, variant: Variant) -> dict[str, list[float]]:
    """Step times of one fit with the variant's strategy (ours or upstream's), warm-up steps dropped."""
    work = workload(config, variant.model)
    steps = config.warmup_steps + config.timed_steps
    data = work.data(work.batch_size * dist.get_world_size() * steps)
    model = work.new_model(shards_itself=shards_itself(variant.strategy))
    timer = StepTimer()
    trainer(strategy_for(variant.strategy, model), [timer], max_epochs=1).fit(
        model, train_dataloaders=lightning_loader(data, work.batch_size)
    )
    return {
        "step_s": timer.durations[config.warmup_steps :],
        "period_s": _periods(timer.starts)[config.warmup_steps :],
    }


def run_hand(config: Config, variant: Variant) -> dict[str, list[float]]:
    """Step times of the same training written by hand with the strategy's wrapper, over the same boundaries."""
    work = workload(config, variant.model)
    steps = config.warmup_steps + config.timed_steps
    data = work.data(work.batch_size * dist.get_world_size() * steps)
    loader = hand_loader(data, work.batch_size, dist.get_rank(), dist.get_world_size())
    module = work.new_model()
    module.train()
    wrapped = by_hand.wrap(variant.strategy, module)
    starts: list[float] = []
    durations: list[float] = []
    try:
        for x, y in loader:
            starts.append(time.perf_counter())
            by_hand.train_step(wrapped, x, y, module.loss)
            durations.append(time.perf_counter() - starts[-1])
    finally:
        wrapped.close()
    return {"step_s": durations[config.warmup_steps :], "period_s": _periods(starts)[config.warmup_steps :]}


def variants(config: Config) -> list[Variant]:
    """MLP: ``ours`` and ``hand`` for each strategy, then upstream ``ddp`` and (with ``fsdp2``) upstream
    ``model_parallel``; GPT-2 (with ``fsdp2``): ``ours``, ``hand`` and upstream ``model_parallel``."""
    peer = UPSTREAM_PEER in config.strategies
    found: list[Variant] = []
    if "mlp" in config.overhead_models:
        found += [Variant(side, strategy) for strategy in config.strategies for side in ("ours", "hand")]
        found.append(Variant("upstream", "ddp"))
        if peer:
            found.append(Variant("upstream", MODEL_PARALLEL))
    for model in config.overhead_models:
        if model != "mlp" and peer:
            found += [
                Variant("ours", UPSTREAM_PEER, model),
                Variant("hand", UPSTREAM_PEER, model),
                Variant("upstream", MODEL_PARALLEL, model),
            ]
    return found


def run(config: Config, workdir: Path) -> dict[str, Any]:
    """Every variant ``config.repeats`` times, in an order that rotates each repeat (alternating, not blocked)."""
    all_variants = variants(config)
    runs: dict[str, list[dict[str, list[float]]]] = {variant.name: [] for variant in all_variants}
    for repeat in range(config.repeats):
        shift = repeat % len(all_variants)
        for variant in all_variants[shift:] + all_variants[:shift]:
            release_free_memory()
            barrier()
            measure = run_hand if variant.side == "hand" else run_lightning
            runs[variant.name].append(measure(config, variant))
    return {"runs": runs}
