"""``dev.py``'s environment build: one line per step, a command's own output only when it fails."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def dev(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``dev.py`` imported as a module (registered only for the test: its dataclasses look themselves up there)."""
    spec = importlib.util.spec_from_file_location("dev", ROOT / "dev.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {ROOT / 'dev.py'}")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "dev", module)
    spec.loader.exec_module(module)
    return module


def test_a_step_that_succeeds_prints_one_line_and_not_the_commands_output(
    dev: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    command = (sys.executable, "-c", "import sys; print('Collecting torch'); print('WARNING: noise', file=sys.stderr)")

    dev._step("installing pinned packages into .venv", *command)

    captured = capsys.readouterr()
    assert captured.out.splitlines() == [captured.out.strip()]
    assert captured.out.startswith("installing pinned packages into .venv ... done (")
    assert "Collecting" not in captured.out + captured.err and "noise" not in captured.out + captured.err


def test_a_step_that_fails_shows_the_commands_output_and_exits_with_its_code(
    dev: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    command = (sys.executable, "-c", "import sys; print('Collecting torch'); sys.exit('ERROR: no matching version')")

    with pytest.raises(SystemExit) as exit_info:
        dev._step("installing pinned packages into .venv", *command)

    captured = capsys.readouterr()
    assert exit_info.value.code == 1
    assert captured.out.startswith("installing pinned packages into .venv ... failed: ")
    assert "Collecting torch" in captured.out and "ERROR: no matching version" in captured.err


def test_a_version_legs_constraints_replace_torch_and_lightning_and_keep_every_other_pin(
    dev: ModuleType, tmp_path: Path
) -> None:
    leg = dev.Environment(tmp_path / ".venv-test", "pytorch-lightning", "test", torch="9.9.9", lightning="8.8.8")
    leg.directory.mkdir()

    pins = dict(line.split("==") for line in leg.constraints().read_text().splitlines() if "==" in line)
    pinned = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line)

    assert (pins["torch"], pins["pytorch-lightning"], pins["lightning"]) == ("9.9.9", "8.8.8", "8.8.8")
    assert {name: pin for name, pin in pins.items() if name not in ("torch", "pytorch-lightning", "lightning")} == {
        name: pin for name, pin in pinned.items() if name not in ("torch", "pytorch-lightning", "lightning")
    }


def test_a_failing_leg_names_itself_and_its_versions(dev: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    here = Path(sys.executable)
    leg = dev.Environment(here.parent.parent, "pytorch-lightning", "test-leg", torch="9.9.9", lightning="8.8.8")
    if leg.python != here:
        pytest.skip(f"this interpreter is not at <directory>/bin/python: {here}")

    with pytest.raises(SystemExit) as exit_info:
        dev._pytest(leg, "tests/no_such_test_file.py", other=leg)

    assert exit_info.value.code != 0
    assert "FAILED: leg 'test-leg' (torch 9.9.9, pytorch-lightning 8.8.8)" in capsys.readouterr().out
