"""The linear layers a quantized checkpoint stores packed, in the speed estimate: which product each one runs, the
bytes it reads, and what that takes on this machine.

A rank loads such a layer as a `tpkit.nn.quantized.QuantMethod`: its stored tensors (packed values, scales) for the
rank's slice, and, for a few activation rows (decode), the fastest product it measured on that slice among those
its format offers at the compute dtype (`Format.products`: tpkit's compiled product, torch's int4 / int8 kernels;
`tpkit.quant.products.fastest`); where none applies (the scales in another dtype than the layer computes in, a split
that cuts groups, act-order, more than `MAX_ROWS` rows, an input that needs a gradient) it dequantizes its slice per
call and multiplies by it. The estimate follows the same rules:

* `quantized_layers`: for the weightless model converted for one rank, each quantized layer's `QuantizedLayer`: its
  stored bytes on that rank (`tpkit.quant.stored_layout` of its dense layout, as the load holds them) and its path,
  "kernel" or "dequantize", from the same `Format.products` the load asks. The fake step records each such layer's
  matmul as its product (`ops.OpRecorder.quantized_layers`), one op of the step like any other;
* `quantized_times`: what that op takes, priced by the one composition (`predict.kernel_times`). A kernel: the
  calibrated call (`machine.QuantizedRate` of "kind/dtype": fixed cost + stored bytes / the bytes/s measured at its
  rows); dequantized: the dense product at the dense rates plus the dequantization ("kind/dtype/dequantize");
* `measure_quantized` (the calibration, `tpkit estimate --calibrate`): builds the layers as the load does (compressed-
  tensors int4 group 128, int8 per channel, FP8 per channel, symmetric; each with the scales in the compute dtype,
  bfloat16 and float32), lets each pick its product as a load does, and times its call at 1 to 8 rows over two
  layer sizes streamed from memory (every rank at once, as the step's ranks run), and the dequantization alone. A
  call's fixed cost is what it costs beyond the linear call of the framework terms that price its models
  (`framework_linear_call`: a layer of their tiny model, in their dtype, as a conversion leaves it), which those
  terms and the per-op cost price already (counting the whole call twice priced TP2 decode 18-35% high on a quiet
  box; set against torch's tiny bf16 product, 16 us, every bf16 call's ~7 us went unpriced).

A dense bf16 / fp16 / float32 layer of a converted model is priced the same way at decode's rows: there its
forward runs tpkit's product (`tpkit.quant.products.dense_linear`), not a BLAS call, so `dense_layers` records its
matmul as a "dense" layer whose stored bytes are its weight's, and the calibration times that product as it times
the quantized ones ("dense/bfloat16", "dense/float16", "dense/float32"). More rows, or a gradient, and it is an
ordinary matmul, priced at its dtype's measured rates (`MachineRates.dtype_gemm`).

A profile without those tables (measured before them, or a datasheet machine) is priced by a rule, said in the
estimate's note (`quantized_note`): a kernel streams the stored bytes at the measured weight-streaming bandwidth; a
dequantization makes `DEQUANTIZE_PASSES` elementwise passes over the stored and the dense bytes.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Mapping

import torch
from torch import nn

from ..convert.transformers_threads import config_dtype
from ..quant.products import MAX_ROWS, NATIVE_DENSE  # activation rows up to which a layer runs its product
from .machine import FRAMEWORK_WIDTH, MachineRates, QuantizedRate, framework_dtypes
from .ops import DENSE, dtype_name

DEQUANTIZE_PASSES = 3  # the rule's elementwise passes of a dequantization: unpack, (q - z) * s, the cast
CALIBRATED = {"int4": dict(layout="ct_pack", bits=4, strategy="group", group_size=128),
              "int8": dict(layout="ct_pack", bits=8, strategy="channel"),
              "fp8": dict(layout="float", bits=8, strategy="channel")}
CALIBRATED_DTYPES = (torch.bfloat16, torch.float32)
ROWS = (1, 2, 4, 8)
# (out, in) of the layer sizes a call's rates are measured at: the input widths of a model's projections (a wide
# input, as a down projection's, streams more slowly); the middle one's rates are `QuantizedRate.rows`
SIZES = ((1024, 1024), (4096, 2048), (2048, 5632))
COLD_BYTES = 128 << 20  # stored bytes the timed layers rotate through: past the caches, as a model's layers are


@dataclasses.dataclass(frozen=True)
class QuantizedLayer:
    """One quantized linear layer of the traced rank: `kind` ("int4", "int8", "fp8"), the compute `dtype`'s name,
    `path` ("kernel": a product of its format; "dequantize": the slice dequantized per call), `products` (the
    candidates the load measures), the stored bytes the rank holds and the dense weight's bytes they replace."""

    name: str
    kind: str
    dtype: str
    path: str
    products: tuple[str, ...]
    stored_bytes: int
    dense_bytes: int
    scheme: str

    @property
    def key(self) -> str:
        """Its `MachineRates.quantized` entry."""
        return f"{self.kind}/{self.dtype}" + ("/dequantize" if self.path == "dequantize" else "")


def kind_of(scheme) -> str:
    return "fp8" if scheme.layout == "float" else f"int{scheme.bits}"


def checkpoint_dtype(config, default: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint stores its floating tensors (and so its scales) in: its config's, else `default`."""
    found = config_dtype(config)
    return found if found is not None and found.is_floating_point else default


def loaded_dtype(config, default: torch.dtype | None) -> torch.dtype | None:
    """The dtype to estimate a config in: a quantized checkpoint's own (what `tpkit.from_pretrained` loads it in, and
    the dtype its kernels apply in: scales and activations alike), else `default`."""
    from ..quant import config_quantization

    quantized = config is not None and not isinstance(config, nn.Module) and config_quantization(config) is not None
    return checkpoint_dtype(config, default or torch.bfloat16) if quantized else default


def _stored(scheme, dense, scale_dtype: torch.dtype) -> tuple[int, bool]:
    """(bytes the rank holds of the layer's stored tensors, whether some needs a `positions` map) for the dense
    weight's layout `dense`, as the load splits them; a split the load would not make (groups cut): the stored
    tensors of the rank's local shape, no map."""
    from ..quant import QuantizationError, positions, stored_layout, stored_tensors

    def size(spec, shape) -> int:
        return math.prod(shape) * (spec.dtype.itemsize if spec.dtype else scale_dtype.itemsize)
    try:
        specs = stored_tensors(scheme, *dense.full_shape)
        held = sum(size(s, stored_layout(dense, s, "").local_shape) for s in specs)
        mapped = any(positions(dense, s, i) is not None for s in specs for i in range(len(s.dims)))
        return held, mapped
    except QuantizationError:
        return sum(size(s, s.shape) for s in stored_tensors(scheme, *dense.local_shape)), False


def quantized_layers(model: nn.Module, work: nn.Module) -> dict[str, QuantizedLayer]:
    """The linear layers of `model` (weightless, unconverted: the checkpoint's module names and classes) that its
    config stores quantized, as the rank `work` (its copy converted for one rank) holds them; {} for a dense one."""
    from ..convert import shard_layouts
    from ..quant import config_quantization

    config = getattr(model, "config", None)
    quant = config_quantization(config) if config is not None else None
    if quant is None:
        return {}
    layouts = shard_layouts(work)
    found = {}
    for name, module in model.named_modules():
        scheme = quant.scheme_for(name, type(module).__name__)
        dense = layouts.get(f"{name}.weight")
        if scheme is None or dense is None or len(dense.full_shape) != 2:
            continue
        dtype = work.get_submodule(name).weight.dtype
        scale_dtype = checkpoint_dtype(config, dtype)
        stored, mapped = _stored(scheme, dense, scale_dtype)
        products = scheme.format.products(scheme, tuple(dense.local_shape), mapped, dtype, scale_dtype)
        found[name] = QuantizedLayer(name, kind_of(scheme), dtype_name(dtype),
                                     "kernel" if products else "dequantize", tuple(p.name for p in products), stored,
                                     math.prod(dense.local_shape) * dtype.itemsize, scheme.describe())
    return found


def dense_layers(work: nn.Module) -> dict[str, QuantizedLayer]:
    """The linear layers of the converted rank `work` (split ones, and those kept whole, `DecodeLinear`) whose weight
    is dense bf16 / fp16 / float32: where
    `products.dense_applies` (decode's rows, no gradient) each runs tpkit's product (`products.dense_linear`: the
    faster of `F.linear` and tpkit's compiled one, chosen on the first call of each shape and row count), priced as
    calibrated ("dense/bfloat16", "dense/float32"), not as a BLAS call. A profile without that entry (measured
    before it; a datasheet machine, whose GPU runs no such product) prices it as any matmul (`predict.kernel_times`)."""
    from ..nn.decode_linear import DecodeLinear
    from ..nn.linear import ColumnParallelLinear, RowParallelLinear

    found = {}
    for name, module in work.named_modules():
        weight = getattr(module, "weight", None)
        linear = isinstance(module, (ColumnParallelLinear, RowParallelLinear, DecodeLinear))
        if linear and getattr(module, "quant_method", None) is None and weight is not None and \
                weight.dtype in NATIVE_DENSE:
            nbytes = weight.numel() * weight.element_size()
            found[name] = QuantizedLayer(name, DENSE, dtype_name(weight.dtype), "kernel",
                                         ("torch", f"native {NATIVE_DENSE[weight.dtype]}"), nbytes, nbytes,
                                         f"dense {NATIVE_DENSE[weight.dtype]}")
    return found


def quantized_times(op, rates: MachineRates) -> tuple[float, float]:
    """(seconds bound by arithmetic, seconds bound by bytes) of the traced op `op`, the product of a quantized layer
    (`op.quantized`) at `op.mnk`'s rows, as the load runs it (see the module docstring)."""
    layer, (m, n, k) = op.quantized, op.mnk
    if layer.path == "kernel" and m <= MAX_ROWS:
        rate = rates.quantized.get(layer.key)
        return 0.0, (rate.seconds(layer.stored_bytes, m, k) if rate is not None
                     else layer.stored_bytes / rates.weight_bandwidth(False))
    rate = rates.quantized.get(f"{layer.kind}/{layer.dtype}/dequantize")
    dequantize = (rate.seconds(layer.stored_bytes) if rate is not None
                  else DEQUANTIZE_PASSES * (layer.stored_bytes + layer.dense_bytes) / rates.copy_bandwidth)
    arithmetic = op.flops / rates.flops_rate(m, math.sqrt(n * k), False, layer.dtype)
    streamed = (op.nbytes - layer.stored_bytes + layer.dense_bytes) / rates.weight_bandwidth(False)
    return (arithmetic, dequantize) if arithmetic > streamed else (0.0, dequantize + streamed)


def quantized_note(layers: Mapping[str, QuantizedLayer], rates: MachineRates) -> str | None:
    """What the estimate priced for a quantized checkpoint's layers (one line, the same for every number of ranks
    sharing a profile's rates: the figures are in `tpkit estimate --calibrate`'s terms), or None for none."""
    if not layers:
        return None
    parts = []
    for key in sorted({layer.key for layer in layers.values()}):
        some = next(layer for layer in layers.values() if layer.key == key)
        rate = rates.quantized.get(key)
        if some.path == "kernel":
            what = (f"its kernel as calibrated ({rate.product}: the cost a call adds to the framework's linear call + "
                    f"the stored bytes at the rate measured at its rows and input width)" if rate is not None else
                    f"the fastest of its products ({', '.join(some.products)}), not calibrated: the stored bytes at "
                    f"the measured weight-streaming bandwidth (a rule)")
        else:
            what = ("dequantized per call, then the dense product" + (
                " (the dequantization as calibrated)" if rate is not None else
                f" (the dequantization not calibrated: {DEQUANTIZE_PASSES} elementwise passes over the stored and "
                f"dense bytes, a rule)") + ": no product of its format applies to the slice at this dtype")
        parts.append(f"{some.scheme} in {some.dtype}: {what}")
    return "linear layers stored quantized, each priced as the product a rank runs (stored bytes, not dense): " + \
        "; ".join(parts)


# ------------------------------------------------------------------------------------------------ calibration
def _layer(kind: str, dtype: torch.dtype, scale_dtype: torch.dtype, out: int, in_: int, gen: torch.Generator):
    """A quantized linear layer built as a load builds it (`QuantizedLinear`), its stored tensors random and valid
    (FP8 values spread over the format's range as a checkpoint's are), its product picked as after a load
    (`after_loading`)."""
    from ..nn.quantized import QuantizedLinear, QuantMethod
    from ..quant import WeightQuant

    scheme = WeightQuant("compressed-tensors", symmetric=True, **CALIBRATED[kind])
    method = QuantMethod(scheme, dtype, {scheme.scale_name: scale_dtype})
    layer = QuantizedLinear(in_, out, False, method, device="cpu")
    for name, spec in method.specs.items():
        t = layer._buffers[name]
        if t.dtype == torch.int64:
            t.copy_(torch.tensor([out, in_]))
        elif t.dtype in (torch.int32, torch.int8):
            t.copy_(torch.randint(-2 ** 31 if t.dtype == torch.int32 else -127, 2 ** 31 - 1 if t.dtype == torch.int32
                                  else 127, t.shape, dtype=t.dtype, generator=gen))
        elif t.dtype == torch.float8_e4m3fn:
            # as quantized per channel: each row's largest value at FP8's largest. Unscaled, 1% of N(0, 1) is FP8
            # subnormal, a denormal input the CPU multiplies in microcode: the product timed 1.2 GB/s, not 8
            r = torch.randn(t.shape, generator=gen)
            t.copy_((r * (torch.finfo(t.dtype).max / r.abs().amax(-1, keepdim=True))).to(t.dtype))
        else:  # scales
            t.copy_(torch.rand(t.shape, generator=gen) * 0.01 + 0.001)
    method.after_loading(layer)
    return layer, method


def _pool(nbytes: int, cold: int) -> int:
    """How many copies of a layer of `nbytes` a timing rotates through: `cold` bytes' worth (past the caches, as a
    model's layers are), from 2 to 128."""
    return max(2, min(cold // nbytes, 128))


def _per_call(calls: list, repeats: int, barrier) -> float:
    """Median seconds per call of one pass over `calls` (after an untimed pass), every rank in step."""
    for c in calls:
        c()
    times = []
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        for c in calls:
            c()
        times.append((time.perf_counter() - start) / len(calls))
    return statistics.median(times)


def _fitted(product: str, timed: dict[int, list[tuple[float, float]]], tiny: float, framework: float) -> QuantizedRate:
    """A `QuantizedRate` from {rows: [(stored bytes, seconds) at each of `SIZES`]}, the call of a tiny layer of the
    format (`tiny`) and the framework terms' linear call (`framework`, `framework_linear_call`), seconds each. The
    fixed cost is what a call costs beyond that one (`tiny - framework`, never below 0): a linear layer's module call
    and its op's own fixed cost are priced already by the framework terms and the per-op cost; each size's rate at
    each row count is its stored bytes over its time less the tiny call's (a line anchored at a measured call, not
    extrapolated from two sizes, whose intercept swung 23-271 us at 2 ranks on a shared box)."""
    def rates(i: int) -> tuple[tuple[int, float], ...]:
        return tuple((m, sizes[i][0] / max(sizes[i][1] - tiny, 0.1 * sizes[i][1])) for m, sizes in sorted(timed.items()))
    return QuantizedRate(product, max(tiny - framework, 0.0), rates(1),
                         tuple((SIZES[i][1], rates(i)) for i in range(len(SIZES))))


def _intercept(product: str, timed: dict[int, list[tuple[float, float]]]) -> QuantizedRate:
    """A `QuantizedRate` from {rows: [(stored bytes, seconds) at each size]} of a call with no dense counterpart
    (the dequantization alone): the fixed cost where the line through the first two sizes meets zero bytes (never
    below 0), the rate from the second less it."""
    fixed = []
    for (s1, t1), (s2, t2), *_ in timed.values():
        fixed.append(max(t1 - s1 * (t2 - t1) / (s2 - s1), 0.0) if t2 > t1 else 0.0)
    a = min(statistics.median(fixed), 0.9 * min(t for pair in timed.values() for _, t in pair))
    return QuantizedRate(product, a, tuple((m, s2 / (t2 - a)) for m, (_, (s2, t2), *_) in sorted(timed.items())))


TINY = (256, 256)  # (out, in) of the tiny layers whose calls anchor the fit: a few KiB, in every product's range


def framework_linear_call(repeats: int, barrier, dtype: torch.dtype = torch.float32) -> float:
    """Seconds per call at one row of the linear layer the framework terms measured and priced: a `dtype`
    `FRAMEWORK_WIDTH` square layer as a conversion leaves it on one rank (`adopt_decode_paths`: its decode product
    chosen as a model's is). What a decode product's call costs beyond it is that product's fixed cost."""
    from ..nn.decode import adopt_decode_paths

    holder = nn.Sequential(nn.Linear(FRAMEWORK_WIDTH, FRAMEWORK_WIDTH, bias=False)).to(dtype)
    adopt_decode_paths(holder)
    x = torch.randn(1, FRAMEWORK_WIDTH, generator=torch.Generator().manual_seed(0)).to(dtype)
    return _per_call([lambda: holder[0](x)] * 200, repeats, barrier)


def _tiny_call(kind: str, dtype: torch.dtype, gen: torch.Generator, repeats: int, barrier) -> float:
    """Seconds per call at one row of a tiny layer of `kind` in `dtype`: the fixed cost the fit anchors to."""
    layer, _ = _layer(kind, dtype, dtype, *TINY, gen)
    x = torch.randn(1, TINY[1], generator=gen).to(dtype)
    return _per_call([lambda: layer(x)] * 200, repeats, barrier)


def measure_quantized(comm=None, repeats: int = 5, quick: bool = False) -> dict[str, QuantizedRate]:
    """{"kind/dtype": the calibrated call, "kind/dtype/dequantize": the dequantization alone} for the `CALIBRATED`
    formats at `CALIBRATED_DTYPES`, and "dense/bfloat16", "dense/float16", "dense/float32": a dense layer's decode
    product (see the module docstring); on every rank of `comm` at once when given. `quick`: int4, int8 and dense in bfloat16 only,
    at 1 and 8 rows over a quarter of the bytes, no dequantization (a few seconds)."""
    barrier = comm.barrier if comm is not None else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    kinds, dtypes = (("int4", "int8"), (torch.bfloat16,)) if quick else (tuple(CALIBRATED), CALIBRATED_DTYPES)
    rows, cold = ((1, MAX_ROWS), COLD_BYTES // 4) if quick else (ROWS, COLD_BYTES)
    out = {}
    with torch.inference_mode():
        # the linear call of the framework terms that price each dtype's models: its own dtype's where a calibration
        # measures those terms (`framework_dtypes`), else float32's (~1 us apart a call on the 2-core box)
        calls = {d: framework_linear_call(repeats, barrier, d) for d in framework_dtypes(quick)}
        framework = lambda dtype: calls.get(dtype, calls[torch.float32])  # noqa: E731
        for kind in kinds:
            for dtype in dtypes:
                name = dtype_name(dtype)
                timed, dequantized, product = {m: [] for m in rows}, {1: []}, ""
                for o, i in SIZES:
                    first, method = _layer(kind, dtype, dtype, o, i, gen)
                    stored = sum(first._buffers[n].nbytes for n in method.specs)
                    layers = [first] + [_layer(kind, dtype, dtype, o, i, gen)[0]
                                        for _ in range(_pool(stored, cold) - 1)]
                    product = method.kernel or "dequantize"
                    for m in rows:
                        x = torch.randn(m, i, generator=gen).to(dtype)
                        timed[m].append((stored, _per_call([lambda L=L: L(x) for L in layers], repeats, barrier)))
                    if not quick:  # the dequantization: bound by its arithmetic, not by streaming
                        dequantized[1].append((stored, _per_call([lambda L=L: L.quant_method.weight(L)
                                                                  for L in layers[:2]], repeats, barrier)))
                out[f"{kind}/{name}"] = _fitted(product, timed, _tiny_call(kind, dtype, gen, repeats, barrier),
                                                framework(dtype))
                if not quick:
                    out[f"{kind}/{name}/dequantize"] = _intercept("dequantize", dequantized)
        for dtype in tuple(NATIVE_DENSE)[:1 if quick else None]:
            out[f"{DENSE}/{dtype_name(dtype)}"] = _measure_dense(dtype, rows, cold, repeats, barrier, gen,
                                                                 framework(dtype))
    return out


def _measure_dense(dtype: torch.dtype, rows, cold: int, repeats: int, barrier, gen, framework: float) -> QuantizedRate:
    """A dense `dtype` parallel layer's call at decode's `rows` (its forward: the product `dense_linear` chose),
    fitted as the quantized calls are: beyond the framework's linear call (`framework`, seconds: see
    `framework_linear_call`), its weights' bytes per second. Its tiny call is the layer's whole call, as the
    quantized layers' is."""
    from ..comm.shapes import ShapeCommunicator
    from ..nn.linear import ColumnParallelLinear
    from ..quant.products import dense_linear

    def layer(out: int, in_: int) -> ColumnParallelLinear:
        made = ColumnParallelLinear(in_, out, bias=False, comm=ShapeCommunicator(0, 1), dtype=dtype)
        with torch.no_grad():
            made.weight.normal_(0, 0.02, generator=gen)
        return made
    timed, chosen = {m: [] for m in rows}, []
    for o, i in SIZES:
        layers = [layer(o, i) for _ in range(_pool(o * i * dtype.itemsize, cold))]
        for m in rows:
            x = torch.randn(m, i, generator=gen).to(dtype)
            timed[m].append((o * i * dtype.itemsize, _per_call([lambda L=L: L(x) for L in layers], repeats,
                                                               barrier)))
            if (o, i) == SIZES[1]:  # what the layer chose at these rows (its first call chose), for the record
                chosen.append(f"{'torch' if dense_linear(x, layers[0].weight) is None else 'native'} at {m}")
    product = ", ".join(chosen)
    tiny = layer(*TINY)
    x = torch.randn(1, TINY[1], generator=gen).to(dtype)
    return _fitted(product, timed, _per_call([lambda: tiny(x)] * 200, repeats, barrier), framework)


def slowest(per_rank: list[Mapping[str, QuantizedRate]]) -> dict[str, QuantizedRate]:
    """Each entry from the rank slowest at it: the largest fixed cost, the lowest rate at each row count and width."""
    def lowest(tables) -> tuple[tuple[int, float], ...]:
        return tuple((m, min(dict(t)[m] for t in tables)) for m, _ in tables[0])
    return {k: QuantizedRate(per_rank[0][k].product, max(r[k].fixed_s for r in per_rank),
                             lowest([r[k].rows for r in per_rank]),
                             tuple((w, lowest([dict(r[k].widths)[w] for r in per_rank])) for w, _ in per_rank[0][k].widths))
            for k in per_rank[0]}


def quantized_saving(trace, setup, goal: str, item: int) -> float:
    """Bytes the traced rank (`fake_step.StepTrace`) of `setup` (`predict.Setup`) does not hold because a quantized
    checkpoint stores its linear layers packed: the traced model is dense, so the dense weights of those layers (and,
    training, their gradients and AdamW states: the packed base is frozen) less the stored tensors the rank holds
    (`QuantizedLayer`: the load's split, in whole groups). 0 for a dense config. Their speed is priced on those stored tensors too (`quantized_times`)."""
    dense = sum(q.dense_bytes for q in trace.quantized)
    frozen = dense / item * (item + 8) if goal == "train" else 0.0
    if goal == "train" and setup.dp_mode == "fsdp" and setup.engine > 1:
        frozen /= setup.engine
    return dense - sum(q.stored_bytes for q in trace.quantized) + frozen


__all__ = ["QuantizedLayer", "dense_layers", "measure_quantized", "quantized_layers", "quantized_note",
           "quantized_saving", "quantized_times"]
