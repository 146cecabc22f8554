"""Runs the zoo: every model under every strategy, four checks, and a failure list that names model, strategy, check.

For one model the harness runs, on 2 forked CPU processes:

* the control: ``ddp`` trains two epochs (two steps each) uninterrupted, validating and saving after each epoch;
  its epoch-0 checkpoint is ``ddp``'s mid-run save, its losses and final weights are the reference;
* every other strategy trains the first epoch and saves (check 1: it fits, with ``ddp``'s losses);
* every saved file is checked as a file (check 3: ``torch.load(weights_only=True)``, ``load_from_checkpoint(
  strict=True)``, the bare model's keys and shapes under ``model.``, no wrapper segment, tied weights tied and equal;
  check 4: ``lightning-strategies inspect`` finds nothing, and for strategies with sharded checkpoints a sharded
  save of the same run consolidates to a file equal to the full one);
* every saved file is resumed under every other strategy for the second epoch (check 2: weights, optimizer state,
  scheduler state and counters restored exactly, as a save right after the restore shows; every logged loss after
  the resume, training and validation, equal to the uninterrupted ``ddp`` run; final weights equal to its).

Nothing raises: every problem becomes a :class:`Failure`. ``python -m tests.zoo --out docs/resume-matrix.md`` runs the
whole zoo and writes its tables into the resume-matrix page.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import Strategy
from torch import Tensor

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy
from lightning_strategies.checkpoint import WRAPPER_PREFIXES
from lightning_strategies.cli.consolidate import consolidate_checkpoint
from lightning_strategies.cli.inspection import inspect_path
from lightning_strategies.testing import SaveAfterRestore, max_state_difference
from lightning_strategies.testing.matrix import ZOO_SECTION_MARKER
from tests.zoo.models import EPOCHS, STEPS_PER_EPOCH, ZooModel, relative_difference

CHECKS: dict[int, str] = {
    1: "fit works",
    2: "resumes exactly",
    3: "loads as a plain checkpoint",
    4: "inspect and consolidate",
}
REFERENCE = "ddp"
SEED = 1234
WRAPPER_SEGMENTS = (*(prefix.rstrip(".") for prefix in WRAPPER_PREFIXES), "flat_param")


@dataclass(frozen=True)
class ZooStrategy:
    """A row/column of the zoo.

    Attributes:
        label: Shown in test ids, failure messages and the table.
        factory: A fresh strategy (or registry name) for a model.
        sharded_factory: The same strategy writing sharded checkpoints, where it has them (check 4 consolidates).
        applies: Whether the strategy applies to a model (per-block sharding needs a block class).
    """

    label: str
    factory: Callable[[ZooModel], Strategy | str]
    sharded_factory: Callable[[ZooModel], Strategy] | None = None
    applies: Callable[[ZooModel], bool] = lambda model: True


def _blocks(model: ZooModel) -> tuple[type[torch.nn.Module], ...]:
    return (model.block(),) if model.block is not None else ()


def default_strategies() -> list[ZooStrategy]:
    """``ddp`` (the control), ``ddp_sharded``, ``fsdp_fairscale`` and ``fsdp2`` with their defaults, and ``fsdp2``
    sharding each block (the model's transformer or residual block class)."""
    return [
        ZooStrategy(REFERENCE, lambda model: "ddp_fork"),
        ZooStrategy("ddp_sharded", lambda model: "ddp_sharded_fork"),
        ZooStrategy(
            "fsdp_fairscale",
            lambda model: "fsdp_fairscale_fork",
            lambda model: FairScaleFSDPStrategy(start_method="fork", state_dict_type="sharded"),
        ),
        ZooStrategy(
            "fsdp2",
            lambda model: "fsdp2_fork",
            lambda model: FSDP2Strategy(start_method="fork", state_dict_type="sharded"),
        ),
        ZooStrategy(
            "fsdp2_blocks",
            lambda model: FSDP2Strategy(start_method="fork", shard_module_classes=_blocks(model)),
            lambda model: FSDP2Strategy(
                start_method="fork", shard_module_classes=_blocks(model), state_dict_type="sharded"
            ),
            applies=lambda model: model.block is not None,
        ),
    ]


@dataclass(frozen=True)
class Failure:
    """One failed check of one (model, strategy) pair, or of one resume cell."""

    model: str
    strategy: str
    check: int
    message: str
    resumed_by: str | None = None

    def __str__(self) -> str:
        where = f"{self.strategy} -> {self.resumed_by}" if self.resumed_by else self.strategy
        return f"[{self.model}] {where}: check {self.check} ({CHECKS[self.check]}): {self.message}"


@dataclass
class ModelReport:
    """Everything one model's zoo run found."""

    model: ZooModel
    strategies: list[str]
    savers: list[str]
    saved: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    seconds: float = 0.0
    fits: int = 0  # Trainer.fit calls, failed ones included
    workdir: Path | None = None  # where the runs wrote their checkpoints (see saved_checkpoint)

    def saved_checkpoint(self, strategy: str, sharded: bool = False) -> Path:
        """The checkpoint a strategy saved after the first epoch: ``ddp``'s from its uninterrupted run, the others'
        from their first-epoch fit, or (``sharded``) from their run with ``state_dict_type="sharded"``."""
        if self.workdir is None:
            raise ValueError(f"[{self.model.name}] the report has no run directory")
        run = "whole" if strategy == REFERENCE else "sharded" if sharded else "first-epoch"
        return self.workdir / strategy / run / "epoch=0.ckpt"

    def fail(self, strategy: str, check: int, message: str, resumed_by: str | None = None) -> None:
        self.failures.append(Failure(self.model.name, strategy, check, message, resumed_by))

    def problems(self, strategy: str, check: int, resumed_by: str | None = None) -> list[Failure]:
        """The failures of one check of one strategy (of one resume cell when ``resumed_by`` is given)."""
        return [
            failure
            for failure in self.failures
            if (failure.strategy, failure.check) == (strategy, check)
            and (resumed_by is None or failure.resumed_by == resumed_by)
        ]

    def explain(self, failures: Iterable[Failure]) -> str:
        """One line per failure, for an assertion message."""
        return "\n".join(str(failure) for failure in failures)

    def table(self) -> str:
        """A Markdown table: one row per saving strategy; its fit, each resume, and the file checks."""
        columns = list(self.strategies)
        header = (
            f"| {self.model.name}: saved by \\ resumed by | fit | "
            + " | ".join(columns)
            + " | plain load | inspect, consolidate |"
        )
        lines = [header, "|" + "---|" * (len(columns) + 4)]
        for saver in self.savers:
            cells = [_cell(self.problems(saver, 1))]
            if saver not in self.saved:
                lines.append(f"| {saver} | {cells[0]} |" + " not run |" * (len(columns) + 2))
                continue
            for column in columns:
                cells.append("-" if column == saver else _cell(self.problems(saver, 2, column)))
            cells += [_cell(self.problems(saver, 3)), _cell(self.problems(saver, 4))]
            lines.append(f"| {saver} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _cell(failures: Sequence[Failure]) -> str:
    if not failures:
        return "pass"
    text = failures[0].message.replace("|", "/").replace("\n", " ")
    more = f" (+{len(failures) - 1})" if len(failures) > 1 else ""
    return f"FAIL: {text[:90]}{more}"


# ---------------------------------------------------------------------------------------------- running


class MetricRecorder(pl.Callback):
    """Writes rank 0's logged losses to ``<dir>/metrics.json``: ``train_loss`` per step, ``val_loss`` per epoch."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.train: dict[int, float] = {}
        self.val: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.train[trainer.global_step] = float(outputs["loss"])

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.val[trainer.current_epoch] = float(trainer.callback_metrics["val_loss"])

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / "metrics.json").write_text(json.dumps({"train": self.train, "val": self.val}))


@dataclass
class Metrics:
    """What a :class:`MetricRecorder` wrote: ``train_loss`` by global step, ``val_loss`` by epoch."""

    train: dict[int, float]
    val: dict[int, float]

    @classmethod
    def read(cls, directory: Path) -> Metrics:
        raw = json.loads((directory / "metrics.json").read_text())
        return cls({int(k): v for k, v in raw["train"].items()}, {int(k): v for k, v in raw["val"].items()})


def _fit(
    model: ZooModel,
    strategy: Strategy | str,
    directory: Path,
    *,
    epochs: int,
    ckpt_path: Path | None = None,
    callbacks: Sequence[pl.Callback] = (),
) -> Metrics:
    pl.seed_everything(SEED, verbose=False)
    module = model.module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision=model.precision,  # type: ignore[arg-type]
        max_epochs=epochs,
        logger=False,
        callbacks=[
            ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1),
            MetricRecorder(directory),
            *callbacks,
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return Metrics.read(directory)


def _reason(error: BaseException) -> str:
    """The error's last line; a worker's error (``ProcessRaisedException`` carries its traceback) as the worker's."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    last = lines[-1][:240] if lines else ""
    return last if re.match(r"^[\w.]+(Error|Exception)\b", last) else f"{type(error).__name__}: {last}"


def _load(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return loaded


def _loss_differences(got: Metrics, expected: Metrics, steps: Iterable[int], epochs: Iterable[int], rtol: float) -> str:
    """What differs between the logged losses of two runs over the given steps and epochs (``""`` if nothing)."""
    problems = []
    for step in steps:
        if step not in got.train:
            problems.append(f"no train_loss logged at step {step}")
        elif relative_difference(got.train[step], expected.train[step]) > rtol:
            problems.append(f"train_loss at step {step} is {got.train[step]:.7g}, ddp's {expected.train[step]:.7g}")
    for epoch in epochs:
        if epoch not in got.val:
            problems.append(f"no val_loss logged in epoch {epoch}")
        elif relative_difference(got.val[epoch], expected.val[epoch]) > rtol:
            problems.append(f"val_loss of epoch {epoch} is {got.val[epoch]:.7g}, ddp's {expected.val[epoch]:.7g}")
    return "; ".join(problems[:3])


def _value_differs(left: Any, right: Any) -> bool:
    if isinstance(left, Tensor) or isinstance(right, Tensor):
        if not (isinstance(left, Tensor) and isinstance(right, Tensor)):
            return True
        return left.shape != right.shape or left.dtype != right.dtype or not torch.equal(left, right)
    if isinstance(left, Mapping) and isinstance(right, Mapping):
        return left.keys() != right.keys() or any(_value_differs(left[k], right[k]) for k in left)
    if isinstance(left, list | tuple) and isinstance(right, list | tuple):
        return type(left) is not type(right) or len(left) != len(right) or any(map(_value_differs, left, right))
    return bool(left != right)


def _optimizer_differences(saved: Sequence[Any], restored: Sequence[Any]) -> list[str]:
    """Where two lists of canonical optimizer states differ (exactly: values, dtypes, shapes, hyper-parameters)."""
    if len(saved) != len(restored):
        return [f"{len(restored)} optimizer states, saved {len(saved)}"]
    problems = []
    for index, (before, after) in enumerate(zip(saved, restored, strict=True)):
        for position, (group, other) in enumerate(zip(before["param_groups"], after["param_groups"], strict=False)):
            differing = sorted(key for key in set(group) | set(other) if _value_differs(group.get(key), other.get(key)))
            if differing:
                problems.append(f"optimizer {index} param group {position}: {differing} differ")
        if len(before["param_groups"]) != len(after["param_groups"]):
            problems.append(f"optimizer {index} has {len(after['param_groups'])} param groups")
        if before["state"].keys() != after["state"].keys():
            problems.append(
                f"optimizer {index} holds state of {len(after['state'])} parameters, saved {len(before['state'])}"
            )
            continue
        for param, entries in before["state"].items():
            differing = sorted(
                k
                for k in set(entries) | set(after["state"][param])
                if _value_differs(entries.get(k), after["state"][param].get(k))
            )
            if differing:
                problems.append(f"optimizer {index} state[{param}] {differing} differ")
    return problems[:3]


def restore_differences(saved: Mapping[str, Any], restored: Mapping[str, Any]) -> list[str]:
    """What a restore changed: ``restored`` is saved right after resuming from ``saved``, before any step."""
    problems = []
    worst, key = max_state_difference(saved["state_dict"], restored["state_dict"])
    if worst != 0.0:
        problems.append(f"restored weights differ ({key}: {worst:.2e})")
    problems += _optimizer_differences(saved.get("optimizer_states", []), restored.get("optimizer_states", []))
    if _value_differs(saved.get("lr_schedulers"), restored.get("lr_schedulers")):
        problems.append(
            f"scheduler state differs: saved {saved.get('lr_schedulers')}, restored {restored.get('lr_schedulers')}"
        )
    # Saved at the end of epoch 0, so the resumed run starts epoch 1 at the same global step.
    if (saved["epoch"] + 1, saved["global_step"]) != (restored["epoch"], restored["global_step"]):
        problems.append(
            f"counters differ: restored epoch/step {restored['epoch']}/{restored['global_step']} from a checkpoint"
            f" saved at the end of epoch {saved['epoch']}, step {saved['global_step']}"
        )
    return problems


def file_problems(model: ZooModel, path: Path) -> list[str]:
    """Check 3: the file as a plain checkpoint of the module."""
    try:
        checkpoint = _load(path)
    except Exception as error:
        return [f"torch.load(weights_only=True) failed: {_reason(error)}"]
    problems = []
    state = checkpoint.get("state_dict", {})
    bare = model.module().state_dict()  # the module's keys: the bare model's under `model.`
    missing, unexpected = sorted(set(bare) - set(state)), sorted(set(state) - set(bare))
    wrapped = sorted(key for key in state if any(segment in key.split(".") for segment in WRAPPER_SEGMENTS))
    if wrapped:
        problems.append(f"keys with a wrapper segment: {wrapped[:3]}")
    if missing:
        problems.append(f"keys missing: {missing[:3]}" + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    if unexpected and not wrapped:
        problems.append(f"unexpected keys: {unexpected[:3]}")
    shapes = [key for key in set(bare) & set(state) if tuple(bare[key].shape) != tuple(state[key].shape)]
    if shapes:
        key = sorted(shapes)[0]
        problems.append(f"{key} has shape {tuple(state[key].shape)}, the model's is {tuple(bare[key].shape)}")
    for left, right in model.tied:
        if left in state and right in state and not torch.equal(state[left], state[right]):
            problems.append(f"tied {left} and {right} hold different values")
    try:
        loaded = model.module.load_from_checkpoint(path, strict=True, weights_only=True)
    except Exception as error:
        problems.append(f"load_from_checkpoint(strict=True) failed: {_reason(error)}")
        return problems
    for left, right in model.tied:
        if loaded.get_parameter(left) is not loaded.get_parameter(right):
            problems.append(f"{left} and {right} are not tied after load_from_checkpoint")
    return problems


def inspect_problems(model: ZooModel, path: Path) -> list[str]:
    """``lightning-strategies inspect --module`` of the file: no error and no warning."""
    try:
        report = inspect_path(path, f"{model.module.__module__}:{model.module.__qualname__}")
    except Exception as error:
        return [f"inspect raised {_reason(error)}"]
    return [
        f"inspect {finding.severity} {finding.code}: {finding.message[:200]}"
        for finding in report.findings
        if finding.severity != "info"
    ]


def consolidation_problems(full: Mapping[str, Any], consolidated: Mapping[str, Any]) -> list[str]:
    """Where a consolidated sharded save differs from the full save of the same run (shapes and dtypes included)."""
    problems = []
    left, right = full["state_dict"], consolidated["state_dict"]
    if left.keys() != right.keys():
        problems.append(
            f"keys differ: only in the full file {sorted(set(left) - set(right))[:3]}, only in the consolidated one"
            f" {sorted(set(right) - set(left))[:3]}"
        )
    for key in sorted(set(left) & set(right)):
        if _value_differs(left[key], right[key]):
            problems.append(
                f"{key} differs (full {tuple(left[key].shape)} {left[key].dtype}, consolidated"
                f" {tuple(right[key].shape)} {right[key].dtype})"
            )
            break
    problems += _optimizer_differences(full.get("optimizer_states", []), consolidated.get("optimizer_states", []))
    for entry in ("lr_schedulers", "epoch", "global_step", "loops"):
        if _value_differs(full.get(entry), consolidated.get(entry)):
            problems.append(f"{entry} differs")
    return problems


def run_model(
    model: ZooModel,
    workdir: Path,
    strategies: Sequence[ZooStrategy] | None = None,
    *,
    savers: Sequence[str] | None = None,
) -> ModelReport:
    """Runs every check of one model under ``strategies`` (the first is the control, ``ddp``); never raises.

    Args:
        model: The zoo model.
        workdir: An empty directory for the runs.
        strategies: Rows and columns (default: :func:`default_strategies`); those that do not apply are left out.
        savers: Labels of the strategies whose saves are checked and resumed (default: all).
    """
    started = time.perf_counter()
    chosen = [strategy for strategy in (strategies or default_strategies()) if strategy.applies(model)]
    by_label = {strategy.label: strategy for strategy in chosen}
    reference = chosen[0]
    saver_labels = list(savers) if savers is not None else list(by_label)
    report = ModelReport(model, list(by_label), saver_labels, workdir=workdir)
    resume_steps = range(STEPS_PER_EPOCH + 1, STEPS_PER_EPOCH * EPOCHS + 1)
    first_steps = range(1, STEPS_PER_EPOCH + 1)

    whole_dir = workdir / reference.label / "whole"
    report.fits += 1
    try:
        whole = _fit(model, reference.factory(model), whole_dir, epochs=EPOCHS)
    except Exception as error:
        for label in saver_labels:
            report.fail(label, 1, f"the uninterrupted ddp control run raised {_reason(error)}")
        report.seconds = time.perf_counter() - started
        return report
    reference_final = _load(whole_dir / f"epoch={EPOCHS - 1}.ckpt")

    saved: dict[str, Path] = {reference.label: whole_dir / "epoch=0.ckpt"}
    for label in saver_labels:
        if label == reference.label:
            continue
        directory = workdir / label / "first-epoch"
        report.fits += 1
        try:
            first = _fit(model, by_label[label].factory(model), directory, epochs=1)
        except Exception as error:
            report.fail(label, 1, f"fit raised {_reason(error)}")
            continue
        saved[label] = directory / "epoch=0.ckpt"
        differences = _loss_differences(first, whole, first_steps, [0], model.loss_rtol)
        if differences:
            report.fail(label, 1, f"losses differ from ddp's: {differences}")

    report.saved = list(saved)
    for label, path in saved.items():
        for problem in file_problems(model, path):
            report.fail(label, 3, problem)
        for problem in inspect_problems(model, path):
            report.fail(label, 4, problem)
        sharded_factory = by_label[label].sharded_factory
        if sharded_factory is not None:
            for problem in _sharded_save_problems(model, sharded_factory(model), workdir / label / "sharded", path):
                report.fail(label, 4, problem)
            report.fits += 1

    for label, path in saved.items():
        for resumer in chosen:
            if resumer.label == label:
                continue
            cell_dir = workdir / label / f"resumed-by-{resumer.label}"
            restored_path = cell_dir / "restored.ckpt"
            report.fits += 1
            try:
                resumed = _fit(
                    model,
                    resumer.factory(model),
                    cell_dir,
                    epochs=EPOCHS,
                    ckpt_path=path,
                    callbacks=[SaveAfterRestore(restored_path)],
                )
            except Exception as error:
                report.fail(label, 2, f"resume raised {_reason(error)}", resumer.label)
                continue
            problems = restore_differences(_load(path), _load(restored_path))
            differences = _loss_differences(resumed, whole, resume_steps, [EPOCHS - 1], model.loss_rtol)
            if differences:
                problems.append(f"losses after the resume differ from the uninterrupted run: {differences}")
            worst, key = max_state_difference(
                reference_final["state_dict"], _load(cell_dir / f"epoch={EPOCHS - 1}.ckpt")["state_dict"]
            )
            if worst > model.weights_atol:
                problems.append(f"final weights differ from the uninterrupted run ({key}: {worst:.2e})")
            for problem in problems:
                report.fail(label, 2, problem, resumer.label)
    report.seconds = time.perf_counter() - started
    return report


def _sharded_save_problems(model: ZooModel, strategy: Strategy, directory: Path, full_path: Path) -> list[str]:
    """A sharded save of the first epoch: inspect finds nothing, and it consolidates to the full save's content."""
    try:
        _fit(model, strategy, directory, epochs=1)
    except Exception as error:
        return [f"fit with state_dict_type='sharded' raised {_reason(error)}"]
    sharded = directory / "epoch=0.ckpt"
    problems = [f"sharded save: {problem}" for problem in inspect_problems(model, sharded)]
    out = directory / "consolidated.ckpt"
    try:
        consolidate_checkpoint(sharded, out, show_progress=False)
    except Exception as error:
        return [*problems, f"consolidate raised {_reason(error)}"]
    if not full_path.exists():
        return problems  # the full save failed: check 1 says so
    problems += [
        f"consolidated sharded save: {problem}" for problem in consolidation_problems(_load(full_path), _load(out))
    ]
    return problems


# ---------------------------------------------------------------------------------------------- the docs


def docs_section(reports: Sequence[ModelReport]) -> str:
    """The model zoo's section of ``docs/resume-matrix.md``: what runs, then one table per model."""
    fits = sum(report.fits for report in reports)
    seconds = sum(report.seconds for report in reports)
    failures = sum(len(report.failures) for report in reports)
    models = "\n".join(
        f"- *{report.model.name}*: {report.model.module.recipe}; precision `{report.model.precision}`"
        for report in reports
    )
    intro = f"""{ZOO_SECTION_MARKER}: generated by `python -m tests.zoo --out docs/resume-matrix.md`, from the code of
`tests/zoo`, whose tests run the same checks in CI -->

## Model zoo

Real architectures built from `transformers` config objects (nothing downloaded; under 1 M parameters each, dropout
0), each with the recipe its users write and steps that call `self.model(**batch)`:

{models}

Two CPU processes, two epochs of two steps each. `ddp` trains uninterrupted and is the reference; every other
strategy trains the first epoch and saves, and every saved file resumes under every other strategy for the second
epoch.

- *fit*: the first epoch trains, with `ddp`'s losses (relative 1e-5; bf16: 1e-2).
- *resumed by X*: X restores weights, optimizer state, scheduler state and counters exactly (a save right after the
  restore equals the file), every logged loss after the resume (training, and validation: BatchNorm statistics
  included) equals the uninterrupted run, and so do the final weights.
- *plain load*: `torch.load(weights_only=True)`, `load_from_checkpoint(strict=True)`, the bare model's keys and
  shapes under `model.` with no wrapper segment, tied weights equal in the file and tied after loading.
- *inspect, consolidate*: `lightning-strategies inspect --module` reports nothing; for `fsdp_fairscale` and `fsdp2`
  a sharded save of the same run also inspects clean and consolidates to a file equal to the full checkpoint.
- `fsdp2_blocks` is `FSDP2Strategy(shard_module_classes=(Block,))` with the model's transformer or residual block.

({fits} fits, {failures} failed checks, {seconds:.0f} s on this machine.)
"""
    tables = [f"{report.table()}\n\n({report.fits} fits in {report.seconds:.0f} s)" for report in reports]
    return intro + "\n" + "\n\n".join(tables) + "\n"


def write_docs_section(page: Path, section: str) -> None:
    """Replaces the zoo's section of the resume-matrix page (everything from its marker on), or appends it."""
    text = page.read_text() if page.exists() else "# Resume matrix\n"
    if ZOO_SECTION_MARKER in text:
        text = text[: text.index(ZOO_SECTION_MARKER)]
    page.write_text(text.rstrip("\n") + "\n\n" + section)
