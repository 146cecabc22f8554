"""Checkpoint files are read without running code, and unreadable ones are named with their cause."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_strategies.checkpoint import (
    FORMAT_VERSION,
    METADATA_KEY,
    CheckpointFormatError,
    CheckpointMetadata,
    read_checkpoint,
    require_full_checkpoint,
)


def _metadata(**overrides: object) -> dict[str, object]:
    block: dict[str, object] = {
        "format_version": 1,
        "strategy": "ddp_sharded",
        "world_size": 2,
        "state_dict_type": "full",
    }
    block.update(overrides)
    return {METADATA_KEY: block}


class RunsCode:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("this must never run",))


def test_metadata_round_trips() -> None:
    metadata = CheckpointMetadata(FORMAT_VERSION, "ddp_sharded", 2, "full")
    assert CheckpointMetadata.read({METADATA_KEY: metadata.to_dict()}) == metadata


def test_a_checkpoint_without_metadata_is_upstreams_and_allowed() -> None:
    assert CheckpointMetadata.read({"state_dict": {}}) is None


def test_a_future_format_version_asks_for_an_upgrade() -> None:
    with pytest.raises(CheckpointFormatError, match=r"format version 99.*Upgrade lightning_strategies"):
        CheckpointMetadata.read(_metadata(format_version=99))


def test_missing_metadata_fields_are_named() -> None:
    with pytest.raises(CheckpointFormatError, match=r"lacks world_size"):
        CheckpointMetadata.read({METADATA_KEY: {"format_version": 1, "strategy": "x", "state_dict_type": "full"}})


def test_a_sharded_checkpoint_given_to_a_full_loader_names_the_consolidate_step() -> None:
    with pytest.raises(CheckpointFormatError, match=r"one rank's shard.*Consolidate it"):
        require_full_checkpoint(_metadata(state_dict_type="sharded"), source="ckpt")


def test_a_zero_byte_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.ckpt"
    path.write_bytes(b"")
    with pytest.raises(CheckpointFormatError, match=r"empty.ckpt' is empty"):
        read_checkpoint(path)


def test_a_truncated_file_is_refused_with_its_path(tmp_path: Path) -> None:
    path = tmp_path / "whole.ckpt"
    torch.save({"state_dict": {"w": torch.ones(100)}}, path)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointFormatError, match=r"truncated.ckpt' could not be read: it is truncated"):
        read_checkpoint(truncated)


def test_a_file_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(CheckpointFormatError, match=r"could not be read"):
        read_checkpoint(path)


def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": RunsCode()}, path)
    with pytest.raises(CheckpointFormatError, match=r"only unpickle by running code"):
        read_checkpoint(path)
    assert "must never run" not in capsys.readouterr().out


def test_a_file_holding_something_else_than_a_dict_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "list.ckpt"
    torch.save([1, 2, 3], path)
    with pytest.raises(CheckpointFormatError, match=r"holds a list"):
        read_checkpoint(path)


def test_a_missing_file_is_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"absent.ckpt"):
        read_checkpoint(tmp_path / "absent.ckpt")
