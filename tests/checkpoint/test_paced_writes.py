"""How checkpoint files reach the kernel (``checkpoint.paced_writes``): in slices, and paced in background writes."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_strategies.checkpoint import paced_writes
from lightning_strategies.checkpoint.paced_writes import (
    PAUSE_PER_SECOND_WORKED,
    WRITE_SLICE_BYTES,
    Pacing,
    SlicedFile,
    open_sliced,
    paced,
)


class RecordingRaw(io.RawIOBase):
    """A raw file that keeps what it is given and the size of each ``write`` the kernel would see."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.sizes: list[int] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sizes.append(len(view))
        self.data += view
        return len(view)


def burn_cpu(seconds: float) -> None:
    started = time.thread_time()
    while time.thread_time() - started < seconds:
        pass


def test_a_large_write_reaches_the_kernel_in_slices() -> None:
    raw = RecordingRaw()
    payload = bytes(range(256)) * (WRITE_SLICE_BYTES // 64)  # four slices
    with SlicedFile(raw) as file:
        assert file.write(payload) == len(payload)
        file.flush()
        assert bytes(raw.data) == payload
    assert max(raw.sizes) <= WRITE_SLICE_BYTES
    assert len(raw.sizes) == 4


def test_torch_save_into_a_sliced_file_writes_the_same_bytes_as_into_memory(tmp_path: Path) -> None:
    checkpoint = {"weight": torch.randn(300, 1000), "step": 3}  # 1.2 MB: written in slices
    in_memory = io.BytesIO()
    torch.save(checkpoint, in_memory)
    with open_sliced(tmp_path / "checkpoint.ckpt") as file:
        torch.save(checkpoint, file)
    assert (tmp_path / "checkpoint.ckpt").read_bytes() == in_memory.getvalue()
    loaded = torch.load(tmp_path / "checkpoint.ckpt", weights_only=True)
    assert torch.equal(loaded["weight"], checkpoint["weight"])


def test_a_paced_write_pauses_twice_as_long_as_it_worked() -> None:
    pacing = Pacing(budget_s=60.0, expected_bytes=1)
    with paced(pacing):
        burn_cpu(0.02)
        paced_writes.pause_if_paced(1)
    assert pacing.paused_s >= 0.02 * PAUSE_PER_SECOND_WORKED * 0.99
    assert pacing.paused_s < 0.02 * PAUSE_PER_SECOND_WORKED + 1.0  # the machine may be slow to wake it, not more


def test_a_paced_write_does_not_pause_past_its_budget() -> None:
    pacing = Pacing(budget_s=0.01, expected_bytes=100)
    with paced(pacing):
        burn_cpu(0.02)  # already past the budget: on schedule, it may not pause
        paced_writes.pause_if_paced(100)
    assert pacing.paused_s == 0.0


def test_a_write_without_a_budget_never_pauses() -> None:
    pacing = Pacing(budget_s=0.0, expected_bytes=0)  # the first save of a fit
    with paced(pacing):
        burn_cpu(0.01)
        paced_writes.pause_if_paced(WRITE_SLICE_BYTES)
    assert pacing.paused_s == 0.0


class NotingWait(threading.Event):
    """An event that notes when a thread starts to wait on it (a pause under way)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def test_hurrying_ends_a_pause_under_way_and_no_other_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paced_writes, "PAUSE_PER_SECOND_WORKED", 1e6)  # a pause of hours, unless hurried
    pacing = Pacing(budget_s=1e9, expected_bytes=1)
    pacing._hurried = hurried = NotingWait()  # what a pause waits on

    def write() -> None:
        with paced(pacing):
            burn_cpu(0.005)
            paced_writes.pause_if_paced(1)
            burn_cpu(0.005)
            paced_writes.pause_if_paced(1)

    thread = threading.Thread(target=write)
    thread.start()
    assert hurried.waiting.wait(timeout=30)  # the first pause is under way
    pacing.hurry()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert pacing.hurried
    assert 0 < pacing.paused_s < 30


def test_only_the_paced_thread_pauses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paced_writes, "PAUSE_PER_SECOND_WORKED", 1e6)
    pacing = Pacing(budget_s=1e9, expected_bytes=1)
    entered, written = threading.Event(), threading.Event()

    def paced_thread() -> None:
        with paced(pacing):
            entered.set()
            written.wait(timeout=60)  # paced, writing nothing, while the foreground writes

    thread = threading.Thread(target=paced_thread)
    thread.start()
    assert entered.wait(timeout=30)
    started = time.perf_counter()
    with open_sliced(tmp_path / "foreground.bin") as file:  # a foreground save beside a paced background write
        file.write(bytes(4 * WRITE_SLICE_BYTES))
    written.set()
    thread.join(timeout=30)
    assert time.perf_counter() - started < 30  # a pause would have lasted hours
    assert pacing.paused_s == 0.0
