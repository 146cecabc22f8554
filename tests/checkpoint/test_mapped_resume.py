"""A full-file resume maps the file (``torch.load(mmap=True)``) so each rank reads only what it keeps, restores exactly
what the run saved, and leaves nothing viewing the file afterwards; a legacy (non-zip) file, another checkpoint IO or
``AsyncCheckpointIO`` still load."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.checkpoint import CheckpointFormatError
from lightning_strategies.checkpoint.io import (
    MappedCheckpoint,
    copy_out_of_mapping,
    read_checkpoint,
    reading_from,
    release_pages,
)
from lightning_strategies.strategies.atomic_io import AtomicTorchCheckpointIO, read_full_checkpoint
from lightning_strategies.testing import SaveAfterRestore
from tests.conftest import write_json
from tests.support.helpers import assert_same_checkpoint_state, fit, new_model, train_and_save

STRATEGIES: dict[str, Callable[..., pl.strategies.Strategy]] = {
    "ddp_sharded": ShardedDDPStrategy,
    "fsdp_fairscale": FairScaleFSDPStrategy,
    "fsdp2": FSDP2Strategy,
}

_LOADS: list[dict[str, Any]] = []  # torch.load's calls in this process (and in the ranks forked from it)


@pytest.fixture
def recorded_loads(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Records every ``torch.load`` call's file and ``mmap`` argument (the forked ranks inherit the spy)."""
    real_load = torch.load
    _LOADS.clear()

    def spy(f: Any, *args: Any, **kwargs: Any) -> Any:
        _LOADS.append({"file": str(f) if isinstance(f, str | Path) else None, "mmap": bool(kwargs.get("mmap"))})
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return _LOADS


def _maps(path: Path) -> bool:
    """Whether this process maps ``path`` (``/proc/self/maps`` names the file of each file mapping)."""
    gc.collect()
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


class MappingProbe(pl.Callback):
    """On every rank, once the restore is done (first ``on_train_start``): how ``torch.load`` read ``path`` during
    the restore, and whether anything still maps it; written to ``<dir>/mapping-rank<r>.json``."""

    def __init__(self, path: Path, directory: Path) -> None:
        self.path, self.directory = path, directory

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        loads = [call["mmap"] for call in _LOADS if call["file"] == str(self.path)]
        mapped_loads = [call for call in _LOADS if call["mmap"]]
        result = {"loads": loads, "mapped_loads": len(mapped_loads), "mapped_after": _maps(self.path)}
        write_json(self.directory / f"mapping-rank{trainer.global_rank}.json", result)

    def read(self) -> list[dict[str, Any]]:
        return [json.loads((self.directory / f"mapping-rank{rank}.json").read_text()) for rank in range(2)]


class SaveAtEnd(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def _resume_and_train(name: str, saved: Path, out: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """Resumes ``saved`` with ``name`` (saving right after the restore and at the end of the next epoch)."""
    probe = MappingProbe(saved, out)
    callbacks = [SaveAfterRestore(out / "restored.ckpt"), SaveAtEnd(out / "final.ckpt"), probe]
    fit(STRATEGIES[name](start_method="fork", **kwargs), new_model(seed=11), ckpt_path=saved, callbacks=callbacks)
    return probe.read()


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_full_file_resume_maps_the_file_and_resumes_exactly(
    tmp_path: Path, name: str, recorded_loads: list[dict[str, Any]]
) -> None:
    saved = train_and_save(STRATEGIES[name](start_method="fork"), tmp_path / "saved")
    mapped_run = _resume_and_train(name, saved, tmp_path / "mapped")
    # Today's resume, reading the whole file through Lightning's own TorchCheckpointIO (it takes no `mmap`).
    whole_run = _resume_and_train(name, saved, tmp_path / "whole", checkpoint_io=TorchCheckpointIO())

    for rank in mapped_run:
        assert rank["loads"] == [True]  # read once, mapped
        assert not rank["mapped_after"]  # nothing restored views the file: the optimizers' states were copied out
    assert all(rank["mapped_loads"] == 0 for rank in whole_run)  # read whole, through a file object
    assert_same_checkpoint_state(saved, tmp_path / "mapped" / "restored.ckpt")
    # Training on from the mapped restore gives exactly what training on from today's restore gives.
    assert_same_checkpoint_state(tmp_path / "whole" / "final.ckpt", tmp_path / "mapped" / "final.ckpt")


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_legacy_non_zip_file_is_read_whole_and_resumes_exactly(
    tmp_path: Path, name: str, recorded_loads: list[dict[str, Any]]
) -> None:
    saved = train_and_save(STRATEGIES[name](start_method="fork"), tmp_path / "saved")
    legacy = tmp_path / "legacy.ckpt"
    torch.save(torch.load(saved, weights_only=True), legacy, _use_new_zipfile_serialization=False)
    out = tmp_path / "resumed"
    probe = MappingProbe(legacy, out)
    fit(
        STRATEGIES[name](start_method="fork"),
        new_model(seed=11),
        ckpt_path=legacy,
        callbacks=[SaveAfterRestore(out / "restored.ckpt"), probe],
    )
    assert all(rank["mapped_loads"] == 0 for rank in probe.read())  # read whole, through a file object
    assert_same_checkpoint_state(saved, out / "restored.ckpt")


# ----------------------------------------------------------------------------------- the loading path, one process


def _checkpoint(path: Path) -> dict[str, Any]:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    checkpoint = {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.5)}},
        "global_step": 1,
    }
    torch.save(checkpoint, path)
    return checkpoint


def _in_span(tensor: torch.Tensor, checkpoint: MappedCheckpoint) -> bool:
    assert checkpoint.span is not None
    return checkpoint.span[0] <= tensor.untyped_storage().data_ptr() < checkpoint.span[1]


class NoMmapIO(AtomicTorchCheckpointIO):
    """A user's subclass that overrides ``load_checkpoint`` as Lightning declares it (no ``mmap``)."""

    calls = 0

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        NoMmapIO.calls += 1
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


@pytest.mark.parametrize(
    ("io", "mapped"),
    [
        (AtomicTorchCheckpointIO(), True),
        (AsyncCheckpointIO(AtomicTorchCheckpointIO()), True),
        (TorchCheckpointIO(), False),
        (NoMmapIO(), False),
    ],
    ids=["default", "async", "lightning-torch-io", "subclass-without-mmap"],
)
def test_the_file_is_mapped_only_through_a_plugin_that_takes_mmap(
    tmp_path: Path, io: Any, mapped: bool, recorded_loads: list[dict[str, Any]]
) -> None:
    path = tmp_path / "full.ckpt"
    expected = _checkpoint(path)
    NoMmapIO.calls = 0
    loaded = read_full_checkpoint(path, io)

    assert isinstance(loaded, MappedCheckpoint) is mapped
    assert [call["mmap"] for call in recorded_loads] == [mapped]
    assert NoMmapIO.calls == int(isinstance(io, NoMmapIO))
    for key, value in expected["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], value)
    if isinstance(loaded, MappedCheckpoint):
        assert _in_span(loaded["state_dict"]["weight"], loaded)  # read from the file when used
        score = loaded["callbacks"]["ModelCheckpoint"]["best_model_score"]
        assert not _in_span(score, loaded) and score == 0.5  # kept by Lightning after the restore: in memory


def test_a_legacy_file_is_read_whole_when_a_mapping_is_asked_for(
    tmp_path: Path, recorded_loads: list[dict[str, Any]]
) -> None:
    path = tmp_path / "legacy.ckpt"
    expected = _checkpoint(tmp_path / "zip.ckpt")
    torch.save(expected, path, _use_new_zipfile_serialization=False)

    for loaded in (read_full_checkpoint(path, AtomicTorchCheckpointIO()), read_checkpoint(path, mmap=True)):
        assert not isinstance(loaded, MappedCheckpoint)
        assert torch.equal(loaded["state_dict"]["weight"], expected["state_dict"]["weight"])
    assert not any(call["mmap"] for call in recorded_loads)


def test_mapped_loads_keep_the_safety_checks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="weights_only=False"):
        AtomicTorchCheckpointIO().load_checkpoint(tmp_path / "any.ckpt", weights_only=False, mmap=True)

    class Code:
        def __reduce__(self) -> Any:
            return (print, ("ran",))

    path = tmp_path / "code.ckpt"
    torch.save({"state_dict": {}, "payload": Code()}, path)
    with pytest.raises(CheckpointFormatError, match="weights_only=True"):
        read_full_checkpoint(path, AtomicTorchCheckpointIO())


def test_optimizer_state_loaded_from_a_mapping_is_copied_out_of_it(tmp_path: Path) -> None:
    path = tmp_path / "full.ckpt"
    expected = _checkpoint(path)
    loaded = read_full_checkpoint(path, AtomicTorchCheckpointIO())
    assert isinstance(loaded, MappedCheckpoint)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.load_state_dict(loaded["optimizer_states"][0])
    held = [value for entries in optimizer.state.values() for value in entries.values()]
    assert any(_in_span(value, loaded) for value in held)  # torch keeps tensors of the right dtype as they are

    copy_out_of_mapping([optimizer], loaded)

    held = [value for entries in optimizer.state.values() for value in entries.values()]
    assert not any(_in_span(value, loaded) for value in held)
    for index, entries in expected["optimizer_states"][0]["state"].items():
        for key, value in entries.items():
            assert torch.equal(optimizer.state_dict()["state"][index][key], value)


def test_pages_are_dropped_only_from_a_file_mapping(tmp_path: Path) -> None:
    path = tmp_path / "full.ckpt"
    torch.save({"state_dict": {"weight": torch.randn(1 << 20)}}, path)  # 4 MiB: whole pages to drop
    mapped = read_checkpoint(path, mmap=True)
    # A loader that is asked to map but reads into memory: its tensors are ordinary memory, never dropped.
    in_memory = read_checkpoint(path, load=lambda: torch.load(path, weights_only=True), mmap=True)

    assert isinstance(mapped, MappedCheckpoint) and mapped.file_backed
    assert isinstance(in_memory, MappedCheckpoint) and not in_memory.file_backed
    weight = in_memory["state_dict"]["weight"]
    expected = weight.clone()
    with reading_from(in_memory):
        release_pages(weight)
    assert torch.equal(weight, expected)
    with reading_from(mapped):  # dropped pages of the file are read again from it
        release_pages(mapped["state_dict"]["weight"])
    assert torch.equal(mapped["state_dict"]["weight"], expected)
