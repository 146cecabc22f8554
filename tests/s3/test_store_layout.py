"""The layout of checkpoints on a store (``checkpoint.remote``) on a real S3 server, and the commands with URLs:
commit markers are created conditionally and list what readers download, uncommitted prefixes are never read,
objects no save wrote are never replaced, and ``inspect``/``consolidate``/``export`` read and write URLs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_strategies.checkpoint.errors import CheckpointError, CheckpointFormatError
from lightning_strategies.checkpoint.remote import (
    UPLOAD_BLOCK_SIZE,
    commit_save,
    download_save,
    list_store,
    newest_committed,
    open_store,
    replace_problem_on_store,
    streamed_write,
)
from lightning_strategies.cli import main
from tests.s3.test_remote_checkpoints import TINY, RecordsTheStart, remote_full_checkpoint, strategy_for
from tests.support.helpers import fit, new_model
from tests.support.s3_server import S3Server

SAVE_ID = "0" * 31 + "1"


def test_a_commit_marker_is_never_replaced(store: S3Server, s3_bucket: str) -> None:
    target = open_store(f"{s3_bucket}/ckpt")
    commit_save(target, SAVE_ID, {"meta.pt": 3})
    with pytest.raises(CheckpointError, match="already committed"):  # S3's If-None-Match: * on the second create
        commit_save(target, SAVE_ID, {"meta.pt": 4})
    assert newest_committed(target).files == {"meta.pt": 3}


def test_a_save_without_its_marker_is_a_leftover_that_readers_never_take(store: S3Server, s3_bucket: str) -> None:
    target = open_store(f"{s3_bucket}/ckpt")
    store.filesystem().pipe(target.key(SAVE_ID, "meta.pt"), b"abc")
    listing = list_store(target)
    assert listing.leftovers == [SAVE_ID] and not listing.committed
    with pytest.raises(FileNotFoundError, match=r"holds no committed save.*uncommitted leftovers"):
        newest_committed(target)


def test_a_download_checks_every_file_against_the_size_its_marker_lists(
    store: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    target = open_store(f"{s3_bucket}/ckpt")
    store.filesystem().pipe(target.key(SAVE_ID, "meta.pt"), b"abc")
    commit_save(target, SAVE_ID, {"meta.pt": 5})
    with pytest.raises(CheckpointFormatError, match=r"meta\.pt of save .* holds 3 bytes, its commit marker says 5"):
        download_save(target, newest_committed(target), tmp_path / "copy")


@pytest.mark.parametrize("size", [0, 100, UPLOAD_BLOCK_SIZE, 2 * UPLOAD_BLOCK_SIZE + 3])
def test_a_streamed_object_holds_exactly_what_was_written(store: S3Server, s3_bucket: str, size: int) -> None:
    url = f"{s3_bucket}/run/last.ckpt"
    data = os.urandom(size)

    def write_in_pieces(file: Any) -> None:  # torch.save writes records of every size
        for start in range(0, size, 3_000_001):
            file.write(memoryview(data)[start : start + 3_000_001])

    streamed_write(open_store(url), write_in_pieces)

    assert store.filesystem().cat_file(url) == data


@pytest.mark.parametrize("written_mib", [1, 20], ids=["before-the-first-part", "after-parts-were-uploaded"])
def test_a_full_save_that_fails_while_streaming_leaves_the_previous_object_and_no_open_upload(
    store: S3Server, s3_bucket: str, written_mib: int
) -> None:
    url = f"{s3_bucket}/run/last.ckpt"
    store.filesystem().pipe_file(url, b"the previous checkpoint")

    def write_then_fail(file: Any) -> None:
        file.write(bytes(written_mib * 1024 * 1024))
        raise RuntimeError("serialization failed")

    with pytest.raises(RuntimeError, match="serialization failed"):
        streamed_write(open_store(url), write_then_fail)

    assert store.filesystem().cat_file(url) == b"the previous checkpoint"
    uploads = store.client().list_multipart_uploads(Bucket=s3_bucket.removeprefix("s3://")).get("Uploads", [])
    assert uploads == []


def test_objects_no_save_wrote_are_never_replaced(store: S3Server, s3_bucket: str) -> None:
    fs = store.filesystem()
    fs.pipe(f"{s3_bucket}/notes.txt".removeprefix("s3://"), b"my notes")
    fs.pipe(f"{s3_bucket}/run/data.csv".removeprefix("s3://"), b"1,2")
    assert "not a checkpoint" in str(replace_problem_on_store(open_store(f"{s3_bucket}/notes.txt"), sharded=False))
    assert "data.csv" in str(replace_problem_on_store(open_store(f"{s3_bucket}/run"), sharded=True))
    assert replace_problem_on_store(open_store(f"{s3_bucket}/fresh"), sharded=True) is None


@pytest.mark.parametrize("name", ["fsdp_fairscale", "fsdp2"])
def test_consolidate_reads_a_stored_sharded_checkpoint_and_writes_the_full_file_to_the_store(
    store: S3Server, s3_bucket: str, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = f"{s3_bucket}/run"
    first = new_model()
    fit(
        strategy_for(name, "sharded"), first, callbacks=[ModelCheckpoint(run, filename="sharded")], max_epochs=1, **TINY
    )

    assert main(["consolidate", f"{run}/sharded.ckpt", f"{run}/full.ckpt", "--no-progress"]) == 0
    assert f"Wrote {run}/full.ckpt" in capsys.readouterr().out
    full = remote_full_checkpoint(store, f"{run}/full.ckpt")
    assert all(torch.equal(full["state_dict"][key], value) for key, value in first.state_dict().items())
    assert main(["consolidate", f"{run}/sharded.ckpt", f"{run}/full.ckpt"]) == 2  # exists: --force to replace

    start = RecordsTheStart(tmp_path / "start.pt")  # every strategy resumes it, here at world size 1
    fit(
        strategy_for("fsdp2"),
        new_model(seed=11),
        ckpt_path=f"{run}/full.ckpt",
        callbacks=[start],
        max_epochs=2,
        devices=1,
        **TINY,
    )  # type: ignore[arg-type]
    assert start.step == 2
    assert all(torch.equal(start.weights[key], value) for key, value in first.state_dict().items())


def test_inspect_and_export_read_a_url_and_export_writes_to_one(
    store: S3Server, s3_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = f"{s3_bucket}/run"
    fit(
        strategy_for("fsdp2", "sharded"),
        new_model(),
        callbacks=[ModelCheckpoint(run, filename="c")],
        max_epochs=1,
        **TINY,
    )

    assert main(["inspect", "--json", f"{run}/c.ckpt"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["path"].startswith(f"{run}/c.ckpt (save ") and report["written_by"]["strategy"] == "fsdp2"

    assert main(["export", f"{run}/c.ckpt", f"{s3_bucket}/export", "--no-progress"]) == 0
    capsys.readouterr()
    assert store.filesystem().ls(f"{s3_bucket}/export".removeprefix("s3://"), detail=False, refresh=True) == [
        f"{s3_bucket}/export/model.safetensors".removeprefix("s3://")
    ]
    assert main(["inspect", f"{s3_bucket}/nothing-here"]) == 2
    assert "holds no committed checkpoint" in capsys.readouterr().err
