"""Shared setup for distributed tests: loopback only, a fresh port per test, quiet Lightning output."""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import json
import logging
import multiprocessing
import os
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lightning_strategies  # noqa: F401  (registers the strategy names)
from tests.support import fork_safety

# One thread in this process and in every worker (OMP_NUM_THREADS is set in tests/__init__.py, before torch loads):
# set_num_threads only where something loaded torch first, since it also creates torch's pthreadpool, whose threads a
# fork of this process would not have (torch 2.11's CUDA build then aborts in the forked ranks' autograd threads:
# "Invalid thread pool!").
if torch.get_num_threads() != 1:
    torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    if fork_safety.emulating():
        fork_safety.emulate_bad_fork()
    # Probed once here, before pytest-xdist starts its workers: they inherit the answer (tests/support/fork_safety.py).
    config.stash[_ISOLATING] = fork_safety.isolating_test_bodies()


_ISOLATING = pytest.StashKey[bool]()


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Which leg of ``dev.py test`` runs (a failure names it), the versions it runs on, and how test bodies run."""
    versions = [f"torch {torch.__version__}"]
    for distribution in ("pytorch-lightning", "lightning"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{distribution} {importlib.metadata.version(distribution)}")
    leg = os.environ.get("LIGHTNING_STRATEGIES_LEG", "(none: pytest run by hand)")
    bodies = "each test body in its own fork" if config.stash[_ISOLATING] else "test bodies in the pytest process"
    return [f"lightning_strategies leg {leg}: {', '.join(versions)}; {bodies}"]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    # A process group its fixtures started stays with this process: its threads would not be in a fork.
    if pyfuncitem.config.stash[_ISOLATING] and not (dist.is_available() and dist.is_initialized()):
        return fork_safety.run_in_fork(pyfuncitem)
    return None


def write_json(path: Path, value: Any) -> None:
    """Writes ``value`` as JSON to ``path`` atomically: a rank stopped mid-write (the first rank to fail stops the
    others) leaves no empty or half-written file for the test to read."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(value))
    os.replace(partial, path)


def free_loopback_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(autouse=True)
def loopback_rendezvous(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Every process group of a test meets on 127.0.0.1 at a port picked for that test; gloo stays on loopback."""
    port = free_loopback_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    yield port


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """A run in the test process (one device) leaves its process group and sets LOCAL_RANK, NODE_RANK, ...;
    forked workers of later tests would inherit them and take the processes as launched from outside."""
    environment = dict(os.environ)
    yield
    if os.environ.get("LOCAL_RANK") != environment.get("LOCAL_RANK"):  # a run in this process, not in workers
        # Its objects that hold the process group in reference cycles (wrappers, sharded optimizers) are collected
        # here, where the group's gloo threads live: a forked worker of a later test that inherited them would run
        # the group's destructor itself, join threads it does not have, and hang. (Only then: a full collection
        # takes about a second.)
        gc.collect()
    # Workers of a failed run may outlive it (stuck in a collective with a dead peer): they would hold the port and
    # block the interpreter's exit, which joins every child.
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


@pytest.fixture(autouse=True, scope="session")
def quiet_lightning() -> None:
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)  # fairscale logs through the root logger
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*dirpath has changed.*")
    warnings.filterwarnings("ignore", message=".*DistributedSampler.*")


MATRIX_PROPERTY = "resume matrix"  # tests record their tables under this name; shown at the end of the run


def pytest_terminal_summary(terminalreporter: Any) -> None:
    # Recorded properties travel with each test's report, also from pytest-xdist's workers.
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        for name, table in getattr(report, "user_properties", []):
            if name == MATRIX_PROPERTY and report.when == "call":
                terminalreporter.write_sep("-", f"resume matrix: {report.nodeid.rsplit('::', 1)[-1]}")
                terminalreporter.write_line(str(table))


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """Trainer arguments for fast, quiet CPU runs; tests override what they are about."""
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "max_epochs": 2,
    }
    kwargs.update(overrides)
    return kwargs
