"""``scripts/gpu_prepare.py``: what travels to a lent GPU machine, and the one command that runs the check there."""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def prepare(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``scripts/gpu_prepare.py`` imported as a module (registered only for the test)."""
    spec = importlib.util.spec_from_file_location("gpu_prepare", ROOT / "scripts" / "gpu_prepare.py")
    if spec is None or spec.loader is None:
        raise ImportError("cannot load scripts/gpu_prepare.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_prepare", module)
    spec.loader.exec_module(module)
    return module


def test_the_printed_device_command_stays_under_the_device_tools_limit(
    prepare: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert prepare.main(["--plan"]) == 0

    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("python3 -m pip install")]
    assert len(printed) == 1
    assert len(printed[0]) < 2000
    assert "--no-index" in printed[0] and ".whl/*.whl" in printed[0]  # offline: that machine reaches no registry
    assert "python3 scripts/gpu_check.py --out $OUT" in printed[0] and (ROOT / "scripts" / "gpu_check.py").exists()


def test_the_carried_wheels_cover_what_the_gpu_machine_lacks(prepare: ModuleType) -> None:
    lacking = set(prepare.lacking())
    carried = prepare.carried_wheels()

    assert "fairscale" in lacking and "transformers" in lacking  # absent there; 5.17 there, <5 declared
    assert lacking - set(prepare.NOT_CARRIED) <= set(carried)
    pins = prepare.pins()
    assert all(version == pins[name] for name, version in carried.items())  # each at the version CI tests


def _wheel(directory: Path, *requirements: str) -> Path:
    path = directory / "example-1.0-py3-none-any.whl"
    metadata = "Metadata-Version: 2.1\nName: example\nVersion: 1.0\n"
    metadata += "".join(f"Requires-Dist: {requirement}\n" for requirement in requirements)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("example-1.0.dist-info/METADATA", metadata)
    return path


def test_a_carried_wheels_requirement_that_the_machine_does_not_meet_is_reported(
    prepare: ModuleType, tmp_path: Path
) -> None:
    wheel = _wheel(
        tmp_path,
        "huggingface-hub<1.0,>=0.34.0",  # carried at 0.36.2: met
        "filelock",  # on the machine: met
        "numpy>=99",  # 2.5.2 there
        "not-on-the-machine>=1",
        'colorama; sys_platform == "win32"',  # not for that machine
        'sphinx; extra == "docs"',  # an extra's
    )

    unmet = prepare.unmet_requirements([wheel])

    assert len(unmet) == 2
    assert "numpy>=99" in unmet[0] and "2.5.2 there" in unmet[0]
    assert "not-on-the-machine>=1" in unmet[1] and "not carried" in unmet[1]
