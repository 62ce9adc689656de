"""`tpkit.pipeline`: pipeline parallelism on torch's engine, composed with tensor, context and data parallelism.

    layout      pipeline_groups: world = pp x dp x cp x tp, tp innermost
    split       split_stages: where to cut (the repeated blocks, balanced by cost and memory, or given)
    stage       a stage by module names: the model with the other stages' modules as placeholders
    tied        weights tied across the first and last stage: a copy on each, gradients summed over the two
    schedule    torch's schedules by name, stage-to-rank placement, the bubble
    compose     each rank's part converted on its tp group, its stages under FSDP2 / DDP over dp
                (cp: the part made context-parallel, each stage cutting its sequences: tpkit.context.pipeline)
    parallel    the facts kept in the model's record (norm, checkpoints, sentinel)
    build       pipeline(model or path, comm, pp=..., ...) -> Pipeline
    run         Pipeline: step (training), eval (forward), the loss, failures as CommError
"""
from __future__ import annotations

from .build import pipeline
from .run import CausalLMLoss, Pipeline
from .layout import PipelineGroups, pipeline_groups
from .parallel import PipelineParallel
from .schedule import SCHEDULES, bubble_fraction
from .split import SplitError, StageSplit, split_stages
from .stage import HeldElsewhere, StageModule

__all__ = ["CausalLMLoss", "HeldElsewhere", "Pipeline", "PipelineGroups", "PipelineParallel", "SCHEDULES",
           "SplitError", "StageModule", "StageSplit", "bubble_fraction", "pipeline", "pipeline_groups",
           "split_stages"]
