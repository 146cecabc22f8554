"""Benchmark 3: fit(ckpt_path=...) start to first step, against a fresh fit and against loading by hand; and
``fsdp2`` against upstream's ``ModelParallelStrategy`` and ``FSDPStrategy``, each resuming its own full and sharded
checkpoints."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import by_hand
from .config import UPSTREAM_PEER, Config, shards_itself, upstream_results_key
from .lightning_side import FirstStepLatency, strategy_for, trainer
from .measure import barrier, release_free_memory, timed
from .models import lightning_loader, new_model, workload
from .save import (
    SAVE_STEPS,
    checkpoint_paths,
    save_checkpoints,
    save_once,
    upstream_pair_names,
    upstream_pair_path,
)


def _first_step_latency(config: Config, strategy: str, checkpoint: Path | None, model: str = "mlp") -> float:
    work = workload(config, model)
    data = work.data(work.batch_size * dist.get_world_size() * SAVE_STEPS)
    # Other weights than saved (seed 8): a resume must change them.
    model = work.new_model(seed=8, shards_itself=shards_itself(strategy))
    release_free_memory()
    barrier()
    latency = FirstStepLatency(time.perf_counter())
    # The checkpoint was saved at the end of epoch 0; a resumed fit trains epoch 1, a fresh one epoch 0.
    trainer(strategy_for(strategy, model), [latency], max_epochs=2 if checkpoint else 1).fit(
        model, train_dataloaders=lightning_loader(data, work.batch_size), ckpt_path=checkpoint
    )
    if latency.latency is None:
        raise RuntimeError(f"{strategy}: the fit ran no training step (checkpoint {checkpoint}).")
    return latency.latency


def _load_by_hand(config: Config, strategy: str, path: Path) -> float:
    wrapped = by_hand.wrap(strategy, new_model(config.width, config.depth, seed=8))
    try:
        release_free_memory()
        return timed(lambda: by_hand.load(wrapped, path))
    finally:
        wrapped.close()


def run(config: Config, workdir: Path) -> dict[str, Any]:
    """Fresh fit, resumed fit and hand load per strategy, ``config.repeats`` times, rotating the order."""
    results: dict[str, Any] = {}
    for strategy in config.strategies:
        ours, hand = checkpoint_paths(workdir, strategy)
        if not (ours.exists() and hand.exists()):
            save_checkpoints(config, strategy, workdir, repeats=1)
        sides = ["fresh", "resume", "hand"]
        samples: dict[str, list[float]] = {side: [] for side in sides}
        for repeat in range(config.repeats):
            shift = repeat % len(sides)
            for side in sides[shift:] + sides[:shift]:
                if side == "hand":
                    samples[side].append(_load_by_hand(config, strategy, hand))
                else:
                    samples[side].append(_first_step_latency(config, strategy, ours if side == "resume" else None))
        results[strategy] = samples
    if UPSTREAM_PEER in config.strategies:
        for model in config.upstream_checkpoint_models:
            results[upstream_results_key(model)] = resume_against_upstream(config, workdir, model)
    return results


def resume_against_upstream(config: Config, workdir: Path, model: str = "mlp") -> dict[str, list[float]]:
    """Resumed fit of ``model`` to first step for each strategy of ``save.UPSTREAM_PAIRS`` from its own checkpoint
    (saved by the save benchmark, or here when it did not run), ``config.repeats`` times in an order that rotates
    each repeat."""
    names = upstream_pair_names()
    for name in names:
        path = upstream_pair_path(workdir, name, model)
        if not path.exists():
            save_once(config, name, path, model)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(config.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(_first_step_latency(config, name, upstream_pair_path(workdir, name, model), model))
    return samples
