"""Attention blocks in the traced dataflow: q/k/v (or one packed projection) -> heads -> output layer.

A row candidate is an attention output layer when its input comes from linear layers that read one shared input
(or, for cross-attention, the query one input and key/value another), inside a module that states its head size
or count, with that head size seen on a reshape on the way. Packed projections are proven by the pieces and
reshapes the trace saw; anything unproven stays whole with the reason.

A gate (Afmoe's `output * sigmoid(gate_proj(x))`, a per-head scalar `gate.unsqueeze(-1)`) is a projection that
reaches the output layer through elementwise ops only, where q, k and v met each other in the scores
(`Tag.attended`): it is split with the query heads, or the block stays whole when its width or layout is not
one of theirs.
"""
from __future__ import annotations

import math

from ..modules import is_linear, is_per_head_source, kind, linear_dims
from ..roles import ATTENTION, Pair, Role
from .dataflow import Tag
from .head_params import head_params
from .heads import head_args, head_info
from .pairing import Pairing


def _lca(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _heads_module(a: Pairing, srcs: list[str], row: str):
    """The module that states the heads: the nearest ancestor of q/k/v (up to the one holding the row) that
    says its head size or count (BERT keeps them on `attention.self`, the output layer one level up)."""
    top = _lca(srcs + [row])
    attn_name = _lca(srcs) if len(srcs) > 1 else srcs[0].rpartition(".")[0]
    while True:
        attn = a.modules[attn_name]
        info = head_info(attn)
        if info[0] or info[1] or len(attn_name) <= len(top):
            return attn_name, attn, info
        attn_name = attn_name.rpartition(".")[0]


def _packed(pieces, out: int, tag, hd, nh, nkv):
    """How one projection holds q, k and v: (role, q width, kv width, head_dim, head block width, pieces,
    extra details), or None when no layout is proven.
    - "qkv": split into three pieces [q | k | v] (Phi-3's slices, GPT-2's split), or seen as a reshape to exactly
      [3, heads, head_dim] (ModernBert), or as [heads + 2, head_dim] with the query cut as its first `heads`
      rows (Falcon's multi-query: one key and one value head after the query heads);
    - "qkv_heads": [heads, 3, head_dim], each head's q, k, v side by side (GPT-NeoX views [heads, 3 x hd],
      BLOOM and Falcon [heads, 3, hd]);
    - "qkv_groups": [kv heads, group + 2, head_dim], each KV group's query heads then its key and value
      (Falcon's grouped layout), seen as a reshape to exactly those sizes, the query cut as each group's first
      `group` rows.
    A layout whose head count is 3 reads the same as its [3, heads] twin and is not proven that way."""
    per_head = hd or (out // (3 * nh) if nh and out % (3 * nh) == 0 else None)
    if pieces and len(pieces) == 3 and pieces[1] == pieces[2]:
        return "qkv", pieces[0], pieces[1], hd, hd, pieces, {}
    if per_head and out % (3 * per_head) == 0:
        heads = out // (3 * per_head)
        # [heads, 3, hd] with heads == 3 reads the same as [3, heads, hd]: not proven. [heads, 3 x hd] is proven by
        # a reshape to exactly those two sizes: a last axis of 3 x hd alone may be the output's flatten of 3 heads.
        if (heads, 3 * per_head) in tag.blocks:
            return "qkv_heads", out // 3, out // 3, per_head, 3 * per_head, None, {}
        if heads != 3 and (heads, 3, per_head) in tag.blocks:
            return "qkv_heads", out // 3, out // 3, per_head, per_head, None, {}
        if heads != 3 and (3, heads, per_head) in tag.blocks and nkv in (None, nh or heads):
            return "qkv", out // 3, out // 3, per_head, per_head, (out // 3,) * 3, {}
    if hd and nh and nkv in (None, 1) and out == (nh + 2) * hd and (nh + 2, hd) in tag.blocks \
            and (nh + 2, 0, nh) in tag.head_slices:
        return "qkv", nh * hd, hd, hd, hd, (nh * hd, hd, hd), {}
    if hd and nh and nkv and nh % nkv == 0 and out == (nh + 2 * nkv) * hd:
        group = nh // nkv
        if nkv != group + 2 and (nkv, group + 2, hd) in tag.blocks and (group + 2, 0, group) in tag.head_slices:
            return "qkv_groups", nh * hd, nkv * hd, hd, hd, None, {"group": group}
    return None


def _unsplittable(a: Pairing, row: str, srcs: list[str], tag: Tag, head_tensors) -> str | None:
    """Why q/k/v -> row cannot be an attention block split by heads, before its heads are even looked at."""
    if not srcs or not is_linear(a.leaves[row]) or not all(is_linear(a.leaves[s]) for s in srcs):
        return f"ops between {srcs + list(head_tensors)} and {row} mix features ({tag.broken_by}) and they are not " \
               f"linear layers of an attention block"
    mixed = [s for s in srcs if s in tag.unproven]
    if mixed and not _within_one_head(a, srcs, row, tag):
        return f"the output of {mixed} is rearranged across its features ({tag.broken_by}) before any reshape to " \
               f"heads (an interleaved rotary or a packing the planner cannot prove), so a split by heads could " \
               f"be wrong; left whole"
    inputs = [a.trace.first(s).input_id for s in srcs]
    if len(set(inputs)) != 1 and not _is_cross(srcs, inputs):
        return f"{srcs} do not read one shared input, so they are not the q/k/v of one attention block " \
               f"(ops between them and {row}: {tag.broken_by})"
    return None


def _within_one_head(a: Pairing, srcs: list[str], row: str, tag: Tag) -> bool:
    """Whether every op that mixed features before a reshape to heads ran on one head's width (GPT-BigCode's
    multi-query key: a piece of head_dim features, transposed for the scores, never reshaped): it mixes nothing
    across heads."""
    hd = _heads_module(a, srcs, row)[2][0]
    return bool(hd) and tag.mixed_at == {hd}


def _is_cross(srcs: list[str], inputs: list) -> bool:
    """Cross-attention: the query reads one input, key and value another (the encoder's output)."""
    return len(srcs) == 3 and len(set(inputs)) == 2 and len(set(inputs[1:])) == 1


def _heads_seen(t, layer: str) -> set[int]:
    """How many heads `layer` (a per-head layer) sees in each call: the rows its input holds per token of the
    projection its heads come from (an input of [batch, heads, seq, head_dim] per [batch, seq] tokens); 0 where
    that cannot be counted."""
    tokens = {math.prod(c.input_shape[:-1]) for s in t.head_local[layer] for c in t.calls.get(s, ())[:1]
              if c.input_shape}
    seen = set()
    for call in t.calls.get(layer, ()):
        rows = math.prod(call.input_shape[:-1]) if call.input_shape else 0
        seen |= {rows // n if n and rows % n == 0 else 0 for n in tokens} or {0}
    return seen


def _whole_heads(a: Pairing, layer: str, hd: int, nh: int, nkv: int) -> set[int]:
    """The head counts a per-head layer sees when it runs on all the heads of its projection: a projection of its
    own (q: its query heads; k or v: its KV heads, or one per query head once repeated), else (a packed one) the
    query or the KV heads."""
    widths = {linear_dims(a.leaves[s])[1] for s in a.trace.head_local[layer] if is_linear(a.leaves[s])}
    own = {w // hd for w in widths} & {nh, nkv}
    return own | {nh} if len(widths) == 1 and own else {nh, nkv}


def _sliced_heads(a: Pairing, head_local: list[str], attn: str, hd: int, nh: int, nkv: int) -> str | None:
    """Why the block stays whole when one of its per-head layers is applied to a slice of the heads rather than to
    all the heads of its projection (StableLM's `qk_layernorm`: a list of LayerNorms, one per head, zipped with
    `torch.split(heads, 1, dim=1)`), or None. Each such layer holds weights for particular heads, while a split
    hands every rank its own heads in the same slots: rank 1 would run the layers of heads 0..k on its heads k..2k.
    Choosing the layers by rank would change the module (and its state_dict keys, which a converted model keeps),
    so the whole block stays on every rank, where it computes exactly what it did."""
    sliced = {c: seen for c in head_local if (seen := _heads_seen(a.trace, c)) - _whole_heads(a, c, hd, nh, nkv)}
    if not sliced:
        return None
    lists: dict[str, list] = {}
    for c, seen in sliced.items():
        lists.setdefault(c.rpartition(".")[0] or c, []).append(seen)
    shown = "; ".join(f"{owner}: {len(seens)} module(s), {'/'.join(map(str, sorted(set().union(*seens))))} head(s) "
                      f"per call" for owner, seens in lists.items())
    return (f"per-head layers of {attn} are applied to slices of its heads, not to all {nh} query / {nkv} KV heads "
            f"at once ({shown}): a list of modules, one per head, as StableLM's per-head q/k LayerNorms; split by "
            f"heads, each rank would apply the modules of the first heads to its own heads, so the attention stays "
            f"whole")


def _own_parameters(a: Pairing, attn_name: str, names: list[str]) -> dict[str, tuple[str, str, object]]:
    """Parameters held by the attention module itself or a container between it and its layers (a per-head
    scale or sink, say): the forward uses them beside the heads; `head_params.py` says whether they follow the
    heads. `{qualified name: (owner module, name there, parameter)}`."""
    top, out = _lca(names), {}
    for name, m in a.modules.items():
        if name not in a.leaves and (name == attn_name or (name.startswith(attn_name) and top.startswith(name))):
            for p, v in m.named_parameters(recurse=False):
                out[f"{name}.{p}" if name else p] = (name, p, v)
    return out


def _own_follow_heads(a: Pairing, own: dict, block: set, common: Role, tag: Tag) -> tuple[dict, str | None]:
    """How the attention's own parameters follow its heads, per module holding them (`{module: ((name, kind),
    ...)}`), or why the block stays whole."""
    kinds, why = head_params(a.trace, {q: v for q, (_, _, v) in own.items()}, block, common.attention,
                             common.num_heads, common.head_dim, common.num_kv_heads, tag.cut)
    owners: dict[str, tuple] = {}
    for q, kind in kinds.items():
        owners[own[q][0]] = owners.get(own[q][0], ()) + ((own[q][1], kind),)
    if not why and "" in owners:
        why = f"the model itself holds {[n for n, _ in owners['']]} beside its heads and a plan names submodules " \
              f"only, so they cannot be split with the heads; the attention stays whole"
    return owners, why


def _gates(srcs: list[str], tag: Tag) -> list[str]:
    """The sources that met the others in elementwise ops only (gates on the attention output), when some met in
    another op (q, k and v in the scores); none when no source did (no attention op was seen)."""
    return [s for s in srcs if s not in tag.attended] if tag.attended & set(srcs) else []


def _gate_roles(a: Pairing, gates: list[str], q: str, attn: str, row: str, hd: int, nh: int,
                tag: Tag) -> tuple[dict[str, str], str | None]:
    """Each gate's role, or why the block stays whole: a gate reads the query's input and holds its heads, either
    head_dim features per head ("gate", laid out as q) or one value per head ("head_gate")."""
    roles = {}
    for g in gates:
        m = a.leaves[g]
        if not is_linear(m):
            return {}, f"{g} ({kind(m)}) meets the heads of {attn} elementwise (a gate) but is not a linear layer"
        width = linear_dims(m)[1]
        if g in tag.unproven or g in tag.headed_cuts:
            return {}, f"the gate {g} (width {width}) of {attn} is rearranged across its features (or cut along its " \
                       f"heads) on the way to {row}, so it cannot be proven to follow the query heads; left whole"
        if a.trace.first(g).input_id != a.trace.first(q).input_id:
            return {}, f"the gate {g} of {attn} reads another input than its query projection {q}; left whole"
        if width not in (nh * hd, nh):
            return {}, f"the gate {g} of {attn} gives {width} features; a gate split with the {nh} query heads of " \
                       f"{hd} must give {nh * hd} (one per feature) or {nh} (one per head); left whole"
        roles[g] = "gate" if width == nh * hd else "head_gate"
    return roles, None


def try_attention(a: Pairing, row: str, srcs: list[str], tag: Tag, head_tensors: list[str] = ()) -> str | None:
    """Record `srcs -> row` as an attention block, or say why it is not one."""
    t = a.trace
    rm = a.leaves[row]
    gates = _gates(srcs, tag)
    srcs, columns = [s for s in srcs if s not in gates], srcs
    why = _unsplittable(a, row, srcs, tag, head_tensors)
    if why:
        return why
    cross = _is_cross(srcs, [t.first(s).input_id for s in srcs])
    attn_name, attn, (hd, nh_attr, nkv_attr) = _heads_module(a, srcs, row)
    own = _own_parameters(a, attn_name, columns + [row])
    widths = [linear_dims(a.leaves[s])[1] for s in srcs]
    head_width = hd
    extra: dict = {}
    if len(srcs) == 1:
        found = _packed(t.pieces.get(srcs[0]), widths[0], tag, hd, nh_attr, nkv_attr)
        if found is None:
            return f"{srcs[0]} feeds {row} through {tag.broken_by} but is not split into q, k, v pieces"
        role, q_w, kv_w, hd, head_width, pieces, extra = found
        roles, q = {srcs[0]: role}, srcs[0]
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
        return f"{len(srcs)} projections {srcs} feed {row}{f' beside the gates {gates}' if gates else ''}; only " \
               f"q/k/v (3) or packed qkv (1) are split by heads"
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
    gate_roles, why = _gate_roles(a, gates, q, attn_name, row, hd, nh, tag)
    if why:
        return why
    why = _sliced_heads(a, sorted(c for c in tag.carried if c in t.head_local), attn_name, hd, nh, nkv)
    if why:
        return why
    # GQA whose attention reads `num_key_value_groups` can expand its local KV heads to one per query head, so
    # its query heads may be spread evenly over the ranks (`tpkit.layout.heads`, `families/attention.py`).
    expand = (nkv < nh and set(roles.values()) <= {"q", "k", "v", "qkv"}
              and isinstance(getattr(attn, "num_key_value_groups", None), int)) or None
    common = Role(ATTENTION, "", attention=attn_name, head_dim=hd, num_heads=nh, num_kv_heads=nkv, kv_expand=expand)
    for s, role in roles.items():
        a.structures[s] = common.replace(role=role, row=row, pieces=tuple(pieces) if role == "qkv" else None,
                                         **extra)
    for g, role in gate_roles.items():  # the query's heads, never expanded as KV heads are (`ExpandKV`)
        a.structures[g] = common.replace(role=role, row=row)
    head_local = sorted(c for c in tag.carried if c in t.head_local)
    if any(c not in t.head_local for c in tag.carried) or any(
            a.leaves[c].weight.shape[0] != hd for c in head_local if hasattr(a.leaves[c], "weight")):
        return f"layers {sorted(tag.carried)} between {srcs} and {row} are not per-head layers of size {hd}"
    odd = [p for p in head_tensors if not is_per_head_source(a.leaves[p], nh)]
    if odd:
        return f"{odd} reach the scores of {attn_name} but are not per-head tensors of its {nh} heads"
    owners, why = _own_follow_heads(a, own, set(columns) | set(head_local) | set(head_tensors), common, tag)
    if why:
        return why
    for owner, params in owners.items():
        a.structures[owner] = common.replace(role="head_params", row=row, params=params)
    _record(a, row, columns, common, t, head_local, head_tensors, tuple(owners))
    return None


def _record(a: Pairing, row: str, srcs: list[str], common: Role, t, head_local: list[str], head_tensors,
            owners: tuple = ()) -> None:
    read = {t.first(s).input_id for s in srcs}
    plain = {at: shape for at, (shape, ident) in t.plain_args.get(common.attention, {}).items() if ident not in read}
    sliced = head_args(plain, t.first(srcs[0]).input_shape[0], common.num_heads)
    a.structures[row] = common.replace(role="o", columns=tuple(srcs), head_args=tuple(sliced.items()))
    for c in head_local:
        a.structures[c] = common.replace(role="head_local", row=row)
    for p in head_tensors:
        before = a.structures.get(p, common.replace(role="per_head"))
        a.structures[p] = before.replace(rows=before.rows + (row,))
    a.pairs.append(Pair(ATTENTION, tuple(srcs), row, tuple(head_local), common.attention, common.head_dim,
                        common.num_heads, common.num_kv_heads, tuple(head_tensors), common.kv_expand, owners))
