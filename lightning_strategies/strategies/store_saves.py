"""Saves to an object store URL and restores from one, for every strategy (the layout: ``checkpoint.remote``).

A sharded save to a URL is the local flow with the store in place of the rename: every rank writes its shards into a
local scratch directory exactly as it would locally (so each format's writer is the same), uploads them under the
save's fresh prefix, and rank 0 writes the commit marker once every rank's upload is done (the ranks' results ride
in one all-gather, so a failed upload is raised on every rank and the save stays uncommitted). A restore downloads
the newest committed save into a local scratch directory and reads it through the one safe reader, as a local
directory.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_strategies.checkpoint.errors import StoreError
from lightning_strategies.checkpoint.metadata import CheckpointMetadata
from lightning_strategies.checkpoint.remote import (
    COMMIT_SUFFIX,
    CommittedSave,
    Store,
    commit_save,
    download_save,
    list_store,
    open_store,
    remove_full_file,
    remove_saves,
    replace_problem_on_store,
    saved_files,
    store_problem,
    upload_save_files,
)
from lightning_strategies.checkpoint.sharded import new_save_id, write_sharded_meta
from lightning_strategies.checkpoint.targets import SaveRefusal, is_url

from .._lightning import CheckpointIO, find_last_checkpoints_as_urls, pl
from .agreement import agree_on_sharded_save, gather_uploads
from .atomic_io import finish_background_writes

if TYPE_CHECKING:
    from .checkpointing import CheckpointFlow

_MARKER_URL = re.compile(r"^(?P<checkpoint>.+)/(?P<save_id>[0-9a-f]{32})" + re.escape(COMMIT_SUFFIX) + r"$")


def store_refusal(url: str, storage_options: dict[str, Any] | None, sharded: bool) -> SaveRefusal | None:
    """On rank 0, before a save to ``url`` writes anything: why it must not (the store cannot be reached, or the URL
    holds objects no checkpoint writer wrote), or ``None``. Raised on every rank by the save's agreement."""
    try:
        store = open_store(url, storage_options)
        problem = store_problem(store)
        if problem is not None:
            return ("store", problem)
        foreign = replace_problem_on_store(store, sharded)
    except StoreError as error:
        return ("store", str(error))
    return None if foreign is None else ("foreign path", foreign)


def save_sharded_to_store(
    flow: CheckpointFlow,
    checkpoint: dict[str, Any],
    url: str,
    write_shards: Callable[[Path, str], None],
    *,
    storage_options: dict[str, Any] | None,
    refusal: SaveRefusal | None,
    keep: set[str],
) -> None:
    """Writes a sharded checkpoint to ``url``: complete (committed) or absent, the previous save kept until then.

    Args:
        flow: The saving strategy.
        checkpoint: What Lightning dumped; its state entries are the ranks' shards.
        url: The checkpoint URL.
        write_shards: Writes this rank's shards into the local directory it is given, stamped with the save id.
        storage_options: The fsspec options of the store (credentials, endpoint), or ``None``.
        refusal: Rank 0's refusal of the URL (:func:`store_refusal`), raised on every rank.
        keep: Save ids never removed at ``url`` (the save the run resumed from).

    Raises:
        StoreError: The store could not be reached, or a rank's upload failed (raised on every rank).
    """
    store = open_store(url, storage_options)
    save_id = agree_on_sharded_save(url, new_save_id(), refusal)
    scratch = Path(tempfile.mkdtemp(prefix="lightning-strategies-upload-"))
    try:
        write_shards(scratch, save_id)
        finish_background_writes(flow.checkpoint_io)
        if flow.is_global_zero:
            meta_io = flow.sharded_checkpoint_io
            write_sharded_meta(meta_io, checkpoint, flow.checkpoint_metadata(), scratch, save_id)
            finish_background_writes(meta_io)
        try:
            uploaded: dict[str, int] | str = upload_save_files(store, save_id, scratch)
        except Exception as error:  # every rank learns of it in the gather below
            uploaded = f"{type(error).__name__}: {error}"
        files = gather_uploads(uploaded)
        if flow.is_global_zero:
            commit_store_save(store, save_id, files, keep)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    flow.barrier("sharded checkpoint committed")


def commit_store_save(store: Store, save_id: str, files: dict[str, int], keep: set[str]) -> None:
    """Commits a save whose files are all uploaded, then removes what it replaces: a full object at the URL, older
    saves and uncommitted leftovers (never those in ``keep``)."""
    commit_save(store, save_id, files)
    remove_full_file(store)
    remove_saves(store, keep={save_id, *keep})


def split_marker_url(path: str) -> tuple[str, str | None]:
    """``(checkpoint URL, save id)`` of a commit marker's URL (how ``ckpt_path="last"`` names a sharded save on a
    store); ``(path, None)`` for any other path."""
    match = _MARKER_URL.match(str(path))
    return (match["checkpoint"], match["save_id"]) if match else (str(path), None)


def resolve_on_store(path: str) -> tuple[Store, CommittedSave] | None:
    """The committed sharded save a restore from the URL ``path`` reads, or ``None`` when the URL holds a full file
    (or nothing: the full loader then names what is missing).

    Raises:
        FileNotFoundError: ``path`` names a commit marker that is not there.
        StoreError: The store cannot be reached.
    """
    url, save_id = split_marker_url(path)
    store = open_store(url)
    listing = list_store(store)
    if save_id is not None:
        chosen = next((save for save in listing.committed if save.save_id == save_id), None)
        if chosen is None:
            raise FileNotFoundError(f"Checkpoint {path!r}: save {save_id} of {url!r} is not committed there.")
        return store, chosen
    return (store, listing.committed[0]) if listing.sharded_is_newest else None


class Downloads:
    """The local copies of stored sharded saves a restore reads; removed once the restore is done."""

    def __init__(self) -> None:
        self._scratch: list[Path] = []

    def fetch(self, store: Store, save: CommittedSave) -> Path:
        """Downloads ``save`` of ``store`` into a new local directory and returns it."""
        scratch = Path(tempfile.mkdtemp(prefix="lightning-strategies-download-"))
        self._scratch.append(scratch)
        return download_save(store, save, scratch / (Path(store.path).name or "checkpoint"))

    def clear(self) -> None:
        """Removes every local copy."""
        for scratch in self._scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        self._scratch.clear()


def last_checkpoints_with_urls(found: set[str], protocol_of: Callable[[str], str]) -> set[str]:
    """``ModelCheckpoint``'s ``last*.ckpt`` paths on a store, as URLs a restore can read.

    Lightning lists the store without the scheme (``bucket/run/last.ckpt``, which then names a local path that does not
    exist: ``ckpt_path="last"`` trained from scratch with a warning) and takes the newest by ``fs.modified``, which a
    sharded checkpoint (a prefix) has not: each is named here by its URL, a sharded one by the URL of its newest
    commit marker.
    """
    urls = set()
    for path in found:
        url = protocol_of(path)
        located = resolve_on_store(url)
        urls.add(url if located is None else located[0].url_of(f"{located[1].save_id}{COMMIT_SUFFIX}"))
    return urls


def background_upload(write: Callable[[], None], store: Store, save_id: str, scratch: Path) -> Callable[[], None]:
    """An asynchronous save's work on one rank for a URL: ``write`` (this rank's shards into ``scratch``), then their
    upload under the save's prefix; ``scratch`` is removed either way."""

    def write_and_upload() -> None:
        try:
            write()
            upload_save_files(store, save_id, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    return write_and_upload


def commit_uploaded(
    store: Store,
    save_id: str,
    rest: dict[str, Any],
    metadata: CheckpointMetadata,
    meta_io: CheckpointIO,
    keep: set[str],
) -> None:
    """Rank 0's commit of an asynchronous save to a URL, once every rank's upload succeeded: ``meta.pt`` uploaded,
    then the marker listing every file the prefix holds, then the removal of what the save replaces."""
    with tempfile.TemporaryDirectory(prefix="lightning-strategies-upload-") as scratch:
        write_sharded_meta(meta_io, rest, metadata, Path(scratch), save_id)
        upload_save_files(store, save_id, Path(scratch))
    commit_store_save(store, save_id, saved_files(store, save_id), keep)


def prepare_store_checkpoints(trainer: pl.Trainer) -> None:
    """At the start of a run, before Lightning resolves ``ckpt_path="last"``: every ``ModelCheckpoint`` whose
    ``dirpath`` is a URL names its last checkpoints by URL, and its store is checked to be reachable.

    Raises:
        StoreError: A ``dirpath``'s store cannot be reached (no such bucket, credentials refused), before any step.
    """
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath is None or not is_url(dirpath):
            continue
        find_last_checkpoints_as_urls(callback, last_checkpoints_with_urls)
        problem = store_problem(open_store(str(dirpath)))
        if problem is not None:
            raise StoreError(problem + " (ModelCheckpoint's dirpath; nothing was trained)")
