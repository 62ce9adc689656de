"""Step 4 of `parallelize` (validate): what no single module can check alone.

A split output must reach only layers that take a split input and vice versa (the traced dataflow), layers
sharing one weight must be split the same way, and sequence parallelism needs a region of per-token layers
between the row- and column-wise ones. Everything here only reads; a failure is a PlanError before any
module is changed.
"""
from __future__ import annotations

from typing import Mapping

from .errors import PlanError
from .fastpath import check_direct_reads
from .per_head import PER_HEAD
from .structure import Analysis
from .styles import (CHANNELWISE, COLWISE, REPLICATE, REPLICATED_WITH_GRAD_ALLREDUCE, ROWWISE, SEQUENCE_PARALLEL,
                     VOCAB_STYLES)


def validate(analysis: Analysis, styles: dict[str, str], world: int, sequence_parallel: bool):
    """Check the plan as a whole; returns the sequence-parallel region (or None) and marks its norms
    `sequence_parallel` in `styles`."""
    for name, s in styles.items():
        if s == REPLICATED_WITH_GRAD_ALLREDUCE and (analysis.trace is None or name not in analysis.trace.head_local):
            raise PlanError(f"{name}: style 'replicated_with_grad_allreduce' is for per-head layers (q/k norms) "
                            f"between split q/k projections and their row-wise output layer; the trace does not "
                            f"show {name} as one")
        if analysis.trace is not None and world > 1:
            check_dataflow(name, s, analysis, styles)
    check_ties(analysis, styles)
    if analysis.trace is not None and world > 1:
        check_direct_reads(analysis.trace.read_directly, styles, analysis.trace.readers)
    if not ((sequence_parallel or SEQUENCE_PARALLEL in styles.values()) and world > 1):
        return None
    from .sequence import find_region

    region = find_region(analysis, styles)
    stray = [n for n, s in styles.items() if s == SEQUENCE_PARALLEL and n not in region.norms]
    if stray:
        raise PlanError(f"plan: {stray} are styled 'sequence_parallel' but are not per-token layers on the "
                        f"sequence-split residual stream (that region holds {region.norms[:4]}...)")
    for n in region.norms:
        styles[n] = SEQUENCE_PARALLEL
    return region


def _style(styles: Mapping[str, str], name: str) -> str:
    return styles.get(name, REPLICATE)


def check_dataflow(name: str, s: str, a: Analysis, styles: Mapping[str, str]) -> None:
    """A split output must reach only layers that take a split input, and vice versa."""
    t = a.trace
    if s == COLWISE and name in t.calls:
        _check_column_users(name, a, styles)
    if s == ROWWISE and name in t.calls:
        tag = t.first(name).input_tag
        srcs = sorted(tag.sources) if tag is not None else []
        bad = [x for x in srcs if _style(styles, x) not in (COLWISE, CHANNELWISE, PER_HEAD)]
        if bad or not srcs:
            raise PlanError(f"conflicting entries: {name} is 'rowwise' (it takes a split input) but its input comes "
                            f"from {bad or 'no layer'}, which give(s) the whole vector; use 'rowwise_rep' or make "
                            f"them 'colwise'")
    if s == PER_HEAD:
        bad = sorted(u for u in t.consumers.get(name, set()) if _style(styles, u) != ROWWISE)
        if bad or name in t.escaped:
            raise PlanError(f"conflicting entries: {name} is 'per_head' (it holds this rank's heads only) but it "
                            f"reaches {bad or '<model output>'}, which take(s) all heads; plan it 'replicate'")
    if s == CHANNELWISE and name in t.carried_by:
        bad = [x for x in t.carried_by[name] if _style(styles, x) != COLWISE]
        if bad:
            raise PlanError(f"conflicting entries: {name} is 'channelwise' but its input comes from {bad}, which "
                            f"is not 'colwise'")


def _check_column_users(name: str, a: Analysis, styles: Mapping[str, str]) -> None:
    t = a.trace
    users = t.consumers.get(name, set())
    bad = sorted(u for u in users if _style(styles, u) not in (ROWWISE, CHANNELWISE))
    if name in t.escaped:
        bad.append("<model output>")
    if bad or not users:
        raise PlanError(f"conflicting entries: {name} is 'colwise' (its output stays split) but its output "
                        f"feeds {bad or 'no layer'}, which take(s) the whole vector; make those 'rowwise' or "
                        f"{name} 'replicate'/'colwise_rep'")
    for h, sources in t.head_local.items():
        if name in sources and _style(styles, h) != REPLICATED_WITH_GRAD_ALLREDUCE:
            raise PlanError(f"conflicting entries: {name} is 'colwise' and its heads pass through the per-head "
                            f"layer {h}, which must then be 'replicated_with_grad_allreduce' (its gradient is "
                            f"a sum over the ranks' heads), not {_style(styles, h)!r}")
    shared = a.structures.get(name, {})
    for other in a.structures.get(shared.get("row", ""), {}).get("columns", []):
        if _style(styles, other) != COLWISE:
            raise PlanError(f"conflicting entries: {name} is 'colwise' but {other}, which feeds the same "
                            f"row-wise layer {shared['row']}, is {_style(styles, other)!r}")


def check_ties(a: Analysis, styles: Mapping[str, str]) -> None:
    """Tied weights: all split over the vocabulary the same way, or all replicated."""
    for name, others in a.ties.items():
        group = sorted([name] + others)
        got = {n: _style(styles, n) for n in group}
        kinds = set(got.values())
        if kinds == {REPLICATE} or kinds <= VOCAB_STYLES:
            continue
        raise PlanError(f"conflicting entries: {group} share one weight but are planned {got}; tied weights must "
                        f"all be split over the vocabulary (embedding_rowwise with colwise_rep / vocab_parallel) "
                        f"or all 'replicate'")
