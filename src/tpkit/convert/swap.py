"""Step 8 of `parallelize` (build and swap): build every new layer from its layouts, then change the model.

`swap` builds every replacement first (`build`: the model is still untouched, so a failure there leaves it as it
was), then puts them in, sets the attributes families asked for (local head counts, fast paths off), ties tied
weights again, points other holders of a replaced parameter at its shard, and lets every family install what
its styles need (gradient sums of per-head norms, the vocab-parallel loss, sequence-parallel entry and gathers,
MoE regions). Last, every plain `nn.Linear` left whole (every one at world size 1) becomes a `DecodeLinear`, whose
product at decode is the faster one a split layer's shard runs (`tpkit.nn.decode_linear`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from torch import nn

from ..nn.decode import adopt_decode_paths
from ..nn.quantized import quant_method_of
from ..nn.rewrites import rewrites_of
from .family import Checked, Family, Planned
from .modules import is_embedding
from .quantized import QuantizedLayers, build_layer
from .registry import families, style
from .styles import Layouts
from .trace import Analysis


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A plan checked against one model on one rank: what `swap` needs (`steps.prepare` makes it)."""

    modules: Mapping[str, nn.Module]       # the model's modules before the swap
    styles: Mapping[str, str]
    layouts: Mapping[str, Layouts]         # per module, its tensors' layouts
    planned: Planned
    checked: Mapping[str, Checked]
    options: Mapping[str, Mapping]         # extra keyword arguments of a module's build


def build(modules: Mapping[str, nn.Module], styles: Mapping[str, str], layouts: Mapping[str, Layouts], comm,
          options: Mapping[str, Mapping[str, Any]], quantized: QuantizedLayers | None = None) -> dict[str, nn.Module]:
    """Every module's replacement on this rank (modules a style keeps are absent); `options`: extra keyword
    arguments of a module's build (sequence-parallel rows); `quantized`: the layers a checkpoint stores quantized,
    built holding its stored tensors, split or whole (`quantized.build_layer`), at any world size. Nothing is
    changed."""
    world, rank = comm.world_size, comm.rank
    packed = quantized.names() if quantized is not None and quantized.packed else ()
    built = {}
    for name, s in styles.items():
        if world > 1 and name in layouts and name not in packed:
            new = style(s).build(modules[name], layouts[name], comm, **options.get(name, {}))
            if new is not None:
                built[name] = new
    for name in packed:
        planned = style(styles[name]) if name in styles and name in layouts else None
        built[name] = build_layer(name, modules[name], planned, layouts.get(name), comm, options.get(name, {}),
                                  quantized, world, rank)
    return built


def attribute_updates(planned: Planned) -> dict[str, dict]:
    """Every family's attribute values to set, per module."""
    updates: dict[str, dict] = {}
    for family in families():
        for name, attrs in family.attributes(planned).items():
            updates.setdefault(name, {}).update(attrs)
    return updates


def swap(model: nn.Module, p: Prepared, comm, quantized: QuantizedLayers | None = None) -> dict[str, dict]:
    """Build every new layer of the prepared plan `p` (`quantized`: the layers a checkpoint stores quantized), then
    put them in and install what they need; returns the attribute updates made."""
    built = build(p.modules, p.styles, p.layouts, comm, p.options, quantized)
    updates = attribute_updates(p.planned)
    for name, new in built.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    for owner, new in updates.items():
        target = model.get_submodule(owner) if owner else model
        for attr, value in new.items():
            setattr(target, attr, value)
    after = dict(model.named_modules())  # the new layers in: what the ties and shared parameters are fixed in
    _retie(after, p.planned.analysis, built)
    _repoint_shared_parameters(after.values(), p.modules, built)
    for family in families():
        if type(family).install is not Family.install:  # (the base class installs nothing)
            family.install(model, p.planned, p.checked.get(family.name), comm)
    adopt_decode_paths(model, comm.world_size)  # the decode paths: attention; at world 1 the Linear layers too
    return updates


def _retie(modules: Mapping[str, nn.Module], a: Analysis, built: Mapping[str, nn.Module]) -> None:
    """Tied weights tied again (each group to its embedding's, else its first module's), in the swapped `modules`."""
    done = set()
    for name, others in a.ties.items():
        group = sorted([name] + others)
        if group[0] in done or not any(n in built for n in group):
            continue
        done.add(group[0])
        owner = next((n for n in group if is_embedding(a.leaves[n])), group[0])
        weight = modules[owner].weight
        for n in group:
            if n != owner:
                modules[n].weight = weight


def _repoint_shared_parameters(modules: Iterable[nn.Module], before: Mapping[str, nn.Module],
                               built: Mapping[str, nn.Module]):
    """A module outside the plan may hold the very Parameter a replaced layer held (BERT's
    `cls.predictions.bias` is `decoder.bias`); point it at the layer's new shard so the tie survives and no
    rank keeps a stale full copy."""
    replaced = {}
    for name, new in built.items():
        for pname, old in before[name].named_parameters(recurse=False):
            shard = new._parameters.get(pname) if pname in rewrites_of(new) or quant_method_of(new) is not None \
                else getattr(new, pname, None)
            if isinstance(shard, nn.Parameter):
                replaced[id(old)] = shard
    if not replaced:
        return
    for module in modules:
        for pname, p in list(module._parameters.items()):
            if p is not None and id(p) in replaced and replaced[id(p)] is not p:
                module._parameters[pname] = replaced[id(p)]
