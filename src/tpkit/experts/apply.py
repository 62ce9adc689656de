"""`expert_parallel(model, groups)`: one call after conversion that spreads a MoE model's experts over the expert group.

As `tpkit.context_parallel`, it is applied to the model as it is (plain, or converted by `tpkit.parallelize` /
`from_pretrained` with its experts kept whole: `plan=tpkit.KEEP_EXPERTS_WHOLE`), as torchtitan applies its
parallelisms in turn, and changes three things, each recorded on the model's record (`record.experts`):
1. every fused experts module becomes a `DispatchedExperts` holding this rank's experts of the expert group
   (`groups.ep`), same parameter names, reached by all-to-all (`dispatch.py`); the router stays whole;
2. the experts' gradients: each rank's covers every token its experts received, from every rank of the expert
   group; they are summed over the ranks holding the same experts (`groups.edp`) and divided by the dp size, the
   mean over data-parallel replicas the engines take of every other weight (Megatron's expert-data reduction).
   The data-parallel engines (`tpkit.data_parallel`) and the cp sum leave these weights alone;
3. their layouts: dim 0 (the experts) split over the expert group, so checkpoints hold each expert once under the
   whole model's names, `clip_grad_norm_` counts each expert once and the replica sentinel compares them over the
   expert-data group only; `save_pretrained` (collective) and `num_parameters` of a transformers model answer for
   the whole model, each expert gathered from the rank holding it (`convert/stock_calls.py`), at any tp size.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..comm.rank_groups import Groups
from ..convert.families.expert_blocks import find_block
from ..convert.families.experts import FusedExperts, experts_in
from ..convert.stock_calls import install_whole_model_calls
from ..layout import ShardLayout
from ..nn.mappings import copy_to_region, scale_grad
from ..nn.quantized_experts import ExpertsQuantMethod
from ..nn.record import ModelRecord, attach_record, find_record
from ..nn.rewrites import Rewrite, rewrite, rewrites_of
from .aux_loss import GlobalAuxLoss, aux_loss_on
from .module import DispatchedExperts

#: Plan overrides that keep every fused experts module whole under tensor parallelism, for `expert_parallel` to
#: spread afterwards: `tpkit.from_pretrained(path, comm=groups.tp, plan=tpkit.KEEP_EXPERTS_WHOLE)`.
KEEP_EXPERTS_WHOLE = {"*.experts": "replicate"}
_CAPACITY_ATTRS = ("capacity_factor", "moe_capacity_factor", "expert_capacity")


class OverExperts(Rewrite):
    """An expert weight's gradient summed over the ranks holding the same experts (`edp`, None when it is this rank
    alone, or when FSDP2 sums it there) and multiplied by `times` / `dp` (`times` > 1: FSDP2's mean over an
    expert-data group of that size, undone)."""

    def __init__(self, edp: Communicator | None, dp: int, times: int = 1):
        self.edp, self.dp, self.times = edp, dp, times

    def read(self, module: nn.Module, name: str, stored: torch.Tensor | None) -> torch.Tensor:
        seen = copy_to_region(stored, self.edp) if self.edp is not None else stored
        return scale_grad(seen, times=self.times, over=self.dp)


@dataclasses.dataclass(eq=False)
class ExpertParallel:
    """The record of an expert-parallel model: the expert group, the expert-data group (None when each expert is
    held once), the dp divisor, the experts modules and their weights' state-dict keys."""

    ep: Communicator
    edp: Communicator | None
    dp: int
    modules: tuple[str, ...]
    keys: frozenset[str]
    fsdp: bool = False  # FSDP2 shards the experts over edp and reduces their gradients (`tpkit.data_parallel`)

    def hand_to_fsdp(self, owner: nn.Module) -> list[nn.Module]:
        """The experts modules of `owner` (the record's model), their sum over the expert-data group handed to FSDP2
        sharding them there: its reduce-scatter averages over edp, so each rank's gradient enters it multiplied by
        edp / dp (the sum over edp divided by dp, on any backend: gloo has no pre-multiplied reduce for FSDP2's own
        divide factor). Called by `tpkit.data_parallel` before it shards them."""
        found = [owner.get_submodule(name) for name in self.modules]
        for module in found:
            for how in rewrites_of(module).values():
                if isinstance(how, OverExperts):
                    how.edp, how.times = None, self.edp.world_size
        self.fsdp = True
        return found


def _experts_modules(model: nn.Module, record: ModelRecord | None) -> list[tuple[str, FusedExperts]]:
    found, refused = experts_in(model)
    for name, info in found:
        m = model.get_submodule(name)
        if any(isinstance(how, ExpertsQuantMethod) for how in rewrites_of(m).values()):
            raise NotImplementedError(f"expert_parallel: {name} ({type(m).__name__}) holds quantized experts; tpkit "
                                      f"dispatches experts of a floating dtype (load with dequantize=True)")
        if record is not None and any(not record.layout(f"{name}.{p}", getattr(m, p).shape).is_replicated
                                      for p in (info.up, "down_proj")):
            raise ValueError(f"expert_parallel: {name} ({type(m).__name__}) was split by tensor parallelism already; "
                             f"convert with its experts whole (tpkit.parallelize / from_pretrained with "
                             f"plan=tpkit.KEEP_EXPERTS_WHOLE), then call expert_parallel")
    if refused:
        raise NotImplementedError("expert_parallel: experts tpkit cannot dispatch exactly: " + "; ".join(refused[:3]))
    if not found:
        separate = [n for n, m in model.named_modules() if find_block(n, m) is not None]
        why = (f"; its MoE block(s) {separate[:3]} hold separate experts (a list of MLP modules, combined in the "
               f"block's own forward, which calls only the experts it picked: no all-to-all can be matched across "
               f"ranks): split them with tensor parallelism instead (tpkit.parallelize, style 'moe_block')"
               if separate else "")
        raise ValueError(f"expert_parallel: {type(model).__name__} has no fused experts module (3-D gate_up_proj / "
                         f"up_proj and down_proj, as transformers' Qwen3-MoE, Mixtral, DeepSeek, gpt-oss keep them)"
                         f"{why}")
    return found


def _check(model: nn.Module, groups: Groups, found: list[tuple[str, FusedExperts]]) -> None:
    if getattr(groups, "ep", None) is None:
        raise ValueError("expert_parallel: groups must be tpkit.comm.groups(comm, tp=..., ep=E) with E > 1 (it "
                         "carves the expert group out of dp x cp x tp)")
    ep = groups.ep.world_size
    config = getattr(model, "config", None)
    for attr in _CAPACITY_ATTRS:
        if getattr(config, attr, None):
            raise NotImplementedError(f"expert_parallel: {type(model).__name__}'s config sets {attr}="
                                      f"{getattr(config, attr)}: a capacity drops tokens, so the result would differ "
                                      f"from one process; tpkit's dispatch is dropless")
    for name, info in found:
        if info.num_experts < ep:
            raise ValueError(f"expert_parallel: {name} holds {info.num_experts} experts, fewer than ep {ep}; every "
                             f"rank of the expert group needs one: choose ep <= {info.num_experts}")


def expert_parallel(model: nn.Module, groups: Groups) -> nn.Module:
    """Spread `model`'s experts over `groups.ep` (see the module docstring; `groups`: `tpkit.comm.groups(...)` with
    ep > 1, or a pipeline's `PipelineGroups`, which carry the same groups); returns it. Checks everything before
    changing anything: a refused model is left as it was."""
    found_record = find_record(model, "expert_parallel")
    record = found_record[1] if found_record is not None else None
    if found_record is not None and found_record[0]:
        raise NotImplementedError(f"expert_parallel: the converted model sits at {found_record[0]!r} inside "
                                  f"{type(model).__name__} (a wrapper: PEFT, DDP); call it on the converted model")
    if record is not None and record.experts is not None:
        raise ValueError(f"expert_parallel: {type(model).__name__} is expert-parallel already over "
                         f"{record.experts.ep.name}")
    found = _experts_modules(model, record)
    _check(model, groups, found)
    ep, edp, dp = groups.ep, groups.edp, groups.dp.world_size
    aux = _global_aux_loss(model, groups, record) if aux_loss_on(model) and dp > 1 else None
    edp = edp if edp is not None and edp.world_size > 1 else None
    layouts, keys = {}, set()
    for name, info in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        new = DispatchedExperts(old, info, ep, groups.tp)
        for p in (info.up, "down_proj"):
            key = f"{name}.{p}"
            layouts[key] = ShardLayout.split(tuple(getattr(old, p).shape), 0, ep.world_size, ep.rank)
            keys.add(key)
            rewrite(new, p, OverExperts(edp, dp))  # also marks them: the cp sum and the engines leave them alone
        setattr(parent, child, new)
    if record is None:
        record = attach_record(model, ModelRecord(groups.tp if groups.tp.world_size > 1 else None, {}))
    record.layouts = {**record.layouts, **layouts}
    record.experts = ExpertParallel(ep, edp, dp, tuple(n for n, _ in found), frozenset(keys))
    install_whole_model_calls(model, record)  # save_pretrained and num_parameters: every expert, from its owner
    if aux is not None:
        aux.install(model)
    return model


def _global_aux_loss(model: nn.Module, groups: Groups, record: ModelRecord | None) -> GlobalAuxLoss:
    """The hook that computes the router's auxiliary loss over the global batch (`aux_loss.py`), or a refusal."""
    cp = groups.cp.world_size if groups.cp is not None else 1
    where = f"context parallelism (cp {cp})" if cp > 1 else "a pipeline" if getattr(record, "pipeline", None) else None
    if where:
        raise NotImplementedError(f"expert_parallel: {type(model).__name__} adds the router's auxiliary loss "
                                  f"(output_router_logits) and tpkit computes it over the global batch only without "
                                  f"{where}; turn it off (config.output_router_logits=False) or drop {where}")
    return GlobalAuxLoss(model, groups.dp)


def experts_of(model: nn.Module) -> ExpertParallel | None:
    """What `expert_parallel` keeps for `model`, or None."""
    found = find_record(model, "experts_of")
    return found[1].experts if found is not None else None
