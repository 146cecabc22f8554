"""The part pipeline a save to a store streams ``torch.save`` through: every byte reaches the store file once, in
order, in parts of the fixed size (the last one shorter), and an upload error reaches the writer."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_strategies.checkpoint.upload_pipeline import PartPipeline
from tests.support.property_settings import PROPERTY


class RecordsParts:
    """A part sink that records each part it gets (and the thread it came from), and how the object ended."""

    def __init__(self, fail_at: int | None = None, uploads_at_once: int = 1) -> None:
        self.uploads_at_once = uploads_at_once
        self.numbered: dict[int, bytes] = {}
        self.parts: list[bytes] = []
        self.threads: set[str] = set()
        self.fail_at = fail_at
        self.ended: str | None = None

    def send(self, number: int, part: bytearray) -> None:
        if self.fail_at is not None and len(self.parts) == self.fail_at:
            raise PermissionError("Access Denied")
        self.numbered[number] = bytes(part)
        self.parts.append(bytes(part))
        self.threads.add(threading.current_thread().name)

    def complete(self) -> None:
        self.ended = "completed"

    def abandon(self) -> None:
        self.ended = "abandoned"


@PROPERTY
@given(writes=st.lists(st.binary(max_size=50), max_size=20), part_size=st.integers(1, 40), at_once=st.integers(1, 3))
def test_every_byte_reaches_the_sink_once_numbered_in_order_in_parts_of_the_fixed_size(
    writes: list[bytes], part_size: int, at_once: int
) -> None:
    file = RecordsParts(uploads_at_once=at_once)
    pipeline = PartPipeline(file, part_size)
    for data in writes:
        assert pipeline.write(memoryview(data)) == len(data)
    pipeline.finish()

    assert file.ended == "completed"
    parts = [file.numbered[number] for number in sorted(file.numbered)]
    assert sorted(file.numbered) == list(range(1, len(parts) + 1))
    assert b"".join(parts) == b"".join(writes)
    assert all(len(part) == part_size for part in parts[:-1])
    assert all(0 < len(part) <= part_size for part in parts)
    if at_once == 1:  # one upload thread: the parts arrive in order
        assert file.parts == parts
    assert file.threads <= {"lightning-strategies-upload"}  # the writer never waits on an upload itself


def test_an_upload_error_is_raised_by_the_writer_and_abandons_the_object() -> None:
    sink = RecordsParts(fail_at=1)
    pipeline = PartPipeline(sink, 4)
    with pytest.raises(PermissionError, match="Access Denied"):
        for _ in range(10):  # the second part fails: a later write or finish() raises it
            pipeline.write(b"abcd")
        pipeline.finish()
    pipeline.abort()

    assert sink.ended == "abandoned"


def test_a_write_after_abort_is_refused_and_abort_never_waits_on_a_full_queue() -> None:
    file = RecordsParts(fail_at=0)
    pipeline = PartPipeline(file, 1)
    with pytest.raises(PermissionError):
        for _ in range(10):
            pipeline.write(b"x")
    pipeline.abort()
    with pytest.raises(ValueError, match="write to a finished upload"):
        pipeline.write(b"x")
    assert file.parts == [] and file.ended == "abandoned"


def test_a_part_holds_at_least_one_byte() -> None:
    with pytest.raises(ValueError, match="at least one byte, not 0"):
        PartPipeline(RecordsParts(), 0)
