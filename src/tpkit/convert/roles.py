"""The records passed between the steps of conversion, as frozen dataclasses (no string-keyed dicts).

`Pair` is what the trace found: a column -> row pair (an MLP, a conv pair, an attention block), world-size free.
`Role` is what a plan records per module beside its style (the plan's `details`): which pair the module belongs
to and the facts its split needs (heads, packed pieces). A plan saved as JSON holds each Role as its `to_dict()`,
which is the same mapping older plans and checkpoint manifests hold, so they replay unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..layout import HeadLayout, head_layout

ATTENTION, MLP, CONV = "attention", "mlp", "conv"


@dataclasses.dataclass(frozen=True)
class Pair:
    """Layers whose outputs stay split from `columns` to `row`: an MLP or conv pair, or an attention block (with
    its heads); `carried` are per-channel / per-head layers in between, `per_head` embeddings with one column per
    head that reach the block's scores (T5's position bias), `owners` the modules of the block that hold
    parameters of their own which follow its heads (attention sinks, per-head biases; `Role.params`), `norms` the
    norms over all of the split features on the way (OLMo-2's q_norm, BitNet's sub-norms), which run whole on the
    features gathered from every rank (`families/gathered_norms.py`)."""

    kind: str
    columns: tuple[str, ...]
    row: str
    carried: tuple[str, ...] = ()
    attention: str | None = None
    head_dim: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    per_head: tuple[str, ...] = ()
    kv_expand: bool | None = None
    owners: tuple[str, ...] = ()
    norms: tuple[str, ...] = ()

    def heads(self, world_size: int) -> HeadLayout:
        """The block's heads per rank (raises `HeadLayoutError` when they cannot be shared out)."""
        return head_layout(self.num_heads, self.num_kv_heads, world_size, self.attention or "attention",
                           spread=bool(self.kv_expand))

    @property
    def members(self) -> tuple[str, ...]:
        """Every module the pair splits or keeps whole together."""
        return self.columns + (self.row,) + self.carried + self.per_head + self.norms


@dataclasses.dataclass(frozen=True)
class Role:
    """A module's part in a pair (`pair`: attention / mlp / conv; `role`: q, k, v, qkv, qkv_heads, qkv_groups, o,
    gate, head_gate, column, row, channel, head_local, per_head, gathered_norm, elementwise, ...) and what its layouts
    need to know."""

    pair: str
    role: str
    row: str | None = None                    # a column's row-wise partner
    columns: tuple[str, ...] = ()             # a row's column-wise partners
    attention: str | None = None              # the module that states the heads
    head_dim: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    pieces: tuple[int, ...] | None = None     # widths of the packed pieces of a fused projection
    group: int | None = None                  # query heads per KV head of a grouped qkv ([kv, group + 2, hd])
    head_args: tuple[tuple[int | str, str], ...] = ()  # per-head arguments: (position or keyword, "flat"/"dim1")
    rows: tuple[str, ...] = ()                # a per-head tensor's attention output layers
    kv_expand: bool | None = None             # the attention can expand its local KV heads to one per query
    #                                           head, so query heads are spread evenly (`tpkit.layout.heads`)
    params: tuple[tuple[str, str], ...] = ()  # a module's own parameters and how each follows the heads:
    #                                           (name, "heads" | "head_features" | "shared"), `trace/head_params.py`
    unit: int | None = None                   # a column / row pair's split features come in whole units of this
    #                                           (a quantized checkpoint's groups and packed words: `quantized.py`)

    def heads(self, world_size: int) -> HeadLayout:
        """The attention's heads per rank: the one fact its layouts, local head counts and hooks read."""
        return head_layout(self.num_heads, self.num_kv_heads, world_size, self.attention or "attention",
                           spread=bool(self.kv_expand))

    @property
    def is_attention(self) -> bool:
        return self.pair == ATTENTION

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: fields that are set, in the form plans have always stored them."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or value == ():
                continue
            if f.name == "head_args":
                value = {str(k): v for k, v in value}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: "Role | Mapping[str, Any]") -> "Role":
        if isinstance(data, Role):
            return data
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"plan details: unknown fields {unknown} (known: {sorted(known)})")
        values = dict(data)
        for name in ("columns", "rows"):
            if name in values:
                values[name] = tuple(values[name])
        if "params" in values:
            values["params"] = tuple((str(n), str(k)) for n, k in values["params"])
        if values.get("pieces") is not None:
            values["pieces"] = tuple(int(p) for p in values["pieces"])
        if "head_args" in values:
            values["head_args"] = tuple((int(k) if isinstance(k, str) and k.isdigit() else k, v)
                                        for k, v in dict(values["head_args"]).items())
        return cls(**values)

    def replace(self, **changes: Any) -> "Role":
        return dataclasses.replace(self, **changes)
