"""consolidate: sharded checkpoints of fsdp_fairscale and fsdp2 become the full checkpoint the same run writes, which
every strategy resumes exactly; incomplete or foreign directories are refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy
from lightning_strategies.cli import main
from lightning_strategies.testing import ConformanceModel, SaveAfterRestore
from tests.conftest import free_loopback_port
from tests.support.helpers import comparable_optimizer_state, fit, new_model, train_and_save

MODEL = "lightning_strategies.testing:ConformanceModel"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """For fsdp_fairscale and fsdp2: a sharded checkpoint and the full one an identical run writes."""
    directory = tmp_path_factory.mktemp("saved")
    runs = {
        "fairscale_sharded": FairScaleFSDPStrategy(start_method="fork", state_dict_type="sharded"),
        "fairscale_full": FairScaleFSDPStrategy(start_method="fork"),
        "fsdp2_sharded": FSDP2Strategy(start_method="fork", state_dict_type="sharded"),
        "fsdp2_full": FSDP2Strategy(start_method="fork"),
    }
    paths = {}
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("MASTER_ADDR", "127.0.0.1")
        environment.setenv("GLOO_SOCKET_IFNAME", "lo")
        for name, strategy in runs.items():
            environment.setenv("MASTER_PORT", str(free_loopback_port()))
            paths[name] = train_and_save(strategy, directory / name)
    yield paths


def _load(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, weights_only=True)
    return loaded


def _assert_same_state(expected: dict[str, Any], got: dict[str, Any]) -> None:
    assert expected["state_dict"].keys() == got["state_dict"].keys()
    for key, value in expected["state_dict"].items():
        assert torch.equal(value, got["state_dict"][key]), key
    assert len(expected["optimizer_states"]) == len(got["optimizer_states"])
    for left, right in zip(expected["optimizer_states"], got["optimizer_states"], strict=True):
        a, b = comparable_optimizer_state(left), comparable_optimizer_state(right)
        assert a["lrs"] == b["lrs"] and a["params"] == b["params"] and a["state"].keys() == b["state"].keys()
        for index, entries in a["state"].items():
            assert entries.keys() == b["state"][index].keys()
            for name, value in entries.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][index][name])), (index, name)


@pytest.fixture(scope="module")
def consolidated(saved: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("consolidated")
    paths = {}
    for name in ("fairscale", "fsdp2"):
        paths[name] = directory / f"{name}.ckpt"
        assert main(["consolidate", str(saved[f"{name}_sharded"]), str(paths[name])]) == 0
    return paths


@pytest.mark.parametrize("name", ["fairscale", "fsdp2"])
def test_consolidating_gives_the_full_checkpoint_of_the_same_run(
    name: str, saved: dict[str, Path], consolidated: dict[str, Path]
) -> None:
    full, result = _load(saved[f"{name}_full"]), _load(consolidated[name])

    _assert_same_state(full, result)
    assert result["optimizer_states"][0]["param_groups"] == full["optimizer_states"][0]["param_groups"]
    assert result["lightning_strategies"] == full["lightning_strategies"]
    assert result["lr_schedulers"] == full["lr_schedulers"] and result["loops"] == full["loops"]


@pytest.mark.parametrize(
    ("name", "resumed_by"),
    [
        ("fairscale", "ddp_fork"),
        ("fairscale", "fsdp2_fork"),
        ("fairscale", "ddp_sharded_fork"),
        ("fsdp2", "ddp_fork"),
        ("fsdp2", "fsdp_fairscale_fork"),
    ],
)
def test_a_consolidated_checkpoint_resumes_exactly_with_another_strategy(
    name: str, resumed_by: str, consolidated: dict[str, Path], tmp_path: Path
) -> None:
    restored = tmp_path / "restored.ckpt"
    fit(resumed_by, new_model(seed=11), ckpt_path=consolidated[name], callbacks=[SaveAfterRestore(restored)])

    _assert_same_state(_load(consolidated[name]), _load(restored))


def test_a_consolidated_checkpoint_passes_inspect_against_the_model(
    consolidated: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(consolidated["fairscale"]), "--module", MODEL]) == 0
    assert "OK: no errors found." in capsys.readouterr().out


@pytest.mark.parametrize("name", ["fairscale_sharded", "fsdp2_sharded"])
def test_inspect_describes_a_sharded_directory_and_names_consolidate(
    name: str, saved: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(saved[name]), "--module", MODEL]) == 0
    out = capsys.readouterr().out
    assert "world size 2, format version 1, sharded" in out
    assert "216 elements" in out and "lightning-strategies consolidate" in out


def test_inspect_flags_a_rank_file_given_alone(saved: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(saved["fairscale_sharded"] / "rank0.pt")]) == 1
    out = capsys.readouterr().out
    assert "rank-file" in out and "flat-shard" in out


class TiedHeadModel(ConformanceModel):
    """The conformance model with a second head that shares the first one's weight (as ``lm_head`` shares ``wte``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.second_head = nn.Linear(16, 4)
        self.second_head.weight = self.head.weight

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def test_a_tied_weight_is_consolidated_under_each_of_its_names_with_its_shape(tmp_path: Path) -> None:
    sharded = train_and_save(
        FairScaleFSDPStrategy(start_method="fork", state_dict_type="sharded"), tmp_path, cls=TiedHeadModel
    )
    out = tmp_path / "consolidated.ckpt"

    assert main(["consolidate", str(sharded), str(out), "--no-progress"]) == 0
    state = _load(out)["state_dict"]
    expected = TiedHeadModel().state_dict()
    assert {key: value.shape for key, value in state.items()} == {key: value.shape for key, value in expected.items()}
    assert torch.equal(state["second_head.weight"], state["head.weight"])


def test_consolidate_refuses_a_directory_without_meta(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "rank0.pt").write_bytes((saved["fairscale_sharded"] / "rank0.pt").read_bytes())

    assert main(["consolidate", str(incomplete), str(tmp_path / "out.ckpt")]) == 1
    assert "has no meta.pt: its save did not finish" in capsys.readouterr().err
    assert not (tmp_path / "out.ckpt").exists()


def test_consolidate_refuses_a_missing_rank_file(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    for file in ("meta.pt", "rank0.pt"):
        (partial / file).write_bytes((saved["fairscale_sharded"] / file).read_bytes())

    assert main(["consolidate", str(partial), str(tmp_path / "out.ckpt")]) == 1
    assert "lacks rank1.pt" in capsys.readouterr().err


def test_consolidate_refuses_rank_files_without_a_layout(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old"
    old.mkdir()
    (old / "meta.pt").write_bytes((saved["fairscale_sharded"] / "meta.pt").read_bytes())
    for rank in range(2):
        shard = _load(saved["fairscale_sharded"] / f"rank{rank}.pt")
        del shard["flat_layout"]
        torch.save(shard, old / f"rank{rank}.pt")

    assert main(["consolidate", str(old), str(tmp_path / "out.ckpt")]) == 1
    assert "no 'flat_layout' block" in capsys.readouterr().err


def test_consolidate_takes_a_directory_and_keeps_existing_outputs(saved: dict[str, Path], tmp_path: Path) -> None:
    assert main(["consolidate", str(saved["fairscale_full"]), str(tmp_path / "out.ckpt")]) == 2
    existing = tmp_path / "existing.ckpt"
    existing.write_bytes(b"keep me")
    assert main(["consolidate", str(saved["fsdp2_sharded"]), str(existing)]) == 2
    assert existing.read_bytes() == b"keep me"
    assert main(["consolidate", str(saved["fsdp2_sharded"]), str(saved["fsdp2_sharded"] / "out.ckpt")]) == 2
