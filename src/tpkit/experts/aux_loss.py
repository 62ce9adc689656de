"""The router's auxiliary (load-balancing) loss over the whole global batch, as one process computes it.

A Hugging Face MoE model with `output_router_logits` adds `router_aux_loss_coef * load_balancing_loss_func(router
logits of every layer, ...)` to its loss: the fraction of tokens each expert received times its mean routing
probability, over the batch the forward saw. Under data parallelism each rank sees its share of the batch, and the
mean of the ranks' losses is not the loss of the whole batch (the product of two means is not linear in the
tokens). So, as Megatron's global aux loss does, every rank computes it on the whole global batch:
- the model's own coefficient is set to 0 (its forward then adds nothing: `router_aux_loss_coef` on the model, the
  config keeps the real one), and a hook after the forward adds `coef * aux` itself;
- `aux` is the model's own `load_balancing_loss_func` (the formula of its module, whatever it is) on every layer's
  router logits gathered over the dp group in batch order (`gather_from_region`: each rank's gradient is that of its
  own tokens' logits), with the attention masks gathered the same way;
- its gradient is multiplied by the dp size on the way back: the engines average gradients over dp, and the global
  aux loss appears once in the global loss, not once per rank.
Context parallelism (tokens of one sequence on several ranks) and pipelines (the loss on the last stage, the router
logits on every stage) are refused with the auxiliary loss on.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..nn.mappings import gather_from_region, scale_grad


def aux_loss_on(model: nn.Module) -> bool:
    """Whether `model`'s forward adds the router's auxiliary loss (its config asks for router logits, with a
    coefficient)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "output_router_logits", False)) and bool(getattr(model, "router_aux_loss_coef", 0))


class GlobalAuxLoss:
    """The hook pair that replaces a model's per-rank auxiliary loss by the global batch's (module docstring)."""

    def __init__(self, model: nn.Module, dp: Communicator):
        fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        if fn is None:
            raise NotImplementedError(f"expert_parallel: {type(model).__name__} asks for router logits, but its module "
                                      f"has no load_balancing_loss_func to compute the auxiliary loss globally with")
        self.fn: Callable = fn
        self.dp, self.coef = dp, float(model.router_aux_loss_coef)
        self.num_experts, self.top_k = _experts_and_k(model.config)

    def install(self, model: nn.Module) -> None:
        model.router_aux_loss_coef = 0.0
        model.register_forward_hook(self.after, with_kwargs=True)

    def after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output):
        logits = output.get("router_logits") if isinstance(output, dict) else None
        if not isinstance(logits, tuple) or not logits:
            return output
        rows = [int(n) for n in self.dp.all_gather(torch.tensor([logits[0].shape[0]])).tolist()]
        gathered = tuple(gather_from_region(g, self.dp, 0, rows) for g in logits)
        mask = kwargs.get("attention_mask")
        if mask is not None:
            batches = [int(n) for n in self.dp.all_gather(torch.tensor([mask.shape[0]])).tolist()]
            mask = self.dp.all_gather(mask.contiguous(), 0, batches)
        aux = self.fn(gathered, self.num_experts, self.top_k, mask)
        output["aux_loss"] = aux
        loss = output.get("loss")
        if loss is not None:
            output["loss"] = loss + self.coef * scale_grad(aux, times=self.dp.world_size).to(loss.device)
        return output


def _experts_and_k(config) -> tuple[int, int]:
    experts = next((getattr(config, a) for a in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(getattr(config, a, None), int)), None)
    k = getattr(config, "num_experts_per_tok", None)
    if experts is None or not isinstance(k, int):
        raise NotImplementedError(f"expert_parallel: {type(config).__name__} does not name its expert count and top-k "
                                  f"(num_experts / num_local_experts, num_experts_per_tok) for the auxiliary loss")
    return experts, k
