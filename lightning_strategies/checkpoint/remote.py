"""Checkpoints on an object store (any fsspec URL: ``s3://``, ``gs://``, ``memory://``): complete or absent.

A store has no rename, so the local flow (stage beside the path, swap in) has no counterpart there. What replaces it:

- **A full checkpoint** is one object, streamed into the store (``torch.save`` writes into the store's file, which
  uploads it in parts). An object store shows an object only once its upload completed: a killed save leaves the
  previous object, never a partial one.
- **A sharded checkpoint** at ``URL`` is a set of saves, each under a fresh prefix of its own::

      URL/<save id>/meta.pt, .metadata, __0_0.distcp, ... (or rank0.pt, rank1.pt, ...)
      URL/<save id>.commit

  Every rank uploads its own files under the save's prefix; the commit marker, written last by rank 0 once every
  rank's files are there, lists each file and its size, and is created with a conditional create (it never replaces
  a marker). Readers take the newest committed save and download exactly the files its marker lists; a prefix
  without a marker is a save that never finished (*uncommitted leftovers*: named by ``inspect``, removed by the next
  save of the URL or by ``lightning-strategies clean``). A newer save removes the older ones only after its own
  marker is written, never the save the run resumed from.

Nothing here imports Lightning (both flavours share it); the strategies reach it through ``CheckpointFlow``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Final, cast

import fsspec
from fsspec import AbstractFileSystem

from lightning_strategies.checkpoint.errors import CheckpointError, CheckpointFormatError, StoreError
from lightning_strategies.checkpoint.targets import CHECKPOINT_DIRECTORY_ENTRIES, is_checkpoint_stream
from lightning_strategies.checkpoint.upload_pipeline import FileParts, PartPipeline, PartSink, S3Parts

COMMIT_SUFFIX: Final = ".commit"
#: What a commit marker says it is (its ``"format"``), and the largest one read (a marker lists file names and sizes).
COMMIT_FORMAT: Final = "lightning_strategies sharded checkpoint on a store"
_COMMIT_MAX_BYTES: Final = 1 << 20
_SAVE_ID: Final = re.compile(r"^[0-9a-f]{32}$")
_COMMIT_NAME: Final = re.compile(r"^([0-9a-f]{32})\.commit$")
#: Part size of streamed uploads: S3's smallest. A full save holds two parts beside the checkpoint (one filled, one
#: uploading; benchmarks: s3fs's own file with 32 MiB parts added 2.4x a 50 MB file, with 8 MiB 0.6x).
UPLOAD_BLOCK_SIZE: Final = 5 * 1024 * 1024
#: Block size for reading a stored object's header and zip directory only (the default would fetch the whole object).
PROBE_BLOCK_SIZE: Final = 64 * 1024


@dataclass(frozen=True)
class Store:
    """A checkpoint URL on its fsspec filesystem.

    Attributes:
        url: The URL as given, less a trailing ``/``.
        fs: Its filesystem (``s3fs.S3FileSystem`` for ``s3://``).
        path: The filesystem's own path for it (``bucket/key``).
    """

    url: str
    fs: AbstractFileSystem
    path: str

    def key(self, *names: str) -> str:
        """The filesystem path of ``names`` below the URL."""
        return "/".join((self.path, *names))

    def url_of(self, *names: str) -> str:
        """The URL of ``names`` below the URL (for messages)."""
        return "/".join((self.url, *names))


#: The filesystems a fork keeps alive for its whole life (see :func:`_keep_filesystems_through_fork`).
_KEPT_THROUGH_FORK: list[Any] = []


def _filesystem_classes(root: type[AbstractFileSystem] = AbstractFileSystem) -> Iterator[type[AbstractFileSystem]]:
    subclass: type[AbstractFileSystem]
    for subclass in root.__subclasses__():
        yield subclass
        yield from _filesystem_classes(subclass)


def _keep_filesystems_through_fork() -> None:
    """Before a fork, in the parent: holds every cached fsspec filesystem, so that the child inherits a reference.

    fsspec empties its instance cache in a forked child, and an asynchronous filesystem (s3fs) dropped there runs its
    finalizer, which closes its pooled connections through the event loop state the child shares with the parent: the
    same epoll instance. The sockets are then taken out of the parent's epoll set, and the parent's next request on
    one of them waits for an answer its loop is never told of (the tests' main process stalled about 15 s on its
    first request after a fork fit). Forked workers end with ``os._exit``, which runs no finalizer of a live object:
    held, the inherited filesystems are never closed in the child. The parent lets go right after the fork.
    """
    _KEPT_THROUGH_FORK.extend(
        instance for cls in _filesystem_classes() for instance in vars(cls).get("_cache", {}).values()
    )


def keep_for_this_process(filesystem: Any) -> None:
    """Holds ``filesystem`` (one this forked process inherited and replaces) until the process ends, for the reason
    :func:`_keep_filesystems_through_fork` gives."""
    _KEPT_THROUGH_FORK.append(filesystem)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_keep_filesystems_through_fork, after_in_parent=_KEPT_THROUGH_FORK.clear)


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """The store of ``url``, with the options s3fs users pass (``key``, ``secret``, ``endpoint_url``, ...).

    Credentials and endpoint otherwise come the way the backend finds them (for s3fs: ``AWS_*`` environment
    variables, ``~/.aws``).

    Raises:
        StoreError: No fsspec backend for the URL's scheme (say ``s3fs`` for ``s3://``) is installed.
    """
    url = str(url).rstrip("/")
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as error:
        scheme = url.split("://", 1)[0]
        raise StoreError(
            f"Cannot reach {url!r}: fsspec has no working backend for {scheme}:// ({error}). Install it (for s3://:"
            " pip install 'lightning-strategies[s3]', which brings s3fs)."
        ) from error
    return Store(url, fs, str(path))


def _unreachable(store: Store, error: BaseException) -> StoreError:
    """``error`` of a store request, as an error naming the URL and the fix."""
    text = str(error) or type(error).__name__
    if isinstance(error, FileNotFoundError) and "bucket" in text.lower():
        cause = f"its bucket does not exist ({text}). Create the bucket, or fix the URL"
    elif isinstance(error, PermissionError) or any(
        word in text for word in ("AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "Forbidden")
    ):
        cause = (
            f"the store refused the credentials ({text}). Pass the right ones (for s3://: AWS_ACCESS_KEY_ID and"
            " AWS_SECRET_ACCESS_KEY in every rank's environment, or storage_options={'key': ..., 'secret': ...})"
        )
    else:
        cause = f"{type(error).__name__}: {text}. Check the URL, the endpoint (AWS_ENDPOINT_URL) and the credentials"
    return StoreError(f"Cannot reach {store.url!r}: {cause}.")


def store_problem(store: Store) -> str | None:
    """Why a save cannot go to ``store`` (no such bucket, credentials refused), or ``None``: one listing request.

    Asked on rank 0 before a save writes anything; the ranks' agreement then raises it on every rank.
    """
    try:
        store.fs.invalidate_cache()
        parent = store.path.rsplit("/", 1)[0] if "/" in store.path else store.path
        store.fs.ls(parent, detail=False)
    except FileNotFoundError as error:
        if "bucket" in str(error).lower():
            return str(_unreachable(store, error))
    except Exception as error:  # any backend's refusal is reported, naming the URL
        return str(_unreachable(store, error))
    return None


# ---------------------------------------------------------------------- what is at a URL


@dataclass(frozen=True)
class CommittedSave:
    """One committed save of a sharded checkpoint on a store.

    Attributes:
        save_id: The save's id (its prefix).
        files: Each file of the save and its size, as the commit marker lists them.
        committed_at: When the store received the marker.
        written_ns: When the committing process wrote it, by its clock (``time.time_ns()``; 0 in markers of
            earlier releases): the order of saves the store dates to the same second.
    """

    save_id: str
    files: dict[str, int]
    committed_at: datetime
    written_ns: int = 0

    @property
    def order(self) -> tuple[datetime, int, str]:
        """Sorts saves by commit: the store's clock first (at the second it reports), the writer's within it."""
        return (self.committed_at.replace(microsecond=0), self.written_ns, self.save_id)


@dataclass(frozen=True)
class StoreListing:
    """What a checkpoint URL holds.

    Attributes:
        committed: The committed sharded saves, newest first.
        leftovers: Prefixes of saves that never committed (their save ids).
        foreign: Objects below the URL that no save of ours wrote (up to a few, for messages).
        full_file_at: When a full checkpoint object at the URL itself was written, or ``None``.
        full_file_size: That object's size in bytes, or ``None``.
        leftovers_written_at: When each leftover's newest file was written (a save under way looks like a leftover
            until its marker is written: ``lightning-strategies clean`` removes only old ones).
    """

    committed: list[CommittedSave]
    leftovers: list[str]
    foreign: list[str]
    full_file_at: datetime | None
    full_file_size: int | None = None
    leftovers_written_at: dict[str, datetime] = field(default_factory=dict)

    @property
    def sharded_is_newest(self) -> bool:
        """Whether the URL reads as a sharded checkpoint: it has a committed save newer than any full object."""
        if not self.committed:
            return False
        return self.full_file_at is None or self.committed[0].committed_at >= self.full_file_at


def _modified(info: dict[str, Any]) -> datetime:
    value = info.get("LastModified") or info.get("mtime") or info.get("created")
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    return datetime.fromtimestamp(0, UTC)


def _read_commit(store: Store, name: str, info: dict[str, Any]) -> CommittedSave:
    where = store.url_of(name)
    if int(info.get("size") or 0) > _COMMIT_MAX_BYTES:
        raise CheckpointFormatError(f"Commit marker {where!r} is larger than any marker a save writes.")
    try:
        record = json.loads(store.fs.cat_file(store.key(name)))
        files = record["files"]
        if record.get("format") != COMMIT_FORMAT or record.get("save_id") != name[: -len(COMMIT_SUFFIX)]:
            raise ValueError("not a commit marker of this save")
        if not isinstance(files, dict) or not all(
            CHECKPOINT_DIRECTORY_ENTRIES.match(str(file)) and isinstance(size, int) for file, size in files.items()
        ):
            raise ValueError("malformed file list")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise CheckpointFormatError(f"Commit marker {where!r} is malformed ({error}).") from error
    written_ns = record.get("written_ns", 0)
    sizes = {str(file): int(size) for file, size in files.items()}
    return CommittedSave(record["save_id"], sizes, _modified(info), written_ns if isinstance(written_ns, int) else 0)


def list_store(store: Store) -> StoreListing:
    """What ``store``'s URL holds: committed saves, uncommitted leftovers, foreign objects, a full object.

    Raises:
        StoreError: The store cannot be reached.
        CheckpointFormatError: A commit marker is malformed.
    """
    try:
        store.fs.invalidate_cache()
        below = store.fs.find(store.path, detail=True, withdirs=False)
        full = store.fs.info(store.path) if store.fs.isfile(store.path) else None
    except FileNotFoundError:
        below, full = {}, None
    except Exception as error:  # any backend's refusal, naming the URL
        raise _unreachable(store, error) from error
    prefix = store.path.rstrip("/") + "/"
    markers: dict[str, dict[str, Any]] = {}
    prefixes: set[str] = set()
    written_at: dict[str, datetime] = {}
    foreign: list[str] = []
    for key, info in below.items():
        relative = str(key)[len(prefix) :] if str(key).startswith(prefix) else ""
        if not relative:
            continue
        head, _, tail = relative.partition("/")
        if not tail and _COMMIT_NAME.match(head):
            markers[head] = info
        elif tail and _SAVE_ID.match(head) and CHECKPOINT_DIRECTORY_ENTRIES.match(tail):
            prefixes.add(head)
            written = _modified(info)
            written_at[head] = max(written, written_at.get(head, written))
        else:
            foreign.append(relative)
    committed = [_read_commit(store, name, info) for name, info in markers.items()]
    committed.sort(key=lambda save: save.order, reverse=True)  # S3 dates objects to the second: two saves may tie
    ids = {save.save_id for save in committed}
    leftovers = sorted(save_id for save_id in prefixes if save_id not in ids)
    is_file = full is not None and full.get("type") != "directory"
    full_at = _modified(full) if full is not None and is_file else None
    full_size = int(full.get("size") or 0) if full is not None and is_file else None
    leftover_times = {save_id: written_at[save_id] for save_id in leftovers}
    return StoreListing(committed, leftovers, sorted(foreign), full_at, full_size, leftover_times)


def replace_problem_on_store(store: Store, sharded: bool) -> str | None:
    """Why a save must not write to the URL: an object there (or, for a sharded save, below it) that no checkpoint
    writer wrote; ``None`` when it holds only checkpoints (or nothing). As the local rule of
    :mod:`~lightning_strategies.checkpoint.targets`: a save replaces checkpoints only."""
    listing = list_store(store)
    if listing.full_file_at is not None:
        with store.fs.open(store.path, "rb", block_size=PROBE_BLOCK_SIZE) as file:
            if not is_checkpoint_stream(file):
                return (
                    f"Refusing to save a checkpoint to {store.url!r}: the object there is not a checkpoint (not in"
                    " torch.save's format), and the save would replace it; nothing was written. Save to another URL."
                )
    if sharded and listing.foreign:
        more = len(listing.foreign) - 3
        shown = ", ".join(listing.foreign[:3]) + (f" and {more} more" if more > 0 else "")
        return (
            f"Refusing to save a sharded checkpoint to {store.url!r}: objects below it were not written by a save"
            f" ({shown}); nothing was written. Save to another URL, or move them away."
        )
    return None


# ---------------------------------------------------------------------- writing


def streamed_write(store: Store, write: Callable[[IO[bytes]], None]) -> None:
    """Writes one object at the URL by streaming ``write``'s bytes into it, uploaded in parts of
    :data:`UPLOAD_BLOCK_SIZE` while the next part is written (:mod:`~lightning_strategies.checkpoint.upload_pipeline`:
    an S3 multipart upload through s3fs, a file of any other fsspec backend): two parts are held beside the data
    written, never a copy of the checkpoint. The object appears only once everything was written and uploaded; when
    ``write`` or an upload fails, the upload is abandoned and what was at the URL before stays as it was.

    Raises:
        StoreError: The store refused the write.
    """
    try:
        store.fs.makedirs(store.path.rsplit("/", 1)[0], exist_ok=True)
        sink: PartSink = (
            S3Parts(store.fs, store.path)
            if hasattr(store.fs, "call_s3")
            else FileParts(store.fs.open(store.path, "wb", block_size=UPLOAD_BLOCK_SIZE))
        )
    except (PermissionError, FileNotFoundError) as error:
        raise _unreachable(store, error) from error
    pipeline = PartPipeline(sink, UPLOAD_BLOCK_SIZE)
    try:
        write(cast(IO[bytes], pipeline))
    except BaseException:
        pipeline.abort()
        raise
    try:
        pipeline.finish()
    except (PermissionError, FileNotFoundError) as error:
        raise _unreachable(store, error) from error


def upload_save_files(store: Store, save_id: str, local: Path) -> dict[str, int]:
    """Uploads the checkpoint files of the local directory ``local`` under the save's prefix; returns their sizes.

    Raises:
        StoreError: The store refused an upload.
    """
    sizes: dict[str, int] = {}
    for file in sorted(local.iterdir()):
        if not (file.is_file() and CHECKPOINT_DIRECTORY_ENTRIES.match(file.name)):
            continue
        try:
            store.fs.put_file(str(file), store.key(save_id, file.name))
        except (PermissionError, FileNotFoundError) as error:
            raise _unreachable(store, error) from error
        sizes[file.name] = file.stat().st_size
    return sizes


def saved_files(store: Store, save_id: str) -> dict[str, int]:
    """The checkpoint files uploaded under the save's prefix and their sizes (what its commit marker will list)."""
    prefix = store.key(save_id) + "/"
    store.fs.invalidate_cache()
    found = store.fs.find(store.key(save_id), detail=True, withdirs=False)
    return {
        str(key)[len(prefix) :]: int(info.get("size") or 0)
        for key, info in found.items()
        if str(key).startswith(prefix) and CHECKPOINT_DIRECTORY_ENTRIES.match(str(key)[len(prefix) :])
    }


def commit_save(store: Store, save_id: str, files: dict[str, int]) -> None:
    """Writes the save's commit marker, last: created only if no marker of that name exists (a conditional create,
    ``If-None-Match: *`` on S3), so a marker is never replaced.

    Raises:
        CheckpointError: A marker of this save is already there.
    """
    record = {
        "format": COMMIT_FORMAT,
        "save_id": save_id,
        "files": dict(sorted(files.items())),
        "written_ns": time.time_ns(),
    }
    name = f"{save_id}{COMMIT_SUFFIX}"
    try:
        with store.fs.open(store.key(name), "xb") as file:
            file.write(json.dumps(record, indent=1).encode())
    except FileExistsError as error:
        raise CheckpointError(f"{store.url_of(name)!r} is already committed: a marker is never replaced.") from error
    except OSError as error:
        if "condition" in str(error).lower():  # s3fs reports S3's 412 PreconditionFailed as an OSError
            raise CheckpointError(
                f"{store.url_of(name)!r} is already committed: a marker is never replaced."
            ) from error
        raise _unreachable(store, error) from error


def _remove_save(store: Store, save_id: str) -> None:
    # The marker first: a save half removed is an uncommitted leftover, never a committed save that lacks files.
    marker = store.key(f"{save_id}{COMMIT_SUFFIX}")
    if store.fs.exists(marker):
        store.fs.rm_file(marker)
    files = store.key(save_id)
    if store.fs.exists(files):
        store.fs.rm(files, recursive=True)
    _forget_directory(store, files)


def _forget_directory(store: Store, path: str) -> None:
    """Removes the directory entry a store may keep for an emptied prefix (SeaweedFS, a filer, lists it on; S3 has
    none, and deleting the absent key is a no-op): else an emptied checkpoint would still seem to exist."""
    with contextlib.suppress(OSError):
        store.fs.rm_file(path.rstrip("/") + "/")


def remove_saves(store: Store, keep: set[str]) -> list[str]:
    """Removes every sharded save and leftover at the URL whose id is not in ``keep``; returns the ids removed.

    Only a save's own files go (its marker, then its prefix); objects no save wrote stay.
    """
    listing = list_store(store)
    removed = [save.save_id for save in listing.committed if save.save_id not in keep]
    removed += [save_id for save_id in listing.leftovers if save_id not in keep]
    for save_id in removed:
        _remove_save(store, save_id)
    return removed


def remove_leftovers(store: Store, older_than: datetime) -> list[str]:
    """Removes the uncommitted leftovers at the URL whose newest file was written before ``older_than`` (a younger
    one may be a save under way); returns their save ids. Committed saves stay."""
    listing = list_store(store)
    removed = [save_id for save_id, written in listing.leftovers_written_at.items() if written < older_than]
    for save_id in removed:
        _remove_save(store, save_id)
    return removed


def remove_full_file(store: Store) -> None:
    """Removes a full checkpoint object at the URL itself (a sharded save replaced it)."""
    if store.fs.isfile(store.path):
        store.fs.rm_file(store.path)


def remove_checkpoint_at(store: Store) -> list[str]:
    """Removes the checkpoint at the URL (a full object and every sharded save of it); objects no save wrote stay,
    and are returned (relative names) so that the caller can say so."""
    remove_full_file(store)
    remove_saves(store, keep=set())
    kept = list_store(store).foreign
    if not kept:
        _forget_directory(store, store.path)
    return kept


# ---------------------------------------------------------------------- reading


def newest_committed(store: Store) -> CommittedSave:
    """The save a reader takes: the newest committed one.

    Raises:
        FileNotFoundError: The URL holds no committed save (say, only uncommitted leftovers).
    """
    listing = list_store(store)
    if not listing.committed:
        leftovers = (
            f" (only uncommitted leftovers of {len(listing.leftovers)} save(s) that never finished)"
            if listing.leftovers
            else ""
        )
        raise FileNotFoundError(f"Checkpoint {store.url!r} holds no committed save{leftovers}.")
    return listing.committed[0]


@dataclass(frozen=True)
class StoredFile:
    """One object a restore downloads: its name in the local copy, its key on the store, its size in bytes (as its
    commit marker lists it, or as the store reported it for a full checkpoint), and how messages name it and that
    size."""

    name: str
    key: str
    size: int
    label: str
    listed_by: str = "its commit marker"


def files_of(store: Store, save: CommittedSave) -> list[StoredFile]:
    """The files of a committed save, as its marker lists them."""
    return [
        StoredFile(name, store.key(save.save_id, name), size, f"{name} of save {save.save_id}")
        for name, size in save.files.items()
    ]


#: A byte range of one stored file, ``(file, start, end)``: the part of a download one process fetches.
FileRange = tuple[StoredFile, int, int]


def split_download(files: Sequence[StoredFile], parts: int) -> list[list[FileRange]]:
    """The files' bytes cut into ``parts`` shares of equal size (within a byte), each a run of contiguous ranges of
    the files laid end to end: the processes that share a local copy each download one share. Every byte is in
    exactly one share; an empty file goes to the first share (which creates it)."""
    if parts < 1:
        raise ValueError(f"A download is split into at least one share, not {parts}.")
    total = sum(file.size for file in files)
    bounds = [total * share // parts for share in range(parts + 1)]
    shares: list[list[FileRange]] = [[] for _ in range(parts)]
    offset = 0
    for file in files:
        if file.size == 0:
            shares[0].append((file, 0, 0))
        for share in range(parts):
            start, end = max(offset, bounds[share]), min(offset + file.size, bounds[share + 1])
            if start < end:
                shares[share].append((file, start - offset, end - offset))
        offset += file.size
    return shares


#: The largest range one request of a download fetches, and how many requests a process has under way at once (a
#: ranged read waits on the network and the store more than on this process): it holds at most that many blocks.
DOWNLOAD_BLOCK_SIZE: Final = 8 * 1024 * 1024
DOWNLOADS_AT_ONCE: Final = 3


def download_ranges(store: Store, ranges: Sequence[FileRange], local: Path) -> None:
    """Writes each range of its stored file into the file of that name in the local directory ``local``, at its
    offset (other processes may write the other ranges of the same file at the same time), in blocks of
    :data:`DOWNLOAD_BLOCK_SIZE`, :data:`DOWNLOADS_AT_ONCE` at a time. The block that ends a file also asks for one
    byte past it, so an object longer than its listed size is noticed, like a shorter one.

    Raises:
        CheckpointFormatError: A file is missing on the store or of another size than listed.
        StoreError: The store refused a read.
    """
    blocks = [
        (file, position, min(end, position + DOWNLOAD_BLOCK_SIZE))
        for file, start, end in ranges
        for position in (range(start, end, DOWNLOAD_BLOCK_SIZE) if end > start else [start])
    ]
    descriptors: dict[str, int] = {}
    try:
        for file, _, _ in blocks:  # every file of the share exists locally before any block is written
            if file.name not in descriptors:
                descriptors[file.name] = os.open(local / file.name, os.O_WRONLY | os.O_CREAT, 0o600)

        def fetch(block: FileRange) -> None:
            file, start, stop = block
            if start == stop:  # an empty file: empty on the store too
                if (size := _stored_size(store, file)) != 0:
                    raise _wrong_size(store, file, size)
                return
            data = _read_block(store, file, start, stop)
            if len(data) != stop - start:
                raise _wrong_size(store, file, start + len(data) if len(data) < stop - start else None)
            _write_at(descriptors[file.name], data, start)

        if len(blocks) <= 1:
            for block in blocks:
                fetch(block)
            return
        with ThreadPoolExecutor(min(DOWNLOADS_AT_ONCE, len(blocks)), "lightning-strategies-download") as pool:
            fetched = [pool.submit(fetch, block) for block in blocks]
            try:
                for future in fetched:
                    future.result()
            except BaseException:
                pool.shutdown(cancel_futures=True)  # the blocks not started yet are not fetched
                raise
    finally:
        for descriptor in descriptors.values():
            os.close(descriptor)


def _read_block(store: Store, file: StoredFile, start: int, stop: int) -> bytes:
    """The bytes ``start:stop`` of a stored file, and the byte past them where ``stop`` ends the file."""
    try:
        return _read_range(store, file, start, stop + 1 if stop == file.size else stop)
    except (CheckpointFormatError, StoreError):
        raise
    except OSError:  # a range past the object's end (S3: InvalidRange): it is shorter than listed
        if (size := _stored_size(store, file)) != file.size:
            raise _wrong_size(store, file, size) from None
        raise


def _read_range(store: Store, file: StoredFile, start: int, end: int) -> bytes:
    try:
        return bytes(store.fs.cat_file(file.key, start=start, end=end))
    except FileNotFoundError as error:
        raise CheckpointFormatError(
            f"Checkpoint {store.url!r}: {file.label} is missing on the store (removed by hand?). Use another"
            " checkpoint."
        ) from error
    except PermissionError as error:
        raise _unreachable(store, error) from error


def _stored_size(store: Store, file: StoredFile) -> int:
    try:
        return int(store.fs.info(file.key).get("size") or 0)
    except FileNotFoundError:
        return -1


def _wrong_size(store: Store, file: StoredFile, actual: int | None) -> CheckpointFormatError:
    held = f"more than {file.size}" if actual is None else str(actual) if actual >= 0 else "no"
    return CheckpointFormatError(
        f"Checkpoint {store.url!r}: {file.label} holds {held} bytes, {file.listed_by} says {file.size} (changed"
        " since it was written?). Use another checkpoint."
    )


def _write_at(descriptor: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(descriptor, view, offset)
        view, offset = view[written:], offset + written


def download_save(store: Store, save: CommittedSave, local: Path) -> Path:
    """Downloads exactly the files the save's marker lists into the new local directory ``local``, each checked
    against its listed size (one process; a restore shares the download between the processes of a host, see
    ``strategies.store_saves``).

    Raises:
        CheckpointFormatError: A listed file is missing or of another size.
    """
    local.mkdir(parents=True)
    download_ranges(store, split_download(files_of(store, save), 1)[0], local)
    return local


@contextmanager
def downloaded(store: Store, save: CommittedSave | None = None) -> Iterator[Path]:
    """A local copy of the URL's newest committed save (or of ``save``), removed on exit."""
    chosen = save if save is not None else newest_committed(store)
    scratch = Path(tempfile.mkdtemp(prefix="lightning-strategies-download-"))
    try:
        yield download_save(store, chosen, scratch / Path(store.path).name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
