"""Pairs for modules the traced forward did not run, by analogy with a module of the same class that it did.

A decoder's cross-attention (BART's `encoder_attn`) does not run without encoder states; a second tower may not
run for the inputs given. When such a module is of the same class as a module that did run, with the same
layers of the same shapes (`self_attn`), it runs the same code: its pairs are that module's pairs under its own
name, with the same roles. Only pairs wholly inside the traced module are carried over. A module with no such
twin stays whole ("not run in the traced forward"), unless it is a model of its own (a Hugging Face vision or
text tower: a `config` and a `main_input_name`): then `towers` traces it alone, with its own default inputs, and
takes its pairs under its name.
"""
from __future__ import annotations

import dataclasses

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


def twins(model: nn.Module, leaves, ran, pairs: list[Pair], structures: dict[str, Role]) -> tuple[list, dict]:
    """Pairs and roles for modules none of whose layers ran, copied from a traced module of the same class and
    parameter shapes (`ran`: the layers that ran)."""
    modules = dict(model.named_modules())
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


def towers(model: nn.Module, leaves, ran, analyze) -> tuple[list, dict]:
    """Pairs and roles of the sub-models none of whose layers ran (a vision tower given no image), each traced
    alone by `analyze(module)` with its own default inputs."""
    new_pairs, new_roles, done = [], {}, []
    for name, m in model.named_modules():
        if not name or any(name.startswith(d + ".") for d in done) or getattr(m, "config", None) is None \
                or not isinstance(getattr(m, "main_input_name", None), str):
            continue
        inner = [n for n in leaves if n.startswith(name + ".")]
        if not inner or any(n in ran for n in inner):
            continue
        done.append(name)
        sub = analyze(m)
        if sub.trace is None:
            continue
        new_pairs += [_prefixed(p, name) for p in sub.pairs]
        new_roles.update({f"{name}.{leaf}": _prefixed(r, name) for leaf, r in sub.structures.items()})
    return new_pairs, new_roles
