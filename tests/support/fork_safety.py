"""Whether a process that ran a backward pass may fork ranks that run one, and what the suite does where it may not.

The suite starts most of its 2-process fits by forking the test process (0.15 s a fit instead of an interpreter
start). With torch's CPU wheel that is always safe. A CUDA build of torch on a machine with a GPU starts autograd's
device threads at the first backward pass, and a fork of such a process cannot run backward ("Unable to handle
autograd's threading in combination with fork-based multiprocessing") or aborts: the lent GPU machine's CPU suite
failed that way (docs/gpu.md). What decides it is the capability, not a version or a build tag, so it is probed:
a fresh interpreter runs a backward pass through ``fully_shard``, forks, and the child runs one
(:func:`fork_after_backward_works`). On a machine without a GPU, CUDA builds of torch 2.11 and 2.15 fail it too.

Where the probe fails, every test body runs in a fork of the pytest process taken before the body runs
(:func:`run_in_fork`; a test whose fixtures started a process group runs in the pytest process, since the group's
threads would not be in the fork): the pytest process itself never runs backward, so each test forks its ranks from
a process that has not either, and a test's own in-process training cannot break the forks of later tests. A test
that trains in its own process *and then* forks ranks needs a fresh process for those ranks (``spawn`` or a
subprocess) on such machines; ``LIGHTNING_STRATEGIES_EMULATE_BAD_FORK=1`` makes this CPU machine refuse such forks
the way a CUDA build does (:func:`emulate_bad_fork`), so those tests are found here, not on the lent GPU.

Environment variables:
    ``LIGHTNING_STRATEGIES_FORK_ISOLATION``: ``1`` runs every test body in its own fork, ``0`` never; unset, the
        probe decides.
    ``LIGHTNING_STRATEGIES_EMULATE_BAD_FORK``: ``1`` emulates a CUDA build's refusal (and isolates test bodies).
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

ISOLATION_VARIABLE = "LIGHTNING_STRATEGIES_FORK_ISOLATION"
EMULATION_VARIABLE = "LIGHTNING_STRATEGIES_EMULATE_BAD_FORK"
_PROBED_VARIABLE = "LIGHTNING_STRATEGIES_FORK_AFTER_BACKWARD"  # the probe's answer, inherited by pytest-xdist workers

#: The probe: exit code 0 where a fork of a process that ran backward can run backward itself. The backward runs
#: through ``fully_shard`` on a one-process gloo group: a plain backward does not start the threads on a machine
#: without a GPU, but FSDP2's does on CUDA builds (seen with torch 2.11 and 2.15, not with the CPU wheel of 2.13).
PROBE = """
import os, socket, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
fully_shard(torch.nn.Linear(2, 2))(torch.ones(1, 2)).sum().backward()
dist.destroy_process_group()
child = os.fork()
if child == 0:
    try:
        torch.ones(2, requires_grad=True).sum().backward()
    except BaseException:
        os._exit(3)
    os._exit(0)
_, status = os.waitpid(child, 0)
sys.exit(0 if os.waitstatus_to_exitcode(status) == 0 else 1)
"""

BAD_FORK_MESSAGE = (
    "Unable to handle autograd's threading in combination with fork-based multiprocessing"
    " (emulated by LIGHTNING_STRATEGIES_EMULATE_BAD_FORK=1: this process is a fork of one that ran backward)"
)


def emulating() -> bool:
    return os.environ.get(EMULATION_VARIABLE) == "1"


def fork_after_backward_works() -> bool:
    """Whether this machine's torch lets a fork of a process that ran backward run backward (probed once; the answer
    is kept in the environment for the pytest-xdist workers)."""
    if emulating():
        return False
    known = os.environ.get(_PROBED_VARIABLE)
    if known is None:
        probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, timeout=120, check=False)
        known = "1" if probe.returncode == 0 else "0"
        os.environ[_PROBED_VARIABLE] = known
    return known == "1"


def isolating_test_bodies() -> bool:
    """Whether each test body runs in its own fork of the pytest process (see the module docstring)."""
    chosen = os.environ.get(ISOLATION_VARIABLE)
    if chosen in ("0", "1"):
        return chosen == "1"
    return not fork_after_backward_works()


class _ForkState:
    ran_backward = False  # this process ran backward (then its forks are refused)
    refused = False  # this process is a fork of one that had


def _after_fork_in_child() -> None:
    _ForkState.refused = _ForkState.refused or _ForkState.ran_backward


def _refusing(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        if _ForkState.refused:
            raise RuntimeError(BAD_FORK_MESSAGE)
        _ForkState.ran_backward = True
        return original(*args, **kwargs)

    return backward


def emulate_bad_fork() -> None:
    """Makes backward in a fork of a process that ran backward raise, as on a CUDA build with a GPU (test sessions
    with ``LIGHTNING_STRATEGIES_EMULATE_BAD_FORK=1`` only: torch's ``backward`` and ``grad`` are wrapped for the
    session; spawned processes and subprocesses start without the wrapping, as they start without the threads)."""
    torch.autograd.backward = _refusing(torch.autograd.backward)  # Tensor.backward looks it up at each call
    torch.autograd.grad = _refusing(torch.autograd.grad)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def run_in_fork(item: pytest.Function) -> bool:
    """Runs ``item``'s test function in a fork of this process and reports its outcome here (``pytest_pyfunc_call``).

    Fixtures were set up here; what the body records with ``record_property`` comes back. Skips and expected
    failures inside the body keep their meaning.
    """
    arguments = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # the test body; never returns
        os.close(reader)
        outcome: tuple[str, str, list[tuple[str, object]]]
        try:
            item.obj(**arguments)
            outcome = ("passed", "", [])
        except pytest.skip.Exception as skipped:
            outcome = ("skipped", str(skipped), [])
        except pytest.xfail.Exception as expected:
            outcome = ("xfailed", str(expected), [])
        except BaseException:
            outcome = ("failed", traceback.format_exc(), [])
        properties = [(name, value) for name, value in item.user_properties if _picklable(value)]
        with os.fdopen(writer, "wb") as pipe:
            pipe.write(pickle.dumps((outcome[0], outcome[1], properties)))
        os._exit(0)
    os.close(writer)
    try:
        with os.fdopen(reader, "rb") as pipe:
            report = pipe.read()
    except BaseException:  # a timeout (pytest-timeout raises here) or an interrupt: the body must not run on
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        raise
    _, status = os.waitpid(child, 0)
    if not report:
        raise pytest.fail.Exception(
            f"the test body died in its fork (exit code {os.waitstatus_to_exitcode(status)}) without a result",
            pytrace=False,
        )
    kind, text, properties = pickle.loads(report)
    item.user_properties.extend(properties)
    if kind == "skipped":
        pytest.skip(text)
    if kind == "xfailed":
        pytest.xfail(text)
    if kind == "failed":
        pytest.fail(f"in the test body's fork ({ISOLATION_VARIABLE}):\n{text}", pytrace=False)
    return True


def _picklable(value: object) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True
