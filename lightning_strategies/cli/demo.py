"""Demo: train with one strategy, save, resume with others in turn, and measure that nothing was lost.

``lightning-strategies demo`` (also ``python -m lightning_strategies demo`` and, as an alias,
``python -m lightning_strategies.demo``). By default: the conformance model trains with ``fsdp_fairscale`` on 2 CPU
processes for one phase and saves; ``ddp_sharded`` resumes that checkpoint for the next phase and saves; upstream
``ddp`` resumes that one for the last phase. An uninterrupted ``fsdp_fairscale`` run over all phases is the reference:
the loss right after each resume is compared with the reference's loss at the same step (a spike would show), and the
weights at the end of each phase with the reference's weights at that step. A phase is one epoch of ``--steps``
steps, so every checkpoint is at an epoch boundary and the data order after a resume is the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .._lightning import FLAVOUR, ModelCheckpoint, StrategyRegistry, pl
from ..testing import ConformanceModel, SaveAfterRestore, max_state_difference
from ._common import EXIT_FAILED, EXIT_OK, UsageError
from .demo_progress import DemoProgress, draw_bar

SEED = 42
BATCH_SIZE = 4
#: Largest weight difference to the uninterrupted run still called equal: strategies reduce gradients in different
#: orders (all-reduce, reduce-scatter), which moves float32 results by a few ulps per step.
WEIGHTS_TOLERANCE = 1e-5
#: Largest loss difference at a resume still called "no spike" (same reason; a spike is orders of magnitude larger).
LOSS_TOLERANCE = 1e-5


@dataclass
class Phase:
    """One phase of the chain: a strategy that trains ``--steps`` steps (resuming the previous phase's checkpoint).

    Attributes:
        strategy: The name as given (e.g. ``"ddp"``).
        runs_as: The registry name the Trainer got (e.g. ``"ddp_fork"``).
        first_step: Global step of its first training step (1-based).
        last_step: Global step of its last training step.
        losses: Rank 0's training losses of the phase.
        checkpoint: The checkpoint written at its end.
        written_by: The metadata block of that checkpoint (``None``: upstream Lightning writes none).
        loss_before: Last loss of the previous phase (``None`` for the first phase).
        loss_after: First loss of this phase.
        uninterrupted_loss: The reference's loss at ``first_step``.
        restored_difference: Largest difference between the weights right after the restore and the checkpoint.
        final_difference: Largest difference between the weights at ``last_step`` and the reference's.
    """

    strategy: str
    runs_as: str
    first_step: int
    last_step: int
    losses: list[float]
    checkpoint: str
    written_by: dict[str, Any] | None
    loss_before: float | None
    loss_after: float
    uninterrupted_loss: float
    restored_difference: float | None
    final_difference: float

    @property
    def loss_jump(self) -> float:
        """First loss after the resume minus the uninterrupted run's loss at that step."""
        return self.loss_after - self.uninterrupted_loss

    @property
    def lossless(self) -> bool:
        """No loss spike, restored weights equal to the checkpoint, final weights equal to the reference's."""
        return (
            abs(self.loss_jump) <= LOSS_TOLERANCE
            and self.restored_difference in (None, 0.0)
            and self.final_difference <= WEIGHTS_TOLERANCE
        )


def resolve_strategy(name: str) -> str:
    """The registry name to train with: the ``_fork`` variant of a plain name when there is one.

    Forked workers keep the demo's own process free of process groups and sharded modules, for any device count.

    Raises:
        UsageError: ``name`` is not a registered strategy.
    """
    available = StrategyRegistry.available_strategies()
    if name not in available:
        ours = sorted(n for n in available if n.startswith(("ddp_sharded", "fsdp_fairscale", "fsdp2")))
        raise UsageError(
            f"unknown strategy {name!r}. This package's: {', '.join(ours)}; upstream ones include ddp, ddp_spawn,"
            " ddp_fork."
        )
    forked = f"{name}_fork"
    return forked if not name.endswith("_fork") and forked in available else name


class _StepProgress(pl.Callback):
    """Moves the demo's bar on after each of rank 0's training steps (in the worker that trains).

    Holds only plain values, so a spawned worker unpickles it; the demo's process keeps its own count (a run in that
    process would otherwise count its steps twice).
    """

    def __init__(self, label: str, done_before: int, total: int) -> None:
        self.label = label
        self.done = done_before
        self.total = total

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero:
            return
        self.done += 1
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        draw_bar(self.label, self.done, self.total, float(loss) if isinstance(loss, torch.Tensor) else None)


def _fit(
    strategy: str,
    directory: Path,
    *,
    devices: int,
    epochs: int,
    samples: int,
    progress: DemoProgress,
    label: str,
    ckpt_path: Path | None = None,
    restored: Path | None = None,
) -> list[float]:
    shutil.rmtree(directory, ignore_errors=True)  # only the demo's own subdirectory: no stale checkpoints
    directory.mkdir(parents=True)
    pl.seed_everything(SEED, verbose=False)
    model = ConformanceModel(batch_size=BATCH_SIZE, samples=samples, record_dir=str(directory))
    callbacks: list[pl.Callback] = [ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)]
    if restored is not None:
        callbacks.append(SaveAfterRestore(restored))
    if progress.live:
        callbacks.append(_StepProgress(progress.bar_label(label), progress.done, progress.total_steps))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,  # the demo draws one display over all its runs
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    progress.begin(label)
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except BaseException:
        progress.interrupted()
        raise
    losses: list[float] = json.loads((directory / "record-fit-rank0.json").read_text())["train_losses"]
    return losses


def _load(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return loaded


def run_demo(
    out: Path,
    strategies: Sequence[str],
    *,
    devices: int = 2,
    steps: int = 8,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Trains the chain and the reference, compares them, and writes ``out/report.json`` (and the plot).

    Args:
        out: Output directory.
        strategies: The strategy of each phase (registry names; plain names run their ``_fork`` variant). The first
            one also trains the uninterrupted reference.
        devices: CPU processes per run.
        steps: Training steps per phase (one epoch).
        show_progress: Draw a progress bar when standard output is a terminal (one line per run is always
            written).

    Returns:
        The report.

    Raises:
        UsageError: An unknown strategy name.
    """
    runs_as = [resolve_strategy(name) for name in strategies]
    out.mkdir(parents=True, exist_ok=True)
    samples = steps * BATCH_SIZE * devices  # one epoch is `steps` steps on every rank
    phases = len(strategies)
    labels = [f"reference run: {strategies[0]}", f"phase 1: {strategies[0]}"]
    labels += [f"phase {number}: resume with {name}" for number, name in enumerate(strategies[1:], start=2)]
    live = show_progress and sys.stdout.isatty()
    progress = DemoProgress(2 * phases * steps, live, label_width=max(len(label) for label in labels))
    fit_args: dict[str, Any] = {"devices": devices, "samples": samples, "progress": progress}
    print(
        f"training {progress.total_steps} steps in {phases + 1} runs on {devices} CPU process(es): {strategies[0]}"
        f" uninterrupted (the reference), then {' -> '.join(strategies)}, each resuming the previous checkpoint",
        flush=True,
    )
    reference_dir = out / "reference"
    reference = _fit(runs_as[0], reference_dir, epochs=phases, label=labels[0], **fit_args)
    progress.end(phases * steps, f"steps 1-{phases * steps} uninterrupted", reference)
    results: list[Phase] = []
    previous: Path | None = None
    for index, (name, registry_name) in enumerate(zip(strategies, runs_as, strict=True)):
        directory = out / f"phase{index + 1}-{name}"
        detail = f"steps {index * steps + 1}-{(index + 1) * steps}"
        if previous is not None:
            detail += f" from {previous.relative_to(out)}"
        restored = directory / "restored.ckpt" if previous is not None else None
        losses = _fit(
            registry_name,
            directory,
            epochs=index + 1,
            ckpt_path=previous,
            restored=restored,
            label=labels[index + 1],
            **fit_args,
        )
        progress.end(steps, detail, losses)
        checkpoint = directory / f"epoch={index}.ckpt"
        saved = _load(checkpoint)
        final_difference, _ = max_state_difference(
            saved["state_dict"], _load(reference_dir / f"epoch={index}.ckpt")["state_dict"]
        )
        restored_difference = None
        if restored is not None and previous is not None:
            restored_difference, _ = max_state_difference(_load(restored)["state_dict"], _load(previous)["state_dict"])
        results.append(
            Phase(
                strategy=name,
                runs_as=registry_name,
                first_step=index * steps + 1,
                last_step=(index + 1) * steps,
                losses=losses,
                checkpoint=str(checkpoint),
                written_by=saved.get("lightning_strategies"),
                loss_before=results[-1].losses[-1] if results else None,
                loss_after=losses[0],
                uninterrupted_loss=reference[index * steps],
                restored_difference=restored_difference,
                final_difference=final_difference,
            )
        )
        previous = checkpoint
    report: dict[str, Any] = {
        "devices": devices,
        "steps_per_phase": steps,
        "lightning": FLAVOUR.pytorch,
        "tolerances": {"weights": WEIGHTS_TOLERANCE, "loss": LOSS_TOLERANCE},
        "reference": {"strategy": strategies[0], "runs_as": runs_as[0], "losses": reference},
        "phases": [{**asdict(phase), "loss_jump": phase.loss_jump, "lossless": phase.lossless} for phase in results],
        "no_loss_spike": all(abs(phase.loss_jump) <= LOSS_TOLERANCE for phase in results[1:]),
        "weights_equal": all(
            phase.final_difference <= WEIGHTS_TOLERANCE and phase.restored_difference in (None, 0.0)
            for phase in results
        ),
    }
    report["lossless"] = report["no_loss_spike"] and report["weights_equal"]
    plot = _plot(report, out / "loss_curve.png")
    report["plot"] = str(plot) if plot is not None else None
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def _plot(report: dict[str, Any], path: Path) -> Path | None:
    """Draws the loss curves (reference and chain), marking each strategy change; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(figsize=(8, 4.5))
    reference = report["reference"]["losses"]
    label = f"{report['reference']['strategy']} uninterrupted"
    axes.plot(
        range(1, len(reference) + 1), reference, color="black", linestyle=":", linewidth=1.2, zorder=3, label=label
    )
    for phase in report["phases"]:
        steps = range(phase["first_step"], phase["first_step"] + len(phase["losses"]))
        axes.plot(steps, phase["losses"], marker=".", linewidth=2.5, alpha=0.8, label=phase["strategy"])
        if phase["loss_before"] is not None:
            axes.axvline(phase["first_step"] - 0.5, color="0.3", linewidth=0.8)
            axes.plot([phase["first_step"]], [phase["loss_after"]], marker="v", color="black", markersize=8)
            top = axes.get_ylim()[1]
            axes.annotate(
                f"resume with {phase['strategy']}", (phase["first_step"] - 0.5, top), rotation=90, va="top", ha="right"
            )
    axes.set_xlabel("global step")
    axes.set_ylabel("training loss (rank 0)")
    axes.set_title(" -> ".join(phase["strategy"] for phase in report["phases"]) + f", {report['devices']} processes")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def format_table(report: dict[str, Any]) -> str:
    """The demo's table: one row per phase, then the verdict."""
    header = ("phase", "strategy", "steps", "loss before", "loss after", "uninterrupted", "jump", "restored", "weights")
    rows = [header]
    for number, phase in enumerate(report["phases"], start=1):
        resumed = phase["loss_before"] is not None
        restored = phase["restored_difference"]
        rows.append(
            (
                str(number),
                phase["strategy"],
                f"{phase['first_step']}-{phase['last_step']}",
                f"{phase['loss_before']:.6f}" if resumed else "-",
                f"{phase['loss_after']:.6f}",
                f"{phase['uninterrupted_loss']:.6f}",
                f"{phase['loss_jump']:+.1e}",
                "-" if restored is None else ("exact" if restored == 0.0 else f"NO ({restored:.1e})"),
                f"{_yes(phase['final_difference'] <= WEIGHTS_TOLERANCE)} ({phase['final_difference']:.1e})",
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    worst = max(phase["final_difference"] for phase in report["phases"])
    jump = max((abs(phase["loss_jump"]) for phase in report["phases"][1:]), default=0.0)
    lines += [
        "",
        "loss after: the first step after the resume; uninterrupted: the reference run at that step; restored: weights"
        " right after the restore vs the checkpoint; weights: at the phase's last step vs the reference (max |diff|).",
        f"no loss spike: {_yes(report['no_loss_spike'])} (largest jump {jump:.1e}, tolerance {LOSS_TOLERANCE:.0e})",
        f"weights equal: {_yes(report['weights_equal'])} (largest difference {worst:.1e}, tolerance"
        f" {WEIGHTS_TOLERANCE:.0e})",
    ]
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    """Runs ``lightning-strategies demo`` with parsed arguments; 0 when every resume was lossless, else 1."""
    logging.getLogger(FLAVOUR.pytorch).setLevel(logging.WARNING)
    logging.getLogger(FLAVOUR.fabric).setLevel(logging.WARNING)
    logging.getLogger().setLevel(logging.ERROR)  # fairscale logs through the root logger
    strategies = [args.save_from, *args.resume_with]
    for name in strategies:
        resolve_strategy(name)  # every name checked before anything trains
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice for real runs (workers, small data) is noise here
        report = run_demo(
            args.out, strategies, devices=args.devices, steps=args.steps, show_progress=not args.no_progress
        )
    print()
    print(f"{' -> '.join(strategies)} on {args.devices} CPU process(es), {args.steps} steps per phase")
    print(format_table(report))
    print(f"\nreport: {args.out / 'report.json'}")
    if report["plot"] is not None:
        print(f"plot:   {report['plot']}")
    else:
        print("plot:   not drawn (matplotlib is not installed): pip install 'lightning-strategies[plots]'")
    return EXIT_OK if report["lossless"] else EXIT_FAILED
