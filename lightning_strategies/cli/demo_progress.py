"""The demo's one progress display: a single bar in a terminal, one line per run in a log.

The demo trains four times (the reference run, then each phase of the chain) in forked or spawned workers. Rank 0's
worker draws the bar while it trains (``draw_bar``, through a callback that carries only plain values, so spawned
workers can unpickle it); the demo's own process keeps the count of steps done and writes one line per finished run
(``DemoProgress``). Nothing here imports Lightning.
"""

from __future__ import annotations

import shutil
import sys
import time

#: Characters of the bar when the terminal can show them, else plain ASCII.
_UNICODE_BAR = ("█", "░")
_ASCII_BAR = ("#", "-")
#: Characters of the bar in a terminal wide enough for it.
BAR_WIDTH = 30


def _bar_characters() -> tuple[str, str]:
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "".join(_UNICODE_BAR).encode(encoding)
    except (LookupError, UnicodeEncodeError):
        return _ASCII_BAR
    return _UNICODE_BAR


def render_bar(label: str, done: int, total: int, loss: float | None, columns: int) -> str:
    """One line of the bar, at most ``columns - 1`` characters (a line as wide as the terminal would wrap).

    Args:
        label: The run, e.g. ``"phase 2: resume with ddp_sharded"``.
        done: Steps done in the whole demo.
        total: Steps of the whole demo.
        loss: Rank 0's last loss (``None`` before the run's first step).
        columns: Width of the terminal.

    Returns:
        ``"<label>  ████░░░░  12/48 steps  loss 0.7234"``, the bar shortened to fit.
    """
    count = f"{done:>{len(str(total))}}/{total} steps"
    tail = f"  {count}  loss {loss:.4f}" if loss is not None else f"  {count}"
    # The bar keeps its width through the demo (its room for the loss is kept before the first step); it shrinks
    # only in a narrow terminal.
    room = columns - 1 - len(label) - len(f"  {count}  loss 0.0000") - 2
    width = max(min(BAR_WIDTH, room), 10)
    filled = width * done // total if total else width
    full, empty = _bar_characters()
    line = f"{label}  {full * filled}{empty * (width - filled)}{tail}"
    return line[: max(columns - 1, 1)]


def draw_bar(label: str, done: int, total: int, loss: float | None) -> None:
    """Redraws the bar over the current terminal line of standard output."""
    columns = shutil.get_terminal_size().columns
    line = render_bar(label, done, total, loss, columns)
    sys.stdout.write("\r" + line.ljust(columns - 1))
    sys.stdout.flush()


class DemoProgress:
    """The demo process's side of the display: counts steps over the runs and writes a line when one ends.

    Args:
        total_steps: Training steps of all runs together.
        live: Draw the bar (standard output is a terminal and progress was asked for); otherwise only the lines.
        label_width: Width of the longest run label: the bar starts in the same column for every run.
    """

    def __init__(self, total_steps: int, live: bool, label_width: int = 0) -> None:
        self.total_steps = total_steps
        self.live = live
        self.label_width = label_width
        self.done = 0
        self._label = ""
        self._started = 0.0

    def bar_label(self, label: str) -> str:
        """``label`` as the bar shows it (padded to the longest run label)."""
        return label.ljust(self.label_width)

    def begin(self, label: str) -> None:
        """A run starts: the bar shows its label at the steps done so far (the worker moves it on)."""
        self._label = label
        self._started = time.perf_counter()
        if self.live:
            draw_bar(self.bar_label(label), self.done, self.total_steps, None)
        sys.stdout.flush()  # workers are forked from this process: nothing buffered may be written twice

    def end(self, steps: int, detail: str, losses: list[float]) -> None:
        """The run trained ``steps`` steps: the bar is erased and one line says what the run did.

        Args:
            steps: Steps the run trained.
            detail: What it trained, e.g. ``"steps 9-16 from phase1-fsdp_fairscale/epoch=0.ckpt"``.
            losses: Rank 0's losses of the run (first and last are shown).
        """
        self.done += steps
        seconds = time.perf_counter() - self._started
        width = len(str(self.total_steps))
        loss = f", loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else ""
        line = f"[{self.done:>{width}}/{self.total_steps} steps] {self._label}, {detail}{loss} ({seconds:.1f} s)"
        if self.live:
            sys.stdout.write("\r" + " " * (shutil.get_terminal_size().columns - 1) + "\r")
        print(line, flush=True)

    def interrupted(self) -> None:
        """A run failed: the bar's line is ended, so the error starts on a line of its own."""
        if self.live:
            sys.stdout.write("\n")
            sys.stdout.flush()
