"""A forked process that drops the store filesystems it inherited leaves the parent's connections alone: the parent's
next request is answered at once (s3fs's finalizer, run in the child, closed the parent's pooled sockets through the
epoll instance the two share, and the parent's first request after a fork fit waited about 15 s)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
from typing import Any

from lightning_strategies._lightning import reopen_callback_filesystems
from lightning_strategies.checkpoint.remote import open_store
from tests.support.s3_server import S3Server

#: Far above a request on loopback (milliseconds), far below the stall (about 15 s).
ANSWERED_WITHIN_S = 5.0


class HoldsAFilesystem:
    """A callback with a filesystem, as ``ModelCheckpoint(dirpath="s3://...")`` holds one."""

    def __init__(self, filesystem: Any) -> None:
        self._fs = filesystem


class Trainer:
    def __init__(self, callbacks: list[Any]) -> None:
        self.callbacks = callbacks


def _child(url: str, callback: HoldsAFilesystem) -> None:
    reopen_callback_filesystems(Trainer([callback]))  # what a fork launcher's worker does first
    open_store(url).fs.ls(url.removeprefix("s3://"))  # a store request of the child's own
    gc.collect()  # whatever the child no longer holds is finalized now
    os._exit(0)  # as a forked worker ends


def _request_time(callback: HoldsAFilesystem, url: str) -> float:
    done = threading.Event()
    start = time.monotonic()

    def request() -> None:
        callback._fs.ls(url.removeprefix("s3://"), refresh=True)
        done.set()

    threading.Thread(target=request, daemon=True).start()
    done.wait(ANSWERED_WITHIN_S * 4)
    return time.monotonic() - start


def test_the_parents_store_requests_are_answered_after_a_forked_child_drops_its_inherited_filesystems(
    store: S3Server, s3_bucket: str
) -> None:
    url = f"{s3_bucket}/run"
    store.filesystem().pipe_file(f"{url}/a", b"a")
    # fsspec's cached instance, held by the callback only (as a script's ModelCheckpoint holds it), with a pooled
    # connection after its first request.
    callback = HoldsAFilesystem(open_store(url).fs)
    callback._fs.ls(url.removeprefix("s3://"))

    for _ in range(3):
        child = multiprocessing.get_context("fork").Process(target=_child, args=(url, callback))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        assert _request_time(callback, url) < ANSWERED_WITHIN_S
