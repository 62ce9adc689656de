"""all_reduce algorithms: ring, recursive doubling, Rabenseifner, binomial tree and direct."""
from __future__ import annotations

import torch

from ..communicator import Communicator
from ..ops import ReduceOp
from ...layout import split_sizes
from .broadcast import binomial_broadcast
from .point_to_point import PointToPoint
from .steps import (combine, direct_reduce_block, doubling_gather_flat, finish_avg, fold, fold_in, fold_out,
                    halving_flat, offsets, old_rank, ring_all_gather_flat, ring_reduce_scatter_flat)


def _flat_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A private flat copy to reduce into (the input is never modified)."""
    return tensor.detach().contiguous().clone().reshape(-1)


def ring_all_reduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """Ring reduce-scatter then ring all-gather: 2(n-1) steps, 2(n-1)/n of the bytes each way (bandwidth-optimal)."""
    p2p = PointToPoint(comm)
    work = _flat_copy(tensor)
    counts = split_sizes(work.numel(), p2p.world_size)
    ring_reduce_scatter_flat(p2p, work, counts, op)
    ring_all_gather_flat(p2p, work, counts)
    return finish_avg(work, op, p2p.world_size).reshape(tensor.shape)


def recursive_doubling_all_reduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """log2(n) exchanges of the whole vector: fewest steps, so best for short messages."""
    p2p = PointToPoint(comm)
    work = _flat_copy(tensor)
    p2, r, newrank = fold(p2p.world_size, p2p.rank)
    fold_in(p2p, work, r, op)
    if newrank >= 0:
        incoming, mask = torch.empty_like(work), 1
        while mask < p2:
            partner = old_rank(newrank ^ mask, r)
            p2p.exchange(work, partner, incoming, partner)
            combine(work, incoming, op)
            mask <<= 1
    fold_out(p2p, work, r)
    return finish_avg(work, op, p2p.world_size).reshape(tensor.shape)


def rabenseifner_all_reduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """Recursive-halving reduce-scatter + recursive-doubling all-gather: 2 log2(n) steps, ring's bandwidth."""
    p2p = PointToPoint(comm)
    work = _flat_copy(tensor)
    p2, r, newrank = fold(p2p.world_size, p2p.rank)
    fold_in(p2p, work, r, op)
    if newrank >= 0:
        bounds = offsets(split_sizes(work.numel(), p2))
        halving_flat(p2p, work, bounds, newrank, r, op)
        doubling_gather_flat(p2p, work, bounds, newrank, r)
    fold_out(p2p, work, r)
    return finish_avg(work, op, p2p.world_size).reshape(tensor.shape)


def binomial_reduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp, root: int = 0) -> torch.Tensor | None:
    """Binomial-tree reduce: `root` gets the (op-)combination of every rank's tensor (AVG: the sum, undivided
    until `tree_all_reduce`), other ranks get None. ceil(log2 n) steps of the whole vector."""
    p2p = PointToPoint(comm)
    n, vr = p2p.world_size, (p2p.rank - root) % p2p.world_size
    acc = _flat_copy(tensor)
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
    return finish_avg(out, op, comm.world_size)


def direct_all_reduce(comm: Communicator, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """Direct reduce-scatter then direct all-gather: ring's bytes in two rounds of latency (every message of a
    round in flight at once), for networks (or oversubscribed CPUs) where per-step latency dominates."""
    p2p = PointToPoint(comm)
    n, rank = p2p.world_size, p2p.rank
    flat = tensor.detach().contiguous().reshape(-1)
    counts = split_sizes(flat.numel(), n)
    off = offsets(counts)
    work = flat.new_empty(flat.numel())
    work[off[rank]:off[rank + 1]] = direct_reduce_block(p2p, flat, counts, op)
    p2p.exchange_all([(work[off[rank]:off[rank + 1]], q) for q in range(n) if q != rank],
                     [(work[off[q]:off[q + 1]], q) for q in range(n) if q != rank])
    return finish_avg(work, op, n).reshape(tensor.shape)
