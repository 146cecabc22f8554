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
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from lightning_strategies.checkpoint.errors import CheckpointError, CheckpointFormatError, StoreError
from lightning_strategies.checkpoint.metadata import CheckpointMetadata
from lightning_strategies.checkpoint.remote import (
    COMMIT_SUFFIX,
    CommittedSave,
    Store,
    StoredFile,
    commit_save,
    download_ranges,
    list_store,
    open_store,
    remove_full_file,
    remove_saves,
    replace_problem_on_store,
    saved_files,
    split_download,
    store_problem,
    upload_save_files,
)
from lightning_strategies.checkpoint.sharded import new_save_id, write_sharded_meta
from lightning_strategies.checkpoint.targets import SaveRefusal, is_url

from .._lightning import CheckpointIO, find_last_checkpoints_as_urls, pl
from .agreement import agree_on_sharded_save, every_rank, gather_uploads, this_rank
from .atomic_io import finish_background_writes

if TYPE_CHECKING:
    from .checkpointing import CheckpointFlow

Answer = TypeVar("Answer")
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


def resolve_on_store(path: str) -> tuple[Store, CommittedSave | StoredFile] | None:
    """What a restore from the URL ``path`` reads: the newest committed sharded save, or the full object at the URL,
    or ``None`` when neither is there (the full loader then names what is missing). Rank 0 lists the store once and
    every rank takes its answer (a collective), so that the ranks read the same save even while another run commits
    one.

    Raises:
        FileNotFoundError: ``path`` names a commit marker that is not there (on every rank).
        StoreError: The store cannot be reached (on every rank).
    """
    url, save_id = split_marker_url(path)
    store = open_store(url)
    found = _rank_zero_answer(lambda: _stored_checkpoint(store, path, save_id))
    return None if found is None else (store, found)


def _stored_checkpoint(store: Store, path: str, save_id: str | None) -> CommittedSave | StoredFile | None:
    """What this process finds at ``path`` on ``store`` (see :func:`resolve_on_store`), listing it itself."""
    listing = list_store(store)
    if save_id is not None:
        chosen = next((save for save in listing.committed if save.save_id == save_id), None)
        if chosen is None:
            raise FileNotFoundError(f"Checkpoint {path!r}: save {save_id} of {store.url!r} is not committed there.")
        return chosen
    if listing.sharded_is_newest:
        return listing.committed[0]
    if listing.full_file_size is None:
        return None
    name = Path(store.path).name or "checkpoint.ckpt"
    return StoredFile(name, store.path, listing.full_file_size, "the object", "the store's listing")


def _rank_zero_answer(ask: Callable[[], Answer]) -> Answer:
    """Rank 0's result of ``ask`` on every rank, or its error raised on every rank (a collective)."""
    answer: tuple[bool, Any] | None = None
    if this_rank() == 0:
        try:
            answer = (True, ask())
        except (OSError, CheckpointError) as error:  # what a listing raises: sent, then raised by every rank
            answer = (False, error)
    ok, value = every_rank(answer)[0]
    if not ok:
        raise value
    return cast(Answer, value)


class Downloads:
    """The local copies of stored checkpoints a restore reads, one per host: the processes that see the same local
    scratch directory (found by looking, not assumed from the launcher) share one copy and each downloads an equal
    share of its bytes, so a host fetches each byte once (instead of once per rank) and in parallel. Removed once
    the restore is done."""

    def __init__(self) -> None:
        self._copies: list[tuple[Path, bool]] = []  # (scratch directory, whether this process made it)

    def fetch(self, store: Store, files: list[StoredFile], name: str) -> Path:
        """Downloads ``files`` of ``store`` into a new directory ``name`` of this host's copy and returns it (a
        collective: every rank calls it with the same files).

        Raises:
            CheckpointFormatError: On every rank: a file is missing on the store or of another size than listed.
            StoreError: On every rank: the store refused a read.
        """
        token = every_rank(secrets.token_hex(16))[0]  # rank 0's: one name for every host's copy
        scratch = Path(tempfile.gettempdir()) / f"lightning-strategies-download-{token}"
        made, unusable = True, None
        try:
            scratch.mkdir(mode=0o700)
        except FileExistsError:  # another process of this host made it first
            made = False
        except OSError as error:
            unusable = f"{type(error).__name__}: {error}"
        identity = None
        if unusable is None:
            self._copies.append((scratch, made))
            seen = scratch.stat()  # the directory, whoever made it: ranks that see the same one share the copy
            identity = (socket.gethostname(), seen.st_dev, seen.st_ino)
        everyone = every_rank((unusable, identity))
        refusals = [(rank, found) for rank, (found, _) in enumerate(everyone) if found is not None]
        if refusals:
            self.clear()
            rank, refusal = refusals[0]
            raise StoreError(
                f"Checkpoint {store.url!r}: rank {rank} cannot make its local copy in {str(scratch.parent)!r}"
                f" ({refusal}). Point TMPDIR at a writable local directory with room for the checkpoint."
            )
        sharing = [rank for rank, (_, other) in enumerate(everyone) if tuple(other) == identity]
        local = scratch / name
        local.mkdir(exist_ok=True)
        share = split_download(files, len(sharing))[sharing.index(this_rank())]
        problem: tuple[bool, str] | None = None
        try:
            download_ranges(store, share, local)
        except CheckpointFormatError as error:
            problem = (True, str(error))
        except Exception as error:  # every rank learns of it below
            problem = (False, f"{type(error).__name__}: {error}")
        failures = [(rank, found) for rank, found in enumerate(every_rank(problem)) if found is not None]
        if failures:
            rank, (about_the_files, message) = failures[0]
            if about_the_files:
                raise CheckpointFormatError(message)
            raise StoreError(f"Downloading checkpoint {store.url!r} failed on rank {rank}: {message}")
        return local

    def clear(self, barrier: Callable[[], None] | None = None) -> None:
        """Removes the copies this process made; ``barrier`` first, where other processes may still read them."""
        if not self._copies:
            return
        if barrier is not None:
            barrier()
        for scratch, made in self._copies:
            if made:
                shutil.rmtree(scratch, ignore_errors=True)
        self._copies.clear()


def last_checkpoints_with_urls(found: set[str], protocol_of: Callable[[str], str]) -> set[str]:
    """``ModelCheckpoint``'s ``last*.ckpt`` paths on a store, as URLs a restore can read.

    Lightning lists the store without the scheme (``bucket/run/last.ckpt``, which then names a local path that does not
    exist: ``ckpt_path="last"`` trained from scratch with a warning) and takes the newest by ``fs.modified``, which a
    sharded checkpoint (a prefix) has not: each is named here by its URL, a sharded one by the URL of its newest
    commit marker.
    """
    urls = set()
    for path in found:  # each rank lists on its own: Lightning looks for "last" on every rank, not always on all
        url = protocol_of(path)
        store = open_store(url)
        located = _stored_checkpoint(store, url, None)
        urls.add(store.url_of(f"{located.save_id}{COMMIT_SUFFIX}") if isinstance(located, CommittedSave) else url)
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
