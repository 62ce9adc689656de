"""transformers' checkpoint conversions as data: stacked and concatenated tensors become pieces of one entry.

transformers 5 keeps some tensors fused in the model but stored split in the files: Mixtral's experts are
`experts.{e}.w1/w3/w2.weight` on disk and `experts.gate_up_proj` (experts x 2I x H) / `experts.down_proj` in
the model, rebuilt on load by a `WeightConverter` (stack over experts, then concatenate w1 and w3). Stacking
and concatenating only place whole stored tensors at offsets of the fused one, so the fused tensor is an
`Entry` whose pieces are the stored tensors: a rank reads only the parts of each expert's matrices its shard
holds, like any other entry. Converters with other operations (chunking, permutations) are not read; their
model keys show as missing, with the converter named.
"""
from __future__ import annotations

import math
import re

from torch import nn

from ..convert.transformers_threads import transformers_name
from .errors import CheckpointError
from .sources import Entry, Piece, Source

_READABLE = {("MergeModulelist",), ("MergeModulelist", "Concatenate")}


def _converters(model: nn.Module):
    try:
        mapping = transformers_name("get_model_conversion_mapping", "conversion_mapping")
        converter, renaming, rename = (transformers_name(name, "core_model_loading")
                                       for name in ("WeightConverter", "WeightRenaming", "rename_source_key"))
    except (ImportError, AttributeError):  # no transformers, or one without these conversions
        return None
    transforms = mapping(model)
    return ([t for t in transforms if isinstance(t, renaming)], [t for t in transforms if isinstance(t, converter)],
            rename)


def transformers_keys(model: nn.Module, source: Source) -> tuple[dict[str, str], list[str]]:
    """`({model key: checkpoint key}, notes)` by transformers' renamings (NeoX's `embed_out` -> `lm_head`,
    legacy `gamma`/`beta`, Mixtral's `block_sparse_moe` -> `mlp`), after adding to `source.entries` one
    fused entry per readable converter target (keyed by that target). `notes` name the converters that were
    not readable, for the error that follows."""
    found = _converters(model)
    if found is None:
        return {}, []
    renamings, converters, rename = found
    names: dict[str, str] = {}
    groups: dict[tuple[str, int], list[tuple[str, str]]] = {}  # (target, converter) -> [(stored key, pattern)]
    by_pattern = {p: i for i, c in enumerate(converters) for p in c.source_patterns}
    for key in list(source.entries):
        new, pattern = rename(key, renamings, converters)
        if pattern is None:
            if new != key:
                names.setdefault(new, key)
        else:
            groups.setdefault((new, by_pattern[pattern]), []).append((key, pattern))
    notes = []
    for (target, i), members in groups.items():
        ops = tuple(type(op).__name__ for op in converters[i].operations)
        if ops not in _READABLE or target in source.entries:
            notes.append(f"{target} (stored as {members[0][0]}..., rebuilt by {'+'.join(ops)})")
            continue
        source.entries[target] = fused_entry(source, target, converters[i], members)
        names.setdefault(target, target)
    return names, notes


def fused_entry(source: Source, target: str, converter, members: list[tuple[str, str]]) -> Entry:
    """The entry `MergeModulelist(dim=0)` (+ `Concatenate(dim=d)`) builds: stored tensor `e` of source pattern
    `j` sits at expert `e` and, along `d`, after patterns 0..j-1."""
    patterns = converter.source_patterns
    rx = {p: re.compile(re.escape(p).replace(r"\*", r"(\d+)")) for p in patterns}
    cat = next((op.dim for op in converter.operations if type(op).__name__ == "Concatenate"), None)
    per: dict[str, dict[int, Entry]] = {p: {} for p in patterns}
    for key, pattern in members:
        m = rx[pattern].search(key)
        if m is None:
            raise CheckpointError(f"{source.entries[key].pieces[0].path}: tensor {key!r} does not match "
                                  f"transformers' pattern {pattern!r} for {target}")
        per[pattern][int(m.group(1))] = source.entries[key]
    first = per[patterns[0]]
    experts = sorted(first)
    inner = first[experts[0]].shape
    widths = [next(iter(per[p].values())).shape[cat - 1] if cat else 0 for p in patterns]
    shape = [len(experts), *inner]
    if cat:
        shape[cat] = sum(widths)
    pieces, dtype = [], first[experts[0]].dtype
    for j, p in enumerate(patterns):
        for e, entry in sorted(per[p].items()):
            stored = entry.pieces[0]
            offsets = [e] + [0] * len(inner)
            if cat:
                offsets[cat] = sum(widths[:j])
            pieces.append(Piece(stored.path, stored.name, tuple(offsets), (1, *stored.shape)))
    full = Entry(target, tuple(shape), dtype, tuple(pieces))
    if sum(math.prod(p.shape) for p in pieces) != math.prod(shape) or any(
            source.entries[k].dtype != dtype for k, _ in members):
        raise CheckpointError(f"{source.root}: the stored tensors {[k for k, _ in members][:3]}... do not tile "
                              f"{target}'s shape {shape} in one dtype")
    return full
