"""What goes wrong on a store, on a real S3 server: a rank killed during a save's upload leaves the previous
checkpoint resumable and the uncommitted leftovers named and removed; a missing bucket or refused credentials are an
error naming the URL on every rank, before anything is written, with the previous checkpoint untouched."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch.distributed
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_strategies.checkpoint.errors import StoreError
from lightning_strategies.checkpoint.remote import list_store, open_store
from lightning_strategies.cli import main
from lightning_strategies.strategies import store_saves
from tests.conftest import write_json
from tests.s3.test_remote_checkpoints import TINY, RecordsTheStart, strategy_for
from tests.support.helpers import fit, new_model
from tests.support.s3_server import S3Server


def _last(run: str) -> ModelCheckpoint:
    return ModelCheckpoint(run, save_last=True, save_top_k=0)


def _kill_rank_one_after_its_upload(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 dies (SIGKILL) right after uploading its files of a save, before the ranks meet to commit it."""
    upload = store_saves.upload_save_files

    def upload_then_die(store: Any, save_id: str, local: Path) -> dict[str, int]:
        sizes = upload(store, save_id, local)
        if torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return sizes

    monkeypatch.setattr(store_saves, "upload_save_files", upload_then_die)


@pytest.mark.parametrize("name", ["fsdp_fairscale", "fsdp2"])
def test_a_rank_killed_during_the_upload_leaves_the_previous_checkpoint_resumable(
    store: S3Server, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    run, last = f"{s3_bucket}/run", f"{s3_bucket}/run/last.ckpt"
    first = new_model()
    fit(
        strategy_for(name, "sharded"),
        first,
        callbacks=[ModelCheckpoint(run, save_last=True, save_top_k=0)],
        max_epochs=1,
        **TINY,
    )
    (previous,) = list_store(open_store(last)).committed

    with monkeypatch.context() as patched:
        _kill_rank_one_after_its_upload(patched)
        with pytest.raises(Exception, match=r"SIGKILL|exited|signal"):
            callbacks = [_last(run)]
            fit(strategy_for(name, "sharded"), new_model(), ckpt_path=last, callbacks=callbacks, max_epochs=2, **TINY)  # type: ignore[arg-type]

    listing = list_store(open_store(last))
    assert [save.save_id for save in listing.committed] == [previous.save_id]  # never committed: still the previous
    assert len(listing.leftovers) == 1  # rank 1's files of the killed save
    start = RecordsTheStart(tmp_path / "start.pt")
    again = [_last(run), start]
    fit(strategy_for(name, "sharded"), new_model(seed=11), ckpt_path=last, callbacks=again, max_epochs=2, **TINY)  # type: ignore[arg-type]
    assert start.step == 2  # resumed from the previous checkpoint, whose weights the first fit handed back
    assert all(torch.equal(start.weights[key], value) for key, value in first.state_dict().items())
    listing = list_store(open_store(last))
    assert not listing.leftovers and len(listing.committed) == 2  # the new save removed them; the resumed-from stays


def test_inspect_names_uncommitted_leftovers_and_clean_removes_them(
    store: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run, last = f"{s3_bucket}/run", f"{s3_bucket}/run/last.ckpt"
    fit(
        strategy_for("fsdp2", "sharded"),
        new_model(),
        callbacks=[ModelCheckpoint(run, save_last=True, save_top_k=0)],
        max_epochs=1,
        **TINY,
    )
    with monkeypatch.context() as patched:
        _kill_rank_one_after_its_upload(patched)
        with pytest.raises(Exception, match=r"SIGKILL|exited|signal"):
            callbacks = [ModelCheckpoint(run, save_last=True, save_top_k=0)]
            fit(
                strategy_for("fsdp2", "sharded"), new_model(), ckpt_path=last, callbacks=callbacks, max_epochs=2, **TINY
            )  # type: ignore[arg-type]
    (leftover,) = list_store(open_store(last)).leftovers

    assert main(["inspect", "--json", last]) == 0
    report = json.loads(capsys.readouterr().out)
    assert any(leftover in finding["message"] for finding in report["findings"]), report["findings"]

    assert main(["clean", last, "--older-than", "0"]) == 0
    assert leftover in capsys.readouterr().out
    listing = list_store(open_store(last))
    assert not listing.leftovers and len(listing.committed) == 1


class SavesTo(pl.Callback):
    """Saves to ``url`` at the end of training; every rank records what it raised."""

    def __init__(self, url: str, record: Path, storage_options: dict[str, Any] | None = None) -> None:
        self.url, self.record, self.storage_options = url, record, storage_options

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            trainer.save_checkpoint(self.url, storage_options=self.storage_options)
            raised = None
        except StoreError as error:
            raised = str(error)
        write_json(self.record / f"rank{trainer.global_rank}.json", raised)


def _raised_on_every_rank(record: Path) -> list[str]:
    return [json.loads((record / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_a_missing_bucket_is_an_error_naming_the_url_on_every_rank(
    store: S3Server, tmp_path: Path, state_dict_type: str
) -> None:
    url = "s3://no-such-bucket-here/run/manual.ckpt"
    record = tmp_path / "record"
    record.mkdir()
    fit(strategy_for("fsdp2", state_dict_type), new_model(), callbacks=[SavesTo(url, record)], max_epochs=1, **TINY)
    for message in _raised_on_every_rank(record):
        assert message is not None and url in message and "bucket does not exist" in message


def test_a_model_checkpoint_on_a_missing_bucket_is_refused_before_training(store: S3Server) -> None:
    model = new_model()
    with pytest.raises(StoreError, match=r"s3://no-such-bucket-here/run.*bucket does not exist"):
        fit(
            strategy_for("fsdp2", "sharded"),
            model,
            callbacks=[ModelCheckpoint("s3://no-such-bucket-here/run")],
            max_epochs=1,
            **TINY,
        )
    assert model.global_step == 0


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_refused_credentials_are_an_error_naming_the_url_on_every_rank_and_the_previous_checkpoint_stays(
    store: S3Server, s3_bucket: str, tmp_path: Path, state_dict_type: str
) -> None:
    url = f"{s3_bucket}/manual.ckpt"
    record = tmp_path / "record"
    record.mkdir()
    fit(
        strategy_for("fsdp2", state_dict_type),
        new_model(),
        callbacks=[SavesTo(url, record, store.storage_options())],
        max_epochs=1,
        **TINY,
    )
    assert _raised_on_every_rank(record) == [None, None]
    before = store.filesystem().find(url.removeprefix("s3://"), detail=True)

    wrong = {**store.storage_options(), "secret": "not-the-secret"}
    fit(
        strategy_for("fsdp2", state_dict_type),
        new_model(),
        callbacks=[SavesTo(url, record, wrong)],
        max_epochs=1,
        **TINY,
    )
    for message in _raised_on_every_rank(record):
        assert message is not None and url in message and "refused the credentials" in message
    store.filesystem().invalidate_cache()
    assert store.filesystem().find(url.removeprefix("s3://"), detail=True) == before  # nothing was written
