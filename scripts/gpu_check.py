"""The GPU check, run on a lent GPU machine by the one command that ``scripts/gpu_prepare.py`` prints.

Runs, within ``--budget`` seconds (the GPU steps in this order, the most telling first, each in its own processes with
a time limit of its own):

1. ``cuda-tests``: ``tests/gpu`` but the zoo (every strategy at world size 1 on ``cuda:0`` with NCCL: fit, save,
   resume under every other strategy exactly; ``16-mixed`` and ``bf16-mixed``; CPU offload);
2. ``zoo``: ``tests/gpu/test_zoo_cuda.py`` (GPT-2 and ResNet from ``tests/zoo`` on CUDA; skipped without the zoo);
3. ``memory``: ``scripts/gpu_memory.py`` for ``ddp``, ``ddp_sharded``, ``fsdp_fairscale`` and ``fsdp2``;
4. ``cpu-suite``: the whole CPU suite with CUDA hidden (``CUDA_VISIBLE_DEVICES=""``), the torch leg of that machine's
   torch version, one test file per ``pytest-xdist`` worker, each test body in a fork of its own
   (``LIGHTNING_STRATEGIES_FORK_ISOLATION=1``: a CUDA build refuses forks of a process that ran backward, and the
   suite forks its ranks; see ``tests/support/fork_safety.py``); it runs beside steps 1-3 from the start, on the CPU
   cores they leave, until the budget ends.

Writes ``report.json`` (versions, each step's outcome and failures, the memory figures) and one log per step into
``--out``. Exit code 0 when every step passed. ``--rehearse`` runs the same steps on the CPU (the CUDA tests through
``LIGHTNING_STRATEGIES_GPU_REHEARSAL=1``) to check this script and the tests' logic where no GPU is lent.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MEMORY_STRATEGIES = ("ddp", "ddp_sharded", "fsdp_fairscale", "fsdp2")
ZOO_TESTS = "tests/gpu/test_zoo_cuda.py"
#: Share of the budget each GPU step may take at most (200, 100 and 80 s of the default 480); a step that ends early
#: leaves its time to the next. The CPU suite runs beside them until the budget ends.
STEP_SHARES = {"cuda-tests": 200 / 480, "zoo": 100 / 480, "memory": 80 / 480}
VERSIONS_OF = ("torch", "pytorch-lightning", "lightning", "lightning-utilities", "fairscale", "transformers")
VERSIONS_OF += ("huggingface-hub", "tokenizers", "pytest", "pytest-xdist", "hypothesis", "numpy")
LOG_TAIL = 3000


def _versions() -> dict[str, Any]:
    import torch

    found: dict[str, Any] = {"python": platform.python_version(), "torch_cuda": torch.version.cuda}
    for name in VERSIONS_OF:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    found["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    found["gpus"] = torch.cuda.device_count()
    found["nccl"] = str(torch.cuda.nccl.version()) if torch.cuda.is_available() else None
    return found


class _Running:
    """A command started with its output in ``log``, to be waited for until a deadline."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self.started = time.monotonic()
        self._handle = log.open("w")
        self._handle.write("$ " + " ".join(command) + "\n")
        self._handle.flush()
        self._process = subprocess.Popen(command, cwd=ROOT, stdout=self._handle, stderr=subprocess.STDOUT, env=env)

    def wait(self, limit: float) -> tuple[int | None, float]:
        """The exit code (``None`` when it ran past ``limit`` more seconds and was killed) and the seconds it ran."""
        try:
            code: int | None = self._process.wait(timeout=max(limit, 1.0))
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
            code = None
        self._handle.close()
        return code, round(time.monotonic() - self.started, 1)


def _run(command: list[str], log: Path, limit: float, env: dict[str, str]) -> tuple[int | None, float]:
    """Runs ``command`` with its output in ``log``; ``None`` as exit code when it ran past ``limit`` seconds."""
    return _Running(command, log, env).wait(limit)


def _junit(path: Path) -> dict[str, Any]:
    """Counts and failed test ids from pytest's JUnit XML (absent when pytest was killed)."""
    if not path.exists():
        return {}
    root = ElementTree.parse(path).getroot()
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[dict[str, str]] = []
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    for case in root.iter("testcase"):
        for outcome in ("failure", "error"):
            found = case.find(outcome)
            if found is not None:
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                failed.append({"test": name, "outcome": outcome, "message": (found.get("message") or "")[:500]})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed}


def _tail(log: Path) -> str:
    text = log.read_text(errors="replace")
    return text[-LOG_TAIL:]


def _pytest_command(arguments: list[str], junit: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", *arguments, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]


def _pytest_result(code: int | None, seconds: float, junit: Path, log: Path) -> dict[str, Any]:
    results = _junit(junit)
    # pytest exit codes: 0 all passed, 1 some failed, 5 no test collected.
    status = "timed out" if code is None else {0: "passed", 5: "nothing ran"}.get(code, "failed")
    if status in ("passed", "nothing ran") and results.get("skipped") and not results.get("passed"):
        status = "all skipped"  # e.g. a module skipped whole at collection (pytest's exit code 5)
    return {"status": status, "exit_code": code, "seconds": seconds, **results, "log_tail": _tail(log)}


def _pytest_step(name: str, arguments: list[str], out: Path, limit: float, env: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        junit = Path(scratch) / "junit.xml"
        code, seconds = _run(_pytest_command(arguments, junit), out / f"{name}.log", limit, env)
        return _pytest_result(code, seconds, junit, out / f"{name}.log")


def _memory_step(out: Path, limit: float, env: dict[str, str], rehearse: bool) -> dict[str, Any]:
    started = time.monotonic()
    figures: list[dict[str, Any]] = []
    failures: list[str] = []
    log = out / "memory.log"
    log.write_text("")
    for strategy in MEMORY_STRATEGIES:
        left = limit - (time.monotonic() - started)
        command = [sys.executable, "scripts/gpu_memory.py", strategy]
        if rehearse:
            command += ["--rehearse", "--width", "256", "--layers", "2"]
        part = out / f"memory-{strategy}.log"
        code, _ = _run(command, part, left, env)
        text = part.read_text(errors="replace")
        part.unlink()
        with log.open("a") as handle:
            handle.write(text)
        lines = [line for line in text.splitlines() if line.startswith("{")]
        if code == 0 and lines:
            figures.append(json.loads(lines[-1]))
        else:
            failures.append(f"{strategy}: {'timed out' if code is None else f'exit code {code}'}")
    status = "passed" if not failures else "failed"
    seconds = round(time.monotonic() - started, 1)
    return {"status": status, "seconds": seconds, "failed": failures, "figures": figures, "log_tail": _tail(log)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where report.json and the logs go")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all steps together (default 480)")
    parser.add_argument("--rehearse", action="store_true", help="on the CPU: checks this script, not CUDA")
    parser.add_argument(
        "--cpu-suite", nargs="*", default=["tests", "--ignore=tests/gpu"], help="pytest arguments of the CPU suite"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath()}
    if args.rehearse:
        env["LIGHTNING_STRATEGIES_GPU_REHEARSAL"] = "1"
    report: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "rehearsal": args.rehearse,
        "budget_s": args.budget,
        "versions": _versions(),
        "steps": {},
    }
    steps = report["steps"]

    def left(step: str | None = None) -> float:
        remaining = args.budget - (time.monotonic() - started)
        return min(STEP_SHARES[step] * args.budget, remaining) if step is not None else remaining

    def save() -> None:
        (args.out / "report.json").write_text(json.dumps(report, indent=2))

    # The CPU suite (CUDA hidden) runs beside the GPU steps, on the cores they leave: most of the budget for both.
    # Each test body in its own fork, whatever the probe of that machine says: the ranks a test forks then come from a
    # process that never ran backward (the first GPU run failed 373 tests on such forks).
    cpu_env = {**env, "CUDA_VISIBLE_DEVICES": "", "LIGHTNING_STRATEGIES_FORK_ISOLATION": "1"}
    cpu_env.pop("LIGHTNING_STRATEGIES_GPU_REHEARSAL", None)
    workers = max(1, min(8, (os.cpu_count() or 1) - 4))
    parallel = ["-n", str(workers), "--dist", "loadfile"] if _has("xdist") and workers > 1 else []
    scratch = tempfile.TemporaryDirectory()
    cpu_junit = Path(scratch.name) / "junit.xml"
    cpu_log = args.out / "cpu-suite.log"
    cpu_suite = _Running(_pytest_command([*args.cpu_suite, *parallel], cpu_junit), cpu_log, cpu_env)

    gpu_tests = ["tests/gpu", f"--ignore={ZOO_TESTS}"]
    steps["cuda-tests"] = _pytest_step("cuda-tests", gpu_tests, args.out, left("cuda-tests"), env)
    save()
    steps["zoo"] = _pytest_step("zoo", [ZOO_TESTS, "-rs"], args.out, left("zoo"), env)
    save()
    steps["memory"] = _memory_step(args.out, left("memory"), env, args.rehearse)
    save()
    code, seconds = cpu_suite.wait(left() - 5)
    steps["cpu-suite"] = {**_pytest_result(code, seconds, cpu_junit, cpu_log), "workers": workers if parallel else 1}
    scratch.cleanup()
    report["seconds"] = round(time.monotonic() - started, 1)
    report["passed"] = all(step["status"] in ("passed", "all skipped") for step in steps.values())
    save()
    for name, step in steps.items():
        counts = "" if "tests" not in step else f" ({step['passed']} passed, {len(step['failed'])} failed)"
        print(f"{name}: {step['status']}{counts} in {step['seconds']} s")
    for figure in steps["memory"]["figures"]:
        print(json.dumps(figure))
    return 0 if report["passed"] else 1


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _pythonpath() -> str:
    # The checkout first (its tests import `tests.*` and this tree's package), then what was there (carried wheels).
    return os.pathsep.join(part for part in (str(ROOT), os.environ.get("PYTHONPATH", "")) if part)


if __name__ == "__main__":
    raise SystemExit(main())
