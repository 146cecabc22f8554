"""A checkpoint written under one Lightning package (``pytorch_lightning`` or ``lightning``) resumes under the other.

The other side runs in the other environment of ``python3 dev.py test``, named by
``LIGHTNING_STRATEGIES_OTHER_PYTHON``; both sides run ``tests/scripts/cross_package.py``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.scripts.cross_package import resume, save
from tests.support.flavour import PACKAGE, testing

OTHER_PYTHON = os.environ.get("LIGHTNING_STRATEGIES_OTHER_PYTHON", "")
ROOT = Path(__file__).parents[2]

max_state_difference = testing.max_state_difference

pytestmark = pytest.mark.skipif(
    not OTHER_PYTHON, reason="needs the other environment: `python3 dev.py test` sets LIGHTNING_STRATEGIES_OTHER_PYTHON"
)


def _in_other_environment(*arguments: str | Path) -> str:
    completed = subprocess.run(
        [OTHER_PYTHON, "-m", "tests.scripts.cross_package", *map(str, arguments)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    other_package = completed.stdout.strip().splitlines()[-1]
    assert other_package != PACKAGE, f"both sides ran under {PACKAGE}: the test would prove nothing"
    return other_package


def _load(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return loaded


def _assert_restored_and_continued(saved_dir: Path, resumed_dir: Path) -> None:
    saved, restored = _load(saved_dir / "epoch=0.ckpt"), _load(resumed_dir / "restored.ckpt")
    assert max_state_difference(saved["state_dict"], restored["state_dict"])[0] == 0.0
    for before, after in zip(saved["optimizer_states"], restored["optimizer_states"], strict=True):
        assert before["param_groups"] == after["param_groups"]
        for index, state in before["state"].items():
            assert max_state_difference(state, after["state"][index])[0] == 0.0
    assert restored["lr_schedulers"] == saved["lr_schedulers"]
    # Saved at the end of epoch 0: the resumed run starts epoch 1 at the same global step.
    assert (restored["epoch"], restored["global_step"]) == (saved["epoch"] + 1, saved["global_step"])
    uninterrupted, final = _load(saved_dir / "epoch=1.ckpt"), _load(resumed_dir / "final.ckpt")
    difference, key = max_state_difference(uninterrupted["state_dict"], final["state_dict"])
    assert difference < 1e-5, f"final weights differ from the uninterrupted run at {key}: {difference}"


def test_a_checkpoint_saved_here_resumes_under_the_other_package(tmp_path: Path) -> None:
    save("fsdp_fairscale_fork", tmp_path / "saved")
    _in_other_environment("resume", "fsdp2_fork", tmp_path / "saved" / "epoch=0.ckpt", tmp_path / "resumed")

    _assert_restored_and_continued(tmp_path / "saved", tmp_path / "resumed")


def test_a_checkpoint_saved_under_the_other_package_resumes_here(tmp_path: Path) -> None:
    _in_other_environment("save", "ddp_sharded_fork", tmp_path / "saved")
    (tmp_path / "resumed").mkdir()
    resume("fsdp_fairscale_fork", tmp_path / "saved" / "epoch=0.ckpt", tmp_path / "resumed")

    _assert_restored_and_continued(tmp_path / "saved", tmp_path / "resumed")
