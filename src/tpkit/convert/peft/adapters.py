"""PEFT LoRA adapters and the converter: a LoRA-wrapped layer is converted as its base layer, and the adapter
follows the base's split (`tpkit.nn.lora`); the layouts of the adapter's tensors derive from the base weight's.

`parallelize(peft_model)` takes the LoRA wrappers out (each base layer back in its place), converts the bare
model exactly as an unwrapped one would be converted (same trace, same plan: LoRA's A -> B is never taken for a
column -> row pair), then puts each wrapper back around its new base layer, its factors split to match. The
result is the model `peft.get_peft_model` gives on a converted model (the other order).

PEFT's objects are recognised by their class names (`seam.peft_kinds`): nothing here imports PEFT unless the
model holds PEFT's objects, and then it is imported already.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Iterator, Mapping

from torch import nn

from ...nn.record import ModelRecord
from ...nn.rewrites import adopt
from ..errors import PlanError
from . import seam
from .seam import PEFT_MODEL, SAVED_COPY, TUNER, TUNER_LAYER, peft_kinds
from ..plan import Plan
from ..planning.decide import plan as plan_for
from ..registry import module_layouts
from ..state import step
from ..styles import REPLICATE
from ..trace import analyze_structure


def peft_layers(model: nn.Module) -> tuple[nn.Module, dict[str, nn.Module], dict[str, nn.Module]]:
    """(the model PEFT wraps: a `PeftModel`'s base model, a `LoraModel`'s model, or `model` itself; `{name: wrapper}`
    of the outermost PEFT adapter layers in it; `{name: wrapper}` of its `modules_to_save` wrappers, modules PEFT
    trains a copy of), by one walk; empty without PEFT."""
    target = model
    if PEFT_MODEL in peft_kinds(type(target)):
        target = target.base_model
    if TUNER in peft_kinds(type(target)):
        target = target.model
    wrapped: dict[str, nn.Module] = {}
    saved: dict[str, nn.Module] = {}
    for name, m in target.named_modules():
        kinds = peft_kinds(type(m))
        if TUNER_LAYER in kinds and not any(name.startswith(n + ".") for n in wrapped):
            wrapped[name] = m
        if SAVED_COPY in kinds:
            saved[name] = m
    return target, wrapped, saved


def _check_wrapper(name: str, w: nn.Module) -> None:
    """Refuse, before anything changes, an adapter layer the converter cannot split exactly."""
    from peft.tuners.lora.layer import Embedding as LoraEmbedding
    from peft.tuners.lora.layer import Linear as LoraLinear

    from ...nn.lora import DORA_REASON

    if type(w) not in (LoraLinear, LoraEmbedding):
        raise PlanError(f"{name}: its LoRA adapter is on a {type(w).__name__}, which tpkit does not split with an "
                        f"adapter yet; leave it out of target_modules (LoRA on Linear / Conv1D layers and on "
                        f"embeddings split along the vocabulary is supported)")
    if w.merged:
        raise PlanError(f"{name}: its LoRA adapter(s) {w.merged_adapters} are merged into the base weight; call "
                        f"unmerge_adapter() (or merge_and_unload()) before tpkit.parallelize")
    for adapter, variant in w.lora_variant.items():
        why = DORA_REASON if "Dora" in type(variant).__name__ else (
            f"the LoRA variant {type(variant).__name__} is not supported under tensor parallelism; use plain LoRA")
        raise PlanError(f"{name}: adapter {adapter!r}: {why}")


def _put(modules: Mapping[str, nn.Module], new: Mapping[str, nn.Module]) -> None:
    """Each module of `new` into the model at its name (`modules`: the model's modules by name, "" itself: where its
    containers are found)."""
    for name, module in new.items():
        parent, _, child = name.rpartition(".")
        setattr(modules[parent], child, module)


def _bare(wrapped: Mapping[str, nn.Module], saved: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """What each wrapper stands in for: a `modules_to_save` wrapper's original module, a LoRA wrapper's base layer."""
    return {**{n: w.original_module for n, w in saved.items()}, **{n: w.get_base_layer() for n, w in wrapped.items()}}


@contextlib.contextmanager
def bare_model(model: nn.Module) -> Iterator[tuple[nn.Module, dict[str, nn.Module]]]:
    """Inside the block, (the model PEFT wraps, its LoRA wrappers by name) with every LoRA wrapper replaced by its
    base layer and every `modules_to_save` wrapper by its original module (the model as it was before PEFT); the
    wrappers are put back after, whatever happens."""
    target, wrapped, saved = peft_layers(model)
    modules = dict(target.named_modules())
    _put(modules, _bare(wrapped, saved))
    try:
        yield target, wrapped
    finally:
        _put(modules, {**saved, **wrapped})


def split_saved_copies(modules: Mapping[str, nn.Module], saved: Mapping[str, nn.Module], record: ModelRecord) -> None:
    """After the bare model was converted (`modules`: its modules by name; `record`: its conversion record): each
    `modules_to_save` wrapper (by name; it still holds the unconverted original) takes the converted original, and each
    trained copy becomes a copy of it holding this rank's slice of the copy's values (the original's layouts, as the
    record holds them), so the copy is split exactly as the original."""
    import copy

    for name, w in saved.items():
        new = modules[name]
        if new is w.original_module:
            continue
        for adapter, old in list(w.modules_to_save.items()):
            split = copy.deepcopy(new)
            full = old.state_dict()
            split.load_state_dict({k: record.layout(f"{name}.{k}", v.shape).shard(v) for k, v in full.items()})
            for pname, p in split.named_parameters():
                p.requires_grad_(old.get_parameter(pname).requires_grad)
            w.modules_to_save[adapter] = split
        w._modules["original_module"] = new


def _factors(w: nn.Module) -> Iterator[tuple[str, str, str, nn.Parameter]]:
    """(factor, adapter, tensor name, tensor) of a LoRA wrapper: A / B modules of a linear layer ('weight',
    'bias'), A / B parameters of an embedding (no tensor name: PEFT keys them `lora_embedding_A.<adapter>`)."""
    for factor in ("lora_A", "lora_B"):
        for adapter, m in getattr(w, factor, {}).items():
            for tname, t in m.named_parameters(recurse=False):
                yield factor, adapter, tname, t
    for factor in ("lora_embedding_A", "lora_embedding_B"):
        for adapter, t in getattr(w, factor, {}).items():
            yield factor, adapter, "", t


def adapter_tensors(wrapped: dict[str, nn.Module], plan: Plan | None, world: int) -> list[dict]:
    """One record per adapter tensor of `wrapped` (unconverted wrappers, names as in `plan`): its name, shape,
    element count and size, how it is held at `world` ranks under its base layer's planned style, and its elements
    on the rank holding the most of it (from the base weight's layouts: KV rows two ranks share included)."""
    out = []
    for name, w in wrapped.items():
        style = plan.entries.get(name, REPLICATE) if plan is not None and world > 1 else REPLICATE
        base = w.get_base_layer()
        rows = cols = None  # the most output rows / input columns a rank holds of the base
        if style != REPLICATE:
            lays = [module_layouts(base, style, plan.details.get(name), world, r)["weight"] for r in range(world)]
            held = max(lays, key=lambda lay: lay.local_numel)
            out_dim = 1 if held.transposed else 0
            if held.dim == out_dim:
                rows = max(lay.stored_local_shape[out_dim] for lay in lays)
            elif held.dim is not None:
                cols = max(lay.stored_local_shape[1 - out_dim] for lay in lays)
        for factor, adapter, tname, t in _factors(w):
            shape = list(t.shape)
            if factor == "lora_B" and rows is not None:
                shape[0], held = rows, "rows as the base's"
            elif factor == "lora_A" and tname == "weight" and cols is not None:
                shape[1], held = cols, "columns as the base's"
            elif factor == "lora_embedding_A" and rows is not None:  # [r, vocab]: the base's vocabulary rows
                shape[1], held = rows, "columns as the base's rows"
            else:
                held = "whole" + (", gradient summed over the ranks" if style != REPLICATE else "")
            key = f"{name}.{factor}.{adapter}" + (f".{tname}" if tname else "")
            out.append(dict(name=key, shape=tuple(t.shape), numel=t.numel(), element_size=t.element_size(),
                            held=held, per_rank=math.prod(shape), trainable=t.requires_grad,
                            bytes=t.numel() * t.element_size(), rank_bytes=math.prod(shape) * t.element_size()))
    return out


def adapter_memory(wrapped: dict[str, nn.Module], bare: nn.Module, worlds: list[int], mode: str,
                   example_inputs=None) -> dict[int, tuple[int, int]]:
    """Per world size, (adapter bytes on the fullest rank, what training adds to them: gradients of the same
    dtype and AdamW's two fp32 states per trainable element), the base layers planned as `bare` (the model
    without its wrappers) is planned automatically."""
    a = analyze_structure(bare, example_inputs) if max(worlds) > 1 else None
    out = {}
    for w in worlds:
        records = adapter_tensors(wrapped, plan_for(bare, w, mode=mode, analysis=a) if w > 1 else None, w)
        out[w] = (sum(t["rank_bytes"] for t in records),
                  sum(t["per_rank"] * (t["element_size"] + 8) for t in records if t["trainable"]))
    return out


def _check_embedding_plan(wrapped: Mapping[str, nn.Module], plan: Plan | None) -> None:
    """Refuse, before converting, a plan that splits a LoRA-wrapped embedding along its features (its adapter is
    split only along the vocabulary, `tpkit.nn.lora_embedding`)."""
    import fnmatch

    entries = plan.entries if plan is not None else {}
    for name, w in wrapped.items():
        if not hasattr(w, "lora_embedding_A") or not w.lora_embedding_A:
            continue
        for key, style in entries.items():
            if (key == name or fnmatch.fnmatchcase(name, key)) and style in ("embedding_colwise", "colwise"):
                raise PlanError(f"{name}: the plan splits this LoRA-wrapped embedding along its features ({key!r}: "
                                f"{style!r}); LoRA on an embedding is split along the vocabulary only: plan it "
                                f"'embedding_rowwise' (the default) or leave it out of target_modules")


@dataclasses.dataclass(frozen=True)
class Adapters:
    """PEFT's wrappers taken out of a model for its conversion, by name in the bare model: the LoRA wrappers and the
    `modules_to_save` wrappers (each still holding the module it wrapped: its base layer, its original module)."""

    wrapped: Mapping[str, nn.Module]
    saved: Mapping[str, nn.Module]

    def check_plan(self, plan: Plan | None) -> None:
        """Refuse, before converting, a plan (the user's entries) that splits a LoRA-wrapped embedding along its
        features."""
        _check_embedding_plan(self.wrapped, plan)


@step
@contextlib.contextmanager
def without_adapters(model: nn.Module) -> Iterator[tuple[nn.Module, Adapters | None]]:
    """0. Unwrap: `(the model to convert, the adapters to carry)`. A model holding LoRA wrappers (a `PeftModel`, or
    layers PEFT wrapped) gives its bare model, each wrapper replaced by its base layer (each refused first when tpkit
    cannot split it), and `Adapters`; any other model gives itself and None. An error inside the block puts every
    wrapper back (the model as it was); otherwise they stay out until `rewrap_adapters` puts them around the new
    base layers. PEFT's dispatch, files and loading learn tpkit's layers here, for any model (`seam.install`: a
    converted model may get its adapters later)."""
    seam.install()
    target, wrapped, saved = peft_layers(model)
    if not wrapped:
        yield model, None
        return
    for name, w in wrapped.items():
        _check_wrapper(name, w)
    adapters = Adapters(wrapped, saved)
    _put(dict(target.named_modules()), _bare(wrapped, saved))
    try:
        yield target, adapters
    except BaseException:
        _put(dict(target.named_modules()), {**saved, **wrapped})  # (the containers as they are now)
        raise


@step
def rewrap_adapters(target: nn.Module, adapters: Adapters | None, record: ModelRecord) -> None:
    """10. Re-wrap: each `modules_to_save` copy split as its converted original (`split_saved_copies`, by `record`,
    the conversion's), and each LoRA wrapper put back around its new base layer, its factors split to match
    (`tpkit.nn.lora`). Nothing to do without adapters."""
    if adapters is None:
        return
    from ...nn.lora import lora_layer_for  # (imports PEFT, which a model holding adapters has imported already)

    modules = dict(target.named_modules())  # the converted model: its new base layers, and where they sit
    converted = {name: modules[name] for name in adapters.wrapped}
    split_saved_copies(modules, adapters.saved, record)
    _put(modules, {**adapters.saved, **adapters.wrapped})
    for name, w in adapters.wrapped.items():
        new = converted[name]
        if new is not w.get_base_layer():  # (the wrapper still holds the layer it wrapped)
            cls = lora_layer_for(new)
            if cls is None:
                raise PlanError(f"{name}: its base layer became a {type(new).__name__}, which takes no LoRA adapter")
            adopt(w, cls)
            w.__dict__["tp_name"] = name
            w._modules["base_layer"] = new
            w.fan_in_fan_out = False
            for adapter in list(w.lora_A.keys()) + list(w.lora_embedding_A.keys()):
                w.split_adapter(adapter)
