"""Checkpoints on object stores for the commands: URLs in (``inspect``, ``consolidate``, ``export``), URLs out
(``consolidate``, ``export``), and ``clean``, which removes the uncommitted leftovers of killed saves.

A URL in is read as the strategies read it (``checkpoint.remote``): its newest committed save (or its full object),
downloaded into a local scratch directory that the command reads like any local checkpoint. A URL out is written
locally first and uploaded once complete; a full file on a store appears only once its upload completed.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from lightning_strategies.checkpoint.errors import StoreError
from lightning_strategies.checkpoint.remote import (
    PROBE_BLOCK_SIZE,
    Store,
    download_save,
    list_store,
    open_store,
    remove_leftovers,
)
from lightning_strategies.checkpoint.targets import is_checkpoint_stream, is_url

from ._common import UsageError


@dataclass
class Input:
    """A command's checkpoint, local (a stored one: its local copy).

    Attributes:
        path: Where the command reads it.
        name: How the command names it (the URL, for a stored one).
        leftovers: The URLs of uncommitted leftovers beside it (saves that never finished), for ``inspect``.
        older_saves: The URLs of older committed saves kept beside it (the one a run resumed from).
    """

    path: Path
    name: str
    leftovers: list[str] = field(default_factory=list)
    older_saves: list[str] = field(default_factory=list)


def _store(url: str) -> Store:
    try:
        return open_store(url)
    except StoreError as error:
        raise UsageError(str(error)) from error


@contextmanager
def checkpoint_input(given: str) -> Iterator[Input]:
    """The checkpoint ``given`` names, local: a local path as it is, a URL's newest committed save (or full object)
    downloaded into a scratch directory removed on exit.

    Raises:
        UsageError: The URL holds no committed checkpoint, or its store cannot be reached.
    """
    if not is_url(given):
        yield Input(Path(given), given)
        return
    store = _store(given)
    listing = list_store(store)
    leftovers = [store.url_of(save_id) + "/" for save_id in listing.leftovers]
    older = [store.url_of(save.save_id) + "/" for save in listing.committed[1:]]
    scratch = Path(tempfile.mkdtemp(prefix="lightning-strategies-cli-"))
    try:
        local = scratch / (Path(store.path).name or "checkpoint")
        if listing.sharded_is_newest:
            save = listing.committed[0]
            yield Input(download_save(store, save, local), f"{store.url} (save {save.save_id})", leftovers, older)
        elif listing.full_file_at is not None:
            store.fs.get_file(store.path, str(local))
            yield Input(local, store.url, leftovers, older)
        else:
            detail = f" ({len(listing.leftovers)} uncommitted leftover(s) only)" if listing.leftovers else ""
            raise UsageError(f"{given!r} holds no committed checkpoint{detail}.")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def output(given: str, *, force: bool, directory: bool = False) -> Iterator[Path]:
    """Where a command writes ``given``: a local path as it is; for a URL a local scratch path, uploaded to the URL
    once the command wrote it (a file as one object; a directory's files under the URL).

    Raises:
        UsageError: The URL holds an object and ``force`` is not set, or one that is not a checkpoint.
    """
    if not is_url(given):
        yield Path(given)
        return
    store = _store(given)
    listing = list_store(store)
    if listing.full_file_at is not None:
        if not force:
            raise UsageError(f"OUT {given!r} exists; pass --force to replace it, or choose another URL.")
        with store.fs.open(store.path, "rb", block_size=PROBE_BLOCK_SIZE) as file:
            if not is_checkpoint_stream(file):
                raise UsageError(f"OUT {given!r} exists and is not a checkpoint, so --force does not replace it.")
    if directory and (listing.foreign or listing.committed) and not force:
        raise UsageError(f"OUT {given!r} holds objects; pass --force to write beside them, or choose another URL.")
    scratch = Path(tempfile.mkdtemp(prefix="lightning-strategies-cli-"))
    try:
        local = scratch / (Path(store.path).name or "out")
        yield local
        files = sorted(local.iterdir()) if directory else [local]
        for file in files:
            target = store.key(file.name) if directory else store.path
            store.fs.put_file(str(file), target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def clean(given: str, older_than: timedelta) -> list[str]:
    """Removes the uncommitted leftovers at the URL ``given`` older than ``older_than``; returns their URLs.

    Raises:
        UsageError: ``given`` is not a URL (local saves leave hidden staging directories, which the next save of the
            path removes), or its store cannot be reached.
    """
    if not is_url(given):
        raise UsageError(
            f"{given!r} is a local path: a killed local save leaves only a hidden staging directory beside it, which"
            " the next save of that path removes. `clean` takes a checkpoint URL (s3://...)."
        )
    store = _store(given)
    removed = remove_leftovers(store, datetime.now(UTC) - older_than)
    return [store.url_of(save_id) + "/" for save_id in removed]
