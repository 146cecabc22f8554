#!/usr/bin/env python3
"""The project's two commands, runnable with nothing but Python 3.11:

    python3 dev.py demo    # train with ddp_sharded on 2 CPU processes, resume with upstream ddp, print a report
    python3 dev.py test    # ruff, mypy --strict and the whole test suite

Both create ``.venv`` on first use and install the pinned versions from ``constraints.txt`` (torch's CPU wheel).
Extra arguments go to the demo or to pytest, e.g. ``python3 dev.py test -k sharded``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / "python"
STAMP = VENV / ".installed"


def _run(*command: str | Path) -> None:
    print("+", " ".join(str(part) for part in command), flush=True)
    result = subprocess.run([str(part) for part in command], cwd=ROOT, check=False)
    if result.returncode != 0:
        sys.exit(result.returncode)


def _ensure_environment() -> None:
    digest = hashlib.sha256(
        b"".join((ROOT / name).read_bytes() for name in ("pyproject.toml", "constraints.txt"))
    ).hexdigest()
    if STAMP.exists() and STAMP.read_text() == digest:
        return
    if not PYTHON.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    _run(PYTHON, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    _run(PYTHON, "-m", "pip", "install", "--quiet", "-c", "constraints.txt", "-e", ".[test]")
    STAMP.write_text(digest)


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__)
        sys.exit(2)
    _ensure_environment()
    command, rest = argv[0], argv[1:]
    if command == "demo":
        _run(PYTHON, "-m", "lightning_strategies.demo", *rest)
        return
    _run(BIN / "ruff", "check", ".")
    _run(BIN / "ruff", "format", "--check", ".")
    _run(BIN / "mypy", "lightning_strategies")
    _run(PYTHON, "-m", "pytest", *rest)


if __name__ == "__main__":
    main(sys.argv[1:])
