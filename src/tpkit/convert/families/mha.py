"""`nn.MultiheadAttention` split by heads: a tensor-parallel replacement that is exact in every mode.

PyTorch's `MultiheadAttention` never calls its `out_proj` (it hands `out_proj.weight` to
`F.multi_head_attention_forward`, or in eval under no_grad to a fused kernel), and keeps q, k, v in one
`in_proj_weight` it owns itself; so no Linear-by-Linear swap can split it. `ParallelMultiheadAttention` does the
same computation for this rank's heads: its rows of q, k and v, scaled dot-product attention on its heads (with
the masks' rows of those heads), and a row-wise `out_proj` (one all-reduce). It has no fast path, so train /
eval and grad / no_grad all take the same exact route. Attention weights, when asked for, are averaged over
all heads (one all-reduce) or gathered per head.

Supported: `_qkv_same_embed_dim`, no `bias_k` / `bias_v`, no `add_zero_attn` (others stay whole, with the reason).
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ...layout import HeadLayoutError, Piece, ShardLayout, head_layout
from ...nn import copy_to_region, gather_from_region, reduce_from_region
from ..errors import PlanError
from ..family import Choice, Draft, Family, Proposal
from ..roles import ATTENTION, Role
from ..styles import ROWWISE, Style

MULTIHEAD_ATTENTION = "multihead_attention"


def unsupported(m: nn.Module) -> str | None:
    """Why `m` cannot be split by this module (None: it can)."""
    if type(m) is not nn.MultiheadAttention:
        return f"{type(m).__name__} is not torch.nn.MultiheadAttention"
    if not m._qkv_same_embed_dim:
        return "kdim / vdim differ from embed_dim (separate q/k/v weights)"
    if m.bias_k is not None or m.add_zero_attn:
        return "bias_k / bias_v / add_zero_attn are not split"
    return None


def _pieces(nh: int, hd: int, world: int, where: str) -> tuple[Piece, ...]:
    try:
        lay = head_layout(nh, nh, world, where)
    except HeadLayoutError as exc:
        raise PlanError(f"{exc}; plan it 'replicate'") from None
    spans = tuple((h[0] * hd, (h[-1] + 1) * hd) for h in lay.q_heads)
    return tuple(Piece(i * nh * hd, nh * hd, spans) for i in range(3))


class MultiheadAttentionHeads(Style):
    """Plan style for `nn.MultiheadAttention`: in_proj rows of this rank's heads; its out_proj is 'rowwise'."""

    name = MULTIHEAD_ATTENTION
    description = ("torch.nn.MultiheadAttention split by whole heads (q/k/v rows of in_proj); its out_proj is "
                   "'rowwise'; one all-reduce")
    collectives: tuple[str, ...] = ("all_reduce",)
    owns_module = True  # holds parameters itself and has a child (out_proj) planned on its own
    splits = True

    def check(self, name: str, m: nn.Module, role: Role | None, world: int) -> None:
        why = unsupported(m)
        if why:
            raise PlanError(f"{name} ({type(m).__name__}): style {self.name!r}: {why}; plan it 'replicate'")

    def layouts(self, m: nn.Module, role: Role | None, world: int, rank: int) -> dict[str, ShardLayout]:
        pieces = _pieces(m.num_heads, m.head_dim, world, role.attention if role is not None else "")
        out = {"in_proj_weight": ShardLayout(tuple(m.in_proj_weight.shape), world, rank, 0, pieces)}
        if m.in_proj_bias is not None:
            out["in_proj_bias"] = ShardLayout(tuple(m.in_proj_bias.shape), world, rank, 0, pieces)
        return out

    def build(self, m: nn.Module, layouts: Mapping[str, ShardLayout], comm,
              sequence_parallel: bool = False) -> nn.Module:
        return ParallelMultiheadAttention(m, layouts, comm)


class ParallelMultiheadAttention(nn.Module):
    """This rank's heads of an `nn.MultiheadAttention` (same call signature, same state_dict keys)."""

    def __init__(self, m: nn.MultiheadAttention, layouts: Mapping[str, ShardLayout], comm):
        super().__init__()
        lay = layouts["in_proj_weight"]
        self.comm, self.batch_first, self.dropout = comm, m.batch_first, m.dropout
        self.total_heads, self.head_dim = m.num_heads, m.head_dim
        self.local_heads = lay.local_shape[0] // (3 * m.head_dim)
        self.first_head = lay.segments()[0][0] // m.head_dim
        self.embed_dim, self.num_heads = m.embed_dim, m.num_heads  # read by parents (TransformerEncoderLayer)
        self._qkv_same_embed_dim, self.bias_k, self.bias_v, self.add_zero_attn = True, None, None, False
        w = nn.Parameter(lay.shard(m.in_proj_weight.detach()).clone(), requires_grad=m.in_proj_weight.requires_grad)
        self.in_proj_weight = w
        self.head_sizes = [s // (3 * m.head_dim) for s in lay.sizes()]  # every rank's heads
        self.in_proj_bias = None
        if m.in_proj_bias is not None:
            b = layouts["in_proj_bias"]
            bias = nn.Parameter(b.shard(m.in_proj_bias.detach()).clone(), requires_grad=m.in_proj_bias.requires_grad)
            self.in_proj_bias = bias
        self.out_proj = m.out_proj  # replaced by its own 'rowwise' layer in the same swap
        self.train(m.training)

    def _heads(self, t: torch.Tensor, length: int, batch: int) -> torch.Tensor:
        return t.reshape(length, batch * self.local_heads, self.head_dim).transpose(0, 1)

    def _mask(self, attn_mask, key_padding_mask, batch: int, dtype) -> torch.Tensor | None:
        """The additive mask for this rank's heads, [batch x local heads, L or 1, S] (torch's conventions:
        True = masked; a 3-D attn_mask holds every head's rows)."""
        def additive(x):
            return torch.zeros_like(x, dtype=dtype).masked_fill(x, float("-inf")) if x.dtype == torch.bool \
                else x.to(dtype)
        out = None
        if attn_mask is not None:
            out = additive(attn_mask)
            if out.dim() == 3:
                out = out.unflatten(0, (batch, self.total_heads)).narrow(1, self.first_head, self.local_heads)
                out = out.flatten(0, 1)
        if key_padding_mask is not None:
            kpm = additive(key_padding_mask).view(batch, 1, 1, -1).expand(-1, self.local_heads, -1, -1)
            kpm = kpm.reshape(batch * self.local_heads, 1, -1)
            out = kpm if out is None else out + kpm
        return out

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if is_causal and attn_mask is None:
            raise RuntimeError("MultiheadAttention: is_causal=True needs attn_mask (the causal mask); torch's "
                               "module says the same")
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        length, batch, _ = query.shape
        w = self.in_proj_weight.chunk(3)
        b = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        q, k, v = (F.linear(copy_to_region(x, self.comm), wi, bi) for x, wi, bi in zip((query, key, value), w, b))
        q, k, v = self._heads(q, length, batch), self._heads(k, key.shape[0], batch), self._heads(v, key.shape[0], batch)
        mask = self._mask(attn_mask, key_padding_mask, batch, q.dtype)
        p = self.dropout if self.training else 0.0
        scores = torch.bmm(q * (1.0 / math.sqrt(self.head_dim)), k.transpose(-2, -1))
        weights = (scores if mask is None else scores + mask).softmax(-1)
        out = torch.bmm(F.dropout(weights, p) if p else weights, v)
        out = out.transpose(0, 1).reshape(length * batch, self.local_heads * self.head_dim)
        out = self.out_proj(out).view(length, batch, -1)
        out = out.squeeze(1) if unbatched else (out.transpose(0, 1) if self.batch_first else out)
        if not need_weights:
            return out, None
        weights = weights.view(batch, self.local_heads, length, -1)
        if average_attn_weights:
            weights = reduce_from_region(weights.sum(1), self.comm) / self.total_heads
        else:
            weights = gather_from_region(weights, self.comm, dim=1, sizes=self.head_sizes)
        return out, (weights.squeeze(0) if unbatched else weights)


class MultiheadAttentions(Family):
    """Every `nn.MultiheadAttention` the forward runs, split by heads when it reads its out_proj itself (and
    nothing else does) and its heads divide; otherwise whole, with the reason on its out_proj."""

    name = "multihead_attention"
    styles = (MultiheadAttentionHeads(),)

    def detect(self, analysis) -> list[str]:
        t = analysis.trace
        return [] if t is None else [n for n, m in analysis.model.named_modules()
                                     if n and type(m) is nn.MultiheadAttention and n in t.module_inputs]

    def propose(self, draft: Draft, found: list[str]) -> list[Proposal]:
        out = []
        for name in found:
            m, proj = draft.analysis.model.get_submodule(name), f"{name}.out_proj"
            why = unsupported(m)
            if why is None and draft.analysis.trace.readers.get(proj) != name:
                why = f"{proj} is not read by {name}'s own forward alone"
            if why is None:
                try:
                    head_layout(m.num_heads, m.num_heads, draft.world_size, name)
                except HeadLayoutError as exc:
                    why = str(exc)
            if why:
                out.append(Proposal(self.name, name, (Choice("whole", reasons={proj: f"{name} stays whole: {why}"}),)))
                continue
            role = Role(ATTENTION, "qkv", attention=name, head_dim=m.head_dim, num_heads=m.num_heads,
                        num_kv_heads=m.num_heads)
            split = Choice("split by heads", {name: MULTIHEAD_ATTENTION, proj: ROWWISE},
                           details={name: role, proj: role.replace(role="o")})
            kept = Choice("whole", reasons={proj: f"{name} stays whole: kept whole by the chosen setup"})
            out.append(Proposal(self.name, name, (split, kept)))
        return out
