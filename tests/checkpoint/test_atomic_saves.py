"""A checkpoint file is the previous complete one or the new complete one, even when the saver is killed."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.checkpoint.atomic import atomic_torch_save
from lightning_strategies.strategies.atomic_io import AtomicTorchCheckpointIO

TRIALS = 20


def _save_forever(target: str, saved: Any) -> None:
    for version in count():
        atomic_torch_save({"version": version, "weights": torch.full((2_000_000,), float(version))}, target)
        saved.put(version)


def test_a_killed_saver_always_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "model.ckpt"
    context = multiprocessing.get_context("fork")
    generator = random.Random(0)
    versions_seen = set()
    for _ in range(TRIALS):
        saved = context.SimpleQueue()
        saver = context.Process(target=_save_forever, args=(str(target), saved))
        saver.start()
        try:
            saved.get()  # one complete save exists from here on
            time.sleep(generator.uniform(0.0, 0.15))  # then kill it somewhere inside a later save
        finally:
            os.kill(saver.pid or 0, signal.SIGKILL)
            saver.join(timeout=30)
        checkpoint = torch.load(target, weights_only=True)  # always a whole file: this raises on a torn one
        assert torch.equal(checkpoint["weights"], torch.full((2_000_000,), float(checkpoint["version"])))
        versions_seen.add(checkpoint["version"])
    assert len(versions_seen) > 1  # the kills landed at different points of the saving


def test_a_failed_save_leaves_the_previous_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "model.ckpt"
    atomic_torch_save({"version": 1}, target)

    class Unpicklable:
        def __reduce__(self) -> tuple[object, ...]:
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        atomic_torch_save({"version": 2, "bad": Unpicklable()}, target)
    assert torch.load(target, weights_only=True) == {"version": 1}
    assert [path.name for path in tmp_path.iterdir()] == ["model.ckpt"]


def test_every_strategy_saves_atomically_by_default() -> None:
    for strategy in (ShardedDDPStrategy(), FairScaleFSDPStrategy(), FSDP2Strategy()):
        assert isinstance(strategy.checkpoint_io, AtomicTorchCheckpointIO)
