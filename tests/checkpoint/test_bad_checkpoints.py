"""Resuming from a bad checkpoint fails with an error that names the problem, and no weight changes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from tests.support.helpers import GuardedShardedStrategy, fit, new_model


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("good")
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    fit("ddp_sharded_fork", new_model(), callbacks=[checkpoints], max_epochs=1, enable_checkpointing=True)
    checkpoint: dict[str, Any] = torch.load(directory / "epoch=0.ckpt", weights_only=True)
    return checkpoint


def _drop_key(checkpoint: dict[str, Any]) -> None:
    del checkpoint["state_dict"]["head.bias"]


def _add_key(checkpoint: dict[str, Any]) -> None:
    checkpoint["state_dict"]["decoder.weight"] = torch.zeros(2, 2)


def _wrong_shape(checkpoint: dict[str, Any]) -> None:
    checkpoint["state_dict"]["encoder.weight"] = torch.zeros(16, 9)


def _two_optimizers(checkpoint: dict[str, Any]) -> None:
    checkpoint["optimizer_states"] = checkpoint["optimizer_states"] * 2


def _rank_shard(checkpoint: dict[str, Any]) -> None:
    state = checkpoint["optimizer_states"][0]
    state["param_groups"] = [{**group, "params": group["params"][:1]} for group in state["param_groups"]]
    state["state"] = {index: entries for index, entries in state["state"].items() if index in (0, 2)}


def _sharded_metadata(checkpoint: dict[str, Any]) -> None:
    checkpoint["lightning_strategies"]["state_dict_type"] = "sharded"


BROKEN: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "missing key": (_drop_key, r"missing keys \(1\): 'head.bias'"),
    "unexpected key": (_add_key, r"unexpected keys \(1\): 'decoder.weight'"),
    "wrong shape": (_wrong_shape, r"'encoder.weight': checkpoint has shape \(16, 9\), model expects \(16, 8\)"),
    "wrong optimizer count": (
        _two_optimizers,
        r"holds 2 optimizer state\(s\), but configure_optimizers\(\) returned 1",
    ),
    "one rank's optimizer shard": (_rank_shard, r"param group 0 has 1 parameter\(s\) in the checkpoint and 2"),
    "sharded metadata": (_sharded_metadata, r"holds one rank's shard .*Consolidate it"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_checkpoint_is_refused_by_name_and_leaves_the_weights_unchanged(
    tmp_path: Path, good_checkpoint: dict[str, Any], case: str
) -> None:
    breaks, message = BROKEN[case]
    checkpoint = {**good_checkpoint, "state_dict": dict(good_checkpoint["state_dict"])}
    checkpoint["optimizer_states"] = [
        {**state, "state": dict(state["state"])} for state in good_checkpoint["optimizer_states"]
    ]
    checkpoint["lightning_strategies"] = dict(good_checkpoint["lightning_strategies"])
    breaks(checkpoint)
    path = tmp_path / "broken.ckpt"
    torch.save(checkpoint, path)
    strategy = GuardedShardedStrategy(tmp_path)

    with pytest.raises(Exception, match=message):
        fit(strategy, new_model(seed=5), ckpt_path=path)
    # The first rank to fail stops the others, so at least one rank reports; every report says "unchanged".
    if case != "sharded metadata":  # that one is refused while reading the file, before any weight is touched
        reports = strategy.read()
        assert reports and all(reports)


def test_a_truncated_file_is_refused_naming_its_path(tmp_path: Path, good_checkpoint: dict[str, Any]) -> None:
    whole = tmp_path / "whole.ckpt"
    torch.save(good_checkpoint, whole)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(whole.read_bytes()[:1000])

    with pytest.raises(Exception, match=r"truncated.ckpt' could not be read: it is truncated"):
        fit("ddp_sharded_fork", new_model(seed=5), ckpt_path=truncated)
