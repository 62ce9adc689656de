"""Tokens to their experts and back: the all-to-all dispatch of one mixture-of-experts layer.

Each rank of an expert group holds a contiguous range of the experts (the split rule: 6 experts over 4 ranks hold
2, 2, 1, 1) and routes its own rows. For one layer:
1. each (row, choice) pair is sorted by its expert (stable), which also sorts it by the rank holding the expert;
2. the ranks exchange how many pairs each sends to each expert (one small all-to-all of counts), and the counts
   reach the host: the one device-to-host sync of the layer, outside any compiled region, which the row exchange
   needs for its sizes;
3. the rows are sent (`tpkit.nn.mappings.all_to_all`: its backward is the reverse exchange), regrouped from
   (source, expert) to (expert, source) order and run through the experts (`compute`: every local expert, even
   with no rows, so each takes part in every backward and its gradient is zeros, never None);
4. the results travel back by the reverse all-to-all, return to the pairs' own order, and are weighted by the
   routing weights and summed per row on the sender, so the router's gradient is computed where the router ran.

Nothing is dropped (no capacity factor): a rank receives whatever its experts were chosen for.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from ..comm.communicator import Communicator
from ..nn.mappings import all_to_all


@dataclasses.dataclass(frozen=True)
class ExpertOwners:
    """Which rank of the expert group holds which experts: rank r holds experts `starts[r]` to `starts[r + 1] - 1`."""

    starts: tuple[int, ...]

    @classmethod
    def split(cls, num_experts: int, ep: int) -> "ExpertOwners":
        from ..comm import split_sizes

        starts = [0]
        for n in split_sizes(num_experts, ep):
            starts.append(starts[-1] + n)
        return cls(tuple(starts))

    @property
    def counts(self) -> list[int]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]

    @property
    def num_experts(self) -> int:
        return self.starts[-1]


def _regroup(rows: torch.Tensor, sizes: Sequence[int], outer: int, inner: int) -> torch.Tensor:
    """`rows` cut into `outer` x `inner` consecutive chunks of `sizes` (outer-major), concatenated inner-major."""
    chunks = rows.split(list(sizes))
    return torch.cat([chunks[o * inner + i] for i in range(inner) for o in range(outer)])


def dispatch(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, comm: Communicator,
             owners: ExpertOwners, compute: Callable[[torch.Tensor, list[int]], torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output for this rank's rows `hidden` [n, H], routed to experts `index` [n, k] (global expert
    numbers) with `weights` [n, k]: `sum_j weights[:, j] * expert[index[:, j]](hidden)`; and how many of this
    rank's choices went to each expert [E]. `compute(rows, counts)` runs this rank's experts on `rows` sorted by
    local expert, `counts[e]` rows each."""
    ep, mine = comm.world_size, owners.counts[comm.rank]
    counts = torch.bincount(index.reshape(-1), minlength=owners.num_experts)
    received = comm.all_to_all(counts, 0, 0, owners.counts, [mine] * ep)
    sizes = torch.cat([counts, received]).tolist()  # the layer's one sync: the exchange below needs its sizes
    return exchange(hidden, index, weights, comm, owners, compute, sizes[:owners.num_experts],
                    sizes[owners.num_experts:]), counts


def exchange(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, comm: Communicator,
             owners: ExpertOwners, compute: Callable[[torch.Tensor, list[int]], torch.Tensor],
             sent_per_expert: Sequence[int], got: Sequence[int]) -> torch.Tensor:
    """`dispatch` once the sizes are known: `sent_per_expert[e]` of this rank's (row, choice) pairs go to expert e,
    `got[i * mine + e]` pairs come from rank i for local expert e. (The estimates trace this very exchange with the
    sizes uniform routing gives: `tpkit.estimate.experts`.)"""
    n, k = index.shape
    ep, mine = comm.world_size, owners.counts[comm.rank]
    order = torch.argsort(index.reshape(-1), stable=True)
    send = [sum(sent_per_expert[a:b]) for a, b in zip(owners.starts, owners.starts[1:])]
    recv = [sum(got[i * mine:(i + 1) * mine]) for i in range(ep)]
    rows = all_to_all(hidden.index_select(0, order // k), comm, 0, 0, send, recv)
    by_expert = _regroup(rows, got, ep, mine)
    per_expert = [sum(got[i * mine + e] for i in range(ep)) for e in range(mine)]
    out = compute(by_expert, per_expert)
    back_sizes = [got[i * mine + e] for e in range(mine) for i in range(ep)]
    back = all_to_all(_regroup(out, back_sizes, mine, ep), comm, 0, 0, recv, send)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    pairs = back.index_select(0, inverse).view(n, k, hidden.shape[-1])  # n may be 0 (fewer rows than tp ranks)
    return (pairs * weights.unsqueeze(-1).to(pairs.dtype)).sum(1).to(hidden.dtype)
