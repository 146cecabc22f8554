"""No save removes or changes what it did not write: a save onto a path that holds anything but a previous checkpoint
(a user's directory, a file that is not a checkpoint, a link to either, a checkpoint directory with a user's file
inside) is refused on every rank before anything is written, for every strategy, both formats, synchronous and
asynchronous saves; a previous checkpoint (of either kind, behind a link or not) is still replaced. The cases are
generated: what is at the path, and what a directory there holds, are drawn rather than listed.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_strategies.checkpoint.targets import ForeignPathError, require_replaceable
from lightning_strategies.strategies.atomic_io import AtomicTorchCheckpointIO
from tests.conftest import write_json
from tests.support.helpers import SAVE_FORMATS, STRATEGY_CLASSES, fit, new_model

# ------------------------------------------------------------------ the generated cases

#: Entries a checkpoint directory holds (regular files): replacing a directory of only these loses nothing of a user's.
CHECKPOINT_ENTRIES = ("meta.pt", "rank0.pt", "rank1.pt", ".metadata", "__0_0.distcp", "__1_0.distcp")
#: Entries no checkpoint writer writes: any one of them makes the directory a user's.
FOREIGN_ENTRIES = ("notes.txt", "config.yaml", "data/", "rank0.pt/", "meta.pt->link", ".hidden", "meta.pt.bak")


@dataclass(frozen=True)
class Occupant:
    """What a save's path holds before the save: ``kind`` and, for a directory, its entries."""

    kind: str  # missing | checkpoint-file | legacy-checkpoint-file | user-file | directory | link | dangling-link
    entries: tuple[str, ...] = ()
    linked: Occupant | None = None  # what a link points to

    @property
    def foreign(self) -> bool:
        """Whether it holds something a checkpoint writer did not write (by construction, not by the code's rule)."""
        if self.kind == "user-file":
            return True
        if self.kind == "directory":
            return any(entry in FOREIGN_ENTRIES for entry in self.entries)
        if self.kind == "link":
            return self.linked is not None and self.linked.foreign
        return False


def _entry_name(entry: str) -> str:
    return entry.rstrip("/").removesuffix("->link")


def _directories() -> st.SearchStrategy[Occupant]:
    entries = st.lists(st.sampled_from(CHECKPOINT_ENTRIES + FOREIGN_ENTRIES), unique_by=_entry_name, max_size=5)
    return entries.map(lambda names: Occupant("directory", tuple(names)))


_PLAIN = st.sampled_from(
    [Occupant("missing"), Occupant("checkpoint-file"), Occupant("legacy-checkpoint-file"), Occupant("user-file")]
)
_TARGETS = st.one_of(_PLAIN.filter(lambda occupant: occupant.kind != "missing"), _directories())
OCCUPANTS = st.one_of(
    _PLAIN,
    _directories(),
    _TARGETS.map(lambda target: Occupant("link", linked=target)),
    st.just(Occupant("dangling-link")),
)


def build(occupant: Occupant, path: Path) -> None:
    """Puts ``occupant`` at ``path`` (a link's target goes to a sibling directory ``elsewhere``)."""
    if occupant.kind == "checkpoint-file":
        torch.save({"previous": torch.ones(2)}, path)
    elif occupant.kind == "legacy-checkpoint-file":
        torch.save({"previous": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    elif occupant.kind == "user-file":
        path.write_bytes(b"the user's own data")
    elif occupant.kind == "directory":
        path.mkdir()
        for entry in occupant.entries:
            if entry.endswith("/"):
                (path / _entry_name(entry)).mkdir()
                (path / _entry_name(entry) / "kept.txt").write_text("mine")
            elif entry.endswith("->link"):
                (path.parent / "linked-data.txt").write_text("mine")
                (path / _entry_name(entry)).symlink_to(path.parent / "linked-data.txt")
            else:
                (path / entry).write_bytes(b"shard bytes" if entry in CHECKPOINT_ENTRIES else b"mine")
    elif occupant.kind == "link":
        assert occupant.linked is not None
        elsewhere = path.parent / "elsewhere"
        elsewhere.mkdir()
        build(occupant.linked, elsewhere / "target")
        path.symlink_to(elsewhere / "target")
    elif occupant.kind == "dangling-link":
        path.symlink_to(path.parent / "gone")


def snapshot(root: Path) -> dict[str, Any]:
    """Every entry under ``root``: a file's bytes, a link's target, a directory's presence."""
    tree: dict[str, Any] = {}
    for folder, directories, files in os.walk(root):
        for name in directories + files:
            path = Path(folder, name)
            relative = str(path.relative_to(root))
            if path.is_symlink():
                tree[relative] = ("link", os.readlink(path))
            elif path.is_dir():
                tree[relative] = ("directory",)
            else:
                tree[relative] = ("file", path.read_bytes())
    return tree


_EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_EXAMPLES
@given(occupant=OCCUPANTS)
def test_a_full_save_replaces_only_a_previous_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, occupant: Occupant
) -> None:
    root = tmp_path_factory.mktemp("full")
    target = root / "last.ckpt"
    build(occupant, target)
    before = snapshot(root)

    if occupant.foreign:
        with pytest.raises(ForeignPathError, match="nothing was changed") as refusal:
            AtomicTorchCheckpointIO().save_checkpoint({"version": 2}, target)
        assert str(target) in str(refusal.value)
        assert snapshot(root) == before
    else:
        AtomicTorchCheckpointIO().save_checkpoint({"version": 2}, target)
        assert target.is_file() and not target.is_symlink()
        assert torch.load(target, weights_only=True) == {"version": 2}
        # Only the path changed: a link's target (a previous checkpoint elsewhere) is left as it was.
        assert {key: value for key, value in snapshot(root).items() if key != "last.ckpt"} == {
            key: value for key, value in before.items() if key != "last.ckpt" and not key.startswith("last.ckpt/")
        }


@_EXAMPLES
@given(occupant=OCCUPANTS)
def test_a_sharded_save_refuses_exactly_what_a_full_save_refuses(
    tmp_path_factory: pytest.TempPathFactory, occupant: Occupant
) -> None:
    root = tmp_path_factory.mktemp("sharded")
    target = root / "last.ckpt"
    build(occupant, target)
    if occupant.foreign:
        with pytest.raises(ForeignPathError, match="Cannot save the sharded checkpoint"):
            require_replaceable(target, "sharded")
    else:
        require_replaceable(target, "sharded")


# ------------------------------------------------------------------ under every strategy, on every rank

#: The foreign neighbours a fit tries to save onto (one of each kind the generator draws that a user meets).
FIT_OCCUPANTS = {
    "users-directory": Occupant("directory", ("notes.txt", "data/")),
    "user-file": Occupant("user-file"),
    "link-to-users-directory": Occupant("link", linked=Occupant("directory", ("config.yaml",))),
    "checkpoint-with-a-users-file": Occupant("directory", ("meta.pt", "__0_0.distcp", ".metadata", "notes.txt")),
}


class SavesOntoForeignPaths(pl.Callback):
    """At the end of training, saves onto each foreign path (every rank records what it raised), then once onto a
    fresh path: the ranks still work together after the refusals."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raised: dict[str, str] = {}
        for name in FIT_OCCUPANTS:
            try:
                trainer.save_checkpoint(self.root / "paths" / name)
            except ForeignPathError as error:
                raised[name] = str(error)
        trainer.save_checkpoint(self.root / "paths" / "fresh")
        trainer.strategy.barrier("the fresh save is committed")
        write_json(self.root / f"raised-rank{trainer.global_rank}.json", raised)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("name", "state_dict_type"), SAVE_FORMATS)
def test_every_rank_refuses_a_save_onto_a_path_that_is_not_a_checkpoint(
    tmp_path: Path, name: str, state_dict_type: str, async_save: bool
) -> None:
    paths = tmp_path / "paths"
    paths.mkdir()
    for occupant_name, occupant in FIT_OCCUPANTS.items():
        build(occupant, paths / occupant_name)
    before = snapshot(paths)
    options = {} if name == "ddp_sharded" else {"state_dict_type": state_dict_type}
    strategy = STRATEGY_CLASSES[name](start_method="fork", async_save=async_save, **options)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(strategy, new_model(), callbacks=[SavesOntoForeignPaths(tmp_path)], max_epochs=1, limit_train_batches=2)

    for rank in (0, 1):
        raised = json.loads((tmp_path / f"raised-rank{rank}.json").read_text())
        assert sorted(raised) == sorted(FIT_OCCUPANTS), f"rank {rank} raised for {sorted(raised)} only"
        for occupant_name, message in raised.items():
            assert str(paths / occupant_name) in message and "nothing was changed" in message
    after = snapshot(paths)
    fresh = {key: value for key, value in after.items() if key == "fresh" or key.startswith("fresh/")}
    assert fresh, "the save after the refusals wrote nothing"
    assert {key: value for key, value in after.items() if key not in fresh} == before  # no staging left either


# ------------------------------------------------------------------ removals: ModelCheckpoint's clean-up


class _ResumedTrainer:
    """Stands in for the Trainer a removal asks which checkpoint the run resumed from."""

    def __init__(self, ckpt_path: str | None) -> None:
        self.ckpt_path = ckpt_path


def _strategy_resumed_from(ckpt_path: str | None) -> Any:
    strategy = STRATEGY_CLASSES["fsdp2"]()
    module = new_model()
    module._trainer = _ResumedTrainer(ckpt_path)  # type: ignore[assignment]
    strategy._lightning_module = module
    return strategy


def test_a_removal_keeps_a_path_that_holds_a_users_files(tmp_path: Path) -> None:
    target = tmp_path / "epoch=0.ckpt"
    build(FIT_OCCUPANTS["checkpoint-with-a-users-file"], target)
    before = snapshot(tmp_path)

    with pytest.warns(UserWarning, match="Not removing .*notes.txt"):
        _strategy_resumed_from(None).remove_checkpoint(target)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("written_as", ["same", "with-a-trailing-slash", "through-a-link"])
def test_a_removal_never_removes_the_checkpoint_the_run_resumed_from(tmp_path: Path, written_as: str) -> None:
    target = tmp_path / "last.ckpt"
    build(Occupant("directory", ("meta.pt", ".metadata", "__0_0.distcp")), target)
    resumed_from = {"same": str(target), "with-a-trailing-slash": f"{target}/", "through-a-link": str(tmp_path / "l")}
    (tmp_path / "l").symlink_to(target)

    with pytest.warns(UserWarning, match="the run resumed from it"):
        _strategy_resumed_from(resumed_from[written_as]).remove_checkpoint(target)
    assert (target / "meta.pt").is_file()


def test_a_removal_of_a_remote_resumed_from_checkpoint_is_kept_and_another_is_not(tmp_path: Path) -> None:
    strategy = _strategy_resumed_from("s3://bucket/run/last.ckpt")
    assert "resumed from it" in (strategy._removal_refusal("s3://bucket/run/last.ckpt/") or "")
    assert strategy._removal_refusal("s3://bucket/run/epoch=0.ckpt") is None


def test_a_removal_removes_a_previous_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "epoch=0.ckpt"
    build(Occupant("directory", ("meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp")), target)

    _strategy_resumed_from(str(tmp_path / "other.ckpt")).remove_checkpoint(target)
    assert not target.exists()
