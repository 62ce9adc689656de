"""Finding the column -> row pairs of a traced model: MLP pairs and attention blocks (world-size free).

Decisions come from module types and the traced dataflow, never from parameter names:
- an MLP pair is a row candidate whose input is made, through per-feature ops only, from the outputs of
  linear (or conv) layers that feed nothing else; those become column-wise, it becomes row-wise;
- an attention pair (`attention.py`) is a row candidate whose input comes from linear layers that read one
  shared input, inside a module that says its head size (or head count), with the head size seen on a reshape
  on the way; q/k/v split by whole heads, packed projections piece by piece.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from torch import nn

from ..modules import (is_conv2d, is_embedding, is_feature_norm, is_linear, is_per_channel, is_plain_conv2d,
                       kind, linear_dims)
from ..roles import CONV, MLP, Pair, Role
from .attention import try_attention
from .dataflow import Tag, Trace
from .pairing import Pairing


def find_pairs(modules: Mapping[str, nn.Module], leaves: dict[str, nn.Module], t: Trace) -> Pairing:
    """Every column -> row pair of the traced forward, in call order of the row-wise layers (`modules`: the traced
    model's, by name)."""
    a = Pairing(modules, leaves, t)
    taken: set = set()
    as_row: set = set()  # layers whose note says why they are no row-wise layer (a column's reason beats it)
    order = sorted((c[0].order, n) for n, c in t.calls.items())
    for _, row in order:
        m = a.leaves[row]
        if not (is_linear(m) or is_plain_conv2d(m)):
            continue
        tag = t.first(row).input_tag
        if tag is None or not tag.sources:
            continue
        through, norms = _through_norms(a, row, tag)
        reason = ""
        if norms:
            before = dict(a.structures), dict(a.notes)
            reason, srcs, per_head = _try_row(a, row, through, norms, taken)
            if reason is not None:  # the pair does not form through the norms: as the row reads its input
                (a.structures, a.notes), norms = before, ()
        if reason is not None:
            reason, srcs, per_head = _try_row(a, row, tag, norms, taken)
        if reason is None:
            taken.add(row)
            taken.update(srcs + list(norms))
            if norms:
                _add_norms(a, row, norms)
        elif reason:
            _note_unpaired(a, row, srcs, per_head, reason, as_row)
    return a


def _try_row(a: Pairing, row: str, tag: Tag, norms: tuple[str, ...], taken: set) -> tuple[str | None, list, list]:
    """Pair `row` with the layers its input `tag` comes from: (None, sources, per-head tensors) when it pairs,
    else (the reason, ...); an empty reason when a note on the row already says it."""
    t = a.trace
    srcs = sorted(tag.sources, key=lambda s: t.first(s).order)
    # Embeddings among an attention output's sources are per-head tensors (T5's position bias): one may
    # serve several blocks, so they are not "taken" by the first (the planner splits all or none of them).
    per_head = [s for s in srcs if not tag.clean and is_embedding(a.leaves[s])]
    per_head = per_head if len(per_head) < len(srcs) else []  # only beside projections
    srcs = [s for s in srcs if s not in per_head]
    if row in taken or any(s in taken for s in srcs):
        if not norms:
            a.notes.setdefault(row, "its input comes from a layer already paired with another row-wise layer "
                                    "(an odd chain of layers: the last one has no partner)")
        return "", srcs, per_head
    if not _calls_alike(t, row, srcs, tag):
        if not norms:
            a.notes.setdefault(row, "called more than once per forward (shared module), not the same way each "
                                    "time; replicated to stay safe")
        return "", srcs, per_head
    if any(s in t.broken for s in srcs):
        return f"the output of {[s for s in srcs if s in t.broken]} is sliced into pieces that do not tile its " \
               f"features; replicated", srcs, per_head
    if tag.clean:
        return _try_mlp(a, row, srcs, tag, norms), srcs, per_head
    return try_attention(a, row, srcs, tag, per_head), srcs, per_head


def _note_unpaired(a: Pairing, row: str, srcs: list[str], per_head: list[str], reason: str, as_row: set) -> None:
    """Say why on the row and on its sources (a source's own reason wins over a note that only says its row's
    input is no splittable layer)."""
    if row not in a.notes:
        a.notes[row] = reason
        if not any(is_linear(a.leaves[s]) or is_conv2d(a.leaves[s]) for s in srcs):
            as_row.add(row)  # only "its input is no splittable layer": says nothing about it
    for s in srcs + per_head:
        if (is_linear(a.leaves[s]) or is_conv2d(a.leaves[s]) or s in per_head) and (s not in a.notes or s in as_row):
            a.notes[s] = reason
            as_row.discard(s)


def _seen_through(tag: Tag, norm: str, inner: frozenset) -> Tag:
    """`tag` with `norm` taken out of its sources: what the trace says of the norm's output (it met the other
    projections in the scores, it was mixed or cut) it says of the layers the norm reads."""
    changes = {"sources": tag.sources - {norm}}
    for field in ("unproven", "attended", "headed_cuts"):
        names = getattr(tag, field)
        if norm in names:
            changes[field] = (names - {norm}) | inner
    return dataclasses.replace(tag, **changes)


def _through_norms(a: Pairing, row: str, tag: Tag) -> tuple[Tag, tuple[str, ...]]:
    """The row's input tag seen through the norms over all features that sit between it and its column layers
    (OLMo-2's q_norm on the whole query projection, BitNet's sub-norm before o_proj and before down_proj), with
    those norms (the tag as it is and no norms when there are none). Such a norm can run whole on each rank on the
    features gathered from every rank (`families/gathered_norms.py`), so the layers before it stay split. Taken only when the norm is
    called once, keeps its input's shape, feeds this row alone, and reads only linear layers that feed it alone."""
    t = a.trace
    new, norms = tag, []
    for n in sorted(tag.sources):
        calls = t.calls.get(n, [])
        if len(calls) != 1 or n in t.escaped or t.consumers.get(n) != {row} or not is_feature_norm(a.leaves[n]):
            continue
        inner = calls[0].input_tag
        if inner is None or not inner.sources or calls[0].input_shape != calls[0].output_shape:
            continue
        if not all(is_linear(a.leaves[s]) and len(t.calls[s]) == 1 and t.consumers.get(s) == {n}
                   and s not in t.escaped for s in inner.sources):
            continue
        new = _seen_through(new.merge(inner), n, inner.sources)
        norms.append(n)
    # A norm on the attention output after its heads were joined back (BitNet's attn_sub_norm) reads a tensor
    # that was reshaped on the way, so the trace carried it like a per-head norm; it spans the row's input.
    width = _in_width(a.leaves[row])
    for c in sorted(tag.carried):
        calls = t.calls.get(c, [])
        if c in t.head_local and len(calls) == 1 and calls[0].input_shape and calls[0].input_shape[-1] == width \
                and is_feature_norm(a.leaves[c]):
            new = dataclasses.replace(new, carried=new.carried - {c})
            norms.append(c)
    weight = getattr(a.leaves[row], "weight", None)
    if norms and any(m is not a.leaves[row] and getattr(m, "weight", None) is weight for m in a.leaves.values()):
        return tag, ()  # a tied LM head: the vocabulary family splits it with its embedding, not by its input
    return new, tuple(norms)


def _in_width(m: nn.Module) -> int:
    return m.in_channels if is_conv2d(m) else linear_dims(m)[0]


def _add_norms(a: Pairing, row: str, norms: tuple[str, ...]) -> None:
    """Record the pair just found as passing through `norms`, each with the layer whose split its features
    follow: the one column it normalises (a q_norm: the query's heads), else the row's input (a sub-norm on the
    attention output or on the MLP's product)."""
    pair = a.pairs[-1]
    a.pairs[-1] = dataclasses.replace(pair, norms=norms)
    for n in norms:
        inner = sorted(a.trace.first(n).input_tag.sources)
        a.structures[n] = Role(pair.kind, "gathered_norm", row=row, columns=tuple(inner) if len(inner) == 1 else ())


def _try_mlp(a: Pairing, row: str, srcs: list[str], tag: Tag, norms: tuple[str, ...] = ()) -> str | None:
    t = a.trace
    rm = a.leaves[row]
    conv = is_conv2d(rm)
    width_in = _in_width(rm)
    for s in srcs:
        sm = a.leaves[s]
        if conv != is_plain_conv2d(sm) or (not conv and not is_linear(sm)):
            return f"input of {row} comes from {s} ({kind(sm)}), which is not a {kind(rm)} that can be split"
        if not t.consumers.get(s) or t.consumers[s] - {row, *norms} or s in t.escaped:
            users = sorted(t.consumers.get(s, set()) | ({"<model output>"} if s in t.escaped else set()))
            return f"output of {s} also feeds {users}: splitting it would hand them a shard"
        out = sm.out_channels if conv else linear_dims(sm)[1]
        pieces = t.pieces.get(s)
        if pieces and any(p != width_in for p in pieces):
            return f"{s} is packed as {list(pieces)}, which does not match {row}'s {width_in} input features"
        if not pieces and out != width_in:
            return f"{s} gives {out} features but {row} takes {width_in}"
    for c in tag.carried:
        # the trace carries per-channel layers and scalar-parameter activations (`is_scalar_elementwise`) alone
        if is_per_channel(a.leaves[c]) and a.leaves[c].num_features != width_in:
            return f"{c} between {srcs} and {row} is not a per-channel layer of {width_in} channels"
    kind_ = CONV if conv else MLP
    for s in srcs:
        a.structures[s] = Role(kind_, "column", row=row, pieces=tuple(t.pieces[s]) if t.pieces.get(s) else None)
    a.structures[row] = Role(kind_, "row", columns=tuple(srcs))
    for c in tag.carried:
        a.structures[c] = Role(CONV, "channel", row=row) if is_per_channel(a.leaves[c]) \
            else Role(kind_, "elementwise", row=row)
    a.pairs.append(Pair(kind_, tuple(srcs), row, tuple(sorted(tag.carried))))
    return None


def _calls_alike(t, row: str, srcs: list[str], tag) -> bool:
    """Whether a pair called more than once (a module shared across depth, ALBERT's layer) is called the same
    way each time: its layers as often as each other, the row-wise layer reading the same layers every call."""
    n = len(t.calls[row])
    if n == 1 and all(len(t.calls[s]) == 1 for s in srcs):
        return True
    return all(len(t.calls[s]) == n for s in srcs) and all(
        c.input_tag is not None and c.input_tag.sources == tag.sources for c in t.calls[row])
