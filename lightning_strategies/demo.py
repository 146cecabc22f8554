"""Demo: train with ``ddp_sharded`` on CPU processes, save, resume with upstream ``ddp``, and report.

Run it with ``python3 dev.py demo`` (or ``python -m lightning_strategies.demo`` inside the environment). It trains
the conformance model three times: with ``ddp_sharded`` for the first epochs (saving a checkpoint), with upstream
``ddp`` resumed from that checkpoint, and with ``ddp_sharded`` uninterrupted for comparison. The report shows the
losses around the resume and whether the weights match.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._lightning import FLAVOUR, ModelCheckpoint, pl
from .testing import ConformanceModel, SaveAfterRestore, max_state_difference

SEED = 42


@dataclass
class _Run:
    label: str
    strategy: str
    losses: list[float]
    state: dict[str, torch.Tensor]


def _train(
    label: str,
    strategy: str,
    out: Path,
    devices: int,
    epochs: int,
    ckpt_path: Path | None = None,
    callbacks: Sequence[pl.Callback] = (),
) -> _Run:
    print(f"- {label}: strategy={strategy!r}, {devices} CPU processes, up to epoch {epochs}", flush=True)
    records = out / label.replace(" ", "-")
    records.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(SEED, verbose=False)
    model = ConformanceModel(record_dir=str(records))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=records, filename="{epoch}", save_top_k=-1), *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    losses = json.loads((records / "record-fit-rank0.json").read_text())["train_losses"]
    return _Run(label, strategy, losses, {key: value.clone() for key, value in model.state_dict().items()})


def run_demo(out: Path, devices: int = 2, epochs_before: int = 2, epochs_after: int = 2) -> dict[str, Any]:
    """Runs the demo and returns its report (also written to ``out/report.json``).

    Args:
        out: Directory for checkpoints and the report.
        devices: Number of CPU processes.
        epochs_before: Epochs trained with ``ddp_sharded`` before the checkpoint.
        epochs_after: Epochs trained with upstream ``ddp`` after resuming.

    Returns:
        The report as a dictionary.
    """
    out.mkdir(parents=True, exist_ok=True)
    total = epochs_before + epochs_after
    first = _train("sharded", "ddp_sharded_fork", out, devices, epochs_before)
    saved = out / "sharded" / f"epoch={epochs_before - 1}.ckpt"
    restored = out / "restored.ckpt"
    resumed = _train(
        "resumed with ddp",
        "ddp_fork",
        out,
        devices,
        total,
        ckpt_path=saved,
        callbacks=[SaveAfterRestore(restored)],
    )
    reference = _train("uninterrupted sharded", "ddp_sharded_fork", out, devices, total)

    checkpoint = torch.load(saved, weights_only=True)
    after_restore = torch.load(restored, weights_only=True)
    steps_before = len(first.losses)
    restored_difference, _ = max_state_difference(after_restore["state_dict"], checkpoint["state_dict"])
    final_difference, _ = max_state_difference(resumed.state, reference.state)
    report = {
        "checkpoint": str(saved),
        "written_by": checkpoint.get("lightning_strategies"),
        "steps_before_resume": steps_before,
        "steps_after_resume": len(resumed.losses),
        "last_loss_before_resume": first.losses[-1],
        "first_loss_after_resume": resumed.losses[0],
        "uninterrupted_loss_at_that_step": reference.losses[steps_before],
        "restored_weights_max_difference": restored_difference,
        "final_weights_max_difference_to_uninterrupted": final_difference,
        "final_loss_resumed": resumed.losses[-1],
        "final_loss_uninterrupted": reference.losses[-1],
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def _print_report(report: dict[str, Any]) -> None:
    restored_ok = report["restored_weights_max_difference"] == 0.0
    final_ok = report["final_weights_max_difference_to_uninterrupted"] <= 1e-5
    spike = report["first_loss_after_resume"] - report["uninterrupted_loss_at_that_step"]
    rows = [
        ("checkpoint written by", f"{report['written_by']}"),
        ("steps before / after resume", f"{report['steps_before_resume']} / {report['steps_after_resume']}"),
        ("last loss before resume (ddp_sharded)", f"{report['last_loss_before_resume']:.6f}"),
        ("first loss after resume (ddp)", f"{report['first_loss_after_resume']:.6f}"),
        ("same step, uninterrupted ddp_sharded", f"{report['uninterrupted_loss_at_that_step']:.6f}"),
        ("loss jump at resume", f"{spike:+.2e} ({'no spike' if abs(spike) <= 1e-5 else 'SPIKE'})"),
        ("restored weights == checkpoint", "yes" if restored_ok else "NO"),
        (
            "final weights == uninterrupted run",
            f"{'yes' if final_ok else 'NO'} (max |diff| {report['final_weights_max_difference_to_uninterrupted']:.1e})",
        ),
        (
            "final loss resumed / uninterrupted",
            f"{report['final_loss_resumed']:.6f} / {report['final_loss_uninterrupted']:.6f}",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    print("\nddp_sharded -> checkpoint -> upstream ddp")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns 0 when the resume was lossless, 1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="directory for checkpoints and report")
    parser.add_argument("--devices", type=int, default=2, help="number of CPU processes (default 2)")
    parser.add_argument("--epochs-before", type=int, default=2, help="epochs with ddp_sharded before saving")
    parser.add_argument("--epochs-after", type=int, default=2, help="epochs with ddp after resuming")
    args = parser.parse_args(argv)
    logging.getLogger(FLAVOUR.pytorch).setLevel(logging.WARNING)
    logging.getLogger().setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    report = run_demo(args.out, args.devices, args.epochs_before, args.epochs_after)
    _print_report(report)
    print(f"\nReport: {args.out / 'report.json'}")
    lossless = (
        report["restored_weights_max_difference"] == 0.0
        and report["final_weights_max_difference_to_uninterrupted"] <= 1e-5
    )
    return 0 if lossless else 1


if __name__ == "__main__":
    raise SystemExit(main())
