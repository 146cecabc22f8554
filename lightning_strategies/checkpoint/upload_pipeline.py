"""A writer that uploads while it is written to: ``torch.save`` into a store object without a copy of the checkpoint.

``torch.save`` hands its writer each tensor's bytes in one call. Written straight into an fsspec store file, a 40 MB
tensor lands whole in the file's buffer and goes out as one 40 MB part (a second copy of it while it uploads), and
the serialization waits for every upload. :class:`PartPipeline` cuts the bytes into parts of a fixed size and hands
each to a thread that writes it into the store file (which uploads it as one part of a multipart upload), so the
next part is serialized while this one uploads, and at most one part waits beside the one being uploaded.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Final

#: What the upload thread is told when no more parts come.
_DONE: Final = None


class PartPipeline:
    """A file-like ``write`` target that forwards its bytes to ``file`` from a background thread, ``part_size`` at a
    time (the last part may be smaller).

    Call :meth:`finish` once everything is written (it raises the upload thread's error, if any) or :meth:`abort`
    after a failure; either way the thread is gone when they return. ``file`` is neither closed nor discarded here:
    whether the object appears is the caller's decision.
    """

    def __init__(self, file: Any, part_size: int) -> None:
        if part_size < 1:
            raise ValueError(f"A part holds at least one byte, not {part_size}.")
        self._file = file
        self._part_size = part_size
        self._part = bytearray()
        self._parts: queue.Queue[bytearray | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._forward, name="lightning-strategies-upload", daemon=True)
        self._thread.start()

    def write(self, data: Any) -> int:
        """Takes ``data`` (any buffer); returns its size in bytes.

        Raises:
            ValueError: After :meth:`finish` or :meth:`abort`.
            Exception: The error the upload thread met on an earlier part.
        """
        if self._closed:
            raise ValueError("write to a finished upload")
        view = memoryview(data).cast("B")
        size = len(view)
        while view:
            room = self._part_size - len(self._part)
            self._part += view[:room]
            view = view[room:]
            if len(self._part) == self._part_size:
                self._send(self._part)
                self._part = bytearray()
        return size

    def flush(self) -> None:
        """Nothing to do: a part is sent once it is full (``torch.save`` calls this)."""

    def finish(self) -> None:
        """Sends the last part and waits until every part is in ``file``.

        Raises:
            Exception: The error the upload thread met.
        """
        if self._part:
            self._send(self._part)
            self._part = bytearray()
        self._stop()
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        """Stops the upload thread; parts not yet written into ``file`` are dropped."""
        self._part = bytearray()
        self._stop()

    def _send(self, part: bytearray) -> None:
        if self._error is not None:
            raise self._error
        self._parts.put(part)  # waits while a part is queued: one uploads, one waits, one is being filled

    def _stop(self) -> None:
        if not self._closed:
            self._closed = True
            self._parts.put(_DONE)
            self._thread.join()

    def _forward(self) -> None:
        while (part := self._parts.get()) is not _DONE:
            if self._error is None:  # after an error the parts are taken and dropped, so no sender ever waits
                try:
                    self._file.write(part)
                except BaseException as error:  # raised in the writing thread by its next write or by finish()
                    self._error = error
