"""Laying ranks out in groups: data x tensor parallel (`split`), and the 4-D layout (`groups`).

`groups(comm, tp=, cp=1, pp=1)` cuts the world as pp x dp x cp x tp, tensor parallelism innermost: world rank
`w = ((p * dp + d) * cp + c) * tp + t`. The tp ranks of one replica are consecutive (they usually share a node,
where the bandwidth is: TP all-reduces every layer), the context-parallel ranks come next (they exchange K/V or
heads every attention layer), then the data-parallel replicas, and the pipeline stages outermost. With cp = 1
this is exactly `split` (pp = 1) and `tpkit.pipeline_groups` (both stay). Ranks 0..7 at dp2 x cp2 x tp2: tp
{0,1} {2,3} {4,5} {6,7}; cp {0,2} {1,3} {4,6} {5,7}; dp {0,4} {1,5} {2,6} {3,7}; dp x cp {0,2,4,6} {1,3,5,7}.

Expert parallelism (`ep`) is carved out of one stage's dp x cp x tp ranks, as Megatron's "parallel folding": the
stage's ranks in layout order (tp fastest) are cut into expert groups of `ep` consecutive ranks, so an expert
group holds ep / tp whole tp groups (ep must be a multiple of tp, and dp x cp x tp a multiple of ep). Each expert
group holds every expert once; the ranks at the same place of every expert group (the expert-data group, `edp`,
dp x cp x tp / ep of them) hold the same experts. At dp2 x cp2 x tp2 with ep 4: ep {0,1,2,3} {4,5,6,7}; edp {0,4}
{1,5} {2,6} {3,7}.
"""
from __future__ import annotations

import dataclasses
import itertools

from .communicator import Communicator


def split(comm: Communicator, tp_size: int) -> tuple[Communicator, Communicator]:
    """Cut `comm` into tensor-parallel groups of `tp_size` consecutive ranks and the data-parallel groups
    across them; return this rank's `(tp_group, dp_group)`.

    Ranks 0..3 with tp_size 2: tp groups {0,1} {2,3}; dp groups {0,2} {1,3}. Consecutive ranks share a
    tensor-parallel group because they usually share a node, where the bandwidth is. Collective over `comm`.
    """
    n = comm.world_size
    if not isinstance(tp_size, int) or tp_size < 1 or n % tp_size:
        valid = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(f"split: tp_size {tp_size!r} does not divide the world size {n}; valid tp sizes: {valid}")
    tp_group = dp_group = None
    for start in range(0, n, tp_size):
        group = comm.new_group(range(start, start + tp_size))
        tp_group = group if group is not None else tp_group
    for offset in range(tp_size):
        group = comm.new_group(range(offset, n, tp_size))
        dp_group = group if group is not None else dp_group
    assert tp_group is not None and dp_group is not None
    return tp_group, dp_group


AXES = ("pp", "dp", "cp", "tp")  # outermost first: the order of a world rank's digits


@dataclasses.dataclass(frozen=True)
class Groups:
    """This rank's groups in the pp x dp x cp x tp layout (see the module docstring). `dp_cp` holds the ranks
    that keep replicas of the same weights in one stage: gradients and FSDP2 shards run over it."""

    tp: Communicator
    cp: Communicator
    dp: Communicator
    pp: Communicator
    dp_cp: Communicator
    ep: Communicator | None = None   # the expert group (None without expert parallelism)
    edp: Communicator | None = None  # the ranks holding the same experts as this one

    def size(self, axis: str) -> int:
        return getattr(self, axis).world_size


def layout_ranks(sizes: dict[str, int], along: tuple[str, ...]) -> list[list[int]]:
    """The world ranks of every group spanning the axes `along` (the other axes fixed), in creation order."""
    fixed = [a for a in AXES if a not in along]
    groups = []
    for outer in itertools.product(*(range(sizes[a]) for a in fixed)):
        coords = dict(zip(fixed, outer))
        members = []
        for inner in itertools.product(*(range(sizes[a]) for a in along)):
            coords.update(zip(along, inner))
            w = 0
            for a in AXES:
                w = w * sizes[a] + coords[a]
            members.append(w)
        groups.append(sorted(members))
    return groups


def expert_ranks(world: int, pp: int, tp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """`(the expert groups, the expert-data groups)` as world ranks: each stage's ranks cut into runs of `ep`
    (see the module docstring). Checks the sizes, naming what would fix them."""
    stage = world // pp
    if ep % tp or stage % ep:
        valid = [d for d in range(tp, stage + 1, tp) if stage % d == 0]
        why = (f"is not a multiple of tp {tp} (an expert group holds whole tp groups: each tp rank dispatches its own "
               f"share of the rows)" if ep % tp else f"does not divide a stage's dp x cp x tp = {stage} ranks")
        raise ValueError(f"groups: ep {ep} {why}; with tp {tp} and {stage} ranks per stage choose ep among {valid}")
    ep_groups = [list(range(s + b, s + b + ep)) for s in range(0, world, stage) for b in range(0, stage, ep)]
    edp_groups = [list(range(s + j, s + stage, ep)) for s in range(0, world, stage) for j in range(ep)]
    return ep_groups, edp_groups


def groups(comm: Communicator, tp: int, cp: int = 1, pp: int = 1, ep: int = 1) -> Groups:
    """This rank's tp / cp / dp / pp groups (and dp x cp) of `comm` (the world), dp being what is left:
    world / (pp x cp x tp); with `ep` > 1 also its expert and expert-data groups (`ep`, `edp`). Collective over
    `comm`: every rank creates every group, in the same order."""
    n = comm.world_size
    for name, size in (("tp", tp), ("cp", cp), ("pp", pp), ("ep", ep)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"groups: {name} must be a positive int, got {size!r}")
    if n % (pp * cp * tp):
        raise ValueError(f"groups: pp {pp} x cp {cp} x tp {tp} = {pp * cp * tp} does not divide the world size {n} "
                         f"(world = pp x dp x cp x tp); choose sizes whose product divides {n}")
    sizes = {"pp": pp, "dp": n // (pp * cp * tp), "cp": cp, "tp": tp}
    mine: dict[str, Communicator] = {}
    for name, along in (("tp", ("tp",)), ("cp", ("cp",)), ("dp", ("dp",)), ("pp", ("pp",)), ("dp_cp", ("dp", "cp"))):
        for ranks in layout_ranks(sizes, along):
            group = comm.new_group(ranks)
            if group is not None:
                mine[name] = group
    if ep > 1:
        for name, every in zip(("ep", "edp"), expert_ranks(n, pp, tp, ep)):
            for ranks in every:
                group = comm.new_group(ranks)
                if group is not None:
                    mine[name] = group
    return Groups(**mine)
