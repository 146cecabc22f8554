"""The command line works with whichever Lightning package is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_python_dash_m_demo_resumes_losslessly_under_the_installed_lightning_package(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "lightning_strategies", "demo", "--steps", "1", "--save-from", "fsdp2"]
    command += ["--resume-with", "fsdp_fairscale", "--out", str(tmp_path), "--no-progress"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment, check=False)

    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["no_loss_spike"] and report["weights_equal"]
