"""Runs a one-process fit in a fork of this process, so that this process never runs backward itself.

A CUDA build of torch refuses backward in a fork of a process that already ran one ("Unable to handle autograd's
threading in combination with fork-based multiprocessing"; docs/gpu.md). The resume matrix and the conformance kit
fork the ranks of their multi-process strategies from the calling process; a one-process strategy that trained right
there first would break every fork after it. Training it in a child keeps the caller clean on every build of torch,
for the cost of one fork (milliseconds).
"""

from __future__ import annotations

import json
import os
import signal
import traceback
from collections.abc import Callable
from typing import Any


class ChildProcessError(RuntimeError):
    """The function raised in the child; the message is the child's traceback, its last line the original error."""


def in_a_child_process(function: Callable[[], Any]) -> Any:
    """Runs ``function`` in a fork of this process and returns its result here.

    Matches :data:`~lightning_strategies.testing.Launch`, so a one-process ``MatrixStrategy`` or ``check_strategy``
    run takes it as ``launch=``.

    Args:
        function: What to run; called with no arguments in the child. It need not be picklable (a fork inherits it).

    Returns:
        What ``function`` returned in the child: a value JSON can carry (``None``, numbers, strings, lists, dicts);
        the package unpickles nothing, so the result comes back as JSON.

    Raises:
        ChildProcessError: ``function`` raised in the child (the message carries its traceback), or the child died
            without a result (its exit code is named).
    """
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # never returns: the child must not run the parent's atexit handlers or test teardown
        os.close(reader)
        try:
            payload = json.dumps([True, function()])
        except BaseException:  # the function's error, or a result JSON cannot carry
            payload = json.dumps([False, traceback.format_exc().strip()])
        with os.fdopen(writer, "w") as pipe:
            pipe.write(payload)
        os._exit(0)
    os.close(writer)
    try:
        with os.fdopen(reader, "r") as pipe:
            report = pipe.read()
    except BaseException:  # interrupted or timed out here: the child must not train on unattended
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        raise
    _, status = os.waitpid(child, 0)
    if not report:
        raise ChildProcessError(
            f"the child process died without a result (exit code {os.waitstatus_to_exitcode(status)})"
        )
    succeeded, value = json.loads(report)
    if not succeeded:
        raise ChildProcessError(value)
    return value
