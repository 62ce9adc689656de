"""What `tpkit.pipeline` did, kept in the model's record (`record.pipeline`), beside what `data_parallel` keeps.

The rank's part of the model (its stages' modules, pruned, converted on its tp group) carries one record, as any
converted model does; this is its pipeline section, read by the code that needs to know the model is one stage
of several, by attribute (as `record.data_parallel` is):
- `tpkit.clip_grad_norm_`: the norm over every dimension, the tp and dp part summed as without pipelining, then
  over the pipeline group (each stage's parameters are disjoint); a weight tied across the first and last stage
  counted once (`tied.py`);
- the checkpoints: a world rank holds its stage's keys (`stage_size` consecutive ranks per pipeline rank, dp x cp x
  tp, tp innermost), a tied copy on the last stage is an alias, the checkpoint's other keys are the other stages'
  (`keys`: every key of the whole model), and its plan is the whole model's (`plan`);
- the replica sentinel: the tied copies compared over their group of two, and a divergence found anywhere
  raised everywhere (the pipeline group joins the tp and dp groups).
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any

import torch
from torch import nn

from ..comm.ops import ReduceOp
from ..convert import Plan
from ..nn.grad_clip import partial_norm
from ..nn.record import Holder, ModelRecord
from .layout import PipelineGroups
from .split import StageSplit
from .tied import TiedCopies


@dataclasses.dataclass(eq=False)
class PipelineParallel:
    """The pipeline facts of this rank's part: its groups, the split, the stages it runs, the tied copies it holds,
    every key of the whole model."""

    groups: PipelineGroups
    split: StageSplit
    stages: tuple[int, ...]
    schedule: str
    tied: TiedCopies | None
    keys: frozenset[str]
    _record: Any = dataclasses.field(repr=False)  # a weakref: the record holds these facts
    plan: Plan | None = dataclasses.field(default=None, repr=False)  # the whole model's tensor-parallel plan

    @classmethod
    def of(cls, groups: PipelineGroups, split: StageSplit, stages: tuple[int, ...], schedule: str,
           tied: TiedCopies | None, keys: frozenset[str], record: ModelRecord, plan: Plan | None) -> "PipelineParallel":
        return cls(groups, split, stages, schedule, tied, keys, weakref.ref(record), plan)

    @property
    def record(self) -> ModelRecord:
        return self._record()

    def __getstate__(self) -> dict:  # copies and pickles refer to the copied record
        return {**self.__dict__, "_record": self.record}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _record=weakref.ref(state["_record"]))

    @property
    def pp_comm(self):
        return self.groups.pp

    @property
    def pp_size(self) -> int:
        return self.groups.pp_size

    @property
    def stage_size(self) -> int:
        """World ranks per pipeline rank (dp x cp x tp, consecutive)."""
        return self.groups.stage_size

    @property
    def aliases(self) -> dict[str, str]:
        """`{key: key it copies}` for the tied copies this rank holds apart (saved as aliases)."""
        return self.tied.aliases if self.tied is not None else {}

    def global_norm(self, params: list[torch.Tensor], held: dict[int, Holder], norm_type: float):
        """The norm source of `tpkit.clip_grad_norm_` for one stage of a pipeline: over pp x dp x tp (the cp ranks
        hold the same, summed gradients: each computes the whole norm)."""
        skip = {id(p) for key, p in self._named().items() if key in self.aliases}
        counted = [p for p in params if id(p) not in skip]
        total, _ = partial_norm(counted, held, norm_type, self.record, None)
        op = ReduceOp.MAX if norm_type == math.inf else ReduceOp.SUM
        total = self.pp_comm.all_reduce(total.cpu(), op)
        if op is not ReduceOp.MAX:
            total = total.pow(1.0 / norm_type)
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        return total.to(device), grads

    def _named(self) -> dict[str, nn.Parameter]:
        owner = self.record.owner
        return dict(owner.named_parameters(remove_duplicate=False)) if owner is not None else {}
