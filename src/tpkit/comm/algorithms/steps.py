"""The steps the algorithms are assembled from, on flat buffers split into per-rank blocks.

`combine` reduces in place; the ring, halving and doubling steps move blocks between ranks; `fold`,
`fold_in` and `fold_out` handle non-powers of two (see the package docstring); the dim helpers move the
collective's `dim` to the front so that each rank's block is one contiguous range.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..ops import ReduceOp, divide_by_count
from .point_to_point import PointToPoint


def combine(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """`acc = acc (op) other`, in place (AVG accumulates a sum; the caller divides once at the end)."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return acc.add_(other)
    if op is ReduceOp.PRODUCT:
        return acc.mul_(other)
    if op is ReduceOp.MAX:
        return torch.maximum(acc, other, out=acc)
    return torch.minimum(acc, other, out=acc)


def finish_avg(out: torch.Tensor, op: ReduceOp, n: int) -> torch.Tensor:
    """Divide the accumulated sum by the number of ranks for AVG; other ops are done already."""
    return divide_by_count(out, n) if op is ReduceOp.AVG else out


def offsets(counts: Sequence[int]) -> list[int]:
    """Where each block starts, and the total at the end: [0, c0, c0 + c1, ...]."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


# -- non-powers of two ------------------------------------------------------------------------------
def fold(n: int, rank: int) -> tuple[int, int, int]:
    """(largest power of two <= n, number of folded pairs r, this rank's new rank or -1 if folded away)."""
    p2 = 1 << (n.bit_length() - 1)
    r = n - p2
    if rank < 2 * r:
        return p2, r, rank // 2 if rank % 2 else -1
    return p2, r, rank - r


def old_rank(newrank: int, r: int) -> int:
    """The rank (in the group) of new rank `newrank` after folding `r` pairs."""
    return 2 * newrank + 1 if newrank < r else newrank + r


def super_block_starts(n: int, r: int, p2: int) -> list[int]:
    """Old-block index where each new rank's range starts (new rank i < r covers blocks 2i and 2i+1)."""
    return [2 * i if i < r else i + r for i in range(p2)] + [n]


def fold_in(p2p: PointToPoint, buf: torch.Tensor, r: int, op: ReduceOp | None, part: slice | None = None) -> None:
    """Even ranks below 2r hand their data (all of `buf`, or `part`) to the odd rank above, which combines it."""
    rank = p2p.rank
    if rank >= 2 * r:
        return
    piece = buf if part is None else buf[part]
    if rank % 2 == 0:
        p2p.send(piece, rank + 1)
    elif op is None:
        p2p.recv(piece, rank - 1)
    else:
        incoming = torch.empty_like(piece)
        p2p.recv(incoming, rank - 1)
        combine(piece, incoming, op)


def fold_out(p2p: PointToPoint, buf: torch.Tensor, r: int, part: slice | None = None) -> None:
    """Odd ranks below 2r give the even rank below them its result (all of `buf`, or `part`)."""
    rank = p2p.rank
    if rank >= 2 * r:
        return
    piece = buf if part is None else buf[part]
    if rank % 2:
        p2p.send(piece, rank - 1)
    else:
        p2p.recv(piece, rank + 1)


# -- building blocks on flat buffers ----------------------------------------------------------------
def ring_reduce_scatter_flat(p2p: PointToPoint, buf: torch.Tensor, counts: list[int], op: ReduceOp) -> None:
    """After n-1 steps block `rank` of `buf` is fully reduced (other blocks hold partial sums)."""
    n, rank = p2p.world_size, p2p.rank
    off = offsets(counts)
    block = lambda i: buf[off[i]:off[i + 1]]  # noqa: E731
    tmp = buf.new_empty(max(counts))
    for step in range(n - 1):
        send_idx, recv_idx = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = tmp[:counts[recv_idx]]
        p2p.exchange(block(send_idx), (rank + 1) % n, incoming, (rank - 1) % n)
        combine(block(recv_idx), incoming, op)


def ring_all_gather_flat(p2p: PointToPoint, buf: torch.Tensor, counts: list[int],
                         order: Sequence[int] | None = None) -> None:
    """Fill every block of `buf` from the one at this rank's ring position; `order[i]` is the rank at position i."""
    n = p2p.world_size
    order = list(range(n)) if order is None else list(order)
    pos = order.index(p2p.rank)
    off = offsets(counts)
    for step in range(n - 1):
        send_idx, recv_idx = (pos - step) % n, (pos - step - 1) % n
        p2p.exchange(buf[off[send_idx]:off[send_idx + 1]], order[(pos + 1) % n],
                     buf[off[recv_idx]:off[recv_idx + 1]], order[(pos - 1) % n])


def halving_flat(p2p: PointToPoint, buf: torch.Tensor, bounds: list[int], newrank: int, r: int,
                 op: ReduceOp) -> None:
    """Recursive halving over the power-of-two new ranks: new rank i ends with range i of `bounds` reduced."""
    p2 = len(bounds) - 1
    lo, hi, mask = 0, p2, p2 >> 1
    tmp: torch.Tensor | None = None
    while mask:
        mid = (lo + hi) // 2
        if newrank & mask:
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        kept = buf[bounds[keep[0]]:bounds[keep[1]]]
        if tmp is None:  # later steps keep a part of this range, so this buffer is big enough for all
            tmp = buf.new_empty(kept.numel())
        incoming = tmp[:kept.numel()]
        p2p.exchange(buf[bounds[give[0]]:bounds[give[1]]], old_rank(newrank ^ mask, r), incoming,
                     old_rank(newrank ^ mask, r))
        combine(kept, incoming, op)
        lo, hi = keep
        mask >>= 1


def doubling_gather_flat(p2p: PointToPoint, buf: torch.Tensor, bounds: list[int], newrank: int, r: int) -> None:
    """Recursive doubling over the new ranks: each starts with range `newrank` of `bounds`, ends with all."""
    p2, mask = len(bounds) - 1, 1
    while mask < p2:
        partner = newrank ^ mask
        mine, theirs = newrank & ~(mask - 1), partner & ~(mask - 1)
        p2p.exchange(buf[bounds[mine]:bounds[mine + mask]], old_rank(partner, r),
                     buf[bounds[theirs]:bounds[theirs + mask]], old_rank(partner, r))
        mask <<= 1


def direct_reduce_block(p2p: PointToPoint, flat: torch.Tensor, counts: list[int], op: ReduceOp) -> torch.Tensor:
    """This rank's block reduced over all ranks, received from everyone at once and combined in rank order
    (so the result is bitwise what a rank-ordered reduction gives)."""
    n, rank = p2p.world_size, p2p.rank
    off = offsets(counts)
    mine = counts[rank]
    incoming = flat.new_empty((n, mine))
    p2p.exchange_all([(flat[off[q]:off[q + 1]], q) for q in range(n) if q != rank],
                     [(incoming[q], q) for q in range(n) if q != rank])
    incoming[rank] = flat[off[rank]:off[rank + 1]]
    acc = incoming[0].clone()
    for q in range(1, n):
        combine(acc, incoming[q], op)
    return acc


# -- dim handling -----------------------------------------------------------------------------------
def rows_first(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """`tensor` with `dim` moved to the front, contiguous (so a block of rows is a flat range)."""
    return (tensor if dim == 0 else tensor.movedim(dim, 0)).contiguous()


def restore(flat: torch.Tensor, rows: int, like: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of `rows_first`: `flat` as `rows` rows of `like`'s other dimensions, `dim` put back."""
    moved_shape = (rows,) + tuple(like.movedim(dim, 0).shape[1:])
    out = flat.reshape(moved_shape)
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def row_size(tensor: torch.Tensor, dim: int) -> int:
    """Elements in one index of `dim` (the product of the other dimensions)."""
    size = 1
    for d, s in enumerate(tensor.shape):
        if d != dim:
            size *= s
    return size
