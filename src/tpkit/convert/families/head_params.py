"""Parameters an attention module holds itself, split with its heads when the block is split by heads.

The trace proves how each one meets the heads (`trace/head_params.py`) and records it on the module that holds it
(`Role.params`): "heads" (attention sinks, a gate bias per head: one entry per query head) and "head_features"
(DeBERTa's q/v biases: heads x head_dim, head-major) keep this rank's heads' entries; "shared" (DiffLlama's
lambdas, used the same way by every head) stay whole on every rank, their gradient summed over the ranks (each
rank's is that of its own heads only). The module is not replaced (it may be the model itself): it keeps its
forward, which reads the parameters as before, now holding its heads' part, beside the local head counts the
attention family sets. So the parameters are cut in place when the new layers are in (`install`), by the same
layouts (`param_layout`) that `plan_layouts` and `shard_layouts` read.
"""
from __future__ import annotations

from typing import Iterator

from torch import nn

from ...layout import HeadLayoutError, Piece, ShardLayout, head_columns, head_spans
from ...nn.grad_sums import sum_grads
from ..errors import PlanError
from ..family import Checked, Choice, Draft, Family, Planned, Proposal
from ..roles import ATTENTION, Pair, Role
from ..styles import ROWWISE, Style, replicated_layouts
from ..trace.head_params import HEAD_FEATURES, HEADS, SHARED

HEAD_PARAMETERS = "head_parameters"


def param_layout(shape: tuple, kind: str, role: Role, world: int, rank: int) -> ShardLayout:
    """The one layout of an attention's own parameter of `kind` on `rank` (conversion and checkpoints read it)."""
    if kind == SHARED:
        return ShardLayout.replicated(shape, world, rank)
    try:
        lay = role.heads(world)
    except HeadLayoutError as exc:
        raise PlanError(f"{exc}; mark this attention block 'replicate' instead") from None
    piece = head_columns(lay) if kind == HEADS else Piece(0, lay.num_heads * role.head_dim,
                                                          head_spans(lay.q_heads, role.head_dim))
    return ShardLayout(tuple(shape), world, rank, 0, (piece,))


class HeadParameters(Style):
    """An attention module's own parameters: per-head ones hold this rank's heads, shared ones stay whole."""

    name = HEAD_PARAMETERS
    description = ("an attention module's own parameters (sinks, per-head biases: this rank's heads; values every "
                   "head uses: whole, gradient summed); its layers are planned on their own")
    collectives = ("all_reduce (backward, shared parameters)",)
    owns_module = True  # holds parameters itself and has children (q/k/v, o) planned on their own
    splits = True

    def check(self, name: str, m: nn.Module, role: Role | None, world: int) -> None:
        where = f"{name} ({type(m).__name__})"
        if role is None or role.num_heads is None or not role.params:
            raise PlanError(f"{where}: style {self.name!r} needs its attention's heads and how each of its "
                            f"parameters follows them; the planner finds them in the dataflow (use plan='auto')")
        own = dict(m.named_parameters(recurse=False))
        known = dict(role.params)
        if set(own) != set(known):
            raise PlanError(f"{where}: style {self.name!r} describes parameters {sorted(known)} but the module holds "
                            f"{sorted(own)}; plan it again with plan='auto'")
        nh, hd = role.num_heads, role.head_dim
        for pname, kind in known.items():
            want = {HEADS: nh, HEAD_FEATURES: nh * (hd or 0)}.get(kind)
            if kind not in (HEADS, HEAD_FEATURES, SHARED):
                raise PlanError(f"{where}: {pname} has kind {kind!r}; known: {HEADS}, {HEAD_FEATURES}, {SHARED}")
            if want is not None and (own[pname].dim() != 1 or own[pname].numel() != want):
                raise PlanError(f"{where}: {pname} has shape {list(own[pname].shape)} but {kind!r} needs one "
                                f"dimension of {want} ({nh} heads of {hd}); plan it 'replicate'")

    def layouts(self, m: nn.Module, role: Role | None, world: int, rank: int) -> dict[str, ShardLayout]:
        if role is None or not role.params:
            raise PlanError(f"style {self.name!r} needs how each parameter of this {type(m).__name__} follows the "
                            f"heads (the plan's details); the planner finds it in the dataflow (use plan='auto')")
        out = replicated_layouts(m, world, rank)
        for pname, kind in role.params:
            out[pname] = param_layout(tuple(getattr(m, pname).shape), kind, role, world, rank)
        return out


def _cut(owner: nn.Module, role: Role, comm) -> None:
    """Give `owner` its heads' part of each split parameter; sum the gradients of the shared ones."""
    shared = []
    for pname, kind in role.params:
        p = getattr(owner, pname)
        lay = param_layout(tuple(p.shape), kind, role, comm.world_size, comm.rank)
        if lay.is_replicated:
            shared.append(pname)
            continue
        w = nn.Parameter(lay.shard(p.detach()).clone(), requires_grad=p.requires_grad)
        setattr(owner, pname, w)
    sum_grads(owner, shared, comm)


class HeadParameterFamily(Family):
    """Own parameters of attention blocks, planned with the block (after the attention family has planned it)."""

    name = "head_parameters"
    styles = (HeadParameters(),)

    def detect(self, analysis) -> list[Pair]:
        return [p for p in analysis.pairs if p.kind == ATTENTION and p.owners]

    def propose(self, draft: Draft, found: list[Pair]) -> Iterator[Proposal]:
        """Split with the block when it is split by heads; otherwise nothing (the modules stay whole)."""
        for p in found:
            if draft.style(p.row) != ROWWISE:
                continue
            details = {o: draft.analysis.structures[o] for o in p.owners}
            yield Proposal(self.name, p.row, (Choice("split with its heads", {o: HEAD_PARAMETERS for o in p.owners},
                                                     details=details),))

    def install(self, model: nn.Module, planned: Planned, checked: Checked | None, comm) -> None:
        """Split parameters keep this rank's heads; shared ones see only this rank's heads' work, so their
        gradient is the sum over the ranks."""
        if comm.world_size == 1:
            return
        for name, s in planned.styles.items():
            d = planned.details.get(name)
            if s == HEAD_PARAMETERS and d is not None:
                _cut(model.get_submodule(name) if name else model, d, comm)
