"""Lone layers: a large linear or conv layer with no partner is split by its output features, its output gathered.

The pairing families split a layer only with a partner: a column-wise layer whose split output a row-wise one
reads. A layer they cannot pair (its output meets an op that needs every feature, as a Mamba mixer's `in_proj`
before its transpose; the last of an odd chain; a pooler; a projection between two norms) used to stay whole,
and with it all its memory. Megatron's `ColumnParallelLinear(gather_output=True)` (Hugging Face's
`colwise_rep`) splits such a layer anyway: each rank computes its slice of the output features and one
all-gather makes the output whole again, so whatever reads it sees what it saw before, exactly. Its input must
be whole (the backward sums its gradient), which holds for every layer no family split.

The gather costs one collective of the layer's output per call, so only layers that hold real memory are
split: at least `1 / GATHER_FRACTION` of the model's largest linear or conv layer (LM heads aside); a router or
a small classifier stays whole. The measure is the largest layer, not the parameter count, so a deep model and
the same model cut to its distinct blocks (plan reuse) decide alike. Never split: a layer another family keeps
whole for a reason of its own (read directly by other code, tied, kept whole by the chosen setup), a layer
inside a module planned as one region, a layer not run in the traced forward, or one whose input is a shard.
The alternative, offered to the setup search, keeps the layer whole.
"""
from __future__ import annotations

from typing import Iterator

from ..family import NO_PARTNER, Choice, Draft, Family, Proposal
from ..modules import is_linear, is_plain_conv2d, linear_dims
from ..styles import ALONE, COLWISE_REP, REPLICATE
from .vocab import lm_heads

GATHER_FRACTION = 8  # a lone layer at least this many times smaller than the largest layer stays whole


def _size(m) -> int:
    return int(m.weight.numel())


def _outputs(m) -> int:
    return int(m.out_channels) if is_plain_conv2d(m) else linear_dims(m)[1]


class LoneLayers(Family):
    """Every large linear / plain conv layer left whole for want of a partner: split by output features, output
    all-gathered (`colwise_rep`), or whole."""

    name = "lone_layers"

    def propose(self, draft: Draft, found) -> Iterator[Proposal]:
        a = draft.analysis
        if a.trace is None or draft.world_size == 1:
            return
        heads = set(lm_heads(a, draft.world_size))
        layers = {n: m for n, m in a.leaves.items() if (is_linear(m) or is_plain_conv2d(m)) and n not in heads}
        if not layers:
            return
        floor = max(_size(m) for m in layers.values()) / GATHER_FRACTION
        for name, m in layers.items():
            if _size(m) < floor or _outputs(m) < draft.world_size or not draft.pairless(name) \
                    or self._held(draft, name):
                continue
            # what stopped the pairing: a family's reason or the trace's note (a traced layer has no other default)
            why = draft.reasons.get(name) or draft.analysis.notes.get(name) or NO_PARTNER
            split = Choice("split, output gathered", {name: COLWISE_REP}, reasons={name: why + ALONE},
                           note=f"{name}: {why}{ALONE}")
            yield Proposal(self.name, name, (split, Choice("whole", {name: REPLICATE}, reasons={name: why})))

    @staticmethod
    def _held(draft: Draft, name: str) -> bool:
        """Whether something besides the missing partner keeps `name` whole (see the module docstring)."""
        a, t = draft.analysis, draft.analysis.trace
        if name not in t.calls or name in t.read_directly or a.ties.get(name):
            return True
        parts = name.split(".")
        outer = (".".join(parts[:i]) for i in range(len(parts)))
        if any(draft.style_object(o).container or draft.style_object(o).region for o in outer):
            return True
        sources = {s for call in t.calls[name] if call.input_tag is not None for s in call.input_tag.sources}
        return any(draft.style_object(s).split_output for s in sources)
