"""The fast products a layer can compute with, and the choice among them: measured once per shape, kept.

A `Product` computes `x W^T` from a layer's stored tensors (`format.Product`). Two families here:

- `Native`: tpkit's compiled small-batch product (`native.py`, `gemv.c`), reading the stored tensors in place: the
  values (bf16 / fp16 bits, int8 or uint8 values, packed int4 pairs, FP8 bits), the scales (float32, bf16, fp16) and
  the zero points (int8, or packed int32 words), the values' storage offset a scalar. So `resident` keeps nothing
  beside the stored tensors (a float32 copy of scales only in a dtype the kernel does not read); a load holds its
  share of the file. Used for a few activation rows (decode); a longer input (prefill) multiplies by the
  dequantized slice. Its sums are float32 whatever the activations' dtype, and the weights are the format's values
  times their scales unrounded, so it applies where that is the weight the layer computes with: scales in float32
  (or the format's arithmetic in float32, HF FP8), or a half-precision compute dtype (whose own rounding is larger).
- torch's weight-only kernels (`kernels.py`, through `compressed_tensors.py`).

`fastest` times the candidates a format offers for one layer on its own shape (one activation row unless told, each
call on the next of copies of its tensors that together pass the caches, alternating; a candidate whose call in cache
is already slower than another's from memory is not timed further) and returns the fastest; the
choice is kept per (products, shape, dtype, rows, threads), so a model's repeated layers measure once. `dense_linear`
is the same choice for a dense bf16 / fp16 / float32 weight (a linear layer of an unquantized model, split or kept
whole): torch's `F.linear` or the native product.
"""
from __future__ import annotations

import threading
import time
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from . import native
from .format import Product

MAX_ROWS = 8  # activation rows (batch x new tokens) up to which a decode product is used
_CHOSEN: dict[tuple, int] = {}
_LOCK = threading.Lock()


class Native(Product):
    """The compiled product on a layer's values (`kind`: `native.KINDS`; `rows`: the local output features), scales
    covering `block` = (rows, columns) of the local weight (`scale`: its stored name; None: none), zero points
    (`zero`: their stored name, `[rows / block[0], columns / block[1]]` once unpacked, packed `zero_bits` to an
    int32 word along the rows when not 0) and `offset` (the values' storage offset: 8 for compressed-tensors' int4,
    128 for its packed int8), each read in place by the kernel."""

    max_rows = MAX_ROWS

    def __init__(self, kind: str, values: str, rows: int, scale: str | None = None, block: tuple[int, int] = (1, 1),
                 zero: str | None = None, zero_bits: int = 0, offset: int = 0):
        self.kind, self.values, self.rows, self.scale = kind, values, rows, scale
        self.block, self.zero, self.zero_bits, self.offset = (int(block[0]), int(block[1])), zero, zero_bits, offset
        self.name = f"native {kind}"

    def key(self) -> tuple:
        return (self.name, self.block, self.offset, self.zero)

    def resident(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The stored tensors themselves (contiguous, as a load holds them); scales in a dtype the kernel does not
        read as a float32 copy, the only table it may make."""
        out = {"values": tensors[self.values].contiguous()}
        if self.scale is not None:
            s = tensors[self.scale]
            out["scales"] = (s if s.dtype in native.SCALE_KINDS else s.to(torch.float32)).contiguous()
        if self.zero is not None:
            out["zeros"] = tensors[self.zero].contiguous()
        return out

    def __call__(self, x: torch.Tensor, t: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return native.gemv(x, t["values"], self.kind, self.rows, t.get("scales"), t.get("zeros"), self.block,
                           self.offset, self.zero_bits)


def unrounded_applies(dtype: torch.dtype, scale_dtype: torch.dtype | None) -> bool:
    """Whether a product whose weight is the values times their scales unrounded (this module's native product,
    `fused.py`'s "words") computes a layer's weight as the format defines it (see the module docstring): float32
    scales (arithmetic in float32), or a half-precision compute dtype (whose own rounding is larger)."""
    return scale_dtype == torch.float32 or dtype in (torch.bfloat16, torch.float16)


def native_applies(dtype: torch.dtype, scale_dtype: torch.dtype | None) -> bool:
    """Whether the compiled product computes a layer's weight as the format defines it (`unrounded_applies`) and a
    compiler built it here."""
    return unrounded_applies(dtype, scale_dtype) and native.available()


# The bytes a choice's timing reads in rotation (copies of the layer's tensors, each call the next): past a last-level
# cache, as a decoded model's weights stream from memory. Timed hot (one weight called again and again), a 16 MB float32
# weight sat in this 2-core EPYC's 32 MB L3, where torch's `F.linear` won; from memory tpkit's product ran 1.5-1.7x
# faster, and half a float32 Llama's layers had taken the slower one (TP1 decode 64.0 ms/token, 59.5 chosen cold).
COLD_BYTES = 64 << 20


def _cold_copies(tensors: Mapping[str, torch.Tensor]) -> list[Mapping[str, torch.Tensor]]:
    """`tensors` and copies of them, `COLD_BYTES` in all (at least two entries, at most 64): what a timing rotates
    through."""
    nbytes = max(sum(t.nbytes for t in tensors.values()), 1)
    count = min(max(COLD_BYTES // nbytes, 2), 64)
    return [tensors] + [{n: t.clone() for n, t in tensors.items()} for _ in range(count - 1)]


def _time(product: Product, copies: Sequence[Mapping[str, torch.Tensor]], x: torch.Tensor) -> float:
    """Seconds per call of `product` at `x`, each call on the next of `copies` (cold: `_cold_copies`)."""
    residents = [product.resident(t) for t in copies]
    product(x, residents[-1])
    start = time.perf_counter()
    for resident in residents:
        product(x, resident)
    return (time.perf_counter() - start) / len(residents)


def _hot(product: Product, tensors: Mapping[str, torch.Tensor], x: torch.Tensor) -> float:
    """The fastest of 3 calls of `product` on the layer's own tensors after an untimed one: hot in the caches, so
    a lower bound of its cold call (`fastest` times from memory only a candidate this bound leaves in the race)."""
    resident = product.resident(tensors)
    product(x, resident)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        product(x, resident)
        best = min(best, time.perf_counter() - start)
    return best


def _cold_race(products: Sequence[Product], tensors: Mapping[str, torch.Tensor], x: torch.Tensor,
               traced: bool) -> int:
    """The index of the fastest of `products` read from memory: the best of 3 alternating rounds over copies of the
    layer's tensors. A candidate whose hot call (`_hot`) is already no faster than the best cold one so far cannot
    win and is not timed cold: torch's int4 kernel repacks its weight on every call, and timing it over the
    copies had cost an int4 checkpoint's load 0.7 s."""
    hot = [_hot(p, tensors, x) for p in products]
    copies = [tensors, tensors] if traced else _cold_copies(tensors)
    cold = [float("inf")] * len(products)
    for i in sorted(range(len(products)), key=hot.__getitem__):  # the first round, hot-fastest first
        if hot[i] < min(cold):
            cold[i] = _time(products[i], copies, x)
    racing = [i for i in range(len(products)) if cold[i] < float("inf")]
    for _ in range(2):  # two more alternating rounds among those timed
        for i in racing:
            cold[i] = min(cold[i], _time(products[i], copies, x))
    return min(range(len(products)), key=cold.__getitem__)


def fastest(products: Sequence[Product], tensors: Mapping[str, torch.Tensor], in_features: int,
            dtype: torch.dtype, rows: int = 1) -> Product | None:
    """The fastest of `products` (a layer's candidates, given its stored tensors) at `rows` activation rows of
    `dtype`, or None when there is none; measured once per (candidates, shape, dtype, rows, threads)."""
    if len(products) <= 1:
        return products[0] if products else None
    traced = torch.compiler.is_compiling()  # (`_traced_dense_choice`: fake tensors, sizes maybe symbolic, no copies)
    shapes = tuple(tuple(t.shape) for t in tensors.values())
    key = (tuple(p.key() for p in products), shapes, dtype, rows, torch.get_num_threads())
    with _LOCK:
        chosen = _CHOSEN.get(key)
    if chosen is None:
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        with torch.inference_mode():
            chosen = _cold_race(products, tensors, x, traced)
        with _LOCK:
            _CHOSEN[key] = chosen
    return products[chosen]


class _Torch(Product):
    """`F.linear` on a dense weight (the candidate `dense_linear` measures the native product against)."""

    name = "torch"

    def key(self) -> tuple:
        return (self.name,)

    def resident(self, tensors):
        return dict(tensors)

    def __call__(self, x, t):
        return F.linear(x, t["weight"])


HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # the half-precision dense dtypes (their own BLAS tables)
# The dense weight dtypes `dense_linear` may multiply natively. float32 too: at decode's rows torch's `F.linear` read
# a float32 weight at 22 GB/s where the native product read 35 (one process, 2-core EPYC, 46 MiB weights).
NATIVE_DENSE = {**HALF, torch.float32: "fp32"}


def dense_applies(weight_dtype: torch.dtype, rows: int, needs_grad: bool, cpu: bool = True) -> bool:
    """Whether a dense layer's product at `rows` activation rows may be tpkit's own (`dense_linear`): a bf16 / fp16 /
    float32 weight on the CPU, a decode's few rows, no gradient asked for (the native product has no backward). The one
    rule the runtime and the speed estimate both read (`estimate/ops.py` prices such a matmul as that product)."""
    return weight_dtype in NATIVE_DENSE and cpu and rows <= MAX_ROWS and not needs_grad


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`x weight^T` for a dense bf16 / fp16 / float32 `weight` by the faster of `F.linear` and the native product
    (measured on the first call of each shape and row count, `dense_choice`), or None where the native product does
    not apply (`dense_applies`; no compiler; under autocast, whose dtype rules are torch's) or was slower: the caller
    uses `F.linear`."""
    if not x.is_cpu:  # (an eager GPU decode is bound by the host's calls: it pays no checks for a CPU product)
        return None
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    fake = not torch.compiler.is_compiling() and (native.fake(x) or native.fake(weight))  # a traced step: no data
    n, k = weight.shape
    rows = x.numel() // k
    if fake or not dense_applies(weight.dtype, rows, grad, x.device.type == "cpu") or \
            torch.is_autocast_enabled(x.device.type):
        return None
    if x.shape[-1] != k or x.dtype != weight.dtype or x.device != weight.device:
        return None  # `F.linear` raises its error (the product, past its first call, would read what is not there)
    kind = NATIVE_DENSE[weight.dtype]
    if torch.compiler.is_compiling():
        chosen = _traced_dense_choice(kind, n, k, rows, x.dtype)
    else:
        chosen = dense_choice(kind, n, k, rows, x.dtype, weight)
    if not chosen or not native.available():
        return None
    return native.gemv(x, weight, kind, n)


def faster_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, its product by `dense_linear` where that applies and was faster: the one product
    of a split layer's shard (`tpkit.nn.linear`) and of a Linear kept whole (`tpkit.nn.decode_linear`)."""
    y = dense_linear(x, weight)
    if y is None:
        return F.linear(x, weight, bias)
    return y if bias is None else y + bias


STAND_IN_ROWS = 8192  # the most weight rows a stand-in weight has (an LM head's vocabulary: its rate is the same)


def dense_choice(kind: str, n: int, k: int, rows: int, dtype: torch.dtype, weight: torch.Tensor | None = None) -> int:
    """1 where the native product of a dense `[n, k]` weight of `kind` outran `F.linear` at `rows` activation rows of
    `dtype`, else 0; measured once per (shape, rows, dtype, threads), on `weight`, or without one on a random stand-in
    of its shape (at most `STAND_IN_ROWS` rows). Per row count: the native product's time grew with the rows (1 to 3x
    from 1 to 8 rows before it shared each decoded weight row among them) where torch's stayed flat, so a choice made
    at one row could be the slower one."""
    key = ("dense", kind, n, k, rows, dtype, torch.get_num_threads())
    with _LOCK:
        chosen = _CHOSEN.get(key)
    if chosen is None:
        if not native.available():
            return 0
        if weight is None:
            weight_dtype = next(d for d, name in NATIVE_DENSE.items() if name == kind)
            n = min(n, STAND_IN_ROWS)
            weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0), dtype=weight_dtype)
        candidate = Native(kind, "weight", n)
        chosen = 1 if fastest([_Torch(), candidate], {"weight": weight}, k, dtype, rows) is candidate else 0
        with _LOCK:
            _CHOSEN[key] = chosen
    return chosen


@torch.compiler.assume_constant_result
def _traced_dense_choice(kind: str, n: int, k: int, rows: int, dtype: torch.dtype) -> int:
    """`dense_choice` as a compiled graph's constant: dynamo runs it when it traces the layer (where the layer's weight
    is a fake tensor, so a choice not made before is measured on a stand-in), and the graph holds the product chosen.
    A model compiled before any eager call used to find no choice there and run `F.linear` at every bf16 layer (TP2
    bf16 decode 43-47 ms/token against 38-41 with the choice)."""
    return dense_choice(kind, n, k, rows, dtype)
