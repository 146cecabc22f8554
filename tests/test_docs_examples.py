"""Every Python example in the README and in docs/ runs, as a user would run it: saved as a script and started.

Scripts (not ``python -c``) because Lightning's default launcher starts the other ranks by running the same script
again, which is what a user's ``train.py`` sees. Each example must be complete: imports, model, data.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _examples() -> list[tuple[str, str]]:
    examples = []
    for page in PAGES:
        for number, match in enumerate(PYTHON_BLOCK.finditer(page.read_text()), start=1):
            examples.append((f"{page.relative_to(ROOT)}#{number}", match.group(1)))
    return examples


EXAMPLES = _examples()


def test_the_pages_with_code_have_their_examples_found() -> None:
    pages = {name.split("#")[0] for name, _ in EXAMPLES}
    assert {"README.md", "docs/user-guide.md", "docs/design.md", "docs/own-strategy.md"} <= pages


@pytest.mark.parametrize(("name", "code"), EXAMPLES, ids=[name for name, _ in EXAMPLES])
def test_example_runs(tmp_path: Path, name: str, code: str) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    completed = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert completed.returncode == 0, f"{name} failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-4000:]}"


CONSOLE_BLOCK = re.compile(r"^```console\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _documented_command_lines() -> list[str]:
    return [
        line.removeprefix("$ ").strip()
        for page in PAGES
        for block in CONSOLE_BLOCK.findall(page.read_text())
        for line in block.splitlines()
        if line.startswith("$ lightning-strategies ")
    ]


def test_the_cli_page_documents_every_command() -> None:
    from lightning_strategies.cli import build_parser

    commands = {line.split()[1] for line in _documented_command_lines()}
    (subcommands,) = [action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    assert commands == set(subcommands.choices) == {"demo", "inspect", "convert", "consolidate", "export", "clean"}


@pytest.mark.parametrize("line", _documented_command_lines())
def test_each_documented_command_line_matches_the_commands_help(line: str, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_strategies.cli import main

    command = line.split()[1]
    assert main([command, "--help"]) == 0
    usage = capsys.readouterr().out
    for option in re.findall(r"--[a-z-]+", line):
        assert option in usage, f"{line!r}: {option} is not an option of `{command}`"
