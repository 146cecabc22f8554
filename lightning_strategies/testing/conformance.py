"""The conformance kit: checks any Lightning strategy against the direct-reference contract on CPU.

It trains :class:`~lightning_strategies.testing.models.ConformanceModel` for two epochs with the strategy (saving a
checkpoint after each), resumes a second run from the first checkpoint, and runs validate/test/predict from the last
one. Every check compares against plain PyTorch on the unwrapped module in this process, with no process group, so
it knows nothing of the strategy's internals. Strategies are given as factories because each Trainer run needs a
fresh strategy object; use the fork or spawn variant of a multi-process strategy (the kit runs inside one Python
process and cannot relaunch its script). A strategy that has no such launcher (upstream's ``ModelParallelStrategy``
only runs the script again per rank) is checked with ``launch=``: a function that runs the kit's training on every
rank started from outside (as ``torchrun`` would) and returns rank 0's result.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_strategies.checkpoint import METADATA_KEY, CheckpointMetadata, check_model_state
from lightning_strategies.checkpoint.optimizer_state import PARAM_SHAPED_STATE

from .._lightning import ModelCheckpoint, Strategy, pl
from .models import ConformanceModel, OptimizerName, make_dataset, probe_input
from .state import max_state_difference

StrategyFactory = Callable[[], Strategy | str]
#: Runs a function on every rank of a run launched from outside (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` set, e.g.
#: forked processes) and returns what it returned on rank 0.
Launch = Callable[[Callable[[], Any]], Any]

ATOL = 1e-6  # same data, same order of operations: only float re-association differs
RESUME_ATOL = 1e-5


class ConformanceError(AssertionError):
    """Raised by :meth:`ConformanceReport.raise_for_failures`; its message is the whole report."""


@dataclass(frozen=True)
class CheckResult:
    """One line of the report.

    Attributes:
        name: The check, e.g. ``"checkpoint_keys"``.
        passed: Whether the strategy kept this part of the contract.
        detail: What was compared, or what differed.
    """

    name: str
    passed: bool
    detail: str


@dataclass
class ConformanceReport:
    """Results of :func:`check_strategy` for one strategy.

    Attributes:
        strategy: How the strategy was named (registry name or class name).
        results: One entry per check, in the order they ran.
    """

    strategy: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Whether every check passed."""
        return all(result.passed for result in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        """The checks that failed."""
        return [result for result in self.results if not result.passed]

    def add(self, name: str, passed: bool, detail: str) -> bool:
        """Records a result and returns ``passed``."""
        self.results.append(CheckResult(name, passed, detail))
        return passed

    def __str__(self) -> str:
        verdict = "conforms" if self.passed else f"FAILS {len(self.failures)} of {len(self.results)} checks"
        width = max((len(result.name) for result in self.results), default=0)
        lines = [f"Conformance of {self.strategy}: {verdict}"]
        for result in self.results:
            status = "pass" if result.passed else "FAIL"
            lines.append(f"  {status}  {result.name:<{width}}  {result.detail}")
        return "\n".join(lines)

    def raise_for_failures(self) -> None:
        """Raises :class:`ConformanceError` with the full report if any check failed."""
        if not self.passed:
            raise ConformanceError(str(self))


def _strategy_label(factory: StrategyFactory) -> str:
    strategy = factory()
    return strategy if isinstance(strategy, str) else type(strategy).__name__


def _trainer(factory: StrategyFactory, devices: int, root: Path, epochs: int, accelerator: str) -> pl.Trainer:
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    return pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=factory(),
        max_epochs=epochs,
        logger=False,
        callbacks=[checkpoints],
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _describe(error: BaseException) -> str:
    """The error's type and message; for an error re-raised from a worker process, the worker's own error."""
    text = "".join(traceback.format_exception_only(type(error), error)).strip()
    if "Traceback (most recent call last)" in text:
        lines = text.splitlines()
        last_frame = max(index for index, line in enumerate(lines) if line.startswith("  "))
        text = " ".join(lines[last_frame + 1 :]).strip() or text
    return " ".join(text.split())[:700]


def _flatten_optimizer_state(state: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for index, entries in state.get("state", {}).items():
        for key, value in entries.items():
            flat[f"state[{index}].{key}"] = value if isinstance(value, Tensor) else torch.tensor(float(value))
    return flat


def _read_records(root: Path, stage: str, devices: int) -> tuple[list[dict[str, Any]], list[int]]:
    records, missing = [], []
    for rank in range(devices):
        path = root / f"record-{stage}-rank{rank}.json"
        if path.exists():
            records.append(json.loads(path.read_text()))
        else:
            missing.append(rank)
    return records, missing


class _Kit:
    def __init__(
        self,
        factory: StrategyFactory,
        workdir: Path,
        devices: int,
        optimizer: OptimizerName,
        model_class: type[ConformanceModel],
        atol: float,
        accelerator: str,
        launch: Launch | None = None,
    ) -> None:
        self.launch = launch
        self.factory = factory
        self.workdir = workdir
        self.devices = devices
        self.optimizer: OptimizerName = optimizer
        self.model_class = model_class
        self.atol = atol
        self.accelerator = accelerator
        self.report = ConformanceReport(_strategy_label(factory))
        self.seed = 7

    def model(self, record_dir: Path | None) -> ConformanceModel:
        pl.seed_everything(self.seed, verbose=False)
        return self.model_class(optimizer=self.optimizer, record_dir=str(record_dir) if record_dir else None)

    def run(self, name: str, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except Exception as error:
            self.report.add(name, False, f"raised {_describe(error)}")
            return None

    def in_ranks(self, action: Callable[[], Any]) -> Any:
        """``action()`` here (the strategy launches its ranks), or on every rank through ``launch`` (rank 0's)."""
        return action() if self.launch is None else self.launch(action)

    def fit(self, name: str, root: Path, ckpt_path: Path | None = None) -> ConformanceModel | None:
        """Trains two epochs; returns this process's module (a fresh one when the ranks ran elsewhere), or ``None``."""
        root.mkdir(parents=True, exist_ok=True)
        model = self.model(root)

        def train() -> bool:
            trained = model if self.launch is None else self.model(root)
            _trainer(self.factory, self.devices, root, 2, self.accelerator).fit(trained, ckpt_path=ckpt_path)
            return True

        return model if self.run(name, lambda: self.in_ranks(train)) else None

    # -- checks on one training run ---------------------------------------------------------------------------

    def check_identity(self, root: Path, stage: str) -> None:
        records, missing = _read_records(root, stage, self.devices)
        failures = [failure for record in records for failure in record["identity_failures"]]
        if missing:
            self.report.add(f"identity_{stage}", False, f"ranks {missing} wrote no record: the run did not finish")
        elif failures:
            self.report.add(f"identity_{stage}", False, "; ".join(failures[:3]))
        else:
            self.report.add(
                f"identity_{stage}",
                True,
                f"strategy.lightning_module is the user's module in every hook on {self.devices} rank(s)",
            )

    def check_checkpoint(self, root: Path, checkpoint_path: Path) -> dict[str, Any] | None:
        if not checkpoint_path.exists():
            self.report.add("checkpoint_written", False, f"{checkpoint_path} was not written")
            return None
        checkpoint = self.run(
            "checkpoint_weights_only_load", lambda: torch.load(checkpoint_path, map_location="cpu", weights_only=True)
        )
        if not isinstance(checkpoint, dict):
            if checkpoint is not None:
                self.report.add(
                    "checkpoint_weights_only_load", False, f"{checkpoint_path.name} holds a {type(checkpoint).__name__}"
                )
            return None
        self.report.add("checkpoint_weights_only_load", True, "torch.load(weights_only=True) reads the file")
        state = checkpoint.get("state_dict", {})
        plain = self.model(None)
        try:
            check_model_state(plain.state_dict(), state, strict=True, source=str(checkpoint_path.name))
            keys_ok = self.report.add(
                "checkpoint_keys", True, f"{len(state)} keys, shapes and dtypes equal the plain module's"
            )
        except Exception as error:
            keys_ok = self.report.add("checkpoint_keys", False, _describe(error))
        self.check_metadata(checkpoint)
        if keys_ok:
            self.check_weights(root, plain, state)
            self.check_load_from_checkpoint(checkpoint_path, state)
        self.check_plain_optimizer(checkpoint)
        return checkpoint

    def check_metadata(self, checkpoint: Mapping[str, Any]) -> None:
        try:
            metadata = CheckpointMetadata.read(checkpoint)
        except Exception as error:
            self.report.add("metadata", False, _describe(error))
            return
        if metadata is None:
            self.report.add("metadata", True, f"no {METADATA_KEY!r} block (allowed: upstream strategies write none)")
        elif metadata.state_dict_type != "full" or metadata.world_size != self.devices:
            self.report.add(
                "metadata", False, f"{metadata} does not describe a full checkpoint at world size {self.devices}"
            )
        else:
            self.report.add("metadata", True, f"{metadata}")

    def check_weights(self, root: Path, plain: nn.Module, state: Mapping[str, Any]) -> None:
        plain.load_state_dict(state, strict=True)
        with torch.no_grad():
            expected = plain(probe_input())
        outputs = [root / f"probe-epoch0-rank{rank}.pt" for rank in range(self.devices)]
        missing = [str(path.name) for path in outputs if not path.exists()]
        if missing:
            self.report.add("checkpoint_weights", False, f"no probe recorded: {', '.join(missing)}")
            return
        recorded = [torch.load(path, weights_only=True) for path in outputs]
        differences = [float((output - expected).abs().max()) for output in recorded]
        passed = max(differences) <= self.atol
        detail = (
            "the checkpoint's weights give each rank's model output at save time"
            if passed
            else "the checkpoint's weights do not compute what the ranks computed at save time"
        )
        self.report.add("checkpoint_weights", passed, f"{detail} (max |diff| per rank: {differences})")

    def check_load_from_checkpoint(self, checkpoint_path: Path, state: Mapping[str, Any]) -> None:
        def load() -> ConformanceModel:
            return self.model_class.load_from_checkpoint(checkpoint_path, strict=True, weights_only=True)

        loaded = self.run("load_from_checkpoint", load)
        if loaded is not None:
            worst, key = max_state_difference(loaded.state_dict(), state)
            self.report.add(
                "load_from_checkpoint",
                worst == 0.0,
                "LightningModule.load_from_checkpoint(strict=True) without a process group"
                + ("" if worst == 0.0 else f": {key!r} differs by {worst}"),
            )

    def check_plain_optimizer(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint.get("optimizer_states")
        if not isinstance(states, list) or len(states) != 1:
            self.report.add("optimizer_state_plain", False, f"expected 1 optimizer state, found {states!r:.80}")
            return
        plain = self.model(None)
        optimizer = plain.configure_optimizers()["optimizer"]
        try:
            optimizer.load_state_dict(states[0])
        except Exception as error:
            self.report.add("optimizer_state_plain", False, f"a plain optimizer refuses it: {_describe(error)}")
            return
        problems = []
        for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
            entries = optimizer.state.get(param)
            if not entries:
                problems.append(f"no state for parameter {index}")
                continue
            for key, value in entries.items():
                if key in PARAM_SHAPED_STATE and value.shape != param.shape:
                    problems.append(f"{key} of parameter {index} has shape {tuple(value.shape)}")
        if problems:
            self.report.add("optimizer_state_plain", False, "; ".join(problems[:4]))
        else:
            self.report.add(
                "optimizer_state_plain",
                True,
                f"loads into a plain {type(optimizer).__name__} over the plain module, every parameter has state",
            )

    def check_parent_weights(self, model: nn.Module, checkpoint: Mapping[str, Any]) -> None:
        compared = self.run(
            "parent_process_weights", lambda: max_state_difference(model.state_dict(), checkpoint["state_dict"])
        )
        if compared is None:
            return
        worst, key = compared
        self.report.add(
            "parent_process_weights",
            worst <= ATOL,
            "after fit, the module in the calling process holds the trained weights"
            if worst <= ATOL
            else f"after fit, the calling process's module differs from the final checkpoint: {key!r} by {worst}",
        )

    # -- resume ------------------------------------------------------------------------------------------------

    def check_resume(self, first: Path, reference: Mapping[str, Any]) -> None:
        root = self.workdir / "resumed"
        if self.fit("resume", root, ckpt_path=first / "checkpoints" / "epoch=0.ckpt") is None:
            return
        final = root / "checkpoints" / "epoch=1.ckpt"
        if not final.exists():
            self.report.add("resume", False, f"the resumed run wrote no {final.name}")
            return
        resumed = torch.load(final, map_location="cpu", weights_only=True)
        worst, key = max_state_difference(resumed["state_dict"], reference["state_dict"])
        self.report.add(
            "resume_weights",
            worst <= RESUME_ATOL,
            f"resumed at epoch 1 == uninterrupted run (max |diff| {worst:.2e}{f' at {key!r}' if key else ''})",
        )
        worst, key = max_state_difference(
            _flatten_optimizer_state(resumed["optimizer_states"][0]),
            _flatten_optimizer_state(reference["optimizer_states"][0]),
        )
        self.report.add(
            "resume_optimizer_state",
            worst <= RESUME_ATOL,
            f"optimizer state after resume == uninterrupted run (max |diff| {worst:.2e}{f' at {key}' if key else ''})",
        )
        uninterrupted, _ = _read_records(first, "fit", 1)
        continued, _ = _read_records(root, "fit", 1)
        if uninterrupted and continued:
            before = uninterrupted[0]["train_losses"]
            after = continued[0]["train_losses"]
            tail = before[len(before) - len(after) :]
            difference = max((abs(a - b) for a, b in zip(tail, after, strict=True)), default=float("inf"))
            self.report.add(
                "resume_losses",
                difference <= RESUME_ATOL,
                f"losses after resume follow the uninterrupted run (first: {after[0]:.6f} vs {tail[0]:.6f})"
                if after
                else "no loss recorded after resume",
            )

    # -- evaluation without fit --------------------------------------------------------------------------------

    def check_evaluation(self, checkpoint_path: Path, state: Mapping[str, Any]) -> None:
        plain = self.model(None)
        if self.run("evaluation_reference", lambda: plain.load_state_dict(state)) is None:
            return
        root = self.workdir / "evaluate"
        root.mkdir(parents=True, exist_ok=True)
        data = make_dataset(2 * plain.batch_size, seed=99)
        with torch.no_grad():
            expected_loss = float(nn.functional.mse_loss(plain(data.tensors[0]), data.tensors[1]))

        def validate() -> Any:
            trainer = _trainer(self.factory, self.devices, root, 1, self.accelerator)
            return trainer.validate(self.model(root), ckpt_path=checkpoint_path, verbose=False)

        results = self.run("validate", lambda: self.in_ranks(validate))
        if results is not None:
            got = float(results[0]["val_loss"])
            self.report.add(
                "validate_from_checkpoint",
                abs(got - expected_loss) <= max(self.atol, RESUME_ATOL),
                f"val_loss {got:.6f}, plain module on the same data {expected_loss:.6f}",
            )

        def predict() -> bool:
            model = self.model(root)
            model.load_state_dict(plain.state_dict())
            _trainer(self.factory, self.devices, root, 1, self.accelerator).predict(model, return_predictions=False)
            return True

        if self.run("predict", lambda: self.in_ranks(predict)) is None:
            return
        inputs = make_dataset(2 * plain.batch_size, seed=97).tensors[0]
        problems = []
        for rank in range(self.devices):
            path = root / f"predictions-rank{rank}.pt"
            if not path.exists():
                problems.append(f"rank {rank} recorded no predictions")
                continue
            with torch.no_grad():
                expected = plain(inputs[rank :: self.devices])  # DistributedSampler order without shuffling
            got = torch.load(path, weights_only=True)
            if got.shape != expected.shape or not torch.allclose(got.float(), expected, atol=self.atol):
                problems.append(f"rank {rank}'s predictions differ from the plain module's")
        self.report.add(
            "predict_without_fit",
            not problems,
            "; ".join(problems) or "every rank's predictions equal the plain module's on the same samples",
        )
        self.check_identity(root, "predict")


def check_strategy(
    strategy_factory: StrategyFactory,
    workdir: str | Path,
    *,
    devices: int = 2,
    optimizer: OptimizerName = "adam",
    model_class: type[ConformanceModel] = ConformanceModel,
    atol: float = ATOL,
    accelerator: str = "cpu",
    launch: Launch | None = None,
) -> ConformanceReport:
    """Checks a strategy against the direct-reference contract and returns a report (it never raises on failure).

    Args:
        strategy_factory: Returns a fresh strategy (instance or registry name) per call, e.g.
            ``lambda: ShardedDDPStrategy(start_method="fork")`` or ``lambda: "ddp_fork"``.
        workdir: An empty directory for checkpoints and per-rank records.
        devices: Number of CPU processes (1 for single-device strategies).
        optimizer: ``"adam"`` or ``"sgd"`` (with momentum) in the conformance model.
        model_class: The model to train: :class:`ConformanceModel` or a subclass (e.g. one that wraps submodules in
            ``configure_model``); it must keep its constructor arguments.
        atol: Tolerance between what the ranks computed and what the checkpoint's weights compute in plain float32
            (raise it for strategies that compute in lower precision).
        accelerator: ``"cpu"`` (the default: gloo) or ``"gpu"`` (NCCL) for a check on a GPU machine.
        launch: For a strategy without a fork or spawn launcher: runs a function on every rank started from outside
            and returns rank 0's result. The check that the calling process's module holds the trained weights is
            then left out (the ranks' modules live in their own processes).

    Returns:
        The report; ``report.passed`` tells whether the strategy conforms, ``str(report)`` shows every check.
    """
    kit = _Kit(strategy_factory, Path(workdir), devices, optimizer, model_class, atol, accelerator, launch)
    first = kit.workdir / "uninterrupted"
    model = kit.fit("fit", first)
    if model is None:
        return kit.report
    kit.check_identity(first, "fit")
    checkpoint = kit.check_checkpoint(first, first / "checkpoints" / "epoch=0.ckpt")
    final_path = first / "checkpoints" / "epoch=1.ckpt"
    if checkpoint is None or not final_path.exists():
        return kit.report
    final = torch.load(final_path, map_location="cpu", weights_only=True)
    if launch is None:
        kit.check_parent_weights(model, final)
    kit.check_resume(first, final)
    kit.check_evaluation(final_path, final["state_dict"])
    return kit.report


def assert_strategy_conforms(
    strategy_factory: StrategyFactory,
    workdir: str | Path,
    *,
    devices: int = 2,
    optimizer: OptimizerName = "adam",
    model_class: type[ConformanceModel] = ConformanceModel,
    atol: float = ATOL,
    accelerator: str = "cpu",
    launch: Launch | None = None,
) -> ConformanceReport:
    """Like :func:`check_strategy`, but raises :class:`ConformanceError` (an ``AssertionError``) on any failure.

    Use it in a pytest test with the ``tmp_path`` fixture as ``workdir``.

    Args:
        strategy_factory: Returns a fresh strategy (instance or registry name) per call.
        workdir: An empty directory for checkpoints and per-rank records.
        devices: Number of CPU processes (1 for single-device strategies).
        optimizer: ``"adam"`` or ``"sgd"`` in the conformance model.
        model_class: The model to train (see :func:`check_strategy`).
        atol: Tolerance for lower-precision strategies (see :func:`check_strategy`).
        accelerator: ``"cpu"`` or ``"gpu"`` (see :func:`check_strategy`).
        launch: For strategies without a fork or spawn launcher (see :func:`check_strategy`).

    Returns:
        The report of a conforming strategy.

    Raises:
        ConformanceError: With the full report, naming each failed check.
    """
    report = check_strategy(
        strategy_factory,
        workdir,
        devices=devices,
        optimizer=optimizer,
        model_class=model_class,
        atol=atol,
        accelerator=accelerator,
        launch=launch,
    )
    report.raise_for_failures()
    return report
