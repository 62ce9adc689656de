"""Finding the column -> row pairs of a traced model: MLP pairs and attention blocks (world-size free).

Decisions come from module types and the traced dataflow, never from parameter names:
- an MLP pair is a row candidate whose input is made, through per-feature ops only, from the outputs of
  linear (or conv) layers that feed nothing else; those become column-wise, it becomes row-wise;
- an attention pair (`attention.py`) is a row candidate whose input comes from linear layers that read one
  shared input, inside a module that says its head size (or head count), with the head size seen on a reshape
  on the way; q/k/v split by whole heads, packed projections piece by piece.
"""
from __future__ import annotations

from torch import nn

from ..modules import is_conv2d, is_embedding, is_linear, is_per_channel, is_plain_conv2d, kind, linear_dims
from ..roles import CONV, MLP, Pair, Role
from .attention import try_attention
from .dataflow import Tag, Trace
from .pairing import Pairing


def find_pairs(model: nn.Module, leaves: dict[str, nn.Module], t: Trace) -> Pairing:
    """Every column -> row pair of the traced forward, in call order of the row-wise layers."""
    a = Pairing(model, leaves, t)
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
        if not _calls_alike(t, row, srcs, tag):
            a.notes.setdefault(row, "called more than once per forward (shared module), not the same way each "
                                    "time; replicated to stay safe")
            continue
        if any(s in t.broken for s in srcs):
            reason = f"the output of {[s for s in srcs if s in t.broken]} is sliced into pieces that do not " \
                     f"tile its features; replicated"
        elif tag.clean:
            reason = _try_mlp(a, row, srcs, tag)
        else:
            reason = try_attention(a, row, srcs, tag, per_head)
        if reason is None:
            taken.add(row)
            taken.update(srcs)
        else:
            _note_unpaired(a, row, srcs, per_head, reason, as_row)
    return a


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


def _try_mlp(a: Pairing, row: str, srcs: list[str], tag: Tag) -> str | None:
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
    kind_ = CONV if conv else MLP
    for s in srcs:
        a.structures[s] = Role(kind_, "column", row=row, pieces=tuple(t.pieces[s]) if t.pieces.get(s) else None)
    a.structures[row] = Role(kind_, "row", columns=tuple(srcs))
    for c in tag.carried:
        a.structures[c] = Role(CONV, "channel", row=row)
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
