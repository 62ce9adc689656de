"""What one rank achieves on the machine at hand, measured with as many ranks running at once as the setup will
have (they share cores, caches and memory bandwidth), as the op-level cost model (`predict.py`) reads it (a machine
known only by its datasheet gets the same record from `hardware.datasheet_rates`):

* `op_overhead_s` / `train_op_overhead_s`: the fixed cost of one aten op as a real model pays it (dispatch and
  the framework's Python around it). Measured on a small reference model whose kernels cost next to nothing:
  its measured step time, less its kernels' time, divided by the ops its traced step counts (forward-only
  steps, and training steps whose backward and optimizer ops cost less Python each);
* `gemm`: matmul FLOP/s by the number of rows `m` (m x 1024 x 1024; a decode's m is the batch, a training
  step's the batch x sequence), the weight read as stored (`x @ W`); `gemm_widths` the same at other widths,
  `linear_gemm` with the weight read transposed as `nn.Linear` reads it (`x @ W.T`). Both orientations, and
  widths up to 4096, because BLAS is not one rate: at 64 rows a 4096-wide weight read transposed ran at 77
  GFLOP/s on this 2-core box where the 1024-wide one read as stored ran at 133, and batched decode (13-20 rows)
  and LM heads live there;
* `stream_bandwidth`: bytes/s reading weights that do not fit the caches (matrix-vector products over a set of
  matrices larger than the last-level cache: what a decode step does), the weight read transposed as
  `nn.Linear` reads it; `stored_bandwidth` the same with the weight read as stored (GPT-2's `Conv1D`, `x @ W`),
  which BLAS streams differently; `copy_bandwidth`: bytes/s of elementwise work (read + write);
* `fresh_bandwidth`: bytes/s at which new pages come to a tensor the allocator does not keep (`ops.FRESH_BLOCK_BYTES`
  and up: glibc unmaps it when freed), on top of the op writing it: a CPU training step makes its large gradients,
  AdamW's temporaries and a large vocabulary's logits anew each step (on this 2-core VM 1.2-1.8 us per 4 KiB page,
  0.44 s of a 2.98 s step of a Llama h1792 x 2 layers);
* `collectives`: for each kind (all_reduce, all_gather, reduce_scatter; all_to_all where measured, else priced from
  the all-gather: `collective`) and group size, a latency and a bandwidth fitted to calls through tpkit's own
  communicator (its checks, its transport) at several sizes;
* `quantized`: the linear layers of a quantized checkpoint as a rank's load builds them (`tpkit.nn.quantized`:
  each keeps the fastest product it measured on its slice), timed at decode's rows: per format and compute dtype,
  a fixed cost per call and the bytes/s its stored tensors stream at (`quantized.py`; `QuantizedRate`);
* `collective_overhead_s` / `train_collective_overhead_s`: what each tensor-parallel collective costs inside a
  step beyond that isolated call: the Python of the parallel layer around it and the wait for the slower rank
  (isolated calls start together after a barrier; in a step the ranks arrive apart). Measured on the reference
  model converted at this many ranks (`reference.collective_overheads`).

How each one is measured is in `calibrate.py`; the framework's per-module terms (`FrameworkCost`) in `framework.py`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """The seconds of one call moving `n` bytes (one rank's input). From a datasheet (`hardware.datasheet_rates`):
    latency + n / bandwidth.
    Measured: the timed `points` (bytes, seconds) joined by straight lines, past the last one at its last
    segment's rate, because a communicator is not one line: tpkit's own sends a call of at most 1 MiB through
    shared memory and a larger one through gloo, and on the 2-core box a 1 MiB all-reduce took 0.5 ms, a 2 MiB
    one 5.8 ms, where the one line fitted through both said 0.36 and 0.71 ms. `latency_s` and `bandwidth` stay
    the line fitted to the points (what `--calibrate` prints, what the datasheet hardware is read off)."""

    latency_s: float
    bandwidth: float
    points: tuple[tuple[float, float], ...] = ()

    def seconds(self, nbytes: float) -> float:
        pts = self.points
        if not pts:
            return self.latency_s + nbytes / self.bandwidth
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
            if nbytes <= b1:
                return s0 + (s1 - s0) * (nbytes - b0) / (b1 - b0)
        (b0, s0), (b1, s1) = pts[-2:] if len(pts) > 1 else ((0.0, 0.0), pts[-1])
        return s1 + max(s1 - s0, 0.0) / (b1 - b0) * (nbytes - b1)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CollectiveCost":
        """From `dataclasses.asdict` (a profile written before `points` existed has none: the line alone)."""
        points = tuple((float(b), float(s)) for b, s in data.get("points", ()))
        return cls(float(data["latency_s"]), float(data["bandwidth"]), points)


@dataclasses.dataclass(frozen=True)
class QuantizedRate:
    """One quantized layer's call as the calibration timed it (`quantized.measure_quantized`): `product`, what the
    layer chose at load (`tpkit.quant.products.fastest`: "native uint4", "int4", ...; "dequantize": the slice
    dequantized per call, timed alone); `fixed_s` per call, and `rows`: ((activation rows, bytes/s of the stored
    tensors), ...) of the middle layer size; `widths`: ((input features, its rows table), ...) of each layer size
    timed (a product streams a wide input more slowly: 10 against 20 GB/s at 5632 and 2048 features here). Seconds
    of a call at `m` rows over `nbytes` stored and `width` input features: `fixed_s + nbytes / bandwidth(m, width)`
    (log-linear between the rows and the widths measured, flat beyond; a profile without widths: `rows`)."""

    product: str
    fixed_s: float
    rows: tuple[tuple[int, float], ...]
    widths: tuple[tuple[int, tuple[tuple[int, float], ...]], ...] = ()

    def bandwidth(self, m: int = 1, width: int | None = None) -> float:
        """Bytes/s of the stored tensors at `m` activation rows and `width` input features."""
        if width is None or not self.widths:
            return _interpolate(self.rows, max(m, 1))
        return _interpolate(tuple((w, _interpolate(rows, max(m, 1))) for w, rows in self.widths), width)

    def seconds(self, nbytes: float, m: int = 1, width: int | None = None) -> float:
        return self.fixed_s + nbytes / self.bandwidth(m, width)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "QuantizedRate":
        def table(rows) -> tuple[tuple[int, float], ...]:
            return tuple((int(m), float(b)) for m, b in rows)
        return cls(str(data["product"]), float(data["fixed_s"]), table(data["rows"]),
                   tuple((int(w), table(rows)) for w, rows in data.get("widths", ())))


# what the framework terms' reference step holds: one batch row, a vocabulary of 256, hidden 64
# (`framework.tiny_config`: float32, and for decoding bfloat16 too: `framework_key`)
FRAMEWORK_ROWS = 1
FRAMEWORK_LOGITS = 256
FRAMEWORK_WIDTH = 64


# the dtypes decoding's framework terms are measured in, each under its own key (`framework_key`): a bf16 model's
# norms and rotary embedding convert to float32 and back, and `generate` converts its logits, work a float32 model
# skips (on the 2-core EPYC a tiny Llama's decoder layer took 20-30 us more in bf16, ~15%). Training: float32 only.
FRAMEWORK_DTYPES = (torch.float32, torch.bfloat16)


def framework_dtypes(quick: bool = False) -> tuple[torch.dtype, ...]:
    """The dtypes a calibration measures decoding's framework terms in (`quick`: float32's only); the quantized
    calls' fixed costs are set against the linear call of the same terms (`quantized.framework_linear_call`)."""
    return FRAMEWORK_DTYPES[:1] if quick else FRAMEWORK_DTYPES


def framework_key(family: str, goal: str, dtype: str = "float32") -> str:
    """The key of `family`'s framework terms for `goal` measured with its tiny model in `dtype` (a dtype name:
    "bfloat16"): "llama/decode" in float32, the profiles' key before dtypes were measured apart, else
    "llama/decode/bfloat16"."""
    return f"{family}/{goal}" if dtype == "float32" else f"{family}/{goal}/{dtype}"


@dataclasses.dataclass(frozen=True)
class FrameworkCost:
    """Seconds per step outside the decoder layers and per decoder layer at one batch row and 256 logits, and, for
    decoding, what each further row and each further logit adds (`framework.py`: `generate` works per row, and
    its logits processors pass over every row's whole vocabulary each token; 0 in profiles measured before)."""

    step_s: float
    layer_s: float
    row_s: float = 0.0
    logit_s: float = 0.0

    def seconds(self, layers: int, rows: int = FRAMEWORK_ROWS, logits: int = FRAMEWORK_LOGITS) -> float:
        """The framework's time of a step with `layers` decoder layers, `rows` batch rows and `logits` logits in
        all (rows x vocabulary)."""
        return (self.step_s + layers * self.layer_s + max(rows - FRAMEWORK_ROWS, 0) * self.row_s
                + max(logits - FRAMEWORK_LOGITS, 0) * self.logit_s)


def _interpolate(table, m: int) -> float:
    """A rate (FLOP/s, bytes/s) at `m` rows from ((rows, rate), ...): log-linear between rows, flat beyond them."""
    pts = sorted(table)
    if m <= pts[0][0]:
        return pts[0][1]
    for (m0, f0), (m1, f1) in zip(pts, pts[1:]):
        if m <= m1:
            w = (math.log(m) - math.log(m0)) / (math.log(m1) - math.log(m0))
            return math.exp((1 - w) * math.log(f0) + w * math.log(f1))
    return pts[-1][1]


@dataclasses.dataclass(frozen=True)
class MachineRates:
    """One rank's rates when `ranks` ranks run on this machine at once, `threads` threads each (see the module
    docstring); `collectives` keyed by kind, then by group size (as a string, for JSON)."""

    ranks: int
    threads: int
    op_overhead_s: float
    train_op_overhead_s: float
    gemm: tuple[tuple[int, float], ...]
    stream_bandwidth: float
    copy_bandwidth: float
    collectives: Mapping[str, Mapping[str, CollectiveCost]] = dataclasses.field(default_factory=dict)
    stored_bandwidth: float = 0.0  # 0: as `stream_bandwidth` (profiles measured before it was)
    collective_overhead_s: float = 0.0  # 0 in profiles measured before it was, and on datasheet machines
    train_collective_overhead_s: float = 0.0
    # format 3 (`framework.py`): "family/goal" -> the framework's own time, run whole by every rank at once
    # (`framework`) and converted over the ranks (`tp_framework`); AdamW's time per parameter tensor
    framework: Mapping[str, FrameworkCost] = dataclasses.field(default_factory=dict)
    tp_framework: Mapping[str, FrameworkCost] = dataclasses.field(default_factory=dict)
    optimizer_tensor_s: float = 0.0
    # matmul FLOP/s by rows at other widths (n = k): ((width, ((m, FLOP/s), ...)), ...); `gemm` is width 1024
    gemm_widths: tuple[tuple[int, tuple[tuple[int, float], ...]], ...] = ()
    # what a rank's process holds besides its tensors: its resident bytes once torch, tpkit and transformers are
    # imported, and what a training step adds beyond the tensors it holds (the allocator's slack, autograd's and
    # the modules' Python objects), measured on the reference model
    import_bytes: float = 0.0
    runtime_bytes: float = 0.0
    # "family/train/ddp" (or fsdp) -> the framework's time under torch's DDP / FSDP2 over these ranks
    dp_framework: Mapping[str, FrameworkCost] = dataclasses.field(default_factory=dict)
    # matmul FLOP/s by rows at each width with the weight read transposed (nn.Linear's `x @ W.T`), from 1024 wide
    # at every row count to 32 (`calibrate.FINE_ROWS`): BLAS is not log-linear in the rows there (a 64 MiB weight
    # ran at 13.7 GFLOP/s with 13 rows and 27.8 with 16 on this box); () in profiles measured before it was (the
    # tables read as stored price both orientations then)
    linear_gemm: tuple[tuple[int, tuple[tuple[int, float], ...]], ...] = ()
    # the fraction work between collectives takes longer when ranks meet at each (`calibrate.measure_rank_skew`):
    skew: float = 0.0  # pieces streamed from memory, as decoding's; 0 in profiles measured before
    train_skew: float = 0.0  # pieces bound by arithmetic, as training's and prefill's
    # "int4/bfloat16" (format kind / compute dtype; "/dequantize" for the slice dequantized per call) -> the quantized
    # layer's call as the load builds it; {} in profiles measured before, and on datasheet machines (`quantized.py`
    # prices by its rule then)
    quantized: Mapping[str, QuantizedRate] = dataclasses.field(default_factory=dict)
    # "bfloat16" / "float16" -> matmul FLOP/s by rows at each width, the weight read as nn.Linear reads it, in that
    # dtype: BLAS runs each dtype at its own rate (on a CPU with AMX, bf16 at 256 rows ran 5.8x float32's; fp16,
    # without its own units, about float32's); {} in profiles measured before (the float32 tables price them then)
    dtype_gemm: Mapping[str, tuple[tuple[int, tuple[tuple[int, float], ...]], ...]] = \
        dataclasses.field(default_factory=dict)
    # bytes/s of new pages for a tensor of at least `ops.FRESH_BLOCK_BYTES` (`bandwidth.measure_fresh_bandwidth`);
    # 0: no such cost (profiles measured before, datasheet machines, a caching allocator)
    fresh_bandwidth: float = 0.0
    # the compiled product the decode rates were measured with (`tpkit.quant.native.build_id`); "" in profiles
    # measured before it was recorded, and on datasheet machines
    product_build: str = ""
    # `stream_bandwidth` measured again as the calibration ended: a machine whose memory bandwidth moves (a shared
    # host's spells: 20 against 35 GB/s per rank minutes apart on the 2-core EPYC) gave rates that hold for neither
    # spell, and the estimate says so (`stream_drift`); 0 in profiles measured before
    stream_bandwidth_end: float = 0.0

    def stream_drift(self) -> float:
        """How far the streaming bandwidth moved during the calibration: end / start or start / end, the larger, less
        1 (0 where not measured twice)."""
        if not self.stream_bandwidth_end or not self.stream_bandwidth:
            return 0.0
        ratio = self.stream_bandwidth_end / self.stream_bandwidth
        return max(ratio, 1 / ratio) - 1

    def framework_cost(self, family: str | None, goal: str, tp: bool, dp_mode: str | None = None,
                       dtype: str = "float32") -> FrameworkCost | None:
        """The measured framework terms of `family` for `goal`: converted (`tp`), else under data parallelism
        (`dp_mode` "ddp" / "fsdp", where measured), else whole; those measured in the model's `dtype` (a name:
        `framework_key`) where there are some, else float32's; None when not measured (the per-op cost prices it
        instead)."""
        if not family:
            return None
        if dp_mode and not tp and f"{family}/{goal}/{dp_mode}" in self.dp_framework:
            return self.dp_framework[f"{family}/{goal}/{dp_mode}"]
        table = self.tp_framework if tp else self.framework
        return table.get(framework_key(family, goal, dtype)) or table.get(framework_key(family, goal))

    def fresh_seconds(self, nbytes: float) -> float:
        """What new pages for `nbytes` of tensors the allocator does not keep add (0 where not measured)."""
        return nbytes / self.fresh_bandwidth if self.fresh_bandwidth else 0.0

    def weight_bandwidth(self, stored: bool) -> float:
        """Bytes/s streaming a matmul's weight, read transposed (nn.Linear) or as stored (Conv1D)."""
        return self.stored_bandwidth if stored and self.stored_bandwidth else self.stream_bandwidth

    def flops_rate(self, m: int, width: float | None = None, stored: bool = True, dtype: str = "") -> float:
        """Matmul FLOP/s with `m` rows (log-linear between the measured rows, flat beyond them), at `width`
        (sqrt(n k)) log-linear between the measured widths when given and measured, else at width 1024; the
        weight read as stored, or transposed (`stored=False`, nn.Linear) where that was measured; in `dtype`
        ("bfloat16", ...) where that dtype was measured (its tables, read as nn.Linear reads the weight, price both
        orientations), else at float32's rates."""
        tables = sorted({1024: tuple(self.gemm), **{w: tuple(t) for w, t in self.gemm_widths}}.items())
        if dtype in self.dtype_gemm:
            tables = sorted((w, tuple(t)) for w, t in self.dtype_gemm[dtype])
        elif not stored and self.linear_gemm:
            tables = sorted((w, tuple(t)) for w, t in self.linear_gemm)
        return self._across_widths(tables, m, 1024 if width is None else width)

    @staticmethod
    def _across_widths(tables, m: int, width: float) -> float:
        if len(tables) == 1:
            return _interpolate(tables[0][1], m)
        if width <= tables[0][0]:
            return _interpolate(tables[0][1], m)
        for (w0, t0), (w1, t1) in zip(tables, tables[1:]):
            if width <= w1:
                a = (math.log(width) - math.log(w0)) / (math.log(w1) - math.log(w0))
                return math.exp((1 - a) * math.log(_interpolate(t0, m)) + a * math.log(_interpolate(t1, m)))
        return _interpolate(tables[-1][1], m)


    def collective(self, kind: str, group: int) -> CollectiveCost:
        """The measured cost of `kind` over `group` ranks (the largest measured group when `group` is larger).

        "all_to_all" (context parallelism's head exchange; its bytes are one rank's send buffer): its own figures
        when the machine has them, else the all-gather's: an all-to-all of an n-byte buffer moves (g-1)/g of it
        over the links, as the all-gather of an n/g-byte input does, so it is priced as that all-gather (latency
        kept, bandwidth and timed points scaled by g)."""
        if group <= 1:
            return CollectiveCost(0.0, math.inf)
        if kind == "all_to_all" and not self.collectives.get(kind):
            gather = self.collective("all_gather", group)
            return CollectiveCost(gather.latency_s, gather.bandwidth * group,
                                  tuple((b * group, t) for b, t in gather.points))
        per = self.collectives.get(kind) or self.collectives.get("all_reduce") or {}
        if not per:
            raise ValueError(f"the machine profile for {self.ranks} ranks has no collective figures; calibrate with "
                             f"world sizes >= 2")
        sizes = sorted(int(g) for g in per)
        return per[str(min((g for g in sizes if g >= group), default=sizes[-1]))]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["gemm"] = [list(p) for p in self.gemm]
        out["gemm_widths"] = [[w, [list(p) for p in t]] for w, t in self.gemm_widths]
        out["linear_gemm"] = [[w, [list(p) for p in t]] for w, t in self.linear_gemm]
        out["dtype_gemm"] = {d: [[w, [list(p) for p in t]] for w, t in tables] for d, tables in self.dtype_gemm.items()}
        out["framework"] = {k: dataclasses.asdict(v) for k, v in self.framework.items()}
        out["tp_framework"] = {k: dataclasses.asdict(v) for k, v in self.tp_framework.items()}
        out["dp_framework"] = {k: dataclasses.asdict(v) for k, v in self.dp_framework.items()}
        out["quantized"] = {k: {"product": v.product, "fixed_s": v.fixed_s, "rows": [list(p) for p in v.rows],
                                "widths": [[w, [list(p) for p in rows]] for w, rows in v.widths]}
                            for k, v in self.quantized.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MachineRates":
        collectives = {k: {g: CollectiveCost.from_dict(c) for g, c in per.items()}
                       for k, per in dict(data.get("collectives", {})).items()}
        return cls(int(data["ranks"]), int(data["threads"]), float(data["op_overhead_s"]),
                   float(data["train_op_overhead_s"]), tuple((int(m), float(f)) for m, f in data["gemm"]),
                   float(data["stream_bandwidth"]), float(data["copy_bandwidth"]), collectives,
                   float(data.get("stored_bandwidth", 0.0)), float(data.get("collective_overhead_s", 0.0)),
                   float(data.get("train_collective_overhead_s", 0.0)),
                   {k: FrameworkCost(**v) for k, v in dict(data.get("framework", {})).items()},
                   {k: FrameworkCost(**v) for k, v in dict(data.get("tp_framework", {})).items()},
                   float(data.get("optimizer_tensor_s", 0.0)),
                   _tables(data.get("gemm_widths", [])),
                   float(data.get("import_bytes", 0.0)), float(data.get("runtime_bytes", 0.0)),
                   {k: FrameworkCost(**v) for k, v in dict(data.get("dp_framework", {})).items()},
                   _tables(data.get("linear_gemm", [])), float(data.get("skew", 0.0)),
                   float(data.get("train_skew", 0.0)),
                   {k: QuantizedRate.from_dict(v) for k, v in dict(data.get("quantized", {})).items()},
                   {d: _tables(t) for d, t in dict(data.get("dtype_gemm", {})).items()},
                   float(data.get("fresh_bandwidth", 0.0)), str(data.get("product_build", "")),
                   float(data.get("stream_bandwidth_end", 0.0)))


def _tables(data) -> tuple[tuple[int, tuple[tuple[int, float], ...]], ...]:
    return tuple((int(w), tuple((int(m), float(f)) for m, f in t)) for w, t in data)
