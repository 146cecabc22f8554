"""Benchmark 2: ``trainer.save_checkpoint`` against the wrapper's own gather + ``torch.save``, time and peak RSS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist

from . import by_hand
from .config import Config
from .lightning_side import trainer, wrapped_by_strategy
from .measure import timed_with_peak
from .models import dataset, lightning_loader, new_model

SAVE_STEPS = 2  # steps before saving, so the optimizer holds state
#: The strategy's save; the wrapper's API + torch.save (the goal's baseline); the same written atomically + fsync.
SIDES = ("ours", "hand", "hand_atomic")


def checkpoint_paths(workdir: Path, strategy: str) -> tuple[Path, Path]:
    """Where the strategy's checkpoint and the hand-written one are saved (shared by both ranks)."""
    directory = workdir / "checkpoints"
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{strategy}-ours.ckpt", directory / f"{strategy}-hand.ckpt"


class _SaveBoth(pl.Callback):
    """At the end of the epoch saves ``repeats`` times each way, alternating which goes first."""

    def __init__(self, strategy: str, paths: tuple[Path, Path], repeats: int) -> None:
        self.strategy = strategy
        self.paths = paths
        self.repeats = repeats
        self.results: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ours, hand = self.paths
        atomic = hand.with_name(hand.name + ".atomic")
        wrapped = wrapped_by_strategy(self.strategy, trainer)
        actions = {
            "ours": lambda: trainer.save_checkpoint(ours),
            "hand": lambda: by_hand.save(wrapped, hand),
            "hand_atomic": lambda: by_hand.save(wrapped, atomic, atomic=True),
        }
        for repeat in range(self.repeats):
            shift = repeat % len(SIDES)
            for side in SIDES[shift:] + SIDES[:shift]:
                seconds, added = timed_with_peak(actions[side])
                self.results[side].append({"seconds": seconds, "rss_added_bytes": float(added)})


def save_checkpoints(config: Config, strategy: str, workdir: Path, repeats: int) -> dict[str, Any]:
    """Trains ``SAVE_STEPS`` steps with ``strategy`` and saves both ways ``repeats`` times at the end of the epoch."""
    paths = checkpoint_paths(workdir, strategy)
    data = dataset(config.width, config.batch_size * dist.get_world_size() * SAVE_STEPS)
    saver = _SaveBoth(strategy, paths, repeats)
    trainer(strategy, [saver], max_epochs=1).fit(
        new_model(config.width, config.depth), train_dataloaders=lightning_loader(data, config.batch_size)
    )
    sizes = {side: path.stat().st_size for side, path in zip(("ours", "hand"), paths, strict=True)}
    sizes["hand_atomic"] = sizes["hand"]
    return {**saver.results, "checkpoint_bytes": sizes}


def run(config: Config, workdir: Path) -> dict[str, Any]:
    """Save timings and peak RSS per strategy."""
    return {strategy: save_checkpoints(config, strategy, workdir, config.repeats) for strategy in config.strategies}
