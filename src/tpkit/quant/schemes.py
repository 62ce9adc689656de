"""Which quantized format a checkpoint holds, per layer, read from its `quantization_config`.

A format is data: a `WeightQuant` says how one linear layer's weight is stored (the integer or FP8 values, how
they are packed, the units their scales cover) and `stored_tensors` lists the tensors that replace its `weight`
in the state dict, each with how its dims follow the dense `[out, in]` weight. Every reader (the loader's byte
ranges, the layer's dequantization, the memory estimate) takes the facts from there.

Read here, refused here: a `quant_method`, format or scheme tpkit does not read raises one `QuantizationError`
naming it and what is supported, before any weight is read. Activation quantization (W8A8, FP8 dynamic
activations) is refused: its outputs depend on a kernel that quantizes the inputs, which a weight-only layer
would silently not reproduce.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

import torch

SUPPORTED = ("compressed-tensors (pack-quantized, int-quantized, naive-quantized, float-quantized: weight-only int "
             "2/4/8-bit group/channel, FP8 channel/tensor/block)", "fp8 (block scales, weight_scale_inv)",
             "gptq (4/8-bit, v1 'gptq' format, desc_act)", "awq (4-bit, version 'gemm')")
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class QuantizationError(ValueError):
    """A quantized checkpoint tpkit cannot read as it is stored; names the method, scheme or layer and what is
    supported (`tpkit.quant.SUPPORTED`)."""


@dataclasses.dataclass(frozen=True)
class DimRule:
    """How one dim of a stored tensor follows the dense `[out, in]` weight: `dense` is the weight dim it runs along
    (None: its own, never split), `pack` dense entries packed into one stored entry, `group` dense entries sharing
    one stored entry (a scale's group or block)."""

    dense: int | None
    pack: int = 1
    group: int = 1

    @property
    def unit(self) -> int:
        return self.pack * self.group


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor a quantized layer stores in place of `weight`: its state-dict name, full shape, dtype (None:
    a floating dtype as the file holds it) and one `DimRule` per dim."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    dims: tuple[DimRule, ...]


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """How one layer's weight is stored. `layout`: "ct_pack" (compressed-tensors int packed into int32 along the
    input), "ct_int" (int8 values as they are), "float" (FP8 values, `scale_name` the scale), "gptq", "awq";
    `strategy`: "group", "channel", "tensor" or "block"; `act_order`: a `g_idx` maps each input column to its
    group (GPTQ desc_act)."""

    method: str
    layout: str
    bits: int
    symmetric: bool
    strategy: str
    group_size: int | None = None
    block: tuple[int, int] | None = None
    act_order: bool = False
    scale_name: str = "weight_scale"

    def describe(self) -> str:
        what = {"group": f"group {self.group_size}", "channel": "per channel", "tensor": "per tensor",
                "block": f"block {self.block[0]}x{self.block[1]}" if self.block else "block"}[self.strategy]
        kind = "fp8" if self.layout == "float" else f"int{self.bits}"
        extra = (", asymmetric" if not self.symmetric else "") + (", act-order" if self.act_order else "")
        return f"{self.method} {kind} {what}{extra}"

    def units(self) -> tuple[int, int]:
        """The (out, in) sizes a split should keep whole when it can (packed words times groups or blocks): a split
        on these never cuts a group or a packed word."""
        return self._along(lambda r: r.unit)

    def packing(self) -> tuple[int, int]:
        """The (out, in) alignment a split must keep: dense entries packed into one stored word."""
        return self._along(lambda r: r.pack)

    def _along(self, size_of) -> tuple[int, int]:
        """`size_of(rule)` combined (lcm) over the stored tensors' dims that run along the weight's out / in dim,
        read from `stored_tensors` of a layer large enough that a per-channel or per-tensor scale (one entry for a
        whole dim) stands out from a group."""
        probe = 64 * math.lcm(32, self.group_size or 1, *(self.block or ()))
        out = [1, 1]
        for s in stored_tensors(self, probe, probe):
            for r in s.dims:
                if r.dense is not None and r.group < probe:
                    out[r.dense] = math.lcm(out[r.dense], size_of(r))
        return out[0], out[1]


def _groups(size: int, group: int) -> int:
    return -(-size // group)


def stored_tensors(q: WeightQuant, out: int, in_: int) -> list[StoredTensor]:
    """The tensors a layer of `out` x `in_` features stores, as its checkpoint holds them."""
    g_in = {"group": q.group_size, "channel": in_, "tensor": in_}.get(q.strategy, q.block[1] if q.block else in_)
    g_out = q.block[0] if q.strategy == "block" else (out if q.strategy == "tensor" else 1)
    n_in, n_out = _groups(in_, g_in), _groups(out, g_out)
    scale_in = DimRule(None) if q.act_order else DimRule(1, 1, g_in)
    if q.layout in ("ct_pack", "ct_int", "float"):
        if q.layout == "ct_pack":
            per = 32 // q.bits
            weight = StoredTensor("weight_packed", (out, _groups(in_, per)), torch.int32, (DimRule(0), DimRule(1, per)))
        else:
            weight = StoredTensor("weight", (out, in_), torch.int8 if q.layout == "ct_int" else torch.float8_e4m3fn,
                                  (DimRule(0), DimRule(1)))
        scale_shape = (1,) if q.strategy == "tensor" else (n_out, n_in)
        scale_dims = (DimRule(None),) if q.strategy == "tensor" else (DimRule(0, 1, g_out), scale_in)
        out_l = [weight, StoredTensor(q.scale_name, scale_shape, None, scale_dims)]
        if not q.symmetric:
            if q.layout == "ct_pack":
                per = 32 // q.bits
                out_l.append(StoredTensor("weight_zero_point", (_groups(out, per), n_in), torch.int32,
                                          (DimRule(0, per), scale_in)))
            else:
                out_l.append(StoredTensor("weight_zero_point", (out, n_in), torch.int8, (DimRule(0), scale_in)))
        if q.layout == "ct_pack":
            out_l.append(StoredTensor("weight_shape", (2,), torch.int64, (DimRule(None),)))
        if q.act_order:
            out_l.append(StoredTensor("weight_g_idx", (in_,), torch.int32, (DimRule(1),)))
        return out_l
    per = 32 // q.bits
    if q.layout == "gptq":
        return [StoredTensor("qweight", (_groups(in_, per), out), torch.int32, (DimRule(1, per), DimRule(0))),
                StoredTensor("qzeros", (n_in, _groups(out, per)), torch.int32, (scale_in, DimRule(0, per))),
                StoredTensor("scales", (n_in, out), None, (scale_in, DimRule(0))),
                StoredTensor("g_idx", (in_,), torch.int32, (DimRule(1),))]
    if q.layout == "awq":
        return [StoredTensor("qweight", (in_, _groups(out, per)), torch.int32, (DimRule(1), DimRule(0, per))),
                StoredTensor("qzeros", (n_in, _groups(out, per)), torch.int32, (scale_in, DimRule(0, per))),
                StoredTensor("scales", (n_in, out), None, (scale_in, DimRule(0)))]
    raise QuantizationError(f"unknown stored layout {q.layout!r}")


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization: its `quant_method`, the config as stored (written back by `consolidate`),
    and the schemes by which layers are matched (`scheme_for`)."""

    method: str
    config: Mapping[str, Any]
    groups: tuple[tuple[tuple[str, ...], WeightQuant], ...]  # (targets, scheme), compressed-tensors' config groups
    ignore: tuple[str, ...] = ()

    def scheme_for(self, name: str, class_name: str) -> WeightQuant | None:
        """The scheme of module `name` (of class `class_name`), or None when it is not quantized."""
        if any(_matches(name, class_name, t) for t in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(name, class_name, t) for t in targets):
                return scheme
        return None

    @property
    def stored_names(self) -> frozenset[str]:
        """Every tensor name (after the module's prefix) a quantized layer of this checkpoint may store."""
        return frozenset(s.name for _, q in self.groups for s in stored_tensors(q, 256, 256))

    def describe(self) -> str:
        return "; ".join(sorted({q.describe() for _, q in self.groups}))


def _matches(name: str, class_name: str, target: str) -> bool:
    """compressed-tensors' matching: `re:` a regular expression matched at the start of the module name, else a
    class name or an exact module name (HF's `modules_to_not_convert` entries also match as name suffixes)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == class_name or target == name or name.endswith("." + target)


def read_quantization(config: Mapping[str, Any] | None) -> Quantization | None:
    """The `Quantization` of a model config's `quantization_config` (None when there is none); raises
    `QuantizationError` for anything tpkit would read wrongly."""
    if not config:
        return None
    qc = dict(config)
    method = qc.get("quant_method")
    readers = {"compressed-tensors": _compressed_tensors, "fp8": _fp8, "gptq": _gptq, "awq": _awq}
    if method not in readers:
        raise QuantizationError(f"quantization_config: quant_method {method!r} is not supported; tpkit reads "
                                f"{'; '.join(SUPPORTED)}. Load the model dequantized with transformers and save it "
                                f"unquantized, or use a checkpoint in one of those formats")
    return readers[method](qc)


def config_quantization(config: Any) -> Quantization | None:
    """The `Quantization` a model config declares (a transformers config, a model's `config`, or a config
    dict), or None: its `quantization_config` as a dict or as transformers' config object."""
    qc = config.get("quantization_config") if isinstance(config, Mapping) else getattr(
        config, "quantization_config", None)
    if qc is not None and not isinstance(qc, Mapping):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else None
    return read_quantization(qc) if qc else None


def _refuse(method: str, what: str, why: str = "") -> QuantizationError:
    return QuantizationError(f"quantization_config ({method}): {what} is not supported{why}; tpkit reads "
                             f"{'; '.join(SUPPORTED)}")


def _compressed_tensors(qc: dict) -> Quantization:
    m = "compressed-tensors"
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(m, f"quantization_status {status!r}", " (only compressed checkpoints are stored quantized)")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise _refuse(m, key)
    if qc.get("kv_cache_scheme"):
        raise _refuse(m, "kv_cache_scheme", " (a quantized KV cache changes attention numerics)")
    groups = []
    for gname, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format")
        for act in ("input_activations", "output_activations"):
            if group.get(act):
                raise _refuse(m, f"{act} of config group {gname!r} (activation quantization, e.g. W8A8 or FP8 "
                                 f"dynamic)", ": its outputs depend on kernels that quantize the activations, which a "
                                 "weight-only layer would silently not reproduce")
        w = group.get("weights")
        if not w:
            raise _refuse(m, f"config group {gname!r} without weight quantization")
        if fmt not in CT_FORMATS:
            raise _refuse(m, f"format {fmt!r} (config group {gname!r})")
        if w.get("dynamic"):
            raise _refuse(m, f"dynamic weight quantization (config group {gname!r})")
        kind, bits, strategy = w.get("type", "int"), int(w.get("num_bits", 8)), w.get("strategy")
        sym = bool(w.get("symmetric", True))
        if kind == "float":
            if fmt != "float-quantized" or bits != 8 or strategy not in ("channel", "tensor", "block") or not sym:
                raise _refuse(m, f"float weights {bits}-bit {strategy} in format {fmt!r} (config group {gname!r})")
            block = tuple(w.get("block_structure") or ()) or None
            scheme = WeightQuant(m, "float", 8, True, strategy, block=block)
        else:
            if kind != "int" or strategy not in ("group", "channel"):
                raise _refuse(m, f"{kind} weights with strategy {strategy!r} (config group {gname!r})")
            layout = "ct_pack" if fmt == "pack-quantized" else "ct_int"
            if (layout == "ct_pack" and bits not in (2, 4, 8)) or (layout == "ct_int" and bits != 8):
                raise _refuse(m, f"{bits}-bit weights in format {fmt!r} (config group {gname!r})")
            act = w.get("actorder") == "group"
            scheme = WeightQuant(m, layout, bits, sym, strategy, group_size=w.get("group_size"), act_order=act)
            if strategy == "group" and not scheme.group_size:
                raise _refuse(m, f"group strategy without group_size (config group {gname!r})")
        groups.append((tuple(group.get("targets") or ()), scheme))
    if not groups:
        raise _refuse(m, "a config without config_groups")
    return Quantization(m, qc, tuple(groups), tuple(qc.get("ignore") or ()))


def _fp8(qc: dict) -> Quantization:
    block = qc.get("weight_block_size")
    if not block or len(block) != 2:
        raise _refuse("fp8", f"weight_block_size {block!r}", " (tpkit reads block-scaled FP8: weight_scale_inv)")
    scheme = WeightQuant("fp8", "float", 8, True, "block", block=(int(block[0]), int(block[1])),
                         scale_name="weight_scale_inv")
    return Quantization("fp8", qc, ((("Linear",), scheme),), tuple(qc.get("modules_to_not_convert") or ()))


def _gptq(qc: dict) -> Quantization:
    bits, fmt = int(qc.get("bits", 4)), qc.get("checkpoint_format", "gptq")
    if bits not in (4, 8) or fmt != "gptq":
        raise _refuse("gptq", f"{bits}-bit weights in checkpoint_format {fmt!r}")
    group = int(qc.get("group_size", -1))
    strategy = "group" if group > 0 else "channel"
    scheme = WeightQuant("gptq", "gptq", bits, False, strategy, group_size=group if group > 0 else None,
                         act_order=bool(qc.get("desc_act", False)))
    return Quantization("gptq", qc, ((("Linear",), scheme),), tuple(qc.get("modules_to_not_convert") or ("lm_head",)))


def _awq(qc: dict) -> Quantization:
    bits, version = int(qc.get("bits", qc.get("w_bit", 4))), str(qc.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not qc.get("zero_point", True):
        raise _refuse("awq", f"{bits}-bit version {version!r} (zero_point={qc.get('zero_point', True)})")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    scheme = WeightQuant("awq", "awq", 4, False, "group", group_size=group)
    return Quantization("awq", qc, ((("Linear",), scheme),), tuple(qc.get("modules_to_not_convert") or ("lm_head",)))
