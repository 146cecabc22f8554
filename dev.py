#!/usr/bin/env python3
"""The project's commands, runnable with nothing but Python 3.11:

    python3 dev.py demo    # fsdp_fairscale on 2 CPU processes -> checkpoint -> ddp_sharded -> upstream ddp -> table
    python3 dev.py bench   # benchmarks against hand-written loops, 2 CPU processes (12-20 min): docs/benchmarks.md
    python3 dev.py fuzz    # differential fuzzer campaign: --examples N --seed S, or --replay "Recipe(...)"
    python3 dev.py test    # ruff, mypy --strict, the docs (Sphinx, warnings as errors) and the test suite,
                           # under pytorch_lightning and again under lightning

``test`` builds two environments from the pins in ``constraints.txt`` (torch's CPU wheel): ``.venv`` with
``pytorch-lightning`` and ``.venv-lightning`` with the unified ``lightning`` package only. The whole suite runs in
the first; ``tests/both_packages`` (conformance kit, cross-strategy resumes, cross-package checkpoints) runs again
in the second, but for its tests marked ``flavour_independent``. ``demo`` needs only ``.venv``.
Extra arguments go to the demo or to pytest, e.g. ``python3 dev.py test -k sharded``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Environment:
    """A virtual environment with one of the two Lightning packages."""

    directory: Path
    lightning_package: str  # the pip distribution: "pytorch-lightning" or "lightning"

    @property
    def bin(self) -> Path:
        return self.directory / ("Scripts" if os.name == "nt" else "bin")

    @property
    def python(self) -> Path:
        return self.bin / "python"


PYTORCH_LIGHTNING_ENV = Environment(ROOT / ".venv", "pytorch-lightning")
LIGHTNING_ENV = Environment(ROOT / ".venv-lightning", "lightning")

# `lightning` declares `pytorch-lightning` as a requirement but never imports it; installing its other requirements
# by hand gives an environment where only `lightning.pytorch` exists, which is what its users may have.
_LIGHTNING_REQUIREMENTS = """
import importlib.metadata, re
for requirement in importlib.metadata.requires("lightning") or []:
    name = re.split(r"[ ;<>=!~\\[]", requirement, maxsplit=1)[0]
    if "extra ==" not in requirement and name.lower() != "pytorch-lightning":
        print(requirement.split(";")[0])
"""


def _run(*command: str | Path, env: dict[str, str] | None = None, echo: bool = True) -> None:
    if echo:
        print("+", " ".join(str(part) for part in command), flush=True)
    result = subprocess.run([str(part) for part in command], cwd=ROOT, check=False, env=env)
    if result.returncode != 0:
        sys.exit(result.returncode)


def _step(message: str, *command: str | Path) -> str:
    """One line for one step of an environment build; the command's own output only when it fails.

    Returns:
        The command's standard output.
    """
    print(f"{message} ...", end=" ", flush=True)
    started = time.perf_counter()
    result = subprocess.run([str(part) for part in command], cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        print("failed:", " ".join(str(part) for part in command), flush=True)
        sys.stdout.write(result.stdout)
        sys.stdout.flush()
        sys.stderr.write(result.stderr)
        sys.exit(result.returncode)
    print(f"done ({time.perf_counter() - started:.0f} s)", flush=True)
    return result.stdout


def _ensure(environment: Environment) -> None:
    stamp = environment.directory / ".installed"
    digest = hashlib.sha256(
        b"".join((ROOT / name).read_bytes() for name in ("pyproject.toml", "constraints.txt", "dev.py"))
    ).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return
    name = environment.directory.name
    if not environment.python.exists():
        _step(f"creating {name}", sys.executable, "-m", "venv", environment.directory)
    python = environment.python
    pip = (python, "-m", "pip", "install", "--progress-bar", "off", "-c", "constraints.txt")
    _step(f"upgrading pip in {name}", python, "-m", "pip", "install", "--progress-bar", "off", "--upgrade", "pip")
    if environment.lightning_package == "pytorch-lightning":
        _step(
            f"installing pinned packages into {name} (torch CPU, pytorch-lightning, fairscale, test and docs tools)",
            *pip,
            "-e",
            ".[pytorch-lightning,plots,docs,test,zoo,export]",
        )
    else:
        _step(
            f"installing pinned packages into {name} (torch CPU, fairscale, test tools)",
            *pip,
            "-e",
            ".[plots,test,export]",
        )
        _step(f"installing lightning into {name} (without pytorch-lightning)", *pip, "--no-deps", "lightning")
        listed = _step(f"listing lightning's requirements in {name}", python, "-c", _LIGHTNING_REQUIREMENTS)
        _step(f"installing lightning's requirements into {name}", *pip, *listed.split())
    stamp.write_text(digest)


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("demo", "bench", "fuzz", "test"):
        print(__doc__)
        sys.exit(2)
    command, rest = argv[0], argv[1:]
    main_env = PYTORCH_LIGHTNING_ENV
    _ensure(main_env)
    if command == "demo":
        _run(main_env.python, "-m", "lightning_strategies", "demo", *rest, echo=False)
        return
    if command == "bench":
        _run(main_env.python, "-m", "benchmarks", *rest)
        return
    if command == "fuzz":
        _run(main_env.python, "-m", "tests.fuzz", *rest, echo=False)
        return
    _ensure(LIGHTNING_ENV)
    _run(main_env.bin / "ruff", "check", ".")
    _run(main_env.bin / "ruff", "format", "--check", ".")
    _run(main_env.bin / "mypy", "lightning_strategies")
    # Warnings are errors: a broken reference or a docstring autodoc cannot read fails the run.
    _run(main_env.bin / "sphinx-build", "-W", "--keep-going", "-q", "-b", "html", "docs", "docs/_build/html")
    # Each run names the other environment's Python: the cross-package tests save in one and resume in the other.
    env = {**os.environ, "LIGHTNING_STRATEGIES_OTHER_PYTHON": str(LIGHTNING_ENV.python)}
    # Two pytest workers, a test module each at a time: the distributed tests spend much of their time waiting
    # (interpreter start-up, rendezvous, collectives), so two overlap well even on 2 cores (measured 980 s -> 632 s).
    parallel = ("-n", "2", "--dist", "loadscope")
    _run(main_env.python, "-m", "pytest", *parallel, *rest, env=env)
    if not rest:
        env = {**os.environ, "LIGHTNING_STRATEGIES_OTHER_PYTHON": str(main_env.python)}
        only_here = ("-m", "not flavour_independent")
        _run(LIGHTNING_ENV.python, "-m", "pytest", *parallel, "tests/both_packages", *only_here, env=env)


if __name__ == "__main__":
    main(sys.argv[1:])
