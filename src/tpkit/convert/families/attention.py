"""Attention blocks split by whole heads: q/k/v (or one packed projection) column-wise, the output layer
row-wise, per-head norms (Qwen3's q_norm / k_norm) whole on every rank with their gradient summed.

The trace finds the blocks (`trace/attention.py`); here they are planned (split by heads, or whole when the heads
cannot be shared out or a layer of the block must stay whole), checked, and given their local head counts: the
attention module's forward reads its head counts from attributes (or its config), so after the split they must
say this rank's heads.

Query heads are spread as evenly as possible where the attention can take it (`Role.kv_expand`, see
`tpkit.layout.heads`): a rank whose KV heads then serve unequal numbers of its query heads (16 heads, 4 KV heads
at 3 ranks: rank 1 holds query heads 6..10, reading KV heads 1 (6, 7) and 2 (8..10)) gets a forward hook on its
k/v projections (`ExpandKV`) that repeats each local KV head once per local query head reading it, and its
attention is told it has as many KV heads as query heads (`num_key_value_groups` 1). Its KV cache then holds
one KV head per local query head. Ranks whose groups are equal keep the model's own `repeat_kv` path.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from torch import nn

from ...layout import HeadLayoutError
from ...nn.grad_sums import sum_grads
from ...nn.sources import forward_source
from ..errors import PlanError
from ..family import Checked, Choice, Draft, Family, Planned, Proposal, whole_choice
from ..roles import ATTENTION, Pair
from ..styles import COLWISE, REPLICATE, ROWWISE, Style
from .gathered_norms import GATHERED_NORM, norms_blocker
from ..trace.heads import NUM_HEADS_ATTRS, NUM_KV_ATTRS

REPLICATED_WITH_GRAD_ALLREDUCE = "replicated_with_grad_allreduce"
WIDTH_ATTRS = ("all_head_size", "embed_dim", "split_size", "inner_dim", "hidden_size", "kdim", "vdim")


class ReplicatedGradAllReduce(Style):
    name = REPLICATED_WITH_GRAD_ALLREDUCE
    description = ("every rank holds the whole module, applied to its own heads or features only (a per-head q/k "
                   "norm, an activation with scalar parameters): its gradient is summed over the ranks")
    collectives = ("all_reduce (backward)",)

    def check_dataflow(self, name: str, planned: Any, lookup) -> None:
        t = planned.analysis.trace
        if t is None or (name not in t.head_local and name not in t.carried_by):
            raise PlanError(f"{name}: style 'replicated_with_grad_allreduce' is for per-head layers (q/k norms) "
                            f"between split q/k projections and their row-wise output layer, or activations with "
                            f"scalar parameters between column- and row-wise layers; the trace does not show {name} "
                            f"as one")


class Attention(Family):
    name = "attention"
    styles = (ReplicatedGradAllReduce(),)

    def detect(self, analysis) -> tuple[Pair, ...]:
        return tuple(p for p in analysis.pairs if p.kind == ATTENTION)

    def propose(self, draft: Draft, found: tuple[Pair, ...]) -> list[Proposal]:
        out = []
        for pair in found:
            layers = pair.columns + (pair.row,)
            whole = draft.whole(layers)
            if whole is None and draft.claimed(layers):
                continue  # an earlier family planned this block
            why = f"{whole[0]}: {whole[1]}" if whole else (_heads_blocker(pair, draft.world_size)
                                                            or norms_blocker(draft, pair))
            if why:
                out.append(Proposal(self.name, pair.row, (whole_choice(pair.members, why, unpaired=True),)))
                continue
            a = draft.analysis
            split = Choice("split by heads", {**{n: COLWISE for n in pair.columns}, pair.row: ROWWISE,
                                              **{n: REPLICATED_WITH_GRAD_ALLREDUCE for n in pair.carried},
                                              **{n: GATHERED_NORM for n in pair.norms}},
                           details={n: a.structures[n] for n in pair.columns + (pair.row,) + pair.carried + pair.norms})
            kept = whole_choice(pair.members, f"attention {pair.attention or '<model>'} kept whole by the chosen setup "
                                      f"(it splits by heads at {draft.world_size} ranks)")
            out.append(Proposal(self.name, pair.row, (split, kept)))
        return out

    def validate(self, planned: Planned) -> Checked | None:
        """A split q/k whose heads pass through a per-head layer needs that layer's gradient summed."""
        t = planned.analysis.trace
        if t is None or planned.world_size == 1:
            return None
        for name, s in planned.styles.items():
            if s != COLWISE or name not in t.calls:
                continue
            for h, sources in t.head_local.items():
                if name in sources and planned.style_of(h) not in (REPLICATED_WITH_GRAD_ALLREDUCE, GATHERED_NORM):
                    raise PlanError(f"conflicting entries: {name} is 'colwise' and its heads pass through the "
                                    f"per-head layer {h}, which must then be 'replicated_with_grad_allreduce' (its "
                                    f"gradient is a sum over the ranks' heads), not {planned.style_of(h)!r}")
        return None

    def attributes(self, planned: Planned) -> Mapping[str, Mapping[str, Any]]:
        """New values of the head-count / width attributes that attention modules read, per module."""
        if planned.world_size == 1:
            return {}
        updates: dict[str, dict] = {}
        for name, s in planned.styles.items():
            d = planned.details.get(name)
            if s != ROWWISE or d is None or not d.is_attention:
                continue
            attn = planned.model.get_submodule(d.attention) if d.attention else planned.model
            lay, r = d.heads(planned.world_size), planned.rank
            updates[d.attention] = local_head_attrs(attn, d.num_heads, d.num_kv_heads, d.head_dim,
                                                    len(lay.q_heads[r]), lay.cache_heads(r))
        return updates

    def install(self, model: nn.Module, planned: Planned, checked: Checked | None, comm) -> None:
        """Per-head norms see only this rank's heads: their gradient is the sum over the ranks. K/V projections of
        a rank with unequal groups expand their KV heads to one per query head."""
        for name, s in planned.styles.items():
            if s == REPLICATED_WITH_GRAD_ALLREDUCE:
                m = model.get_submodule(name)
                sum_grads(m, [n for n, p in m.named_parameters(recurse=False)], comm)
        if planned.world_size > 1:
            for name, s in planned.styles.items():
                d = planned.details.get(name)
                if s == ROWWISE and d is not None and d.is_attention and d.kv_expand:
                    for column, hook in _kv_expanders(d, planned).items():
                        model.get_submodule(column).register_forward_hook(hook)


class ExpandKV:
    """Forward hook of a k/v projection (or a packed qkv one: `keep` query features first, then k and v): repeats
    each local KV head `repeats[i]` times, so the attention sees one KV head per local query head."""

    def __init__(self, keep: int, repeats: tuple[int, ...], head_dim: int, blocks: int):
        self.keep, self.repeats, self.head_dim, self.blocks = keep, tuple(repeats), head_dim, blocks

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        hd, parts, at = self.head_dim, [out.narrow(-1, 0, self.keep)] if self.keep else [], self.keep
        for _ in range(self.blocks):
            for n in self.repeats:
                head = out.narrow(-1, at, hd)
                parts.append(head if n == 1 else head.unsqueeze(-2).expand(*head.shape[:-1], n, hd).flatten(-2))
                at += hd
        return torch.cat(parts, -1)


def _kv_expanders(o: Any, planned: Planned) -> dict[str, ExpandKV]:
    """The `ExpandKV` hook of each K/V (or packed qkv) projection of attention block `o` on this rank, by name: none
    where the rank's query heads share its KV heads evenly (a fact of the plan, so the model is not needed)."""
    lay, r = o.heads(planned.world_size), planned.rank
    if lay.even_groups(r):
        return {}
    out = {}
    for c in o.columns:
        role = planned.details[c].role
        if role in ("k", "v", "qkv"):
            keep = len(lay.q_heads[r]) * o.head_dim if role == "qkv" else 0
            out[c] = ExpandKV(keep, lay.kv_repeats(r), o.head_dim, 2 if role == "qkv" else 1)
    return out


def _heads_blocker(pair: Pair, world: int) -> str | None:
    try:
        pair.heads(world)
    except HeadLayoutError as exc:
        return str(exc)
    return None


def local_head_attrs(attn: nn.Module, nh: int, nkv: int, hd: int, nh_l: int, nkv_l: int) -> dict:
    """The attributes `attn` reads its head counts and widths from, set to this rank's."""
    new = {}
    for attr in NUM_HEADS_ATTRS:
        if getattr(attn, attr, None) == nh:
            new[attr] = nh_l
    for attr in NUM_KV_ATTRS:
        if getattr(attn, attr, None) == nkv:
            new[attr] = nkv_l
    if isinstance(getattr(attn, "num_key_value_groups", None), int):
        new["num_key_value_groups"] = nh_l // nkv_l
    for attr in WIDTH_ATTRS:
        if getattr(attn, attr, None) == nh * hd and not isinstance(getattr(attn, attr), bool):
            new[attr] = nh_l * hd
    cfg = getattr(attn, "config", None)
    source = forward_source(type(attn)) if cfg is not None else ""
    if "config.num_attention_heads" in source or "config.num_key_value_heads" in source:
        # Its forward reads head counts from the model-wide config (Phi-3: `config.num_attention_heads`):
        # give this module its own copy with the local counts; the shared config stays global.
        local = copy.copy(cfg)
        if getattr(cfg, "num_attention_heads", None) == nh:
            local.num_attention_heads = nh_l
        if getattr(cfg, "num_key_value_heads", None) == nkv:
            local.num_key_value_heads = nkv_l
        new["config"] = local
    return new
