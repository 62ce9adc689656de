"""Parameters whose gradient is a sum over ranks, summed where their module reads them.

Some parameters are held by several ranks that each apply them to their own share of the work: a per-head norm
every rank holds whole but applies to its own heads, KV-head rows held by the ranks whose query heads share them,
the router of a MoE block whose experts are split. Each holder's gradient is then a partial sum; the gradient of
the one-device model is the sum over the holders.

The sum is the backward half of a conjugate pair (Megatron's mappings), applied to the parameter itself: while
the module that owns it runs its forward, reading `module.weight` gives the parameter through
`copy_to_region` (identity forward, all-reduce backward), or through `copy_rows_to_region` for rows held by
some ranks only. Outside that forward the name gives the Parameter as usual (`.grad`, `.data`, optimizers, state dicts).

Why not a hook on the tensor: a tensor hook belongs to one Parameter object, and every path that replaces the
object drops it without a trace (a meta model materialised with `swap_tensors`, `to_empty`,
`load_state_dict(assign=True)`, `deepcopy`); a dropped hook is a silently wrong gradient. Here the mapping
belongs to the module: a subclass of its class made once per (class, names) (as `torch.nn.utils.parametrize`
does, but state-dict keys unchanged), plus forward hooks that say when its forward runs. Whatever Parameter
sits in `module._parameters` at forward time is summed, so the sum survives every such path, pickling, and
`torch.compile` (the property and hooks trace like any module code).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import nn

from ..comm.communicator import Communicator
from ._layer import SharedRef
from .mappings import copy_rows_to_region, copy_to_region


@dataclass(frozen=True)
class GradSum:
    """How one parameter's gradient is summed: over all ranks (`rows` None), or, for rows of dim 0 held by
    several ranks, per row over its holders (`rows`: this rank's rows as positions in the full dim 0 of
    `full_rows`; every rank of the group takes part, one whose rows are all single included)."""

    rows: tuple[int, ...] | None = None
    full_rows: int = 0


def summed(p: torch.Tensor, how: GradSum, comm: Communicator) -> torch.Tensor:
    """`p` entering the computation with its gradient summed as `how` says (itself at world size 1)."""
    return copy_to_region(p, comm) if how.rows is None else copy_rows_to_region(p, how.rows, how.full_rows, comm)


class GradSums:
    """What one module sums (`specs`: parameter name -> GradSum), over which communicator, and whether its
    forward is running (`depth`, counted so a module that calls itself stays inside)."""

    def __init__(self, specs: Mapping[str, GradSum], comm: Communicator):
        self.specs, self._comm, self.depth = dict(specs), SharedRef(comm), 0

    @property
    def comm(self) -> Communicator:
        return self._comm.value

    def enter(self, module: nn.Module, args) -> None:
        self.depth += 1

    def leave(self, module: nn.Module, args, output) -> None:
        self.depth -= 1


_LOCK = threading.Lock()
_CLASSES: dict[tuple[type, frozenset], type] = {}


def _read(name: str):
    def get(self):
        p = self._parameters.get(name)
        if p is None:
            if name in self._parameters:
                return None
            return nn.Module.__getattr__(self, name)
        sums = self.__dict__["tp_grad_sums"]
        return summed(p, sums.specs[name], sums.comm) if sums.depth else p

    return property(get)


def _rebuild(base: type, names: frozenset) -> nn.Module:
    """Unpickling: an empty instance of the summing class (its state follows through `__setstate__`)."""
    return object.__new__(_summing_class(base, names))


def _reduce_ex(self, protocol):
    base, names = self.__dict__["tp_grad_sums_base"], frozenset(self.__dict__["tp_grad_sums"].specs)
    return _rebuild, (base, names), self.__getstate__()


def _summing_class(base: type, names: frozenset) -> type:
    """The subclass of `base` whose `names` read through the gradient sum during its forward: one per pair, kept,
    with the base's name (messages and `type(m).__name__` stay as they were)."""
    with _LOCK:
        cls = _CLASSES.get((base, names))
        if cls is None:
            body = {n: _read(n) for n in names}
            body.update(__module__=base.__module__, __qualname__=base.__qualname__, __reduce_ex__=_reduce_ex,
                        __doc__=base.__doc__)
            cls = _CLASSES[(base, names)] = type(base.__name__, (base,), body)
        return cls


def sum_grads(module: nn.Module, params: Mapping[str, GradSum] | Iterable[str], comm: Communicator) -> None:
    """Sum the gradients of `module`'s own parameters `params` (names, or names -> GradSum) over the ranks of
    `comm`, from now on, whatever Parameter objects they later hold. Collective in effect: every rank installs
    the same names (each with its own rows). Adding names to a module already summing merges them."""
    specs = dict(params) if isinstance(params, Mapping) else {n: GradSum() for n in params}
    missing = [n for n in specs if n not in module._parameters]
    if missing:
        raise ValueError(f"sum_grads: {type(module).__name__} has no parameter(s) {missing}; its parameters are "
                         f"{sorted(module._parameters)}")
    if comm.world_size == 1 or not specs:
        return
    old = module.__dict__.get("tp_grad_sums")
    if old is not None:
        old.specs.update(specs)
        specs = old.specs
    base = module.__dict__.get("tp_grad_sums_base", type(module))
    module.__class__ = _summing_class(base, frozenset(specs))
    if old is None:
        state = GradSums(specs, comm)
        module.__dict__["tp_grad_sums_base"] = base
        module.__dict__["tp_grad_sums"] = state
        module.register_forward_pre_hook(state.enter)
        module.register_forward_hook(state.leave, always_call=True)


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def grad_sums(model: nn.Module) -> dict[str, GradSum]:
    """Every summed parameter of `model`, by state-dict key."""
    out = {}
    for prefix, m in model.named_modules():
        state = m.__dict__.get("tp_grad_sums")
        for n, how in (state.specs.items() if state is not None else ()):
            out[_key(prefix, n)] = how
    return out


def unsummed(model: nn.Module) -> list[str]:
    """State-dict keys of parameters recorded as summed whose module no longer sums them (its class or its hooks
    replaced): a gradient that would be silently partial."""
    bad = []
    for prefix, m in model.named_modules():
        state = m.__dict__.get("tp_grad_sums")
        if state is None or state.comm.world_size == 1:
            continue
        hooked = (any(getattr(h, "__self__", None) is state for h in m._forward_pre_hooks.values())
                  and any(getattr(h, "__self__", None) is state for h in m._forward_hooks.values()))
        for n in state.specs:
            prop = getattr(type(m), n, None)
            if not (hooked and isinstance(prop, property) and n in m._parameters):
                bad.append(_key(prefix, n))
    return bad

