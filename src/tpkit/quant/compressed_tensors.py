"""compressed-tensors checkpoints (llm-compressor's W4A16 / W8A16 / FP8): `quant_method: compressed-tensors`.

Formats read: `pack-quantized` (int2 / int4 / int8 packed into int32 words along the input, zero points packed
along the output), `int-quantized` and `naive-quantized` with int weights (int8 values as stored), and
`float-quantized` or `naive-quantized` with float weights (FP8 e4m3 values; `naive-quantized` is what
compressed-tensors' `ModelCompressor` writes for weight-only FP8 when given no format). Scales per group, channel,
tensor or block; `actorder: group` adds `weight_g_idx`. `w = (q - z) * s` in the scales' dtype, then cast, as
compressed-tensors dequantizes.

Refused: activation quantization (W8A8, FP8 dynamic activations: its outputs depend on a kernel that quantizes the
inputs, which a weight-only layer would silently not reproduce), dynamic weights, sparsity, transforms, a
quantized KV cache, checkpoints not stored compressed.

The fast products, for a local slice that holds whole groups from its first feature (no act-order): tpkit's
compiled product on the stored values in place (`products.Native`: FP8, int8, int4 and int8 packed), torch's int4
kernel for `pack-quantized` int4 groups of 32 to 256 with output rows in blocks of 64, torch's int8 kernel for int8
per channel, symmetric; the layer keeps the fastest it measured (`products.fastest`). torch's kernels compute in the
activations' dtype, so they apply where the scales are stored in the dtype the layer computes in (a bf16
checkpoint's weight is `(q - z) * s` rounded to bf16, which a float32 kernel would not reproduce); the compiled one
where the arithmetic is float32 or the layer computes in half precision (`products.native_applies`).
"""
from __future__ import annotations

from typing import Mapping

import torch

from .format import Format, Product, Refused, Roles
from .products import Native, native_applies
from .kernels import INT4_GROUPS, INT8_K_MULTIPLE, int4_kernel_block, int4_linear, int8_linear
from .packing import unpack_signed
from .schemes import DimRule, Quantization, StoredTensor, WeightQuant, groups

METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


def _scheme(gname: str, group: dict, fmt: str) -> WeightQuant:
    """One config group's weight scheme (raising `Refused` for what is not read)."""
    for act in ("input_activations", "output_activations"):
        if group.get(act):
            raise Refused(f"{act} of config group {gname!r} (activation quantization, e.g. W8A8 or FP8 dynamic)",
                          ": its outputs depend on kernels that quantize the activations, which a weight-only layer "
                          "would silently not reproduce")
    w = group.get("weights")
    if not w:
        raise Refused(f"config group {gname!r} without weight quantization")
    if fmt not in FORMATS:
        raise Refused(f"format {fmt!r} (config group {gname!r})")
    if w.get("dynamic"):
        raise Refused(f"dynamic weight quantization (config group {gname!r})")
    kind, bits, strategy = w.get("type", "int"), int(w.get("num_bits", 8)), w.get("strategy")
    sym = bool(w.get("symmetric", True))
    if kind == "float":
        if fmt not in ("float-quantized", "naive-quantized") or bits != 8 or \
                strategy not in ("channel", "tensor", "block") or not sym:
            raise Refused(f"float weights {bits}-bit {strategy} in format {fmt!r} (config group {gname!r})")
        block = tuple(w.get("block_structure") or ()) or None
        return WeightQuant(METHOD, "float", 8, True, strategy, block=block)
    if kind != "int" or strategy not in ("group", "channel"):
        raise Refused(f"{kind} weights with strategy {strategy!r} (config group {gname!r})")
    layout = "ct_pack" if fmt == "pack-quantized" else "ct_int"
    if (layout == "ct_pack" and bits not in (2, 4, 8)) or (layout == "ct_int" and bits != 8):
        raise Refused(f"{bits}-bit weights in format {fmt!r} (config group {gname!r})")
    scheme = WeightQuant(METHOD, layout, bits, sym, strategy, group_size=w.get("group_size"),
                         act_order=w.get("actorder") == "group")
    if strategy == "group" and not scheme.group_size:
        raise Refused(f"group strategy without group_size (config group {gname!r})")
    return scheme


class _Int4(Product):
    """torch's int4 kernel on a `pack-quantized` int4 group slice."""

    name = "int4"

    def __init__(self, group: int, bits: int):
        self.group, self.bits = group, bits

    def __call__(self, x: torch.Tensor, t: Mapping[str, torch.Tensor]) -> torch.Tensor:
        z = t.get("weight_zero_point")
        return int4_linear(x, t["weight_packed"], t["weight_scale"],
                           None if z is None else unpack_signed(z, self.bits, 0), self.group)


class _Int8(Product):
    """torch's int8 kernel on int8 per-channel symmetric values (`int-quantized`: read in place)."""

    name = "int8"

    def __init__(self, values: str):
        self.values = values

    def __call__(self, x: torch.Tensor, t: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return int8_linear(x, t[self.values], t["weight_scale"])


class CompressedTensors(Format):
    method = METHOD
    supported = ("compressed-tensors (pack-quantized, int-quantized, naive-quantized, float-quantized: weight-only "
                 "int 2/4/8-bit group/channel, FP8 channel/tensor/block)")

    def read(self, qc: dict) -> Quantization:
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise Refused(f"quantization_status {status!r}", " (only compressed checkpoints are stored quantized)")
        for key in ("sparsity_config", "transform_config"):
            if qc.get(key):
                raise Refused(key)
        if qc.get("kv_cache_scheme"):
            raise Refused("kv_cache_scheme", " (a quantized KV cache changes attention numerics)")
        found = [(tuple(group.get("targets") or ()), _scheme(gname, group, group.get("format") or qc.get("format")))
                 for gname, group in (qc.get("config_groups") or {}).items()]
        if not found:
            raise Refused("a config without config_groups")
        return Quantization(METHOD, qc, tuple(found), tuple(qc.get("ignore") or ()))

    def stored_tensors(self, q: WeightQuant, out: int, in_: int) -> list[StoredTensor]:
        g_in = {"group": q.group_size, "channel": in_, "tensor": in_}.get(q.strategy, q.block[1] if q.block else in_)
        g_out = q.block[0] if q.strategy == "block" else (out if q.strategy == "tensor" else 1)
        n_in, n_out = groups(in_, g_in), groups(out, g_out)
        scale_in = DimRule(None) if q.act_order else DimRule(1, 1, g_in)
        per = 32 // q.bits
        if q.layout == "ct_pack":
            weight = StoredTensor("weight_packed", (out, groups(in_, per)), torch.int32, (DimRule(0), DimRule(1, per)))
        else:
            weight = StoredTensor("weight", (out, in_), torch.int8 if q.layout == "ct_int" else torch.float8_e4m3fn,
                                  (DimRule(0), DimRule(1)))
        scale_shape = (1,) if q.strategy == "tensor" else (n_out, n_in)
        scale_dims = (DimRule(None),) if q.strategy == "tensor" else (DimRule(0, 1, g_out), scale_in)
        found = [weight, StoredTensor(q.scale_name, scale_shape, None, scale_dims)]
        if not q.symmetric:
            found.append(StoredTensor("weight_zero_point", (groups(out, per), n_in), torch.int32,
                                      (DimRule(0, per), scale_in)) if q.layout == "ct_pack" else
                         StoredTensor("weight_zero_point", (out, n_in), torch.int8, (DimRule(0), scale_in)))
        if q.layout == "ct_pack":
            found.append(StoredTensor("weight_shape", (2,), torch.int64, (DimRule(None),)))
        if q.act_order:
            found.append(StoredTensor("weight_g_idx", (in_,), torch.int32, (DimRule(1),)))
        return found

    def roles(self, q: WeightQuant) -> Roles:
        return Roles("weight_packed" if q.layout == "ct_pack" else "weight", q.scale_name, "weight_zero_point",
                     "weight_g_idx")

    def values(self, q: WeightQuant, name: str, t: torch.Tensor) -> torch.Tensor:
        if q.layout == "ct_pack" and name == "weight_packed":
            return unpack_signed(t, q.bits, 1)
        if q.layout == "ct_pack" and name == "weight_zero_point":
            return unpack_signed(t, q.bits, 0)
        return t

    def products(self, q: WeightQuant, local_shape: tuple[int, int], mapped: bool, dtype: torch.dtype,
                 scale_dtype: torch.dtype | None) -> list[Product]:
        out, in_ = local_shape
        if mapped or q.act_order:
            return []
        found = [p for p in [_native(q, out, in_)] if p is not None and native_applies(dtype, scale_dtype)]
        if dtype != scale_dtype:  # torch's kernels compute in the activations' dtype (the module docstring)
            return found
        rows = int4_kernel_block()
        if q.layout == "ct_pack" and q.bits == 4 and q.strategy == "group" and q.group_size in INT4_GROUPS \
                and rows and out % rows == 0 and in_ % q.group_size == 0:
            found.append(_Int4(q.group_size, q.bits))
        if q.layout in ("ct_pack", "ct_int") and q.bits == 8 and q.strategy == "channel" and q.symmetric \
                and in_ % INT8_K_MULTIPLE == 0:
            found.append(_Int8("weight_packed" if q.layout == "ct_pack" else "weight"))
        return found


def _native(q: WeightQuant, out: int, in_: int) -> Native | None:
    """tpkit's compiled product on the stored values in place (`products.Native`), where their layout is one it
    reads: FP8, int8 values, int4 and int8 packed along the input."""
    block = {"group": (1, q.group_size), "channel": (1, in_), "tensor": (out, in_)}.get(q.strategy, q.block)
    if q.layout == "float":
        return Native("fp8", "weight", out, q.scale_name, block)
    zero = None if q.symmetric else "weight_zero_point"
    if q.layout == "ct_int":
        return Native("int8", "weight", out, q.scale_name, block, zero)
    if q.bits in (4, 8):
        return Native("uint4" if q.bits == 4 else "uint8", "weight_packed", out, q.scale_name, block, zero,
                      zero_bits=q.bits, offset=1 << (q.bits - 1))
    return None


FORMAT = CompressedTensors()
