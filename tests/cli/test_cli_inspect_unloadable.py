"""Tensors nothing can load, and legacy keys behind nested wrapper prefixes: named errors, never tracebacks.

``inspect`` flags meta-device, sparse and oversized tensors (a stride-0 view that declares 2**40 elements of a
one-element storage) by key with exit code 1, and ``convert`` refuses them, without reading their values (which
would ask the allocator for terabytes). A resume of a legacy checkpoint whose keys carry nested wrapper prefixes
(``_fsdp_wrapped_module._fpw_module.``, ``module._forward_module.``) names the prefix and ``convert``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_strategies import FairScaleFSDPStrategy
from lightning_strategies.checkpoint import ModelStateMismatchError, check_model_state
from lightning_strategies.cli import main
from lightning_strategies.testing import ConformanceModel
from tests.support.helpers import fit, new_model, train_and_save

NESTED_PREFIXES = ["_fsdp_wrapped_module._fpw_module.", "module._forward_module."]


def _checkpoint(state: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"epoch": 0, "global_step": 4, "pytorch-lightning_version": "2.6.0", "state_dict": state, **extra}


def _model_state() -> dict[str, torch.Tensor]:
    return dict(ConformanceModel().state_dict())


def _save(checkpoint: dict[str, Any], path: Path) -> Path:
    torch.save(checkpoint, path)
    return path


def _inspect(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = main(["inspect", str(path), "--json"])
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return code, report


def _unloadable(report: dict[str, Any]) -> str:
    messages = [finding["message"] for finding in report["findings"] if finding["code"] == "unloadable-tensor"]
    assert len(messages) == 1, report["findings"]
    assert report["findings"][[f["code"] for f in report["findings"]].index("unloadable-tensor")]["severity"] == "error"
    return messages[0]


def _oversized() -> torch.Tensor:
    """2**40 float32 elements declared over a storage of one: 4 TiB if anything reads the values."""
    return torch.zeros(1).expand(2**40)


# ---------------------------------------------------------------------------------------------- inspect


def test_inspect_flags_a_meta_tensor_naming_its_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {**_model_state(), "head.weight": torch.empty(4, 16, device="meta")}

    code, report = _inspect(_save(_checkpoint(state), tmp_path / "meta.ckpt"), capsys)

    assert code == 1
    assert "'head.weight' is a meta-device tensor" in _unloadable(report)


def test_inspect_flags_a_sparse_tensor_naming_its_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {**_model_state(), "encoder.weight": torch.eye(16, 8).to_sparse()}

    code, report = _inspect(_save(_checkpoint(state), tmp_path / "sparse.ckpt"), capsys)

    assert code == 1
    assert "'encoder.weight' has the sparse_coo layout" in _unloadable(report)


def test_inspect_names_a_stride_0_view_of_2_40_elements_instead_of_allocating_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {**_model_state(), "output_scale": _oversized()}

    code, report = _inspect(_save(_checkpoint(state), tmp_path / "oversized.ckpt"), capsys)

    assert code == 1
    message = _unloadable(report)
    assert "'output_scale' declares 1,099,511,627,776 elements" in message and "storage holds 1" in message


def test_inspect_flags_an_unloadable_optimizer_state_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    optimizer = {
        "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(16, 8, device="meta")}},
        "param_groups": [{"lr": 0.01, "params": [0, 1, 2, 3]}],
    }
    path = _save(_checkpoint(_model_state(), optimizer_states=[optimizer]), tmp_path / "optimizer.ckpt")

    code, report = _inspect(path, capsys)

    assert code == 1
    assert "'optimizer 0 state[0].exp_avg' is a meta-device tensor" in _unloadable(report)


def test_inspect_of_a_bare_state_dict_flags_an_unloadable_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {**_model_state(), "head.bias": torch.empty(4, device="meta")}

    code, report = _inspect(_save(state, tmp_path / "bare.pt"), capsys)

    assert code == 1 and "'head.bias' is a meta-device tensor" in _unloadable(report)


def test_a_small_dense_view_is_not_flagged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {**_model_state(), "encoder.weight": torch.randn(8, 16).t()}  # transposed: strided, not oversized

    _, report = _inspect(_save(_checkpoint(state), tmp_path / "view.ckpt"), capsys)

    assert "unloadable-tensor" not in {finding["code"] for finding in report["findings"]}


# ---------------------------------------------------------------------------------------------- convert


@pytest.mark.parametrize(
    ("key", "tensor", "reason"),
    [
        ("output_scale", _oversized(), "declares 1,099,511,627,776 elements"),
        ("head.weight", torch.empty(4, 16, device="meta"), "is a meta-device tensor"),
        ("encoder.weight", torch.eye(16, 8).to_sparse(), "has the sparse_coo layout"),
    ],
    ids=["stride-0-2**40", "meta", "sparse"],
)
def test_convert_refuses_an_unloadable_tensor_naming_its_key(
    key: str, tensor: torch.Tensor, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # No metadata block: convert would add one, were it not for the tensor.
    path = _save(_checkpoint({**_model_state(), key: tensor}), tmp_path / "legacy.ckpt")

    assert main(["convert", str(path), str(tmp_path / "out.ckpt")]) == 1

    error = capsys.readouterr().err
    assert "unloadable-tensor" in error and f"'{key}' {reason}" in error
    assert not (tmp_path / "out.ckpt").exists()


# ---------------------------------------------------------------------------------------------- nested prefixes


@pytest.mark.parametrize("prefix", NESTED_PREFIXES)
def test_keys_behind_nested_wrapper_prefixes_are_refused_naming_the_prefix_and_convert(prefix: str) -> None:
    expected = _model_state()
    legacy = {prefix + key: value for key, value in expected.items()}

    with pytest.raises(ModelStateMismatchError) as refused:
        check_model_state(expected, legacy)

    assert f"behind the wrapper prefix {prefix!r}" in str(refused.value)
    assert "lightning-strategies convert" in str(refused.value)


def test_fairscale_segments_inside_paths_are_named_with_convert() -> None:
    expected = _model_state()
    legacy = {key.replace("encoder.", "encoder._fsdp_wrapped_module._fpw_module."): v for key, v in expected.items()}

    with pytest.raises(ModelStateMismatchError, match=r"wrapper segments .* inside their paths") as refused:
        check_model_state(expected, legacy)
    assert "lightning-strategies convert" in str(refused.value)


@pytest.mark.parametrize("prefix", NESTED_PREFIXES)
def test_resuming_a_legacy_checkpoint_with_nested_prefixes_is_refused_naming_the_prefix_and_convert(
    prefix: str, tmp_path: Path
) -> None:
    state = {prefix + key: value for key, value in _model_state().items()}
    legacy = _save(_checkpoint(state), tmp_path / "legacy.ckpt")

    with pytest.raises(Exception, match="wrapper prefix") as refused:
        fit("ddp_sharded_fork", new_model(), ckpt_path=legacy, max_epochs=1)

    assert repr(prefix) in str(refused.value) and "lightning-strategies convert" in str(refused.value)


def test_inspect_names_an_oversized_view_in_a_rank_file_of_a_sharded_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sharded = train_and_save(FairScaleFSDPStrategy(start_method="fork", state_dict_type="sharded"), tmp_path)
    shard = torch.load(sharded / "rank1.pt", weights_only=True)
    buffer = next(key for key in shard["state_dict"] if key.endswith("output_scale"))
    shard["state_dict"][buffer] = _oversized()
    torch.save(shard, sharded / "rank1.pt")

    code, report = _inspect(sharded, capsys)

    assert code == 1
    assert f"'rank1.pt:{buffer}' declares 1,099,511,627,776 elements" in _unloadable(report)
