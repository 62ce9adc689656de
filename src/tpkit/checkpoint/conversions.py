"""transformers' checkpoint conversions as data: stored tensors fused, stacked or cut on load become pieces of entries.

transformers 5 keeps some tensors fused in the model but stored split in the files, or the other way round, and
rebuilds them on load by a `WeightConverter` (source patterns, target patterns, operations): Mixtral's experts are
`experts.{e}.w1/w3/w2.weight` on disk and `experts.gate_up_proj` (experts x 2I x H) in the model
(`MergeModulelist` stacks over the experts, `Concatenate` joins w1 and w3); Kimi-Linear's stored `q/k/v_conv1d`
are one `conv1d` (`Concatenate`); Sarvam's stored `query_key_value` is `q_proj`, `k_proj` and `v_proj` (`Split`,
by each target parameter's size) and HRM's `gqkv_proj` four equal parts (`Chunk`). These operations only place
whole stored tensors, or boxes of one, at offsets of the model's tensor, so each model tensor is an `Entry` whose
pieces are stored tensors or boxes `within` one: a rank reads only the bytes of the part its shard holds, like
any other entry. Converters with other operations (permutations, transposes, dequantization) are not read; their
model keys show as missing, with the converter named.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from ..convert.layouts import shard_layouts
from ..convert.transformers_threads import transformers_name
from ..quant import stored_tensors
from .errors import CheckpointError
from .sources import Entry, Piece, Source

_STACK, _CAT, _CHUNK, _SPLIT = "MergeModulelist", "Concatenate", "Chunk", "Split"
_JOINS = {(_STACK,), (_STACK, _CAT), (_CAT,)}  # stored tensors -> one model tensor
_CUTS = {(_CHUNK,), (_SPLIT,)}  # one stored tensor -> several model tensors


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


def _ops(converter) -> tuple[str, ...]:
    return tuple(type(op).__name__ for op in converter.operations)


def _readable(converter, members: list) -> bool:
    """Whether tpkit reads what `converter` builds of `members`: joins of whole stored tensors (stacked along a new
    dim 0, one source pattern's or then concatenated; concatenated), or one stored tensor cut into a fixed list of
    targets (not a number of them read from the config)."""
    ops, first = _ops(converter), converter.operations[0]
    if ops in _JOINS:
        return ops[0] != _STACK or (first.dim == 0 and (len(ops) > 1 or len(converter.source_patterns) == 1))
    return ops in _CUTS and len(members) == 1 and getattr(first, "num_shards_attribute", None) is None


def transformers_keys(model: nn.Module, source: Source) -> tuple[dict[str, str], list[str]]:
    """`({model key: checkpoint key}, notes)` by transformers' renamings (NeoX's `embed_out` -> `lm_head`,
    legacy `gamma`/`beta`, Mixtral's `block_sparse_moe` -> `mlp`), after adding to `source.entries` the entries
    every readable converter builds (keyed by their model keys). `notes` name the converters that were not
    readable, for the error that follows."""
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
    notes, shape_of = [], _shape_finder(model)
    for (target, i), members in groups.items():
        converter = converters[i]
        built = _build(source, target, converter, members, shape_of) if _readable(converter, members) else None
        if not built or any(k in source.entries for k in built):
            notes.append(f"{target} (stored as {members[0][0]}..., rebuilt by {'+'.join(_ops(converter))})")
            continue
        for k, entry in built.items():
            source.entries[k] = entry
            names.setdefault(k, k)
    return names, notes


def _build(source: Source, target: str, converter, members: list[tuple[str, str]],
           shape_of: Callable[[str], tuple | None]) -> dict[str, Entry] | None:
    """The entries a readable converter builds of `members`, by model key; None when a stored tensor is not one
    whole tensor of a file (a tpkit checkpoint is never converted) or a target's size is unknown."""
    if any(not source.entries[k].is_whole for k, _ in members):
        return None
    ops = _ops(converter)
    if ops in _JOINS:
        cat = converter.operations[-1].dim if ops[-1] == _CAT else None
        return {target: fused_entry(source, target, converter.source_patterns, members, ops[0] == _STACK, cat)}
    return cut_entries(source, target, converter, members[0][0], shape_of)


def _natural(key: str) -> list:
    """transformers' order of stored keys (its `dot_natural_key`), the order a converter receives them in: numbers
    by value, a name's trailing digits too, so expert 10 follows expert 9."""
    parts: list[tuple] = []
    for part in key.split("."):
        text = part.rstrip("0123456789")
        if part.isdigit():
            parts.append((0, int(part)))
        else:
            parts.append((1, text, int(part[len(text):])) if text != part else (1, text))
    return parts


def fused_entry(source: Source, target: str, patterns, members: list[tuple[str, str]], stack: bool,
                cat: int | None) -> Entry:
    """The entry `MergeModulelist(dim=0)` (`stack`) and/or `Concatenate(dim=cat)` build of `members` ((stored key,
    its source pattern) each): each pattern's tensors in transformers' order (`_natural`), stacked along a new dim
    0 (`stack`: the n-th at index n) or else concatenated along `cat`; then the patterns' blocks concatenated along
    `cat` in the converter's order. Raises CheckpointError when transformers could not fuse them either."""
    pieces, at = [], 0
    if cat is not None:
        cat %= len(source.entries[members[0][0]].shape) + stack
    for pattern in patterns:
        block = []
        for n, key in enumerate(sorted((k for k, p in members if p == pattern), key=_natural)):
            entry = source.entries[key]
            shape = (1, *entry.shape) if stack else tuple(entry.shape)
            offsets = [n if stack and d == 0 else 0 for d in range(len(shape))]
            if cat is not None:
                offsets[cat] += at if stack else at + sum(p.shape[cat] for p in block)
            block.append(Piece(entry.pieces[0].path, entry.pieces[0].name, tuple(offsets), shape))
        pieces += block
        at = max((p.offsets[cat] + p.shape[cat] for p in pieces), default=0) if cat is not None else 0
    _check_fusable(source, target, pieces, members, stack, cat)
    shape = tuple(max(p.offsets[d] + p.shape[d] for p in pieces) for d in range(len(pieces[0].shape)))
    return Entry(target, shape, source.entries[members[0][0]].dtype, tuple(pieces))


def _check_fusable(source: Source, target: str, pieces: list[Piece], members: list[tuple[str, str]], stack: bool,
                   cat: int | None) -> None:
    """What torch.stack and torch.cat require (one dtype; stacked tensors of a pattern of one shape; concatenated
    ones alike but along `cat`): with it, the pieces tile the fused tensor exactly."""
    keys = [k for k, _ in members]
    shapes = sorted({tuple(source.entries[k].shape) for k in keys})
    dtypes = sorted({str(source.entries[k].dtype) for k in keys})
    stacked = not stack or all(len({source.entries[k].shape for k, q in members if q == p}) == 1
                               for p in {q for _, q in members})
    joined = cat is None or len({p.shape[:cat] + p.shape[cat + 1:] for p in pieces}) == 1
    if len(dtypes) > 1 or len({len(p.shape) for p in pieces}) > 1 or not stacked or not joined:
        how = ("stacked" if stack else "") + (" and " if stack and cat is not None else "") + \
            (f"concatenated along dim {cat}" if cat is not None else "")
        raise CheckpointError(f"{pieces[0].path}: the stored tensors {keys[:3]}{' ...' if len(keys) > 3 else ''} "
                              f"(shapes {shapes[:3]}, dtypes {dtypes}) do not fit together into {target}, which "
                              f"transformers builds of them on load ({how}): a damaged checkpoint, or one mixing "
                              f"configurations")


def cut_entries(source: Source, first: str, converter, stored_key: str,
                shape_of: Callable[[str], tuple | None]) -> dict[str, Entry] | None:
    """The model tensors `Chunk(dim)` (equal parts, as `torch.chunk`) or `Split(dim)` (each its model parameter's
    size) cut the stored tensor `stored_key` into, by model key (transformers' names: `first`, the renamed key,
    with each target pattern in place of the first), each a box `within` the stored tensor; None when the targets
    cannot be named so or a Split target is not a tensor of the model. Raises CheckpointError when a Split's sizes
    do not add up."""
    op, entry = converter.operations[0], source.entries[stored_key]
    head, found, tail = first.partition(converter.target_patterns[0])
    if not found or not entry.shape:  # a target named by a regex group; a scalar: not cut by tpkit
        return None
    dim, total = op.dim % len(entry.shape), entry.shape[op.dim]
    keys = [head + t + tail for t in converter.target_patterns]
    if type(op).__name__ == _CHUNK:
        step = -(-total // len(keys))
        sizes = [min(step, total - j * step) for j in range(len(keys))]
    else:
        shapes = [shape_of(k) for k in keys]
        if any(s is None or len(s) != len(entry.shape) for s in shapes):
            return None
        sizes = [s[dim] for s in shapes]
        if sum(sizes) != total:
            raise CheckpointError(f"{entry.pieces[0].path}: tensor {stored_key!r} has {total} along dim {dim}, but "
                                  f"the model's {keys} (that transformers splits it into) have {sizes}: a checkpoint "
                                  f"of another configuration (check config.json)")
    out, start, stored = {}, 0, entry.pieces[0]
    for key, size in zip(keys, sizes):
        if size <= 0:  # torch.chunk made fewer parts: transformers leaves the rest unloaded too
            continue
        shape = tuple(size if d == dim else n for d, n in enumerate(entry.shape))
        within = tuple(start if d == dim else 0 for d in range(len(shape)))
        out[key] = Entry(key, shape, entry.dtype, (Piece(stored.path, stored.name, (0,) * len(shape), shape,
                                                         within=within),))
        start += size
    return out


def _shape_finder(model: nn.Module) -> Callable[[str], tuple | None]:
    """Full shape of a model key (with or without the base model's prefix), or None; the layouts are taken once, on
    the first question (only a `Split` asks)."""
    shapes: dict[str, tuple] = {}
    prefix = getattr(model, "base_model_prefix", "") or ""

    def shape_of(key: str) -> tuple | None:
        if not shapes:
            shapes.update({k: tuple(lay.full_shape) for k, lay in shard_layouts(model).items()})
        options = [key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")] if prefix else [key]
        return next((shapes[o] for o in options if o in shapes), None)

    return shape_of


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
        source.entries[f"{target}.{last}"] = fused_entry(source, f"{target}.{last}", patterns, members, True, cat)
        taken.add(f"{target}.{last}")
        module, _, param = target.rpartition(".")
        experts.setdefault(module, {})[param] = scheme
    return experts, taken
