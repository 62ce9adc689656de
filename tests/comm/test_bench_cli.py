"""`tpkit bench`: nccl-tests columns, JSON output, the #wrong checker, the plot, and bad options."""
from __future__ import annotations

import json

import pytest
import torch

from tpkit.cli import main
from tpkit.comm import algorithms
from tpkit.comm.profiler import bus_factor

COLUMNS = {"collective", "algorithm", "chosen", "bytes", "count", "type", "redop", "time_us", "algbw", "busbw", "wrong"}


def _run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["bench", "--no-progress", "--json", "-", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_threads_json_rows_cover_every_collective_size_and_algorithm(capsys, tmp_path):
    code, data = _run_json(capsys, "--backend", "threads", "-n", "3", "-b", "1K", "-e", "16K", "-f", "4",
                           "-a", "builtin,auto,ring", "--iters", "2", "--repeats", "2", "--budget", "0", "--no-calibrate",
                           "--plot", str(tmp_path / "busbw.png"))
    assert code == 0 and data["world_size"] == 3 and data["backend"] == "threads"
    rows = data["rows"]
    assert all(COLUMNS <= set(r) for r in rows)
    keys = {(r["collective"], r["bytes"], r["algorithm"]) for r in rows}
    sizes = sorted({r["bytes"] for r in rows if r["collective"] == "all_reduce"})
    assert sizes == [1020, 4092, 16380]  # 1K, 4K, 16K rounded down to a multiple of 3 floats
    for col in ("all_reduce", "all_gather", "reduce_scatter"):
        assert {(col, s, a) for s in sizes for a in ("builtin", "auto", "ring")} <= keys
    assert not any(r["collective"] == "broadcast" and r["algorithm"] == "ring" for r in rows)  # no ring broadcast
    for r in rows:
        assert r["wrong"] == 0 and r["count"] * 4 == r["bytes"] and r["time_us"] > 0
        assert r["algbw"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw"] == pytest.approx(r["algbw"] * bus_factor(r["collective"], 3))
        assert r["redop"] == ("sum" if r["collective"] in ("all_reduce", "reduce_scatter") else "none")
        if r["algorithm"] == "auto":  # MPICH's choice, or builtin if it measured slower
            assert r["chosen"] in [*algorithms.ALGORITHMS[r["collective"]], "builtin"]
    assert (tmp_path / "busbw.png").read_bytes()[:4] == b"\x89PNG"


def test_table_output_and_wrong_results_are_counted(capsys, monkeypatch):
    def broken_ring(comm, tensor, op):
        return tensor + 100

    monkeypatch.setitem(algorithms.ALGORITHMS["all_reduce"], "ring", broken_ring)
    monkeypatch.setenv("COLUMNS", "160")  # every column fits (a narrower terminal drops the least needed first)
    code = main(["bench", "--backend", "threads", "-n", "2", "-c", "all_reduce", "-b", "4K", "-e", "4K",
                 "-a", "builtin,ring", "--iters", "1", "--repeats", "1", "--budget", "0", "--op", "max", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1
    header = next(line for line in out.splitlines() if "time(us)" in line)
    for column in ("size", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"):
        assert column in header
    ring = next(line for line in out.splitlines() if " ring " in line)
    builtin = next(line for line in out.splitlines() if " builtin " in line)
    assert " max " in ring and ring.split()[-2] == "2048"  # 1024 wrong floats on each of 2 ranks
    assert builtin.split()[-1] == "0"
    assert "FAILED" in out


def test_table_in_80_columns(capsys, monkeypatch, tmp_path):
    """In an 80-column terminal each row fits one line, whole: count, type, redop, algbw go first (type and redop
    then head each block), size, algorithm, time, busbw and #wrong stay."""
    monkeypatch.setenv("COLUMNS", "80")
    code = main(["bench", "--backend", "threads", "-n", "2", "-c", "all_reduce,all_gather", "-b", "4K", "-e", "16K",
                 "-a", "builtin,auto,recursive_doubling", "--repeats", "1", "--budget", "0", "--no-calibrate",
                 "--no-progress", "--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "out.json").read_text())
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 80
    header = next(line for line in out.splitlines() if "time(us)" in line).split()
    assert header[:2] == ["#", "size"] and {"algorithm", "time(us)", "busbw(GB/s)", "#wrong"} <= set(header)
    assert len(header) < 12  # something was left out: the full row is 126 characters
    moved = [("float32", "float32"), ("sum", "none")] if "redop" not in header else [("float32", "float32")]
    assert "type" not in header and "count" not in header
    assert f"# all_reduce ({', '.join(m[0] for m in moved)})" in out
    assert f"# all_gather ({', '.join(m[1] for m in moved)})" in out
    lines = [line for line in out.splitlines() if line and not line.startswith("#")]
    assert len(lines) == len(data["rows"])
    for line, r in zip(lines, data["rows"]):
        name = r["algorithm"] + (f" -> {r['chosen']}" if r["algorithm"] == "auto" else "")
        assert line.split()[0] == str(r["bytes"]) and f" {name} " in line
        assert f" {r['time_us']:.1f} " in line and f" {r['busbw']:.3f} " in line


def test_gloo_processes_with_calibrated_auto(capsys):
    code, data = _run_json(capsys, "-n", "2", "-c", "all_reduce,reduce_scatter", "-b", "4K", "-e", "64K", "-f", "16",
                           "--iters", "2", "--repeats", "1", "--budget", "0", "--calibration-budget", "1", "--op", "avg",
                           "--timeout", "60")
    assert code == 0 and data["backend"] == "gloo" and data["world_size"] == 2
    assert data["model"]["calibrated"] and data["model"]["alpha"] >= 0
    assert len(data["rows"]) == 2 * 2 * 2 and all(r["wrong"] == 0 and r["redop"] == "avg" for r in data["rows"])


@pytest.mark.parametrize("argv, message", [
    (["-c", "alltoall"], "unknown collectives ['alltoall']"),
    (["-a", "builtin,fastest"], "unknown algorithms ['fastest']"),
    (["-b", "64M", "-e", "4K"], "is above --max-bytes"),
    (["--op", "mean"], "unknown reduce op 'mean'"),
])
def test_bad_options_are_refused_before_anything_runs(capsys, argv, message):
    assert main(["bench", "--backend", "threads", *argv]) == 2
    assert message in capsys.readouterr().err
