"""The README's demo runs and reports a lossless resume."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_strategies.demo import main


def test_the_demo_reports_a_lossless_resume_from_ddp_sharded_to_ddp(tmp_path: Path) -> None:
    exit_code = main(["--out", str(tmp_path), "--epochs-before", "1", "--epochs-after", "1"])

    report = json.loads((tmp_path / "report.json").read_text())
    assert exit_code == 0
    assert report["written_by"]["strategy"] == "ddp_sharded"
    assert report["restored_weights_max_difference"] == 0.0
    assert report["first_loss_after_resume"] == report["uninterrupted_loss_at_that_step"]
