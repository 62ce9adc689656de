"""Pairs for modules the traced forward did not run, by analogy with a module of the same class that it did.

A decoder's cross-attention (BART's `encoder_attn`) does not run without encoder states; a second tower may not
run for the inputs given. When such a module is of the same class as a module that did run, with the same
layers of the same shapes (`self_attn`), it runs the same code: its pairs are that module's pairs under its own
name, with the same roles. Only pairs wholly inside the traced module are carried over. A module with no such
twin stays whole ("not run in the traced forward"), unless `towers` can trace it alone: a model of its own (a
Hugging Face vision or audio tower: a `config` and a `main_input_name`) with its own default inputs, or a plain
module of several layers (the projector between a tower and the language model) with a batch shaped for its first
layer. Its pairs and its notes (why a layer stays whole) are taken under its name. Such a module runs, in the full
model, on what the tower or the model before it hands over: a whole (replicated) activation, as every module
outside a pair receives, so the pairs found alone hold there.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from torch import nn

from ..roles import Pair, Role


def _shape(m: nn.Module) -> tuple:
    return type(m), tuple((n, tuple(p.shape)) for n, p in m.named_parameters())


def _rename(value, old: str, new: str):
    if isinstance(value, str):
        return new + value[len(old):] if value == old or value.startswith(old + ".") else value
    if isinstance(value, tuple):
        return tuple(_rename(v, old, new) for v in value)
    return value


def _moved(record, old: str, new: str):
    return dataclasses.replace(record, **{f.name: _rename(getattr(record, f.name), old, new)
                                          for f in dataclasses.fields(record) if f.name != "head_args"})


def _inside(names, root: str) -> bool:
    return all(n == root or n.startswith(root + ".") for n in names if n)


def _members(p: Pair) -> list[str]:
    return [*p.columns, p.row, *p.carried, *p.per_head, p.attention or ""]


def twins(modules: Mapping[str, nn.Module], leaves, ran, pairs: list[Pair], structures: dict[str, Role]
          ) -> tuple[list, dict]:
    """Pairs and roles for modules none of whose layers ran, copied from a traced module of the same class and
    parameter shapes (`modules`: the model's, by name; `ran`: the layers that ran)."""
    under = {name: [n for n in leaves if n.startswith(name + ".")] for name in modules if name}
    traced = {}
    for name, inner in under.items():
        if inner and all(n in ran for n in inner):
            traced.setdefault(_shape(modules[name]), name)
    new_pairs, new_roles, done = [], {}, []
    for name, inner in under.items():
        if not inner or any(n in ran for n in inner) or any(name.startswith(d + ".") for d in done):
            continue
        twin = traced.get(_shape(modules[name]))
        if twin is None:
            continue
        done.append(name)
        for p in pairs:
            if _inside(_members(p), twin):
                new_pairs.append(_moved(p, twin, name))
        for leaf, role in structures.items():
            if leaf.startswith(twin + "."):
                new_roles[_rename(leaf, twin, name)] = _moved(role, twin, name)
    return new_pairs, new_roles


def _prefixed(record, prefix: str):
    def move(v):
        if isinstance(v, str):
            return f"{prefix}.{v}" if v else prefix
        return tuple(move(x) for x in v) if isinstance(v, tuple) else v
    return dataclasses.replace(record, **{f.name: move(getattr(record, f.name))
                                          for f in dataclasses.fields(record) if f.name != "head_args"})


def _alone(m: nn.Module, leaves, name: str) -> bool:
    """Whether `m` can be traced on its own: a sub-model (a config and a main input name), or a plain module
    holding two or more of the model's layers."""
    if getattr(m, "config", None) is not None and isinstance(getattr(m, "main_input_name", None), str):
        return True
    return sum(1 for n in leaves if n.startswith(name + ".")) >= 2


@dataclasses.dataclass
class Alone:
    """What the modules traced alone add, under their names in the model: pairs, roles, notes (why a layer stays
    whole) and the layers their own traces ran."""

    pairs: list = dataclasses.field(default_factory=list)
    roles: dict = dataclasses.field(default_factory=dict)
    notes: dict = dataclasses.field(default_factory=dict)
    ran: set = dataclasses.field(default_factory=set)


def towers(modules: Mapping[str, nn.Module], leaves, ran, analyze, covered=()) -> Alone:
    """What the modules none of whose layers ran (a vision tower given no image, its projector) give when each is
    traced alone by `analyze(module)` with its default inputs (`modules`: the model's, by name); `covered`: layers
    given roles by `twins` already."""
    out, done = Alone(), []
    for name, m in modules.items():
        if not name or any(name.startswith(d + ".") for d in done) or not _alone(m, leaves, name):
            continue
        inner = [n for n in leaves if n.startswith(name + ".")]
        if not inner or any(n in ran or n in covered for n in inner):
            continue
        done.append(name)
        sub = analyze(m)
        if sub.trace is None:
            continue
        out.pairs += [_prefixed(p, name) for p in sub.pairs]
        out.roles.update({f"{name}.{leaf}": _prefixed(r, name) for leaf, r in sub.structures.items()})
        out.notes.update({f"{name}.{leaf}": why for leaf, why in sub.notes.items()})
        out.ran.update(f"{name}.{leaf}" for leaf in [*sub.trace.calls, *sub.traced_alone])
    return out
