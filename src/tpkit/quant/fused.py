"""A quantized layer's decode product on a GPU: the format's dequantization and the product in one compiled kernel.

On the CPU a decode step's quantized layers take tpkit's compiled product (`native.py`). On a GPU they multiplied by
the dequantized slice: one kernel wrote the dense weight in the compute dtype, cuBLAS read it back, so an int4 layer
moved about 9 bytes per weight where the stored tensors hold half a byte. Here the product of a few activation rows
(`products.MAX_ROWS`) is a float32 reduction that inductor compiles into one kernel reading each stored value once
(as gpt-fast's int8 weight-only decode does). Two ways to write it, each a candidate:

- "generic": `sum_i x[i] * w[o, i]` with `w` the format's own dequantization (`dequant.py`, the one function every
  format's weight comes from) inlined: any format, any split, the weight rounded to the compute dtype as
  `layer.weight` is; the result is the dequantized product's to the summation order.
- "words": for values packed along the input into int32 words (compressed-tensors' `pack-quantized`), one reduction
  over the words: each word is loaded once, its `32 / bits` values unpacked by shifts against the activations they
  meet, the offset and zero point subtracted once per word through the activations' sum, the scale applied once per
  group. Its weights are the values times their scales unrounded, so it applies where the native CPU product does
  (`products.unrounded_applies`: float32 scales or a half-precision compute dtype).

Which runs is measured once per layer signature (scheme, stored shapes, local shape, compute dtype) and row count on
the device, against the dequantized product, and kept: on an H200 (BENCHMARKS.md) "generic" cut FP8's decode step
4-5x and packed int8's 2.4-2.6x but made packed int4's slower, where "words" cut int4's 5.4x and int8's 3.9x.
Each compiled candidate has its own copy of the function's code, so dynamo keeps its entries apart (one code object
shared by every shape would hit its recompile limit after 8 and fall back to eager without a word). Inside a model
the user compiles, "generic" is traced inline.

`TPKIT_FUSED` (read when tpkit is imported; `set_policy` changes it later): "0" turns it off; "generic" or "words"
forces that candidate on any device, the CPU included (tests run the compiled kernels here); default: the measured
choice on CUDA tensors where Triton is present. A CPU layer's decode call pays 0.1 us for all this (reading the
variable on every call had cost 0.24 ms of an 8.1 ms TP2 int4 token).
"""
from __future__ import annotations

import os
import threading
import time
import types
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from .dequant import Maps, on_grid, dequantize
from .format import Format
from .products import MAX_ROWS, unrounded_applies
from .schemes import StoredTensor, WeightQuant

ENV = "TPKIT_FUSED"
CANDIDATES = ("generic", "words")
POLICY = os.environ.get(ENV, "")  # "", "0" or a candidate's name (the module docstring)
_CHOSEN: dict[tuple, Callable | None] = {}  # per (signature, rows, x's dtype and device, policy): the pick
_COMPILED: dict[tuple, Callable] = {}  # per (signature, candidate): the compiled function
_LOCK = threading.Lock()
Product = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Maps], torch.Tensor]


@torch.compiler.assume_constant_result
def _triton() -> bool:
    """Whether Triton is present (a constant to a compiled graph: dynamo does not trace the cached check)."""
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()


def set_policy(value: str) -> None:
    """Set the policy `TPKIT_FUSED` set at import: "" (the default), "0", "generic" or "words"."""
    global POLICY
    if value not in ("", "0") + CANDIDATES:
        raise ValueError(f"tpkit.quant.fused.set_policy: {value!r} is not one of '', '0', " + ", ".join(
            repr(c) for c in CANDIDATES))
    POLICY = value


def wanted(x: torch.Tensor) -> bool:
    """Whether a product of `x` (`[..., in_features]`, no gradient asked for) may take a fused kernel: a device the
    policy (`POLICY`, the module docstring) allows, a few rows, and real data."""
    # (`is_cuda` costs 0.07 us a call, `x.device.type` 0.25)
    if not (POLICY in CANDIDATES or (POLICY == "" and x.is_cuda and _triton())):
        return False
    if x.numel() > MAX_ROWS * x.shape[-1]:
        return False
    # a traced step (the estimate) prices the dequantized product it has always priced
    return torch.compiler.is_compiling() or not isinstance(x, torch._subclasses.fake_tensor.FakeTensor)


def generic(q: WeightQuant, specs: Mapping[str, StoredTensor], shape: tuple[int, int], dtype: torch.dtype,
            fmt: Format) -> Product:
    """The "generic" candidate, uncompiled: the product by the layer's dequantized weight, as one reduction."""

    def generic_product(x: torch.Tensor, tensors: Mapping[str, torch.Tensor], maps: Maps) -> torch.Tensor:
        w = dequantize(q, specs, tensors, maps, shape, dtype, fmt)
        return (x.unsqueeze(-2).float() * w.float()).sum(-1).to(x.dtype)

    return generic_product


def words_apply(q: WeightQuant, shape: tuple[int, int], dtype: torch.dtype, scale_dtype: torch.dtype | None,
                mapped: bool) -> bool:
    """Whether the "words" candidate computes this layer: values packed along the input, whole groups per word and
    per rank (no `positions` map, no act-order), and the unrounded weight allowed (the module docstring)."""
    per = 32 // q.bits if q.bits else 0
    out, in_ = shape
    group = q.group_size if q.strategy == "group" else in_
    return (q.layout == "ct_pack" and q.strategy in ("group", "channel") and not mapped and not q.act_order
            and bool(per) and in_ % per == 0 and bool(group) and group % per == 0 and in_ % group == 0
            and unrounded_applies(dtype, scale_dtype))


def words(q: WeightQuant, specs: Mapping[str, StoredTensor], shape: tuple[int, int], dtype: torch.dtype,
          fmt: Format) -> Product:
    """The "words" candidate, uncompiled (see the module docstring; `words_apply` says where it applies)."""
    bits, (out, in_) = q.bits, shape
    per, mask, offset = 32 // bits, (1 << bits) - 1, 1 << (bits - 1)
    r = fmt.roles(q)

    def words_product(x: torch.Tensor, tensors: Mapping[str, torch.Tensor], maps: Maps) -> torch.Tensor:
        packed = tensors[r.values].narrow(1, 0, in_ // per)  # [out, words]
        s = on_grid(specs[r.scale], tensors[r.scale], maps, shape).float()  # [out, groups]
        groups = s.shape[1]
        xw = x.reshape(-1, in_ // per, per).float()  # [rows, words, per]
        rows = xw.shape[0]
        acc = xw[:, None, :, 0] * (packed & mask).float()
        for k in range(1, per):
            acc = acc + xw[:, None, :, k] * ((packed >> (bits * k)) & mask).float()
        shift = torch.full((), offset, dtype=torch.float32, device=x.device)
        if r.zero_point in tensors:
            z = on_grid(specs[r.zero_point], fmt.values(q, r.zero_point, tensors[r.zero_point]), maps, shape)
            shift = (z.float() + offset).view(1, out, groups, 1)
        acc = acc.view(rows, out, groups, -1) - xw.sum(-1).view(rows, 1, groups, -1) * shift
        y = (acc * s.view(1, out, groups, 1)).sum((-1, -2))
        return y.reshape(*x.shape[:-1], out).to(x.dtype)

    return words_product


def _compiled(fn: Callable) -> Callable:
    """`fn` compiled by inductor, on a copy of its code object: dynamo keeps its compiled entries per code object."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(own, fullgraph=True)


def _timed(fn: Callable, calls: int = 10) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return time.perf_counter() - start


def chosen(x: torch.Tensor, q: WeightQuant, specs: Mapping[str, StoredTensor], tensors: Mapping[str, torch.Tensor],
           maps: Maps, shape: tuple[int, int], dtype: torch.dtype, fmt: Format) -> Callable | None:
    """The compiled candidate this layer's signature runs at `x`'s rows (None: the dequantized product was fastest),
    measured on the first call of each row count and kept; `TPKIT_FUSED` naming a candidate forces it."""
    setting = POLICY
    scale_dtype = tensors[fmt.roles(q).scale].dtype
    signature = (q, tuple(sorted(specs.items())), tuple(shape), dtype, scale_dtype, fmt.method, tuple(maps))
    key = (signature, x.numel() // shape[1], x.dtype, x.device.type, setting)
    with _LOCK:
        if key in _CHOSEN:
            return _CHOSEN[key]
    makers = {"generic": generic}
    if words_apply(q, shape, dtype, scale_dtype, bool(maps)):
        makers["words"] = words
    if setting in CANDIDATES:
        makers = {setting: makers[setting]} if setting in makers else {}
    found = {}
    for n, make in makers.items():  # compiled once per signature: another row count recompiles it (rows dynamic)
        with _LOCK:
            if (signature, n) not in _COMPILED:
                _COMPILED[signature, n] = _compiled(make(q, specs, tuple(shape), dtype, fmt))
            found[n] = _COMPILED[signature, n]
    pick = next(iter(found.values()), None)
    if setting not in CANDIDATES:  # measured against the dequantized product, alternating rounds, the best of each
        ways = dict(found, dequant=lambda x_, t_, m_: F.linear(x_, dequantize(q, specs, t_, m_, shape, dtype, fmt)))
        best: dict[str, float] = {}
        for _ in range(3):  # in the caller's grad mode, which the compiled entries are guarded on
            for n, fn in ways.items():
                best[n] = min(best.get(n, float("inf")), _timed(lambda: fn(x, tensors, maps)))
        pick = found.get(min(best, key=best.get))
    with _LOCK:
        _CHOSEN[key] = pick
    return pick


def linear(x: torch.Tensor, q: WeightQuant, specs: Mapping[str, StoredTensor], tensors: Mapping[str, torch.Tensor],
           maps: Maps, shape: tuple[int, int], dtype: torch.dtype, fmt: Format) -> torch.Tensor | None:
    """`x W^T` for a layer's stored `tensors` (and `positions` maps) by its chosen fused kernel, or None where the
    dequantized product is the faster (the caller multiplies by `layer.weight`); traced inline ("generic") when
    the caller is itself being compiled."""
    if torch.compiler.is_compiling():
        return generic(q, specs, tuple(shape), dtype, fmt)(x, tensors, maps)
    fn = chosen(x, q, specs, tensors, maps, shape, dtype, fmt)
    return None if fn is None else fn(x, tensors, maps)
