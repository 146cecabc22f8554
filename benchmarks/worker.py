"""One rank of a benchmark run: ``python -m benchmarks.worker CONFIG WORKDIR`` with torchrun-style variables set.

Every rank runs the same benchmarks in the same order; rank 0 writes ``WORKDIR/raw.json`` with each rank's results.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import async_save, memory, overhead, resume, save, scaling, store
from .config import STORE_BENCHMARK, Config

SUITES: dict[str, Callable[[Config, Path], dict[str, Any]]] = {
    "overhead": overhead.run,
    "save": save.run,
    "resume": resume.run,
    "memory": memory.run,
    "scaling": scaling.run,
    "async_save": async_save.run,
    STORE_BENCHMARK: store.run,
}


def _quiet() -> None:
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)  # fairscale logs through the root logger
    warnings.filterwarnings("ignore")


def main(argv: list[str]) -> None:
    config = Config.read(Path(argv[0]))
    workdir = Path(argv[1])
    _quiet()
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=10))
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for name in config.benchmarks:
        start = time.perf_counter()
        results[name] = SUITES[name](config, workdir)
        seconds[name] = time.perf_counter() - start
        if rank == 0:
            print(f"[benchmarks] {name} done in {seconds[name]:.1f} s", file=sys.stderr, flush=True)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, {"results": results, "seconds": seconds})
    if rank == 0:
        (workdir / "raw.json").write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
