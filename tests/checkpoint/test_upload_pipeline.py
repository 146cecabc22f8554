"""The part pipeline a save to a store streams ``torch.save`` through: every byte reaches the store file once, in
order, in parts of the fixed size (the last one shorter), and an upload error reaches the writer."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_strategies.checkpoint.upload_pipeline import PartPipeline
from tests.support.property_settings import PROPERTY


class RecordsParts:
    """A store file that records each write it gets (and the thread it came from)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.parts: list[bytes] = []
        self.threads: set[str] = set()
        self.fail_at = fail_at

    def write(self, data: Any) -> int:
        if self.fail_at is not None and len(self.parts) == self.fail_at:
            raise PermissionError("Access Denied")
        self.parts.append(bytes(data))
        self.threads.add(threading.current_thread().name)
        return len(data)


@PROPERTY
@given(writes=st.lists(st.binary(max_size=50), max_size=20), part_size=st.integers(1, 40))
def test_every_byte_reaches_the_file_once_in_order_in_parts_of_the_fixed_size(
    writes: list[bytes], part_size: int
) -> None:
    file = RecordsParts()
    pipeline = PartPipeline(file, part_size)
    for data in writes:
        assert pipeline.write(memoryview(data)) == len(data)
    pipeline.finish()

    assert b"".join(file.parts) == b"".join(writes)
    assert all(len(part) == part_size for part in file.parts[:-1])
    assert all(0 < len(part) <= part_size for part in file.parts)
    assert file.threads <= {"lightning-strategies-upload"}  # the writer never waits on an upload itself


def test_an_upload_error_is_raised_by_the_writer() -> None:
    pipeline = PartPipeline(RecordsParts(fail_at=1), 4)
    with pytest.raises(PermissionError, match="Access Denied"):
        for _ in range(10):  # the second part fails: a later write or finish() raises it
            pipeline.write(b"abcd")
        pipeline.finish()


def test_a_write_after_abort_is_refused_and_abort_never_waits_on_a_full_queue() -> None:
    file = RecordsParts(fail_at=0)
    pipeline = PartPipeline(file, 1)
    with pytest.raises(PermissionError):
        for _ in range(10):
            pipeline.write(b"x")
    pipeline.abort()
    with pytest.raises(ValueError, match="write to a finished upload"):
        pipeline.write(b"x")
    assert file.parts == []


def test_a_part_holds_at_least_one_byte() -> None:
    with pytest.raises(ValueError, match="at least one byte, not 0"):
        PartPipeline(RecordsParts(), 0)
