"""reduce_scatter algorithms: ring, pairwise exchange, recursive halving and direct; pieces follow `sizes`
(default `split_sizes`) along `dim`."""
from __future__ import annotations

from typing import Sequence

import torch

from ..communicator import Communicator
from ..ops import ReduceOp
from ...layout import split_sizes
from .point_to_point import PointToPoint
from .steps import (combine, direct_reduce_block, finish_avg, fold, fold_in, fold_out, halving_flat, offsets, restore,
                    ring_reduce_scatter_flat, row_size, rows_first, super_block_starts)


def _scatter_setup(tensor: torch.Tensor, dim: int, sizes: Sequence[int] | None, n: int):
    """(every rank's rows along `dim`, every rank's element count, the input flattened rows-first)."""
    sizes = split_sizes(tensor.shape[dim], n) if sizes is None else list(sizes)
    row = row_size(tensor, dim)
    return sizes, [s * row for s in sizes], rows_first(tensor, dim).reshape(-1)


def _scatter_result(flat_block: torch.Tensor, sizes: Sequence[int], rank: int, like: torch.Tensor, dim: int,
                    op: ReduceOp) -> torch.Tensor:
    """This rank's reduced block (a view into a work buffer) as its own tensor of `like`'s layout."""
    out = finish_avg(flat_block.clone(), op, len(sizes))
    return restore(out, sizes[rank], like, dim)


def ring_reduce_scatter(comm: Communicator, tensor: torch.Tensor, op: ReduceOp, dim: int = 0,
                        sizes: Sequence[int] | None = None) -> torch.Tensor:
    """n-1 steps passing partial sums around the ring: (n-1)/n of the bytes, half of an all-reduce."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    sizes, counts, flat = _scatter_setup(tensor, dim, sizes, n)
    work = flat.clone()
    ring_reduce_scatter_flat(p2p, work, counts, op)
    off = offsets(counts)
    return _scatter_result(work[off[rank]:off[rank + 1]], sizes, rank, tensor, dim, op)


def pairwise_reduce_scatter(comm: Communicator, tensor: torch.Tensor, op: ReduceOp, dim: int = 0,
                            sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Pairwise exchange: step s sends rank+s its block and takes rank-s's piece of mine (MPICH, long messages)."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    sizes, counts, flat = _scatter_setup(tensor, dim, sizes, n)
    off = offsets(counts)
    acc = flat[off[rank]:off[rank + 1]].clone()
    incoming = torch.empty_like(acc)
    for step in range(1, n):
        dst, src = (rank + step) % n, (rank - step) % n
        p2p.exchange(flat[off[dst]:off[dst + 1]], dst, incoming, src)
        combine(acc, incoming, op)
    return restore(finish_avg(acc, op, n), sizes[rank], tensor, dim)


def direct_reduce_scatter(comm: Communicator, tensor: torch.Tensor, op: ReduceOp, dim: int = 0,
                          sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Pairwise exchange with every step in flight at once: (n-1)/n of the bytes in one round of latency."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    sizes, counts, flat = _scatter_setup(tensor, dim, sizes, n)
    acc = direct_reduce_block(p2p, flat, counts, op)
    return restore(finish_avg(acc, op, n), sizes[rank], tensor, dim)


def recursive_halving_reduce_scatter(comm: Communicator, tensor: torch.Tensor, op: ReduceOp, dim: int = 0,
                                     sizes: Sequence[int] | None = None) -> torch.Tensor:
    """log2(n) steps, each exchanging half of what is left (MPICH's short-message choice)."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    sizes, counts, flat = _scatter_setup(tensor, dim, sizes, n)
    off = offsets(counts)
    work = flat.clone()
    p2, r, newrank = fold(n, rank)
    fold_in(p2p, work, r, op)
    if newrank >= 0:
        bounds = [off[b] for b in super_block_starts(n, r, p2)]
        halving_flat(p2p, work, bounds, newrank, r, op)
    if rank < 2 * r:  # the odd rank reduced its even neighbour's block too; hand it over
        part = rank - 1 if rank % 2 else rank
        fold_out(p2p, work, r, slice(off[part], off[part + 1]))
    return _scatter_result(work[off[rank]:off[rank + 1]], sizes, rank, tensor, dim, op)
