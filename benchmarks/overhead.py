"""Benchmark 1: step time of Trainer + strategy against a hand-written loop with the same wrapper and data."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import by_hand
from .config import Config
from .lightning_side import StepTimer, trainer
from .measure import barrier, release_free_memory
from .models import dataset, hand_loader, lightning_loader, loss_of, new_model


def _periods(starts: list[float]) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(starts)]


def run_lightning(config: Config, strategy: str) -> dict[str, list[float]]:
    """Step times of one fit with ``strategy`` (ours or upstream's ``ddp``), warm-up steps dropped."""
    steps = config.warmup_steps + config.timed_steps
    data = dataset(config.width, config.batch_size * dist.get_world_size() * steps)
    timer = StepTimer()
    trainer(strategy, [timer], max_epochs=1).fit(
        new_model(config.width, config.depth), train_dataloaders=lightning_loader(data, config.batch_size)
    )
    return {
        "step_s": timer.durations[config.warmup_steps :],
        "period_s": _periods(timer.starts)[config.warmup_steps :],
    }


def run_hand(config: Config, strategy: str) -> dict[str, list[float]]:
    """Step times of the same training written by hand with the strategy's wrapper, over the same boundaries."""
    steps = config.warmup_steps + config.timed_steps
    data = dataset(config.width, config.batch_size * dist.get_world_size() * steps)
    loader = hand_loader(data, config.batch_size, dist.get_rank(), dist.get_world_size())
    module = new_model(config.width, config.depth)
    module.train()
    wrapped = by_hand.wrap(strategy, module)
    starts: list[float] = []
    durations: list[float] = []
    try:
        for x, y in loader:
            starts.append(time.perf_counter())
            by_hand.train_step(wrapped, x, y, loss_of)
            durations.append(time.perf_counter() - starts[-1])
    finally:
        wrapped.close()
    return {"step_s": durations[config.warmup_steps :], "period_s": _periods(starts)[config.warmup_steps :]}


def variants(config: Config) -> list[str]:
    """``ours:<strategy>`` and ``hand:<strategy>`` for each strategy, then upstream ``ddp``."""
    names = [f"{side}:{strategy}" for strategy in config.strategies for side in ("ours", "hand")]
    return [*names, "upstream:ddp"]


def run(config: Config, workdir: Path) -> dict[str, Any]:
    """Every variant ``config.repeats`` times, in an order that rotates each repeat (alternating, not blocked)."""
    names = variants(config)
    runs: dict[str, list[dict[str, list[float]]]] = {name: [] for name in names}
    for repeat in range(config.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            side, strategy = name.split(":")
            release_free_memory()
            barrier()
            runs[name].append(run_hand(config, strategy) if side == "hand" else run_lightning(config, strategy))
    return {"runs": runs}
