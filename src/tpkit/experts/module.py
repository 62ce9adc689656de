"""A fused experts module whose experts live on several ranks: this rank's experts, reached by all-to-all.

`DispatchedExperts` replaces a fused experts module of Hugging Face's layout (`tpkit.convert.families.experts`:
3-D `gate_up_proj` [E, 2I, H] or `up_proj`, and `down_proj` [E, H, I], possibly stored transposed) with one that
holds only this rank's experts under the same parameter names (state-dict keys do not change) and takes the same
forward `(hidden_states, top_k_index, top_k_weights)`.

Its rows: the router runs whole and alike on every rank of a tensor-parallel group, so each tp rank dispatches its
own share of the rows (the split rule, `scatter_to_region` along rows: the gradient of the whole input comes back
all-gathered), and the outputs are gathered back to every row (`gather_from_region`: each rank keeps its share of
the replicated gradient). Its experts: computed one at a time as transformers' eager path computes them
(`act(x @ gate) * (x @ up)`, then `@ down`), so every dtype runs, float64 included, and every local expert takes
part in every forward, with rows or without.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..comm import split_sizes
from ..comm.communicator import Communicator
from ..convert.families.experts import FusedExperts
from ..nn.mappings import gather_from_region, scatter_to_region
from .dispatch import ExpertOwners, dispatch


class DispatchedExperts(nn.Module):
    """Experts `first` .. `first + count - 1` of a fused experts module (`info`), the rest on the other ranks of
    the expert group `ep`; `tp`: the tensor-parallel group inside it whose ranks share rows (None: none)."""

    def __init__(self, original: nn.Module, info: FusedExperts, ep: Communicator, tp: Communicator | None):
        super().__init__()
        self.info, self.owners = info, ExpertOwners.split(info.num_experts, ep.world_size)
        self.ep, self.tp = ep, tp if tp is not None and tp.world_size > 1 else None
        self.first = self.owners.starts[ep.rank]
        self.count = self.owners.counts[ep.rank]
        self.act_fn = original.act_fn
        self.tokens_per_expert: torch.Tensor | None = None  # this rank's choices per expert since the last balancing
        for name in (info.up, "down_proj"):
            p = getattr(original, name)
            local = p.detach()[self.first:self.first + self.count].clone()
            self.register_parameter(name, nn.Parameter(local, requires_grad=p.requires_grad))

    def extra_repr(self) -> str:
        return (f"experts {self.first}..{self.first + self.count - 1} of {self.info.num_experts} over ep "
                f"{self.ep.world_size}{f', rows shared by tp {self.tp.world_size}' if self.tp else ''}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if parametrize.is_parametrized(self):  # PEFT's LoRA on the 3-D weights (`target_parameters`)
            raise NotImplementedError(
                f"{type(self).__name__}: its weights {sorted(self.parametrizations)} are parametrized (PEFT's LoRA "
                f"on fused experts, target_parameters): their adapters would hold every expert on every rank and skip "
                f"the experts' gradient rule; tpkit's expert parallelism trains LoRA on the other layers only (leave "
                f"the experts out of target_parameters)")
        if self.tp is None:
            return self.route(hidden_states, top_k_index, top_k_weights)
        sizes = split_sizes(hidden_states.shape[0], self.tp.world_size)
        start = sum(sizes[:self.tp.rank])
        index = top_k_index[start:start + sizes[self.tp.rank]]
        rows, weights = scatter_to_region(hidden_states, self.tp, 0), scatter_to_region(top_k_weights, self.tp, 0)
        out = self.route(rows, index, weights)
        return gather_from_region(out, self.tp, 0, sizes)  # uneven: fewer rows than tp ranks when decoding

    def route(self, rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's rows to their experts over the expert group and back (`dispatch.dispatch`); in training, the
        tokens each expert was chosen for, kept for balancing by the router's bias (`balance.update_expert_bias`)."""
        out, load = dispatch(rows, index, weights, self.ep, self.owners, self.compute)
        if self.training:
            self.tokens_per_expert = self.tokens_per_expert + load if self.tokens_per_expert is not None else load
        return out

    def compute(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on `rows`, `counts[e]` consecutive rows for local expert e (zero rows allowed)."""
        up, down = getattr(self, self.info.up), self.down_proj  # read once: a gradient sum applies once
        outs = []
        for e, x in enumerate(rows.split(counts)):
            h = x @ up[e] if self.info.transposed else nn.functional.linear(x, up[e])
            if self.info.pieces == 2:
                gate, lin = h.chunk(2, dim=-1)
                h = self.act_fn(gate) * lin
            else:
                h = self.act_fn(h)
            outs.append(h @ down[e] if self.info.transposed else nn.functional.linear(h, down[e]))
        return torch.cat(outs) if outs else rows.new_zeros((0, rows.shape[-1]))
