"""Parameters whose gradient is a sum over ranks, summed where their module reads them.

Some parameters are held by several ranks that each apply them to their own share of the work: a per-head norm
every rank holds whole but applies to its own heads, KV-head rows held by the ranks whose query heads share them,
the router of a MoE block whose experts are split, a norm running on a slice of the sequence. Each holder's gradient
is then a partial sum; the gradient of the one-device model is the sum over the holders.

The sum is the backward half of a conjugate pair (Megatron's mappings), applied to the parameter itself: while
the module that owns it runs its forward, reading `module.weight` gives the parameter through `copy_to_region`
(identity forward, all-reduce backward), or through `copy_rows_to_region` for rows held by some ranks only. Outside
that forward the name gives the Parameter as usual (`.grad`, `.data`, optimizers, state dicts). It is a rewrite of
how the parameter enters the forward (`rewrites.py`), registered on the module by name, so it survives every path
that replaces the Parameter object, pickling, and `torch.compile`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..layout import ShardLayout
from .mappings import copy_rows_to_region, copy_to_region
from .rewrites import Rewrite, rewrite, rewrites_of, unapplied


@dataclass(frozen=True)
class GradSum:
    """How one parameter's gradient is summed: over all ranks (`rows` None), or, for rows of dim 0 held by
    several ranks, per row over its holders (`rows`: this rank's rows as positions in the full dim 0 of
    `full_rows`; every rank of the group takes part, one whose rows are all single included)."""

    rows: tuple[int, ...] | None = None
    full_rows: int = 0


def rows_sum(layout: ShardLayout) -> GradSum | None:
    """The gradient sum of a tensor whose rows (dim `layout.dim`, the rows of a column split) several ranks hold,
    each for its own part of the work (a KV head two ranks' query heads read), or None when no row is shared."""
    if not layout.shares_entries():
        return None
    return GradSum(tuple(layout.index()), layout.full_shape[layout.dim])


def summed(p: torch.Tensor, how: GradSum, comm: Communicator) -> torch.Tensor:
    """`p` entering the computation with its gradient summed as `how` says (itself at world size 1)."""
    return copy_to_region(p, comm) if how.rows is None else copy_rows_to_region(p, how.rows, how.full_rows, comm)


class Summed(Rewrite):
    """The rewrite: inside its module's forward, the parameter enters through the sum `how` over `comm`."""

    def __init__(self, how: GradSum, comm: Communicator):
        self.how, self.comm = how, comm

    def read(self, module: nn.Module, name: str, stored: torch.Tensor | None) -> torch.Tensor:
        return summed(stored, self.how, self.comm)


def sum_grads(module: nn.Module, params: Mapping[str, GradSum] | Iterable[str], comm: Communicator) -> None:
    """Sum the gradients of `module`'s own parameters `params` (names, or names -> GradSum) over the ranks of
    `comm`, from now on, whatever Parameter objects they later hold. Collective in effect: every rank installs
    the same names (each with its own rows). Adding names to a module already summing merges them."""
    specs = dict(params) if isinstance(params, Mapping) else {n: GradSum() for n in params}
    missing = [n for n in specs if n not in module._parameters]
    if missing:
        raise ValueError(f"sum_grads: {type(module).__name__} has no parameter(s) {missing}; its parameters are "
                         f"{sorted(module._parameters)}")
    if comm.world_size == 1:
        return
    for n, how in specs.items():
        rewrite(module, n, Summed(how, comm))


def _tp_sum(how: Rewrite | None) -> "Summed | None":
    """The TP sum of a rewrite: itself, or the one a wider sum (over the cp group) keeps inside (`inner`)."""
    how = getattr(how, "inner", how) if not isinstance(how, Summed) else how
    return how if isinstance(how, Summed) else None


def sum_of(module: nn.Module, name: str) -> GradSum | None:
    """How `module`'s parameter `name` has its gradient summed over its TP group, or None."""
    how = _tp_sum(rewrites_of(module).get(name))
    return how.how if how is not None else None


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def grad_sums(model: nn.Module) -> dict[str, GradSum]:
    """Every summed parameter of `model`, by state-dict key."""
    return {_key(prefix, n): _tp_sum(how).how for prefix, m in model.named_modules()
            for n, how in rewrites_of(m).items() if _tp_sum(how) is not None}


def unsummed(model: nn.Module) -> list[str]:
    """State-dict keys of parameters recorded as summed whose module no longer sums them (its class or its hooks
    replaced): a gradient that would be silently partial."""
    summing = set(grad_sums(model))
    return [k for k in unapplied(model) if k in summing]
