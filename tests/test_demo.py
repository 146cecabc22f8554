"""The README's demo: fsdp_fairscale -> ddp_sharded -> upstream ddp, measured against an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_strategies.cli import main
from lightning_strategies.demo import main as demo_alias


def test_the_default_chain_resumes_without_a_loss_spike_and_with_equal_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exit_code = main(["demo", "--steps", "2", "--out", str(tmp_path), "--no-progress"])

    report = json.loads((tmp_path / "report.json").read_text())
    assert exit_code == 0
    assert [phase["strategy"] for phase in report["phases"]] == ["fsdp_fairscale", "ddp_sharded", "ddp"]
    assert [phase["runs_as"] for phase in report["phases"]] == ["fsdp_fairscale_fork", "ddp_sharded_fork", "ddp_fork"]
    assert report["no_loss_spike"] and report["weights_equal"]
    assert [phase["restored_difference"] for phase in report["phases"]] == [None, 0.0, 0.0]
    assert [phase["written_by"]["strategy"] if phase["written_by"] else None for phase in report["phases"]] == [
        "fsdp_fairscale",
        "ddp_sharded",
        None,  # upstream ddp writes no metadata block
    ]
    assert len(report["reference"]["losses"]) == 6
    assert (tmp_path / "loss_curve.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "no loss spike: yes" in table and "weights equal: yes" in table


def test_python_dash_m_demo_runs_a_chosen_chain(tmp_path: Path) -> None:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lightning_strategies", "demo", "--steps", "1", "--save-from", "ddp_sharded"]
    command += ["--resume-with", "fsdp2", "--out", str(tmp_path), "--no-progress"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "ddp_sharded -> fsdp2" in result.stdout and "weights equal: yes" in result.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["phases"][1]["runs_as"] == "fsdp2_fork"


def test_the_demo_module_is_an_alias_of_the_demo_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo_alias(["--help"]) == 0
    assert "usage: lightning-strategies demo" in capsys.readouterr().out
