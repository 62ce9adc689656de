"""How a parameter enters its module's forward, changed by name: the one protocol for every such change.

tpkit changes how some tensors enter a forward: a gradient summed over the ranks that share a parameter
(`grad_sums.py`), a weight stored quantized and dequantized as it is read (`quantized.py`). Each change is a
`Rewrite` registered on the module that owns the tensor, under its name, as `torch.nn.utils.parametrize` keeps
`parametrizations[name]`:

- the registry (`rewrites_of(module)`: name -> Rewrite) and a public `remove_rewrite(module, name)` that gives the
  plain attribute back, and the module its own class when the last rewrite goes;
- one injected class per module at most: a subclass of the module's class made once per (class, rewritten names)
  and kept, whose property for each name asks the rewrite. It keeps the base's name, module and docstring
  (messages and `type(m).__name__` stay as they were), and the tensors stay in `_parameters` / `_buffers`, so
  state-dict keys do not change;
- a count of the module's own forwards running (a pre-hook and an always-called hook, registered with the first
  rewrite that needs it), so a rewrite may apply only inside them: a gradient sum must not touch `.grad` reads,
  optimizers or state dicts.

Why a class and not tensor hooks: a hook on a tensor belongs to one Parameter object, and every path that replaces
the object (`load_state_dict(assign=True)`, `to_empty`, `swap_tensors`, `deepcopy`) drops it without a trace. The
property reads whatever sits under the name when the forward runs; the registry deep-copies and pickles with the
module (the class is rebuilt by name on unpickling); `torch.compile` traces the property as module code.

This module is also the one place a tpkit module's class changes at all (`adopt`: PEFT's LoRA wrapper becoming
tpkit's LoRA layer for a base the converter split, `tpkit.nn.lora`; a plain `nn.Linear` a conversion keeps whole
becoming a `DecodeLinear`, `decode_linear.py`).
"""
from __future__ import annotations

import threading
from typing import Mapping

import torch
from torch import nn

_ATTR = "_tp_rewrites"
_LOCK = threading.Lock()
_CLASSES: dict[tuple[type, frozenset], type] = {}


class Rewrite:
    """How the tensor `name` of a module enters the module's forward. `read(module, name, stored)` gets what is
    stored under the name (a Parameter or a buffer; None when the name stores nothing, a quantized weight) and
    returns what the forward sees. `in_forward_only`: outside the module's forward the name gives the stored tensor
    (a gradient sum); False: every read is rewritten (a weight computed from stored tensors)."""

    in_forward_only: bool = True

    def read(self, module: nn.Module, name: str, stored: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class Rewrites:
    """One module's registry: `entries` (name -> Rewrite), its class before any rewrite (`base`), and how many of its
    forwards are running (`depth`, counted so a module that calls itself stays inside)."""

    def __init__(self, base: type):
        self.entries: dict[str, Rewrite] = {}
        self.base, self.depth = base, 0
        self.counted = False  # the counter hooks registered (once: a second pair would count each forward twice)

    def enter(self, module: nn.Module, args) -> None:
        self.depth += 1

    def leave(self, module: nn.Module, args, output) -> None:
        self.depth -= 1


def _property(name: str) -> property:
    def get(self):
        state: Rewrites = self.__dict__[_ATTR]
        how = state.entries[name]
        stored = self._parameters.get(name)
        if stored is None:
            stored = self._buffers.get(name)
        if how.in_forward_only and not state.depth:
            return stored if stored is not None or name in self._parameters else nn.Module.__getattr__(self, name)
        return how.read(self, name, stored)

    return property(get)


def _rebuild(base: type, names: frozenset) -> nn.Module:
    """Unpickling: an empty instance of the injected class (its state follows through `__setstate__`)."""
    return object.__new__(_class(base, names))


def _reduce_ex(self, protocol):
    state: Rewrites = self.__dict__[_ATTR]
    return _rebuild, (state.base, frozenset(state.entries)), self.__getstate__()


def _class(base: type, names: frozenset) -> type:
    """The subclass of `base` whose `names` are read through their rewrites: one per pair, kept."""
    if not names:
        return base
    with _LOCK:
        cls = _CLASSES.get((base, names))
        if cls is None:
            body = {n: _property(n) for n in names}
            body.update(__module__=base.__module__, __qualname__=base.__qualname__, __reduce_ex__=_reduce_ex,
                        __doc__=base.__doc__)
            cls = _CLASSES[(base, names)] = type(base.__name__, (base,), body)
        return cls


def rewrite(module: nn.Module, name: str, how: Rewrite) -> None:
    """Register `how` for the tensor `name` of `module` (replacing one registered before), from now on, whatever
    tensor object the name holds later."""
    state: Rewrites | None = module.__dict__.get(_ATTR)
    if state is None:
        state = module.__dict__[_ATTR] = Rewrites(type(module))
    if how.in_forward_only and not getattr(state, "counted", True):  # only such a rewrite reads the count: a
        # module without one (a quantized weight) keeps torch's call without hooks, ~1.2 us less per call at decode.
        # Registered once: a hook lost since stays lost, for `unapplied` to name (a registry pickled before the flag
        # existed had its hooks from the start)
        module.register_forward_pre_hook(state.enter)
        module.register_forward_hook(state.leave, always_call=True)
        state.counted = True
    state.entries[name] = how
    module.__class__ = _class(state.base, frozenset(state.entries))


def rewrites_of(module: nn.Module) -> Mapping[str, Rewrite]:
    """`module`'s rewrites by name (empty when it has none)."""
    state: Rewrites | None = module.__dict__.get(_ATTR)
    return dict(state.entries) if state is not None else {}


def remove_rewrite(module: nn.Module, name: str) -> Rewrite:
    """Stop rewriting `name` of `module`; returns the rewrite. The last one gone, the module is its own class again
    and its forward counter hooks are removed."""
    state: Rewrites | None = module.__dict__.get(_ATTR)
    if state is None or name not in state.entries:
        raise KeyError(f"remove_rewrite: {type(module).__name__} has no rewrite of {name!r} (it rewrites "
                       f"{sorted(state.entries) if state is not None else []})")
    how = state.entries.pop(name)
    module.__class__ = _class(state.base, frozenset(state.entries))
    if not state.entries:
        del module.__dict__[_ATTR]
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, h in hooks.items() if getattr(h, "__self__", None) is state]:
                del hooks[key]
                module._forward_hooks_always_called.pop(key, None)
    return how


def base_class(module: nn.Module) -> type:
    """The module's class before any rewrite."""
    state: Rewrites | None = module.__dict__.get(_ATTR)
    return state.base if state is not None else type(module)


def adopt(module: nn.Module, cls: type) -> None:
    """Make `module` an instance of `cls`, a subclass of its class that adds behaviour but no state of its own
    (PEFT's LoRA wrapper becoming tpkit's LoRA layer on a split base; an `nn.Linear` becoming a `DecodeLinear`).
    Rewrites registered on it are kept."""
    state: Rewrites | None = module.__dict__.get(_ATTR)
    base = state.base if state is not None else type(module)
    if not issubclass(cls, base):
        raise TypeError(f"adopt: {cls.__name__} is not a subclass of {base.__name__}")
    if state is not None:
        state.base = cls
    module.__class__ = _class(cls, frozenset(state.entries)) if state is not None else cls


def _counting(module: nn.Module, state: Rewrites) -> bool:
    """Whether `module` carries `state`'s forward counter hooks (registered with its first rewrite that applies
    inside the forward only)."""
    return (any(getattr(h, "__self__", None) is state for h in module._forward_pre_hooks.values())
            and any(getattr(h, "__self__", None) is state for h in module._forward_hooks.values()))


def unapplied(model: nn.Module) -> list[str]:
    """`(state-dict keys of)` rewritten tensors whose module no longer applies the rewrite (its class or its
    forward hooks replaced after tpkit registered it): a gradient that would be silently partial."""
    bad = []
    for prefix, m in model.named_modules():
        state: Rewrites | None = m.__dict__.get(_ATTR)
        if state is None:
            continue
        hooked = _counting(m, state)
        for n, how in state.entries.items():
            prop = getattr(type(m), n, None)
            if not (isinstance(prop, property) and (hooked or not how.in_forward_only)):
                bad.append(f"{prefix}.{n}" if prefix else n)
    return bad
