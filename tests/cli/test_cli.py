"""The command line: help and exit codes, inspect and convert on checkpoints of our strategies, of upstream Lightning
and hand-made legacy ones (each wrapper prefix, issue-13500 flat shards and empty state)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_strategies.checkpoint import WRAPPER_PREFIXES
from lightning_strategies.cli import main
from lightning_strategies.testing import ConformanceModel, SaveAfterRestore
from tests.conftest import free_loopback_port
from tests.support.helpers import comparable_optimizer_state, fit, new_model, train_and_save

MODEL = "lightning_strategies.testing:ConformanceModel"


class WiderModel(ConformanceModel):
    """The conformance model with a wider hidden layer: the same keys, other shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 32)
        self.head = nn.Linear(32, 4)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """One checkpoint written by fsdp_fairscale (ours) and one by upstream ddp, shared by the tests of this file."""
    directory = tmp_path_factory.mktemp("written")
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("MASTER_ADDR", "127.0.0.1")
        environment.setenv("GLOO_SOCKET_IFNAME", "lo")
        environment.setenv("MASTER_PORT", str(free_loopback_port()))
        ours = train_and_save("fsdp_fairscale_fork", directory / "fsdp_fairscale")
        environment.setenv("MASTER_PORT", str(free_loopback_port()))
        upstream = train_and_save("ddp_fork", directory / "ddp")
        yield {"ours": ours, "upstream": upstream}


def _load(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, weights_only=True)
    return loaded


def _save(checkpoint: dict[str, Any], path: Path) -> Path:
    torch.save(checkpoint, path)
    return path


def _inspect_json(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = main(["inspect", str(path), "--json", *extra])
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return code, report


def _codes(report: dict[str, Any], severity: str = "error") -> set[str]:
    return {finding["code"] for finding in report["findings"] if finding["severity"] == severity}


def _prefixed(checkpoint: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {**checkpoint, "state_dict": {prefix + key: value for key, value in checkpoint["state_dict"].items()}}


def _issue_13500_flat_shard(upstream: dict[str, Any]) -> dict[str, Any]:
    """What Lightning 1.6's fairscale fsdp saved on rank 0: its flat shard of the weights and of Adam's state."""
    flat = torch.cat([value.reshape(-1) for key, value in upstream["state_dict"].items() if key != "output_scale"])
    shard = flat[: -(-flat.numel() // 2)].clone()
    optimizer = {
        "state": {
            0: {"step": torch.tensor(8.0), "exp_avg": torch.zeros_like(shard), "exp_avg_sq": torch.ones_like(shard)}
        },
        "param_groups": [{**upstream["optimizer_states"][0]["param_groups"][0], "params": [0]}],
    }
    checkpoint = {key: value for key, value in upstream.items() if key not in ("state_dict", "optimizer_states")}
    return {**checkpoint, "state_dict": {"_fsdp_wrapped_module.flat_param_0": shard}, "optimizer_states": [optimizer]}


# ---------------------------------------------------------------------------------------------- help and usage


@pytest.mark.parametrize("command", [[], ["demo"], ["inspect"], ["convert"], ["consolidate"]])
def test_every_command_has_help_and_exits_0(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--help"]) == 0
    assert "usage: lightning-strategies" in capsys.readouterr().out


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["frobnicate"], ["inspect"], ["convert", "a.ckpt"], ["demo", "--steps", "0"], ["demo", "--devices", "two"]],
)
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    assert main(argv) == 2


def test_python_dash_m_runs_the_command_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_strategies", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert all(command in result.stdout for command in ("demo", "inspect", "convert", "consolidate"))


def test_an_unknown_demo_strategy_exits_2_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--save-from", "fsdp3", "--out", "unused"]) == 2
    assert "unknown strategy 'fsdp3'" in capsys.readouterr().err
    assert not Path("unused").exists()


# ---------------------------------------------------------------------------------------------- inspect


def test_inspect_reports_what_wrote_our_checkpoint(
    written: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _inspect_json(written["ours"], capsys)

    assert code == 0 and report["ok"]
    assert report["written_by"] == {
        "format_version": 1,
        "strategy": "fsdp_fairscale",
        "world_size": 2,
        "state_dict_type": "full",
    }
    assert report["model"]["tensors"] == 5
    assert report["model"]["elements"] == sum(t.numel() for t in ConformanceModel().state_dict().values())
    assert report["optimizers"][0]["parameters"] == report["optimizers"][0]["parameters_with_state"] == 4
    assert report["lr_schedulers"] == 1
    assert report["lightning"]["global_step"] == 8  # one epoch: 64 samples, batch 4, 2 ranks


def test_inspect_of_an_upstream_checkpoint_notes_the_missing_metadata(
    written: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _inspect_json(written["upstream"], capsys)

    assert code == 0
    assert report["written_by"] is None
    assert _codes(report, "info") == {"no-metadata"}


def test_inspect_prints_a_readable_report(written: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(written["ours"])]) == 0
    out = capsys.readouterr().out
    assert "fsdp_fairscale, world size 2, format version 1, full" in out
    assert "Adam-like" in out and "OK: no errors found." in out


def test_inspect_with_the_model_class_finds_nothing_wrong(
    written: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _inspect_json(written["ours"], capsys, "--module", MODEL)
    assert code == 0 and not report["findings"]


def test_inspect_with_another_model_class_names_the_mismatched_shapes(
    written: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _inspect_json(written["ours"], capsys, "--module", "tests.cli.test_cli:WiderModel")

    assert code == 1
    (mismatch,) = [finding for finding in report["findings"] if finding["code"] == "model-mismatch"]
    assert "'encoder.weight': checkpoint has shape (16, 8), model expects (32, 8)" in mismatch["message"]


def test_inspect_with_a_module_that_does_not_import_exits_2(
    written: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(written["ours"]), "--module", "no_such_package.models:Net"]) == 2
    assert "cannot import 'no_such_package.models'" in capsys.readouterr().err


@pytest.mark.parametrize("prefix", WRAPPER_PREFIXES)
def test_inspect_flags_each_wrapper_prefix_as_repairable(
    prefix: str, written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    legacy = _save(_prefixed(_load(written["upstream"]), prefix), tmp_path / "legacy.ckpt")

    code, report = _inspect_json(legacy, capsys)

    assert code == 1
    (finding,) = [finding for finding in report["findings"] if finding["code"] == "wrapper-prefix"]
    assert repr(prefix) in finding["message"] and finding["repairable"]


def test_inspect_flags_an_issue_13500_flat_shard(
    written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    legacy = _save(_issue_13500_flat_shard(_load(written["upstream"])), tmp_path / "flat.ckpt")

    code, report = _inspect_json(legacy, capsys)

    assert code == 1
    assert "flat-shard" in _codes(report)
    assert not any(finding["repairable"] for finding in report["findings"] if finding["code"] == "flat-shard")


def test_inspect_flags_flat_parameters_against_the_model_class(
    written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upstream = _load(written["upstream"])
    flattened = {key: value.reshape(-1) for key, value in upstream["state_dict"].items()}
    legacy = _save({**upstream, "state_dict": flattened}, tmp_path / "flattened.ckpt")

    code, report = _inspect_json(legacy, capsys, "--module", MODEL)

    assert code == 1
    (mismatch,) = [finding for finding in report["findings"] if finding["code"] == "model-mismatch"]
    assert "are 1-D where the model has matrices" in mismatch["message"]


def test_inspect_flags_an_issue_13500_empty_state(
    written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    legacy = _save({**_load(written["upstream"]), "state_dict": {}, "optimizer_states": [{}]}, tmp_path / "empty.ckpt")

    code, report = _inspect_json(legacy, capsys)

    assert code == 1
    assert {"empty-state", "empty-optimizer-state"} <= _codes(report)


def test_inspect_flags_an_optimizer_state_keyed_by_one_ranks_indices(
    written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upstream = _load(written["upstream"])
    state = upstream["optimizer_states"][0]
    rank_one = {"state": {4: state["state"][2], 5: state["state"][3]}, "param_groups": state["param_groups"]}
    legacy = _save({**upstream, "optimizer_states": [rank_one]}, tmp_path / "rank1.ckpt")

    code, report = _inspect_json(legacy, capsys)

    assert code == 1 and "optimizer-shard" in _codes(report)


def test_inspect_flags_an_oss_partitioned_optimizer_state(
    written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upstream = _load(written["upstream"])
    state = upstream["optimizer_states"][0]
    partitioned = {"state": [state["state"], {}], "param_groups": state["param_groups"], "partition": [[0, 1], [2, 3]]}
    legacy = _save({**upstream, "optimizer_states": [partitioned]}, tmp_path / "oss.ckpt")

    code, report = _inspect_json(legacy, capsys)

    assert code == 1 and "optimizer-partition" in _codes(report)


def test_inspect_warns_about_state_for_fewer_parameters_than_listed(
    written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upstream = _load(written["upstream"])
    state = upstream["optimizer_states"][0]
    partial = {"state": {0: state["state"][0]}, "param_groups": state["param_groups"]}
    legacy = _save({**upstream, "optimizer_states": [partial]}, tmp_path / "partial.ckpt")

    code, report = _inspect_json(legacy, capsys)

    assert code == 0 and "optimizer-partial" in _codes(report, "warning")


def test_inspect_flags_a_flattened_optimizer_state(
    written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upstream = _load(written["upstream"])
    state = upstream["optimizer_states"][0]
    flat = {index: {k: v.reshape(-1) for k, v in entry.items()} for index, entry in state["state"].items()}
    legacy = _save({**upstream, "optimizer_states": [{**state, "state": flat}]}, tmp_path / "flat-optimizer.ckpt")

    code, report = _inspect_json(legacy, capsys)

    assert code == 1 and "optimizer-flat" in _codes(report)


def test_inspect_of_a_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nothing.ckpt")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_inspect_of_a_corrupt_file_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"not a checkpoint")
    code, report = _inspect_json(corrupt, capsys)
    assert code == 1 and _codes(report) == {"unreadable"}


def test_inspect_never_runs_code_from_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    malicious = _save({"state_dict": {}, "payload": WiderModel}, tmp_path / "code.ckpt")  # a class: needs unpickling
    code, report = _inspect_json(malicious, capsys)
    assert code == 1 and "weights_only" in report["findings"][0]["message"]


# ---------------------------------------------------------------------------------------------- convert


@pytest.mark.parametrize("prefix", [*WRAPPER_PREFIXES, "module._forward_module."])
def test_convert_strips_each_wrapper_prefix_and_adds_metadata(
    prefix: str, written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upstream = _load(written["upstream"])
    legacy = _save(_prefixed(upstream, prefix), tmp_path / "legacy.ckpt")
    before = legacy.read_bytes()

    assert main(["convert", str(legacy), str(tmp_path / "repaired.ckpt"), "--module", MODEL]) == 0

    repaired = _load(tmp_path / "repaired.ckpt")
    assert list(repaired["state_dict"]) == list(upstream["state_dict"])
    assert all(torch.equal(value, upstream["state_dict"][key]) for key, value in repaired["state_dict"].items())
    assert repaired["lightning_strategies"] == {
        "format_version": 1,
        "strategy": "converted",
        "world_size": 1,
        "state_dict_type": "full",
    }
    assert legacy.read_bytes() == before  # the input is never written
    assert "removed the wrapper prefix" in capsys.readouterr().out


def test_convert_strips_inner_fairscale_segments(
    written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upstream = _load(written["upstream"])
    inner = {
        key.replace("encoder.", "encoder._fsdp_wrapped_module._fpw_module."): value
        for key, value in upstream["state_dict"].items()
    }
    legacy = _save({**upstream, "state_dict": inner}, tmp_path / "inner.ckpt")

    assert main(["convert", str(legacy), str(tmp_path / "repaired.ckpt")]) == 0
    assert list(_load(tmp_path / "repaired.ckpt")["state_dict"]) == list(upstream["state_dict"])


def test_a_converted_legacy_checkpoint_resumes_with_our_strategy(written: dict[str, Path], tmp_path: Path) -> None:
    upstream = _load(written["upstream"])
    legacy = _save(_prefixed(upstream, "module."), tmp_path / "legacy.ckpt")
    assert main(["convert", str(legacy), str(tmp_path / "repaired.ckpt")]) == 0

    restored = tmp_path / "restored.ckpt"
    fit(
        "fsdp_fairscale_fork",
        new_model(seed=11),
        ckpt_path=tmp_path / "repaired.ckpt",
        callbacks=[SaveAfterRestore(restored)],
    )

    after = _load(restored)
    assert all(torch.equal(value, after["state_dict"][key]) for key, value in upstream["state_dict"].items())
    assert _same_optimizer_state(after["optimizer_states"][0], upstream["optimizer_states"][0])


def _same_optimizer_state(left: dict[str, Any], right: dict[str, Any]) -> bool:
    a, b = comparable_optimizer_state(left), comparable_optimizer_state(right)
    return (
        a["lrs"] == b["lrs"]
        and a["params"] == b["params"]
        and a["state"].keys() == b["state"].keys()
        and all(
            torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][index][name]))
            for index, entries in a["state"].items()
            for name, value in entries.items()
        )
    )


def test_convert_refuses_an_issue_13500_flat_shard_with_the_reason(
    written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    legacy = _save(_issue_13500_flat_shard(_load(written["upstream"])), tmp_path / "flat.ckpt")

    assert main(["convert", str(legacy), str(tmp_path / "out.ckpt")]) == 1

    error = capsys.readouterr().err
    assert "Refusing to convert" in error and "flat parameters" in error and "not the model's tensors" in error
    assert not (tmp_path / "out.ckpt").exists()


def test_convert_refuses_an_issue_13500_empty_state_with_the_reason(
    written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    legacy = _save({**_load(written["upstream"]), "state_dict": {}}, tmp_path / "empty.ckpt")

    assert main(["convert", str(legacy), str(tmp_path / "out.ckpt")]) == 1

    assert "empty-state: The model state is empty" in capsys.readouterr().err
    assert not (tmp_path / "out.ckpt").exists()


def test_convert_wraps_a_bare_state_dict_into_a_checkpoint(written: dict[str, Path], tmp_path: Path) -> None:
    bare = {"module." + key: value for key, value in _load(written["upstream"])["state_dict"].items()}
    legacy = _save(bare, tmp_path / "weights.pt")

    assert main(["convert", str(legacy), str(tmp_path / "out.ckpt")]) == 0

    model = ConformanceModel.load_from_checkpoint(tmp_path / "out.ckpt", weights_only=True)
    assert all(torch.equal(value, bare["module." + key]) for key, value in model.state_dict().items())


def test_convert_of_a_canonical_checkpoint_writes_a_copy(
    written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["convert", str(written["ours"]), str(tmp_path / "copy.ckpt")]) == 0
    assert "nothing needed repair" in capsys.readouterr().out
    assert _load(tmp_path / "copy.ckpt")["lightning_strategies"]["strategy"] == "fsdp_fairscale"


def test_convert_never_writes_over_its_input(written: dict[str, Path], tmp_path: Path) -> None:
    legacy = _save(_prefixed(_load(written["upstream"]), "module."), tmp_path / "legacy.ckpt")
    before = legacy.read_bytes()

    assert main(["convert", str(legacy), str(legacy), "--force"]) == 2
    assert main(["convert", str(legacy), str(tmp_path / "." / "legacy.ckpt"), "--force"]) == 2
    assert legacy.read_bytes() == before


def test_convert_replaces_an_existing_output_only_with_force(
    written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    legacy = _save(_prefixed(_load(written["upstream"]), "module."), tmp_path / "legacy.ckpt")
    out = tmp_path / "out.ckpt"
    torch.save({"an": "older checkpoint"}, out)
    before = out.read_bytes()

    assert main(["convert", str(legacy), str(out)]) == 2
    assert "pass --force" in capsys.readouterr().err and out.read_bytes() == before
    assert main(["convert", str(legacy), str(out), "--force"]) == 0
    assert "module.encoder.weight" not in _load(out)["state_dict"]


def test_force_never_replaces_a_file_that_is_not_a_checkpoint(
    written: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "notes.txt"
    out.write_bytes(b"keep me")

    assert main(["convert", str(written["upstream"]), str(out), "--force"]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err and out.read_bytes() == b"keep me"


def test_convert_refuses_a_directory_and_names_consolidate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", str(tmp_path), str(tmp_path.parent / "out.ckpt")]) == 2
    assert "lightning-strategies consolidate" in capsys.readouterr().err
