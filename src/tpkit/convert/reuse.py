"""Plan reuse: the plan of a model whose blocks repeat, from the plan of its distinct blocks.

`trace.analyze_blocks` traces a deep model cut to its distinct leading blocks; the planner plans that, and
`expand` gives every later block the entries, details and reasons of the traced block with its signature, module
names renamed (`model.layers.1.mlp.up_proj` -> `model.layers.37.mlp.up_proj`). Whatever it cannot rename for sure
(a block's facts naming another block, a model-level fact naming a block) gives None, and the caller plans from the
whole trace. `enabled` reads the switch: `plan(..., reuse=False)` or the environment's `TPKIT_PLAN_REUSE=0`.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, Iterable

from .plan import Plan
from .roles import Role
from .trace.blocks import Blocks


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


def _rename(text: str, pattern: re.Pattern, lists: dict[str, Blocks], where: tuple[str, int] | None, to: int,
            outside: re.Pattern | None = None) -> str:
    """`text` of traced block `where` (list, index) as block `to`: that block renamed, any other block named is
    unsure, and so is a module outside the blocks when `outside` is given (a copy to another block). A model-level
    `text` (`where` None) names the last traced block as the last block; the blocks before it are themselves."""
    def sub(m: re.Match) -> str:
        b, d = lists[m.group(1)], int(m.group(2))
        if where is not None and (b.name, d) == where:
            return f"{b.name}.{to}"
        if where is None and d < b.keep - 1:
            return m.group(0)
        if where is None and d == b.keep - 1:
            return f"{b.name}.{b.length - 1}"
        raise _Unsure(text)

    if outside is not None and outside.search(text):
        raise _Unsure(text)
    return pattern.sub(sub, text)


def _role(role: Role, f: Callable[[str], str]) -> Role:
    changes = {}
    for fld in dataclasses.fields(role):
        v = getattr(role, fld.name)
        if isinstance(v, str):
            changes[fld.name] = f(v)
        elif isinstance(v, tuple) and v and all(isinstance(x, str) for x in v):
            changes[fld.name] = tuple(f(x) for x in v)
    return dataclasses.replace(role, **changes)


def _copies(name: str, pattern: re.Pattern, lists: dict[str, Blocks], outside: re.Pattern | None):
    """(new name, renaming function) for every module that takes `name`'s facts: its block's copies, or itself."""
    m = pattern.match(name)
    if m is None or m.start() != 0:
        return [(name, lambda s: _rename(s, pattern, lists, None, 0))]
    b, j = lists[m.group(1)], int(m.group(2))
    out = []
    for i, src in enumerate(b.source):
        if src == j:
            moved = i != j and not (j == b.keep - 1 and i == b.length - 1)  # a copy to another place in the stack
            out.append((f"{b.name}.{i}{name[m.end():]}",
                        lambda s, i=i, o=outside if moved else None: _rename(s, pattern, lists, (b.name, j), i, o)))
    return out


def expand(plan: Plan, blocks: list[Blocks], outside: Iterable[str]) -> Plan | None:
    """`plan` (of the model cut to its distinct blocks) for the whole model, or None when unsure. `outside`: the
    names of the modules outside the blocks."""
    pattern, lists = _renamer(blocks)
    around = _outside(outside)
    entries: dict[str, str] = {}
    details: dict[str, Role] = {}
    reasons: dict[str, str] = {}
    try:
        for source, out in ((plan.entries, entries), (plan.details, details), (plan.reasons, reasons)):
            for name, value in source.items():
                for new, f in _copies(name, pattern, lists, around):
                    out[new] = _role(value, f) if isinstance(value, Role) else value if out is entries else f(value)
    except _Unsure:
        return None
    result = Plan(world_size=plan.world_size, mode=plan.mode, reasons=reasons, prefix=plan.prefix)
    result.entries, result.details = entries, details  # already canonical styles and Role records
    return result
