"""The top setups of a search, run for real: several launches each, alternating, and which ones they cannot separate.

Why: one launch of a setup is one draw. On the 2-core box one plan run three ways differed by up to 16% between
launches (10-60 ms steps), so a search that ran each setup once picked whichever launch was lucky. Here each of the
top K runs `launches` times, the setups taking turns (the order reversed every other round, so no setup always runs
first or right after the same other one), each figure the median of its launches. Two setups whose launches'
ranges overlap are a tie: the launches cannot tell which is faster, and the search says so instead of pretending.
With one launch each, the estimate's own tie rule (`NOISE` of the median) is all there is.
"""
from __future__ import annotations

import statistics
from typing import Callable, Sequence


def run_alternating(count: int, launches: int, run: Callable[[int], float]) -> list[tuple[float, ...]]:
    """`run(i)` for i in range(count), `launches` rounds, the order reversed every other round; each i's seconds."""
    if launches < 1:
        raise ValueError(f"search: launches must be >= 1, got {launches}")
    times: list[list[float]] = [[] for _ in range(count)]
    for round_ in range(launches):
        for i in (range(count) if round_ % 2 == 0 else reversed(range(count))):
            times[i].append(run(i))
    return [tuple(t) for t in times]


def median(runs: Sequence[float]) -> float:
    return statistics.median(runs)


def inseparable(best: Sequence[float], other: Sequence[float], noise: float) -> bool:
    """Whether `other`'s launches cannot be told from `best`'s: their ranges overlap (two launches or more each),
    else (one launch) `other`'s time within `noise` of `best`'s."""
    if len(best) >= 2 and len(other) >= 2:
        return min(other) <= max(best)
    return median(other) <= median(best) * (1 + noise)


def runs_text(runs: Sequence[float]) -> str:
    """'12.30' for one launch, '12.30 (11.90-12.80)' for several: the median and the range, in ms."""
    text = f"{median(runs) * 1e3:.2f}"
    return text if len(runs) < 2 else f"{text} ({min(runs) * 1e3:.2f}-{max(runs) * 1e3:.2f})"
