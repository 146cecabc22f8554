"""The README's demo: fsdp_fairscale -> ddp_sharded -> upstream ddp, measured against an uninterrupted run."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_strategies.cli import main
from lightning_strategies.cli.demo_progress import render_bar
from lightning_strategies.demo import main as demo_alias

DEFAULT_CHAIN_RUNS = [
    "reference run: fsdp_fairscale",
    "phase 1: fsdp_fairscale",
    "phase 2: resume with ddp_sharded",
    "phase 3: resume with ddp",
]


def _demo_command(out: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "lightning_strategies", "demo", "--out", str(out), *options]


def _environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"}


def _run_in_pseudo_terminal(command: list[str], timeout: float) -> tuple[int, bytes]:
    """Runs ``command`` with a pseudo-terminal as standard output and error: what a person at a terminal sees."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=_environment())
    os.close(follower)
    output = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], deadline - time.monotonic())
            if not ready:
                break
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # Linux: EIO once every writer has closed the terminal
                break
            if not chunk:
                break
            output += chunk
        return process.wait(timeout=max(deadline - time.monotonic(), 1)), output
    finally:
        process.kill()
        os.close(leader)


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


def test_the_demo_writes_one_line_per_run_and_no_carriage_return_to_a_pipe(tmp_path: Path) -> None:
    # Bytes, not text: text mode would turn a carriage return into a newline before the test saw it.
    result = subprocess.run(
        _demo_command(tmp_path, "--steps", "2"), capture_output=True, timeout=300, env=_environment()
    )

    stdout, stderr = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, stdout + stderr
    assert b"\r" not in result.stdout and b"\r" not in result.stderr
    before_table = stdout.split("\n\n")[0].splitlines()
    assert len(before_table) == 1 + len(DEFAULT_CHAIN_RUNS)  # what the demo trains, then one line per run
    assert [line.split("] ", 1)[1].split(",")[0] for line in before_table[1:]] == DEFAULT_CHAIN_RUNS
    assert before_table[-1].startswith("[12/12 steps] phase 3: resume with ddp, steps 5-6 from")
    assert "weights equal: yes" in stdout
    assert "it/s" not in stdout + stderr  # Lightning's own bars (tqdm's rate) stay off
    assert "Trainable params" not in stdout + stderr  # and so do its model summaries


def test_the_demo_draws_a_single_progress_bar_in_a_terminal(tmp_path: Path) -> None:
    exit_code, output = _run_in_pseudo_terminal(_demo_command(tmp_path, "--steps", "1"), timeout=300)

    screen = output.decode()
    assert exit_code == 0, screen
    frames = [frame.strip() for frame in screen.split("\r") if "░" in frame or "█" in frame]
    for run in DEFAULT_CHAIN_RUNS:
        assert any(frame.startswith(run) for frame in frames), f"no bar for {run!r} in {screen!r}"
    assert frames[-1].startswith("phase 3: resume with ddp") and "6/6 steps  loss " in frames[-1]
    assert "it/s" not in screen  # Lightning's own bars (tqdm's rate) stay off
    assert "weights equal: yes" in screen


def test_the_demo_module_is_an_alias_of_the_demo_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo_alias(["--help"]) == 0
    assert "usage: lightning-strategies demo" in capsys.readouterr().out


@pytest.mark.parametrize("columns", [30, 80, 200])
def test_the_bar_line_stays_narrower_than_the_terminal(columns: int) -> None:
    line = render_bar("phase 2: resume with ddp_sharded", 36, 48, 0.7363, columns)

    assert len(line) <= columns - 1  # a line as wide as the terminal would wrap, and `\r` would not return to it


def test_the_bar_keeps_its_width_from_before_the_first_step_to_the_end() -> None:
    def bar(line: str) -> str:
        return "".join(character for character in line if character in "█░")

    widths = {len(bar(render_bar("phase 1: fsdp_fairscale", done, 48, loss, 100))) for done, loss in
              [(0, None), (1, 1.5), (47, 0.5), (48, 12.25)]}  # fmt: skip
    assert len(widths) == 1
