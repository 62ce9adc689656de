"""Repeated blocks: trace a deep model as deep as its distinct blocks, not as deep as it is.

A transformer is an `nn.ModuleList` of blocks that are alike: same module classes, parameter shapes, settings.
`repeated_blocks` finds the outermost such lists (not experts) and gives every block a structural signature: per
module inside it, its class, parameter and buffer shapes and every attribute but its layer index (plain values as
they are, other objects by identity), plus the model config's settings for that layer (`layer_types[i]`, `i in
mlp_only_layers`, every v-th layer for periodic settings, `i < first_k_dense_replace`). `cut` picks the shortest
prefix to trace whose blocks stand for all the others (the last traced block for the last block, an earlier one
with the same signature for each block in between); `analyze_blocks` traces the model with each list cut there
(`cut_view`: a new module object holding a prefix of each list, so every traced block keeps its index; the model is
not changed), and `convert/planning/reuse.py` copies the traced blocks' plan entries. Anything it cannot vouch for
(weights shared with a block past the cut, a trace that fails when cut, a block layer the trace did not run) gives
None: the caller traces the whole model.
"""
from __future__ import annotations

import copy as copying
import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from .structure import Analysis, trace_structure

# Attributes that number a block rather than describe it.
_INDEX_NAMES = frozenset("layer_idx layer_id layer_index layer_number layer_num block_idx block_id block_index "
                         "idx index i".split())
# Integer config settings that can make layer i differ from layer j (a period, a step, the first k dense layers).
_PERIODIC = ("step", "freq", "pattern", "interval", "every", "period")  # layer i by i % v == 0, (i + 1) % v == 0
_THRESHOLD = ("first", "replace", "dense", "_layers")  # layer i by i < v (first_k_dense_replace, max_window_layers)
_PLAIN = (int, float, str)  # and None
_SKIP = _INDEX_NAMES | set(vars(nn.Module()))  # the index names and nn.Module's own bookkeeping
_KEYS: dict[tuple, tuple] = {}


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One list of blocks: its module name, its length, how many leading blocks the shortened trace keeps, and
    for every block the index of the traced block whose plan it takes (see `cut`)."""

    name: str
    length: int
    keep: int
    source: tuple[int, ...]
    extra_params: int = 0  # parameters of the blocks past the cut (each has its source's count)
    extra_bytes: int = 0   # bytes of their parameters and buffers likewise (`Analysis.copy_bytes`)


def _plain(v: Any) -> Any:
    """A hashable stand-in for an attribute value that can steer a forward: plain values as they are, tensors by
    shape, functions by name, settings dicts by their items, any other object by its identity (blocks that hold
    distinct ones are not taken for alike). Checks go by `type(v)`: `isinstance` would ask a config object for its
    `__class__`, which transformers' configs answer slowly."""
    t = type(v)
    if v is None or issubclass(t, _PLAIN):
        return v
    if (t is tuple or t is list) and all(x is None or isinstance(x, _PLAIN) for x in v):
        return tuple(v)
    if issubclass(t, torch.Tensor):
        return "tensor", tuple(v.shape), v.dtype
    if t is dict and all(isinstance(k, str) and (x is None or isinstance(x, _PLAIN)) for k, x in v.items()):
        return tuple(sorted(v.items()))
    if t is functools.partial:
        return "partial", _plain(v.func), tuple(_plain(a) for a in v.args), \
            tuple(sorted((k, _plain(x)) for k, x in v.keywords.items()))
    if callable(v) and not issubclass(t, nn.Module) and hasattr(v, "__qualname__"):
        return v.__qualname__
    return t.__qualname__, id(v)


def _config_rules(config: Any, n: int, seen: set | None = None) -> list:
    """The settings of `config` (and its sub-configs) that can tell layer i of n from another: per-layer lists,
    lists of layer indices, periodic integers. Read once per list of blocks; `_config_bits` applies them."""
    seen = seen if seen is not None else set()
    if config is None or id(config) in seen or not hasattr(config, "__dict__"):
        return []
    seen.add(id(config))
    rules = []
    for k, v in sorted(vars(config).items()):
        if isinstance(v, (list, tuple)) and len(v) == n:
            rules.append((k, "each", v))
        elif isinstance(v, (list, tuple, set, frozenset)) and v and all(isinstance(x, int) for x in v):
            rules.append((k, "in", frozenset(v)))
        elif isinstance(v, int) and not isinstance(v, bool):
            if any(p in k.lower() for p in _PERIODIC):
                rules.append((k, "period", v))
            if any(p in k.lower() for p in _THRESHOLD):
                rules.append((k, "below", v))
        elif hasattr(v, "to_dict") and hasattr(v, "__dict__"):  # a sub-config (text_config, ...)
            rules.extend(((f"{k}.{r[0]}",) + r[1:]) for r in _config_rules(v, n, seen))
    return rules


def _config_bits(rules: list, i: int) -> tuple:
    """What the config's `rules` say of layer i."""
    bits = []
    for k, how, v in rules:
        if how == "each":
            bits.append((k, repr(v[i])))
        elif how == "in":
            bits.append((k, i in v))
        elif how == "below":
            bits.append((k, i < v))
        else:
            bits.append((k, v > 0 and i % v == 0, v > 0 and (i + 1) % v == 0))  # both conventions of "every v-th"
    return tuple(bits)


def _module_signature(m: nn.Module, ids: list) -> tuple:
    """Class, parameter and buffer shapes, plain settings of one module; the ids of its parameters go to `ids`."""
    d = m.__dict__
    params = ()
    if d["_parameters"]:
        params = tuple((k, p.shape, p.dtype, p.requires_grad) for k, p in d["_parameters"].items() if p is not None)
        ids.extend(id(p) for p in d["_parameters"].values() if p is not None)
    bufs = tuple((k, b.shape, b.dtype) for k, b in d["_buffers"].items() if b is not None) if d["_buffers"] else ()
    order = tuple(d)
    keys = _KEYS.get(order)
    if keys is None:  # the attributes that describe the module, sorted (once per layout of a module's __dict__)
        if len(_KEYS) > 4096:
            _KEYS.clear()
        keys = _KEYS[order] = tuple(sorted(k for k in order if k[0] != "_" and k not in _SKIP))
    # a config object goes by identity: its per-layer settings are the block's (`_config_bits`)
    return type(m), params, bufs, keys, tuple([_plain(d[k]) for k in keys])


def _tree_signature(m: nn.Module, ids: list) -> tuple:
    return _module_signature(m, ids), tuple((k, _tree_signature(c, ids)) for k, c in m._modules.items()
                                            if c is not None)


def block_signature(block: nn.Module, i: int, rules: list, ids: list | None = None) -> tuple:
    """What the plan of block `i` can depend on, without its index (`rules`: the config's, `_config_rules`):
    every module inside, by name, and the config's settings for layer i. The ids of its parameters go to `ids`."""
    return _tree_signature(block, [] if ids is None else ids), _config_bits(rules, i)


def _is_block(b: nn.Module) -> bool:
    """A container: some child owns parameters or has children of its own (not a layer)."""
    return any(c is not None and (c._modules or any(p is not None for p in c._parameters.values()))
               for c in b._modules.values())


def _lists(model: nn.Module, ids: list) -> list[tuple[str, nn.ModuleList]]:
    """The outermost ModuleLists of containers (blocks), not of experts; the walk does not enter those. The ids of
    the parameters of every module it walks go to `ids`."""
    out: list[tuple[str, nn.ModuleList]] = []
    stack = [("", model)]
    while stack:
        name, m = stack.pop()
        ids.extend(id(p) for p in m._parameters.values() if p is not None)
        if isinstance(m, nn.ModuleList):
            blocks = [b for b in m._modules.values() if b is not None]
            if len(blocks) >= 3 and "expert" not in name.rsplit(".", 1)[-1].lower() \
                    and len({id(b) for b in blocks}) == len(blocks) and all(_is_block(b) for b in blocks):
                out.append((name, m))  # (one block object repeated shares its weights: not a list of blocks)
                continue  # lists inside its blocks are not blocks of the model
        stack.extend((f"{name}.{k}" if name else k, c) for k, c in reversed(m._modules.items()) if c is not None)
    return out


def cut(sigs: list) -> tuple[int, tuple[int, ...]] | None:
    """Where to cut a list of blocks with signatures `sigs`, and which traced block each block copies; None when
    no cut saves a block.

    The last block (feeding the head) sits apart from the rest, so the cut keeps the shortest prefix whose last
    block has the last block's signature and whose other blocks hold every signature of the blocks in between:
    the first `keep - 1` traced blocks are themselves, the last traced one stands for the last block, and every
    block in between copies the nearest traced block with its signature (a fact of a copied block that names a
    module outside its block, such as the embeddings that feed the first, makes `reuse.expand` unsure)."""
    codes: dict = {}
    sigs = [codes.setdefault(sig, len(codes)) for sig in sigs]  # hash each signature once
    n = len(sigs)
    for keep in range(2, n):
        if sigs[keep - 1] != sigs[-1]:
            continue
        inner = {sigs[j]: j for j in range(keep - 1)}  # the latest traced block per signature, but the last
        if all(sigs[i] in inner for i in range(keep - 1, n - 1)):
            middle = tuple(inner[sigs[i]] for i in range(keep - 1, n - 1))
            return keep, tuple(range(keep - 1)) + middle + (keep - 1,)
    return None


def repeated_blocks(model: nn.Module) -> list[Blocks]:
    """Every list of blocks in `model` whose later blocks repeat earlier ones (cut shorter than it is)."""
    traced: list = []
    return _survey(_lists(model, traced), getattr(model, "config", None), traced)[0]


def _survey(lists: list[tuple[str, nn.ModuleList]], config: Any, traced: list) -> tuple[list[Blocks], bool]:
    """(the repeated blocks among the model's `lists` of blocks, whether a block past a cut shares a parameter with
    any other module); `config`: the model's, `traced`: the ids of the parameters `_lists` walked, outside them."""
    found, dropped = [], []
    for name, lst in lists:
        rules = _config_rules(config, len(lst))
        per_block: list[list] = [[] for _ in lst]
        found_cut = cut([block_signature(b, i, rules, per_block[i]) for i, b in enumerate(lst)])
        if found_cut is None:
            traced.extend(i for ids in per_block for i in ids)
            continue
        keep, source = found_cut
        for i, ids in enumerate(per_block):
            (traced if i < keep - 1 else dropped).extend(ids)
        counts = {j: (sum(p.numel() for p in lst[j].parameters()),
                      sum(t.nbytes for t in list(lst[j].parameters()) + list(lst[j].buffers())))
                  for j in set(source[keep:])}
        past = [counts[source[i]] for i in range(keep, len(lst))]
        found.append(Blocks(name, len(lst), keep, source, sum(n for n, _ in past), sum(b for _, b in past)))
    seen: dict[int, int] = {}
    for i in traced + dropped:
        seen[i] = seen.get(i, 0) + 1
    return found, any(seen[i] > 1 for i in dropped)


def cut_view(model: nn.Module, blocks: list[Blocks]) -> nn.Module:
    """`model` with each list of `blocks` cut to its first `keep` blocks, as a new module object: the model and each
    module on the way to a list are shallow copies holding their own child table, so every block, layer and tensor
    is `model`'s own and `model` itself is not changed (thread-ranks may cut their models at once)."""
    copies: dict[str, nn.Module] = {}

    def copied(name: str) -> nn.Module:
        if name not in copies:
            old = model.get_submodule(name) if name else model
            new = copying.copy(old)
            new.__dict__["_modules"] = dict(old._modules)
            copies[name] = new
            if name:
                parent, _, attr = name.rpartition(".")
                copied(parent)._modules[attr] = new
        return copies[name]

    for b in blocks:
        parent, _, attr = b.name.rpartition(".")
        copied(parent)._modules[attr] = nn.ModuleList(list(model.get_submodule(b.name))[:b.keep])
    return copied("")


def analyze_blocks(model: nn.Module, example_inputs: Any = None) -> tuple[Analysis, list[Blocks]] | None:
    """(the analysis of the model cut to its distinct blocks, whose `.model` is that cut (`cut_view`; its
    `total_params` and `copy_bytes` the whole model's); the repeated blocks), or None when the model has no
    repeated blocks or the cut's trace cannot stand in for the whole one (weights shared with a block it leaves
    out, a failed trace, a block layer the trace did not run)."""
    traced: list = []
    blocks, shared = _survey(_lists(model, traced), getattr(model, "config", None), traced)
    if not blocks or shared:
        return None
    short = trace_structure(cut_view(model, blocks), example_inputs)
    inside = tuple(b.name + "." for b in blocks)
    if short.trace is None or any(n.startswith(inside) and n not in short.trace.calls for n in short.leaves):
        return None  # a layer the trace did not run (an expert no token chose): a fact of values, not of blocks
    return dataclasses.replace(short, total_params=short.total_params + sum(b.extra_params for b in blocks),
                               copy_bytes=short.copy_bytes + sum(b.extra_bytes for b in blocks)), blocks
