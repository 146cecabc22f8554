"""Benchmark 5: save and load time of the strategies' full checkpoints against model size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist

from .config import Config
from .lightning_side import trainer
from .measure import release_free_memory, timed
from .models import dataset, depth_for, lightning_loader, new_model, parameter_count

BATCH_SIZE = 2  # the step only makes optimizer state; its cost does not matter here


class _SaveAndLoad(pl.Callback):
    """At the end of a one-step epoch: saves, then loads through the strategy's own restore path, alternating."""

    def __init__(self, path: Path, repeats: int) -> None:
        self.path = path
        self.repeats = repeats
        self.save_s: list[float] = []
        self.load_s: list[float] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy

        def load() -> None:
            # What Trainer.fit(ckpt_path=...) calls: read (every rank), check, then load model and optimizer state.
            checkpoint = strategy.load_checkpoint(self.path)
            strategy.load_model_state_dict(checkpoint)
            strategy.load_optimizer_state_dict(checkpoint)

        for _ in range(self.repeats):
            release_free_memory()
            self.save_s.append(timed(lambda: trainer.save_checkpoint(self.path)))
            release_free_memory()
            self.load_s.append(timed(load))


def run(config: Config, workdir: Path) -> dict[str, Any]:
    """For each size (ascending) and strategy: parameter count, checkpoint bytes, save and load seconds."""
    results: dict[str, list[dict[str, Any]]] = {strategy: [] for strategy in config.strategies}
    directory = workdir / "scaling"
    directory.mkdir(parents=True, exist_ok=True)
    for target in config.scaling_params:
        depth = depth_for(target, config.scaling_width)
        data = dataset(config.scaling_width, BATCH_SIZE * dist.get_world_size())
        for strategy in config.strategies:
            path = directory / f"{strategy}-{target}.ckpt"
            probe = _SaveAndLoad(path, config.scaling_repeats)
            trainer(strategy, [probe], max_epochs=1).fit(
                new_model(config.scaling_width, depth), train_dataloaders=lightning_loader(data, BATCH_SIZE)
            )
            size = path.stat().st_size
            dist.barrier()
            if dist.get_rank() == 0:
                path.unlink()
            results[strategy].append(
                {
                    "params": parameter_count(config.scaling_width, depth),
                    "tensors": 2 * depth,
                    "checkpoint_bytes": size,
                    "save_s": probe.save_s,
                    "load_s": probe.load_s,
                }
            )
    return results
