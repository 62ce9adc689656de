"""CommProfiler: counts, bytes, nccl-tests bandwidths, stats, JSON / Chrome trace export, record_function."""
from __future__ import annotations

import json

import pytest
import torch

import tpkit
from tpkit.comm import AlgorithmCommunicator, CommProfiler, CommunicationOptimizer, create_communicator, run_threads
from tpkit.comm.profiler import bus_factor, size_bucket


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_reduce", 3) == pytest.approx(4 / 3)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 3) == pytest.approx(2 / 3)
    assert bus_factor("broadcast", 8) == 1.0
    assert bus_factor("all_reduce", 1) == 1.0
    with pytest.raises(ValueError, match="unknown op 'alltoall'"):
        bus_factor("alltoall", 2)
    assert [size_bucket(b) for b in (0, 1, 1000, 1024, 1025)] == [0, 1, 1024, 1024, 2048]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_counts_bytes_and_bandwidth(world_size):
    def body(comm):
        prof = CommProfiler(comm)
        x = torch.randn(256, 4)  # 4 KiB
        outs = [prof.all_reduce(x) for _ in range(3)]
        outs.append(prof.all_gather(x, dim=1))
        outs.append(prof.reduce_scatter(x))
        outs.append(prof.broadcast(x, src=0))
        outs.append(prof.all_reduce(x, async_op=True).wait())
        ref = [comm.all_reduce(x)] * 3 + [comm.all_gather(x, dim=1), comm.reduce_scatter(x), comm.broadcast(x),
                                          comm.all_reduce(x)]
        same = all(torch.equal(a, b) for a, b in zip(outs, ref))
        return same, prof.records, prof.stats()

    for same, records, stats in run_threads(body, world_size):
        assert same
        assert [r.op for r in records] == ["all_reduce"] * 3 + ["all_gather", "reduce_scatter", "broadcast", "all_reduce"]
        n = world_size
        assert [r.bytes for r in records] == [4096] * 3 + [4096 * n, 4096, 4096, 4096]
        for r in records:
            assert r.world_size == n and r.dtype == "float32" and r.algorithm == "builtin" and r.duration > 0
            assert r.algbw == pytest.approx(r.bytes / r.duration / 1e9)
            assert r.busbw == pytest.approx(r.algbw * bus_factor(r.op, n))
        ar = [s for s in stats if s["op"] == "all_reduce"]
        assert len(ar) == 1 and ar[0]["count"] == 4 and ar[0]["bytes"] == 4 * 4096 and ar[0]["size_bucket"] == 4096
        bws = sorted(r.busbw for r in records if r.op == "all_reduce")
        assert ar[0]["busbw_min"] == pytest.approx(bws[0]) and ar[0]["busbw_max"] == pytest.approx(bws[-1])
        assert ar[0]["busbw_p50"] == pytest.approx(bws[1]) and ar[0]["busbw_p99"] == pytest.approx(bws[-1])
        assert ar[0]["total_time"] == pytest.approx(sum(r.duration for r in records if r.op == "all_reduce"))


def test_algorithm_and_fallback_notes_are_recorded_and_subgroups_share_the_profile():
    def body(comm):
        prof = CommProfiler(AlgorithmCommunicator(comm, "ring"))
        x = torch.ones(64)
        prof.all_reduce(x)
        prof.all_reduce(x, async_op=True).wait()
        prof.broadcast(x)  # ring has no broadcast: builtin
        group = prof.new_group([0, 1])
        if group is not None:
            group.all_reduce(x)
        return [(r.op, r.algorithm, r.note, r.world_size) for r in prof.records]

    recs = run_threads(body, 3)[0]
    assert recs[0] == ("all_reduce", "ring", "", 3)
    assert recs[1][1] == "builtin" and "async_op" in recs[1][2]
    assert recs[2][:2] == ("broadcast", "builtin")
    assert recs[3] == ("all_reduce", "ring", "", 2)


def test_exports_json_and_chrome_trace_and_record_function(tmp_path):
    def body():
        comm = tpkit.get_communicator()
        prof = create_communicator("threads", profile=True)
        x = torch.ones(1000)
        if comm.rank == 0:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
                prof.all_reduce(x)
            names = {e.name for e in tp.events()}
        else:
            prof.all_reduce(x)
            names = set()
        prof.all_gather(x)
        if comm.rank == 0:
            prof.to_json(tmp_path / "p.json")
            prof.export_chrome_trace(tmp_path / "t.json")
        return names

    with_names = tpkit.launch(body, 2, backend="threads")[0]
    assert "tpkit::all_reduce" in with_names
    data = json.loads((tmp_path / "p.json").read_text())
    assert [r["op"] for r in data["records"]] == ["all_reduce", "all_gather"]
    assert data["records"][1]["bytes"] == 8000 and data["records"][1]["busbw"] > 0
    trace = json.loads((tmp_path / "t.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in events] == ["all_reduce", "all_gather"]
    assert all(e["dur"] > 0 and e["ts"] >= 0 and e["args"]["algorithm"] == "builtin" for e in events)
    assert events[1]["ts"] >= events[0]["ts"] + events[0]["dur"]


def test_disabled_profiler_records_nothing_and_optimizer_profiles():
    def body(comm):
        prof = CommProfiler(comm, enabled=False)
        prof.all_reduce(torch.ones(4))
        opt = CommunicationOptimizer(comm, algorithm="recursive_doubling")
        out = opt.all_reduce(torch.ones(4) * (comm.rank + 1))
        return len(prof.records), [(r.op, r.algorithm) for r in opt.records], out.tolist(), opt.pool.pinned

    n_disabled, recs, out, pinned = run_threads(body, 4)[0]
    assert n_disabled == 0 and recs == [("all_reduce", "recursive_doubling")] and out == [10.0] * 4
    assert pinned is torch.cuda.is_available()


def _overhead_body(iters):
    import statistics
    import time

    comm = tpkit.get_communicator()
    prof = CommProfiler(comm)
    x = torch.randn(1 << 18)  # 1 MiB
    plain, profiled = [], []
    for _ in range(iters):  # alternate, so load changes hit both equally
        for target, times in ((comm, plain), (prof, profiled)):
            comm.barrier()
            start = time.perf_counter()
            target.all_reduce(x)
            times.append(time.perf_counter() - start)
    return statistics.median(plain), statistics.median(profiled)


@pytest.mark.slow
def test_profiling_overhead_on_gloo_1mib_all_reduce_is_small():
    # target is 5%; the test allows 25% because the box is shared and the medians still move, and takes the
    # best of three tries: another job's burst can hit one try (3.3x once), a real overhead hits all three
    tries = []
    for _ in range(3):
        plain, profiled = tpkit.launch(_overhead_body, 2, args=(25,), timeout=60)[0]
        tries.append((plain, profiled))
        if profiled <= plain * 1.25:
            return
    raise AssertionError(f"profiled all_reduce slower than 1.25x plain in every try (plain, profiled): {tries}")


def test_profile_times_any_callable_beside_the_collectives():
    import time

    def body(comm):
        prof = CommProfiler(comm)
        x = torch.ones(256)
        prof.all_reduce(x)
        got = prof.profile(lambda a, b=0: (time.sleep(0.02), a + b)[1], 2, b=3, name="step")
        handle = prof.profile(comm.all_reduce, x, async_op=True, name="overlapped")  # an async collective
        waited_before = [r.op for r in prof.records]
        time.sleep(0.01)
        out = handle.wait()
        handle.wait()  # a second wait records nothing more
        named = prof.profile(torch.add, x, x)  # the function's own name by default
        with pytest.raises(TypeError, match="expected a callable, got Tensor"):
            prof.profile(x)
        return got, waited_before, out, prof.records, named

    for got, waited_before, out, records, named in run_threads(body, 2):
        assert got == 5 and torch.equal(out, torch.full((256,), 2.0)) and torch.equal(named, torch.full((256,), 2.0))
        assert waited_before == ["all_reduce", "step"]  # the async one is recorded when it has been waited for
        assert [(r.op, r.kind) for r in records] == [("all_reduce", "collective"), ("step", "call"),
                                                     ("overlapped", "call"), ("add", "call")]
        step, overlapped = records[1], records[2]
        assert step.duration >= 0.02 and overlapped.duration >= 0.01
        assert step.bytes == 0 and step.busbw == 0.0 and step.algorithm == ""
        assert step.start >= records[0].start + records[0].duration


def test_a_profiled_call_given_its_bytes_reports_a_bandwidth():
    import time

    def body(comm):
        prof = CommProfiler(comm)
        x = torch.ones(1 << 18)  # 1 MiB
        out = prof.profile(lambda t: (time.sleep(0.01), comm.all_reduce(t))[1], x, name="sum", bytes=x.nbytes)
        plain = prof.profile(lambda: None, name="nothing")  # no bytes given: none recorded, as before
        with pytest.raises(ValueError, match=r"bytes must be a non-negative int .* got -1"):
            prof.profile(lambda: None, bytes=-1)
        return out, prof.records, prof.stats().totals, plain

    for out, records, totals, plain in run_threads(body, 2):
        assert torch.equal(out, torch.full((1 << 18,), 2.0)) and plain is None
        call, nothing = records
        assert (call.op, call.kind, call.bytes) == ("sum", "call", 1 << 20)
        assert call.algbw == pytest.approx((1 << 20) / call.duration / 1e9) and call.algbw > 0
        assert call.busbw == call.algbw  # a call has no collective's bus factor
        assert nothing.bytes == 0 and nothing.algbw == 0.0
        assert {t["op"]: t["bytes"] for t in totals} == {"sum": 1 << 20, "nothing": 0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA-event timing of CUDA tensors")
def test_cuda_tensors_are_timed_with_cuda_events_read_lazily():
    from tpkit.comm.profiler import _PendingCuda

    prof = create_communicator("threads", profile=True)  # a world of one
    a = torch.randn(2048, 2048, device="cuda")
    product = prof.profile(lambda x: x @ x, a, name="matmul", bytes=3 * a.nbytes)
    total = prof.all_reduce(a)
    pending = list(prof._root._records)  # before anything reads them: still two events each
    records = prof.records
    assert product.is_cuda and torch.equal(total, a)
    assert [type(p) for p in pending] == [_PendingCuda, _PendingCuda]
    assert [(r.op, r.kind) for r in records] == [("matmul", "call"), ("all_reduce", "collective")]
    for r in records:
        assert r.duration > 0 and r.algbw == pytest.approx(r.bytes / r.duration / 1e9)
    assert records[0].bytes == 3 * a.nbytes and records[1].bytes == a.nbytes


def test_stats_totals_reset_and_summary():
    def body(comm):
        prof = CommProfiler(comm)
        small, big = torch.ones(256), torch.ones(1 << 14)  # 1 KiB and 64 KiB: two size buckets
        for t in (small, small, big):
            prof.all_reduce(t)
        prof.all_gather(small)
        prof.profile(lambda: None, name="compute")
        stats = prof.stats()
        text = prof.summary()
        records = prof.records
        prof.reset()
        return stats, text, records, prof.records, prof.stats(), prof.summary()

    for stats, text, records, after, empty, empty_text in run_threads(body, 2):
        assert [(s["op"], s["size_bucket"]) for s in stats] == [("all_gather", 2048), ("all_reduce", 1024),
                                                                ("all_reduce", 65536), ("compute", 0)]
        totals = {t["op"]: t for t in stats.totals}
        ar = [r for r in records if r.op == "all_reduce"]
        assert totals["all_reduce"]["count"] == 3 and totals["all_reduce"]["bytes"] == 2 * 1024 + 65536
        assert totals["all_reduce"]["total_time"] == pytest.approx(sum(r.duration for r in ar))
        assert totals["all_reduce"]["busbw_mean"] == pytest.approx(sum(r.busbw for r in ar) / 3)
        bus_bytes = sum(r.bytes * bus_factor("all_reduce", 2) for r in ar)
        assert totals["all_reduce"]["busbw_overall"] == pytest.approx(bus_bytes / sum(r.duration for r in ar) / 1e9)
        assert totals["compute"]["kind"] == "call" and totals["compute"]["bytes"] == 0
        assert stats.total == {"count": 5, "bytes": 2 * 1024 + 65536 + 2048,
                               "total_time": pytest.approx(sum(r.duration for r in records))}
        assert "communication on rank" in text and "totals on rank" in text
        for fragment in ("all_reduce", "compute", "1.00 KiB", "64.00 KiB", "66.00 KiB"):
            assert fragment in text, fragment
        assert after == [] and list(empty) == [] and empty.totals == [] and empty.total["count"] == 0
        assert "all_reduce" not in empty_text and "totals on rank" in empty_text


def test_files_are_written_atomically(tmp_path, monkeypatch):
    prof = create_communicator("threads", profile=True)
    prof.all_reduce(torch.ones(4))
    for name in ("to_json", "export_chrome_trace"):
        write = getattr(prof, name)
        target = tmp_path / f"{name}.json"
        target.write_text("previous")
        monkeypatch.setattr("os.fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
        with pytest.raises(OSError, match="disk full"):
            write(target)
        assert target.read_text() == "previous"  # a failed write leaves the old file whole
        monkeypatch.undo()
        write(target)
        data = json.loads(target.read_text())
        ops = [r["op"] for r in data["records"]] if name == "to_json" else [e["name"] for e in data["traceEvents"][1:]]
        assert ops == ["all_reduce"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export_chrome_trace.json", "to_json.json"]  # no temp files
