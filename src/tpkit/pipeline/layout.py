"""The rank layout of pipeline x data x context x tensor parallelism: world = pp x dp x cp x tp, tp innermost.

World rank `w = ((p * dp + d) * cp + c) * tp + t` (`tpkit.comm.groups`' layout, which makes the groups): the tp
ranks of one stage replica are consecutive (they usually share a node, where the bandwidth is: TP all-reduces
every layer), the cp ranks splitting its sequences come next (they exchange K/V every attention layer), then the dp
replicas of a stage, and the pipeline stages are outermost (a stage sends one activation per micro-batch to the
next: the slowest link can carry it). Ranks 0..7 at pp2 x dp2 x tp2: tp groups {0,1} {2,3} {4,5} {6,7}; dp groups
{0,2} {1,3} {4,6} {5,7}; pp groups {0,4} {1,5} {2,6} {3,7}. Within one stage this is exactly `tpkit.comm.split` of
the stage's ranks (cp = 1, the default, leaves the layout of pp x dp x tp as it was).
"""
from __future__ import annotations

import dataclasses

from ..comm.communicator import Communicator
from ..comm.rank_groups import groups


@dataclasses.dataclass(frozen=True)
class PipelineGroups:
    """This rank's groups and where it sits in each (`pp_rank` is its pipeline position). `dp` holds the replicas
    given different data (FSDP2 / DDP run over it); `cp` the ranks splitting the same sequences; `dp_cp` both."""

    pp: Communicator
    dp: Communicator
    tp: Communicator
    cp: Communicator | None = None
    dp_cp: Communicator | None = None
    ep: Communicator | None = None   # the expert group inside the stage (`tpkit.expert_parallel`), None at ep 1
    edp: Communicator | None = None  # the stage's ranks holding the same experts

    @property
    def pp_rank(self) -> int:
        return self.pp.rank

    @property
    def pp_size(self) -> int:
        return self.pp.world_size

    @property
    def cp_size(self) -> int:
        return self.cp.world_size if self.cp is not None else 1

    @property
    def stage_size(self) -> int:
        """Ranks holding one pipeline position: dp x cp x tp (consecutive world ranks)."""
        return self.dp.world_size * self.cp_size * self.tp.world_size


def world_rank(p: int, d: int, t: int, dp: int, tp: int, c: int = 0, cp: int = 1) -> int:
    """The world rank of pipeline rank `p`, data-parallel rank `d`, context-parallel rank `c`, tensor-parallel rank
    `t`."""
    return ((p * dp + d) * cp + c) * tp + t


def pipeline_groups(comm: Communicator, pp: int, tp: int = 1, cp: int = 1, ep: int = 1) -> PipelineGroups:
    """Cut `comm` (the world) into pp x dp x cp x tp groups, tp innermost (see the module docstring); dp is what is
    left (world / (pp x cp x tp)). Collective over `comm`: every rank creates every group, in the same order."""
    n = comm.world_size
    for name, size in (("pp", pp), ("tp", tp), ("cp", cp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"pipeline_groups: {name} must be a positive int, got {size!r}")
    if n % (pp * cp * tp):
        sizes = f"pp {pp} x tp {tp}" if cp == 1 else f"pp {pp} x cp {cp} x tp {tp}"
        raise ValueError(f"pipeline_groups: {sizes} = {pp * cp * tp} does not divide the world size {n}; world = pp x "
                         f"dp x {'cp x ' if cp > 1 else ''}tp")
    mine = groups(comm, tp=tp, cp=cp, pp=pp, ep=ep)
    return PipelineGroups(pp=mine.pp, dp=mine.dp, tp=mine.tp, cp=mine.cp, dp_cp=mine.dp_cp, ep=mine.ep, edp=mine.edp)
