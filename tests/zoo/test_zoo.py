"""Every zoo model under every strategy: fit, resume under every other strategy, plain load, inspect/consolidate.

Each test reads its model's report (one run per model, see ``conftest.py``) and fails with the harness's own words,
which name the model, the strategy and the check.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.strategies import DDPStrategy
from safetensors import safe_open
from torch.utils.data import default_collate

from lightning_strategies.cli import main
from tests.zoo.harness import REFERENCE, ModelReport, ZooStrategy, default_strategies, run_model
from tests.zoo.models import BATCH_SIZE, ZOO, ZooModel

pytest.importorskip("transformers")

# A model's first test runs its whole zoo (about 30 fits of 2 forked processes).
pytestmark = pytest.mark.timeout(900)

Report = Callable[[ZooModel], ModelReport]

PAIRS = [(model, strategy) for model in ZOO for strategy in default_strategies() if strategy.applies(model)]
PAIR_IDS = [f"{model.id}-{strategy.label}" for model, strategy in PAIRS]
CELLS = [
    (model, saver, resumer)
    for model, saver in PAIRS
    for _, resumer in PAIRS
    if _ is model and resumer.label != saver.label
]
CELL_IDS = [f"{model.id}-{saver.label}-to-{resumer.label}" for model, saver, resumer in CELLS]


def _saved(report: ModelReport, strategy: ZooStrategy) -> None:
    if strategy.label not in report.saved:
        pytest.fail(f"[{report.model.name}] {strategy.label}: not checked, its fit failed (check 1)")


@pytest.mark.parametrize(("model", "strategy"), PAIRS, ids=PAIR_IDS)
def test_fit_works_with_ddps_losses(zoo_report: Report, model: ZooModel, strategy: ZooStrategy) -> None:
    report = zoo_report(model)
    failures = report.problems(strategy.label, 1)
    assert not failures, report.explain(failures)


@pytest.mark.parametrize(("model", "saved_by", "resumed_by"), CELLS, ids=CELL_IDS)
def test_a_mid_run_checkpoint_resumes_exactly_under_another_strategy(
    zoo_report: Report, model: ZooModel, saved_by: ZooStrategy, resumed_by: ZooStrategy
) -> None:
    report = zoo_report(model)
    _saved(report, saved_by)
    failures = report.problems(saved_by.label, 2, resumed_by.label)
    assert not failures, report.explain(failures)


@pytest.mark.parametrize(("model", "strategy"), PAIRS, ids=PAIR_IDS)
def test_the_checkpoint_loads_as_a_plain_checkpoint_with_the_bare_models_keys(
    zoo_report: Report, model: ZooModel, strategy: ZooStrategy
) -> None:
    report = zoo_report(model)
    _saved(report, strategy)
    failures = report.problems(strategy.label, 3)
    assert not failures, report.explain(failures)


@pytest.mark.parametrize(("model", "strategy"), PAIRS, ids=PAIR_IDS)
def test_inspect_finds_nothing_and_a_sharded_save_consolidates_to_the_full_checkpoint(
    zoo_report: Report, model: ZooModel, strategy: ZooStrategy
) -> None:
    report = zoo_report(model)
    _saved(report, strategy)
    failures = report.problems(strategy.label, 4)
    assert not failures, report.explain(failures)


def _exported_keys(directory: Path) -> list[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as exported:
        return list(exported.keys())


# Exported from ddp's full file and from the sharded directories of fsdp_fairscale (rank files) and fsdp2 (DCP).
EXPORTS = [(model, saver, saver != REFERENCE) for model in ZOO for saver in (REFERENCE, "fsdp_fairscale", "fsdp2")]
EXPORT_IDS = [f"{model.id}-{saver}{'-sharded' if sharded else ''}" for model, saver, sharded in EXPORTS]


@pytest.mark.parametrize(("model", "saved_by", "sharded"), EXPORTS, ids=EXPORT_IDS)
def test_the_export_loads_with_from_pretrained_and_gives_the_trained_models_outputs(
    zoo_report: Report, model: ZooModel, saved_by: str, sharded: bool, tmp_path: Path
) -> None:
    report = zoo_report(model)
    checkpoint = report.saved_checkpoint(saved_by, sharded)
    if not checkpoint.exists():
        pytest.fail(f"[{model.name}] {saved_by}: not checked, its save failed (checks 1 and 4 say why)")
    out = tmp_path / "export"
    # A DCP directory holds a copy per tied name; the model class says which names are one parameter.
    module = ["--module", f"{model.module.__module__}:{model.module.__qualname__}"] if saved_by == "fsdp2" else []

    assert main(["export", str(checkpoint), str(out), "--submodule", "model", "--no-progress", *module]) == 0

    trained = model.module()  # the trained model: the same run's full save (check 4: equal to the sharded one)
    trained.load_state_dict(torch.load(report.saved_checkpoint(saved_by), weights_only=True)["state_dict"])
    trained.model.save_pretrained(tmp_path / "hf")  # what Hugging Face writes for the same model: the same keys
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as theirs:
        assert set(_exported_keys(out)) == set(theirs.keys()), f"[{model.name}] other keys than save_pretrained's"
    trained.model.config.save_pretrained(out)  # the export holds weights; the config comes from the model
    loaded, info = type(trained.model).from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), f"[{model.name}] from_pretrained of the export of {saved_by}'s save: {info}"
    for left, right in model.tied:  # written once, tied again from the config
        assert loaded.get_parameter(left.removeprefix("model.")) is loaded.get_parameter(right.removeprefix("model."))
    dataset = trained.dataset(BATCH_SIZE, seed=99)
    batch = default_collate([dataset[index] for index in range(BATCH_SIZE)])
    with torch.no_grad():
        expected, got = trained.model.eval()(**batch), loaded.eval()(**batch)
    assert torch.equal(got.logits, expected.logits), f"[{model.name}] the export's outputs differ"
    assert torch.equal(got.loss, expected.loss)


class DropsTheTiedKey(DDPStrategy):
    """ddp, except that its checkpoints lack GPT-2's tied ``lm_head.weight`` (what fsdp_fairscale once wrote)."""

    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        state.pop("model.lm_head.weight", None)
        return state


def test_a_strategy_that_drops_the_tied_key_fails_the_zoo_naming_model_strategy_and_check(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    gpt2 = next(model for model in ZOO if model.name == "gpt2")
    control = next(strategy for strategy in default_strategies() if strategy.label == REFERENCE)
    broken = ZooStrategy("ddp_drops_tied_key", lambda model: DropsTheTiedKey(start_method="fork"))

    report = run_model(gpt2, tmp_path, [control, broken])

    plain_load = report.explain(report.problems("ddp_drops_tied_key", 3))
    assert "[gpt2] ddp_drops_tied_key: check 3 (loads as a plain checkpoint): keys missing:" in plain_load
    assert "model.lm_head.weight" in plain_load
    resumed = report.explain(report.problems("ddp_drops_tied_key", 2, REFERENCE))
    assert "[gpt2] ddp_drops_tied_key -> ddp: check 2 (resumes exactly): resume raised" in resumed
    assert "lm_head.weight" in resumed
    assert not report.problems(REFERENCE, 1) and not report.problems(REFERENCE, 3)  # the control's own file is good
    assert "| ddp_drops_tied_key | pass | FAIL: resume raised" in report.table()


def test_the_docs_show_a_zoo_table_for_every_model() -> None:
    page = (Path(__file__).parents[2] / "docs" / "resume-matrix.md").read_text()

    for model in ZOO:
        assert f"| {model.name}: saved by \\ resumed by | fit |" in page
