"""Collective algorithms built from point-to-point messages (Thakur, Rabenseifner & Gropp 2005), plus
"direct" variants that post every message of a phase at once; `ALGORITHMS` is the registry by name.

Why: a backend's builtin collective is one fixed algorithm. torch's gloo `reduce_scatter` is an all-reduce
in disguise (it moves twice the bytes it needs), and no single algorithm is best at every size: few large
steps win for small messages (latency), bandwidth-optimal rings win for large ones. These are the classic
alternatives, each written over `send`/`recv` (`PointToPoint`) so it runs on every backend.

Every function takes a communicator and already-validated arguments (`AlgorithmCommunicator` checks them),
returns a new tensor, never modifies its input, and equals the builtin collective within rounding. AVG is
SUM followed by a division, as on gloo. Messages of zero elements are skipped on both sides (every rank
knows every block size), so uneven and empty shards work. Non-powers of two use the standard fold: among
the first `2r` ranks (`r = n - 2^floor(log2 n)`) each even rank hands its data to the odd rank above it,
the remaining power of two runs the algorithm, and the even ranks get their result back at the end.

One module per collective (`all_reduce`, `all_gather`, `reduce_scatter`, `broadcast`, `all_to_all`); the steps
they share are in `steps`.
"""
from __future__ import annotations

from typing import Callable

import torch

from .all_gather import bruck_all_gather, direct_all_gather, recursive_doubling_all_gather, ring_all_gather
from .all_to_all import direct_all_to_all, pairwise_all_to_all
from .all_reduce import (binomial_reduce, direct_all_reduce, rabenseifner_all_reduce, recursive_doubling_all_reduce,
                         ring_all_reduce, tree_all_reduce)
from .broadcast import binomial_broadcast, scatter_allgather_broadcast
from .point_to_point import PointToPoint
from .reduce_scatter import (direct_reduce_scatter, pairwise_reduce_scatter, recursive_halving_reduce_scatter,
                             ring_reduce_scatter)
from .steps import combine

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

ALGORITHMS: dict[str, dict[str, Callable[..., torch.Tensor]]] = {
    "all_reduce": {"ring": ring_all_reduce, "recursive_doubling": recursive_doubling_all_reduce,
                   "rabenseifner": rabenseifner_all_reduce, "tree": tree_all_reduce, "direct": direct_all_reduce},
    "all_gather": {"ring": ring_all_gather, "recursive_doubling": recursive_doubling_all_gather,
                   "bruck": bruck_all_gather, "direct": direct_all_gather},
    "reduce_scatter": {"ring": ring_reduce_scatter, "pairwise": pairwise_reduce_scatter,
                       "recursive_halving": recursive_halving_reduce_scatter, "direct": direct_reduce_scatter},
    "broadcast": {"binomial": binomial_broadcast, "scatter_allgather": scatter_allgather_broadcast},
    "all_to_all": {"pairwise": pairwise_all_to_all, "direct": direct_all_to_all},
}

__all__ = [
    "ALGORITHMS", "COLLECTIVES", "PointToPoint", "combine",
    "binomial_reduce", "direct_all_reduce", "rabenseifner_all_reduce", "recursive_doubling_all_reduce",
    "ring_all_reduce", "tree_all_reduce",
    "bruck_all_gather", "direct_all_gather", "recursive_doubling_all_gather", "ring_all_gather",
    "direct_reduce_scatter", "pairwise_reduce_scatter", "recursive_halving_reduce_scatter", "ring_reduce_scatter",
    "binomial_broadcast", "scatter_allgather_broadcast", "direct_all_to_all", "pairwise_all_to_all",
]
