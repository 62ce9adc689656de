"""`CommProfiler`: what every collective cost, per call, with nccl-tests' bandwidth definitions.

Why: TP time goes into all-reduces, and a user cannot fix what they cannot see. The profiler wraps any
Communicator (so layers use it unchanged) and records per call: op, bytes, dtype, group size, algorithm
(and why it fell back to builtin, if it did), duration and algbw / busbw. Each call is also a
`torch.profiler.record_function` range while a torch profiler runs, so it shows up in its traces next to
the compute.

Bandwidths follow nccl-tests (doc/PERFORMANCE.md): algbw = bytes / time with bytes = the tensor for
all_reduce and broadcast, the whole array (gathered output, scattered input) for all_gather and
reduce_scatter, and this rank's whole send buffer (its input) for all_to_all; busbw = algbw x 2(n-1)/n for
all_reduce, x (n-1)/n for all_gather, reduce_scatter and all_to_all, x 1 for broadcast — the rate each link must sustain, comparable across world sizes.

Durations: wall clock on CPU; CUDA events on GPU tensors, read lazily (no synchronisation on the hot
path; events are resolved when records are read).

Beside the collectives, `profile(fn, *args, name=..., bytes=...)` times any callable (the seed's
Profile(operation, dataSizeBytes, func); a callable that returns a `Handle` is timed until the handle is waited
for, its ProfileAsync) into the same records, so a step's compute and its communication read as one timeline.
`stats()` groups records by op and size and also totals each op over the whole run (`.totals`, `.total`; the
seed's GetStatistics); `reset()` clears them (Clear). Files are written atomically (a temporary file renamed
over the target), so a reader never sees half a trace.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import tempfile
import time
from typing import Any, Callable, Sequence

import torch

from .communicator import Communicator
from .handle import Handle
from .ops import ReduceOp
from .wrapper import WrappedCommunicator

_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
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
    """One profiled call. `duration` is seconds; bandwidths are GB/s (1e9 bytes/s) as in nccl-tests.

    `kind` is "collective" for the communicator's own operations and "call" for `CommProfiler.profile`
    (bytes as its caller gave them, 0 by default: a call moves no bytes the profiler can see; its busbw is its
    algbw, there being no collective's bus factor to apply)."""

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
    kind: str = "collective"

    @property
    def algbw(self) -> float:
        return self.bytes / self.duration / 1e9 if self.duration > 0 else 0.0

    @property
    def busbw(self) -> float:
        if self.kind != "collective":
            return self.algbw
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
        return self._timed(op, "collective", int(nbytes), str(tensor.dtype).replace("torch.", ""),
                           tuple(tensor.shape), tensor.is_cuda, call, async_op)

    def _timed(self, op: str, kind: str, nbytes: int, dtype: str, shape: tuple, cuda: bool, call: Callable[[], Any],
               async_op: bool | None):
        """Run `call()` and record it; `async_op=None`: asynchronous when the call returns a `Handle`, whose
        record then ends when it is waited for."""
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
        if async_op is None:
            async_op = isinstance(result, Handle)
        algorithm = getattr(self.inner, "last_algorithm", "builtin") if kind == "collective" else ""
        note = getattr(self.inner, "last_note", "") if kind == "collective" else ""

        def record(end: float) -> None:
            rec = CommRecord(op, nbytes, dtype, self.world_size, algorithm, start - root._t0, end - start,
                             self.rank, note, shape, kind)
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

    def profile(self, fn: Callable[..., Any], *args: Any, name: str | None = None, bytes: int = 0,
                **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, timed and recorded beside the collectives as op `name` (default: the
        function's name), kind "call"; returns what `fn` returns. `bytes`: how many bytes the call moves (the
        seed's `Profile(operation, dataSizeBytes, func)`), so its record reports a bandwidth; 0, the default,
        records none. CUDA events time it when a tensor argument is on a GPU or the backend is nccl (read
        lazily, like the collectives'), `perf_counter` otherwise. If `fn` returns a `Handle` (an async
        collective), the record ends when the handle is waited for."""
        if not callable(fn):
            raise TypeError(f"CommProfiler.profile: expected a callable, got {type(fn).__name__}; "
                            f"pass the function and its arguments: prof.profile(fn, x, name='step')")
        if isinstance(bytes, bool) or not isinstance(bytes, int) or bytes < 0:
            raise ValueError(f"CommProfiler.profile: bytes must be a non-negative int (the bytes the call moves), "
                             f"got {bytes!r}")
        if not self.enabled:
            return fn(*args, **kwargs)
        label = name or getattr(fn, "__name__", None) or type(fn).__name__
        cuda = getattr(self.base, "torch_backend", None) == "nccl" or any(
            isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *kwargs.values()))
        return self._timed(label, "call", bytes, "", (), cuda, lambda: fn(*args, **kwargs), None)

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

    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int,
                   scatter_sizes: Sequence[int] | None = None, gather_sizes: Sequence[int] | None = None,
                   async_op: bool = False):
        nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
        return self._profiled("all_to_all", tensor, nbytes, async_op,
                              lambda: self.inner.all_to_all(tensor, scatter_dim, gather_dim, scatter_sizes,
                                                            gather_sizes, async_op=async_op))

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
        """Forget every record (the seed's Clear); times start again from zero."""
        self._root._records.clear()
        self._root._t0 = time.perf_counter()

    def stats(self) -> "CommStats":
        """Per (op, size bucket): count, bytes, total_time (s), and busbw mean/min/max/p50/p99 (GB/s), plus the
        mean algbw; sorted by op, then size. The list also carries whole-run totals: `.totals`, one dict per op
        (kind, count, bytes, total_time, busbw_mean over calls, busbw_overall = bus bytes / total time), and
        `.total` over everything (count, bytes, total_time)."""
        records = self.records
        groups: dict[tuple[str, int], list[CommRecord]] = {}
        for rec in records:
            groups.setdefault((rec.op, size_bucket(rec.bytes)), []).append(rec)
        rows = CommStats()
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
        by_op: dict[str, list[CommRecord]] = {}
        for rec in records:
            by_op.setdefault(rec.op, []).append(rec)
        for op, recs in sorted(by_op.items()):
            total_time = sum(r.duration for r in recs)
            bus_bytes = sum(r.busbw * r.duration for r in recs) * 1e9
            rows.totals.append({
                "op": op, "kind": recs[0].kind, "count": len(recs), "bytes": sum(r.bytes for r in recs),
                "total_time": total_time, "busbw_mean": sum(r.busbw for r in recs) / len(recs),
                "busbw_overall": bus_bytes / total_time / 1e9 if total_time > 0 else 0.0,
            })
        rows.total = {"count": len(records), "bytes": sum(r.bytes for r in records),
                      "total_time": sum(r.duration for r in records)}
        return rows

    def summary(self, width: int | None = None) -> str:
        """`stats()` as two tables, per op and size, then per op over the whole run (fitted to `width`
        columns; None: natural width)."""
        from ..tables import Column, format_bytes, render_table

        stats = self.stats()
        columns = [Column("op", "left"), Column("bucket"), Column("count"), Column("total ms"),
                   Column("busbw GB/s p50"), Column("p99", drop=2), Column("algorithms", "left", drop=1, wrap="words")]
        rows = [[s["op"], format_bytes(s["size_bucket"]), str(s["count"]), f"{s['total_time'] * 1e3:.2f}",
                 f"{s['busbw_p50']:.3f}", f"{s['busbw_p99']:.3f}", ", ".join(s["algorithms"])] for s in stats]
        title = f"communication on rank {self.rank} of {self.world_size}"
        columns_total = [Column("op", "left"), Column("kind", "left", drop=1), Column("calls"), Column("bytes"),
                         Column("total ms"), Column("busbw GB/s mean")]
        totals = [[t["op"], t["kind"], str(t["count"]), format_bytes(t["bytes"]), f"{t['total_time'] * 1e3:.2f}",
                   f"{t['busbw_mean']:.3f}"] for t in stats.totals]
        totals.append(["all", "", str(stats.total["count"]), format_bytes(stats.total["bytes"]),
                       f"{stats.total['total_time'] * 1e3:.2f}", ""])
        return (render_table(title, columns, rows, width) + "\n"
                + render_table(f"totals on rank {self.rank} of {self.world_size}", columns_total, totals, width))

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """Records, stats and totals as JSON; written atomically to `path` if given."""
        stats = self.stats()
        text = json.dumps({"rank": self.rank, "world_size": self.world_size, "backend": self.backend,
                           "records": [r.to_dict() for r in self.records], "stats": list(stats),
                           "totals": stats.totals, "total": stats.total}, indent=1)
        if path is not None:
            write_atomically(path, text)
        return text

    def export_chrome_trace(self, path: str | os.PathLike) -> dict:
        """Write a Chrome trace (JSON, opens in Perfetto / chrome://tracing): one complete event per call,
        one process per rank. Returns the trace dict."""
        events = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                   "args": {"name": f"tpkit rank {self.rank}"}}]
        for r in self.records:
            events.append({"name": r.op, "cat": "comm" if r.kind == "collective" else "call", "ph": "X",
                           "pid": r.rank, "tid": 0,
                           "ts": r.start * 1e6, "dur": r.duration * 1e6,
                           "args": {"kind": r.kind, "bytes": r.bytes, "dtype": r.dtype, "world_size": r.world_size,
                                    "algorithm": r.algorithm, "algbw_GBps": r.algbw, "busbw_GBps": r.busbw,
                                    "note": r.note}})
        trace = {"traceEvents": events, "displayTimeUnit": "ms"}
        write_atomically(path, json.dumps(trace))
        return trace


class CommStats(list):
    """`CommProfiler.stats()`: the per (op, size bucket) rows, plus `totals` (one dict per op over the whole
    run) and `total` (count, bytes and time of every record)."""

    def __init__(self, rows=()):
        super().__init__(rows)
        self.totals: list[dict[str, Any]] = []
        self.total: dict[str, Any] = {"count": 0, "bytes": 0, "total_time": 0.0}


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same directory and a rename: a reader (or a
    crash) sees the old file or the new one, never a torn one."""
    directory = os.path.dirname(os.fspath(path)) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(os.fspath(path))}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
