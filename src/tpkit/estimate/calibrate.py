"""Measure this machine for the speed estimate into a `SpeedProfile` (`tpkit estimate --calibrate` writes it as JSON).

Why measured rather than looked up: a CPU box, a power-capped GPU or an unusual link is on no datasheet, and a
step is only as fast as the rates its ops run at. The op-level rates (`machine.MachineRates`, what `predict.py`
prices every op and collective with) are measured for 1 up to the largest world size of ranks running at once,
`threads` threads each (default: the cores shared out over the largest world size, one device per rank): each rank
measures its matmul and memory rates, a quantized checkpoint's layers as a load builds them (`quantized.py`), a
reference model's per-op cost and the framework's per-module terms (`framework.py`) while the others do the same,
then the collectives through tpkit's communicator, alone and inside the steps of the reference model converted over
those ranks (`reference.py`), and the skew of ranks meeting at collectives; the slowest rank's figures are kept (a
step ends when its slowest rank does).

The profile also names the machine as a `Hardware` read off those rates (its fastest one-rank matmul, its one-rank
streaming bandwidth, the all-reduce line fitted at each world size, split by least squares into a fixed cost per
collective and a per-hop latency), for the tables' titles and the memory that fits; it prices nothing itself.
"""
from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
import time

import torch

from ..comm.shm import SLOT_BYTES
from ..quant import native
from ..quant.products import HALF
from .bandwidth import (COLD_BYTES, best_seconds, measure_copy_bandwidth, measure_fresh_bandwidth,
                        measure_shared_stream_bandwidth, measure_stream_bandwidth)
from .framework import FAMILIES, FrameworkCost, framework_costs, optimizer_tensor_seconds
from .hardware import Hardware, Interconnect
from .machine import COLLECTIVES, CollectiveCost, MachineRates, framework_dtypes
from .ops import dtype_name
from .process_memory import reset_peak_rss, rss_bytes
from .profile import LinkProfile, SpeedProfile
from .quantized import measure_quantized, slowest as slowest_quantized
from .reference import collective_overheads, op_overheads

GEMM_ROWS = (1, 4, 8, 16, 32, 64, 256, 1024)
GEMM_WIDTHS = (256, 1024, 4096)  # 4096: a 64 MiB weight, as large as LM heads are
FINE_ROWS = tuple(range(1, 17)) + (20, 24, 28, 32)  # a batched decode's rows
COMPUTE_BOUND = 8  # a product this many times slower than reading its matrix is not held up by the read
ROUND_SECONDS = 0.02  # a compute-bound row's timing: enough products to make this long
_SIZES = {True: dict(matmul=256, repeats=3), False: dict(matmul=1024, repeats=10)}


def _median(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of `fn` after an untimed one: what a step sees among other ranks."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_matmul_flops(dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs) on this process's threads."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b), repeats)


def measure_gemm(rows=GEMM_ROWS, n: int = 1024, repeats: int = 5, linear: bool = False,
                 dtype: torch.dtype = torch.float32, bandwidth: float = 0.0) -> tuple[tuple[int, float], ...]:
    """(m, FLOP/s) of `dtype` `m x n` by `n x n` matmuls, the weight read as stored (`x @ W`) or, `linear`,
    transposed (`x @ W.T`, nn.Linear); below 1024 rows the weights rotate through a set larger than the caches
    (`COLD_BYTES`: each product reads its matrix from memory, as each layer of a model reads its own after the
    others evicted it), so memory-bound rows read as what they are.

    `bandwidth` (bytes/s this rank streams, 0: unknown): once a row's product takes `COMPUTE_BOUND` times as long
    as reading its matrix at that rate, the caches no longer change its time, and the larger rows after it (more
    arithmetic per byte) rotate through only enough matrices for `ROUND_SECONDS` a timing. Without it a 2-core
    AMD EPYC (bf16 by conversion, ~10 GFLOP/s) spent 25 of a quick calibration's 190 s multiplying bf16 rows
    from 32 to 256 through 128 MiB four times each."""
    out = []
    size = n * n * dtype.itemsize
    # made once per table (filling 128 MiB per row took longer than the products), values away from denormals
    pool = [torch.empty(n, n, dtype=dtype).uniform_(0.5, 1.0) for _ in range(max(1, COLD_BYTES // size))]
    enough = len(pool)  # matrices a timing rotates through
    for m in rows:
        total = COLD_BYTES if m < 256 else COLD_BYTES // 4  # from 256 rows a product reuses its matrix enough
        count = min(max(1, total // size) if m < 1024 else 1, enough)
        ws = pool[:count]
        x = torch.randn(m, n, dtype=dtype)
        if linear:
            seconds = _median(lambda: [torch.mm(x, w.t()) for w in ws], repeats) / count
        else:
            seconds = _median(lambda: [torch.mm(x, w) for w in ws], repeats) / count
        out.append((m, 2.0 * m * n * n / seconds))
        if bandwidth > 0 and seconds >= COMPUTE_BOUND * size / bandwidth:
            enough = max(1, math.ceil(ROUND_SECONDS / seconds))
    return tuple(out)


def fit_collective(points: list[tuple[int, float]]) -> CollectiveCost:
    """The measured (bytes, seconds) points, and the line time = latency + bytes / bandwidth fitted to them by
    least squares of the relative error (weights 1 / seconds^2), so small messages count as much as large ones.
    Where that line would start at or below zero (the transport switches past 1 MiB, and the small sizes ran
    faster than the large ones' line allows), the line starts at the smallest message's time instead, the
    bandwidth fitted with that start fixed: a collective always has a latency, and the smallest message is
    nearly all latency."""
    w = [1.0 / max(s, 1e-12) ** 2 for _, s in points]
    x = [float(b) for b, _ in points]
    y = [s for _, s in points]
    sw, sx, sy = sum(w), sum(wi * xi for wi, xi in zip(w, x)), sum(wi * yi for wi, yi in zip(w, y))
    sxx = sum(wi * xi * xi for wi, xi in zip(w, x))
    sxy = sum(wi * xi * yi for wi, xi, yi in zip(w, x, y))
    det = sw * sxx - sx * sx
    slope = max((sw * sxy - sx * sy) / det if det > 0 else 0.0, 1e-15)
    latency = (sy - slope * sx) / sw
    if latency <= 0.0:
        latency = min(points)[1]
        slope = max((sxy - latency * sx) / sxx if sxx > 0 else 0.0, 1e-15)
    return CollectiveCost(latency, 1.0 / slope, _never_cheaper_when_larger(points))


def _never_cheaper_when_larger(points: list[tuple[int, float]]) -> tuple[tuple[float, float], ...]:
    """The points by size, each no slower than any larger one: a message never costs more than a larger one, so a
    slow outlier at a small size (a 2.3 ms 1 KiB reduce-scatter among 0.8 ms ones) is not what small calls cost."""
    out: list[tuple[float, float]] = []
    for b, s in sorted(((float(b), float(s)) for b, s in points), reverse=True):
        out.append((b, min(s, out[-1][1]) if out else s))
    return tuple(reversed(out))


def measure_collectives(comm, sizes: tuple[int, ...], repeats: int = 7) -> dict[str, CollectiveCost]:
    """On every rank of `comm` (call on all): each collective kind timed at `sizes` bytes of fp32 input (the
    calibration's `collective_sizes`) through the communicator's own methods, in `repeats` rounds that each time
    every size once after a barrier (a slow spell weighs on all sizes alike: two calibrations timed one 2 MiB
    all-reduce at 3.8 and 8.1 ms when each size ran its repeats back to back); the slowest rank's medians."""
    out = {}
    for kind in COLLECTIVES:
        tensors = [torch.ones(max(comm.world_size, n // 4 // comm.world_size * comm.world_size)) for n in sizes]
        call = {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather,
                "reduce_scatter": comm.reduce_scatter}[kind]
        for x in tensors:  # warm: the first call of a size sets up its buffers
            call(x)
        times: list[list[float]] = [[] for _ in sizes]
        for _ in range(repeats):
            for x, seen in zip(tensors, times):
                comm.barrier()
                start = time.perf_counter()
                call(x)
                seen.append(time.perf_counter() - start)
        medians = torch.tensor([statistics.median(t) for t in times], dtype=torch.float64)
        worst = comm.all_reduce(medians, "max")
        out[kind] = fit_collective([(x.numel() * 4, float(s)) for x, s in zip(tensors, worst)])
    return out


def measure_rank_skew(comm, rows: int = 1, pieces: int = 48, repeats: int = 7, n: int = 1024) -> float:
    """The fraction by which work between collectives takes longer when the ranks meet at a collective after each
    piece of it than when each runs it on its own beside the others (call on every rank): each meeting waits for
    the slower rank, and which rank is slower, and by how much, changes piece by piece (the OS, shared caches).
    A piece is a few milliseconds of matmuls with `rows` rows: at 1 row, 4 weights of n x n streamed cold from
    memory (half a decoder layer of a decode step); at more, one weight, bound by arithmetic as training is; a small
    all-reduce after each; the slowest rank's medians. On the 2-core box: 3-6% at 1 row, which the collectives'
    isolated times and the tiny models' framework terms both miss."""
    ws = [torch.empty(n, n).uniform_(0.5, 1.0) for _ in range(max(4, COLD_BYTES // (n * n * 4)))]
    x, message, per_piece = torch.randn(rows, n), torch.ones(256), 4 if rows == 1 else 1

    def run(work: bool, meet: bool) -> float:
        comm.barrier()
        start = time.perf_counter()
        for i in range(pieces):
            for j in range(per_piece if work else 0):
                torch.mm(x, ws[(per_piece * i + j) % len(ws)].t())
            if meet:
                comm.all_reduce(message)
        return time.perf_counter() - start
    run(True, True)
    runs = ((True, False), (True, True), (False, True))  # alone, meeting, the meetings' calls alone
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):  # alternating, so a slow spell weighs on each alike
        for seen, (work, meet) in zip(times, runs):
            seen.append(run(work, meet))
    medians = torch.tensor([statistics.median(t) for t in times], dtype=torch.float64)
    alone, meeting, calls = (float(v) for v in comm.all_reduce(medians, "max"))
    return max(meeting / (alone + calls) - 1.0, 0.0)


def _split_latency(latencies: dict[int, float]) -> tuple[float, float]:
    """(fixed cost per collective, per-hop latency) from small-message times at each world size."""
    if len(latencies) == 1:
        (t, lat), = latencies.items()
        return 0.0, lat / (2 * (t - 1))
    xs = [2 * (t - 1) for t in latencies]
    ys = list(latencies.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


def _table_rows(width: int, linear: bool) -> tuple[int, ...]:
    """The rows a matmul table is timed at: `GEMM_ROWS`, and a batched decode's every row count (`FINE_ROWS`) where
    the weight is read as nn.Linear reads it at widths from 1024; up to 256 rows past width 1024."""
    rows = sorted(set(GEMM_ROWS) | (set(FINE_ROWS) if linear and width >= 1024 else set()))
    return tuple(m for m in rows if width <= 1024 or m <= 256)


def _rank_rates(threads: int, quick: bool, model=None, families=FAMILIES, dp_wrappers=None) -> MachineRates:
    """On one launched rank: this rank's rates while every rank measures at once (barriers keep them in step)."""
    from ..distributed import get_communicator

    import transformers  # noqa: F401 - a user's process has it imported: part of what it holds

    torch.set_num_threads(threads)
    comm = get_communicator()
    imports = rss_bytes()
    repeats = 3 if quick else 7
    tables = {}
    # as stored (x @ W) and as nn.Linear reads it (x @ W.T) in float32, and as nn.Linear reads it in bf16 and fp16
    # (what those layers run where tpkit's decode product does not), at each width; every rank at once. `quick`:
    # bf16 only, at `GEMM_ROWS` (the fine rows of both half dtypes added 30 s to a 80 s quick calibration)
    half = tuple(HALF)[:1] if quick else tuple(HALF)
    comm.barrier()
    stream = measure_shared_stream_bandwidth(comm, repeats=repeats)  # first: the tables read with it
    for dtype, linear in ((torch.float32, False), (torch.float32, True), *((d, True) for d in half)):
        for width in GEMM_WIDTHS:
            comm.barrier()
            rows = _table_rows(width, linear and not (quick and dtype != torch.float32))
            tables[dtype, linear, width] = measure_gemm(rows, width, 3, linear, dtype, stream)
    gemm = tables[torch.float32, False, 1024]
    dtype_gemm = {dtype_name(d): tuple((w, tables[d, True, w]) for w in GEMM_WIDTHS) for d in half}
    comm.barrier()
    stored = measure_stream_bandwidth(repeats=repeats, stored=True)
    copy_bw = measure_copy_bandwidth(repeats=repeats)
    comm.barrier()
    fresh = measure_fresh_bandwidth(repeats=repeats)
    comm.barrier()
    quantized = measure_quantized(comm, 3 if quick else 5, quick)  # every rank at once: they share the memory bus
    rates = MachineRates(comm.world_size, threads, 0.0, 0.0, gemm, stream, copy_bw, stored_bandwidth=stored,
                         gemm_widths=tuple((w, tables[torch.float32, False, w]) for w in GEMM_WIDTHS if w != 1024),
                         linear_gemm=tuple((w, tables[torch.float32, True, w]) for w in GEMM_WIDTHS),
                         quantized=quantized,
                         dtype_gemm=dtype_gemm, fresh_bandwidth=fresh, product_build=native.build_id())
    comm.barrier()
    reset_peak_rss()
    before = rss_bytes()
    forward, train, held = op_overheads(rates, model, repeats)
    runtime = max(rss_bytes("VmHWM") - before - held, 0) if before else 0
    tensor_s = optimizer_tensor_seconds(repeats)
    rates = dataclasses.replace(rates, op_overhead_s=forward, train_op_overhead_s=train, optimizer_tensor_s=tensor_s,
                                import_bytes=imports, runtime_bytes=runtime)
    comm.barrier()
    dtypes = framework_dtypes(quick)
    rates = dataclasses.replace(rates, framework=framework_costs(rates, None, families, repeats, tensor_s,
                                                                 dtypes=dtypes))
    if comm.world_size == 1:
        return _stream_at_end(rates, comm, repeats)
    sizes = collective_sizes(quick)
    collectives = {k: {str(comm.world_size): c} for k, c in measure_collectives(comm, sizes, repeats).items()}
    rates = dataclasses.replace(rates, collectives=collectives, skew=measure_rank_skew(comm, 1, repeats=repeats),
                                train_skew=measure_rank_skew(comm, 256, repeats=repeats))
    in_step, train_in_step = collective_overheads(rates, comm, model, repeats)
    rates = dataclasses.replace(rates, collective_overhead_s=in_step, train_collective_overhead_s=train_in_step)
    rates = dataclasses.replace(rates, tp_framework=framework_costs(rates, comm, families, repeats, tensor_s,
                                                                    dtypes=dtypes))
    dp: dict = {}
    for mode, wrap in sorted((dp_wrappers or {}).items()):
        dp.update(framework_costs(rates, comm, families, repeats, tensor_s, dp=(mode, wrap)))
    return _stream_at_end(dataclasses.replace(rates, dp_framework=dp), comm, repeats)


def _stream_at_end(rates: MachineRates, comm, repeats: int) -> MachineRates:
    """`rates` with the streaming bandwidth measured again as the rank's calibration ends (`stream_drift`)."""
    comm.barrier()
    return dataclasses.replace(rates, stream_bandwidth_end=measure_shared_stream_bandwidth(comm, repeats=repeats))


def _worst(per_rank: list[dict[str, FrameworkCost]]) -> dict[str, FrameworkCost]:
    return {k: FrameworkCost(*(max(getattr(r[k], f.name) for r in per_rank)
                               for f in dataclasses.fields(FrameworkCost))) for k in per_rank[0]}


def _slowest(per_rank: list[MachineRates]) -> MachineRates:
    """The rates a step sees: each figure from the rank that is slowest at it."""
    first = per_rank[0]
    gemm = tuple((m, min(dict(r.gemm)[m] for r in per_rank)) for m, _ in first.gemm)

    def slowest_tables(tables_of):
        return tuple((w, tuple((m, min(dict(dict(tables_of(r))[w])[m] for r in per_rank)) for m, _ in table))
                     for w, table in tables_of(first))
    return dataclasses.replace(first, op_overhead_s=max(r.op_overhead_s for r in per_rank),
                               train_op_overhead_s=max(r.train_op_overhead_s for r in per_rank), gemm=gemm,
                               gemm_widths=slowest_tables(lambda r: r.gemm_widths),
                               linear_gemm=slowest_tables(lambda r: r.linear_gemm),
                               collective_overhead_s=max(r.collective_overhead_s for r in per_rank),
                               train_collective_overhead_s=max(r.train_collective_overhead_s for r in per_rank),
                               stream_bandwidth=min(r.stream_bandwidth for r in per_rank),
                               stream_bandwidth_end=min(r.stream_bandwidth_end for r in per_rank),
                               stored_bandwidth=min(r.stored_bandwidth for r in per_rank),
                               copy_bandwidth=min(r.copy_bandwidth for r in per_rank),
                               fresh_bandwidth=min((r.fresh_bandwidth for r in per_rank if r.fresh_bandwidth),
                                                   default=0.0),
                               optimizer_tensor_s=max(r.optimizer_tensor_s for r in per_rank),
                               skew=max(r.skew for r in per_rank),
                               train_skew=max(r.train_skew for r in per_rank),
                               import_bytes=max(r.import_bytes for r in per_rank),
                               runtime_bytes=max(r.runtime_bytes for r in per_rank),
                               framework=_worst([r.framework for r in per_rank]),
                               tp_framework=_worst([r.tp_framework for r in per_rank]) if first.tp_framework else {},
                               dp_framework=_worst([r.dp_framework for r in per_rank]) if first.dp_framework else {},
                               quantized=slowest_quantized([r.quantized for r in per_rank]),
                               dtype_gemm={d: slowest_tables(lambda r: r.dtype_gemm[d]) for d in first.dtype_gemm})


def calibrate_machine(backend: str = "gloo", max_ranks: int = 2, threads: int | None = None, quick: bool = False,
                      model=None, families=FAMILIES, dp_wrappers=None) -> dict[str, MachineRates]:
    """`MachineRates` for 1 .. `max_ranks` ranks sharing this machine (see the module doc); `model`: measure the
    per-op cost on this model (small!) instead of the reference Llama; `families`: the transformers families
    whose framework terms are measured (`framework.py`); `dp_wrappers`: {"ddp" / "fsdp": wrap(model, comm)}
    (picklable; `tpkit.setups.DP_WRAPPERS`) to measure the framework under data parallelism too."""
    from ..launch import launch

    threads = threads or max(1, (os.cpu_count() or 1) // max_ranks)
    return {str(n): _slowest(launch(_rank_rates, n, backend=backend, args=(threads, quick, model, families, dp_wrappers)))
            for n in range(1, max_ranks + 1)}


def collective_sizes(quick: bool) -> tuple[int, ...]:
    """Bytes at which the collectives are timed: from a decode's few KiB to a training step's many MiB, with the
    largest call the communicator sends through shared memory and one just past it (gloo), since the time jumps
    there (2-core box: all-reduce 0.5 ms at 1 MiB, 5.8 ms at 2 MiB)."""
    edge = (SLOT_BYTES, SLOT_BYTES + 2 ** 16)
    if quick:
        return (2 ** 10, 2 ** 16) + edge + (2 ** 23,)
    return (2 ** 10, 2 ** 14, 2 ** 18) + edge + (2 ** 21, 2 ** 23, 2 ** 25)


def calibrate_profile(backend: str = "gloo", world_sizes=(2,), quick: bool = False, threads: int | None = None,
                      model=None, families=FAMILIES, dp_wrappers=None) -> SpeedProfile:
    """Measure this machine (see the module doc) and return its profile: the op-level rates for 1 ..
    max(world_sizes) ranks sharing the machine, and, read off them, the machine as a `Hardware` (its fastest
    one-rank matmul, its one-rank streaming bandwidth, the all-reduce over `backend`) with efficiencies 1, so
    every figure the profile holds is one that was measured by the op-level calibration."""
    sizes = [int(t) for t in world_sizes]
    if not sizes or min(sizes) < 2:
        raise ValueError(f"calibrate_profile: world sizes must be >= 2 (an all-reduce needs two ranks), got {world_sizes!r}")
    k = _SIZES[bool(quick)]
    bf16 = measure_matmul_flops(torch.bfloat16, 512 if quick else k["matmul"], k["repeats"])
    machine = calibrate_machine(backend, max(sizes), threads, quick, model, families, dp_wrappers)
    one = machine["1"]
    fp32 = max(f for _, f in one.gemm)
    latencies, bandwidths = {}, []
    for t in sizes:
        cost = machine[str(t)].collective("all_reduce", t)
        latencies[t] = cost.latency_s
        bandwidths.append(cost.bandwidth * 2 * (t - 1) / t)  # bus bandwidth: what crosses each rank's link
    fixed, hop = _split_latency(latencies)
    link = Interconnect(f"{backend} on this host (measured)", min(bandwidths), hop, backend)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 0
    name = f"measured: {platform.machine()} {os.cpu_count()} cores" + (", quick" if quick else "")
    hw = Hardware(name, bf16, fp32, one.stream_bandwidth, int(ram), link)
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    return SpeedProfile(name, 1.0, 1.0, {backend: LinkProfile(fixed, hop, 1.0)}, hw,
                        {"measured": f"tpkit estimate --calibrate on {platform.node() or 'this host'} at {when}; "
                                     f"all-reduce over {backend} with world sizes {sizes}",
                         "torch": torch.__version__, "threads": str(machine["1"].threads),
                         "op overhead": "per-op cost measured on " + (type(model).__name__ if model is not None
                                                                     else "the reference Llama (reference.py)"),
                         "framework": "per-module terms on tiny " + ", ".join(families) + " (framework.py)"},
                        machine)
