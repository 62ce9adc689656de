"""Plan reuse: the plan of a model whose blocks repeat, from the plan of its distinct blocks.

`trace.analyze_blocks` traces a deep model cut to its distinct leading blocks; the planner plans that, and
`expand` gives every later block the entries, details and reasons of the traced block with its signature, module
names renamed (`model.layers.1.mlp.up_proj` -> `model.layers.37.mlp.up_proj`); a model-level fact naming the last
traced block names the last block. Whatever it cannot rename for sure (a block's fact naming another block, or
naming a module outside the blocks when copied elsewhere in the stack; a model-level fact naming an inner block)
gives None, and the caller plans from the whole trace. `enabled` reads the switch: `plan(..., reuse=False)` or the environment's `TPKIT_PLAN_REUSE=0`.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, Iterable

from ..plan import Plan
from ..roles import Role
from ..trace.blocks import Blocks


class _Unsure(Exception):
    """A name the renaming cannot vouch for."""


def enabled(reuse: bool | None) -> bool:
    """The `reuse` argument, or when None the environment (`TPKIT_PLAN_REUSE=0` turns reuse off)."""
    if reuse is not None:
        return bool(reuse)
    return os.environ.get("TPKIT_PLAN_REUSE", "1").strip().lower() not in ("0", "false", "no", "off")


def _renamer(blocks: list[Blocks]) -> tuple[re.Pattern, dict[str, Blocks]]:
    names = sorted((b.name for b in blocks), key=len, reverse=True)
    pattern = re.compile(r"(?<![\w.])(" + "|".join(re.escape(n) for n in names) + r")\.(\d+)(?!\w)")
    return pattern, {b.name: b for b in blocks}


def _outside(names: Iterable[str]) -> re.Pattern | None:
    """A pattern for the modules outside the blocks (a copied block's fact naming one is unsure)."""
    names = sorted(set(names), key=len, reverse=True)
    if not names:
        return None
    return re.compile(r"(?<![\w.\-])(" + "|".join(re.escape(n) for n in names) + r")(?![\w.\-])")


def _model_text(text: str, pattern: re.Pattern, lists: dict[str, Blocks]) -> str:
    """A model-level fact (of a module outside the blocks): it names the last traced block as the last block, the
    blocks before it as themselves; naming any other is unsure."""
    def sub(m: re.Match) -> str:
        b, d = lists[m.group(1)], int(m.group(2))
        if d < b.keep - 1:
            return m.group(0)
        if d == b.keep - 1:
            return f"{b.name}.{b.length - 1}"
        raise _Unsure(text)

    return pattern.sub(sub, text)


def _pieces(text: str, pattern: re.Pattern, where: str, outside: re.Pattern | None) -> tuple[list[str], bool]:
    """A block fact cut where it names its block (`where`: "list.j"; to be joined with the new name), and whether
    it names a module outside the blocks. Naming any other block is unsure."""
    parts = pattern.split(text)  # [text, list, index, text, list, index, ..., text]
    if any(f"{parts[k]}.{parts[k + 1]}" != where for k in range(1, len(parts), 3)):
        raise _Unsure(text)
    return parts[0::3], outside is not None and outside.search(text) is not None


def _names_in(value: str | Role) -> list[tuple[str, str | tuple]]:
    """The fields of a fact that hold module names: ("", text) for a reason, (field, value) for a Role."""
    if isinstance(value, str):
        return [("", value)]
    out = []
    for fld in dataclasses.fields(value):
        v = getattr(value, fld.name)
        if isinstance(v, str) or (isinstance(v, tuple) and v and all(isinstance(x, str) for x in v)):
            out.append((fld.name, v))
    return out


def _block_copies(value: str | Role, pattern: re.Pattern, where: str, outside: re.Pattern | None,
                  targets: list[tuple[str, bool]]) -> list[str | Role]:
    """`value` (a fact of block `where`) for every target (its new name "list.i", moved): the name replaced."""
    cut = {}
    near = False
    for field, v in _names_in(value):
        texts = (v,) if isinstance(v, str) else v
        cuts = [_pieces(t, pattern, where, outside) for t in texts]
        near = near or any(c[1] for c in cuts)
        if any(len(c[0]) > 1 for c in cuts):
            cut[field] = (isinstance(v, str), [c[0] for c in cuts])
    if near and any(moved for _, moved in targets):
        raise _Unsure(str(value))
    if not cut:
        return [value] * len(targets)
    if isinstance(value, str):
        return [new.join(cut[""][1][0]) for new, _ in targets]
    out = []
    for new, _ in targets:
        role = object.__new__(Role)  # a frozen record: fill the copy's fields directly (dataclasses.replace is slow)
        role.__dict__.update(value.__dict__)
        role.__dict__.update({f: new.join(parts[0]) if one else tuple(new.join(p) for p in parts)
                              for f, (one, parts) in cut.items()})
        out.append(role)
    return out


def _model_fact(value: str | Role, pattern: re.Pattern, lists: dict[str, Blocks]) -> str | Role:
    """A model-level reason or role with the block names in it renamed (`_model_text`)."""
    if isinstance(value, str):
        return _model_text(value, pattern, lists)
    return dataclasses.replace(value, **{f: _model_text(v, pattern, lists) if isinstance(v, str)
                                         else tuple(_model_text(x, pattern, lists) for x in v)
                                         for f, v in _names_in(value)})


def outside_blocks(names: Iterable[str], blocks: list[Blocks]) -> list[str]:
    """The module names (of the cut model) in no block list and holding none: what `expand` calls `outside`."""
    inside = tuple(b.name for b in blocks)
    return [n for n in names if n and not n.startswith(inside) and not any(b.startswith(n + ".") for b in inside)]


def expand(plan: Plan, blocks: list[Blocks], outside: Iterable[str],
           verbatim: Callable[[str], bool] = lambda reason: False) -> Plan | None:
    """`plan` (of the model cut to its distinct blocks) for the whole model, or None when unsure. `outside`: the
    names of the modules outside the blocks (a fact of a block copied elsewhere in the stack that names one, such
    as the embeddings feeding the first block, is unsure). A reason for which `verbatim` holds is copied to every
    block as it is: one reason given to a module in every block alike (the dry run's, which names the block where
    the forward failed first, in the whole model as in the cut)."""
    pattern, lists = _renamer(blocks)
    around = _outside(outside)
    out: tuple[dict, dict, dict] = ({}, {}, {})
    try:
        for k, source in enumerate((plan.entries, plan.details, plan.reasons)):
            for name, value in source.items():
                m = pattern.match(name)
                as_is = k == 0 or (k == 2 and verbatim(value))
                if m is None:
                    out[k][name] = value if as_is else _model_fact(value, pattern, lists)
                    continue
                b, j = lists[m.group(1)], int(m.group(2))
                targets = [(f"{b.name}.{i}", i != j and not (j == b.keep - 1 and i == b.length - 1))
                           for i, src in enumerate(b.source) if src == j]  # moved: copied elsewhere in the stack
                values = [value] * len(targets) if as_is else _block_copies(value, pattern, m.group(0), around,
                                                                             targets)
                for (new, _), v in zip(targets, values):
                    out[k][new + name[m.end():]] = v
    except _Unsure:
        return None
    return plan.replaced(*out)
