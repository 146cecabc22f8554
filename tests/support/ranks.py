"""Runs a function on forked processes started the way ``torchrun`` starts ranks, for strategies without a launcher.

Upstream Lightning's ``ModelParallelStrategy`` launches only by running the script again per rank; with ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE`` set every strategy takes its processes as started from outside and launches
nothing, so ours and upstream's run the same way here, each rank a fork of the test process (no interpreter start).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from tests.conftest import free_loopback_port


def _rank_main(connection: Connection, rank: int, world_size: int, port: int, function: Callable[[], Any]) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
    )
    try:
        result: tuple[bool, Any] = (True, function())
    except BaseException:  # the rank's own traceback, for the test's failure message
        result = (False, traceback.format_exc())
    connection.send(result)
    connection.close()
    # Straight out: the process group and the Trainer die with the process (no teardown that could wait on a peer).
    os._exit(0 if result[0] else 1)


def run_as_ranks(function: Callable[[], Any], world_size: int = 2, timeout: float = 120.0) -> list[Any]:
    """Runs ``function`` on ``world_size`` forked ranks and returns what each returned, in rank order.

    Raises:
        RuntimeError: A rank raised (its traceback is in the message) or died.
        TimeoutError: The ranks did not all finish within ``timeout`` seconds (they are killed).
    """
    context = multiprocessing.get_context("fork")
    port = free_loopback_port()
    pipes = [context.Pipe(duplex=False) for _ in range(world_size)]
    processes = [
        context.Process(target=_rank_main, args=(sender, rank, world_size, port, function), daemon=True)
        for rank, (_, sender) in enumerate(pipes)
    ]
    for process in processes:
        process.start()
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            for rank, (receiver, _) in enumerate(pipes):
                if rank not in results and receiver.poll(0.05):
                    results[rank] = receiver.recv()
            if any(not ok for ok, _ in results.values()):
                time.sleep(1.0)  # give the other ranks a moment to report their own error
                break
            dead = [r for r, p in enumerate(processes) if r not in results and p.exitcode is not None]
            if dead and not any(pipes[r][0].poll() for r in dead):
                raise RuntimeError(
                    f"rank(s) {dead} died without a result (exit codes {[processes[r].exitcode for r in dead]})"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {timeout} s"
                )
    finally:
        killed = {rank for rank, process in enumerate(processes) if process.is_alive()}
        for rank in killed:
            processes[rank].kill()
        for process in processes:
            process.join(timeout=10)
    failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(results.items()) if not ok]
    # A rank that crashed (a signal) says nothing itself; its peers then report lost connections.
    crashed = [
        f"rank {rank} died of {signal.Signals(-process.exitcode).name}"
        for rank, process in enumerate(processes)
        if rank not in results and rank not in killed and process.exitcode is not None and process.exitcode < 0
    ]
    failures = crashed + failures
    if failures:
        raise RuntimeError("\n".join(failures))
    return [results[rank][1] for rank in range(world_size)]


def on_ranks(function: Callable[[], Any]) -> Any:
    """:func:`run_as_ranks` on two ranks, returning rank 0's result: the conformance kit's ``launch``."""
    return run_as_ranks(function)[0]
