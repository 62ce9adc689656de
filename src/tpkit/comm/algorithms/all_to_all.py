"""all_to_all algorithms: pairwise exchange and direct; sizes already resolved (`checks.check_all_to_all`).

Both move each piece once, straight from its sender's packed tensor into its receiver's flat buffer (the layout
is `comm/all_to_all.py`'s, the same as the builtin's), and keep this rank's own piece locally. Pieces of zero
elements are skipped on both sides, since every rank knows the sizes of what it sends and receives.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import all_to_all as a2a
from ..communicator import Communicator
from .point_to_point import PointToPoint


def _buffers(p2p: PointToPoint, tensor: torch.Tensor, sd: int, gd: int, ss: Sequence[int], gs: Sequence[int]):
    """(packed input, its piece bounds, the flat receive buffer with this rank's own piece in place, its bounds)."""
    packed = a2a.pack(tensor, sd)
    send = a2a.offsets(a2a.send_counts(tensor.shape, sd, ss))
    recv = a2a.offsets(a2a.recv_counts(tensor.shape, sd, gd, ss, gs, p2p.rank))
    flat = packed.new_empty(recv[-1])
    me = p2p.rank
    flat[recv[me]:recv[me + 1]] = packed[send[me]:send[me + 1]]
    return packed, send, flat, recv


def pairwise_all_to_all(comm: Communicator, tensor: torch.Tensor, scatter_dim: int, gather_dim: int,
                        scatter_sizes: Sequence[int], gather_sizes: Sequence[int]) -> torch.Tensor:
    """n-1 steps; step s sends rank+s its piece and receives rank-s's: one peer at a time (MPICH, long messages)."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    packed, send, flat, recv = _buffers(p2p, tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes)
    for step in range(1, n):
        dst, src = (rank + step) % n, (rank - step) % n
        p2p.exchange(packed[send[dst]:send[dst + 1]], dst, flat[recv[src]:recv[src + 1]], src)
    return a2a.unpack(flat, tensor.shape, scatter_dim, gather_dim, scatter_sizes, gather_sizes, rank)


def direct_all_to_all(comm: Communicator, tensor: torch.Tensor, scatter_dim: int, gather_dim: int,
                      scatter_sizes: Sequence[int], gather_sizes: Sequence[int]) -> torch.Tensor:
    """Every send and receive posted at once: the pairwise bytes in one round of latency (MPICH, medium)."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    packed, send, flat, recv = _buffers(p2p, tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes)
    p2p.exchange_all([(packed[send[q]:send[q + 1]], q) for q in range(n) if q != rank],
                     [(flat[recv[q]:recv[q + 1]], q) for q in range(n) if q != rank])
    return a2a.unpack(flat, tensor.shape, scatter_dim, gather_dim, scatter_sizes, gather_sizes, rank)
