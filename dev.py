#!/usr/bin/env python3
"""The project's commands, runnable with nothing but Python 3.11:

    python3 dev.py demo    # fsdp_fairscale on 2 CPU processes -> checkpoint -> ddp_sharded -> upstream ddp -> table
    python3 dev.py bench   # benchmarks against hand-written loops, 2 CPU processes (12-20 min): docs/benchmarks.md
    python3 dev.py fuzz    # differential fuzzer campaign: --examples N --seed S, or --replay "Recipe(...)"
    python3 dev.py test    # ruff, mypy --strict, the docs (Sphinx, warnings as errors) and the test suite,
                           # under pytorch_lightning, under lightning, and at each end of the declared ranges

``test`` runs four legs, each in an environment of its own built from the pins in ``constraints.txt``: ``pinned``
(``.venv``: torch's CPU wheel and ``pytorch-lightning``) runs the whole suite; ``lightning`` (``.venv-lightning``:
the unified ``lightning`` package only) runs ``tests/both_packages`` (conformance kit, cross-strategy resumes,
cross-package checkpoints) but for its tests marked ``flavour_independent``; ``newest`` and ``oldest``
(``.venv-newest``, ``.venv-oldest``: the ends of the ranges ``pyproject.toml`` declares, torch's CUDA build from
pypi.org run on the CPU) run ``tests/both_packages``, the differential fuzzer's CI examples, the checkpoint IO
plugin tests and the resume matrix's remote cells on the S3 server (``VERSION_LEG_TESTS``). Their environments are
built in the background while the pinned leg runs, the ``lightning`` leg's while ruff, mypy and Sphinx run (their
logs: ``.venv-newest.log``, ``.venv-oldest.log``, ``.venv-lightning.log``).
``demo`` needs only ``.venv``. Extra arguments go to the demo or to pytest (pinned leg only), e.g.
``python3 dev.py test -k sharded``.
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


def _pinned(name: str) -> str:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.startswith(f"{name}=="):
            return line.split("==", 1)[1].strip()
    raise SystemExit(f"constraints.txt pins no {name}")


PINNED_TORCH = _pinned("torch")
PINNED_LIGHTNING = _pinned("pytorch-lightning")


@dataclass(frozen=True)
class Environment:
    """A virtual environment with one of the two Lightning packages, at one torch and one Lightning version."""

    directory: Path
    lightning_package: str  # the pip distribution: "pytorch-lightning" or "lightning"
    leg: str  # the CI leg's name, printed with every failure
    torch: str = PINNED_TORCH
    lightning: str = PINNED_LIGHTNING

    @property
    def bin(self) -> Path:
        return self.directory / ("Scripts" if os.name == "nt" else "bin")

    @property
    def python(self) -> Path:
        return self.bin / "python"

    @property
    def pinned(self) -> bool:
        """Whether torch and Lightning are the versions of ``constraints.txt`` (the local CPU wheel of torch)."""
        return (self.torch, self.lightning) == (PINNED_TORCH, PINNED_LIGHTNING)

    def describe(self) -> str:
        return f"leg {self.leg!r} (torch {self.torch}, {self.lightning_package} {self.lightning})"

    def constraints(self) -> Path:
        """``constraints.txt`` with this leg's torch and Lightning versions in place of the pinned ones."""
        if self.pinned:
            return ROOT / "constraints.txt"
        overridden = {"torch": self.torch, "pytorch-lightning": self.lightning, "lightning": self.lightning}
        lines = []
        for line in (ROOT / "constraints.txt").read_text().splitlines():
            name = line.split("==", 1)[0].strip()
            lines.append(f"{name}=={overridden[name]}" if name in overridden and "==" in line else line)
        path = self.directory / "constraints.txt"
        path.write_text("\n".join(lines) + "\n")
        return path


PYTORCH_LIGHTNING_ENV = Environment(ROOT / ".venv", "pytorch-lightning", "pinned")
LIGHTNING_ENV = Environment(ROOT / ".venv-lightning", "lightning", "lightning")
# The ends of the declared ranges (pyproject.toml). No CPU wheel of these torch releases is reachable from CI (only
# pypi.org is, and its Linux wheels are CUDA builds), so these legs install the CUDA build and run it on the CPU.
NEWEST_ENV = Environment(ROOT / ".venv-newest", "pytorch-lightning", "newest", torch="2.15.0", lightning="2.6.6")
OLDEST_ENV = Environment(ROOT / ".venv-oldest", "pytorch-lightning", "oldest", torch="2.11.0", lightning="2.4.0")
# What the version legs run: the strategies across each other, the resume matrix and the fuzzer's CI examples.
VERSION_LEG_TESTS = (
    "tests/both_packages",
    "tests/test_differential_fuzzer.py",
    # Where Lightning's checkpoint IO differs between releases (weights_only, AsyncCheckpointIO's writer thread).
    "tests/checkpoint/test_security.py",
    "tests/checkpoint/test_async_checkpoint_io.py",
    # The resume matrix's remote cells: checkpoints on the S3 server, resumed by another strategy from the URL.
    "tests/s3/test_remote_resume_matrix.py",
)
VERSION_LEG_TESTS_ENVIRONMENTS = (NEWEST_ENV, OLDEST_ENV)


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


def _step(message: str, *command: str | Path, env: dict[str, str] | None = None) -> str:
    """One line for one step of an environment build; the command's own output only when it fails.

    Returns:
        The command's standard output.
    """
    print(f"{message} ...", end=" ", flush=True)
    started = time.perf_counter()
    result = subprocess.run(
        [str(part) for part in command], cwd=ROOT, capture_output=True, text=True, check=False, env=env
    )
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
    constraints = environment.constraints()
    # A machine-wide pip constraint (this workplace caps torch at the releases on its disk) would refuse another
    # leg's torch; the leg's own constraints file takes its place.
    pip_env = {**os.environ, "PIP_CONSTRAINT": str(constraints)}
    pip = (python, "-m", "pip", "install", "--progress-bar", "off", "-c", constraints)
    _step(f"upgrading pip in {name}", python, "-m", "pip", "install", "--progress-bar", "off", "--upgrade", "pip")
    torch_build = "torch CPU" if environment.pinned else f"torch {environment.torch}, a CUDA build run on the CPU"
    if environment.pinned and environment.lightning_package == "pytorch-lightning":
        _step(
            f"installing pinned packages into {name} (torch CPU, pytorch-lightning, fairscale, test and docs tools)",
            *pip,
            "-e",
            ".[pytorch-lightning,plots,docs,test,zoo,export]",
            env=pip_env,
        )
    elif environment.lightning_package == "pytorch-lightning":  # a version leg: tests/both_packages and the fuzzer
        _step(
            f"installing pinned packages into {name} ({torch_build}, pytorch-lightning {environment.lightning}, "
            "fairscale, test tools)",
            *pip,
            "-e",
            ".[pytorch-lightning,plots,test]",
            env=pip_env,
        )
    else:
        _step(
            f"installing pinned packages into {name} ({torch_build}, fairscale, test tools)",
            *pip,
            "-e",
            ".[plots,test,export]",
            env=pip_env,
        )
        _step(f"installing lightning into {name} (without pytorch-lightning)", *pip, "--no-deps", "lightning")
        listed = _step(f"listing lightning's requirements in {name}", python, "-c", _LIGHTNING_REQUIREMENTS)
        _step(f"installing lightning's requirements into {name}", *pip, *listed.split(), env=pip_env)
    stamp.write_text(digest)


def _pytest(environment: Environment, *arguments: str, other: Environment) -> None:
    """Runs pytest in ``environment``; a failure names the leg. ``other`` is where cross-package tests resume."""
    # Two pytest workers, a test module each at a time: the distributed tests spend much of their time waiting
    # (interpreter start-up, rendezvous, collectives), so two overlap well even on 2 cores (measured 980 s -> 632 s).
    parallel = ("-n", "2", "--dist", "loadscope")
    env = {
        **os.environ,
        "LIGHTNING_STRATEGIES_OTHER_PYTHON": str(other.python),
        "LIGHTNING_STRATEGIES_LEG": environment.leg,
    }
    print(f"+ {environment.describe()}: pytest {' '.join(arguments)}", flush=True)
    result = subprocess.run([str(environment.python), "-m", "pytest", *parallel, *arguments], cwd=ROOT, env=env)
    if result.returncode != 0:
        print(f"FAILED: {environment.describe()}: pytest {' '.join(arguments)}", flush=True)
        sys.exit(result.returncode)


def _build_in_background(environment: Environment) -> subprocess.Popen[bytes]:
    """Builds ``environment`` in a process of its own (``dev.py env NAME``), its output in ``DIRECTORY.log``."""
    log = environment.directory.with_name(environment.directory.name + ".log").open("wb")
    return subprocess.Popen(
        [sys.executable, __file__, "env", environment.leg], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
    )


def _await_build(environment: Environment, build: subprocess.Popen[bytes]) -> None:
    if build.wait() != 0:
        log = environment.directory.with_name(environment.directory.name + ".log")
        sys.stdout.write(log.read_text(errors="replace"))
        print(f"FAILED: building the environment of {environment.describe()} (log: {log.name})", flush=True)
        sys.exit(build.returncode)


LEGS = {environment.leg: environment for environment in (PYTORCH_LIGHTNING_ENV, LIGHTNING_ENV, NEWEST_ENV, OLDEST_ENV)}


def main(argv: list[str]) -> None:
    if argv[:1] == ["env"] and len(argv) == 2 and argv[1] in LEGS:  # used by `test` to build a leg in the background
        _ensure(LEGS[argv[1]])
        return
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
    # The `lightning` leg's environment (which the pinned leg's cross-package tests run too) is built while the
    # checks below run, the version legs' (mostly downloads and unpacking, about 5 GB each) while the pinned leg runs,
    # which waits on its ranks a lot.
    lightning_build = _build_in_background(LIGHTNING_ENV)
    legs = () if rest else VERSION_LEG_TESTS_ENVIRONMENTS
    builds = {environment: _build_in_background(environment) for environment in legs}
    _run(main_env.bin / "ruff", "check", ".")
    _run(main_env.bin / "ruff", "format", "--check", ".")
    _run(main_env.bin / "mypy", "lightning_strategies")
    # Warnings are errors: a broken reference or a docstring autodoc cannot read fails the run.
    _run(main_env.bin / "sphinx-build", "-W", "--keep-going", "-q", "-b", "html", "docs", "docs/_build/html")
    _await_build(LIGHTNING_ENV, lightning_build)
    # Each run names another environment's Python: the cross-package tests save in one and resume in the other.
    # The slowest tests are listed: cut redundant slow cases before adding new ones (the run must stay under 25 min).
    _pytest(main_env, "--durations=15", *rest, other=LIGHTNING_ENV)
    if not rest:
        _pytest(LIGHTNING_ENV, "tests/both_packages", "-m", "not flavour_independent", other=main_env)
        # The ends of the declared ranges resume checkpoints of the pinned `lightning` leg and the other way round.
        for environment, build in builds.items():
            _await_build(environment, build)
            _pytest(environment, *VERSION_LEG_TESTS, other=LIGHTNING_ENV)


if __name__ == "__main__":
    main(sys.argv[1:])
