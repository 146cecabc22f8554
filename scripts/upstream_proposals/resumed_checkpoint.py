"""ModelCheckpoint removes the remote checkpoint a run resumed from (upstream issue 21813)."""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
from lightning_fabric.utilities.cloud_io import _is_local_file_protocol
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.demos.boring_classes import BoringModel

from scripts.upstream_proposals.core import ISSUES, UPSTREAM_MAIN, Outcome, Proposal


def same_checkpoint(first: str, second: str) -> bool:
    """Whether two checkpoint paths name one location: local paths made absolute, URLs without their protocol's
    spelling differences (``fsspec`` strips each filesystem's protocol and trailing slashes)."""
    if _is_local_file_protocol(first) and _is_local_file_protocol(second):
        return Path(first).absolute() == Path(second).absolute()
    (fs_first, path_first), (fs_second, path_second) = fsspec.url_to_fs(first), fsspec.url_to_fs(second)
    return fs_first.protocol == fs_second.protocol and path_first.rstrip("/") == path_second.rstrip("/")


class KeepsResumedCheckpoint(ModelCheckpoint):
    """Upstream's ``ModelCheckpoint``; a removal first spares the checkpoint the run resumed from, local or remote
    (upstream spares it only on local filesystems)."""

    def _should_remove_checkpoint(self, trainer: Trainer, previous: str, current: str) -> bool:
        if trainer.ckpt_path is not None and same_checkpoint(previous, str(trainer.ckpt_path)):
            return False
        return super()._should_remove_checkpoint(trainer, previous, current)


def _fit(root: str, cls: type, epochs: int, ckpt_path: str | None = None) -> None:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        limit_train_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cls(dirpath=root, filename="{epoch}", save_top_k=1)],
    )
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)


def _resumed_from_is_kept(root: str, cls: type) -> bool:
    _fit(root, cls, epochs=1)
    _fit(root, cls, epochs=2, ckpt_path=f"{root}/epoch=0.ckpt")
    return bool(fsspec.url_to_fs(root)[0].exists(f"{root}/epoch=0.ckpt"))


def reproduce(root: Path, cls: type) -> Outcome:
    """Save epoch 0 to ``memory://``, resume from it with ``save_top_k=1`` in the same directory, train an epoch."""
    url = f"memory://{uuid.uuid4().hex}"  # fsspec's memory filesystem lives as long as the process
    kept_remote = _resumed_from_is_kept(url, cls)
    kept_local = _resumed_from_is_kept(str(root / "local"), cls)
    return Outcome(
        kept_remote and kept_local,
        f"the checkpoint resumed from is {'kept' if kept_remote else 'removed'} on `memory://`,"
        f" {'kept' if kept_local else 'removed'} on a local path",
    )


# The tests for upstream's tests_pytorch/checkpointing/test_model_checkpoint.py


def test_model_checkpoint_keeps_remote_checkpoint_resumed_from(
    tmp_path: Path, cls: type = KeepsResumedCheckpoint
) -> None:
    assert _resumed_from_is_kept(f"memory://{uuid.uuid4().hex}", cls)


def test_model_checkpoint_still_removes_remote_previous_checkpoint(
    tmp_path: Path, cls: type = KeepsResumedCheckpoint
) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    _fit(url, cls, epochs=2)
    assert fsspec.url_to_fs(url)[0].ls(url, detail=False) == [f"{url.removeprefix('memory:/')}/epoch=1.ckpt"]


PROPOSAL = Proposal(
    slug="remote-resumed-checkpoint",
    title="ModelCheckpoint deletes the remote checkpoint the run resumed from",
    kind="bug",
    issues=(21813,),
    severity="data loss",
    status=f"open: `_should_remove_checkpoint` returns `True` for every non-local path before it looks at"
    f" `trainer.ckpt_path` on {UPSTREAM_MAIN}",
    template={
        "Bug description": "Resuming from `s3://bucket/run/epoch=3.ckpt` with a `ModelCheckpoint(dirpath="
        "'s3://bucket/run', save_top_k=1)` deletes `epoch=3.ckpt` at the next save: the resumed-from checkpoint is"
        " spared only on local filesystems.",
        "Reproduction": "Same with `memory://` (fsspec's in-memory filesystem): fit one epoch, resume from its"
        " checkpoint with `max_epochs=2`, list the directory.",
        "Expected": "`epoch=0.ckpt` is still there (as on a local path).",
        "Actual": "It is removed; on a local path it is kept.",
        "Environment": "pytorch-lightning 2.6.6, fsspec's `memory://` (same code path as `s3://`), CPU.",
    },
    change="`src/lightning/pytorch/callbacks/model_checkpoint.py`, `_should_remove_checkpoint`: compare `previous`"
    " with `trainer.ckpt_path` before the local-filesystem test, for every protocol (local paths made absolute, URLs"
    " through `fsspec.url_to_fs`). Here: `same_checkpoint` and `KeepsResumedCheckpoint`, a subclass.",
    cost="Behaviour: the remote checkpoint resumed from is kept, as the local one already is; other remote removals"
    " unchanged (still no check that the path is inside `dirpath` for remote paths, which is the other half of"
    " the issue and a separate change).",
    fix=(same_checkpoint, KeepsResumedCheckpoint),
    released=ModelCheckpoint,
    changed=KeepsResumedCheckpoint,
    reproduce=reproduce,
    tests=(
        test_model_checkpoint_keeps_remote_checkpoint_resumed_from,
        test_model_checkpoint_still_removes_remote_previous_checkpoint,
    ),
    upstream_test_file="tests_pytorch/checkpointing/test_model_checkpoint.py",
    notes=(
        f"Issue: {ISSUES}21813. No Fabric test: the removal is `ModelCheckpoint`'s, a Trainer callback; Fabric has no"
        " checkpoint callback, and `fabric.save` writes where it is told and removes nothing.",
    ),
)
