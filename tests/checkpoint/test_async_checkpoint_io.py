"""Lightning's ``AsyncCheckpointIO`` plugin under every strategy, with full files and sharded directories: every
checkpoint a run leaves is complete and resumes exactly, an old checkpoint is removed only once its background write
finished, and a failed write is raised (never lost, no hang)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import AsyncCheckpointIO

from lightning_strategies.checkpoint.sharded import open_sharded, sharded_directory
from lightning_strategies.strategies.atomic_io import AtomicTorchCheckpointIO
from lightning_strategies.strategies.base import DirectReferenceStrategy
from lightning_strategies.testing import SaveAfterRestore
from tests.conftest import trainer_kwargs
from tests.support.helpers import (
    SAVE_FORMATS,
    STRATEGY_CLASSES,
    assert_same_checkpoint_state,
    canonical_checkpoint,
    fit,
    new_model,
)

CLASSES = STRATEGY_CLASSES
FORMATS = SAVE_FORMATS
SHARDED = [(name, kind) for name, kind in FORMATS if kind == "sharded"]


def strategy(name: str, state_dict_type: str, cls: type[DirectReferenceStrategy] | None = None) -> Any:
    options = {} if name == "ddp_sharded" else {"state_dict_type": state_dict_type}
    return (cls or CLASSES[name])(start_method="fork", **options)


def leftovers(directory: Path) -> list[str]:
    """Staging directories and temporary files of saves that did not finish (or were never swapped in)."""
    return sorted(path.name for path in directory.iterdir() if path.name.startswith("."))


def assert_complete(path: Path) -> None:
    """``path`` is a whole checkpoint: a full file that loads, or a sharded directory whose every shard is there."""
    directory = sharded_directory(path)
    if directory is not None:
        open_sharded(directory)  # refuses a directory without meta.pt ("its save did not finish")
    checkpoint = canonical_checkpoint(path)
    assert checkpoint["state_dict"] and checkpoint["optimizer_states"]


# With a validation loop the broken sharded save finished silently; without one it failed (FileNotFoundError).
@pytest.mark.parametrize(
    ("name", "state_dict_type", "validation"),
    [(name, kind, True) for name, kind in FORMATS] + [(name, kind, False) for name, kind in SHARDED],
)
def test_every_checkpoint_written_through_async_checkpoint_io_is_complete_and_resumes_exactly(
    tmp_path: Path, name: str, state_dict_type: str, validation: bool
) -> None:
    directory = tmp_path / "checkpoints"
    checkpoints = ModelCheckpoint(dirpath=directory, save_last=True)
    limits = {"limit_train_batches": 2, **({} if validation else {"limit_val_batches": 0})}
    fit(
        strategy(name, state_dict_type),
        new_model(),
        callbacks=[checkpoints],
        enable_checkpointing=True,
        plugins=[AsyncCheckpointIO()],
        **limits,
    )

    assert sorted(path.name for path in directory.iterdir()) == ["epoch=1-step=4.ckpt", "last.ckpt"]
    for path in directory.iterdir():
        assert_complete(path)
        assert (sharded_directory(path) is not None) == (state_dict_type == "sharded")
    restored = tmp_path / "restored.ckpt"
    fit(
        strategy(name, state_dict_type),
        new_model(seed=11),
        ckpt_path=directory / "last.ckpt",
        callbacks=[SaveAfterRestore(restored)],
        plugins=[AsyncCheckpointIO()],
        max_epochs=3,
        limit_train_batches=2,
    )
    assert_same_checkpoint_state(directory / "last.ckpt", restored)
    assert not leftovers(directory) and not leftovers(tmp_path)


@pytest.mark.parametrize("name", list(CLASSES))
def test_async_checkpoint_io_given_alone_writes_through_the_atomic_io(name: str) -> None:
    plugin = AsyncCheckpointIO()
    trainer = pl.Trainer(strategy=strategy(name, "full"), plugins=[plugin], **trainer_kwargs())

    # The strategy's default IO (temporary file, fsync, rename), not Lightning's plain torch.save to the path.
    assert trainer.strategy.checkpoint_io is plugin
    assert type(plugin.checkpoint_io) is AtomicTorchCheckpointIO


class RemovalRecorder(AtomicTorchCheckpointIO):
    """Holds the background write of the first checkpoint until ``released`` (its removal began) and records whether
    each path existed when it was removed."""

    def __init__(self, log: Path) -> None:
        super().__init__()
        self.log = log
        self.released = threading.Event()
        self.first: str | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if str(path).endswith(".ckpt"):  # a full file (a sharded save writes meta.pt and shards synchronously)
            self.first = self.first or str(path)
        if str(path) == self.first:
            self.released.wait(timeout=30)  # bounded: a test that does not release it fails, it does not hang
        super().save_checkpoint(checkpoint, path, storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        with self.log.open("a") as log:
            log.write(f"{Path(path).name} existed={Path(path).exists()}\n")
        super().remove_checkpoint(path)


def releasing(cls: type[DirectReferenceStrategy]) -> type[DirectReferenceStrategy]:
    """``cls`` whose ``remove_checkpoint`` first lets the held write go on (it then races the removal)."""

    class Releasing(cls):  # type: ignore[valid-type,misc]
        def remove_checkpoint(self, filepath: Any) -> None:
            plugin = self.checkpoint_io
            assert isinstance(plugin, AsyncCheckpointIO) and isinstance(plugin.checkpoint_io, RemovalRecorder)
            plugin.checkpoint_io.released.set()
            super().remove_checkpoint(filepath)

    return Releasing


@pytest.mark.parametrize(("name", "state_dict_type"), FORMATS)
def test_an_old_checkpoint_is_removed_only_after_its_background_write_finished(
    tmp_path: Path, name: str, state_dict_type: str
) -> None:
    directory, log = tmp_path / "checkpoints", tmp_path / "removed.log"
    fit(
        strategy(name, state_dict_type, releasing(CLASSES[name])),
        new_model(),
        callbacks=[ModelCheckpoint(dirpath=directory, filename="{epoch}")],  # keeps the latest epoch only
        enable_checkpointing=True,
        plugins=[AsyncCheckpointIO(RemovalRecorder(log))],
        max_epochs=3,
    )

    removed = [line for line in log.read_text().splitlines() if line.startswith("epoch=")]  # not the hand-back file
    assert removed == ["epoch=0.ckpt existed=True", "epoch=1.ckpt existed=True"]
    assert sorted(path.name for path in directory.iterdir()) == ["epoch=2.ckpt"]


class FailingIO(AtomicTorchCheckpointIO):
    """Fails every write, as a full or broken remote store would."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        raise OSError(f"the store refused {Path(path).name}")


@pytest.mark.parametrize(("name", "state_dict_type"), FORMATS)
def test_a_failed_background_write_fails_the_fit_and_leaves_no_checkpoint(
    tmp_path: Path, name: str, state_dict_type: str
) -> None:
    directory = tmp_path / "checkpoints"
    with pytest.raises(Exception, match="the store refused"):
        fit(
            strategy(name, state_dict_type),
            new_model(),
            callbacks=[ModelCheckpoint(dirpath=directory, save_last=True)],
            enable_checkpointing=True,
            plugins=[AsyncCheckpointIO(FailingIO())],
        )
    # No checkpoint appeared (a staging directory a failed save left is hidden, and the next save removes it).
    assert not directory.exists() or not [path for path in directory.iterdir() if not path.name.startswith(".")]


@pytest.mark.parametrize(("name", "state_dict_type"), SHARDED)
def test_a_sharded_save_raises_the_error_of_an_earlier_background_write(
    tmp_path: Path, name: str, state_dict_type: str
) -> None:
    """An error stored by the plugin (here: of a write done outside the sharded save) is raised by the next save."""

    class FailedEarlier(AsyncCheckpointIO):
        def __init__(self) -> None:
            super().__init__()
            self._error = OSError("an earlier background write failed")

    path = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(Exception, match="an earlier background write failed"):
        fit(
            strategy(name, state_dict_type),
            new_model(),
            callbacks=[ModelCheckpoint(dirpath=path.parent, save_last=True)],
            enable_checkpointing=True,
            plugins=[FailedEarlier()],
            max_epochs=1,
        )
    assert not path.exists()
