"""Starts the ranks of a benchmark run as separate processes, the way torchrun would, and waits for them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .config import Config

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def run_workers(
    config: Config, workdir: Path, timeout_s: float, environment: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Runs ``benchmarks.worker`` on ``WORLD_SIZE`` processes (gloo, loopback, one thread each), with
    ``environment`` added to theirs (the store's credentials and endpoint).

    Returns:
        Each rank's ``{"results": ..., "seconds": ...}``.

    Raises:
        RuntimeError: A rank failed or the run took longer than ``timeout_s``.
    """
    config_path = workdir / "config.json"
    config.write(config_path)
    port = _free_port()
    processes = []
    for rank in range(WORLD_SIZE):
        env = {
            **os.environ,
            **(environment or {}),
            "OMP_NUM_THREADS": "1",  # one thread per rank: 2 ranks on 2 cores, no oversubscription
            "MKL_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "WORLD_SIZE": str(WORLD_SIZE),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        command = [sys.executable, "-m", "benchmarks.worker", str(config_path), str(workdir)]
        processes.append(subprocess.Popen(command, cwd=ROOT, env=env))
    deadline = time.monotonic() + timeout_s
    try:
        while any(process.poll() is None for process in processes):
            failed = [rank for rank, process in enumerate(processes) if process.returncode not in (None, 0)]
            if failed:
                raise RuntimeError(f"benchmark rank(s) {failed} failed; see their output above.")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the benchmark ranks did not finish within {timeout_s:.0f} s.")
            time.sleep(0.2)
        codes = [process.returncode for process in processes]
        if any(codes):
            raise RuntimeError(f"benchmark ranks exited with {codes}; see their output above.")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    ranks: list[dict[str, Any]] = json.loads((workdir / "raw.json").read_text())
    return ranks
