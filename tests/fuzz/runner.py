"""Runs a recipe under upstream ``ddp`` and under each of our strategies, and judges each run against ``ddp``.

Every run is a fork fit of two CPU processes in this process (about 0.3 s for these modules). A verdict is one of:

- ``equal``: the final state (weights, buffers, extra state) equals ``ddp``'s (fp32 within 1e-5, bf16-mixed within
  :data:`BF16_TOLERANCE`);
- ``refused``: every rank raised the same error from this package's code before the first optimizer step changed
  anything (a refusal at fit start, or in the first step before the optimizer stepped; its message is recorded);
- ``different``: trained, and ended elsewhere than ``ddp`` (a silent difference);
- ``crash``: an error that is not such a refusal on every rank (raised inside torch, fairscale or
  Lightning, on one rank only, or after an optimizer step);
- ``hang``: the run did not end within :data:`HANG_SECONDS` (its workers are killed).

A recipe with a checkpoint also runs its first epoch under ``saved_by`` and resumes it under ``resumed_by``; the
resumed run must end equal to ``ddp``'s uninterrupted one (unless either strategy refuses the recipe itself).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.conftest import free_loopback_port, write_json
from tests.fuzz.recipes import EPOCHS, OURS, REFERENCE, SHARDED_FORMATS, Recipe, build_module
from tests.support.flavour import ours, pl

#: fp32 runs must end this close to ``ddp`` (the order of a sum of two ranks' gradients is all that differs).
FP32_TOLERANCE = 1e-5
#: bf16-mixed runs: held to the same bound. Our strategies run the same autocast ops as ``ddp`` on the same inputs
#: and reduce fp32 gradients; measured over 25 drawn bf16 recipes, ``ddp_sharded`` and ``fsdp2`` ended bitwise equal
#: to ``ddp`` while bf16 itself moved the weights 4.6e-5 to 1.9e-3 away from fp32 (docs/recipes.md): a looser bound
#: would hide differences of the size bf16 makes.
BF16_TOLERANCE = FP32_TOLERANCE
#: A run that takes longer than this is a hang (a fit of these modules takes well under a second).
HANG_SECONDS = 60.0

_LIBRARY = str(Path(ours.__file__).parent)

Strategies = dict[str, Callable[[Recipe, dict[str, Any]], Any]]


def _ddp(recipe: Recipe, options: dict[str, Any]) -> Any:
    # A GAN's pass leaves the other network without gradients, and uncalled layers never get one: ddp must be told.
    return pl.strategies.DDPStrategy(
        start_method="fork",
        find_unused_parameters=True,
        broadcast_buffers=options.get("broadcast_buffers", True),
    )


def _ours(name: str) -> Callable[[Recipe, dict[str, Any]], Any]:
    classes = {
        "ddp_sharded": ours.ShardedDDPStrategy,
        "fsdp_fairscale": ours.FairScaleFSDPStrategy,
        "fsdp2": ours.FSDP2Strategy,
    }

    def make(recipe: Recipe, options: dict[str, Any]) -> Any:
        if "shard_module_classes" in options:  # drawn by name, so that a recipe's repr replays it
            options["shard_module_classes"] = [getattr(torch.nn, cls) for cls in options["shard_module_classes"]]
        return classes[name](start_method="fork", **options)

    return make


#: How each strategy under test is built from a recipe's drawn options (tests may add a deliberately broken one).
STRATEGIES: Strategies = {name: _ours(name) for name in OURS}


@dataclass
class RankFailure:
    """What one rank raised."""

    rank: int
    kind: str
    message: str
    raised_in_package: bool
    trained: bool


@dataclass
class Run:
    """One fit's outcome: the main process's state after the fit, or what went wrong."""

    state: dict[str, Any] | None = None
    failures: list[RankFailure] = field(default_factory=list)
    error: str = ""
    hung: bool = False

    def refusal(self, world_size: int = 2) -> str | None:
        """The refusal's message when every rank refused with the same error from our code before an optimizer step."""
        if self.state is not None or self.hung or len(self.failures) != world_size:
            return None
        if any(failure.trained or not failure.raised_in_package for failure in self.failures):
            return None
        messages = {failure.message for failure in self.failures}
        return messages.pop() if len(messages) == 1 else None


@dataclass
class Verdict:
    """A strategy's verdict on a recipe."""

    strategy: str
    verdict: str  # equal | refused | different | crash | hang
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict in ("equal", "refused")


@dataclass
class Report:
    """Every verdict on one recipe."""

    recipe: Recipe
    verdicts: list[Verdict]

    @property
    def ok(self) -> bool:
        return all(verdict.ok for verdict in self.verdicts)

    def describe(self) -> str:
        lines = [f"recipe: {self.recipe!r}", f"replay: {self.recipe.replay()}"]
        lines += [f"  {v.strategy}: {v.verdict}{' - ' + v.detail if v.detail else ''}" for v in self.verdicts]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- one fit


class _RecordingTrainer(pl.Trainer):  # type: ignore[misc, name-defined]
    """A Trainer whose fit, on every rank, records what it raised and whether a training batch had started."""

    record_dir: Path

    def _fit_impl(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._fit_impl(*args, **kwargs)
        except BaseException as exception:
            frames = traceback.extract_tb(exception.__traceback__)
            raiser = frames[-1].filename if frames else ""
            failure = {
                "rank": self.global_rank,
                "kind": type(exception).__name__,
                "message": str(exception).strip().splitlines()[0][:400] if str(exception).strip() else "",
                "raised_in_package": raiser.startswith(_LIBRARY),
                # An optimizer step of this fit completed (not counting the steps of the checkpoint it resumed).
                "trained": self.global_step > getattr(self, "_recipe_start_step", self.global_step),
            }
            write_json(self.record_dir / f"failure-rank{self.global_rank}.json", failure)
            self._wait_for_peers()
            raise

    def _wait_for_peers(self) -> None:
        # torch's launcher kills the other workers once one has failed: give each of them a moment to record its own
        # failure (a refusal must come from every rank), bounded so that a peer stuck in a collective cannot hang us.
        deadline = threading.Event()
        for _ in range(40):
            if len(list(self.record_dir.glob("failure-rank*.json"))) >= self.world_size:
                return
            deadline.wait(0.05)


class _TrainingStarted(pl.Callback):  # type: ignore[misc, name-defined]
    """Records the optimizer steps done when training starts (a resumed fit starts from its checkpoint's)."""

    def on_train_start(self, trainer: Any, *args: Any) -> None:
        trainer._recipe_start_step = trainer.global_step


@contextmanager
def _watchdog(seconds: float) -> Iterator[threading.Event]:
    """Kills this process's worker processes if the block runs longer than ``seconds``; the event says it did."""
    fired = threading.Event()

    def kill() -> None:
        fired.set()
        for child in multiprocessing.active_children():
            child.kill()

    timer = threading.Timer(seconds, kill)
    timer.daemon = True
    timer.start()
    try:
        yield fired
    finally:
        timer.cancel()


def fit_once(
    recipe: Recipe,
    strategy: Any,
    directory: Path,
    *,
    max_epochs: int = EPOCHS,
    ckpt_path: Path | None = None,
    save: bool = False,
) -> Run:
    """One fork fit of the recipe's module; returns the main process's state after it, or the failures."""
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_loopback_port())
    module = build_module(recipe)
    callbacks: list[Any] = [_TrainingStarted()]
    if save:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1))
    automatic = getattr(recipe.optimization, "accumulate", None)
    clip = getattr(recipe.optimization, "clip", None) if automatic is not None else None
    trainer = _RecordingTrainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        precision=recipe.precision,
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=save,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        accumulate_grad_batches=automatic or 1,
        gradient_clip_val=0.3 if clip else None,
        gradient_clip_algorithm=clip,
    )
    trainer.record_dir = directory
    run = Run()
    with _watchdog(HANG_SECONDS) as fired:
        try:
            trainer.fit(module, ckpt_path=ckpt_path)
            run.state = {key: _detached(value) for key, value in module.state_dict().items()}
        except BaseException as exception:  # every failure is judged below
            run.error = f"{type(exception).__name__}: {_first_lines(str(exception))}"
            run.hung = fired.is_set()
    for path in sorted(directory.glob("failure-rank*.json")):
        run.failures.append(RankFailure(**json.loads(path.read_text())))
        path.unlink()
    return run


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        return full.detach().clone().cpu()
    return value


def _first_lines(text: str, count: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-count:])[:800]


# ---------------------------------------------------------------------------------------------- verdicts


def difference(state: dict[str, Any], reference: dict[str, Any], tolerance: float) -> str | None:
    """Where ``state`` differs from ``reference`` beyond ``tolerance`` (``None``: nowhere)."""
    if state.keys() != reference.keys():
        return f"keys differ: {sorted(set(state) ^ set(reference))}"
    worst: tuple[float, str] = (0.0, "")
    for key, value in reference.items():
        other = state[key]
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            gap = float((other.float() - value.float()).abs().max()) if value.numel() else 0.0
            if not gap <= tolerance and gap >= worst[0]:  # NaN counts as a difference
                worst = (gap if gap == gap else float("inf"), key)
        elif isinstance(value, torch.Tensor):
            if not torch.equal(other, value):
                return f"{key}: {other.tolist()} != ddp's {value.tolist()}"
        elif other != value:
            return f"{key}: {other!r} != ddp's {value!r}"
    return None if not worst[1] else f"{worst[1]} differs by {worst[0]:.2e} (tolerance {tolerance:.0e})"


def _judge(strategy: str, run: Run, reference: dict[str, Any], tolerance: float) -> Verdict:
    if run.hung:
        return Verdict(strategy, "hang", f"no end after {HANG_SECONDS:.0f} s; {run.error}")
    if run.state is not None:
        gap = difference(run.state, reference, tolerance)
        return Verdict(strategy, "different", gap) if gap else Verdict(strategy, "equal")
    refusal = run.refusal()
    if refusal is not None:
        return Verdict(strategy, "refused", refusal)
    ranks = "; ".join(
        f"rank {f.rank}: {f.kind}: {f.message} ({'ours' if f.raised_in_package else 'raised outside the package'}"
        f"{', after an optimizer step' if f.trained else ''})"
        for f in run.failures
    )
    return Verdict(strategy, "crash", ranks or run.error)


class Fuzzer:
    """Runs recipes; caches ``ddp``'s reference states per recipe and ``broadcast_buffers``."""

    def __init__(self, strategies: Strategies | None = None, workdir: Path | None = None) -> None:
        self.strategies = dict(STRATEGIES if strategies is None else strategies)
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="fuzz-"))
        self._references: dict[tuple[Recipe, bool], dict[str, Any]] = {}
        self._runs = 0

    def _directory(self) -> Path:
        self._runs += 1
        directory = self.workdir / f"run{self._runs}"
        shutil.rmtree(directory, ignore_errors=True)
        return directory

    def reference(self, recipe: Recipe, broadcast_buffers: bool = True) -> dict[str, Any]:
        """``ddp``'s state after the whole run."""
        key = (recipe, broadcast_buffers)
        if key not in self._references:
            options = {"broadcast_buffers": broadcast_buffers}
            run = fit_once(recipe, _ddp(recipe, options), self._directory())
            if run.state is None:
                raise RuntimeError(f"ddp itself failed on {recipe!r}: {run.error}")  # the recipe generator's bug
            self._references[key] = run.state
        return self._references[key]

    def _make(self, name: str, recipe: Recipe, **extra: Any) -> Any:
        options = {**recipe.options_for(name), **extra}
        return _ddp(recipe, options) if name == REFERENCE else self.strategies[name](recipe, options)

    def tolerance(self, recipe: Recipe) -> float:
        return FP32_TOLERANCE if recipe.precision == "32-true" else BF16_TOLERANCE

    def run(self, recipe: Recipe) -> Report:
        """Every strategy's verdict on the recipe (and on its checkpoint, if it has one)."""
        verdicts: list[Verdict] = []
        for name in self.strategies:
            buffers = bool(recipe.options_for(name).get("broadcast_buffers", True))
            reference = self.reference(recipe, buffers)
            run = fit_once(recipe, self._make(name, recipe), self._directory())
            verdicts.append(_judge(name, run, reference, self.tolerance(recipe)))
        if recipe.checkpoint is not None:
            verdicts.append(self._checkpoint_verdict(recipe, {v.strategy: v for v in verdicts}))
        self._clean()
        return Report(recipe, verdicts)

    def _checkpoint_verdict(self, recipe: Recipe, plain: dict[str, Verdict]) -> Verdict:
        checkpoint = recipe.checkpoint
        if checkpoint is None:
            raise ValueError("the recipe has no checkpoint")
        label = f"{checkpoint.saved_by} -> {checkpoint.resumed_by} ({checkpoint.state_dict_type})"
        for name in (checkpoint.saved_by, checkpoint.resumed_by):
            if name in plain and plain[name].verdict != "equal":
                return Verdict(label, "refused", f"{name} does not train the recipe")  # judged above already
            if name not in plain and name != REFERENCE:
                return Verdict(label, "refused", f"{name} is not under test")
        # Buffers follow ddp's rule in both halves, so that ddp's uninterrupted run is each half's reference.
        reference = self.reference(recipe)
        directory = self._directory()
        extra: dict[str, Any] = {"broadcast_buffers": True}
        if checkpoint.saved_by in SHARDED_FORMATS:
            extra["state_dict_type"] = checkpoint.state_dict_type
        first = fit_once(recipe, self._make(checkpoint.saved_by, recipe, **extra), directory, max_epochs=1, save=True)
        if first.state is None:
            return _judge(label, first, reference, self.tolerance(recipe))
        path = directory / "epoch=0.ckpt"
        if not path.exists():
            return Verdict(label, "crash", f"{checkpoint.saved_by} trained but wrote no {path.name}")
        resuming = self._make(checkpoint.resumed_by, recipe, broadcast_buffers=True)
        resumed = fit_once(recipe, resuming, self._directory(), ckpt_path=path)
        verdict = _judge(label, resumed, reference, self.tolerance(recipe))
        if verdict.verdict == "refused":  # the recipe trains under both: refusing its checkpoint loses the run
            return Verdict(label, "crash", f"the resume was refused: {verdict.detail}")
        return verdict

    def _clean(self) -> None:
        for directory in self.workdir.glob("run*"):
            shutil.rmtree(directory, ignore_errors=True)
