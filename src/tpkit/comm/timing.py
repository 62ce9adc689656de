"""Timing collectives fairly on a machine that may be shared: interleaved, time-budgeted, median.

Why: on a loaded box one call can take 10x another of the same kind. Timing A for a while and then B
compares two different loads. Here the candidates alternate call by call (each call starts after a
barrier, so every rank starts together), in an order shuffled every round (the same on every rank: seeded
by the round), so no candidate always runs right after the same other one (a gloo call leaves threads
behind that slow the next call down), and the number of rounds comes from a pilot round and a time budget,
agreed by all ranks (a MAX all-reduce), so no rank stops early.
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Callable, Sequence

import torch

from .communicator import Communicator
from .ops import ReduceOp


def interleaved_times(comm: Communicator, calls: Sequence[Callable[[], object]], budget_s: float = 1.0,
                      min_rounds: int = 3, max_rounds: int = 200, iters: int = 1,
                      sync: Callable[[], None] | None = None) -> list[list[float]]:
    """Seconds per call (mean over `iters` back-to-back calls) of each of `calls`, one list per call, as many
    rounds as fit in `budget_s` (at least `min_rounds`). Collective: every rank passes matching `calls`."""
    sync = sync or (lambda: None)

    def timed(call) -> float:
        comm.barrier()
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        sync()
        return (time.perf_counter() - start) / iters

    pilot = [timed(c) for c in calls]  # also the warm-up
    if comm.world_size > 1:
        pilot = comm.all_reduce(torch.tensor(pilot, dtype=torch.float64), op=ReduceOp.MAX).tolist()
    per_round = max(sum(pilot), 1e-6)
    rounds = int(min(max_rounds, max(min_rounds, budget_s / per_round)))
    samples: list[list[float]] = [[] for _ in calls]
    order = list(range(len(calls)))
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for j in order:
            samples[j].append(timed(calls[j]))
    return samples


def slowest_rank_medians(comm: Communicator, samples: list[list[float]]) -> list[float]:
    """The median of each candidate's samples, then the maximum over ranks (the time the group took)."""
    medians = [statistics.median(s) for s in samples]
    if comm.world_size == 1:
        return medians
    return comm.all_reduce(torch.tensor(medians, dtype=torch.float64), op=ReduceOp.MAX).tolist()
