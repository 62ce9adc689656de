"""The automatic planner: from a dataflow trace to a `Plan`.

Decisions come from module types and the traced dataflow, never from parameter names:
- an MLP pair is a row candidate whose input is made, through per-feature ops only, from the outputs of
  linear (or conv) layers that feed nothing else; those become column-wise, it becomes row-wise;
- an attention pair is a row candidate whose input comes from linear layers that read one shared input,
  inside a module that says its head size (or head count), with the head size seen on a reshape on the way;
  q/k/v split by whole heads (GQA groups kept, KV heads replicated when fewer than ranks), packed
  projections piece by piece;
- the LM head is a large linear layer whose output leaves the model; embeddings split over the vocabulary
  when large or tied to the head;
- everything else is replicated, with the reason.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Mapping

import torch
from torch import nn

from .heads import HeadLayoutError, head_layout
from .errors import PlanError
from .modules import (is_conv2d, is_embedding, is_feature_norm, is_linear, is_per_channel, is_plain_conv2d, kind,
                      linear_dims)
from .plan import Plan
from .styles import (CHANNELWISE, COLWISE, COLWISE_REP, EMBEDDING_ROWWISE, REPLICATE, REPLICATED_WITH_GRAD_ALLREDUCE,
                     ROWWISE, VOCAB_PARALLEL, VOCAB_STYLES)
from .trace import Trace, parameterised_leaves, trace

HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "d_head", "d_k")
NUM_HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_attention_heads_per_partition")
NUM_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")


@dataclasses.dataclass
class Analysis:
    """What the planner learned about a model, independent of the world size."""

    model: nn.Module
    leaves: dict[str, nn.Module]
    trace: Trace | None
    trace_error: str | None
    structures: dict[str, dict]          # module -> details (role in an attention/MLP/conv pair)
    pairs: list[dict]                    # each: {"kind", "columns", "row", "carried", ...}
    notes: dict[str, str]                # module -> why it is not part of a pair
    ties: dict[str, list[str]]           # module -> other modules sharing its weight
    total_params: int
    prefix: str | None


def _int_attr(m: Any, names) -> int | None:
    for n in names:
        v = getattr(m, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def head_info(attn: nn.Module) -> tuple[int | None, int | None, int | None]:
    """(head_dim, num_heads, num_kv_heads) as the attention module (or its config) states them."""
    cfg = getattr(attn, "config", None)
    hd = _int_attr(attn, HEAD_DIM_ATTRS)
    nh = _int_attr(attn, NUM_HEADS_ATTRS)
    nkv = _int_attr(attn, NUM_KV_ATTRS)
    if cfg is not None:
        hd = hd or _int_attr(cfg, ("head_dim",))
        nh = nh or _int_attr(cfg, ("num_attention_heads", "n_head"))
        nkv = nkv or _int_attr(cfg, ("num_key_value_heads",))
    groups = _int_attr(attn, ("num_key_value_groups",))
    if nkv is None and nh and groups:
        nkv = nh // groups
    return hd, nh, nkv


def _lca(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def default_inputs(model: nn.Module) -> list:
    """Tiny inputs to try for the trace: HF models get token ids (or pixels); others a batch shaped for
    their first layer, as [batch, features] and then [batch, seq, features]."""
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    cfg = getattr(model, "config", None)
    main = getattr(model, "main_input_name", None)
    if cfg is not None and main == "input_ids":
        return [{"input_ids": torch.zeros(1, 4, dtype=torch.long, device=device)}]
    if cfg is not None and main == "pixel_values":
        size = getattr(cfg, "image_size", 32)
        size = size if isinstance(size, int) else size[0]
        return [{"pixel_values": torch.zeros(1, getattr(cfg, "num_channels", 3), size, size, device=device)}]
    for m in model.modules():
        dtype = next(m.parameters(), torch.empty(0)).dtype
        if is_linear(m) or isinstance(m, nn.LayerNorm):
            n = linear_dims(m)[0] if is_linear(m) else m.normalized_shape[-1]
            return [(torch.zeros(2, n, device=device, dtype=dtype),),
                    (torch.zeros(2, 4, n, device=device, dtype=dtype),)]
        if is_conv2d(m):
            return [(torch.zeros(2, m.in_channels, 16, 16, device=device, dtype=dtype),)]
        if is_embedding(m):
            return [(torch.zeros(2, 4, dtype=torch.long, device=device),)]
    raise ValueError(f"cannot guess an input for {type(model).__name__}; pass example_inputs")


def _ties(leaves: dict[str, nn.Module]) -> dict[str, list[str]]:
    owners: dict[int, list[str]] = {}
    for name, m in leaves.items():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor):
            owners.setdefault(id(w), []).append(name)
    out = {}
    for names in owners.values():
        if len(names) > 1:
            for n in names:
                out[n] = [o for o in names if o != n]
    return out


_CACHE: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _signature(model: nn.Module) -> tuple:
    """What the analysis depends on: every module's name, class and parameter shapes (and identities)."""
    return tuple((n, type(m), tuple((k, tuple(p.shape), id(p)) for k, p in m.named_parameters(recurse=False)))
                 for n, m in model.named_modules())


def analyze_structure(model: nn.Module, example_inputs: Any = None) -> Analysis:
    """Trace the model once and find its attention blocks and column -> row pairs (world-size free).

    With the default inputs the result is remembered per model object until its modules or parameter
    shapes change, so `analyze`, `plan` and `parallelize` in a row trace a large model once."""
    if example_inputs is not None:
        return _analyze_structure(model, example_inputs)
    sig = _signature(model)
    hit = _CACHE.get(model)
    if hit is not None and hit[0] == sig:
        return dataclasses.replace(hit[1], model=model)
    a = _analyze_structure(model, None)
    _CACHE[model] = (sig, dataclasses.replace(a, model=None))
    return a


def _analyze_structure(model: nn.Module, example_inputs: Any = None) -> Analysis:
    leaves = parameterised_leaves(model)
    total = sum(p.numel() for p in model.parameters())
    prefix = getattr(model, "base_model_prefix", None) if hasattr(model, "config") else None
    if prefix and not hasattr(model, prefix):
        prefix = None
    analysis = Analysis(model, leaves, None, None, {}, [], {}, _ties(leaves), total, prefix)
    try:
        candidates = default_inputs(model) if example_inputs is None else [example_inputs]
    except ValueError as exc:
        analysis.trace_error = str(exc)
        return analysis
    for inputs in candidates:
        try:
            analysis.trace = trace(model, inputs)
            break
        except Exception as exc:  # noqa: BLE001 - any failure means: no dataflow, replicate with the reason
            analysis.trace_error = analysis.trace_error or f"{type(exc).__name__}: {exc}"
    if analysis.trace is None:
        return analysis
    analysis.trace_error = None
    _find_pairs(analysis)
    return analysis


def _find_pairs(a: Analysis) -> None:
    t = a.trace
    assert t is not None
    taken: set = set()
    order = sorted((c[0].order, n) for n, c in t.calls.items())
    for _, row in order:
        m = a.leaves[row]
        if not (is_linear(m) or is_plain_conv2d(m)):
            continue
        call = t.first(row)
        tag = call.input_tag
        if tag is None or not tag.sources:
            continue
        srcs = sorted(tag.sources, key=lambda s: t.first(s).order)
        if row in taken or any(s in taken for s in srcs):
            a.notes.setdefault(row, "its input comes from a layer already paired with another row-wise layer "
                                    "(an odd chain of layers: the last one stays replicated)")
            continue
        if len(t.calls[row]) > 1 or any(len(t.calls[s]) > 1 for s in srcs):
            a.notes.setdefault(row, "called more than once per forward (shared module); replicated to stay safe")
            continue
        if any(s in t.broken for s in srcs):
            reason = f"the output of {[s for s in srcs if s in t.broken]} is sliced into pieces that do not " \
                     f"tile its features; replicated"
        elif tag.clean:
            reason = _try_mlp(a, row, srcs, tag)
        else:
            reason = _try_attention(a, row, srcs, tag)
        if reason is None:
            taken.add(row)
            taken.update(srcs)
        else:
            a.notes.setdefault(row, reason)
            for s in srcs:
                if is_linear(a.leaves[s]) or is_conv2d(a.leaves[s]):
                    a.notes.setdefault(s, reason)


def _try_mlp(a: Analysis, row: str, srcs: list[str], tag) -> str | None:
    t = a.trace
    rm = a.leaves[row]
    conv = is_conv2d(rm)
    width_in = rm.in_channels if conv else linear_dims(rm)[0]
    for s in srcs:
        sm = a.leaves[s]
        if conv != is_plain_conv2d(sm) or (not conv and not is_linear(sm)):
            return f"input of {row} comes from {s} ({kind(sm)}), which is not a {kind(rm)} that can be split"
        if t.consumers.get(s, set()) != {row} or s in t.escaped:
            users = sorted(t.consumers.get(s, set()) | ({"<model output>"} if s in t.escaped else set()))
            return f"output of {s} also feeds {users}: splitting it would hand them a shard"
        out = sm.out_channels if conv else linear_dims(sm)[1]
        pieces = t.pieces.get(s)
        if pieces and any(p != width_in for p in pieces):
            return f"{s} is packed as {list(pieces)}, which does not match {row}'s {width_in} input features"
        if not pieces and out != width_in:
            return f"{s} gives {out} features but {row} takes {width_in}"
    for c in tag.carried:
        if not is_per_channel(a.leaves[c]) or a.leaves[c].num_features != width_in:
            return f"{c} between {srcs} and {row} is not a per-channel layer of {width_in} channels"
    for s in srcs:
        a.structures[s] = {"pair": "conv" if conv else "mlp", "role": "column", "row": row}
        if t.pieces.get(s):
            a.structures[s]["pieces"] = list(t.pieces[s])
    a.structures[row] = {"pair": "conv" if conv else "mlp", "role": "row", "columns": srcs}
    for c in tag.carried:
        a.structures[c] = {"pair": "conv", "role": "channel", "row": row}
    a.pairs.append({"kind": "conv" if conv else "mlp", "columns": srcs, "row": row, "carried": sorted(tag.carried)})
    return None


def _try_attention(a: Analysis, row: str, srcs: list[str], tag) -> str | None:
    t = a.trace
    rm = a.leaves[row]
    if not is_linear(rm) or not all(is_linear(a.leaves[s]) for s in srcs):
        return f"ops between {srcs} and {row} mix features ({tag.broken_by}) and they are not linear layers " \
               f"of an attention block"
    if len({t.first(s).input_id for s in srcs}) != 1:
        return f"{srcs} do not read one shared input, so they are not the q/k/v of one attention block " \
               f"(ops between them and {row}: {tag.broken_by})"
    # The module that states the heads: the nearest ancestor of q/k/v (up to the one holding the row) that
    # says its head size or count (BERT keeps them on `attention.self`, the output layer one level up).
    top = _lca(srcs + [row])
    attn_name = _lca(srcs) if len(srcs) > 1 else srcs[0].rpartition(".")[0]
    while True:
        attn = a.model.get_submodule(attn_name) if attn_name else a.model
        hd, nh_attr, nkv_attr = head_info(attn)
        if hd or nh_attr or len(attn_name) <= len(top):
            break
        attn_name = attn_name.rpartition(".")[0]
    widths = [linear_dims(a.leaves[s])[1] for s in srcs]
    head_width = hd
    if len(srcs) == 1:
        pieces = t.pieces.get(srcs[0])
        out = widths[0]
        per_head = hd or (out // (3 * nh_attr) if nh_attr and out % (3 * nh_attr) == 0 else None)
        if pieces and len(pieces) == 3 and pieces[1] == pieces[2]:
            q_w, kv_w = pieces[0], pieces[1]
            roles = {srcs[0]: "qkv"}
        elif per_head and out % (3 * per_head) == 0 and 3 * per_head in tag.reshaped_to:
            # GPT-NeoX: one projection viewed as [heads, 3 x head_dim], each head's q, k, v side by side.
            hd, head_width, pieces = per_head, 3 * per_head, None
            q_w = kv_w = out // 3
            roles = {srcs[0]: "qkv_heads"}
        else:
            return f"{srcs[0]} feeds {row} through {tag.broken_by} but is not split into q, k, v pieces"
    elif len(srcs) == 3:
        big = max(widths)
        q_candidates = [s for s, w in zip(srcs, widths) if w == big]
        q = q_candidates[0]
        kv = [s for s in srcs if s != q]
        if len({linear_dims(a.leaves[s])[1] for s in kv}) != 1:
            return f"k/v projections {kv} of {attn_name} have different widths"
        q_w, kv_w = big, linear_dims(a.leaves[kv[0]])[1]
        roles = {q: "q", kv[0]: "k", kv[1]: "v"}
        pieces = None
    else:
        return f"{len(srcs)} projections {srcs} feed {row}; only q/k/v (3) or packed qkv (1) are split by heads"
    if hd is None and nh_attr:
        hd = q_w // nh_attr
    if hd is None:
        return f"{attn_name} ({type(attn).__name__}) states no head size or head count, so heads cannot be " \
               f"kept whole; replicated"
    if (head_width or hd) not in tag.reshaped_to:
        return f"no reshape to heads of size {hd} between {srcs} and {row} (saw {sorted(tag.reshaped_to)})"
    if q_w % hd or kv_w % hd:
        return f"projection widths {q_w}/{kv_w} of {attn_name} are not whole heads of {hd}"
    nh, nkv = q_w // hd, kv_w // hd
    if nh_attr and nh_attr != nh:
        return f"{attn_name} says {nh_attr} heads but its query projection holds {nh} heads of {hd}"
    if linear_dims(rm)[0] != q_w:
        return f"{row} takes {linear_dims(rm)[0]} features but the heads give {q_w}"
    common = {"pair": "attention", "attention": attn_name, "head_dim": hd, "num_heads": nh, "num_kv_heads": nkv}
    for s, role in roles.items():
        a.structures[s] = dict(common, role=role, row=row)
        if role == "qkv":
            a.structures[s]["pieces"] = list(pieces)
    head_local = sorted(c for c in tag.carried if c in t.head_local)
    if any(c not in t.head_local for c in tag.carried) or any(
            a.leaves[c].weight.shape[0] != hd for c in head_local if hasattr(a.leaves[c], "weight")):
        return f"layers {sorted(tag.carried)} between {srcs} and {row} are not per-head layers of size {hd}"
    a.structures[row] = dict(common, role="o", columns=srcs)
    for c in head_local:
        a.structures[c] = dict(common, role="head_local", row=row)
    a.pairs.append({"kind": "attention", "columns": srcs, "row": row, "carried": head_local, "attention": attn_name,
                    "head_dim": hd, "num_heads": nh, "num_kv_heads": nkv})
    return None


def _lm_heads(a: Analysis, world_size: int) -> list[str]:
    t = a.trace
    out = []
    for name in sorted(t.escaped):
        m = a.leaves.get(name)
        if m is None or not is_linear(m) or name in a.structures:
            continue
        n_out = linear_dims(m)[1]
        vocab = getattr(getattr(a.model, "config", None), "vocab_size", None)
        if vocab is not None:
            big = n_out == vocab or name in a.ties
        else:
            # Without a config: a vocabulary-like fan-out (many more outputs than inputs) that weighs something.
            big = name in a.ties or (n_out >= 2 * linear_dims(m)[0] and m.weight.numel() >= 0.05 * a.total_params)
        if n_out >= max(world_size, 2) and big:
            out.append(name)
    return out


def auto_plan(a: Analysis, world_size: int, mode: str = "inference") -> Plan:
    """The automatic plan for `world_size` ranks from a structure analysis."""
    if mode not in ("inference", "training"):
        raise ValueError(f"plan: mode must be 'inference' or 'training', got {mode!r}")
    entries: dict[str, str] = {}
    details: dict[str, dict] = {}
    reasons: dict[str, str] = {}
    if a.trace is None:
        for name in a.leaves:
            reasons[name] = f"the model's forward could not be traced ({a.trace_error}); pass example_inputs"
        return Plan({n: REPLICATE for n in a.leaves}, world_size=world_size, mode=mode, reasons=reasons,
                    prefix=a.prefix)
    for pair in a.pairs:
        names = pair["columns"] + [pair["row"]] + pair["carried"]
        why = _pair_blocker(a, pair, world_size)
        if why:
            for n in names:
                entries[n] = REPLICATE
                reasons[n] = why
            continue
        for n in pair["columns"]:
            entries[n] = COLWISE
            details[n] = a.structures[n]
        entries[pair["row"]] = ROWWISE
        details[pair["row"]] = a.structures[pair["row"]]
        for n in pair["carried"]:
            # BatchNorm between convs holds its channels; a per-head norm stays whole, its gradient summed.
            entries[n] = REPLICATED_WITH_GRAD_ALLREDUCE if pair["kind"] == "attention" else CHANNELWISE
            details[n] = a.structures[n]
    heads = _lm_heads(a, world_size)
    for h in heads:
        entries[h] = VOCAB_PARALLEL if mode == "training" else COLWISE_REP
    for name, m in a.leaves.items():
        if name in entries or not is_embedding(m):
            continue
        tied_to_head = any(o in heads for o in a.ties.get(name, []))
        vocab = getattr(getattr(a.model, "config", None), "vocab_size", None)
        share = m.weight.numel() / max(a.total_params, 1)
        if m.num_embeddings < world_size:
            reasons[name] = f"{m.num_embeddings} rows cannot be split over {world_size} ranks"
        elif tied_to_head or m.num_embeddings == vocab or (vocab is None and share >= 0.05):
            entries[name] = EMBEDDING_ROWWISE
        else:
            reasons[name] = (f"not the vocabulary ({share:.1%} of parameters, {m.num_embeddings} rows): splitting it "
                             f"would add an all-reduce per forward for little memory")
    _settle_ties(a, entries, reasons)
    for name, m in a.leaves.items():
        if name not in entries:
            entries[name] = REPLICATE
            reasons.setdefault(name, _replicate_reason(a, name, m))
    return Plan(entries, world_size=world_size, mode=mode, details=details, reasons=reasons, prefix=a.prefix)


def _pair_blocker(a: Analysis, pair: dict, world_size: int) -> str | None:
    if pair["kind"] == "attention":
        try:
            head_layout(pair["num_heads"], pair["num_kv_heads"], world_size, pair["attention"])
        except HeadLayoutError as exc:
            return str(exc)
        return None
    row = a.leaves[pair["row"]]
    width = row.in_channels if is_conv2d(row) else linear_dims(row)[0]
    if width < world_size:
        return f"{pair['row']} has {width} input features, fewer than {world_size} ranks"
    return None


def _settle_ties(a: Analysis, entries: dict, reasons: dict) -> None:
    """Tied weights must be split the same way (over the vocabulary) or all stay replicated."""
    for name, others in a.ties.items():
        group = [name] + others
        styles = {entries.get(n, REPLICATE) for n in group}
        if styles <= VOCAB_STYLES or styles == {REPLICATE}:
            continue
        for n in group:
            entries[n] = REPLICATE
            reasons[n] = f"weight tied with {[o for o in group if o != n]}, which cannot be split the same way"


def _replicate_reason(a: Analysis, name: str, m: nn.Module) -> str:
    if name not in a.trace.calls:
        return "not run in the traced forward"
    if name in a.notes:
        return a.notes[name]
    if is_feature_norm(m):
        return "normalises over all features, so it needs the whole vector (small; replicated)"
    if is_per_channel(m):
        return "per-channel layer not between a column and a row conv"
    if is_embedding(m):
        return "embedding not split"
    if is_linear(m) and name in a.trace.escaped:
        return "its output leaves the model and it is small; replicating avoids a gather"
    if is_linear(m) or is_conv2d(m):
        return "no column -> row partner found in the dataflow"
    return f"{kind(m)}: no rule splits this layer type"


def plan(model: nn.Module, world_size: int, *, mode: str = "inference", example_inputs: Any = None,
         overrides: Mapping[str, str] | Plan | None = None, analysis: Analysis | None = None) -> Plan:
    """The tensor-parallel plan for `model` on `world_size` ranks (module name -> style; see `Plan`).

    `mode="training"` keeps the LM head's logits split over the vocabulary (pair it with
    `tpkit.nn.vocab_parallel_cross_entropy`); inference gathers them. `overrides` (a mapping or a Plan)
    take precedence over the automatic entries. The plan never depends on an HF config's
    `base_model_tp_plan`; `analyze` reports where that hint and this plan disagree.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"plan: world_size must be a positive int, got {world_size!r}")
    a = analysis or analyze_structure(model, example_inputs)
    result = auto_plan(a, world_size, mode)
    if overrides:
        over = overrides if isinstance(overrides, Plan) else Plan.from_dict(overrides)
        over.prefix = over.prefix or a.prefix
        over.resolve(a.leaves)  # entries naming no module raise here
        result = result.updated(over)
    return result
