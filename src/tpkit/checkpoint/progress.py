"""Progress of loads and saves that take long enough to need it.

Shown on rank 0 only. On a terminal: a bar (rich), and only once the work has run for about a second (a tiny
checkpoint prints nothing). Anywhere else (a log file, a pipe, a notebook's captured stderr) a bar is a stream
of cursor moves that ends up as blank lines, so there it is one plain line per tenth of the work instead.
Off by default without a terminal; `progress=True` turns it on anyway, `progress=False` or
`TPKIT_NO_PROGRESS=1` turns it off.
"""
from __future__ import annotations

import os
import sys
import time
from typing import TextIO

from ..tables import format_bytes

STEPS = 10  # lines written without a terminal: one per tenth


class Progress:
    """`advance(nbytes)` as bytes are read or written; `close()` at the end."""

    def __init__(self, description: str, total: int, enabled: bool | None = None, rank: int = 0,
                 stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stderr
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        if enabled is None:
            enabled = rank == 0 and tty and os.environ.get("TPKIT_NO_PROGRESS", "0") != "1"
        self.description, self.total, self.enabled = description, max(int(total), 1), bool(enabled)
        self.lines = self.enabled and not tty
        self.start, self.done, self._bar, self._task, self._step = time.monotonic(), 0, None, None, 0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        if self.lines:
            step = min(STEPS, self.done * STEPS // self.total)
            if step > self._step:
                self._step = step
                print(f"{self.description}: {100 * step // STEPS}% ({format_bytes(self.done)} of "
                      f"{format_bytes(self.total)}, {time.monotonic() - self.start:.1f} s)", file=self.stream, flush=True)
            return
        if self._bar is None and time.monotonic() - self.start > 1.0:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress as RichProgress, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), TimeRemainingColumn(), transient=True,
                                     console=Console(file=self.stream))
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
