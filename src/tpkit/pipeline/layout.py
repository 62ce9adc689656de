"""The rank layout of pipeline x data x tensor parallelism: world = pp x dp x tp, tensor parallelism innermost.

World rank `w = (p * dp + d) * tp + t`: the tp ranks of one stage replica are consecutive (they usually share a
node, where the bandwidth is: TP all-reduces every layer), the dp replicas of a stage come next, and the pipeline
stages are outermost (a stage sends one activation per micro-batch to the next: the slowest link can carry it).
Ranks 0..7 at pp2 x dp2 x tp2: tp groups {0,1} {2,3} {4,5} {6,7}; dp groups {0,2} {1,3} {4,6} {5,7}; pp groups
{0,4} {1,5} {2,6} {3,7}. Within one stage this is exactly `tpkit.comm.split` of the stage's ranks.
"""
from __future__ import annotations

import dataclasses

from ..comm.communicator import Communicator


@dataclasses.dataclass(frozen=True)
class PipelineGroups:
    """This rank's three groups and where it sits in each (`pp_rank` is its pipeline position)."""

    pp: Communicator
    dp: Communicator
    tp: Communicator

    @property
    def pp_rank(self) -> int:
        return self.pp.rank

    @property
    def pp_size(self) -> int:
        return self.pp.world_size

    @property
    def stage_size(self) -> int:
        """Ranks holding one pipeline position: dp x tp."""
        return self.dp.world_size * self.tp.world_size


def world_rank(p: int, d: int, t: int, dp: int, tp: int) -> int:
    """The world rank of pipeline rank `p`, data-parallel rank `d`, tensor-parallel rank `t`."""
    return (p * dp + d) * tp + t


def pipeline_groups(comm: Communicator, pp: int, tp: int = 1) -> PipelineGroups:
    """Cut `comm` (the world) into pp x dp x tp groups, tp innermost (see the module docstring); dp is what is left
    (world / (pp x tp)). Collective over `comm`: every rank creates every group, in the same order."""
    n = comm.world_size
    for name, size in (("pp", pp), ("tp", tp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"pipeline_groups: {name} must be a positive int, got {size!r}")
    if n % (pp * tp):
        raise ValueError(f"pipeline_groups: pp {pp} x tp {tp} = {pp * tp} does not divide the world size {n}; "
                         f"world = pp x dp x tp")
    dp = n // (pp * tp)
    mine: dict[str, Communicator | None] = {"pp": None, "dp": None, "tp": None}
    layouts = {
        "tp": [[world_rank(p, d, t, dp, tp) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[world_rank(p, d, t, dp, tp) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[world_rank(p, d, t, dp, tp) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
    for name in ("tp", "dp", "pp"):
        for ranks in layouts[name]:
            group = comm.new_group(ranks)
            mine[name] = group if group is not None else mine[name]
    assert all(g is not None for g in mine.values())
    return PipelineGroups(pp=mine["pp"], dp=mine["dp"], tp=mine["tp"])  # type: ignore[arg-type]
