"""Per-head tensors that are not projections: split with the heads they belong to.

T5 adds to its attention scores a learned bias read from an embedding with one column per head
(`relative_attention_bias`, [buckets, heads]). The dataflow (`pairs.py`) finds it as a source of an attention
block's scores whose width is that block's head count; when the block's heads are split, each rank needs only
the columns of its own heads, and the scores it adds them to are already its heads only. So the embedding
keeps this rank's head columns and no communication is needed: its output stays split, like a column-wise
layer's. One such tensor may serve several blocks (T5 computes the bias in the first block and hands it to the
others); it is split only when every block it reaches is split with the same heads, else every one of those
blocks stays whole.

BLOOM hands its attention an ALiBi bias built for all heads: a split attention block that takes such a per-head
argument (found by the trace, `Role.head_args`) gets only its heads' slices, by a forward pre-hook.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

from torch import nn

from ...layout import HeadLayoutError, Piece, ShardLayout, head_columns
from ..errors import PlanError
from ..family import Checked, Choice, Draft, Family, Planned, Proposal
from ..modules import is_embedding, keep_output_scale, kind
from ..roles import ATTENTION, Pair, Role
from ..styles import REPLICATE, ROWWISE, Style

PER_HEAD = "per_head"


def head_piece(role: Role, world: int) -> Piece:
    """Each rank's span of a one-column-per-query-head tensor, from the attention's head counts."""
    try:
        lay = role.heads(world)
    except HeadLayoutError as exc:
        raise PlanError(f"{exc}; mark this attention block 'replicate' instead") from None
    return head_columns(lay)


class PerHead(Style):
    """An embedding with one column per attention head, holding this rank's heads' columns (output stays split)."""

    name = PER_HEAD
    description = ("per-head tensor (T5's relative attention bias: an embedding with one column per head): holds "
                   "this rank's heads' columns, output stays split with the heads")
    split_output = splits = True

    def check(self, name: str, m: nn.Module, role: Role | None, world: int) -> None:
        where = f"{name} ({kind(m)})"
        if not is_embedding(m):
            raise PlanError(f"{where}: style 'per_head' needs an nn.Embedding with one column per head")
        if role is None or role.num_heads is None:
            raise PlanError(f"{where}: style 'per_head' needs the attention heads it belongs to; the planner finds "
                            f"them in the dataflow (use plan='auto' or copy its details)")
        if m.embedding_dim != role.num_heads:
            raise PlanError(f"{where}: {m.embedding_dim} columns, but its attention has {role.num_heads} heads")

    def layouts(self, m: nn.Module, role: Role | None, world: int, rank: int) -> dict[str, ShardLayout]:
        return {"weight": ShardLayout(tuple(m.weight.shape), world, rank, 1, (head_piece(role, world),))}

    def check_dataflow(self, name: str, planned: Any, lookup) -> None:
        """It holds this rank's heads only: it may reach only the row-wise layers of its attention."""
        t = planned.analysis.trace
        if t is None or planned.world_size == 1:
            return
        bad = sorted(u for u in t.consumers.get(name, set()) if planned.style_of(u) != ROWWISE)
        if bad or name in t.escaped:
            raise PlanError(f"conflicting entries: {name} is 'per_head' (it holds this rank's heads only) but it "
                            f"reaches {bad or '<model output>'}, which take(s) all heads; plan it 'replicate'")

    def build(self, m: nn.Module, layouts: Mapping[str, ShardLayout], comm,
              sequence_parallel: bool = False) -> nn.Module:

        lay = layouts["weight"]
        new = nn.Embedding(m.num_embeddings, lay.local_shape[1], padding_idx=m.padding_idx, max_norm=m.max_norm,
                           norm_type=m.norm_type, scale_grad_by_freq=m.scale_grad_by_freq, sparse=m.sparse,
                           device="meta")
        w = nn.Parameter(lay.shard(m.weight.detach()).clone(), requires_grad=m.weight.requires_grad)
        new.weight = w
        new.train(m.training)
        return keep_output_scale(m, new)


def _slice_heads(x, layout: str, num_heads: int, first: int, count: int):
    if layout == "flat":
        return x.unflatten(0, (-1, num_heads)).narrow(1, first, count).flatten(0, 1)
    return x.narrow(1, first, count)


def install_head_arg_slicers(attn: nn.Module, args: Mapping, num_heads: int, heads: tuple) -> None:
    """Give `attn` only this rank's heads of its per-head arguments (a forward pre-hook; `heads` are the rank's
    query heads, contiguous; `args`: position or keyword -> "flat" / "dim1")."""
    attn.register_forward_pre_hook(HeadArgSlicer(dict(args), num_heads, heads[0], len(heads)), with_kwargs=True)


class HeadArgSlicer:
    """The pre-hook of `install_head_arg_slicers` (an object, so the model pickles and deep-copies)."""

    def __init__(self, args: dict, num_heads: int, first: int, count: int):
        self.args, self.num_heads, self.first, self.count = args, num_heads, first, count

    def __call__(self, mod, a, kw):
        args, n, first, count = self.args, self.num_heads, self.first, self.count
        a = tuple(_slice_heads(v, args[i], n, first, count) if i in args and v is not None else v
                  for i, v in enumerate(a))
        kw = {k: _slice_heads(v, args[k], n, first, count) if k in args and v is not None else v
              for k, v in kw.items()}
        return a, kw


class PerHeadTensors(Family):
    """Per-head tensors split with their attention (after the attention family has planned it)."""

    name = "per_head"
    styles = (PerHead(),)

    def detect(self, analysis) -> list[tuple[str, tuple[Pair, ...]]]:
        """Every per-head tensor, in the order blocks reach it, with the attention blocks it serves."""
        found: dict[str, list[Pair]] = {}
        for p in analysis.pairs:
            if p.kind == ATTENTION:
                for src in p.per_head:
                    found.setdefault(src, []).append(p)
        return [(src, tuple(users)) for src, users in found.items()]

    def propose(self, draft: Draft, found: list[tuple[str, tuple[Pair, ...]]]) -> Iterator[Proposal]:
        for src, users in found:  # one at a time: the next tensor sees the blocks this one kept whole
            yield self._one(draft, src, users)

    def _one(self, draft: Draft, src: str, users: tuple[Pair, ...]) -> Proposal:
        """All its blocks split with the same heads: split it with them; otherwise all of them whole."""
        notes = draft.analysis.notes
        blocked = [p for p in users if draft.style(p.row) != ROWWISE]
        why = draft.reasons.get(blocked[0].row) if blocked else (
            notes.get(src) and f"{src} also reaches attention that stays whole: {notes[src]}")
        heads = sorted({(p.num_heads, p.num_kv_heads) for p in users})
        if why is None and len(heads) > 1:
            why = f"{src} serves attention blocks with different head counts {heads}"
        if why is None:
            return Proposal(self.name, src, (Choice("split with its heads", {src: PER_HEAD},
                                                    details={src: draft.analysis.structures[src]}),))
        entries, reasons = {src: REPLICATE}, {}
        for p in users:
            mine = draft.reasons.get(p.row) if p in blocked else \
                f"shares the per-head tensor {src} with attention that stays whole ({why})"
            entries.update({n: REPLICATE for n in p.members})
            reasons.update({n: mine for n in p.members if n != src or p is users[-1]})
        return Proposal(self.name, src, (Choice("whole", entries, reasons=reasons, unpaired=True),))

    def install(self, model: nn.Module, planned: Planned, checked: Checked | None, comm) -> None:
        """Split attention that takes per-head arguments built for all heads (ALiBi) gets its heads' slices."""
        if comm.world_size == 1:
            return
        for name, s in planned.styles.items():
            d = planned.details.get(name)
            if s == ROWWISE and d is not None and d.head_args:
                lay = d.heads(comm.world_size)
                attn = model.get_submodule(d.attention) if d.attention else model
                install_head_arg_slicers(attn, dict(d.head_args), d.num_heads, lay.q_heads[comm.rank])
