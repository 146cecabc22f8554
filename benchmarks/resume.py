"""Benchmark 3: fit(ckpt_path=...) start to first step, against a fresh fit and against loading by hand; and
``fsdp2`` against upstream's ``ModelParallelStrategy`` and ``FSDPStrategy``, each resuming its own full and sharded
checkpoints, with the peak RSS each rank adds while restoring against the state it keeps (its share)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist
from pytorch_lightning.strategies import Strategy

from . import by_hand
from .config import FSDP2_READ_WHOLE, UPSTREAM_PEER, Config, shards_itself, upstream_results_key
from .lightning_side import FirstStepLatency, raw_optimizer, strategy_for, trainer
from .measure import (
    barrier,
    peak_rss_bytes,
    release_free_memory,
    reset_peak_rss,
    rss_bytes,
    timed,
    training_state_bytes,
)
from .models import BenchModule, lightning_loader, new_model, workload
from .save import (
    SAVE_STEPS,
    checkpoint_paths,
    save_checkpoints,
    save_once,
    upstream_pair_names,
    upstream_pair_path,
)


class RestoreMemory(pl.Callback):
    """The peak RSS this rank adds from ``on_fit_start`` (the strategy has set up; nothing is restored yet) to the
    first ``on_train_batch_start`` (restored), and the bytes of parameters and optimizer state the rank then holds
    (its share of the checkpoint's state). Freed memory is returned to the OS first, so that the restore cannot reuse
    pages still resident; the seconds that takes are reported, to be taken off the fit's latency."""

    def __init__(self) -> None:
        self.before = 0
        self.probe_seconds = 0.0
        self.sample: dict[str, float] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        start = time.perf_counter()
        release_free_memory()
        self.before = rss_bytes()
        reset_peak_rss()
        self.probe_seconds = time.perf_counter() - start

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.sample:
            return
        added = max(0, peak_rss_bytes() - self.before)
        wrapper = trainer.strategy.model if trainer.strategy.model is not None else pl_module
        kept = training_state_bytes(wrapper.parameters(), raw_optimizer(trainer.strategy.optimizers[0]))
        self.sample = {"rss_added_bytes": float(added), "share_bytes": float(kept["params"] + kept["optimizer"])}


def first_step(
    config: Config,
    strategy: str,
    checkpoint: Path | str | None,
    model: str = "mlp",
    build: Callable[[BenchModule], str | Strategy] | None = None,
) -> tuple[float, dict[str, float]]:
    """Seconds from ``fit`` to the first step (without the memory probe's own time) and :class:`RestoreMemory`'s
    sample. ``build`` makes the strategy for the module (default: ``strategy_for(strategy, module)``); ``checkpoint``
    may be a URL."""
    work = workload(config, model)
    data = work.data(work.batch_size * dist.get_world_size() * SAVE_STEPS)
    # Other weights than saved (seed 8): a resume must change them.
    model = work.new_model(seed=8, shards_itself=shards_itself(strategy))
    release_free_memory()
    barrier()
    memory = RestoreMemory()
    latency = FirstStepLatency(time.perf_counter())
    # The checkpoint was saved at the end of epoch 0; a resumed fit trains epoch 1, a fresh one epoch 0.
    made = build(model) if build is not None else strategy_for(strategy, model)
    trainer(made, [memory, latency], max_epochs=2 if checkpoint else 1).fit(
        model, train_dataloaders=lightning_loader(data, work.batch_size), ckpt_path=checkpoint
    )
    if latency.latency is None:
        raise RuntimeError(f"{strategy}: the fit ran no training step (checkpoint {checkpoint}).")
    return latency.latency - memory.probe_seconds, memory.sample


def _first_step_latency(config: Config, strategy: str, checkpoint: Path | None, model: str = "mlp") -> float:
    return first_step(config, strategy, checkpoint, model)[0]


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
            key = upstream_results_key(model)
            results[key], results[memory_results_key(model)] = resume_against_upstream(config, workdir, model)
    return results


#: The memory samples of a fresh ``fsdp2`` fit (no checkpoint) among the resumes' (:func:`resume_against_upstream`).
FRESH = "fresh_fsdp2"


def memory_results_key(model: str) -> str:
    """Where the resume benchmark's results hold the restores' memory samples against upstream on ``model``."""
    return f"{upstream_results_key(model)}_memory"


def resume_against_upstream(
    config: Config, workdir: Path, model: str = "mlp"
) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]]]:
    """Resumed fit of ``model`` to first step for each strategy of ``save.UPSTREAM_PAIRS`` from its own checkpoint
    (saved by the save benchmark, or here when it did not run), ``config.repeats`` times in an order that rotates
    each repeat; and the memory each restore added (:class:`RestoreMemory`)."""
    names = upstream_pair_names()
    for name in names:
        path = upstream_pair_path(workdir, name, model)
        if not path.exists():
            save_once(config, name, path, model)
    # fsdp2's full file once more, read whole (as before it was mapped), in the same rotation.
    paths = {name: upstream_pair_path(workdir, name, model) for name in names}
    paths[FSDP2_READ_WHOLE] = paths[UPSTREAM_PEER]
    names = [*names, FSDP2_READ_WHOLE]
    samples: dict[str, list[float]] = {name: [] for name in names}
    memory: dict[str, list[dict[str, float]]] = {name: [] for name in [*names, FRESH]}
    for repeat in range(config.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, added = first_step(config, name, paths[name], model)
            samples[name].append(seconds)
            memory[name].append(added)
        # What the same window adds without a restore (the optimizers' state is not created until the first step).
        memory[FRESH].append(first_step(config, UPSTREAM_PEER, None, model)[1])
    return samples, memory
