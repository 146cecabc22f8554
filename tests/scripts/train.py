"""Trains with a strategy whose processes are started from outside: by Lightning's subprocess launcher (this script
runs once per rank) or by torchrun (one script per node).

Usage: python train.py STRATEGY OUT_DIR [NUM_NODES]

Each rank writes ``OUT_DIR/environment-rank<r>.json``: the cluster environment Lightning detected and what it says.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

import lightning_strategies  # noqa: F401  (registers the strategy names)
from lightning_strategies.testing import ConformanceModel


class RecordEnvironment(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        environment = trainer.strategy.cluster_environment  # type: ignore[attr-defined]
        record = {
            "environment": type(environment).__name__,
            "world_size": trainer.world_size,
            "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "num_nodes": trainer.num_nodes,
        }
        (self.out / f"environment-rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    strategy, out = sys.argv[1], Path(sys.argv[2])
    num_nodes = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    pl.seed_everything(3, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 if num_nodes == 1 else 1,
        num_nodes=num_nodes,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=out, filename="{epoch}", save_top_k=-1), RecordEnvironment(out)],
    )
    trainer.fit(ConformanceModel())
