"""What a conversion tells its user: one line on the `tpkit.convert` logger when layers stayed whole.

`parallelize` logs, once per conversion (on rank 0), "N modules kept whole: ..." with the commonest reasons
(`Plan.kept_whole()` has them all, per module), and "N modules split alone (output all-gathered): ..." for
layers that found no partner and pay an all-gather per call instead (`Plan.split_alone()`). It is a WARNING
when the plan was the planner's (`plan="auto"`): the user asked tpkit to split what it can, and these it could
not; an INFO line for a plan the user gave.
Silence it with `quiet_conversions()` for a block, or for good with the standard logging level:
`logging.getLogger("tpkit.convert").setLevel(logging.ERROR)`.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

from ..plan import Plan

logger = logging.getLogger("tpkit.convert")
_quiet = [0]  # open quiet_conversions() blocks, in any thread
_lock = threading.Lock()


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _quiet[0] == 0 or record.levelno >= logging.ERROR


logger.addFilter(_Quiet())


def log_kept_whole(plan: Plan, planned_automatically: bool, rank: int = 0) -> None:
    """Log the modules `plan` keeps whole (nothing when none is, or on ranks other than 0)."""
    kept, alone = plan.kept_whole(), plan.split_alone()
    if rank != 0 or not (kept or alone):
        return
    parts = ([f"{plan.kept_whole_summary()} (all of them: model.tp_plan.kept_whole())"] if kept else []) + (
        [f"{plan.split_alone_summary()} (all of them: model.tp_plan.split_alone())"] if alone else [])
    level = logging.WARNING if planned_automatically else logging.INFO
    logger.log(level, "tpkit.parallelize at %s ranks: %s (silence: tpkit.convert.quiet_conversions())",
               plan.world_size, "; ".join(parts))


@contextlib.contextmanager
def quiet_conversions() -> Iterator[None]:
    """While the block runs, conversions (on any thread: thread-ranks included) log nothing below ERROR. Blocks nest
    and may overlap across threads; the logger's own level is left alone."""
    with _lock:
        _quiet[0] += 1
    try:
        yield
    finally:
        with _lock:
            _quiet[0] -= 1
