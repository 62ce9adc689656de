"""Step 7 of `parallelize` (lay out) and `shard_layouts(model)`: the one record of what each rank holds.

`plan_layouts` asks every planned module's style which part of each of its tensors this rank will hold,
before anything is built; the builders cut their shards from those same layouts. After the swap,
`key_layouts` re-keys them by `state_dict` key (a tensor two modules share, such as BERT's decoder bias, gets
its layout under both keys), and `shard_layouts(model)` reads that record back, keyed exactly as
`model.state_dict()`: split tensors and replicated ones alike.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from ..layout import ShardLayout
from ..nn.grad_sums import grad_sums
from ..nn.quantized import quant_method_of
from ..nn.rewrites import rewrites_of, unapplied
from ..nn.record import ModelRecord, find_record
from .errors import PlanError
from .state import step
from .modules import kind
from .registry import module_layouts, style
from .roles import Role
from .styles import REPLICATE, Layouts


def plan_layouts(modules: Mapping[str, nn.Module], leaves: Mapping[str, nn.Module], styles: Mapping[str, str],
                 details: Mapping[str, Role], world: int, rank: int) -> dict[str, Layouts]:
    """Per planned module, its tensors' layouts on `rank`; raises PlanError (naming the module) for a style
    that does not fit the module's type or sizes. Nothing is changed."""
    out: dict[str, Layouts] = {}
    for name, s in styles.items():
        m = modules[name]
        obj = style(s)
        if name not in leaves and not obj.owns_module:
            if not obj.container and obj.name != REPLICATE:
                raise PlanError(f"plan: style {s!r} on {name} ({type(m).__name__}), which is a container; name its "
                                f"layers instead (e.g. {name}.*)")
            continue
        if obj.container:
            raise PlanError(f"plan: style {s!r} is for container modules, not the layer {name}")
        d = details.get(name)
        obj.check(name, m, d, world)
        try:
            out[name] = module_layouts(m, s, d, world, rank)
        except PlanError as exc:
            raise PlanError(f"{name} ({kind(m)}): {exc}") from None
    return out


def key_layouts(modules: Mapping[str, nn.Module], tensors: Mapping[str, torch.Tensor],
                layouts: Mapping[str, Layouts], world: int, rank: int) -> dict[str, ShardLayout]:
    """Every `state_dict` key of the converted model with its layout (tensors no style split are whole).

    `modules` are its modules after the swap, by name; `tensors` its `state_dict(keep_vars=True)`. The planned
    layouts are found by tensor identity, so a tensor reachable under several keys (ties) has the same layout under
    each."""
    by_id: dict[int, ShardLayout] = {}
    for name, lays in layouts.items():
        for tname, lay in lays.items():
            t = _held(modules[name], tname)
            if t is not None:
                by_id.setdefault(id(t), lay)
    return {key: by_id.get(id(t)) or ShardLayout.replicated(t.shape, world, rank) for key, t in tensors.items()}


def _held(module: nn.Module, name: str):
    """The tensor `module` holds under `name` (None where a quantized layer computes it from stored tensors)."""
    t = module._parameters.get(name)
    if t is None:
        t = module._buffers.get(name)
    if t is not None or quant_method_of(module) is not None or name in rewrites_of(module):
        return t  # (a rewritten name is computed when read: nothing held under it)
    return getattr(module, name, None)


def shard_layouts(model: nn.Module, record: ModelRecord | None = None) -> dict[str, ShardLayout]:
    """`{state_dict key: ShardLayout}` of a converted model: every parameter and persistent buffer, replicated
    ones included, keyed exactly as `model.state_dict()` (a model wrapped after conversion, e.g. under a
    `module.` prefix or by PEFT, is found by its submodule; PEFT's LoRA tensors follow their base layer's,
    `tpkit.nn.adapter_layouts`). An unconverted model: every tensor whole, world size 1. `record`: the record
    `model` itself holds, when the caller has it (it is not looked for)."""
    found = find_record(model, "shard_layouts") if record is None else ("", record)
    if found is None:
        return {key: ShardLayout.replicated(t.shape, 1, 0) for key, t in model.state_dict(keep_vars=True).items()}
    prefix, record = found
    cut = len(prefix) + 1 if prefix else 0
    return {key: record.layout(key[cut:] if prefix and key.startswith(prefix + ".") else key, t.shape)
            for key, t in model.state_dict(keep_vars=True).items()}


def check_grad_sums(model: nn.Module, where: str, record: ModelRecord | None = None) -> None:
    """(As `check_gradients`, step 11 of `parallelize`, on the model as the user gets it back, its adapters
    re-wrapped: the conversion's promise, checked once.) Raise PlanError when a parameter of the converted `model` whose gradient must be summed over ranks is not:
    rows several ranks hold (its layout says so) with no sum recorded, or a recorded sum whose module no longer
    applies it (its class or forward hooks replaced after the conversion). Either is a silently wrong gradient.
    `record`: the record `model` itself holds, when the caller has it (`shard_layouts`)."""
    layouts, params = shard_layouts(model, record), {n for n, _ in model.named_parameters()}
    summed = grad_sums(model)
    # a plain split never shares an entry: only what is neither summed nor plainly split walks its entries
    missing = [k for k, lay in layouts.items()
               if k in params and k not in summed and not lay.is_plain_split() and lay.shares_entries()]
    missing += [k for k in unapplied(model) if k in summed]  # recorded sums no longer applied
    if missing:
        raise PlanError(f"{where}: parameter(s) {missing[:4]}{' ...' if len(missing) > 4 else ''} are used by several "
                        f"ranks, each for its own part of the work, so their gradients must be summed over those ranks, "
                        f"but nothing sums them (their module's class or forward hooks were replaced after tpkit "
                        f"converted it). Convert the original model again (tpkit.parallelize / tpkit.from_pretrained) "
                        f"and do not replace its modules afterwards")


check_gradients = step(check_grad_sums)  # 11. of `parallelize`: the same check, once per conversion
