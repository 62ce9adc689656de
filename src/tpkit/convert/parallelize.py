"""`parallelize(model, plan, comm)`: swap a model's layers for this rank's `tpkit.nn` shards, in place.

Everything is checked and every new layer is built before the first module is swapped, so an error leaves
the model exactly as it was. After the swap: attention modules see their local head counts, tied weights
are tied again (both sides split over the vocabulary the same way), and `model.tp_plan` records the plan.
"""
from __future__ import annotations

import copy
import functools
import inspect
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ..nn._layer import check_module
from ..nn.embedding import UNSUPPORTED_EMBEDDING_OPTIONS
from .heads import HeadLayoutError, head_layout
from .modules import is_conv2d, is_embedding, is_linear, is_per_channel, is_plain_conv2d, kind, linear_dims
from .plan import CONTAINER_NO_OPS, Plan, PlanError
from .planner import NUM_HEADS_ATTRS, NUM_KV_ATTRS, Analysis, analyze_structure, auto_plan
from .shard import build_channelwise, build_column, build_row, column_rows

WIDTH_ATTRS = ("all_head_size", "embed_dim", "split_size", "inner_dim", "hidden_size", "kdim", "vdim")
COLUMN_STYLES = {"colwise", "colwise_rep", "vocab_parallel"}
ROW_STYLES = {"rowwise", "rowwise_rep"}


def resolve_plan(model: nn.Module, plan: Any, world_size: int, analysis: Analysis, mode: str) -> Plan:
    """`plan` as a Plan: "auto", a Plan (used as is), a JSON path, or a mapping of user entries (which
    override the automatic plan)."""
    if isinstance(plan, str) and plan == "auto":
        return auto_plan(analysis, world_size, mode)
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    if isinstance(plan, Plan):
        return plan.updated({})  # a copy: the caller's plan is not filled in with details
    if isinstance(plan, Mapping):
        user = Plan.from_dict(plan)
        user.prefix = user.prefix or analysis.prefix
        user.resolve(_names(model))
        if "entries" in plan:
            return user
        return auto_plan(analysis, world_size, mode).updated(user)
    raise PlanError(f"parallelize: plan must be 'auto', a Plan, a mapping or a JSON path, got {type(plan).__name__}")


def _names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_modules() if n]


def _check(name: str, m: nn.Module, style: str, details: dict, world: int, a: Analysis, styles: dict) -> None:
    """Raise PlanError if `style` cannot be applied to module `m` (type, sizes, heads, dataflow)."""
    where = f"{name} ({kind(m)})"
    if style in COLUMN_STYLES | ROW_STYLES:
        if not (is_linear(m) or is_plain_conv2d(m)):
            raise PlanError(f"{where}: style {style!r} needs a Linear, Conv1D or Conv2d (groups=1)")
        if is_conv2d(m):
            split = m.out_channels if style in COLUMN_STYLES else m.in_channels
        else:
            n_in, n_out = linear_dims(m)
            split = n_out if style in COLUMN_STYLES else n_in
        if split < world:
            raise PlanError(f"{where}: {split} features cannot be split over {world} ranks; use 'replicate' or a "
                            f"world size <= {split}")
        if details.get("pair") == "attention":
            try:
                head_layout(details["num_heads"], details["num_kv_heads"], world, details.get("attention", name))
            except HeadLayoutError as exc:
                raise PlanError(f"{where}: {exc}; mark this attention block 'replicate' instead") from None
    elif style in ("embedding_rowwise", "embedding_colwise"):
        if not is_embedding(m):
            raise PlanError(f"{where}: style {style!r} needs an nn.Embedding")
        n = m.num_embeddings if style == "embedding_rowwise" else m.embedding_dim
        if n < world:
            raise PlanError(f"{where}: {n} rows/features cannot be split over {world} ranks")
        try:  # the layer's own rule for which embeddings it can shard
            check_module(f"{where}: {style}", m, nn.Embedding, UNSUPPORTED_EMBEDDING_OPTIONS)
        except (TypeError, ValueError) as exc:
            raise PlanError(f"{exc}; plan it 'replicate'") from None
    elif style == "replicated_with_grad_allreduce":
        t = a.trace
        if t is None or name not in t.head_local:
            raise PlanError(f"{where}: style 'replicated_with_grad_allreduce' is for per-head layers (q/k norms) "
                            f"between split q/k projections and their row-wise output layer; the trace does not "
                            f"show {name} as one")
    elif style == "channelwise":
        if not is_per_channel(m):
            raise PlanError(f"{where}: style 'channelwise' needs a BatchNorm")
        if m.num_features < world:
            raise PlanError(f"{where}: {m.num_features} channels cannot be split over {world} ranks")
    if a.trace is not None and world > 1:
        _check_dataflow(name, m, style, a, styles)


def _check_dataflow(name: str, m: nn.Module, style: str, a: Analysis, styles: dict) -> None:
    """A split output must reach only layers that take a split input, and vice versa."""
    t = a.trace
    if style == "colwise" and name in t.calls:
        users = t.consumers.get(name, set())
        bad = sorted(u for u in users if styles.get(u, "replicate") not in ("rowwise", "channelwise"))
        if name in t.escaped:
            bad.append("<model output>")
        if bad or not users:
            raise PlanError(f"conflicting entries: {name} is 'colwise' (its output stays split) but its output "
                            f"feeds {bad or 'no layer'}, which take(s) the whole vector; make those 'rowwise' or "
                            f"{name} 'replicate'/'colwise_rep'")
        for h, sources in t.head_local.items():
            if name in sources and styles.get(h, "replicate") != "replicated_with_grad_allreduce":
                raise PlanError(f"conflicting entries: {name} is 'colwise' and its heads pass through the per-head "
                                f"layer {h}, which must then be 'replicated_with_grad_allreduce' (its gradient is "
                                f"a sum over the ranks' heads), not {styles.get(h, 'replicate')!r}")
        shared = a.structures.get(name, {})
        for other in a.structures.get(shared.get("row", ""), {}).get("columns", []):
            if styles.get(other, "replicate") != "colwise":
                raise PlanError(f"conflicting entries: {name} is 'colwise' but {other}, which feeds the same "
                                f"row-wise layer {shared['row']}, is {styles.get(other, 'replicate')!r}")
    if style == "rowwise" and name in t.calls:
        tag = t.first(name).input_tag
        srcs = sorted(tag.sources) if tag is not None else []
        bad = [s for s in srcs if styles.get(s, "replicate") not in ("colwise", "channelwise")]
        if bad or not srcs:
            raise PlanError(f"conflicting entries: {name} is 'rowwise' (it takes a split input) but its input comes "
                            f"from {bad or 'no layer'}, which give(s) the whole vector; use 'rowwise_rep' or make "
                            f"them 'colwise'")
    if style == "channelwise" and name in a.trace.carried_by:
        bad = [s for s in a.trace.carried_by[name] if styles.get(s, "replicate") != "colwise"]
        if bad:
            raise PlanError(f"conflicting entries: {name} is 'channelwise' but its input comes from {bad}, which "
                            f"is not 'colwise'")


def _build(name: str, m: nn.Module, style: str, details: dict, comm, seq: bool = False) -> nn.Module | None:
    from ..nn import ParallelEmbedding, VocabParallelEmbedding

    if style in ("replicate", "replicated_with_grad_allreduce", "sequence_parallel") or style in CONTAINER_NO_OPS:
        return None
    if is_embedding(m):
        if style == "embedding_rowwise":
            return VocabParallelEmbedding.from_module(m, comm)
        return ParallelEmbedding.from_module(m, comm)
    if style == "colwise":
        return build_column(m, details, comm, sequence_parallel=seq)
    if style == "colwise_rep":
        return build_column(m, {}, comm, gather=True)
    if style == "vocab_parallel":
        return build_column(m, {}, comm, sequence_parallel=seq)
    if style == "rowwise":
        return build_row(m, details, comm, sequence_parallel=seq)
    if style == "rowwise_rep":
        return build_row(m, {}, comm, input_is_parallel=False)
    if style == "channelwise":
        return build_channelwise(m, comm)
    raise PlanError(f"{name}: no builder for style {style!r}")


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _attention_updates(model: nn.Module, plan: Plan, styles: dict, world: int, rank: int) -> dict[str, dict]:
    """New values of the head-count / width attributes that attention modules read, per module."""
    updates: dict[str, dict] = {}
    for name, style in styles.items():
        d = plan.details.get(name, {})
        if style != "rowwise" or d.get("pair") != "attention":
            continue
        attn_name = d["attention"]
        attn = model.get_submodule(attn_name) if attn_name else model
        lay = head_layout(d["num_heads"], d["num_kv_heads"], world, attn_name)
        nh, nkv, hd = d["num_heads"], d["num_kv_heads"], d["head_dim"]
        nh_l, nkv_l = len(lay.q_heads[rank]), len(lay.kv_heads[rank])
        new = {}
        for attr in NUM_HEADS_ATTRS:
            if getattr(attn, attr, None) == nh:
                new[attr] = nh_l
        for attr in NUM_KV_ATTRS:
            if getattr(attn, attr, None) == nkv:
                new[attr] = nkv_l
        if isinstance(getattr(attn, "num_key_value_groups", None), int):
            new["num_key_value_groups"] = nh_l // nkv_l
        for attr in WIDTH_ATTRS:
            if getattr(attn, attr, None) == nh * hd and not isinstance(getattr(attn, attr), bool):
                new[attr] = nh_l * hd
        cfg = getattr(attn, "config", None)
        if cfg is not None and _forward_reads_config_heads(type(attn)):
            # Its forward reads head counts from the model-wide config (Phi-3: `config.num_attention_heads`):
            # give this module its own copy with the local counts; the shared config stays global.
            local = copy.copy(cfg)
            if getattr(cfg, "num_attention_heads", None) == nh:
                local.num_attention_heads = nh_l
            if getattr(cfg, "num_key_value_heads", None) == nkv:
                local.num_key_value_heads = nkv_l
            new["config"] = local
        updates[attn_name] = new
    return updates


@functools.lru_cache(maxsize=None)
def _forward_reads_config_heads(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "config.num_attention_heads" in source or "config.num_key_value_heads" in source


def parallelize(model: nn.Module, plan: Any = "auto", comm=None, *, mode: str = "inference",
                example_inputs: Any = None, sequence_parallel: bool = False) -> nn.Module:
    """Convert `model` in place to this rank's tensor-parallel shard and return it.

    `plan`: "auto" (the planner's), a `Plan` (applied as is), a path to a plan JSON, or a mapping of user
    entries `{module name or glob: style}` that override the automatic plan. `comm`: the tensor-parallel
    communicator (default `tpkit.get_communicator()`). `mode="training"` keeps LM-head logits split over
    the vocabulary (use `tpkit.nn.vocab_parallel_cross_entropy`). Works on meta-device models (shards
    stay meta, to be loaded later). Raises before changing anything when the plan cannot be applied.

    `sequence_parallel=True` (or plan entries styled "sequence_parallel") also splits the residual stream
    along the sequence between row- and column-wise layers (see `sequence.py`; training mode, sequence length
    a multiple of the world size; call `tpkit.nn.sync_sequence_parallel_grads(model)` after backward).
    """
    from ..nn._layer import resolve_comm

    comm = resolve_comm(comm)
    world, rank = comm.world_size, comm.rank
    done = [n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)]
    if done:
        raise PlanError(f"parallelize: the model already holds tensor-parallel shards (e.g. {done[0]}); it was "
                        f"converted before (see its tp_plan). Convert the original model once per rank")
    analysis = analyze_structure(model, example_inputs)
    the_plan = resolve_plan(model, plan, world, analysis, mode)
    names = _names(model)
    modules = dict(model.named_modules())
    styles = _embedding_styles(the_plan.resolve(names), modules)
    # User-written entries carry no head / packing facts: take them from the traced structure.
    for name, style in styles.items():
        if style in ("colwise", "rowwise") and name not in the_plan.details and name in analysis.structures:
            the_plan.details[name] = analysis.structures[name]
    # 1. Validate everything.
    for name, style in styles.items():
        m = modules[name]
        if name not in analysis.leaves and style not in CONTAINER_NO_OPS and style != "replicate":
            raise PlanError(f"plan: style {style!r} on {name} ({type(m).__name__}), which is a container; name its "
                            f"layers instead (e.g. {name}.*)")
        if name in analysis.leaves and style in CONTAINER_NO_OPS:
            raise PlanError(f"plan: style {style!r} is for container modules, not the layer {name}")
        _check(name, m, style, the_plan.details.get(name, {}), world, analysis, styles)
    _check_ties(analysis, styles)
    region = None
    if (sequence_parallel or "sequence_parallel" in styles.values()) and world > 1:
        from .sequence import find_region

        region = find_region(analysis, styles)
        stray = [n for n, s in styles.items() if s == "sequence_parallel" and n not in region.norms]
        if stray:
            raise PlanError(f"plan: {stray} are styled 'sequence_parallel' but are not per-token layers on the "
                            f"sequence-split residual stream (that region holds {region.norms[:4]}...)")
        for n in region.norms:
            styles[n] = "sequence_parallel"
    # 2. Build every new layer (the model is still untouched).
    built = {}
    seq = set(region.rows) if region else set()  # rows reduce-scatter; columns get gathered inputs
    for name, style in styles.items():
        if world == 1:
            break
        new = _build(name, modules[name], style, the_plan.details.get(name, {}), comm, name in seq)
        if new is not None:
            built[name] = new
    updates = _attention_updates(model, the_plan, styles, world, rank) if world > 1 else {}
    # 3. Swap, update attributes, re-tie, record.
    for name, new in built.items():
        _set_submodule(model, name, new)
    for attn_name, new in updates.items():
        attn = model.get_submodule(attn_name) if attn_name else model
        for attr, value in new.items():
            setattr(attn, attr, value)
    _retie(model, analysis, built)
    _repoint_shared_parameters(model, modules, built)
    if world > 1:
        for name, style in styles.items():
            if style == "replicated_with_grad_allreduce":
                _sum_grads_over_ranks(modules[name], comm)
    _install_vocab_parallel_loss(model, built, styles, comm)
    if region is not None:
        from ..nn import mark_sequence_parallel
        from .sequence import install_entry, install_gather

        install_entry(model, region.entry_block, comm, region.entry_arg)
        for n in region.norms:
            mark_sequence_parallel(modules[n])
        for n in region.gathered:
            install_gather(modules[n], comm)
    record = Plan({n: s for n, s in styles.items() if n in analysis.leaves}, world_size=world, mode=the_plan.mode,
                  details=the_plan.details, reasons=the_plan.reasons, prefix=the_plan.prefix)
    record.updated_attributes = updates
    record.sequence_parallel = region
    record.rank = rank
    _record(model, record)
    return model


def _embedding_styles(styles: dict[str, str], modules: dict[str, nn.Module]) -> dict[str, str]:
    """HF plans write 'rowwise' / 'colwise' on embeddings too (PyTorch's styles shard an embedding's weight by
    rows, the vocabulary, or by columns, its features); name them as the embedding styles they are, once, so
    every later check (ties, sizes, dataflow) sees one vocabulary."""
    return {n: f"embedding_{s}" if s in ("rowwise", "colwise") and is_embedding(modules[n]) else s
            for n, s in styles.items()}


def _check_ties(a: Analysis, styles: dict) -> None:
    vocab = {"embedding_rowwise", "colwise_rep", "vocab_parallel"}
    for name, others in a.ties.items():
        group = sorted([name] + others)
        got = {n: styles.get(n, "replicate") for n in group}
        kinds = set(got.values())
        if kinds == {"replicate"} or kinds <= vocab:
            continue
        raise PlanError(f"conflicting entries: {group} share one weight but are planned {got}; tied weights must "
                        f"all be split over the vocabulary (embedding_rowwise with colwise_rep / vocab_parallel) "
                        f"or all 'replicate'")


def _retie(model: nn.Module, a: Analysis, built: dict) -> None:
    done = set()
    for name, others in a.ties.items():
        group = sorted([name] + others)
        if group[0] in done or not any(n in built for n in group):
            continue
        done.add(group[0])
        owner = next((n for n in group if is_embedding(a.leaves[n])), group[0])
        weight = model.get_submodule(owner).weight
        for n in group:
            if n != owner:
                model.get_submodule(n).weight = weight


def _repoint_shared_parameters(model: nn.Module, before: dict, built: dict) -> None:
    """A module outside the plan may hold the very Parameter a replaced layer held (BERT's
    `cls.predictions.bias` is `decoder.bias`); point it at the layer's new shard so the tie survives and no
    rank keeps a stale full copy."""
    replaced = {}
    for name, new in built.items():
        for pname, old in before[name].named_parameters(recurse=False):
            shard = getattr(new, pname, None)
            if isinstance(shard, nn.Parameter):
                replaced[id(old)] = shard
    if not replaced:
        return
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None and id(p) in replaced and replaced[id(p)] is not p:
                module._parameters[pname] = replaced[id(p)]


def _sum_grads_over_ranks(m: nn.Module, comm) -> None:
    """Each rank's gradient covers only its heads; the full gradient is the sum over ranks."""
    for p in m.parameters(recurse=False):
        if p.requires_grad and p.device.type != "meta":
            p.register_hook(lambda g: comm.all_reduce(g))


def _install_vocab_parallel_loss(model: nn.Module, built: dict, styles: dict, comm) -> None:
    """An HF causal LM whose head keeps split logits computes its loss with vocab_parallel_cross_entropy."""
    heads = [n for n, s in styles.items() if s == "vocab_parallel" and n in built]
    if len(heads) == 1 and isinstance(getattr(type(model), "loss_function", None), property):
        from .losses import VocabParallelCausalLMLoss

        model.loss_function = VocabParallelCausalLMLoss(comm, built[heads[0]].partition_sizes)


def _record(model: nn.Module, plan: Plan) -> None:
    # Hugging Face models expose `tp_plan` as a validating property backed by `_tp_plan`.
    if isinstance(getattr(type(model), "tp_plan", None), property):
        model._tp_plan = plan
    else:
        model.tp_plan = plan
