"""Step 2 of conversion (plan): from a structure `Analysis` to a `Plan` for a world size.

The pairs found in the trace become column- and row-wise entries (unless their heads or widths do not fit the
world size); the LM head is a large linear layer whose output leaves the model; embeddings split over the
vocabulary when large or tied to the head; everything else is replicated, with the reason.
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping

from torch import nn

from .experts import plan_experts
from .fastpath import direct_read_reason
from ..layout import HeadLayoutError, head_layout
from .modules import is_conv2d, is_embedding, is_feature_norm, is_linear, is_per_channel, kind, linear_dims
from .mha import MULTIHEAD_ATTENTION, unsupported
from .per_head import PER_HEAD
from .plan import Plan
from .styles import (CHANNELWISE, COLWISE, COLWISE_REP, EMBEDDING_ROWWISE, REPLICATE, REPLICATED_WITH_GRAD_ALLREDUCE,
                     ROWWISE, VOCAB_PARALLEL, VOCAB_STYLES)
from .structure import Analysis, analyze_structure


def _lm_heads(a: Analysis, world_size: int) -> list[str]:
    t = a.trace
    out = []
    for name in sorted(t.escaped):
        m = a.leaves.get(name)
        if m is None or not is_linear(m) or name in a.structures:
            continue
        n_out = linear_dims(m)[1]
        vocab = getattr(getattr(a.model, "config", None), "vocab_size", None)
        if vocab is not None:
            big = n_out == vocab or name in a.ties
        else:
            # Without a config: a vocabulary-like fan-out (many more outputs than inputs) that weighs something.
            big = name in a.ties or (n_out >= 2 * linear_dims(m)[0] and m.weight.numel() >= 0.05 * a.total_params)
        if n_out >= max(world_size, 2) and big:
            out.append(name)
    return out


def computes_own_loss(model) -> bool:
    """A Hugging Face model whose forward computes its loss other than through `self.loss_function` as a
    causal LM (masked LM, seq2seq: inline `CrossEntropyLoss` over `view(-1, vocab)`), which vocabulary-split
    logits would crash or, worse, feed wrong. Causal LMs get tpkit's loss (`losses.py`); other models keep the
    documented split logits for `vocab_parallel_cross_entropy`."""
    if not isinstance(getattr(type(model), "loss_function", None), property):
        return False
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return True
    return "self.loss_function" not in source or getattr(model, "loss_type", None) not in (None, "ForCausalLM")


def auto_plan(a: Analysis, world_size: int, mode: str = "inference") -> Plan:
    """The automatic plan for `world_size` ranks from a structure analysis."""
    if mode not in ("inference", "training"):
        raise ValueError(f"plan: mode must be 'inference' or 'training', got {mode!r}")
    entries: dict[str, str] = {}
    details: dict[str, dict] = {}
    reasons: dict[str, str] = {}
    if a.trace is None:
        for name in a.leaves:
            reasons[name] = f"the model's forward could not be traced ({a.trace_error}); pass example_inputs"
        return Plan({n: REPLICATE for n in a.leaves}, world_size=world_size, mode=mode, reasons=reasons,
                    prefix=a.prefix)
    blockers = _blockers(a, world_size)
    for pair, why in zip(a.pairs, blockers):
        names = pair["columns"] + [pair["row"]] + pair["carried"] + pair.get("per_head", [])
        if why:
            for n in names:
                entries[n] = REPLICATE
                reasons[n] = why
            continue
        for n in pair["columns"]:
            entries[n] = COLWISE
            details[n] = a.structures[n]
        entries[pair["row"]] = ROWWISE
        details[pair["row"]] = a.structures[pair["row"]]
        for n in pair["carried"]:
            # BatchNorm between convs holds its channels; a per-head norm stays whole, its gradient summed.
            entries[n] = REPLICATED_WITH_GRAD_ALLREDUCE if pair["kind"] == "attention" else CHANNELWISE
            details[n] = a.structures[n]
        for n in pair.get("per_head", []):
            entries[n] = PER_HEAD
            details[n] = a.structures[n]
    _multihead_attention(a, world_size, entries, details, reasons)
    heads = [h for h in _lm_heads(a, world_size) if h not in a.trace.read_directly]
    own_loss = mode == "training" and computes_own_loss(a.model)
    for h in heads:
        entries[h] = VOCAB_PARALLEL if mode == "training" and not own_loss else COLWISE_REP
        if own_loss:
            reasons[h] = (f"logits gathered in training: {type(a.model).__name__}.forward computes its loss from full "
                          f"logits itself, which split logits would break")
    for name, m in a.leaves.items():
        if name in entries or not is_embedding(m):
            continue
        if name in a.trace.read_directly:
            reasons[name] = direct_read_reason(name, a.trace.read_directly[name])
            continue
        if name in a.notes:  # a per-head tensor of attention that stays whole
            reasons[name] = a.notes[name]
            continue
        tied_to_head = any(o in heads for o in a.ties.get(name, []))
        vocab = getattr(getattr(a.model, "config", None), "vocab_size", None)
        share = m.weight.numel() / max(a.total_params, 1)
        if m.num_embeddings < world_size:
            reasons[name] = f"{m.num_embeddings} rows cannot be split over {world_size} ranks"
        elif tied_to_head or m.num_embeddings == vocab or (vocab is None and share >= 0.05):
            entries[name] = EMBEDDING_ROWWISE
        else:
            reasons[name] = (f"not the vocabulary ({share:.1%} of parameters, {m.num_embeddings} rows): splitting it "
                             f"would add an all-reduce per forward for little memory")
    plan_experts(a.model, a.leaves, world_size, entries, reasons)  # mixture-of-experts layers (experts.py)
    _settle_ties(a, entries, reasons)
    for name, m in a.leaves.items():
        if name not in entries:
            entries[name] = REPLICATE
            reasons.setdefault(name, _replicate_reason(a, name, m))
    return Plan(entries, world_size=world_size, mode=mode, details=details, reasons=reasons, prefix=a.prefix)


def _multihead_attention(a: Analysis, world_size: int, entries: dict, details: dict, reasons: dict) -> None:
    """Every `nn.MultiheadAttention` run in the forward is split by heads (mha.py) when it reads its out_proj
    itself (and nothing else does) and its heads divide; otherwise its out_proj stays whole, with the reason."""
    for name, m in a.model.named_modules():
        out = f"{name}.out_proj"
        if not name or type(m) is not nn.MultiheadAttention or name not in a.trace.module_inputs:
            continue
        why = unsupported(m)
        if why is None and a.trace.readers.get(out) != name:
            why = f"{out} is not read by {name}'s own forward alone"
        if why is None:
            try:
                head_layout(m.num_heads, m.num_heads, world_size, name)
            except HeadLayoutError as exc:
                why = str(exc)
        if why:
            reasons[out] = f"{name} stays whole: {why}"
            continue
        common = {"pair": "attention", "attention": name, "head_dim": m.head_dim, "num_heads": m.num_heads,
                  "num_kv_heads": m.num_heads}
        entries[name], details[name] = MULTIHEAD_ATTENTION, dict(common, role="qkv")
        entries[out], details[out] = ROWWISE, dict(common, role="o")
        reasons.pop(out, None)


def _blockers(a: Analysis, world_size: int) -> list[str | None]:
    """Per pair, why it stays whole (None: split). A per-head tensor serving several attention blocks (T5's
    position bias) is split with all of them or none: one blocked block, or one that failed to pair, or
    blocks with other head counts keep every block it reaches whole."""
    out = [_pair_blocker(a, p, world_size) for p in a.pairs]
    for src in {s for p in a.pairs for s in p.get("per_head", [])}:
        users = [i for i, p in enumerate(a.pairs) if src in p.get("per_head", [])]
        heads = {(a.pairs[i]["num_heads"], a.pairs[i]["num_kv_heads"]) for i in users}
        why = next((out[i] for i in users if out[i]), None) or (a.notes.get(src) and
                                                              f"{src} also reaches attention that stays whole: "
                                                              f"{a.notes[src]}")
        if why is None and len(heads) > 1:
            why = f"{src} serves attention blocks with different head counts {sorted(heads)}"
        if why:
            for i in users:
                out[i] = out[i] or f"shares the per-head tensor {src} with attention that stays whole ({why})"
    return out


def _pair_blocker(a: Analysis, pair: dict, world_size: int) -> str | None:
    read = [n for n in pair["columns"] + [pair["row"]] if n in a.trace.read_directly]
    if read:
        return f"{read[0]}: {direct_read_reason(read[0], a.trace.read_directly[read[0]])}"
    if pair["kind"] == "attention":
        try:
            head_layout(pair["num_heads"], pair["num_kv_heads"], world_size, pair["attention"])
        except HeadLayoutError as exc:
            return str(exc)
        return None
    row = a.leaves[pair["row"]]
    width = row.in_channels if is_conv2d(row) else linear_dims(row)[0]
    if width < world_size:
        return f"{pair['row']} has {width} input features, fewer than {world_size} ranks"
    return None


def _settle_ties(a: Analysis, entries: dict, reasons: dict) -> None:
    """Tied weights must be split the same way (over the vocabulary) or all stay replicated."""
    for name, others in a.ties.items():
        group = [name] + others
        styles = {entries.get(n, REPLICATE) for n in group}
        if styles <= VOCAB_STYLES or styles == {REPLICATE}:
            continue
        for n in group:
            entries[n] = REPLICATE
            reasons[n] = f"weight tied with {[o for o in group if o != n]}, which cannot be split the same way"


def _replicate_reason(a: Analysis, name: str, m: nn.Module) -> str:
    if name in a.trace.read_directly:
        return direct_read_reason(name, a.trace.read_directly[name])
    if name not in a.trace.calls:
        return "not run in the traced forward"
    if name in a.notes:
        return a.notes[name]
    if is_feature_norm(m):
        return "normalises over all features, so it needs the whole vector (small; replicated)"
    if is_per_channel(m):
        return "per-channel layer not between a column and a row conv"
    if is_embedding(m):
        return "embedding not split"
    if is_linear(m) and name in a.trace.escaped:
        return "its output leaves the model and it is small; replicating avoids a gather"
    if is_linear(m) or is_conv2d(m):
        return "no column -> row partner found in the dataflow"
    return f"{kind(m)}: no rule splits this layer type"


def plan(model: nn.Module, world_size: int, *, mode: str = "inference", example_inputs: Any = None,
         overrides: Mapping[str, str] | Plan | None = None, analysis: Analysis | None = None) -> Plan:
    """The tensor-parallel plan for `model` on `world_size` ranks (module name -> style; see `Plan`).

    `mode="training"` keeps the LM head's logits split over the vocabulary (pair it with
    `tpkit.nn.vocab_parallel_cross_entropy`); inference gathers them. `overrides` (a mapping or a Plan)
    take precedence over the automatic entries. The plan never depends on an HF config's
    `base_model_tp_plan`; `analyze` reports where that hint and this plan disagree.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"plan: world_size must be a positive int, got {world_size!r}")
    a = analysis or analyze_structure(model, example_inputs)
    result = auto_plan(a, world_size, mode)
    if overrides:
        over = overrides if isinstance(overrides, Plan) else Plan.from_dict(overrides)
        over.prefix = over.prefix or a.prefix
        over.resolve(a.leaves)  # entries naming no module raise here
        result = result.updated(over)
    return result
