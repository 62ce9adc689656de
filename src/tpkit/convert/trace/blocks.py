"""Repeated blocks: trace a deep model as deep as its distinct blocks, not as deep as it is.

A transformer is an `nn.ModuleList` of blocks that are alike: same module classes, parameter shapes, settings.
`repeated_blocks` finds such lists and gives every block a structural signature (classes, parameter and buffer
shapes, plain attributes of every module inside but its layer index, and the model config's per-layer settings:
`layer_types[i]`, `i in mlp_only_layers`, `i % decoder_sparse_step`, ...). `analyze_blocks` then traces the model
with each list cut after the last block whose signature is new (a prefix, so every traced block keeps its own
index and its neighbours); a later block takes the plan of the first block with its signature (`convert/reuse.py`).
Anything it cannot vouch for (weights shared with a dropped block, a trace that fails when shortened) gives None:
the caller traces the whole model.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any

from torch import nn

from .structure import Analysis, _analyze_structure, _signature, untraced_structure

# Attributes that number a block rather than describe it.
_INDEX_NAMES = frozenset("layer_idx layer_id layer_index layer_number layer_num block_idx block_id block_index "
                         "idx index i".split())
# Integer config settings that can make layer i differ from layer j (a period, a step, the first k dense layers).
_PERIODIC = ("step", "freq", "pattern", "interval", "every", "period", "replace", "dense", "sparse", "first_k")
_PLAIN = (int, float, bool, str, type(None))


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One list of blocks: its module name, its length, how many leading blocks the shortened trace keeps, and
    for every block the index of the traced block whose plan it takes (see `cut`)."""

    name: str
    length: int
    keep: int
    source: tuple[int, ...]


def _plain(v: Any) -> Any:
    """A hashable stand-in for an attribute value that can steer a forward, or None to ignore it."""
    if isinstance(v, _PLAIN):
        return repr(v)
    if isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v):
        return repr(tuple(v))
    if callable(v) and not isinstance(v, nn.Module):
        return getattr(v, "__qualname__", type(v).__name__)
    return None


def _config_bits(config: Any, i: int, n: int, seen: set | None = None) -> tuple:
    """What the config says of layer i of n: per-layer lists, index lists, periodic settings (and those of its
    sub-configs)."""
    seen = seen if seen is not None else set()
    if config is None or id(config) in seen or not hasattr(config, "__dict__"):
        return ()
    seen.add(id(config))
    bits = []
    for k, v in sorted(vars(config).items()):
        if isinstance(v, (list, tuple)) and len(v) == n:
            bits.append((k, repr(v[i])))
        elif isinstance(v, (list, tuple, set, frozenset)) and v and all(isinstance(x, int) for x in v):
            bits.append((k, i in v))
        elif isinstance(v, int) and not isinstance(v, bool) and any(p in k.lower() for p in _PERIODIC):
            bits.append((k, i % v if v > 0 else v, i < v, (i + 1) % v if v > 0 else v))
        elif hasattr(v, "to_dict") and hasattr(v, "__dict__"):  # a sub-config (text_config, ...)
            bits.append((k, _config_bits(v, i, n, seen)))
    return tuple(bits)


def block_signature(block: nn.Module, i: int, n: int, config: Any) -> tuple:
    """What the plan of block `i` (of `n`) can depend on, without its index."""
    parts = []
    for name, m in block.named_modules():
        params = tuple((k, tuple(p.shape), p.dtype, p.requires_grad) for k, p in m.named_parameters(recurse=False))
        bufs = tuple((k, tuple(b.shape), b.dtype) for k, b in m.named_buffers(recurse=False))
        attrs = []
        for k, v in vars(m).items():
            if k.startswith("_") or k in _INDEX_NAMES or k == "training":
                continue
            p = _plain(v)
            if p is not None:
                attrs.append((k, p))
            elif k == "config" or hasattr(v, "to_dict"):
                attrs.append((k, id(v)))  # the same config object (its per-layer bits come below)
        parts.append((name, type(m), params, bufs, tuple(sorted(attrs))))
    return tuple(parts), _config_bits(config, i, n)


def _lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The outermost ModuleLists of containers (blocks), not of experts."""
    out: list[tuple[str, nn.ModuleList]] = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < 3 or any(name.startswith(o + ".") for o, _ in out):
            continue
        if "expert" in name.rsplit(".", 1)[-1].lower():
            continue
        blocks = list(m)
        if len({id(b) for b in blocks}) != len(blocks):
            continue  # one block object repeated (shared weights)
        if not all(any(True for c in b.children() for _ in c.parameters()) for b in blocks):
            continue  # a list of leaves (layers, not blocks)
        out.append((name, m))
    return out


def cut(sigs: list) -> tuple[int, tuple[int, ...]] | None:
    """Where to cut a list of blocks with signatures `sigs`, and which traced block each block copies; None when
    no cut saves a block.

    The first block (fed by the embeddings) and the last (feeding the head) sit apart from the rest, so the cut
    keeps the shortest prefix whose last block has the last block's signature and whose inner blocks (neither
    first nor last) hold every signature of the blocks in between: the first `keep - 1` traced blocks are
    themselves, the last traced one stands for the last block, and every block in between copies the nearest
    inner traced block with its signature."""
    n = len(sigs)
    for keep in range(3, n):
        if sigs[keep - 1] != sigs[-1]:
            continue
        inner = {sigs[j]: j for j in range(1, keep - 1)}  # the latest inner block per signature
        if all(sigs[i] in inner for i in range(keep - 1, n - 1)):
            middle = tuple(inner[sigs[i]] for i in range(keep - 1, n - 1))
            return keep, tuple(range(keep - 1)) + middle + (keep - 1,)
    return None


def repeated_blocks(model: nn.Module) -> list[Blocks]:
    """Every list of blocks in `model` whose later blocks repeat earlier ones (cut shorter than it is)."""
    config = getattr(model, "config", None)
    found = []
    for name, lst in _lists(model):
        n = len(lst)
        found_cut = cut([block_signature(b, i, n, config) for i, b in enumerate(lst)])
        if found_cut is not None:
            found.append(Blocks(name, n, *found_cut))
    return found


@contextlib.contextmanager
def shortened(model: nn.Module, blocks: list[Blocks]):
    """The model with each list of `blocks` cut to its first `keep` blocks (the same block objects), restored
    after."""
    saved = []
    try:
        for b in blocks:
            parent_name, _, attr = b.name.rpartition(".")
            parent = model.get_submodule(parent_name)
            full = parent._modules[attr]
            saved.append((parent, attr, full))
            parent._modules[attr] = nn.ModuleList(list(full)[:b.keep])
        yield model
    finally:
        for parent, attr, full in reversed(saved):
            parent._modules[attr] = full


def _dropped(blocks: list[Blocks]) -> list[str]:
    return [f"{b.name}.{i}" for b in blocks for i in range(b.keep - 1, b.length)]


_CACHE: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def analyze_blocks(model: nn.Module, example_inputs: Any = None) -> tuple[Analysis, Analysis, list[Blocks]] | None:
    """(the shortened model's analysis, the whole model's untraced structure, its repeated blocks), or None when
    the model has no repeated blocks or the shortened trace cannot stand in for the whole one."""
    sig = _signature(model) if example_inputs is None else None
    hit = _CACHE.get(model) if sig is not None else None
    if hit is not None and hit[0] == sig:
        return hit[1]
    result = _analyze_blocks(model, example_inputs)
    if sig is not None:
        _CACHE[model] = (sig, result)
    return result


def _analyze_blocks(model: nn.Module, example_inputs: Any) -> tuple[Analysis, Analysis, list[Blocks]] | None:
    blocks = repeated_blocks(model)
    if not blocks:
        return None
    whole = untraced_structure(model)
    dropped = tuple(d + "." for d in _dropped(blocks))
    for name, others in whole.ties.items():  # weights shared across blocks: the trace must see every holder
        if any(n.startswith(dropped) for n in [name, *others]):
            return None
    with shortened(model, blocks):
        short = _analyze_structure(model, example_inputs)
    inside = tuple(b.name + "." for b in blocks)
    if short.trace is None or any(n.startswith(inside) and n not in short.trace.calls for n in short.leaves):
        return None  # a layer the trace did not run (an expert no token chose): a fact of values, not of blocks
    short = dataclasses.replace(short, model=None, total_params=whole.total_params)
    return short, dataclasses.replace(whole, model=None), blocks

