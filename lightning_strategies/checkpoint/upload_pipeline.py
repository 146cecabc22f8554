"""Uploads that run while they are written: ``torch.save`` into a store object without a copy of the checkpoint.

``torch.save`` hands its writer each tensor's bytes in one call. Written straight into an fsspec store file, a 40 MB
tensor lands whole in the file's buffer and goes out as one 40 MB part (a second copy of it while it uploads), and
the serialization waits for every upload. :class:`PartPipeline` cuts the bytes into parts of a fixed size and hands
each to a thread that uploads it (:class:`S3Parts`: one part of an S3 multipart upload; :class:`FileParts`: a write
into any other fsspec file), so the next part is serialized while this one uploads, and two parts are held at most:
the one being filled and the one being uploaded.
"""

from __future__ import annotations

import contextlib
import io
import queue
import threading
from typing import Any, Protocol


class PartSink(Protocol):
    """Where a :class:`PartPipeline` sends its parts, from ``uploads_at_once`` upload threads."""

    #: How many parts may upload at the same time (1: in order, each once the part before it is done).
    uploads_at_once: int

    def send(self, number: int, part: bytearray) -> None:
        """Uploads part ``number`` (from 1; every part but the last one holds the pipeline's part size)."""

    def complete(self) -> None:
        """Makes the object appear, whole: called once every part was sent."""

    def abandon(self) -> None:
        """Drops what was sent: the object does not appear, what was at its path stays (never raises)."""


class _PartReader(io.RawIOBase):
    """A part as a seekable file over its buffer: the HTTP client reads it in small chunks (a ``bytes`` body is handed
    to the socket whole, and what the socket does not take at once is copied into the transport's buffer)."""

    def __init__(self, part: bytearray) -> None:
        self._view = memoryview(part)
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        taken = self._view[self._position : self._position + len(buffer)]
        memoryview(buffer).cast("B")[: len(taken)] = taken
        self._position += len(taken)
        return len(taken)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._view)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def close(self) -> None:
        self._view.release()
        super().close()


class S3Parts:
    """The parts of one S3 multipart upload, through s3fs's client, two uploading at once (a part's request waits on
    the network and the store more than on this process): the upload starts before the first part, and an object of
    one part (or of none) is still one multipart upload, completed or aborted as a whole."""

    uploads_at_once = 2

    def __init__(self, fs: Any, path: str) -> None:
        self._filesystem = fs
        self._object_path = path
        self._bucket, self._key, _ = fs.split_path(path)
        started = fs.call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key)
        self._upload_id: str | None = str(started["UploadId"])
        self._etags: dict[int, str] = {}

    def send(self, number: int, part: bytearray) -> None:
        with _PartReader(part) as body:
            sent = self._filesystem.call_s3(
                "upload_part",
                Bucket=self._bucket,
                Key=self._key,
                PartNumber=number,
                UploadId=self._upload_id,
                Body=body,
                ContentLength=len(part),
            )
        self._etags[number] = sent["ETag"]

    def complete(self) -> None:
        if not self._etags:  # nothing was written: an empty object (S3 completes no upload of no parts)
            self.abandon()
            self._filesystem.call_s3("put_object", Bucket=self._bucket, Key=self._key, Body=b"")
        else:
            parts = [{"PartNumber": number, "ETag": self._etags[number]} for number in sorted(self._etags)]
            self._filesystem.call_s3(
                "complete_multipart_upload",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )
        self._filesystem.invalidate_cache(self._object_path)

    def abandon(self) -> None:
        if self._upload_id is not None:
            with contextlib.suppress(Exception):  # an upload left open is removed by the bucket's lifecycle rules
                self._filesystem.call_s3(
                    "abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id
                )
            self._upload_id = None


class FileParts:
    """The parts written, in order, into an fsspec file open for writing (any backend)."""

    uploads_at_once = 1

    def __init__(self, file: Any) -> None:
        self._file = file

    def send(self, number: int, part: bytearray) -> None:
        self._file.write(part)

    def complete(self) -> None:
        self._file.close()

    def abandon(self) -> None:
        with contextlib.suppress(Exception):
            self._file.discard()
        # Not closed: fsspec's close finishes the upload, which would publish a truncated object (its finaliser
        # would close it too).
        self._file.closed = True


class PartPipeline:
    """A file-like ``write`` target that sends its bytes to ``sink`` from background threads, ``part_size`` at a
    time (the last part may be smaller), while the next part is filled.

    Two buffers of ``part_size`` bytes take turns (filled here, then uploaded, then filled again), so a save holds
    two parts and allocates nothing more, however large the checkpoint; a sink that uploads two parts at once gets
    both buffers uploading while ``torch.save`` (much faster than an upload) waits for one. Call :meth:`finish` once
    everything is written (the object then appears; it raises the upload's error, if any) or :meth:`abort` after a
    failure (the object does not appear); either way the upload threads are gone then.
    """

    def __init__(self, sink: PartSink, part_size: int) -> None:
        if part_size < 1:
            raise ValueError(f"A part holds at least one byte, not {part_size}.")
        self._sink = sink
        self._part_size = part_size
        self._part = bytearray(part_size)
        self._filled = 0
        self._parts: queue.SimpleQueue[tuple[int, bytearray] | None] = queue.SimpleQueue()
        self._numbered = 0
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()  # buffers back from the upload thread
        self._free.put(bytearray(part_size))
        self._failure: BaseException | None = None
        self._closed = False
        self._threads = [
            threading.Thread(target=self._upload, name="lightning-strategies-upload", daemon=True)
            for _ in range(max(1, sink.uploads_at_once))
        ]
        for thread in self._threads:
            thread.start()

    def write(self, data: Any) -> int:
        """Takes ``data`` (any buffer); returns its size in bytes.

        Raises:
            ValueError: After :meth:`finish` or :meth:`abort`.
            Exception: The error the upload met on an earlier part.
        """
        if self._closed:
            raise ValueError("write to a finished upload")
        view = memoryview(data).cast("B")
        size = len(view)
        while view:
            taken = min(len(view), self._part_size - self._filled)
            self._part[self._filled : self._filled + taken] = view[:taken]
            self._filled += taken
            view = view[taken:]
            if self._filled == self._part_size:
                self._send(self._part)
                self._part, self._filled = self._free.get(), 0  # waits while the part before still uploads
                if self._failure is not None:
                    raise self._failure
        return size

    def flush(self) -> None:
        """Nothing to do: a part is sent once it is full (``torch.save`` calls this)."""

    def finish(self) -> None:
        """Sends the last part, waits for every upload and completes the object.

        Raises:
            Exception: The error the upload met (the object was abandoned).
        """
        try:
            if self._filled:
                del self._part[self._filled :]  # in place: the last part is shorter
                self._send(self._part)
            self._stop()
            if self._failure is not None:
                raise self._failure
            self._sink.complete()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Stops the upload thread and abandons the object: what was at its path stays as it was."""
        self._filled = 0
        self._stop()
        self._sink.abandon()

    def _send(self, part: bytearray) -> None:
        if self._failure is not None:
            raise self._failure
        self._numbered += 1
        self._parts.put((self._numbered, part))

    def _stop(self) -> None:
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._parts.put(None)
            for thread in self._threads:
                thread.join()

    def _upload(self) -> None:
        while (numbered := self._parts.get()) is not None:
            number, part = numbered
            try:
                if self._failure is None:  # after an error the parts are dropped, so the writer never waits long
                    self._sink.send(number, part)
            except BaseException as error:  # raised in the writing thread by its next write or by finish()
                self._failure = error
            finally:
                self._free.put(part)
