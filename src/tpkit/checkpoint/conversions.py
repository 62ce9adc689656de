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
from ..quant import stored_tensors
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
        cat = next((op.dim for op in converters[i].operations if type(op).__name__ == "Concatenate"), None)
        source.entries[target] = fused_entry(source, target, converters[i].source_patterns, cat, members)
        names.setdefault(target, target)
    return names, notes


def fused_entry(source: Source, target: str, patterns, cat: int | None, members: list[tuple[str, str]]) -> Entry:
    """The entry `MergeModulelist(dim=0)` (+ `Concatenate(dim=cat)`) builds: stored tensor `e` of source pattern
    `j` sits at expert `e` and, along `cat`, after patterns 0..j-1."""
    rx = {p: re.compile(re.escape(p).replace(r"\*", r"(\d+)")) for p in patterns}
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


def quantized_expert_entries(model: nn.Module, source: Source, quant) -> tuple[dict[str, dict], set[str]]:
    """A quantized MoE checkpoint's experts, stored one tensor per expert projection (`experts.{e}.w1.weight_packed`,
    `...weight_scale`, ...), as fused entries of the model's fused experts: for every converter that stacks (and
    concatenates) an expert projection's `weight` into a fused parameter, each tensor the projection stores
    quantized becomes the entry `<fused parameter>.<stored name>` (stacked over the experts, gate and up
    concatenated along the dim that runs with the weight's output), added to `source.entries`. Returns
    `({experts module: {parameter: scheme}}, the keys they take: the stored ones and the stacked entries)`;
    `weight_shape` (one per expert, not stacked) is taken and not read."""
    found = _converters(model)
    if found is None or quant is None:
        return {}, set()
    renamings, converters, rename = found
    names = quant.stored_names
    groups: dict[tuple[str, int, str], list[tuple[str, str]]] = {}
    for key in list(source.entries):
        head, _, last = key.rpartition(".")
        if last not in names:
            continue
        target, pattern = rename(f"{head}.weight", renamings, converters)
        if pattern is not None and pattern.endswith(".weight"):
            i = next(j for j, c in enumerate(converters) if pattern in c.source_patterns)
            groups.setdefault((target, i, last), []).append((key, pattern[:-len("weight")] + last))
    experts: dict[str, dict] = {}
    taken: set[str] = set()
    for (target, i, last), members in groups.items():
        scheme = quant.scheme_for(members[0][0].rpartition(".")[0], "Linear")
        if scheme is None:
            continue
        spec = next((s for s in stored_tensors(scheme, 8, 8) if s.name == last), None)
        taken.update(k for k, _ in members)
        out_dim = next((d for d, r in enumerate(spec.dims) if r.dense == 0), None) if spec is not None else None
        if out_dim is None:
            continue  # weight_shape: per expert, nothing to stack
        cat = out_dim + 1 if len(converters[i].source_patterns) > 1 else None
        patterns = [p[:-len("weight")] + last for p in converters[i].source_patterns]
        source.entries[f"{target}.{last}"] = fused_entry(source, f"{target}.{last}", patterns, cat, members)
        taken.add(f"{target}.{last}")
        module, _, param = target.rpartition(".")
        experts.setdefault(module, {})[param] = scheme
    return experts, taken
