"""all_gather algorithms: ring, recursive doubling, Bruck and direct; shards may be uneven along `dim`."""
from __future__ import annotations

from typing import Sequence

import torch

from ..communicator import Communicator
from .point_to_point import PointToPoint
from .steps import (doubling_gather_flat, fold, fold_in, fold_out, offsets, restore, ring_all_gather_flat, row_size,
                    rows_first, super_block_starts)


def _gather_setup(tensor: torch.Tensor, dim: int, sizes: Sequence[int] | None, n: int):
    """(every rank's rows along `dim`, every rank's element count, this rank's shard flattened rows-first)."""
    rows = [tensor.shape[dim]] * n if sizes is None else list(sizes)
    row = row_size(tensor, dim)
    return rows, [s * row for s in rows], rows_first(tensor, dim).reshape(-1)


def _gather_buffer(mine: torch.Tensor, counts: list[int], rank: int) -> tuple[torch.Tensor, list[int]]:
    """The flat result buffer with this rank's block already in place, and every block's offset."""
    off = offsets(counts)
    buf = mine.new_empty(off[-1])
    buf[off[rank]:off[rank + 1]] = mine
    return buf, off


def ring_all_gather(comm: Communicator, tensor: torch.Tensor, dim: int = 0,
                    sizes: Sequence[int] | None = None) -> torch.Tensor:
    """n-1 steps, each passing one block to the next rank: bandwidth-optimal, latency (n-1) alpha."""
    p2p = PointToPoint(comm)
    rows, counts, mine = _gather_setup(tensor, dim, sizes, p2p.world_size)
    buf, _ = _gather_buffer(mine, counts, p2p.rank)
    ring_all_gather_flat(p2p, buf, counts)
    return restore(buf, sum(rows), tensor, dim)


def recursive_doubling_all_gather(comm: Communicator, tensor: torch.Tensor, dim: int = 0,
                                  sizes: Sequence[int] | None = None) -> torch.Tensor:
    """log2(n) exchanges of doubling size (non-powers of two folded in and out)."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    rows, counts, mine = _gather_setup(tensor, dim, sizes, n)
    buf, off = _gather_buffer(mine, counts, rank)
    p2, r, newrank = fold(n, rank)
    if rank < 2 * r:  # the even rank's block joins its odd neighbour's
        part = rank if rank % 2 == 0 else rank - 1
        fold_in(p2p, buf, r, None, slice(off[part], off[part + 1]))
    if newrank >= 0:
        bounds = [off[b] for b in super_block_starts(n, r, p2)]
        doubling_gather_flat(p2p, buf, bounds, newrank, r)
    fold_out(p2p, buf, r)
    return restore(buf, sum(rows), tensor, dim)


def direct_all_gather(comm: Communicator, tensor: torch.Tensor, dim: int = 0,
                      sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Every rank sends its block to every other at once: ring's bytes in one round of latency."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    rows, counts, mine = _gather_setup(tensor, dim, sizes, n)
    buf, off = _gather_buffer(mine, counts, rank)
    p2p.exchange_all([(mine, q) for q in range(n) if q != rank],
                     [(buf[off[q]:off[q + 1]], q) for q in range(n) if q != rank])
    return restore(buf, sum(rows), tensor, dim)


def bruck_all_gather(comm: Communicator, tensor: torch.Tensor, dim: int = 0,
                     sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Bruck: ceil(log2 n) steps for any n; step k sends the blocks held so far to rank - k."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    rows, counts, mine = _gather_setup(tensor, dim, sizes, n)
    held = [mine]  # held[j] is the block of rank (rank + j) % n
    k = 1
    while k < n:
        cnt = min(k, n - k)
        owners = [(rank + k + j) % n for j in range(cnt)]
        incoming = mine.new_empty(sum(counts[o] for o in owners))
        p2p.exchange(torch.cat(held[:cnt]), (rank - k) % n, incoming, (rank + k) % n)
        held.extend(incoming.split([counts[o] for o in owners]))
        k *= 2
    buf = torch.cat([held[(q - rank) % n] for q in range(n)])
    return restore(buf, sum(rows), tensor, dim)
