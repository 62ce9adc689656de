"""torch's pipeline schedules by name, and which pipeline rank runs each stage under them.

tpkit runs no schedule of its own: the names below are torch's classes (`torch.distributed.pipelining`), which do
the micro-batching, the point-to-point sends and the backward. `gpipe` and `1f1b` run one stage per rank;
`interleaved1f1b`, `looped_bfs` and `interleaved_zb` (zero bubble, the weight gradients deferred into the bubble)
run several stages per rank, stage `s` on pipeline rank `s % pp`; `zbv` (zero bubble, V-shaped) runs exactly two
per rank, stage `s` on rank `s` for the first half and `2 pp - 1 - s` for the second, so the first and the last
stage share a rank.
"""
from __future__ import annotations

from typing import Any, Callable

from ..estimate.pipeline import bubble_fraction  # the one formula, which the estimate prices

__all__ = ["SCHEDULES", "SINGLE", "V_SHAPED", "bubble_fraction", "check_schedule", "make_schedule", "rank_stages",
           "stage_rank"]

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
SINGLE = ("gpipe", "1f1b")  # one stage per rank
V_SHAPED = ("zbv",)


def check_schedule(name: str, stages_per_rank: int) -> None:
    """ValueError naming the choices for an unknown name or a stage count the schedule does not run."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline: schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"pipeline: stages_per_rank must be a positive int, got {stages_per_rank!r}")
    if name in SINGLE and stages_per_rank != 1:
        raise ValueError(f"pipeline: schedule {name!r} runs one stage per rank; for {stages_per_rank} use "
                         f"'interleaved1f1b', 'looped_bfs' or 'interleaved_zb'")
    if name in V_SHAPED and stages_per_rank != 2:
        raise ValueError(f"pipeline: schedule {name!r} runs exactly two stages per rank, got {stages_per_rank}")


def stage_rank(stage: int, num_stages: int, pp: int, name: str) -> int:
    """The pipeline rank running `stage` under schedule `name` (see the module docstring)."""
    if name in V_SHAPED:
        return stage if stage < pp else num_stages - 1 - stage
    return stage % pp


def rank_stages(pp_rank: int, num_stages: int, pp: int, name: str) -> list[int]:
    """The stages pipeline rank `pp_rank` runs, in increasing order."""
    return [s for s in range(num_stages) if stage_rank(s, num_stages, pp, name) == pp_rank]


def make_schedule(name: str, stages: list, microbatches: int, loss_fn: Callable[..., Any] | None):
    """torch's schedule `name` over this rank's `PipelineStage`s (the loss is the mean over micro-batches: torch
    divides the gradients by their number)."""
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, SCHEDULES[name])
    if name in SINGLE:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
