"""The resume matrix: every strategy saves, every strategy resumes, and each cell says what carried over.

For each row strategy A the conformance model trains two epochs, saving after each. For each column strategy B a
fresh run resumes from A's first checkpoint and trains to the end of the second epoch. A cell passes when

* the state B restored equals what A saved (weights exactly; optimizer state, LR schedulers and the epoch/step
  counters), checked by saving again right after the restore, before any step;
* B's final weights equal A's uninterrupted run (1e-5) — where the math allows: a different world size gives each
  step different samples (Lightning's ``DistributedSampler``), so there the cell only checks the restore;
* every checkpoint of the matrix (A's, and B's final one) loads with plain ``torch.load(weights_only=True)`` and
  ``LightningModule.load_from_checkpoint(strict=True)``.

The calling process never trains: multi-process strategies fork their ranks from it, and the default
``single_device`` cells run in a child (:func:`~lightning_strategies.testing.child.in_a_child_process`), because a
CUDA build of torch refuses backward in a fork of a process that ran one.

``python -m lightning_strategies.testing.matrix --out docs/resume-matrix.md`` regenerates the table for the docs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._lightning import ModelCheckpoint, pl
from .child import in_a_child_process
from .conformance import Launch, StrategyFactory
from .models import ConformanceModel, OptimizerName
from .state import SaveAfterRestore, max_state_difference

WEIGHTS_ATOL = 1e-5
STATE_ATOL = 1e-6
#: Where the model zoo's section of the resume-matrix page starts (``python -m tests.zoo`` writes it); ``main`` keeps
#: everything from there on when it rewrites the page.
ZOO_SECTION_MARKER = "<!-- model zoo"


@dataclass(frozen=True)
class MatrixStrategy:
    """A row/column of the matrix.

    Attributes:
        label: Short name shown in the table.
        factory: Returns a fresh strategy (instance or registry name) per run; fork/spawn variants for several
            processes.
        devices: Number of CPU processes it runs on.
        precision: The Trainer's ``precision`` (``"32-true"``, ``"bf16-mixed"``, ...).
        launch: For a strategy without a fork or spawn launcher: runs a function on its ranks started from outside
            and returns rank 0's result (see :func:`~lightning_strategies.testing.check_strategy`).
    """

    label: str
    factory: StrategyFactory
    devices: int = 2
    precision: str = "32-true"
    launch: Launch | None = None


@dataclass
class Cell:
    """One cell: what happened when ``resumed_by`` resumed ``saved_by``'s checkpoint."""

    saved_by: str
    resumed_by: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Whether nothing differed."""
        return not self.problems

    def text(self) -> str:
        """The table cell: ``pass`` (with notes), or what differed."""
        if self.problems:
            return "FAIL: " + "; ".join(self.problems)
        return "pass" + (f" ({'; '.join(self.notes)})" if self.notes else "")


@dataclass
class Matrix:
    """All cells of one run, plus per-row checks of the saved checkpoint."""

    labels: list[str]
    optimizer: str
    rows: list[str] = field(default_factory=list)
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)
    row_problems: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failures(self) -> list[Cell]:
        """Cells that failed, and rows whose checkpoint fails plain loading, as cells against ``"(plain load)"``."""
        failed = [cell for cell in self.cells.values() if not cell.passed]
        failed += [Cell(row, "(plain load)", problems) for row, problems in self.row_problems.items() if problems]
        return failed

    def table(self) -> str:
        """A Markdown table: rows = saved by, columns = resumed by."""
        header = f"| saved by \\ resumed by ({self.optimizer}) | " + " | ".join(self.labels) + " | plain load |"
        lines = [header, "|" + "---|" * (len(self.labels) + 2)]
        for row in self.rows or self.labels:
            cells = [self.cells[(row, column)].text() if (row, column) in self.cells else "-" for column in self.labels]
            plain = "FAIL: " + "; ".join(self.row_problems[row]) if self.row_problems.get(row) else "pass"
            lines.append(f"| {row} | " + " | ".join(cells) + f" | {plain} |")
        return "\n".join(lines)


def _trainer(strategy: MatrixStrategy, root: Path, callbacks: Sequence[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=strategy.devices,
        strategy=strategy.factory(),
        precision=strategy.precision,  # type: ignore[arg-type]
        max_epochs=2,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1), *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _fit(
    strategy: MatrixStrategy,
    root: Path,
    model_class: type[ConformanceModel],
    optimizer: OptimizerName,
    callbacks: Sequence[pl.Callback] = (),
    ckpt_path: Path | None = None,
) -> None:
    def train() -> None:
        pl.seed_everything(7, verbose=False)
        _trainer(strategy, root, callbacks).fit(model_class(optimizer=optimizer), ckpt_path=ckpt_path)

    if strategy.launch is None:
        train()
    else:
        strategy.launch(train)


def _load(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return loaded


def _optimizer_differences(saved: dict[str, Any], restored: dict[str, Any]) -> list[str]:
    problems = []
    for index, (before, after) in enumerate(zip(saved["optimizer_states"], restored["optimizer_states"], strict=False)):
        if [g["params"] for g in before["param_groups"]] != [g["params"] for g in after["param_groups"]]:
            problems.append(f"optimizer {index} param groups differ")
        for group, (saved_group, restored_group) in enumerate(
            zip(before["param_groups"], after["param_groups"], strict=False)
        ):
            # Every hyperparameter verbatim (a tuple that came back as a list counts: it is not the same state).
            differing = [key for key in saved_group if key != "params" and restored_group.get(key) != saved_group[key]]
            differing += [key for key in saved_group if type(restored_group.get(key)) is not type(saved_group[key])]
            if differing:
                problems.append(f"optimizer {index} param group {group}: {sorted(set(differing))} differ")
        if before["state"].keys() != after["state"].keys():
            problems.append(
                f"optimizer {index} has state for {sorted(after['state'])}, saved {sorted(before['state'])}"
            )
            continue
        for param, entries in before["state"].items():
            for key, value in entries.items():
                other = after["state"][param].get(key)
                same = other is not None and torch.allclose(
                    torch.as_tensor(value, dtype=torch.float64),
                    torch.as_tensor(other, dtype=torch.float64),
                    atol=STATE_ATOL,
                )
                if not same:
                    problems.append(f"optimizer {index} state[{param}].{key} differs")
    if len(saved["optimizer_states"]) != len(restored["optimizer_states"]):
        problems.append("optimizer count differs")
    return problems[:4]


def _row_problems(path: Path, model_class: type[ConformanceModel]) -> list[str]:
    problems = []
    try:
        _load(path)
    except Exception as error:
        problems.append(f"torch.load(weights_only=True): {type(error).__name__}")
    try:
        model_class.load_from_checkpoint(path, strict=True, weights_only=True)
    except Exception as error:
        problems.append(f"load_from_checkpoint(strict=True): {str(error).splitlines()[0][:120]}")
    return problems


def run_matrix(
    strategies: Sequence[MatrixStrategy],
    workdir: str | Path,
    *,
    optimizer: OptimizerName = "adam",
    rows: Sequence[MatrixStrategy] | None = None,
    model_class: type[ConformanceModel] = ConformanceModel,
) -> Matrix:
    """Runs every (saved by, resumed by) pair and returns the matrix; it never raises on a failed cell.

    Args:
        strategies: The columns (and, unless ``rows`` is given, the rows).
        workdir: An empty directory for the runs' checkpoints.
        optimizer: ``"adam"`` or ``"sgd"`` (with momentum); the model has two param groups and an LR scheduler.
        rows: Strategies that save, if not all of ``strategies`` (e.g. a broken one under test).
        model_class: :class:`ConformanceModel` or a subclass that keeps its constructor (e.g. one that shards itself in
            ``configure_model`` for a strategy that requires it).

    Returns:
        The matrix; ``matrix.failures`` lists the failed cells, ``matrix.table()`` renders it.
    """
    started = time.perf_counter()
    root = Path(workdir)
    savers = list(rows) if rows is not None else list(strategies)
    matrix = Matrix([strategy.label for strategy in strategies], optimizer, [saver.label for saver in savers])
    for saver in savers:
        row_dir = root / saver.label
        try:
            _fit(saver, row_dir / "uninterrupted", model_class, optimizer)
        except Exception as error:
            for resumer in strategies:
                matrix.cells[(saver.label, resumer.label)] = Cell(
                    saver.label, resumer.label, [f"A raised {error!r:.160}"]
                )
            continue
        saved_path = row_dir / "uninterrupted" / "epoch=0.ckpt"
        matrix.row_problems[saver.label] = _row_problems(saved_path, model_class)
        try:
            saved, uninterrupted = _load(saved_path), _load(row_dir / "uninterrupted" / "epoch=1.ckpt")
        except Exception as error:  # a directory, or no file at all: nothing to compare the resumes with
            for resumer in strategies:
                problem = f"its checkpoint is not a file torch.load reads ({type(error).__name__})"
                matrix.cells[(saver.label, resumer.label)] = Cell(saver.label, resumer.label, [problem])
            continue
        for resumer in strategies:
            cell = Cell(saver.label, resumer.label)
            matrix.cells[(saver.label, resumer.label)] = cell
            cell_dir = row_dir / f"resumed-by-{resumer.label}"
            restored_path = cell_dir / "restored.ckpt"
            try:
                _fit(resumer, cell_dir, model_class, optimizer, [SaveAfterRestore(restored_path)], saved_path)
            except Exception as error:
                cell.problems.append(f"resume raised {str(error).strip().splitlines()[-1][:200]}")
                continue
            restored = _load(restored_path)
            worst, key = max_state_difference(saved["state_dict"], restored["state_dict"])
            if worst != 0.0:
                cell.problems.append(f"restored weights differ ({key}: {worst:.2e})")
            cell.problems += _optimizer_differences(saved, restored)
            if saved["lr_schedulers"] != restored["lr_schedulers"]:
                cell.problems.append("LR scheduler state differs")
            # Saved at the end of epoch 0, so the resumed run starts epoch 1 at the same global step.
            if (saved["epoch"] + 1, saved["global_step"]) != (restored["epoch"], restored["global_step"]):
                cell.problems.append(
                    f"counters differ: resumed at epoch/step {restored['epoch']}/{restored['global_step']} from a"
                    f" checkpoint saved at the end of epoch {saved['epoch']}, step {saved['global_step']}"
                )
            cell.problems += [
                f"its final checkpoint: {problem}" for problem in _row_problems(cell_dir / "epoch=1.ckpt", model_class)
            ]
            if saver.devices != resumer.devices:
                cell.notes.append(f"world size {saver.devices}->{resumer.devices}: restore checked, not the math")
                continue
            final = _load(cell_dir / "epoch=1.ckpt")
            worst, key = max_state_difference(uninterrupted["state_dict"], final["state_dict"])
            if worst > WEIGHTS_ATOL:
                cell.problems.append(f"final weights differ from the uninterrupted run ({key}: {worst:.2e})")
    matrix.seconds = time.perf_counter() - started
    return matrix


def default_strategies() -> list[MatrixStrategy]:
    """Every strategy this package ships, plus upstream ``single_device`` and ``ddp``."""
    return [
        # In a child: the ranks of the other strategies fork from this process, which must not have run backward.
        MatrixStrategy("single_device", lambda: "single_device", devices=1, launch=in_a_child_process),
        MatrixStrategy("ddp", lambda: "ddp_fork"),
        MatrixStrategy("ddp_sharded", lambda: "ddp_sharded_fork"),
        MatrixStrategy("fsdp_fairscale", lambda: "fsdp_fairscale_fork"),
        MatrixStrategy("fsdp2", lambda: "fsdp2_fork"),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the default matrix for both optimizers and writes the tables; returns 1 if any cell failed."""
    import tempfile

    parser = argparse.ArgumentParser(description="Run the cross-strategy resume matrix and write its tables.")
    parser.add_argument("--out", type=Path, help="Markdown file to write (default: print only)")
    args = parser.parse_args(argv)
    sections = []
    failed = False
    for optimizer in ("adam", "sgd"):
        matrix = run_matrix(default_strategies(), tempfile.mkdtemp(), optimizer=optimizer)
        failed |= bool(matrix.failures)
        sections.append(f"{matrix.table()}\n\n({len(matrix.cells)} cells in {matrix.seconds:.0f} s)")
    text = "# Resume matrix\n\n" + "\n\n".join(sections) + "\n"
    print(text)
    if args.out:
        existing = args.out.read_text() if args.out.exists() else ""
        zoo = existing[existing.index(ZOO_SECTION_MARKER) :] if ZOO_SECTION_MARKER in existing else ""
        args.out.write_text(text + (f"\n{zoo}" if zoo else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
