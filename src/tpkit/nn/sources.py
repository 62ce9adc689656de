"""A module class's `forward` as source text, read once per class: how tpkit tells what a forward reads (the
attention it dispatches to, the config fields it takes) without running it."""
from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def forward_source(cls: type) -> str:
    """The source of `cls.forward`, or "" where Python has none (a builtin, a class made at run time)."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


__all__ = ["forward_source"]
