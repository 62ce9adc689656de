"""Converting a model whose linear layers a checkpoint stores quantized (`tpkit.quant`): planned in whole units,
built quantized.

`from_pretrained` reads the checkpoint's config and keys and says which layers it stores quantized
(`plan_quantized`: a `QuantizedLayers`, checked before anything is built: a tied weight, stored tensors no linear
layer takes); `parallelize(..., quantization=that)` then plans, and builds each of those layers holding the
format's stored tensors (`tpkit.nn.quantized`: its `QuantMethod`, chosen here): column / row layers through their
styles, a layer every rank holds whole as a `QuantizedLinear` (`build_layer`). The conversion record gets their
layouts once, when it is attached (`record_layouts`: each stored tensor's, and the dense weight's under
`<layer>.weight`, which a LoRA adapter's factors follow, `tpkit.nn.adapter_layouts`), so loading, saving and
`shard_layouts` read them as any other tensor.

Planning (`with_units`): a column / row pair whose layers are quantized splits its shared features in whole
quantization units (groups times packed words) where the split can (5 groups of 128 over 2 ranks: 3 / 2), else in
whole packed words, so no rank's slice cuts a group that the pair could keep whole. Attention splits stay whole
heads: a group the heads cut is held by both ranks (`tpkit.quant.layouts`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..layout import ShardLayout
from ..nn.linear import ColumnParallelLinear, RowParallelLinear
from ..nn.quantized import QuantMethod, QuantizedLinear, quant_method_of
from ..nn.quantized_experts import ExpertsQuantMethod, copy_with, experts_methods_of
from ..quant import (Quantization, QuantizationError, WeightQuant, config_quantization, resident_bytes,
                     stored_layout, stored_tensors)
from .plan import Plan
from .roles import ATTENTION


@dataclasses.dataclass(frozen=True)
class QuantizedLayers:
    """What a conversion needs to build a checkpoint's quantized layers: its `quantization`, the compute `dtype`,
    per linear layer the checkpoint stores quantized (module name) the file dtypes of its floating stored tensors
    (scales), and per fused experts module the parameters it stores quantized with their scheme and file dtypes.
    `packed=False` (`from_pretrained(dequantize=True)`): the layers are built dense, split as the packed ones would
    be."""

    quantization: Quantization
    dtype: torch.dtype
    layers: Mapping[str, Mapping[str, torch.dtype]]
    packed: bool = True
    experts: Mapping[str, Mapping[str, tuple[WeightQuant, Mapping[str, torch.dtype]]]] = dataclasses.field(
        default_factory=dict)

    def names(self) -> list[str]:
        """Every module built quantized: linear layers and fused experts."""
        return list(self.layers) + list(self.experts)

    def method(self, name: str, module: nn.Module):
        """A new quantization method for module `name`: a `QuantMethod` for a linear layer, `{parameter:
        ExpertsQuantMethod}` for fused experts."""
        if name in self.experts:
            return {p: ExpertsQuantMethod(q, self.dtype, d) for p, (q, d) in self.experts[name].items()}
        return QuantMethod(scheme_of(self.quantization, name, module), self.dtype, self.layers[name])


def is_linear_layer(m: nn.Module) -> bool:
    """A layer a quantized checkpoint may store packed: `nn.Linear` or a tpkit linear layer."""
    return isinstance(m, (nn.Linear, ColumnParallelLinear, RowParallelLinear))


def scheme_of(quant: Quantization, name: str, m: nn.Module) -> WeightQuant | None:
    return quant.scheme_for(name, "Linear") if is_linear_layer(m) else None


def with_units(the_plan: Plan, modules: Mapping[str, nn.Module], quant: Quantization, world: int) -> Plan:
    """`the_plan` with each quantized column / row pair's `unit` set (see the module docstring); `modules`: the
    model's modules by name."""
    details = dict(the_plan.details)
    for row, role in the_plan.details.items():
        if role.pair == ATTENTION or role.role != "row" or not role.columns or row not in modules:
            continue
        members = [(c, 0) for c in role.columns] + [(row, 1)]
        unit, pack = 1, 1
        for name, dim in members:
            scheme = scheme_of(quant, name, modules.get(name)) if name in modules else None
            if scheme is not None:
                unit, pack = math.lcm(unit, scheme.units()[dim]), math.lcm(pack, scheme.packing()[dim])
        if unit == 1 and pack == 1:
            continue
        width = _in_features(modules[row])
        chosen = next((u for u in (unit, pack) if width % u == 0 and width // u >= world), None)
        if chosen is None or chosen == 1:
            continue
        for name, _ in members:
            if name in details:
                details[name] = details[name].replace(unit=chosen)
    return the_plan.replaced(details=details)


def _in_features(m: nn.Module) -> int:
    return int(getattr(m, "in_features", 0) or m.weight.shape[1])


def plan_quantized(model: nn.Module, quant: Quantization, dtype: torch.dtype, find: Callable[[str], str | None],
                   file_dtype: Callable[[str], torch.dtype | None], stored_keys: list[str],
                   packed: bool = True, experts: Mapping[str, Mapping[str, WeightQuant]] | None = None,
                   taken: set[str] = frozenset()) -> QuantizedLayers:
    """The layers of `model` (built, not converted) that the checkpoint stores quantized: each linear layer the
    config's schemes match whose scale the checkpoint holds, and the fused experts `experts` says (module ->
    {parameter: scheme}: read as stacked entries, which take the stored keys `taken`). `find`: model key ->
    checkpoint key (None when absent); `file_dtype`: a checkpoint key's dtype; `stored_keys`: the checkpoint's keys
    that are quantized tensors, every one of which must land in such a layer. Raises `QuantizationError` naming the
    layer or keys."""
    layers = {}
    for name, m in model.named_modules():
        scheme = scheme_of(quant, name, m)
        if scheme is None or m._parameters.get("weight") is None:
            continue
        specs = stored_tensors(scheme, 8, 8)
        marker = next(s.name for s in specs if s.name == scheme.format.roles(scheme).scale)
        if find(f"{name}.{marker}") is None:
            continue  # the checkpoint stores this layer dense
        if _shared_weight(model, m):
            raise QuantizationError(f"{name}: its weight is tied to another module's, and the checkpoint stores it "
                                    f"quantized ({scheme.describe()}); load with dequantize=True")
        dtypes = {s.name: file_dtype(find(f"{name}.{s.name}") or "") for s in specs if s.dtype is None}
        layers[name] = {k: v for k, v in dtypes.items() if v is not None}
    modules = dict(model.named_modules())
    claimed = {find(f"{n}.{s.name}") for n in layers
               for s in stored_tensors(scheme_of(quant, n, modules[n]), *modules[n].weight.shape)}
    stray = [k for k in stored_keys if k not in claimed and k not in taken]
    if stray:
        raise QuantizationError(f"the checkpoint stores {len(stray)} quantized tensor(s) for layers tpkit does not "
                                f"read as quantized linear layers: {stray[:4]}{' ...' if len(stray) > 4 else ''} "
                                f"({quant.describe()}; tpkit reads quantized nn.Linear layers, not "
                                f"{_kinds(model, stray)}); load with transformers instead")
    stacked = {m: {p: (q, {s.name: d for s in stored_tensors(q, 8, 8) if s.dtype is None and
                           (d := file_dtype(find(f"{m}.{p}.{s.name}") or "")) is not None}) for p, q in params.items()}
               for m, params in (experts or {}).items()}
    return QuantizedLayers(quant, dtype, layers, packed, stacked)


def build_layer(name: str, m: nn.Module, style, layouts, comm, options: Mapping, quantized: QuantizedLayers,
                world: int, rank: int) -> nn.Module:
    """Layer `name` (the model's `m`, planned `style` with `layouts`, or None when every rank holds it whole) built
    holding the checkpoint's stored tensors: by its style, or as a `QuantizedLinear` where it stays whole. A style
    that splits but cannot build a quantized layer raises `QuantizationError` (before anything changes)."""
    method = quantized.method(name, m)
    if style is not None and style.splits and world > 1:
        if not style.builds_quantized:
            raise QuantizationError(f"{name}: style {style.name!r} cannot build a layer the checkpoint stores "
                                    f"quantized ({quantized.quantization.describe()}); plan it 'colwise', 'rowwise' "
                                    f"or 'replicate', or load with dequantize=True")
        return style.build(m, layouts, comm, **options, quant_method=method)
    if isinstance(method, dict):  # fused experts every rank holds whole
        return copy_with(m, {p: ShardLayout.replicated(tuple(getattr(m, p).shape), world, rank) for p in method},
                         method, name)
    return QuantizedLinear.from_module(m, method, ShardLayout.replicated(tuple(m.weight.shape), world, rank), name)


def record_layouts(modules: Mapping[str, nn.Module]) -> dict[str, ShardLayout]:
    """The layouts the conversion record holds for the quantized layers of a model's `modules` (by name): each stored
    tensor's under its state-dict key, and the dense weight's under `<layer>.weight` (no state-dict key: what follows
    the base's split, a LoRA adapter's factors, reads it there as for a dense layer)."""
    out = {}
    for name, m in modules.items():
        prefix = f"{name}." if name else ""
        method = quant_method_of(m)
        if method is not None:
            out[f"{prefix}weight"] = method.dense
            out.update({f"{prefix}{n}": lay for n, lay in method.layouts.items()})
        for param, stacked in experts_methods_of(m).items():
            out[f"{prefix}{param}"] = stacked.dense
            out.update({f"{prefix}{param}.{n}": lay for n, lay in stacked.layouts.items()})
    return out


def _kinds(model: nn.Module, keys: list[str]) -> str:
    modules = dict(model.named_modules())
    kinds = set()
    for k in keys:
        head = k.rpartition(".")[0]
        m = next((v for n, v in modules.items() if n and (head == n or head.endswith("." + n))), None)
        kinds.add(type(m).__name__ if m is not None else f"{head} (no such module)")
    return ", ".join(sorted(kinds))


def _shared_weight(model: nn.Module, layer: nn.Module) -> bool:
    w = layer._parameters["weight"]
    return sum(1 for m in model.modules() if m._parameters.get("weight") is w) > 1


_QUANTIZED_NAMES = ("weight_packed", "qweight", "weight_scale_inv", "weight_scale", "SCB")


def refuse_quantized(modules: Mapping[str, nn.Module], config: Any) -> None:
    """Raise `QuantizationError` when a library already quantized a model's layers (its `modules` by name, its
    `config`: transformers with compressed-tensors, GPTQ, AWQ, FP8 or bitsandbytes): their packed tensors cannot be
    split as dense weights, and a layer kept whole would fail later on a dtype mismatch. Names the first such layer
    and the two ways in."""
    method = (getattr(config, "quantization_config", None) or {})
    method = method.get("quant_method") if isinstance(method, dict) else getattr(method, "quant_method", None)
    method = getattr(method, "value", method)
    for name, m in modules.items():
        if quant_method_of(m) is not None:
            continue
        own = [n for n, _ in m.named_parameters(recurse=False)] + [n for n, _ in m.named_buffers(recurse=False)]
        odd = [n for n, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
               if n == "weight" and (not t.dtype.is_floating_point or t.dtype.itemsize == 1)]
        if hasattr(m, "quantization_scheme") or odd or any(n in _QUANTIZED_NAMES for n in own):
            raise QuantizationError(
                f"parallelize: {name or 'the model'} ({type(m).__name__}) is already quantized"
                f"{f' ({method})' if method else ''}: its packed weights cannot be split as dense ones. Load the "
                f"checkpoint with tpkit.from_pretrained(path) (each rank reads its packed slices; "
                f"dequantize=True for dense weights), or load it dequantized with transformers "
                f"(e.g. quantization_config=CompressedTensorsConfig(dequantize=True)) and parallelize that")


def model_quantization(model: nn.Module) -> Quantization | None:
    """The quantization a model's config declares (`config.quantization_config`), or None."""
    config = getattr(model, "config", None)
    return config_quantization(config) if config is not None else None


def stored_weight_bytes(scheme: WeightQuant, dense: ShardLayout, scale_bytes: int) -> int:
    """The bytes a rank holds of a quantized layer's stored tensors, for the dense weight's layout `dense`
    (`scale_bytes`: the itemsize of its floating tensors, the scales)."""
    out, in_ = dense.full_shape
    total = 0
    for s in stored_tensors(scheme, out, in_):
        size = s.dtype.itemsize if s.dtype else scale_bytes
        try:
            total += stored_layout(dense, s, "").local_numel * size
        except QuantizationError:  # a split the format cannot follow (loading refuses it): its share of the bytes
            total += math.prod(s.shape) * size * dense.local_numel // max(math.prod(dense.full_shape), 1)
    return total


def held_weight_bytes(scheme: WeightQuant, dense: ShardLayout, dtype: torch.dtype) -> int:
    """The bytes a rank holds of a quantized layer once loaded in `dtype` (its scales stored in it): the stored
    tensors (`stored_weight_bytes`) and what the load keeps beside them (`tpkit.quant.resident_bytes`: the maps
    where a split cuts a group, the tables a fast product makes)."""
    return stored_weight_bytes(scheme, dense, dtype.itemsize) + resident_bytes(scheme, dense, dtype)


def quantized_note(quant: Quantization) -> str:
    """`analyze`'s line about a quantized checkpoint: what its bytes count, its format and units."""
    units = "; ".join(sorted({f"{q.describe()}: splits keep whole units of {q.units()[0]} output x {q.units()[1]} "
                              f"input features where they can" for _, q in quant.groups}))
    return (f"quantized checkpoint ({quant.method}): bytes count the stored tensors (packed weights, scales, zero "
            f"points) and what a load keeps beside them (maps where a split cuts a group); {units}. Load it with "
            f"tpkit.from_pretrained(path): each rank reads its packed slices")
