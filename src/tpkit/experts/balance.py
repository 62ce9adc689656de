"""Balancing the experts by the router's bias, on the global batch's counts (DeepSeek-V3's auxiliary-loss-free
balancing).

A router with a score-correction bias (`e_score_correction_bias`: DeepSeek-V3, GLM-4-MoE and their kin) picks its
top-k experts by score plus bias, and the bias is not trained by the gradient: after each step it moves by a small
rate toward balance, up for experts that received fewer tokens than the mean, down for those that received more.
transformers leaves that update to the training loop. Under expert parallelism each rank sees only its own tokens,
so its counts are a part of the batch's: `update_expert_bias` sums every rank's counts over the stage (the expert
group, then the expert-data group: every rank's rows once, the tp ranks of a replica having dispatched disjoint
rows), so every rank moves the bias alike, as one process would on the whole batch.
"""
from __future__ import annotations

import torch
from torch import nn

from .apply import experts_of
from .module import DispatchedExperts

BIAS = "e_score_correction_bias"


def router_bias(model: nn.Module, experts_name: str) -> torch.Tensor:
    """The score-correction bias of the router beside the experts module `experts_name`."""
    parent_name = experts_name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    found = [getattr(m, BIAS) for m in parent.children() if isinstance(getattr(m, BIAS, None), torch.Tensor)]
    if len(found) != 1:
        raise ValueError(f"update_expert_bias: {parent_name or type(model).__name__} holds {len(found)} routers with a "
                         f"score-correction bias ({BIAS}) beside its experts; balancing by bias needs exactly one")
    return found[0]


@torch.no_grad()
def update_expert_bias(model: nn.Module, rate: float = 1e-3) -> dict[str, torch.Tensor]:
    """Move each MoE layer's router bias by `rate` toward balance, from the tokens each expert received since the
    last call on every rank of the stage: `bias += rate * sign(mean load - load)`. Collective over the stage's
    ranks; returns each experts module's global load (tokens per expert). Call it after `optimizer.step()`."""
    state = experts_of(model)
    if state is None:
        raise ValueError("update_expert_bias: the model is not expert-parallel (tpkit.expert_parallel)")
    loads = {}
    for name in state.modules:
        module = model.get_submodule(name)
        assert isinstance(module, DispatchedExperts)
        bias = router_bias(model, name)
        load = module.tokens_per_expert
        load = torch.zeros(module.info.num_experts, dtype=torch.long) if load is None else load.detach().cpu()
        load = state.ep.all_reduce(load)
        if state.edp is not None:
            load = state.edp.all_reduce(load)
        bias.add_(rate * torch.sign(load.double().mean() - load.double()).to(bias.device, bias.dtype))
        module.tokens_per_expert = None
        loads[name] = load
    return loads
