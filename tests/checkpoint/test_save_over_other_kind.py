"""A save replaces a checkpoint of the other kind at its path: a full save a sharded directory, a sharded save a full
file. The everyday case: ``ModelCheckpoint(save_last=True)`` of a run that saved sharded, resumed with full saves (or
the other way round), saves ``last.ckpt`` again. The path holds the previous complete checkpoint until the new one is
complete; a directory that is not a checkpoint is never replaced.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.checkpoint import atomic
from lightning_strategies.checkpoint.sharded import open_sharded
from lightning_strategies.checkpoint.targets import ForeignPathError
from lightning_strategies.strategies.atomic_io import AtomicTorchCheckpointIO
from tests.support.helpers import assert_same_checkpoint_state, fit, new_model

SHARDED: dict[str, type[FairScaleFSDPStrategy | FSDP2Strategy]] = {
    "fsdp_fairscale": FairScaleFSDPStrategy,
    "fsdp2": FSDP2Strategy,
}
SAVING = {"enable_checkpointing": True}


def _strategy(name: str, state_dict_type: str) -> Any:
    if name == "ddp_sharded":
        return ShardedDDPStrategy(start_method="fork")
    return SHARDED[name](start_method="fork", state_dict_type=state_dict_type)  # type: ignore[arg-type]


def _save_last(directory: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0)


def _first_epoch(directory: Path, name: str, state_dict_type: str) -> Path:
    """One epoch with ``ModelCheckpoint(save_last=True)``; returns its ``last.ckpt``."""
    fit(_strategy(name, state_dict_type), new_model(), callbacks=[_save_last(directory)], max_epochs=1, **SAVING)
    return directory / "last.ckpt"


def _resume_for_an_epoch(last: Path, name: str, state_dict_type: str) -> None:
    """Resumes ``last`` for a second epoch, saving ``last.ckpt`` at the same path (the run that crashed before)."""
    fit(_strategy(name, state_dict_type), new_model(), ckpt_path=last, callbacks=[_save_last(last.parent)], **SAVING)


# Each strategy that saves full files resumes a directory of the other sharded format (fsdp_fairscale's rank files,
# fsdp2's torch.distributed.checkpoint layout), and ddp_sharded both.
FULL_OVER_SHARDED = [("ddp_sharded", "fsdp_fairscale"), ("ddp_sharded", "fsdp2"), ("fsdp_fairscale", "fsdp2")]
FULL_OVER_SHARDED += [("fsdp2", "fsdp_fairscale")]


@pytest.mark.parametrize(("full", "sharded"), FULL_OVER_SHARDED)
def test_full_save_replaces_a_sharded_last_checkpoint(tmp_path: Path, full: str, sharded: str) -> None:
    last = _first_epoch(tmp_path / "run", sharded, "sharded")
    assert last.is_dir()
    reference = _first_epoch(tmp_path / "reference", full, "full")  # the same epoch, saved full

    _resume_for_an_epoch(last, full, "full")

    assert last.is_file()
    assert (
        torch.load(last, weights_only=True)["global_step"]
        == 2 * torch.load(reference, weights_only=True)["global_step"]
    )
    assert sorted(path.name for path in last.parent.iterdir()) == ["last.ckpt"]  # nothing of the directory is left


@pytest.mark.parametrize("sharded", sorted(SHARDED))
def test_sharded_save_replaces_a_full_last_checkpoint(tmp_path: Path, sharded: str) -> None:
    last = _first_epoch(tmp_path / "run", "ddp_sharded", "full")
    assert last.is_file()

    _resume_for_an_epoch(last, sharded, "sharded")

    assert last.is_dir()
    assert open_sharded(last).meta["global_step"] > 0
    assert sorted(path.name for path in last.parent.iterdir()) == ["last.ckpt"]


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded fsdp2 directory (written by a run in forked workers)."""
    directory = tmp_path_factory.mktemp("sharded")
    return _first_epoch(directory, "fsdp2", "sharded")


def _copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / source.name
    shutil.copytree(source, target)
    return target


class Unpicklable:
    def __reduce__(self) -> tuple[object, ...]:
        raise RuntimeError("cannot pickle this")


def test_failed_full_save_leaves_the_sharded_directory_readable(tmp_path: Path, sharded_checkpoint: Path) -> None:
    target = _copy(sharded_checkpoint, tmp_path)
    with pytest.raises(RuntimeError, match="cannot pickle"):
        AtomicTorchCheckpointIO().save_checkpoint({"bad": Unpicklable()}, target)

    assert open_sharded(target).meta["global_step"] == open_sharded(sharded_checkpoint).meta["global_step"]
    assert_same_checkpoint_state(sharded_checkpoint, target)
    assert sorted(path.name for path in tmp_path.iterdir()) == [target.name]  # no temporary file left


@pytest.mark.parametrize("exchange", [True, False], ids=["atomic-exchange", "two-renames"])
def test_full_save_over_a_sharded_directory_leaves_only_the_file(
    tmp_path: Path, sharded_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    if not exchange:  # a filesystem without renameat2(RENAME_EXCHANGE)
        monkeypatch.setattr(atomic, "_exchange", lambda first, second: False)
    target = _copy(sharded_checkpoint, tmp_path)
    AtomicTorchCheckpointIO().save_checkpoint({"version": 2}, target)

    assert torch.load(target, weights_only=True) == {"version": 2}
    assert sorted(path.name for path in tmp_path.iterdir()) == [target.name]


def test_full_save_refuses_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "runs"
    target.mkdir()
    (target / "notes.txt").write_text("mine")

    with pytest.raises(ForeignPathError, match="files no checkpoint writes"):
        AtomicTorchCheckpointIO().save_checkpoint({"version": 1}, target)
    assert (target / "notes.txt").read_text() == "mine"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["runs"]
