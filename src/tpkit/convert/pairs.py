"""Finding the column -> row pairs of a traced model: MLP pairs and attention blocks (world-size free).

Decisions come from module types and the traced dataflow, never from parameter names:
- an MLP pair is a row candidate whose input is made, through per-feature ops only, from the outputs of
  linear (or conv) layers that feed nothing else; those become column-wise, it becomes row-wise;
- an attention pair is a row candidate whose input comes from linear layers that read one shared input,
  inside a module that says its head size (or head count), with the head size seen on a reshape on the way;
  q/k/v split by whole heads, packed projections piece by piece.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from .modules import is_conv2d, is_embedding, is_linear, is_per_channel, is_plain_conv2d, kind, linear_dims
from .per_head import head_args, is_per_head_source

HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "d_head", "d_k")
NUM_HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_attention_heads_per_partition")
NUM_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")


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


def find_pairs(a) -> None:
    t = a.trace
    assert t is not None
    taken: set = set()
    as_row: set = set()  # layers whose note says why they are no row-wise layer (a column's reason beats it)
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
        # Embeddings among an attention output's sources are per-head tensors (T5's position bias): one may
        # serve several blocks, so they are not "taken" by the first (the planner splits all or none of them).
        per_head = [s for s in srcs if not tag.clean and is_embedding(a.leaves[s])]
        per_head = per_head if len(per_head) < len(srcs) else []  # only beside projections
        srcs = [s for s in srcs if s not in per_head]
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
            reason = _try_attention(a, row, srcs, tag, per_head)
        if reason is None:
            taken.add(row)
            taken.update(srcs)
        else:
            if row not in a.notes:
                a.notes[row] = reason
                if not any(is_linear(a.leaves[s]) or is_conv2d(a.leaves[s]) for s in srcs):
                    as_row.add(row)  # only "its input is no splittable layer": says nothing about it
            for s in srcs + per_head:
                if (is_linear(a.leaves[s]) or is_conv2d(a.leaves[s]) or s in per_head) and (
                        s not in a.notes or s in as_row):
                    a.notes[s] = reason
                    as_row.discard(s)


def _try_mlp(a, row: str, srcs: list[str], tag) -> str | None:
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


def _heads_module(a, srcs: list[str], row: str):
    """The module that states the heads: the nearest ancestor of q/k/v (up to the one holding the row) that
    says its head size or count (BERT keeps them on `attention.self`, the output layer one level up)."""
    top = _lca(srcs + [row])
    attn_name = _lca(srcs) if len(srcs) > 1 else srcs[0].rpartition(".")[0]
    while True:
        attn = a.model.get_submodule(attn_name) if attn_name else a.model
        info = head_info(attn)
        if info[0] or info[1] or len(attn_name) <= len(top):
            return attn_name, attn, info
        attn_name = attn_name.rpartition(".")[0]


def _packed(pieces, out: int, tag, hd, nh, nkv):
    """How one projection holds q, k and v: (role, q width, kv width, head_dim, head block width, pieces,
    extra details), or None when no layout is proven.
    - "qkv": split into three pieces [q | k | v] (Phi-3's slices, GPT-2's split);
    - "qkv_heads": [heads, 3, head_dim], each head's q, k, v side by side (GPT-NeoX views [heads, 3 x hd],
      BLOOM and Falcon [heads, 3, hd]);
    - "qkv_groups": [kv heads, group + 2, head_dim], each KV group's query heads then its key and value
      (Falcon's grouped layout), seen as a reshape to exactly those sizes."""
    per_head = hd or (out // (3 * nh) if nh and out % (3 * nh) == 0 else None)
    if pieces and len(pieces) == 3 and pieces[1] == pieces[2]:
        return "qkv", pieces[0], pieces[1], hd, hd, pieces, {}
    if per_head and out % (3 * per_head) == 0:
        heads = out // (3 * per_head)
        # [heads, 3, hd] with heads == 3 reads the same as [3, heads, hd]: not proven.
        if 3 * per_head in tag.reshaped_to:
            return "qkv_heads", out // 3, out // 3, per_head, 3 * per_head, None, {}
        if heads != 3 and (heads, 3, per_head) in tag.blocks:
            return "qkv_heads", out // 3, out // 3, per_head, per_head, None, {}
    if hd and nh and nkv and nh % nkv == 0 and out == (nh + 2 * nkv) * hd:
        group = nh // nkv
        if nkv != group + 2 and (nkv, group + 2, hd) in tag.blocks:
            return "qkv_groups", nh * hd, nkv * hd, hd, hd, None, {"group": group}
    return None


def _unsplittable(a, row: str, srcs: list[str], tag, head_tensors) -> str | None:
    """Why q/k/v -> row cannot be an attention block split by heads, before its heads are even looked at."""
    if not srcs or not is_linear(a.leaves[row]) or not all(is_linear(a.leaves[s]) for s in srcs):
        return f"ops between {srcs + list(head_tensors)} and {row} mix features ({tag.broken_by}) and they are not " \
               f"linear layers of an attention block"
    mixed = [s for s in srcs if s in tag.unproven]
    if mixed:
        return f"the output of {mixed} is rearranged across its features ({tag.broken_by}) before any reshape to " \
               f"heads (an interleaved rotary or a packing the planner cannot prove), so a split by heads could " \
               f"be wrong; left whole"
    inputs = [a.trace.first(s).input_id for s in srcs]
    if len(set(inputs)) != 1 and not _is_cross(srcs, inputs):
        return f"{srcs} do not read one shared input, so they are not the q/k/v of one attention block " \
               f"(ops between them and {row}: {tag.broken_by})"
    return None


def _is_cross(srcs: list[str], inputs: list) -> bool:
    """Cross-attention: the query reads one input, key and value another (the encoder's output)."""
    return len(srcs) == 3 and len(set(inputs)) == 2 and len(set(inputs[1:])) == 1


def _own_parameters(a, attn_name: str, names: list[str]) -> list[str]:
    """Parameters held by the attention module itself or a container between it and its layers (a per-head
    scale or sink, say): the forward uses them beside the heads, and nothing splits them with the heads."""
    top, out = _lca(names), []
    for name, m in a.model.named_modules():
        if name not in a.leaves and (name == attn_name or (name.startswith(attn_name) and top.startswith(name))):
            out += [f"{name}.{p}" if name else p for p, _ in m.named_parameters(recurse=False)]
    return out


def _try_attention(a, row: str, srcs: list[str], tag, head_tensors: list[str] = ()) -> str | None:
    t = a.trace
    rm = a.leaves[row]
    why = _unsplittable(a, row, srcs, tag, head_tensors)
    if why:
        return why
    cross = _is_cross(srcs, [t.first(s).input_id for s in srcs])
    attn_name, attn, (hd, nh_attr, nkv_attr) = _heads_module(a, srcs, row)
    own = _own_parameters(a, attn_name, srcs + [row])
    if own:
        return f"{attn_name} holds {own} itself and uses them beside its heads (per-head scales?); they are not " \
               f"split with the heads, so the attention stays whole"
    widths = [linear_dims(a.leaves[s])[1] for s in srcs]
    head_width = hd
    extra: dict = {}
    if len(srcs) == 1:
        found = _packed(t.pieces.get(srcs[0]), widths[0], tag, hd, nh_attr, nkv_attr)
        if found is None:
            return f"{srcs[0]} feeds {row} through {tag.broken_by} but is not split into q, k, v pieces"
        role, q_w, kv_w, hd, head_width, pieces, extra = found
        roles = {srcs[0]: role}
    elif len(srcs) == 3:
        big = max(widths)
        q = srcs[0] if cross else [s for s, w in zip(srcs, widths) if w == big][0]
        kv = [s for s in srcs if s != q]
        if len({linear_dims(a.leaves[s])[1] for s in kv}) != 1:
            return f"k/v projections {kv} of {attn_name} have different widths"
        q_w, kv_w = linear_dims(a.leaves[q])[1], linear_dims(a.leaves[kv[0]])[1]
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
        a.structures[s].update(extra)
    head_local = sorted(c for c in tag.carried if c in t.head_local)
    if any(c not in t.head_local for c in tag.carried) or any(
            a.leaves[c].weight.shape[0] != hd for c in head_local if hasattr(a.leaves[c], "weight")):
        return f"layers {sorted(tag.carried)} between {srcs} and {row} are not per-head layers of size {hd}"
    odd = [p for p in head_tensors if not is_per_head_source(a.leaves[p], nh)]
    if odd:
        return f"{odd} reach the scores of {attn_name} but are not per-head tensors of its {nh} heads"
    a.structures[row] = dict(common, role="o", columns=srcs)
    read = {t.first(s).input_id for s in srcs}
    plain = {at: shape for at, (shape, ident) in t.plain_args.get(attn_name, {}).items() if ident not in read}
    sliced = head_args(plain, t.first(srcs[0]).input_shape[0], nh)
    if sliced:
        a.structures[row]["head_args"] = sliced
    for c in head_local:
        a.structures[c] = dict(common, role="head_local", row=row)
    for p in head_tensors:
        a.structures.setdefault(p, dict(common, role="per_head", rows=[]))["rows"].append(row)
    a.pairs.append({"kind": "attention", "columns": srcs, "row": row, "carried": head_local, "attention": attn_name,
                    "head_dim": hd, "num_heads": nh, "num_kv_heads": nkv, "per_head": list(head_tensors)})
    return None
