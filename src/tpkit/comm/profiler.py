"""`CommProfiler`: what every collective cost, per call, with nccl-tests' bandwidth definitions.

Why: TP time goes into all-reduces, and a user cannot fix what they cannot see. The profiler wraps any
Communicator (so layers use it unchanged) and records per call: op, bytes, dtype, group size, algorithm
(and why it fell back to builtin, if it did), duration and algbw / busbw. Each call is also a
`torch.profiler.record_function` range while a torch profiler runs, so it shows up in its traces next to
the compute.

Bandwidths follow nccl-tests (doc/PERFORMANCE.md): algbw = bytes / time with bytes = the tensor for
all_reduce and broadcast and the whole array (gathered output, scattered input) for all_gather and
reduce_scatter; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather and reduce_scatter,
x 1 for broadcast — the rate each link must sustain, comparable across world sizes.

Durations: wall clock on CPU; CUDA events on GPU tensors, read lazily (no synchronisation on the hot
path; events are resolved when records are read).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import time
from typing import Any, Sequence

import torch

from .communicator import Communicator
from .ops import ReduceOp
from .wrapper import WrappedCommunicator

_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw for `op` on `world_size` ranks (1 for a single rank and for broadcast)."""
    if world_size <= 1:
        return 1.0
    if op not in _BUS_FACTOR:
        raise ValueError(f"bus_factor: unknown op {op!r}; valid: {', '.join(_BUS_FACTOR)}")
    return _BUS_FACTOR[op](world_size)


def _torch_profiler_on() -> bool:
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    return True if enabled is None else bool(enabled())


def size_bucket(nbytes: int) -> int:
    """The power of two at or above `nbytes` (0 stays 0): the bucket `stats()` groups sizes by."""
    return 0 if nbytes <= 0 else 1 << math.ceil(math.log2(nbytes))


@dataclasses.dataclass
class CommRecord:
    """One profiled call. `duration` is seconds; bandwidths are GB/s (1e9 bytes/s) as in nccl-tests."""

    op: str
    bytes: int
    dtype: str
    world_size: int
    algorithm: str
    start: float  # seconds since the profiler started
    duration: float
    rank: int
    note: str = ""
    shape: tuple = ()

    @property
    def algbw(self) -> float:
        return self.bytes / self.duration / 1e9 if self.duration > 0 else 0.0

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.world_size)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["shape"] = list(self.shape)
        out.update(algbw=self.algbw, busbw=self.busbw)
        return out


class _PendingCuda:
    """A record whose duration is still two CUDA events; resolved on first read."""

    def __init__(self, record: CommRecord, start: Any, end: Any):
        self.record, self.start_event, self.end_event = record, start, end

    def resolve(self) -> CommRecord:
        self.end_event.synchronize()
        self.record.duration = self.start_event.elapsed_time(self.end_event) / 1e3
        return self.record


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


class CommProfiler(WrappedCommunicator):
    """Record every collective of `inner`; `records`, `stats()`, `to_json()`, `export_chrome_trace()`.

    `enabled` can be switched off and on; `max_records` bounds memory (oldest records are dropped).
    Subgroups made with `new_group` record into the same profiler.
    """

    def __init__(self, inner: Communicator, enabled: bool = True, max_records: int = 100_000,
                 _shared: "CommProfiler | None" = None):
        super().__init__(inner)
        self.enabled = enabled
        root = _shared if _shared is not None else self
        self._root = root
        if _shared is None:
            self._records: collections.deque = collections.deque(maxlen=max_records)
            self._t0 = time.perf_counter()

    def _rewrap(self, group: Communicator) -> Communicator:
        return CommProfiler(group, self.enabled, _shared=self._root)

    # -- recording --------------------------------------------------------------------------------
    def _profiled(self, op: str, tensor: torch.Tensor, nbytes: int, async_op: bool, call):
        if not self.enabled or not isinstance(tensor, torch.Tensor):
            return call()
        cuda = tensor.is_cuda
        # The range only when a torch profiler listens: an idle record_function still makes c10d carry
        # profiler state to its worker thread, which cost ~0.1 ms per gloo call on the CPU box.
        scope = torch.profiler.record_function(f"tpkit::{op}") if _torch_profiler_on() else contextlib.nullcontext()
        with scope:
            if cuda:
                start_ev = torch.cuda.Event(enable_timing=True)
                end_ev = torch.cuda.Event(enable_timing=True)
                start_ev.record()
            start = time.perf_counter()
            result = call()
        root = self._root

        def record(end: float) -> None:
            rec = CommRecord(op, int(nbytes), str(tensor.dtype).replace("torch.", ""), self.world_size,
                             getattr(self.inner, "last_algorithm", "builtin"), start - root._t0, end - start,
                             self.rank, getattr(self.inner, "last_note", ""), tuple(tensor.shape))
            if cuda:
                end_ev.record()
                root._records.append(_PendingCuda(rec, start_ev, end_ev))
            else:
                root._records.append(rec)

        if async_op:  # the operation ends when its handle is waited for
            raw_wait = result.wait

            def wait():
                out = raw_wait()
                if not getattr(wait, "done", False):
                    wait.done = True
                    record(time.perf_counter())
                return out
            result.wait = wait
            return result
        record(time.perf_counter())
        return result

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False):
        nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
        return self._profiled("all_reduce", tensor, nbytes, async_op,
                              lambda: self.inner.all_reduce(tensor, op=op, async_op=async_op))

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None,
                   async_op: bool = False):
        nbytes = 0
        if isinstance(tensor, torch.Tensor):
            nbytes = tensor.numel() * tensor.element_size() * self.world_size
            if sizes is not None and tensor.dim() and tensor.shape[dim]:
                nbytes = tensor.numel() // tensor.shape[dim] * tensor.element_size() * sum(int(s) for s in sizes)
        return self._profiled("all_gather", tensor, nbytes, async_op,
                              lambda: self.inner.all_gather(tensor, dim=dim, sizes=sizes, async_op=async_op))

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, dim: int = 0,
                       sizes: Sequence[int] | None = None, async_op: bool = False):
        nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
        return self._profiled("reduce_scatter", tensor, nbytes, async_op,
                              lambda: self.inner.reduce_scatter(tensor, op=op, dim=dim, sizes=sizes,
                                                                async_op=async_op))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
        return self._profiled("broadcast", tensor, nbytes, async_op,
                              lambda: self.inner.broadcast(tensor, src=src, async_op=async_op))

    # -- reading ----------------------------------------------------------------------------------
    @property
    def records(self) -> list[CommRecord]:
        """Every record so far, oldest first (CUDA timings resolved here)."""
        out = []
        for item in self._root._records:
            out.append(item.resolve() if isinstance(item, _PendingCuda) else item)
        return out

    def reset(self) -> None:
        self._root._records.clear()
        self._root._t0 = time.perf_counter()

    def stats(self) -> list[dict[str, Any]]:
        """Per (op, size bucket): count, bytes, total_time (s), and busbw mean/min/max/p50/p99 (GB/s),
        plus the mean algbw. Sorted by op, then size."""
        groups: dict[tuple[str, int], list[CommRecord]] = {}
        for rec in self.records:
            groups.setdefault((rec.op, size_bucket(rec.bytes)), []).append(rec)
        rows = []
        for (op, bucket), recs in sorted(groups.items()):
            bw = sorted(r.busbw for r in recs)
            total_time = sum(r.duration for r in recs)
            total_bytes = sum(r.bytes for r in recs)
            rows.append({
                "op": op, "size_bucket": bucket, "count": len(recs), "bytes": total_bytes,
                "total_time": total_time, "algorithms": sorted({r.algorithm for r in recs}),
                "busbw_mean": sum(bw) / len(bw), "busbw_min": bw[0], "busbw_max": bw[-1],
                "busbw_p50": _percentile(bw, 50), "busbw_p99": _percentile(bw, 99),
                "algbw_mean": sum(r.algbw for r in recs) / len(recs),
            })
        return rows

    def summary(self, width: int | None = None) -> str:
        """`stats()` as a table (fitted to `width` columns; None: natural width)."""
        from ..tables import Column, format_bytes, render_table

        columns = [Column("op", "left"), Column("bucket"), Column("count"), Column("total ms"),
                   Column("busbw GB/s p50"), Column("p99", drop=2), Column("algorithms", "left", drop=1, wrap="words")]
        rows = [[s["op"], format_bytes(s["size_bucket"]), str(s["count"]), f"{s['total_time'] * 1e3:.2f}",
                 f"{s['busbw_p50']:.3f}", f"{s['busbw_p99']:.3f}", ", ".join(s["algorithms"])] for s in self.stats()]
        return render_table(f"communication on rank {self.rank} of {self.world_size}", columns, rows, width)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """Records and stats as JSON; written to `path` if given."""
        text = json.dumps({"rank": self.rank, "world_size": self.world_size, "backend": self.backend,
                           "records": [r.to_dict() for r in self.records], "stats": self.stats()}, indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def export_chrome_trace(self, path: str | os.PathLike) -> dict:
        """Write a Chrome trace (JSON, opens in Perfetto / chrome://tracing): one complete event per call,
        one process per rank. Returns the trace dict."""
        events = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                   "args": {"name": f"tpkit rank {self.rank}"}}]
        for r in self.records:
            events.append({"name": r.op, "cat": "comm", "ph": "X", "pid": r.rank, "tid": 0,
                           "ts": r.start * 1e6, "dur": r.duration * 1e6,
                           "args": {"bytes": r.bytes, "dtype": r.dtype, "world_size": r.world_size,
                                    "algorithm": r.algorithm, "algbw_GBps": r.algbw, "busbw_GBps": r.busbw,
                                    "note": r.note}})
        trace = {"traceEvents": events, "displayTimeUnit": "ms"}
        with open(path, "w") as f:
            json.dump(trace, f)
        return trace
