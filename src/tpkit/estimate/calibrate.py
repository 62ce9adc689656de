"""Measure this machine for the speed estimate: matmul FLOP/s, memory bandwidth and all-reduce latency and
bandwidth over a backend, into a `SpeedProfile` (`tpkit estimate --calibrate` writes it as JSON).

Why measured rather than looked up: a CPU box, a power-capped GPU or an unusual link is on no datasheet,
and the estimate is only as good as the three numbers it divides by. Each figure is the best of a few
repeats (the machine's capability, not its noise); the all-reduce is timed on real ranks started by
`tpkit.launch` (processes for gloo, threads for "threads"), a small message for latency and a large one for
bandwidth, as the alpha-beta model of `speed.py` reads them: time(n) = alpha + 2(t-1)/t * n / bandwidth.

With one world size the latency is booked as ring hops (2(t-1) of them); with several (`world_sizes`) it is
split by least squares into a fixed cost per collective and a per-hop latency.

The op-level rates (`machine.MachineRates`, what `predict.py` reads) are measured for 1 up to the largest world
size of ranks running at once, `threads` threads each (default: the cores shared out over the largest world
size, one device per rank): each rank measures its matmul and memory rates and a reference model's per-op cost
while the others do the same, then the collectives through tpkit's communicator, alone and inside the steps of
the reference model converted over those ranks; the slowest rank's figures are kept (a step ends when its
slowest rank does).
"""
from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time

import torch

from ..comm.shm import SLOT_BYTES
from .hardware import Hardware, Interconnect
from .framework import FAMILIES, FrameworkCost, framework_costs, optimizer_tensor_seconds
from .machine import (COLD_BYTES, FINE_ROWS, GEMM_ROWS, GEMM_WIDTHS, MachineRates, measure_collectives,
                      measure_copy_bandwidth, measure_gemm, measure_shared_stream_bandwidth, measure_stream_bandwidth)
from .process_memory import reset_peak_rss, rss_bytes
from .profile import LinkProfile, SpeedProfile
from .reference import collective_overheads, op_overheads

_SIZES = {True: dict(matmul=256, copy=8 * 2**20, small=8, large=2**20, repeats=3),
          False: dict(matmul=1024, copy=256 * 2**20, small=8, large=32 * 2**20, repeats=10)}


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm up (allocation, first-call dispatch)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul_flops(dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs) on this process's threads."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), repeats)


def measure_memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 10) -> float:
    """Bytes/s of a large copy (read + write: 2 x nbytes moved), the figure a weight-streaming decode sees."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src), repeats)


def _time_all_reduce(small: int, large: int, repeats: int) -> tuple[float, float]:
    """On one rank: best seconds of an all-reduce of `small` and of `large` bytes (fp32), barrier first."""
    from ..distributed import get_communicator

    comm = get_communicator()
    out = []
    for nbytes in (small, large):
        x = torch.ones(max(1, nbytes // 4))

        def once():
            comm.all_reduce(x)
        comm.barrier()
        out.append(_best_seconds(once, repeats))
    return out[0], out[1]


def measure_all_reduce(backend: str = "gloo", world_size: int = 2, small: int = 8, large: int = 2**25,
                       repeats: int = 10) -> tuple[float, float]:
    """(latency seconds of a tiny all-reduce, bus bandwidth bytes/s) over `backend` on `world_size` local
    ranks started by `tpkit.launch`; the slowest rank's figures (a collective ends when its last rank does)."""
    from ..launch import launch

    timings = launch(_time_all_reduce, world_size, backend=backend, args=(small, large, repeats))
    t_small = max(t[0] for t in timings)
    t_large = max(t[1] for t in timings)
    moved = 2 * (world_size - 1) / world_size * (max(1, large // 4) * 4)
    return t_small, moved / max(t_large - t_small, 1e-9)


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


def _rank_rates(threads: int, quick: bool, model=None, families=FAMILIES, dp_wrappers=None) -> MachineRates:
    """On one launched rank: this rank's rates while every rank measures at once (barriers keep them in step)."""
    from ..distributed import get_communicator

    import transformers  # noqa: F401 - a user's process has it imported: part of what it holds

    torch.set_num_threads(threads)
    comm = get_communicator()
    imports = rss_bytes()
    repeats = 3 if quick else 7
    tables = {}
    for linear in (False, True):  # as stored (x @ W) and as nn.Linear reads it (x @ W.T), at each width
        for width in GEMM_WIDTHS:
            comm.barrier()
            rows = sorted(set(GEMM_ROWS) | (set(FINE_ROWS) if linear and width >= 1024 else set()))
            rows = tuple(m for m in rows if width <= 1024 or m <= 256)
            tables[linear, width] = measure_gemm(rows, width, 3, linear)  # cold: steady
    gemm = tables[False, 1024]
    comm.barrier()
    stream = measure_shared_stream_bandwidth(comm, repeats=repeats)
    comm.barrier()
    stored = measure_stream_bandwidth(repeats=repeats, stored=True)
    copy_bw = measure_copy_bandwidth(repeats=repeats)
    rates = MachineRates(comm.world_size, threads, 0.0, 0.0, gemm, stream, copy_bw, stored_bandwidth=stored,
                         gemm_widths=tuple((w, tables[False, w]) for w in GEMM_WIDTHS if w != 1024),
                         linear_gemm=tuple((w, tables[True, w]) for w in GEMM_WIDTHS))
    comm.barrier()
    reset_peak_rss()
    before = rss_bytes()
    forward, train, held = op_overheads(rates, model, repeats)
    runtime = max(rss_bytes("VmHWM") - before - held, 0) if before else 0
    tensor_s = optimizer_tensor_seconds(repeats)
    rates = dataclasses.replace(rates, op_overhead_s=forward, train_op_overhead_s=train, optimizer_tensor_s=tensor_s,
                                import_bytes=imports, runtime_bytes=runtime)
    comm.barrier()
    rates = dataclasses.replace(rates, framework=framework_costs(rates, None, families, repeats, tensor_s))
    if comm.world_size == 1:
        return rates
    sizes = collective_sizes(quick)
    collectives = {k: {str(comm.world_size): c} for k, c in measure_collectives(comm, sizes, repeats).items()}
    rates = dataclasses.replace(rates, collectives=collectives, skew=measure_rank_skew(comm, 1, repeats=repeats),
                                train_skew=measure_rank_skew(comm, 256, repeats=repeats))
    in_step, train_in_step = collective_overheads(rates, comm, model, repeats)
    rates = dataclasses.replace(rates, collective_overhead_s=in_step, train_collective_overhead_s=train_in_step)
    rates = dataclasses.replace(rates, tp_framework=framework_costs(rates, comm, families, repeats, tensor_s))
    dp: dict = {}
    for mode, wrap in sorted((dp_wrappers or {}).items()):
        dp.update(framework_costs(rates, comm, families, repeats, tensor_s, dp=(mode, wrap)))
    return dataclasses.replace(rates, dp_framework=dp)


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
                               stored_bandwidth=min(r.stored_bandwidth for r in per_rank),
                               copy_bandwidth=min(r.copy_bandwidth for r in per_rank),
                               optimizer_tensor_s=max(r.optimizer_tensor_s for r in per_rank),
                               skew=max(r.skew for r in per_rank),
                               train_skew=max(r.train_skew for r in per_rank),
                               import_bytes=max(r.import_bytes for r in per_rank),
                               runtime_bytes=max(r.runtime_bytes for r in per_rank),
                               framework=_worst([r.framework for r in per_rank]),
                               tp_framework=_worst([r.tp_framework for r in per_rank]) if first.tp_framework else {},
                               dp_framework=_worst([r.dp_framework for r in per_rank]) if first.dp_framework else {})


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
