"""Step 5 of `parallelize` (swap): build every new layer from its layouts, then change the model.

`build` makes every replacement while the model is still untouched (a failure there leaves it as it was);
`swap` puts them in, gives attention modules their local head counts, ties tied weights again, points other
holders of a replaced parameter at its shard, and installs the hooks some styles need (gradient sums of
per-head norms, the vocab-parallel loss, sequence-parallel entry and gathers).
"""
from __future__ import annotations

import copy
import functools
import inspect
from typing import Mapping

from torch import nn

from ..layout import head_layout
from .modules import is_embedding
from .pairs import NUM_HEADS_ATTRS, NUM_KV_ATTRS
from .structure import Analysis
from .styles import REPLICATED_WITH_GRAD_ALLREDUCE, ROWWISE, VOCAB_PARALLEL, Layouts, style

WIDTH_ATTRS = ("all_head_size", "embed_dim", "split_size", "inner_dim", "hidden_size", "kdim", "vdim")


def build(modules: Mapping[str, nn.Module], styles: Mapping[str, str], layouts: Mapping[str, Layouts], comm,
          sequence_rows: set[str]) -> dict[str, nn.Module]:
    """Every module's replacement on this rank (modules a style keeps are absent). Nothing is changed."""
    if comm.world_size == 1:
        return {}
    built = {}
    for name, s in styles.items():
        if name in layouts:
            new = style(s).build(modules[name], layouts[name], comm, name in sequence_rows)
            if new is not None:
                built[name] = new
    return built


def attention_updates(model: nn.Module, styles: Mapping[str, str], details: Mapping[str, dict], world: int,
                      rank: int) -> dict[str, dict]:
    """New values of the head-count / width attributes that attention modules read, per module."""
    if world == 1:
        return {}
    updates: dict[str, dict] = {}
    for name, s in styles.items():
        d = details.get(name, {})
        if s != ROWWISE or d.get("pair") != "attention":
            continue
        attn_name = d["attention"]
        attn = model.get_submodule(attn_name) if attn_name else model
        lay = head_layout(d["num_heads"], d["num_kv_heads"], world, attn_name)
        updates[attn_name] = _local_head_attrs(attn, d["num_heads"], d["num_kv_heads"], d["head_dim"],
                                               len(lay.q_heads[rank]), len(lay.kv_heads[rank]))
    return updates


def _local_head_attrs(attn: nn.Module, nh: int, nkv: int, hd: int, nh_l: int, nkv_l: int) -> dict:
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
    return new


@functools.lru_cache(maxsize=None)
def _forward_reads_config_heads(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "config.num_attention_heads" in source or "config.num_key_value_heads" in source


def swap(model: nn.Module, modules: Mapping[str, nn.Module], analysis: Analysis, styles: Mapping[str, str],
         built: Mapping[str, nn.Module], updates: Mapping[str, dict], region, comm,
         details: Mapping[str, dict] | None = None) -> None:
    """Put the built layers in and install what they need; `modules` are the model's modules before."""
    for name, new in built.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    for attn_name, new in updates.items():
        attn = model.get_submodule(attn_name) if attn_name else model
        for attr, value in new.items():
            setattr(attn, attr, value)
    for name, s in styles.items():  # styles acting on a whole container install their hooks (moe_block)
        if hasattr(style(s), "install") and comm.world_size > 1:
            style(s).install(model.get_submodule(name) if name else model, comm)
    _retie(model, analysis, built)
    _repoint_shared_parameters(model, modules, built)
    if comm.world_size > 1:
        for name, s in styles.items():
            if s == REPLICATED_WITH_GRAD_ALLREDUCE:
                _sum_grads_over_ranks(modules[name], comm)
    _install_vocab_parallel_loss(model, built, styles, comm)
    _slice_head_args(model, styles, details, comm)
    if region is not None:
        from ..nn import mark_sequence_parallel
        from .sequence import install_entry, install_gather

        install_entry(model, region.entry_block, comm, region.entry_arg)
        for n in region.norms:
            mark_sequence_parallel(modules[n])
        for n in region.gathered:
            install_gather(modules[n], comm)


def _slice_head_args(model: nn.Module, styles: Mapping[str, str], details: Mapping[str, dict] | None, comm):
    """Split attention that takes per-head arguments built for all heads (ALiBi) gets its heads' slices."""
    if comm.world_size == 1:
        return
    from .per_head import install_head_arg_slicers

    for name, s in styles.items():
        d = (details or {}).get(name, {})
        if s == ROWWISE and d.get("head_args"):
            lay = head_layout(d["num_heads"], d["num_kv_heads"], comm.world_size, d["attention"])
            attn = model.get_submodule(d["attention"]) if d["attention"] else model
            install_head_arg_slicers(attn, d["head_args"], d["num_heads"], lay.q_heads[comm.rank])


def _retie(model: nn.Module, a: Analysis, built: Mapping[str, nn.Module]) -> None:
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


def _repoint_shared_parameters(model: nn.Module, before: Mapping[str, nn.Module], built: Mapping[str, nn.Module]):
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
    from ..comm import traceable

    for p in m.parameters(recurse=False):
        if p.requires_grad and p.device.type != "meta":
            p.register_hook(lambda g: traceable.all_reduce(g, comm))


def _install_vocab_parallel_loss(model: nn.Module, built: Mapping[str, nn.Module], styles: Mapping[str, str],
                                 comm) -> None:
    """An HF causal LM whose head keeps split logits computes its loss with vocab_parallel_cross_entropy."""
    heads = [n for n, s in styles.items() if s == VOCAB_PARALLEL and n in built]
    if len(heads) == 1 and isinstance(getattr(type(model), "loss_function", None), property):
        from .losses import VocabParallelCausalLMLoss

        model.loss_function = VocabParallelCausalLMLoss(comm, built[heads[0]].partition_sizes)
