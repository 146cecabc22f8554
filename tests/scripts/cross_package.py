"""Saves or resumes a checkpoint under whichever Lightning package this environment has.

Usage:
    python -m tests.scripts.cross_package save STRATEGY DIR          # DIR/epoch=0.ckpt, DIR/epoch=1.ckpt
    python -m tests.scripts.cross_package resume STRATEGY CKPT DIR   # DIR/restored.ckpt, DIR/final.ckpt

Prints the Lightning package it ran under on its last line, so the caller can check that the two sides differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.support.flavour import PACKAGE, pl, testing


def _trainer(strategy: str, callbacks: list[object]) -> object:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _model() -> object:
    pl.seed_everything(11, verbose=False)
    return testing.ConformanceModel(optimizer="adam")


def save(strategy: str, directory: Path) -> None:
    """Trains two epochs from seed 11, saving after each epoch."""
    every_epoch = pl.callbacks.ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    _trainer(strategy, [every_epoch]).fit(_model())


def resume(strategy: str, checkpoint: Path, directory: Path) -> None:
    """Resumes ``checkpoint`` to the end of epoch 2; saves right after the restore and at the end."""
    trainer = _trainer(strategy, [testing.SaveAfterRestore(directory / "restored.ckpt")])
    pl.seed_everything(11, verbose=False)
    trainer.fit(_model(), ckpt_path=checkpoint)
    trainer.save_checkpoint(directory / "final.ckpt")


if __name__ == "__main__":
    command, strategy, *paths = sys.argv[1:]
    if command == "save":
        save(strategy, Path(paths[0]))
    else:
        resume(strategy, Path(paths[0]), Path(paths[1]))
    print(PACKAGE)
