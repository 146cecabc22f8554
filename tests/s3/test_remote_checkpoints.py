"""Checkpoints on a real S3 server (SeaweedFS, ``tests/s3/conftest.py``): every strategy saves full files and sharded
checkpoints through ``ModelCheckpoint(dirpath="s3://...")``, sync and ``async_save=True``, and resumes them from the
URL (``ckpt_path="last"`` too, at another world size); a sharded checkpoint on the store is a committed save under a
fresh prefix, and the one the run resumed from is never removed.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_strategies.checkpoint.remote import list_store, open_store
from tests.support.helpers import SAVE_FORMATS, STRATEGY_CLASSES, fit, new_model
from tests.support.s3_server import S3Server

TINY = {"limit_train_batches": 2, "limit_val_batches": 0, "enable_checkpointing": True}


def strategy_for(name: str, state_dict_type: str = "full", **kwargs: Any) -> Any:
    options = {} if name == "ddp_sharded" else {"state_dict_type": state_dict_type}
    return STRATEGY_CLASSES[name](start_method="fork", **options, **kwargs)


def remote_full_checkpoint(server: S3Server, url: str) -> dict[str, Any]:
    with server.filesystem().open(url, "rb") as file:
        loaded: dict[str, Any] = torch.load(io.BytesIO(file.read()), weights_only=True)
    return loaded


class RecordsTheStart(pl.Callback):
    """Records (on rank 0, into a file: the ranks run in forked processes) the step and the weights a fit starts
    training from, after any restore; ``step`` and ``weights`` read them back."""

    def __init__(self, record: Path) -> None:
        self.record = record

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        weights = trainer.strategy.full_model_state()  # type: ignore[attr-defined]  # canonical keys, on rank 0
        if trainer.global_rank == 0:
            torch.save({"step": trainer.global_step, "weights": weights}, self.record)

    @property
    def step(self) -> int:
        return int(torch.load(self.record, weights_only=True)["step"])

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        weights: dict[str, torch.Tensor] = torch.load(self.record, weights_only=True)["weights"]
        return weights


def _names(server: S3Server, url: str) -> list[str]:
    return sorted(path.rsplit("/", 1)[1] for path in server.filesystem().ls(url, detail=False, refresh=True))


@pytest.mark.parametrize(("name", "state_dict_type"), SAVE_FORMATS, ids=[f"{n}-{t}" for n, t in SAVE_FORMATS])
def test_checkpoints_reach_the_store_and_resume_from_last_at_another_world_size(
    store: S3Server, s3_bucket: str, tmp_path: Path, name: str, state_dict_type: str
) -> None:
    run = f"{s3_bucket}/run"
    first = new_model()
    callback = ModelCheckpoint(dirpath=run, filename="{epoch}", save_last=True, save_top_k=-1)
    fit(strategy_for(name, state_dict_type), first, callbacks=[callback], max_epochs=1, **TINY)

    assert _names(store, run) == ["epoch=0.ckpt", "last.ckpt"]
    for checkpoint in ("epoch=0.ckpt", "last.ckpt"):
        listing = list_store(open_store(f"{run}/{checkpoint}"))
        if state_dict_type == "sharded":  # one committed save under its own prefix, nothing else
            assert len(listing.committed) == 1 and not listing.leftovers and listing.full_file_at is None
            assert "meta.pt" in listing.committed[0].files
        else:
            assert listing.full_file_at is not None and not listing.committed
    if state_dict_type == "full":
        saved = remote_full_checkpoint(store, f"{run}/last.ckpt")
        assert saved["global_step"] == 2 and saved["lightning_strategies"]["strategy"] == name
        assert saved["state_dict"].keys() == new_model().state_dict().keys()  # canonical: the module's own keys

    start = RecordsTheStart(tmp_path / "start.pt")
    resume = ModelCheckpoint(dirpath=run, filename="{epoch}", save_last=True, save_top_k=-1)
    strategy = strategy_for(name, state_dict_type)
    fit(strategy, new_model(seed=11), ckpt_path="last", callbacks=[resume, start], max_epochs=2, devices=1, **TINY)  # type: ignore[arg-type]

    # One process resumed the 2-process run's epoch 0, with its weights (handed back to `first`), and went on.
    assert start.step == 2
    assert all(torch.equal(start.weights[key], value) for key, value in first.state_dict().items())
    assert not (tmp_path / "s3:").exists()  # where Path() folded a URL to before


@pytest.mark.parametrize("name", ["fsdp_fairscale", "fsdp2"])
def test_asynchronous_sharded_saves_commit_on_the_store_and_resume(
    store: S3Server, s3_bucket: str, tmp_path: Path, name: str
) -> None:
    run = f"{s3_bucket}/run"
    first = new_model()
    callback = ModelCheckpoint(
        dirpath=run, filename="{step}", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=True
    )
    fit(strategy_for(name, "sharded", async_save=True), first, callbacks=[callback], max_epochs=2, **TINY)

    # Four saves; top-2 removed the older two only once newer ones were committed.
    assert _names(store, run) == ["last.ckpt", "step=3.ckpt", "step=4.ckpt"]
    assert [len(list_store(open_store(f"{run}/{c}")).committed) for c in _names(store, run)] == [1, 1, 1]
    start = RecordsTheStart(tmp_path / "start.pt")
    fit(
        strategy_for(name, "sharded"),
        new_model(seed=11),
        ckpt_path=f"{run}/step=4.ckpt",
        callbacks=[start],
        max_epochs=3,
        **TINY,
    )  # type: ignore[arg-type]
    assert start.step == 4
    assert all(torch.equal(start.weights[key], value) for key, value in first.state_dict().items())


def test_top_k_never_removes_the_checkpoint_the_run_resumed_from(store: S3Server, s3_bucket: str) -> None:
    run = f"{s3_bucket}/run"
    options = {"dirpath": run, "filename": "{epoch}", "save_top_k": 1, "monitor": "step", "mode": "max"}
    fit(strategy_for("fsdp2", "sharded"), new_model(), callbacks=[ModelCheckpoint(**options)], max_epochs=1, **TINY)
    assert _names(store, run) == ["epoch=0.ckpt"]

    resumed = f"{run}/epoch=0.ckpt"
    callbacks = [ModelCheckpoint(**options)]
    fit(strategy_for("fsdp2", "sharded"), new_model(), ckpt_path=resumed, callbacks=callbacks, max_epochs=3, **TINY)  # type: ignore[arg-type]

    # Top-1 removed epoch=1 when epoch=2 came; epoch=0, which it would have removed first, is the resumed-from one.
    assert _names(store, run) == ["epoch=0.ckpt", "epoch=2.ckpt"]
    assert len(list_store(open_store(resumed)).committed) == 1


def test_saving_again_to_the_url_a_run_resumed_from_keeps_that_save_beside_the_new_one(
    store: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    last = f"{s3_bucket}/run/last.ckpt"
    callback = ModelCheckpoint(dirpath=f"{s3_bucket}/run", save_last=True, save_top_k=0)
    fit(strategy_for("fsdp2", "sharded"), new_model(), callbacks=[callback], max_epochs=1, **TINY)
    (first,) = list_store(open_store(last)).committed

    again = ModelCheckpoint(dirpath=f"{s3_bucket}/run", save_last=True, save_top_k=0)
    fit(strategy_for("fsdp2", "sharded"), new_model(), ckpt_path=last, callbacks=[again], max_epochs=2, **TINY)  # type: ignore[arg-type]

    newest, kept = list_store(open_store(last)).committed
    assert kept.save_id == first.save_id != newest.save_id  # readers take the newest; the resumed-from one stays
    start = RecordsTheStart(tmp_path / "start.pt")
    fit(strategy_for("fsdp2", "sharded"), new_model(), ckpt_path=last, callbacks=[start], max_epochs=3, **TINY)  # type: ignore[arg-type]
    assert start.step == 4
