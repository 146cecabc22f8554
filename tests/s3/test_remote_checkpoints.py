"""Checkpoints on a real S3 server (SeaweedFS, ``tests/s3/conftest.py``): full files of every strategy reach the store
through ``ModelCheckpoint(dirpath="s3://...")`` and resume from the URL (``"last"`` too, at another world size); a
sharded save to a URL, which used to land in a local folder named ``s3:`` while reporting success, is refused on every
rank before anything is written, at fit start for a ``ModelCheckpoint`` and at the save for
``trainer.save_checkpoint``; a removal never takes the checkpoint the run resumed from.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_strategies.checkpoint.targets import RemoteShardedSaveError
from tests.conftest import write_json
from tests.support.helpers import STRATEGY_CLASSES, fit, new_model
from tests.support.s3_server import S3Server

TINY = {"limit_train_batches": 2, "limit_val_batches": 0, "enable_checkpointing": True}


@pytest.fixture
def store(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3Server:
    """The server's credentials and endpoint in the environment, as s3fs users set them (the forked ranks inherit
    it); the working directory is a fresh one, so that a URL written locally would show as a folder there."""
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    return s3_server


def _strategy(name: str, state_dict_type: str = "full", **kwargs: Any) -> Any:
    options = {} if name == "ddp_sharded" else {"state_dict_type": state_dict_type}
    return STRATEGY_CLASSES[name](start_method="fork", **options, **kwargs)


def _remote_checkpoint(server: S3Server, url: str) -> dict[str, Any]:
    with server.filesystem().open(url, "rb") as file:
        loaded: dict[str, Any] = torch.load(io.BytesIO(file.read()), weights_only=True)
    return loaded


@pytest.mark.parametrize("name", sorted(STRATEGY_CLASSES))
def test_full_checkpoints_reach_the_store_and_resume_from_last_at_another_world_size(
    store: S3Server, s3_bucket: str, tmp_path: Path, name: str
) -> None:
    run = f"{s3_bucket}/run"
    callback = ModelCheckpoint(dirpath=run, filename="{epoch}", save_last=True, save_top_k=-1)
    fit(_strategy(name), new_model(), callbacks=[callback], max_epochs=1, **TINY)

    listed = sorted(path.rsplit("/", 1)[1] for path in store.filesystem().ls(run, detail=False))
    assert listed == ["epoch=0.ckpt", "last.ckpt"]
    saved = _remote_checkpoint(store, f"{run}/last.ckpt")
    assert saved["global_step"] == 2 and saved["lightning_strategies"]["strategy"] == name
    assert saved["state_dict"].keys() == new_model().state_dict().keys()  # canonical: the module's own keys

    resumed = new_model(seed=11)  # other initial weights: the resume must restore them
    resume = ModelCheckpoint(
        dirpath=run, filename="{epoch}", save_last=True, save_top_k=-1, enable_version_counter=False
    )
    fit(_strategy(name), resumed, ckpt_path="last", callbacks=[resume], max_epochs=2, devices=1, **TINY)  # type: ignore[arg-type]

    # One process resumed the 2-process run's epoch 0 and went on: its counters continue (2 steps an epoch).
    assert _remote_checkpoint(store, f"{run}/last.ckpt")["global_step"] == 4
    assert _remote_checkpoint(store, f"{run}/epoch=1.ckpt")["global_step"] == 4
    assert not (tmp_path / "s3:").exists()


@pytest.mark.parametrize("name", ["fsdp_fairscale", "fsdp2"])
def test_a_sharded_model_checkpoint_to_a_url_is_refused_at_fit_start(
    store: S3Server, s3_bucket: str, tmp_path: Path, name: str
) -> None:
    model = new_model()
    callback = ModelCheckpoint(dirpath=f"{s3_bucket}/run")
    with pytest.raises(
        RemoteShardedSaveError, match=r"state_dict_type='full'.*nothing was written|nothing was written"
    ):
        fit(_strategy(name, "sharded"), model, callbacks=[callback], max_epochs=1, **TINY)

    assert model.global_step == 0  # refused before the first step
    assert store.filesystem().ls(s3_bucket, detail=False) == []
    assert not (tmp_path / "s3:").exists()  # where Path() folded the URL to before


class SavesShardedToAURL(pl.Callback):
    """Saves sharded to ``url`` at the end of training; every rank records what it raised."""

    def __init__(self, url: str, record: Path) -> None:
        self.url, self.record = url, record

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            trainer.save_checkpoint(self.url)
            raised = None
        except RemoteShardedSaveError as error:
            raised = str(error)
        write_json(self.record / f"rank{trainer.global_rank}.json", raised)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_sharded_save_checkpoint_to_a_url_is_refused_on_every_rank(
    store: S3Server, s3_bucket: str, tmp_path: Path, async_save: bool
) -> None:
    record = tmp_path.parent / f"{tmp_path.name}-record"
    record.mkdir()
    url = f"{s3_bucket}/manual"
    callbacks = [SavesShardedToAURL(url, record)]
    fit(_strategy("fsdp2", "sharded", async_save=async_save), new_model(), callbacks=callbacks, max_epochs=1, **TINY)

    for rank in (0, 1):
        message = json.loads((record / f"rank{rank}.json").read_text())
        assert message is not None and url in message and "state_dict_type='full'" in message
    assert store.filesystem().ls(s3_bucket, detail=False) == []
    assert not (tmp_path / "s3:").exists()  # where Path() folded the URL to before


def test_the_named_fix_trains_and_resumes_through_the_url(store: S3Server, s3_bucket: str) -> None:
    """The refusal names ``state_dict_type='full'``: with it the same ModelCheckpoint saves and resumes."""
    run = f"{s3_bucket}/run"
    fit(_strategy("fsdp2", "full"), new_model(), callbacks=[ModelCheckpoint(dirpath=run)], max_epochs=1, **TINY)
    (written,) = store.filesystem().ls(run, detail=False)
    again = ModelCheckpoint(dirpath=run, filename="resumed")
    fit(_strategy("fsdp2", "full"), new_model(), ckpt_path=f"s3://{written}", callbacks=[again], max_epochs=2, **TINY)  # type: ignore[arg-type]
    assert _remote_checkpoint(store, f"{run}/resumed.ckpt")["global_step"] == 4
