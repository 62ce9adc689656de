"""The leaves of an op's arguments or results, as `torch.utils._pytree.tree_flatten` gives them, fast.

The tracer flattens every op's arguments and outputs (several times an op): through torch's pytree that was about a
quarter of a trace. Plain tuples, lists and dicts, nearly all it meets, are walked here; anything else a pytree
node (a namedtuple, `torch.Size`, an OrderedDict or a `ModelOutput`, a registered type) goes to `tree_flatten`, and
everything else is a leaf, as there.
"""
from __future__ import annotations

from typing import Any

from torch.utils._pytree import SUPPORTED_NODES, tree_flatten


def flatten(tree: Any) -> list:
    """`tree_flatten(tree)[0]`."""
    out: list = []
    _collect(tree, out)
    return out


def _collect(x: Any, out: list) -> None:
    kind = type(x)
    if kind is tuple or kind is list:
        for v in x:
            _collect(v, out)
    elif kind is dict:
        for v in x.values():
            _collect(v, out)
    elif isinstance(x, (tuple, list, dict)) or kind in SUPPORTED_NODES:
        out.extend(tree_flatten(x)[0])
    else:
        out.append(x)
