"""Trains with a strategy started by the subprocess launcher (this script runs once per rank).

Usage: python train.py STRATEGY OUT_DIR
"""

from __future__ import annotations

import sys

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

import lightning_strategies  # noqa: F401  (registers the strategy names)
from lightning_strategies.testing import ConformanceModel

if __name__ == "__main__":
    strategy, out = sys.argv[1], sys.argv[2]
    pl.seed_everything(3, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=out, filename="{epoch}", save_top_k=-1)],
    )
    trainer.fit(ConformanceModel())
