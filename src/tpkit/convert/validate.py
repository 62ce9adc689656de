"""The checks of `parallelize`'s steps 4 and 7 (validate): what no single module can check alone.

Each planned module's style checks the traced dataflow around it (`Style.check_dataflow`: a split output must
reach only layers that take a split input, and vice versa), tied weights must be split the same way, and every
registered family checks the plan as a whole (`Family.validate`: per-head norms, layers read directly, the
sequence-parallel region), returning what it settled for the swap. Everything here only reads; a failure is a
PlanError before any module is changed.
"""
from __future__ import annotations

from typing import Mapping

from .errors import PlanError
from .family import Checked, Planned
from .registry import families, style
from .styles import REPLICATE, VOCAB_STYLES


def validate(planned: Planned) -> dict[str, Checked]:
    """Check the plan as a whole; returns what each family settled (by family name). Without a trace on purpose
    (`Analysis.untraced`) the styles' dataflow checks are not made: they were, where the plan was made; a trace that
    failed leaves each style to refuse what it cannot check."""
    if not planned.analysis.untraced:
        for name, s in planned.styles.items():
            style(s).check_dataflow(name, planned, planned.style_object)
    check_ties(planned)
    out = {}
    for family in families():
        checked = family.validate(planned)
        if checked is not None:
            out[family.name] = checked
    return out


def check_ties(planned: Planned) -> None:
    """Tied weights: all split over the vocabulary the same way, or all replicated."""
    for name, others in planned.analysis.ties.items():
        group = sorted([name] + others)
        got: Mapping[str, str] = {n: planned.style_of(n) for n in group}
        kinds = set(got.values())
        if kinds == {REPLICATE} or kinds <= VOCAB_STYLES:
            continue
        raise PlanError(f"conflicting entries: {group} share one weight but are planned {got}; tied weights must "
                        f"all be split over the vocabulary (embedding_rowwise with colwise_rep / vocab_parallel) "
                        f"or all 'replicate'")
