"""Every strategy trains each drawn recipe like upstream ``ddp``, or refuses it on every rank before its first step.

The recipes are drawn by :mod:`tests.fuzz.recipes` along every dimension users vary (module shape, how the step
calls it, automatic or manual optimization, optimizer, scheduler, precision, each strategy's options, a checkpoint
in the middle resumed under another strategy); :mod:`tests.fuzz.runner` judges each strategy's run against ``ddp``'s.
CI draws the same recipes every run (derandomized); ``python3 dev.py fuzz --examples N --seed S`` draws new ones.
Each recipe a campaign found failing is kept below as an explicit example.
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from lightning_strategies import FSDP2Strategy
from tests.fuzz.__main__ import parse_recipe
from tests.fuzz.recipes import Automatic, Checkpoint, Manual, ModelSpec, Recipe, recipes
from tests.fuzz.runner import Fuzzer, Report

#: Recipes drawn in CI; each runs under ddp and all three strategies (about 2.5 s of fits per recipe on 2 busy cores).
#: A regression guard, not the search: campaigns (`dev.py fuzz`) draw new recipes by the thousand.
CI_EXAMPLES = 40

FUZZ = settings(
    max_examples=CI_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    # No shrinking: the failing recipe is printed whole with its replay command; shrinking would re-run many fits.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory) -> Fuzzer:
    return Fuzzer(workdir=tmp_path_factory.mktemp("fuzz"))


# Found by campaigns, kept as explicit examples (each ran wrong before its fix).
@example(recipe=Recipe(optimization=Manual(kind="gan", toggle=True, first="b")))  # discriminator step first
@example(recipe=Recipe(model=ModelSpec(container="modulelist"), options=(("fsdp2", (("min_num_params", 300),)),)))
@example(recipe=Recipe(model=ModelSpec(tied=True), options=(("fsdp2", (("shard_module_classes", ("Linear",)),)),)))
@example(
    recipe=Recipe(
        optimization=Manual(kind="one"), options=(("ddp_sharded", (("reduce_buffer_size", 2**20),)),)
    )  # refused when fit starts, not at the first backward pass
)
@example(recipe=Recipe(checkpoint=Checkpoint("fsdp2", "sharded", "fsdp_fairscale"), precision="bf16-mixed"))
# fsdp_fairscale: weight decay moved an uncalled layer flattened with called ones
@example(recipe=Recipe(model=ModelSpec(uncalled=True), optimizer="sgd"))
@example(  # fsdp_fairscale: a method of an auto-wrapped child reaches its layers outside its forward (refused)
    recipe=Recipe(
        model=ModelSpec(tied=True),
        call="submodules",
        optimization=Manual(kind="one"),
        options=(("fsdp_fairscale", (("flatten_parameters", False), ("auto_wrap_min_params", 300))),),
    )
)
@example(recipe=Recipe(optimization=Manual(kind="split", clip=True)))  # fsdp_fairscale clipped both optimizers' grads
@example(  # fsdp_fairscale with move_grads_to_cpu: an uncalled layer got a zero gradient
    recipe=Recipe(
        model=ModelSpec(uncalled=True),
        optimization=Automatic(accumulate=2),
        optimizer="adamw_no_decay",
        options=(("fsdp_fairscale", (("flatten_parameters", False), ("move_grads_to_cpu", True))),),
    )
)
@example(recipe=Recipe(model=ModelSpec(batchnorm=True), optimization=Automatic(clip="norm")))  # a bias before BN
@FUZZ
@given(recipe=recipes())
@pytest.mark.timeout(900)
def test_every_strategy_trains_each_drawn_recipe_like_ddp_or_refuses_it_before_its_first_step(
    fuzzer: Fuzzer, recipe: Recipe
) -> None:
    report = fuzzer.run(recipe)
    assert report.ok, report.describe()


# ---------------------------------------------------------------------------------------------- the fuzzer itself


class FSDP2ThatSkipsOneReduction(FSDP2Strategy):
    """fsdp2 broken on purpose: after a micro-batch whose gradients are accumulated without a reduction, it forgets
    to turn reductions back on, so the last micro-batch of each accumulated step is not reduced either."""

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        with super().block_backward_sync():
            yield None
        module = self.lightning_module
        if module is not None and hasattr(module, "set_requires_gradient_sync"):
            module.set_requires_gradient_sync(False)


def test_the_fuzzer_finds_a_strategy_that_skips_one_gradient_reduction_and_its_recipe_replays(tmp_path: Path) -> None:
    def broken(recipe: Recipe, options: dict[str, Any]) -> FSDP2Strategy:
        return FSDP2ThatSkipsOneReduction(start_method="fork")

    fuzzer = Fuzzer({"fsdp2": broken}, workdir=tmp_path)
    found: list[Report] = []

    @settings(FUZZ, max_examples=40, phases=[Phase.generate])
    @given(recipe=recipes())
    def search(recipe: Recipe) -> None:
        if found:
            return  # the rest of the draws cost nothing
        # Checkpoints are left out: the search is for the broken step, and each one costs two more fits.
        report = fuzzer.run(replace(recipe, checkpoint=None))
        if not report.ok:
            found.append(report)

    search()

    assert found, "40 drawn recipes did not find a strategy that skips the last micro-batch's gradient reduction"
    report = found[0]
    (verdict,) = report.verdicts
    assert verdict.verdict == "different"
    assert isinstance(report.recipe.optimization, Automatic) and report.recipe.optimization.accumulate == 2
    # The printed recipe replays alone, to the same verdict.
    replayed = parse_recipe(report.describe().splitlines()[0].removeprefix("recipe: "))
    assert replayed == report.recipe
    assert fuzzer.run(replayed).verdicts[0].verdict == "different"


def test_a_run_that_never_ends_is_judged_a_hang_and_its_workers_are_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.fuzz import runner

    class RankZeroNeverStarts(FSDP2Strategy):
        def setup(self, trainer: Any) -> None:
            if self.global_rank == 0:
                threading.Event().wait()  # for ever: rank 1 waits for it in its first collective
            super().setup(trainer)

    monkeypatch.setattr(runner, "HANG_SECONDS", 10.0)
    fuzzer = Fuzzer({"fsdp2": lambda recipe, options: RankZeroNeverStarts(start_method="fork")}, workdir=tmp_path)

    (verdict,) = fuzzer.run(Recipe()).verdicts

    assert verdict.verdict == "hang"
