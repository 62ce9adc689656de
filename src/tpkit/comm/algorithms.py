"""Collective algorithms built from point-to-point messages (Thakur, Rabenseifner & Gropp 2005), plus
"direct" variants that post every message of a phase at once.

Why: a backend's builtin collective is one fixed algorithm. torch's gloo `reduce_scatter` is an all-reduce
in disguise (it moves twice the bytes it needs), and no single algorithm is best at every size: few large
steps win for small messages (latency), bandwidth-optimal rings win for large ones. These are the classic
alternatives, each written over `send`/`recv` so it runs on every backend.

Every function takes a communicator and already-validated arguments (`AlgorithmCommunicator` checks them),
returns a new tensor, never modifies its input, and equals the builtin collective within rounding. AVG is
SUM followed by a division, as on gloo. Messages of zero elements are skipped on both sides (every rank
knows every block size), so uneven and empty shards work. Non-powers of two use the standard fold: among
the first `2r` ranks (`r = n - 2^floor(log2 n)`) each even rank hands its data to the odd rank above it,
the remaining power of two runs the algorithm, and the even ranks get their result back at the end.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .communicator import Communicator
from .ops import ReduceOp, divide_by_count
from .sharding import split_sizes

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


# -- point to point ---------------------------------------------------------------------------------
class PointToPoint:
    """Paired send/recv that cannot deadlock.

    On torch process groups both directions are posted at once (`irecv` + `isend`, then wait), since a
    blocking gloo `send` may wait for its receiver. Other backends' `send` is buffered (threads), so a
    send followed by a recv is safe there.
    """

    def __init__(self, comm: Communicator):
        base = getattr(comm, "base", comm)
        self.comm = base
        self.rank = base.rank
        self.world_size = base.world_size
        self._group = getattr(base, "process_group", None)
        if self._group is not None:
            import torch.distributed as dist

            self._dist = dist
            self._global = dist.get_process_group_ranks(self._group)

    def exchange(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int) -> None:
        """Send `send` to `dst` and receive into `recv` from `src` (either may be None or empty)."""
        send = send if send is not None and send.numel() else None
        recv = recv if recv is not None and recv.numel() else None
        if self._group is not None:
            works = []
            if recv is not None:
                works.append(self._dist.irecv(recv, self._global[src], group=self._group))
            if send is not None:
                works.append(self._dist.isend(send, self._global[dst], group=self._group))
            for work in works:
                work.wait()
            return
        if send is not None:
            self.comm.send(send, dst)
        if recv is not None:
            self.comm.recv(recv, src)

    def exchange_all(self, sends: Sequence[tuple[torch.Tensor, int]],
                     recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
        """Post every receive and send at once, then wait for all: one round of latency, not one per peer."""
        sends = [(t, d) for t, d in sends if t.numel()]
        recvs = [(t, s) for t, s in recvs if t.numel()]
        if self._group is not None:
            works = [self._dist.irecv(t, self._global[s], group=self._group) for t, s in recvs]
            works += [self._dist.isend(t, self._global[d], group=self._group) for t, d in sends]
            for work in works:
                work.wait()
            return
        for t, d in sends:
            self.comm.send(t, d)
        for t, s in recvs:
            self.comm.recv(t, s)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.exchange(tensor, dst, None, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self.exchange(None, src, tensor, src)


def combine(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """`acc = acc (op) other`, in place (AVG accumulates a sum; the caller divides once at the end)."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return acc.add_(other)
    if op is ReduceOp.PRODUCT:
        return acc.mul_(other)
    if op is ReduceOp.MAX:
        return torch.maximum(acc, other, out=acc)
    return torch.minimum(acc, other, out=acc)


def _offsets(counts: Sequence[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def _fold(n: int, rank: int) -> tuple[int, int, int]:
    """(largest power of two <= n, number of folded pairs r, this rank's new rank or -1 if folded away)."""
    p2 = 1 << (n.bit_length() - 1)
    r = n - p2
    if rank < 2 * r:
        return p2, r, rank // 2 if rank % 2 else -1
    return p2, r, rank - r


def _old_rank(newrank: int, r: int) -> int:
    return 2 * newrank + 1 if newrank < r else newrank + r


def _super_block_starts(n: int, r: int, p2: int) -> list[int]:
    """Old-block index where each new rank's range starts (new rank i < r covers blocks 2i and 2i+1)."""
    return [2 * i if i < r else i + r for i in range(p2)] + [n]


# -- building blocks on flat buffers ----------------------------------------------------------------
def _ring_reduce_scatter_flat(p2p: PointToPoint, buf: torch.Tensor, counts: list[int], op: ReduceOp) -> None:
    """After n-1 steps block `rank` of `buf` is fully reduced (other blocks hold partial sums)."""
    n, rank = p2p.world_size, p2p.rank
    off = _offsets(counts)
    block = lambda i: buf[off[i]:off[i + 1]]  # noqa: E731
    tmp = buf.new_empty(max(counts))
    for step in range(n - 1):
        send_idx, recv_idx = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = tmp[:counts[recv_idx]]
        p2p.exchange(block(send_idx), (rank + 1) % n, incoming, (rank - 1) % n)
        combine(block(recv_idx), incoming, op)


def _ring_all_gather_flat(p2p: PointToPoint, buf: torch.Tensor, counts: list[int],
                          order: Sequence[int] | None = None) -> None:
    """Fill every block of `buf` from the one at this rank's ring position; `order[i]` is the rank at position i."""
    n = p2p.world_size
    order = list(range(n)) if order is None else list(order)
    pos = order.index(p2p.rank)
    off = _offsets(counts)
    for step in range(n - 1):
        send_idx, recv_idx = (pos - step) % n, (pos - step - 1) % n
        p2p.exchange(buf[off[send_idx]:off[send_idx + 1]], order[(pos + 1) % n],
                     buf[off[recv_idx]:off[recv_idx + 1]], order[(pos - 1) % n])


def _halving_flat(p2p: PointToPoint, buf: torch.Tensor, bounds: list[int], newrank: int, r: int,
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
        p2p.exchange(buf[bounds[give[0]]:bounds[give[1]]], _old_rank(newrank ^ mask, r), incoming,
                     _old_rank(newrank ^ mask, r))
        combine(kept, incoming, op)
        lo, hi = keep
        mask >>= 1


def _doubling_gather_flat(p2p: PointToPoint, buf: torch.Tensor, bounds: list[int], newrank: int, r: int) -> None:
    """Recursive doubling over the new ranks: each starts with range `newrank` of `bounds`, ends with all."""
    p2, mask = len(bounds) - 1, 1
    while mask < p2:
        partner = newrank ^ mask
        mine, theirs = newrank & ~(mask - 1), partner & ~(mask - 1)
        p2p.exchange(buf[bounds[mine]:bounds[mine + mask]], _old_rank(partner, r),
                     buf[bounds[theirs]:bounds[theirs + mask]], _old_rank(partner, r))
        mask <<= 1


def _fold_in(p2p: PointToPoint, buf: torch.Tensor, r: int, op: ReduceOp | None, part: slice | None = None) -> None:
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


def _fold_out(p2p: PointToPoint, buf: torch.Tensor, r: int, part: slice | None = None) -> None:
    """Odd ranks below 2r give the even rank below them its result (all of `buf`, or `part`)."""
    rank = p2p.rank
    if rank >= 2 * r:
        return
    piece = buf if part is None else buf[part]
    if rank % 2:
        p2p.send(piece, rank - 1)
    else:
        p2p.recv(piece, rank + 1)


def _finish_avg(out: torch.Tensor, op: ReduceOp, n: int) -> torch.Tensor:
    return divide_by_count(out, n) if op is ReduceOp.AVG else out


# -- dim handling -----------------------------------------------------------------------------------
def _rows_first(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    return (tensor if dim == 0 else tensor.movedim(dim, 0)).contiguous()


def _restore(flat: torch.Tensor, rows: int, like: torch.Tensor, dim: int) -> torch.Tensor:
    moved_shape = (rows,) + tuple(like.movedim(dim, 0).shape[1:])
    out = flat.reshape(moved_shape)
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def _row_size(tensor: torch.Tensor, dim: int) -> int:
    size = 1
    for d, s in enumerate(tensor.shape):
        if d != dim:
            size *= s
    return size


# -- all_reduce -------------------------------------------------------------------------------------
def ring_all_reduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """Ring reduce-scatter then ring all-gather: 2(n-1) steps, 2(n-1)/n of the bytes each way (bandwidth-optimal)."""
    p2p = PointToPoint(comm)
    work = tensor.detach().contiguous().clone().reshape(-1)
    counts = split_sizes(work.numel(), p2p.world_size)
    _ring_reduce_scatter_flat(p2p, work, counts, op)
    _ring_all_gather_flat(p2p, work, counts)
    return _finish_avg(work, op, p2p.world_size).reshape(tensor.shape)


def recursive_doubling_all_reduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """log2(n) exchanges of the whole vector: fewest steps, so best for short messages."""
    p2p = PointToPoint(comm)
    work = tensor.detach().contiguous().clone().reshape(-1)
    p2, r, newrank = _fold(p2p.world_size, p2p.rank)
    _fold_in(p2p, work, r, op)
    if newrank >= 0:
        incoming, mask = torch.empty_like(work), 1
        while mask < p2:
            partner = _old_rank(newrank ^ mask, r)
            p2p.exchange(work, partner, incoming, partner)
            combine(work, incoming, op)
            mask <<= 1
    _fold_out(p2p, work, r)
    return _finish_avg(work, op, p2p.world_size).reshape(tensor.shape)


def rabenseifner_all_reduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """Recursive-halving reduce-scatter + recursive-doubling all-gather: 2 log2(n) steps, ring's bandwidth."""
    p2p = PointToPoint(comm)
    work = tensor.detach().contiguous().clone().reshape(-1)
    p2, r, newrank = _fold(p2p.world_size, p2p.rank)
    _fold_in(p2p, work, r, op)
    if newrank >= 0:
        bounds = _offsets(split_sizes(work.numel(), p2))
        _halving_flat(p2p, work, bounds, newrank, r, op)
        _doubling_gather_flat(p2p, work, bounds, newrank, r)
    _fold_out(p2p, work, r)
    return _finish_avg(work, op, p2p.world_size).reshape(tensor.shape)


def binomial_reduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp, root: int = 0) -> torch.Tensor | None:
    """Binomial-tree reduce: `root` gets the (op-)combination of every rank's tensor (AVG: the sum, undivided
    until `tree_all_reduce`), other ranks get None. ceil(log2 n) steps of the whole vector."""
    p2p = PointToPoint(comm)
    n, vr = p2p.world_size, (p2p.rank - root) % p2p.world_size
    acc = tensor.detach().contiguous().clone().reshape(-1)
    incoming, mask = torch.empty_like(acc), 1
    while mask < n:
        if vr & mask:
            p2p.send(acc, (vr - mask + root) % n)
            return None
        if vr + mask < n:
            p2p.recv(incoming, (vr + mask + root) % n)
            combine(acc, incoming, op)
        mask <<= 1
    return acc.reshape(tensor.shape)


def tree_all_reduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """Binomial reduce to rank 0, then binomial broadcast: 2 ceil(log2 n) whole-vector steps."""
    reduced = binomial_reduce(comm, tensor, op, root=0)
    if reduced is None:
        reduced = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    out = binomial_broadcast(comm, reduced, 0)
    return _finish_avg(out, op, comm.world_size)


def direct_all_reduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """Direct reduce-scatter then direct all-gather: ring's bytes in two rounds of latency (every message of a
    round in flight at once), for networks (or oversubscribed CPUs) where per-step latency dominates."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    flat = tensor.detach().contiguous().reshape(-1)
    counts = split_sizes(flat.numel(), n)
    off = _offsets(counts)
    work = flat.new_empty(flat.numel())
    work[off[rank]:off[rank + 1]] = _direct_reduce_block(p2p, flat, counts, op)
    p2p.exchange_all([(work[off[rank]:off[rank + 1]], q) for q in range(n) if q != rank],
                     [(work[off[q]:off[q + 1]], q) for q in range(n) if q != rank])
    return _finish_avg(work, op, n).reshape(tensor.shape)


def _direct_reduce_block(p2p: PointToPoint, flat: torch.Tensor, counts: list[int], op: ReduceOp) -> torch.Tensor:
    """This rank's block reduced over all ranks, received from everyone at once and combined in rank order
    (so the result is bitwise what a rank-ordered reduction gives)."""
    n, rank = p2p.world_size, p2p.rank
    off = _offsets(counts)
    mine = counts[rank]
    incoming = flat.new_empty((n, mine))
    p2p.exchange_all([(flat[off[q]:off[q + 1]], q) for q in range(n) if q != rank],
                     [(incoming[q], q) for q in range(n) if q != rank])
    incoming[rank] = flat[off[rank]:off[rank + 1]]
    acc = incoming[0].clone()
    for q in range(1, n):
        combine(acc, incoming[q], op)
    return acc


def _root_copy_or_buffer(tensor: torch.Tensor, is_root: bool) -> torch.Tensor:
    if is_root:
        return tensor.detach().contiguous().clone()
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


# -- broadcast --------------------------------------------------------------------------------------
def binomial_broadcast(comm: Communicator, tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Binomial tree from `src`: ceil(log2 n) steps of the whole vector (MPICH's short-message choice)."""
    p2p = PointToPoint(comm)
    n, vr = p2p.world_size, (p2p.rank - src) % p2p.world_size
    out = _root_copy_or_buffer(tensor, vr == 0)
    flat, mask = out.reshape(-1), 1
    while mask < n:
        if vr & mask:
            p2p.recv(flat, (vr - mask + src) % n)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < n:
            p2p.send(flat, (vr + mask + src) % n)
        mask >>= 1
    return out


def scatter_allgather_broadcast(comm: Communicator, tensor: torch.Tensor, src: int) -> torch.Tensor:
    """van de Geijn: binomial scatter of n chunks, then ring all-gather; ~2x one copy's bytes, for long messages."""
    p2p = PointToPoint(comm)
    n, vr = p2p.world_size, (p2p.rank - src) % p2p.world_size
    out = _root_copy_or_buffer(tensor, vr == 0)
    flat = out.reshape(-1)
    off = _offsets(split_sizes(flat.numel(), n))  # chunk i belongs to relative rank i
    real = lambda v: (v + src) % n  # noqa: E731
    mask = 1
    while mask < n:  # receive my subtree's chunks [vr, vr + lowbit(vr)) from my parent
        if vr & mask:
            p2p.recv(flat[off[vr]:off[min(vr + mask, n)]], real(vr - mask))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < n:
            p2p.send(flat[off[vr + mask]:off[min(vr + 2 * mask, n)]], real(vr + mask))
        mask >>= 1
    _ring_all_gather_flat(p2p, flat, [off[i + 1] - off[i] for i in range(n)], [real(v) for v in range(n)])
    return out


# -- all_gather -------------------------------------------------------------------------------------
def _gather_setup(tensor: torch.Tensor, dim: int, sizes: Sequence[int] | None, n: int):
    rows = [tensor.shape[dim]] * n if sizes is None else list(sizes)
    row = _row_size(tensor, dim)
    return rows, [s * row for s in rows], _rows_first(tensor, dim).reshape(-1)


def _gather_buffer(mine: torch.Tensor, counts: list[int], rank: int) -> tuple[torch.Tensor, list[int]]:
    """The flat result buffer with this rank's block already in place, and every block's offset."""
    off = _offsets(counts)
    buf = mine.new_empty(off[-1])
    buf[off[rank]:off[rank + 1]] = mine
    return buf, off


def ring_all_gather(comm: Communicator, tensor: torch.Tensor, dim: int = 0,
                    sizes: Sequence[int] | None = None) -> torch.Tensor:
    """n-1 steps, each passing one block to the next rank: bandwidth-optimal, latency (n-1) alpha."""
    p2p = PointToPoint(comm)
    rows, counts, mine = _gather_setup(tensor, dim, sizes, p2p.world_size)
    buf, _ = _gather_buffer(mine, counts, p2p.rank)
    _ring_all_gather_flat(p2p, buf, counts)
    return _restore(buf, sum(rows), tensor, dim)


def recursive_doubling_all_gather(comm: Communicator, tensor: torch.Tensor, dim: int = 0,
                                  sizes: Sequence[int] | None = None) -> torch.Tensor:
    """log2(n) exchanges of doubling size (non-powers of two folded in and out)."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    rows, counts, mine = _gather_setup(tensor, dim, sizes, n)
    buf, off = _gather_buffer(mine, counts, rank)
    p2, r, newrank = _fold(n, rank)
    if rank < 2 * r:  # the even rank's block joins its odd neighbour's
        part = rank if rank % 2 == 0 else rank - 1
        _fold_in(p2p, buf, r, None, slice(off[part], off[part + 1]))
    if newrank >= 0:
        bounds = [off[b] for b in _super_block_starts(n, r, p2)]
        _doubling_gather_flat(p2p, buf, bounds, newrank, r)
    _fold_out(p2p, buf, r)
    return _restore(buf, sum(rows), tensor, dim)


def direct_all_gather(comm: Communicator, tensor: torch.Tensor, dim: int = 0,
                      sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Every rank sends its block to every other at once: ring's bytes in one round of latency."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    rows, counts, mine = _gather_setup(tensor, dim, sizes, n)
    buf, off = _gather_buffer(mine, counts, rank)
    p2p.exchange_all([(mine, q) for q in range(n) if q != rank],
                     [(buf[off[q]:off[q + 1]], q) for q in range(n) if q != rank])
    return _restore(buf, sum(rows), tensor, dim)


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
    return _restore(buf, sum(rows), tensor, dim)


# -- reduce_scatter ---------------------------------------------------------------------------------
def _scatter_setup(tensor: torch.Tensor, dim: int, sizes: Sequence[int], n: int):
    row = _row_size(tensor, dim)
    return [s * row for s in sizes], _rows_first(tensor, dim).reshape(-1)


def _scatter_result(flat_block: torch.Tensor, sizes: Sequence[int], rank: int, like: torch.Tensor, dim: int,
                    op: ReduceOp) -> torch.Tensor:
    out = _finish_avg(flat_block.clone(), op, len(sizes))
    return _restore(out, sizes[rank], like, dim)


def ring_reduce_scatter(comm: Communicator, tensor: torch.Tensor, op: ReduceOp, dim: int = 0,
                        sizes: Sequence[int] | None = None) -> torch.Tensor:
    """n-1 steps passing partial sums around the ring: (n-1)/n of the bytes, half of an all-reduce."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    sizes = split_sizes(tensor.shape[dim], n) if sizes is None else list(sizes)
    counts, flat = _scatter_setup(tensor, dim, sizes, n)
    work = flat.clone()
    _ring_reduce_scatter_flat(p2p, work, counts, op)
    off = _offsets(counts)
    return _scatter_result(work[off[rank]:off[rank + 1]], sizes, rank, tensor, dim, op)


def pairwise_reduce_scatter(comm: Communicator, tensor: torch.Tensor, op: ReduceOp, dim: int = 0,
                            sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Pairwise exchange: step s sends rank+s its block and takes rank-s's piece of mine (MPICH, long messages)."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    sizes = split_sizes(tensor.shape[dim], n) if sizes is None else list(sizes)
    counts, flat = _scatter_setup(tensor, dim, sizes, n)
    off = _offsets(counts)
    acc = flat[off[rank]:off[rank + 1]].clone()
    incoming = torch.empty_like(acc)
    for step in range(1, n):
        dst, src = (rank + step) % n, (rank - step) % n
        p2p.exchange(flat[off[dst]:off[dst + 1]], dst, incoming, src)
        combine(acc, incoming, op)
    return _restore(_finish_avg(acc, op, n), sizes[rank], tensor, dim)


def direct_reduce_scatter(comm: Communicator, tensor: torch.Tensor, op: ReduceOp, dim: int = 0,
                          sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Pairwise exchange with every step in flight at once: (n-1)/n of the bytes in one round of latency."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    sizes = split_sizes(tensor.shape[dim], n) if sizes is None else list(sizes)
    counts, flat = _scatter_setup(tensor, dim, sizes, n)
    acc = _direct_reduce_block(p2p, flat, counts, op)
    return _restore(_finish_avg(acc, op, n), sizes[rank], tensor, dim)


def recursive_halving_reduce_scatter(comm: Communicator, tensor: torch.Tensor, op: ReduceOp, dim: int = 0,
                                     sizes: Sequence[int] | None = None) -> torch.Tensor:
    """log2(n) steps, each exchanging half of what is left (MPICH's short-message choice)."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    sizes = split_sizes(tensor.shape[dim], n) if sizes is None else list(sizes)
    counts, flat = _scatter_setup(tensor, dim, sizes, n)
    off = _offsets(counts)
    work = flat.clone()
    p2, r, newrank = _fold(n, rank)
    _fold_in(p2p, work, r, op)
    if newrank >= 0:
        bounds = [off[b] for b in _super_block_starts(n, r, p2)]
        _halving_flat(p2p, work, bounds, newrank, r, op)
    if rank < 2 * r:  # the odd rank reduced its even neighbour's block too; hand it over
        part = rank - 1 if rank % 2 else rank
        _fold_out(p2p, work, r, slice(off[part], off[part + 1]))
    return _scatter_result(work[off[rank]:off[rank + 1]], sizes, rank, tensor, dim, op)


ALGORITHMS: dict[str, dict[str, Callable[..., torch.Tensor]]] = {
    "all_reduce": {"ring": ring_all_reduce, "recursive_doubling": recursive_doubling_all_reduce,
                   "rabenseifner": rabenseifner_all_reduce, "tree": tree_all_reduce, "direct": direct_all_reduce},
    "all_gather": {"ring": ring_all_gather, "recursive_doubling": recursive_doubling_all_gather,
                   "bruck": bruck_all_gather, "direct": direct_all_gather},
    "reduce_scatter": {"ring": ring_reduce_scatter, "pairwise": pairwise_reduce_scatter,
                       "recursive_halving": recursive_halving_reduce_scatter, "direct": direct_reduce_scatter},
    "broadcast": {"binomial": binomial_broadcast, "scatter_allgather": scatter_allgather_broadcast},
}


def algorithm_names(collective: str) -> list[str]:
    """The algorithms of `collective` (not counting "builtin")."""
    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(ALGORITHMS)}")
    return list(ALGORITHMS[collective])
