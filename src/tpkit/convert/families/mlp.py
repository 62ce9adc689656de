"""MLP and conv pairs: the column-wise layers' outputs stay split until the row-wise layer sums them (one
all-reduce per pair); a BatchNorm between two convs holds its rank's channels.

The trace finds the pairs (`trace/pairs.py`); a pair stays whole when one of its layers must (an earlier family
keeps it whole) or when the row-wise layer has fewer input features than ranks.
"""
from __future__ import annotations

from ..family import Choice, Draft, Family, Proposal, whole_choice
from ..modules import is_conv2d, linear_dims
from ..roles import ATTENTION, Pair
from ..styles import CHANNELWISE, COLWISE, ROWWISE
from .attention import REPLICATED_WITH_GRAD_ALLREDUCE
from .gathered_norms import GATHERED_NORM, norms_blocker


class FeaturePairs(Family):
    name = "mlp"

    def detect(self, analysis) -> tuple[Pair, ...]:
        return tuple(p for p in analysis.pairs if p.kind != ATTENTION)

    def propose(self, draft: Draft, found: tuple[Pair, ...]) -> list[Proposal]:
        out = []
        for pair in found:
            layers = pair.columns + (pair.row,)
            whole = draft.whole(layers)
            if whole is None and draft.claimed(layers):
                continue  # an earlier family planned these layers
            why = f"{whole[0]}: {whole[1]}" if whole else (_width_blocker(draft, pair) or norms_blocker(draft, pair))
            if why:
                out.append(Proposal(self.name, pair.row, (whole_choice(pair.members, why, unpaired=True),)))
                continue
            a = draft.analysis
            split = Choice("split", {**{n: COLWISE for n in pair.columns}, pair.row: ROWWISE,
                                     **{n: _carried_style(a.structures[n]) for n in pair.carried},
                                     **{n: GATHERED_NORM for n in pair.norms}},
                           details={n: a.structures[n] for n in pair.columns + (pair.row,) + pair.carried + pair.norms})
            kept = whole_choice(pair.members, f"kept whole by the chosen setup (the pair splits at {draft.world_size} ranks)")
            out.append(Proposal(self.name, pair.row, (split, kept)))
        return out


def _carried_style(role) -> str:
    """A BatchNorm between the layers holds its rank's channels; an activation with scalar parameters stays whole,
    its gradient summed (each rank's covers its own features)."""
    return REPLICATED_WITH_GRAD_ALLREDUCE if role.role == "elementwise" else CHANNELWISE


def _width_blocker(draft: Draft, pair: Pair) -> str | None:
    row = draft.analysis.leaves[pair.row]
    width = row.in_channels if is_conv2d(row) else linear_dims(row)[0]
    if width < draft.world_size:
        return f"{pair.row} has {width} input features, fewer than {draft.world_size} ranks"
    return None
