"""Experts held in shards: a mixture-of-experts layer with one all-reduce after its combine.

A mixture-of-experts layer computes, per token, `sum_e w_e * E_e(x)` over the experts `e` the router picked.
When each rank holds a slice of every expert's intermediate features (tensor parallelism inside each expert:
gate/up by rows, down by columns) or all of some of the experts (expert parallelism), what a rank computes for
an expert is a partial sum of that expert's output, and partial sums survive the weighted combine: the rank's
combined output is a partial sum of the layer's output. So the whole layer needs one all-reduce, after the
combine, not one per expert.

The router runs whole on every rank (its decisions are replicated), so the hidden states and the routing
weights enter the layer with `copy_to_region` (identity forward; on each rank their gradients are partial, so
backward sums them) and the combined output leaves with `reduce_from_region` (all-reduce forward). Under
expert parallelism the global expert numbers the router gives are mapped to this rank's own (`first`,
`count`): experts held elsewhere become the sentinel `count`, which the layer skips, and get weight 0.

`ExpertsRegion` installs this as two hooks on the experts module, so its own forward (whatever kernel it picks)
runs unchanged on the shards; no host sync, nothing that breaks a compiled graph.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..comm import Communicator
from .mappings import copy_to_region, reduce_from_region, scale_grad


class ExpertsRegion:
    """The two hooks that make an experts module's forward `(hidden, expert_index, expert_weights)` exact on
    sharded experts: replicated inputs in, one all-reduce of the combined output out.

    `names` are the forward's parameter names for the three inputs (positional or keyword); `experts`
    is `(first, count)`, this rank's experts under expert parallelism, or None when every rank holds a slice
    of every expert."""

    def __init__(self, comm: Communicator, names: tuple[str, str, str], experts: tuple[int, int] | None = None):
        self.comm, self.names, self.experts = comm, tuple(names), experts

    def install(self, module: nn.Module) -> nn.Module:
        module.register_forward_pre_hook(self.enter, with_kwargs=True)
        module.register_forward_hook(self.leave)
        return module

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        values = [_arg(args, kwargs, i, n) for i, n in enumerate(self.names)]
        hidden, index, weights = values
        if hidden.dtype == torch.float64:
            _eager_for_float64(module)
        # Entered before the masking below: the gradient a rank gives the weights of its own experts is summed
        # with the other ranks' (which hold the rest), and only then flows back to the router.
        hidden, weights = copy_to_region(hidden, self.comm), copy_to_region(weights, self.comm)
        if self.experts is not None:
            first, count = self.experts
            local = index - first
            held = (local >= 0) & (local < count)
            index = torch.where(held, local, torch.full_like(local, count))
            weights = weights.masked_fill(~held, 0)
        for i, (n, v) in enumerate(zip(self.names, (hidden, index, weights))):
            _set_arg(args, kwargs, i, n, v)
        return tuple(args), kwargs

    def leave(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{type(module).__name__}: an experts module split by tpkit must return one tensor (the "
                            f"combined output), got {type(output).__name__}")
        return reduce_from_region(output, self.comm)


def _eager_for_float64(module: nn.Module) -> None:
    """transformers' default fused kernel (`grouped_mm`) has no float64: such a module runs transformers' eager
    loop instead, through a config of its own (the model's other modules keep theirs)."""
    config = getattr(module, "config", None)
    if getattr(config, "_experts_implementation", "eager") == "grouped_mm":
        module.config = copy.copy(config)
        module.config._experts_implementation = "eager"


def _arg(args: list, kwargs: dict, i: int, name: str):
    if name in kwargs:
        return kwargs[name]
    if i < len(args):
        return args[i]
    raise TypeError(f"experts forward called without its {name!r} argument (position {i})")


def _set_arg(args: list, kwargs: dict, i: int, name: str, value) -> None:
    if name in kwargs:
        kwargs[name] = value
    else:
        args[i] = value


class BlockRegion:
    """Hooks that make a whole MoE block one partial-sum region, for experts kept as separate modules (whose
    combine happens in the block's own forward).

    Inside, every rank runs the whole router and its slice of every expert with no communication, so the
    block's first output is a partial sum: all-reduced once, on the way out. Its floating-point inputs enter
    with `copy_to_region`. The gradients of the block's replicated parameters (the router) are partial on each
    rank, so they are summed; a replicated output (router logits, for an auxiliary loss) brings the same full
    gradient on every rank, so it is divided by the world size on the way in, and the sums restore it."""

    def __init__(self, comm: Communicator):
        self.comm = comm

    def install(self, block: nn.Module, split: set[str] = frozenset()) -> nn.Module:
        """Make `block` one region; `split`: its modules (names inside it) that hold shards (the experts'
        projections), whose gradients are this rank's own; every other parameter's is summed."""
        from .grad_sums import sum_grads

        block.register_forward_pre_hook(self.enter, with_kwargs=True)
        block.register_forward_hook(self.leave)
        for name, m in block.named_modules():  # layers that compute partial results only run inside a region
            m.tp_block_region = True
            if name not in split:
                sum_grads(m, [n for n, p in m.named_parameters(recurse=False)], self.comm)
        return block

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def enter_one(v):
            return copy_to_region(v, self.comm) if isinstance(v, torch.Tensor) and v.is_floating_point() else v

        return tuple(enter_one(a) for a in args), {k: enter_one(v) for k, v in kwargs.items()}

    def leave(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return reduce_from_region(output, self.comm)
        if not isinstance(output, tuple) or not output or not isinstance(output[0], torch.Tensor):
            raise TypeError(f"{type(module).__name__}: a MoE block split by tpkit must return its combined output, "
                            f"alone or first in a tuple; got {type(output).__name__}")
        rest = tuple(scale_grad(o, over=self.comm.world_size)
                     if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad else o
                     for o in output[1:])
        return (reduce_from_region(output[0], self.comm),) + rest
