"""Checkpoints move between upstream Lightning's sharded strategies and every strategy of ours, both ways, exactly.

A user who never installed this package trains with upstream's ``ModelParallelStrategy`` (``fully_shard`` in
``configure_model``), which writes a ``torch.distributed.checkpoint`` directory by default and one full file with
``save_distributed_checkpoint=False``, or with ``FSDPStrategy`` (torch FSDP1). Each of our strategies resumes their
files; upstream resumes our full files and our ``fsdp2`` directories; our ``fsdp_fairscale`` rank files reach upstream
through ``consolidate``. Every resume restores what was saved exactly and continues the uninterrupted run (losses at
1e-5).

``FSDPStrategy`` runs with the CPU fixes of ``tests/support/upstream_runs.py`` (without them its full save segfaults).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_strategies.cli.consolidate import consolidate_checkpoint
from lightning_strategies.cli.inspection import inspect_path
from tests.support.helpers import assert_same_checkpoint_state
from tests.support.upstream_runs import (
    OURS,
    OURS_SHARDED,
    FSDPStrategyOnCPU,
    GPT2ShardedByUser,
    NoDecayGroups,
    ShardedByUser,
    assert_continues,
    fit,
    upstream,
)


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Upstream's uninterrupted run (its sharded directories) and its full files; one epoch of each of ours."""
    root = tmp_path_factory.mktemp("saves")
    found: dict[str, Any] = {"losses": fit(upstream(True), root / "upstream-sharded")}
    found["upstream-sharded"] = root / "upstream-sharded" / "epoch=0.ckpt"
    fit(upstream(False), root / "upstream-full", epochs=1)
    found["upstream-full"] = root / "upstream-full" / "epoch=0.ckpt"
    for name, strategy in {**OURS, **OURS_SHARDED}.items():
        fit(strategy, root / name, epochs=1)
        found[name] = root / name / "epoch=0.ckpt"
    for form in ("sharded", "full"):
        fit(lambda form=form: FSDPStrategyOnCPU(state_dict_type=form), root / f"fsdp1-{form}", epochs=1)
        found[f"fsdp1-{form}"] = root / f"fsdp1-{form}" / "epoch=0.ckpt"
    found["no-decay losses"] = fit(upstream(False), root / "no-decay-upstream", model_class=NoDecayGroups)
    found["no-decay upstream-full"] = root / "no-decay-upstream" / "epoch=0.ckpt"
    fit(lambda: FSDPStrategyOnCPU(state_dict_type="full"), root / "no-decay-fsdp1", epochs=1, model_class=NoDecayGroups)
    found["no-decay fsdp1-full"] = root / "no-decay-fsdp1" / "epoch=0.ckpt"
    return found


def test_upstream_writes_what_this_test_means_to_read(saves: dict[str, Any]) -> None:
    assert (saves["upstream-sharded"] / ".metadata").is_file() and (saves["upstream-sharded"] / "meta.pt").is_file()
    assert saves["upstream-full"].is_file() and saves["fsdp1-full"].is_file()
    assert (saves["fsdp1-sharded"] / ".metadata").is_file()


@pytest.mark.parametrize("form", ["upstream-sharded", "upstream-full", "fsdp1-sharded", "fsdp1-full"])
@pytest.mark.parametrize("ours", list(OURS))
def test_each_of_our_strategies_resumes_upstreams_checkpoint_exactly(
    tmp_path: Path, saves: dict[str, Any], ours: str, form: str
) -> None:
    losses = fit(OURS[ours], tmp_path, ckpt_path=saves[form])
    assert_same_checkpoint_state(saves[form], tmp_path / "restored.ckpt")
    assert_continues(saves["losses"], losses)


@pytest.mark.parametrize("ours", list(OURS))
def test_upstream_resumes_each_of_our_full_checkpoints_exactly(
    tmp_path: Path, saves: dict[str, Any], ours: str
) -> None:
    losses = fit(upstream(False), tmp_path, ckpt_path=saves[ours])
    assert_same_checkpoint_state(saves[ours], tmp_path / "restored.ckpt")
    assert_continues(saves["losses"], losses)


def test_upstream_resumes_our_fsdp2_sharded_directory_exactly(tmp_path: Path, saves: dict[str, Any]) -> None:
    losses = fit(upstream(False), tmp_path, ckpt_path=saves["fsdp2-sharded"])
    assert_same_checkpoint_state(saves["fsdp2-sharded"], tmp_path / "restored.ckpt")
    assert_continues(saves["losses"], losses)


#: How torch's DCP reader refuses a directory without `.metadata`: the missing file (torch 2.13 and later), or
#: "metadata is None" (torch 2.11, the `oldest` leg).
NO_DCP_METADATA = r"No such file or directory: .*\.metadata|metadata is None"


def test_our_fairscale_rank_files_reach_upstream_through_consolidate(tmp_path: Path, saves: dict[str, Any]) -> None:
    # Upstream reads only torch.distributed.checkpoint directories: it looks for a `.metadata` that is not there.
    with pytest.raises(RuntimeError, match=NO_DCP_METADATA):
        fit(upstream(False), tmp_path / "direct", ckpt_path=saves["fsdp_fairscale-sharded"])
    consolidated = tmp_path / "consolidated.ckpt"
    consolidate_checkpoint(saves["fsdp_fairscale-sharded"], consolidated, show_progress=False)
    losses = fit(upstream(False), tmp_path / "resumed", ckpt_path=consolidated)
    assert_same_checkpoint_state(saves["fsdp_fairscale-sharded"], tmp_path / "resumed" / "restored.ckpt")
    assert_continues(saves["losses"], losses)


@pytest.mark.parametrize("ours", list(OURS))
def test_upstreams_full_file_with_param_groups_out_of_module_order_resumes_exactly(
    tmp_path: Path, saves: dict[str, Any], ours: str
) -> None:
    # Upstream numbers the parameters of its full files in the module's order ([[0, 2], [1, 3]] here), torch through
    # the groups ([[0, 1], [2, 3]]): both mean the same state, and it must land on the same parameters.
    saved = saves["no-decay upstream-full"]
    assert [
        group["params"] for group in torch.load(saved, weights_only=True)["optimizer_states"][0]["param_groups"]
    ] == [
        [0, 2],
        [1, 3],
    ]
    losses = fit(OURS[ours], tmp_path, ckpt_path=saved, model_class=NoDecayGroups)
    assert_same_checkpoint_state(saved, tmp_path / "restored.ckpt")
    assert_continues(saves["no-decay losses"], losses)


@pytest.mark.parametrize("form", ["sharded", "full"])
@pytest.mark.parametrize("ours", list(OURS))
def test_fsdp_strategy_resumes_each_of_our_full_checkpoints_exactly(
    tmp_path: Path, saves: dict[str, Any], ours: str, form: str
) -> None:
    losses = fit(lambda: FSDPStrategyOnCPU(state_dict_type=form), tmp_path, ckpt_path=saves[ours])
    assert_same_checkpoint_state(saves[ours], tmp_path / "restored.ckpt")
    assert_continues(saves["losses"], losses)


@pytest.mark.parametrize(
    ("form", "refusal"),
    [
        # FSDPStrategy reads its own DCP layout (the model under "model"), ours is ModelParallelStrategy's.
        ("fsdp2-sharded", r"Missing key in checkpoint state_dict: model\."),
        # It reads only torch.distributed.checkpoint directories.
        ("fsdp_fairscale-sharded", NO_DCP_METADATA),
    ],
)
def test_fsdp_strategy_resumes_our_sharded_directories_through_consolidate(
    tmp_path: Path, saves: dict[str, Any], form: str, refusal: str
) -> None:
    with pytest.raises(RuntimeError, match=refusal):
        fit(lambda: FSDPStrategyOnCPU(state_dict_type="sharded"), tmp_path / "direct", ckpt_path=saves[form])
    consolidated = tmp_path / "consolidated.ckpt"
    consolidate_checkpoint(saves[form], consolidated, show_progress=False)
    losses = fit(lambda: FSDPStrategyOnCPU(state_dict_type="sharded"), tmp_path / "resumed", ckpt_path=consolidated)
    assert_same_checkpoint_state(saves[form], tmp_path / "resumed" / "restored.ckpt")
    assert_continues(saves["losses"], losses)


@pytest.mark.parametrize("ours", list(OURS))
def test_each_of_our_strategies_resumes_an_fsdp_strategy_full_file_with_param_groups_out_of_module_order_exactly(
    tmp_path: Path, saves: dict[str, Any], ours: str
) -> None:
    # FSDPStrategy re-keys its full optimizer state to parameter ids with FSDP1's own API: the module's order.
    saved = saves["no-decay fsdp1-full"]
    groups = torch.load(saved, weights_only=True)["optimizer_states"][0]["param_groups"]
    assert [group["params"] for group in groups] == [[0, 2], [1, 3]]
    losses = fit(OURS[ours], tmp_path, ckpt_path=saved, model_class=NoDecayGroups)
    assert_same_checkpoint_state(saved, tmp_path / "restored.ckpt")
    assert_continues(saves["no-decay losses"], losses)


# ---------------------------------------------------------------------------------------------- inspect, consolidate


@pytest.mark.parametrize(
    ("form", "writer"), [("upstream-sharded", "ModelParallelStrategy"), ("fsdp1-sharded", "FSDPStrategy")]
)
def test_inspect_names_upstreams_sharded_directory_and_reports_it_clean(
    saves: dict[str, Any], form: str, writer: str
) -> None:
    report = inspect_path(saves[form], "tests.support.upstream_runs:ShardedByUser")
    assert not report.errors, report.errors
    named = [finding.message for finding in report.findings if finding.code == "upstream-sharded"]
    assert named and f"upstream Lightning ({writer})" in named[0] and "keyed by parameter name" in named[0]
    assert report.written_by is not None and report.written_by["strategy"] == f"lightning:{writer}"


def test_inspect_says_how_upstreams_full_file_numbers_its_optimizer_state(saves: dict[str, Any]) -> None:
    report = inspect_path(saves["no-decay upstream-full"], "tests.support.upstream_runs:NoDecayGroups")
    assert not report.errors, report.errors
    numbering = [finding.message for finding in report.findings if finding.code == "optimizer-numbering"]
    assert numbering and "module's parameter order" in numbering[0]
    assert "optimizer-numbering" not in {finding.code for finding in inspect_path(saves["fsdp2"]).findings}


@pytest.mark.parametrize("form", ["upstream-sharded", "fsdp1-sharded"])
def test_consolidate_turns_upstreams_directory_into_the_full_file_upstream_would_write(
    tmp_path: Path, saves: dict[str, Any], form: str
) -> None:
    out = tmp_path / "full.ckpt"
    consolidate_checkpoint(saves[form], out, show_progress=False)
    full = torch.load(out, weights_only=True)
    assert set(full["state_dict"]) == set(ShardedByUser().state_dict())
    assert full["global_step"] == torch.load(saves["upstream-full"], weights_only=True)["global_step"]
    if form == "upstream-sharded":  # the same run saved both ways: the same state
        assert_same_checkpoint_state(saves["upstream-full"], out)


# ---------------------------------------------------------------------------------------------- a real architecture


@pytest.fixture(scope="module")
def gpt2_saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Upstream's uninterrupted GPT-2 run, saving its default DCP directory after each epoch."""
    root = tmp_path_factory.mktemp("gpt2")
    losses = fit(upstream(True), root, model_class=GPT2ShardedByUser)
    return {"losses": losses, "sharded": root / "epoch=0.ckpt"}


@pytest.mark.parametrize("ours", list(OURS))
def test_each_of_our_strategies_resumes_upstreams_gpt2_with_the_usual_recipe_exactly(
    tmp_path: Path, gpt2_saves: dict[str, Any], ours: str
) -> None:
    # Tied wte/lm_head, AdamW with no-decay groups (not in module order), a warmup schedule.
    losses = fit(OURS[ours], tmp_path, ckpt_path=gpt2_saves["sharded"], model_class=GPT2ShardedByUser)
    assert_same_checkpoint_state(gpt2_saves["sharded"], tmp_path / "restored.ckpt")
    assert_continues(gpt2_saves["losses"], losses)


@pytest.mark.parametrize("form", list(OURS_SHARDED))
@pytest.mark.parametrize("ours", list(OURS))
def test_each_of_our_strategies_resumes_each_of_our_sharded_directories_exactly(
    tmp_path: Path, saves: dict[str, Any], ours: str, form: str
) -> None:
    # In place where the strategy reads the layout (fsdp2's DCP, fsdp_fairscale's own rank files), read whole elsewhere.
    losses = fit(OURS[ours], tmp_path, ckpt_path=saves[form])
    assert_same_checkpoint_state(saves[form], tmp_path / "restored.ckpt")
    assert_continues(saves["losses"], losses)
