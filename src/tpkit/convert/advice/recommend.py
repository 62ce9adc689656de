"""`analyze`'s recommendations: what a user should know about the plan it shows, in sentences.

Read from the traced structure and the plans at each world size; nothing here changes a plan.
"""
from __future__ import annotations

from typing import Any

from ...layout import valid_world_sizes
from ...tables import format_bytes as human
from ..plan import Plan
from ..planning.planner import propose
from ..trace import Analysis


def _heads_text(pair, n: int) -> str:
    """The attention heads each of `n` ranks holds, as the converter lays them out (`Pair.heads`)."""
    lay = pair.heads(n)
    q = [len(h) for h in lay.q_heads]
    out = f"attention heads at {n} ranks: {lay.counts()}"
    if lay.kv_replicated:
        why = (f"{pair.num_kv_heads} KV heads < world size {n}" if pair.num_kv_heads < n
               else "some KV heads are read by query heads of two ranks")
        out += (f"; {why}: such KV heads are replicated on the ranks that read them (k/v projections hold "
                f"{sum(len(k) for k in lay.kv_heads)} KV heads in all for {pair.num_kv_heads}; their gradients are "
                f"summed across those ranks; the KV cache grows with them)")
    if len(set(q)) > 1:
        out += f"; the ranks with {max(q)} query heads set the step time; world sizes dividing {pair.num_heads} " \
               f"balance the work"
    return out


def recommendations(a: Analysis, plans: dict, plan, shown: int, report: Any) -> list[str]:
    """What `analyze` advises for the plan shown (`report`: its AnalysisReport): heads per rank, what stays
    replicated, the vocabulary split, sequence parallelism, how the config's own TP plan differs."""
    recs: list[str] = []
    if a.trace is None:
        recs.append(f"the forward could not be traced ({a.trace_error}), so every layer is replicated; pass "
                    f"example_inputs=... that the model's forward accepts")
        return recs
    attn = [p for p in a.pairs if p.kind == "attention"]
    if attn:
        p0 = attn[0]
        nh, nkv = p0.num_heads, p0.num_kv_heads
        blocked = [w for w, pl in plans.items() if pl.entries.get(p0.row) == "replicate" and w > 1]
        if blocked:
            recs.append(f"attention ({nh} query / {nkv} KV heads) stays replicated at world sizes {blocked}: "
                        f"{plans[blocked[0]].reasons.get(p0.row, '')}; world sizes that split it: "
                        f"{valid_world_sizes(nh, nkv, 64, spread=bool(p0.kv_expand))}")
        if shown > 1 and plan.entries.get(p0.row) == "rowwise":
            recs.append(_heads_text(p0, shown))
        recs.append(f"{len(attn)} attention blocks and {len(a.pairs) - len(attn)} MLP pairs split as column -> "
                    f"row: one all-reduce per block in the forward (one more in the backward)")
    elif a.pairs:
        recs.append(f"{len(a.pairs)} column -> row pairs found: one all-reduce each in the forward")
    heads = [n for n, s in plan.entries.items() if s in ("colwise_rep", "vocab_parallel")]
    for h in heads:
        m = a.leaves[h]
        vocab = m.weight.shape[0] if not hasattr(m, "nf") else m.weight.shape[1]
        if vocab % shown:
            recs.append(f"{h}: vocabulary {vocab} does not divide by {shown}; ranks hold "
                        f"{-(-vocab // shown)} or {vocab // shown} rows (exact, but padding the vocabulary to a "
                        f"multiple of {shown * 64} would even them out)")
        if plan.mode == "inference":
            recs.append(f"{h} gathers full logits (an all-gather of batch x seq x {vocab} per step); for training "
                        f"use mode='training' to keep them split and tpkit.nn.vocab_parallel_cross_entropy")
        if h in a.ties:
            recs.append(f"{h} shares its weight with {a.ties[h]}: both are split over the vocabulary with the same "
                        f"rows and stay tied")
    replicated = [r for r in report.layers if r.style == "replicate" and r.params]
    rep_bytes = sum(r.bytes for r in replicated)
    if report.total_bytes and rep_bytes / report.total_bytes > 0.2:
        big = sorted(replicated, key=lambda r: -r.bytes)[:3]
        recs.append(f"{100 * rep_bytes / report.total_bytes:.0f}% of parameter bytes stay replicated; largest: "
                    + "; ".join(f"{r.name} ({human(r.bytes)}: {r.reason})" for r in big))
    elif replicated:
        recs.append(f"replicated: {len(replicated)} small layers ({human(rep_bytes)}, "
                    f"{100 * rep_bytes / max(report.total_bytes, 1):.1f}% of bytes), mostly norms")
    on = _sequence_parallel_alternative(a, shown, plan.mode)
    if on is not None:
        recs.append(f"parallelize(..., sequence_parallel=True) would {on.note}: their activations shrink {shown}x; "
                    f"sequence length must be a multiple of {shown}")
    hint = getattr(getattr(a.model, "config", None), "base_model_tp_plan", None)
    if hint:
        try:
            hp = Plan(hint, prefix=a.prefix)
            differ = [n for n in a.leaves if (hp.style_for(n) or "replicate") != plan.entries.get(n, "replicate")
                      and hp.style_for(n) is not None]
        except Exception:  # noqa: BLE001 - an HF hint we cannot read is only a hint
            differ = []
        if differ:
            recs.append(f"the config's base_model_tp_plan differs from tpkit's plan on {len(differ)} layers "
                        f"(e.g. {differ[0]}: {hp.style_for(differ[0])} vs {plan.entries.get(differ[0])})")
    return recs


def _sequence_parallel_alternative(a: Analysis, world: int, mode: str):
    """The planner's "sequence parallel on" alternative at this world size (a `Choice`), or None."""
    if mode != "training" or world == 1:
        return None
    _, proposals = propose(a, world, mode)
    return next((c for p in proposals if p.key == "sequence_parallel" for c in p.choices if c.label == "on"), None)
