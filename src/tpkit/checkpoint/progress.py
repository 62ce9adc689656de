"""A progress bar for loads and saves that take long enough to need one.

Shown on rank 0 only, on a terminal only, and only once the work has run for about a second (a tiny
checkpoint prints nothing). `TPKIT_NO_PROGRESS=1` or `progress=False` turns it off; `progress=True` forces it
on even without a TTY.
"""
from __future__ import annotations

import os
import sys
import time


class Progress:
    """`advance(nbytes)` as bytes are read or written; `close()` at the end."""

    def __init__(self, description: str, total: int, enabled: bool | None = None, rank: int = 0):
        if enabled is None:
            enabled = rank == 0 and sys.stderr.isatty() and os.environ.get("TPKIT_NO_PROGRESS", "0") != "1"
        self.description, self.total, self.enabled = description, max(int(total), 1), bool(enabled)
        self.start, self.done, self._bar, self._task = time.monotonic(), 0, None, None

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        if self._bar is None and time.monotonic() - self.start > 1.0:
            from rich.progress import (BarColumn, DownloadColumn, Progress as RichProgress, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), TimeRemainingColumn(), transient=True)
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
