"""`tpkit estimate --calibrate` (measured profile on this machine, gloo on loopback over 2 ranks started by
tpkit.launch) and `--plot`."""
from __future__ import annotations

import json
import platform
import shutil

import pytest
import torch

from tpkit.cli import main
from tpkit.estimate.calibrate import _split_latency, measure_copy_bandwidth, measure_matmul_flops
from tpkit.estimate.profile import load_profile

from .conftest import CALIBRATION_TIMEOUT

pytest.importorskip("transformers")


def test_measurements_are_positive_and_plausible():
    flops = measure_matmul_flops(n=128, repeats=2)
    bw = measure_copy_bandwidth(4 * 2**20, repeats=2)
    assert 1e7 < flops < 1e14 and 1e8 < bw < 1e13


def test_a_compute_bound_row_is_timed_on_fewer_matrices(monkeypatch):
    """`measure_gemm(bandwidth=)`: a row whose product takes 8x its matrix's read at that rate rotates through the
    whole pool no more; the rows after it are timed on ROUND_SECONDS' worth. Unknown (0) or a rate at which no row
    is compute-bound: every row of fewer than 256 reads the whole pool (its matrices from memory)."""
    from tpkit.estimate import calibrate

    rows, n = (1, 4, 16), 64
    pool = calibrate.COLD_BYTES // (n * n * 4)
    real = torch.mm

    def products(bandwidth):
        calls = []
        monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(a.shape[0]) or real(a, b))
        table = calibrate.measure_gemm(rows, n, 1, True, torch.float32, bandwidth)
        monkeypatch.setattr(torch, "mm", real)
        assert [m for m, _ in table] == list(rows) and all(f > 0 for _, f in table)
        return [calls.count(m) // 2 for m in rows]  # one untimed call of the timing, one timed
    assert products(0.0) == products(1.0) == [pool] * 3  # 1 byte/s: nothing is compute-bound
    first, *later = products(1e30)  # every row compute-bound
    assert first == pool and all(1 <= c < pool for c in later), (first, later)


def test_latency_split():
    assert _split_latency({2: 40e-6}) == (0.0, 20e-6)
    fixed, hop = _split_latency({2: 12e-6, 4: 16e-6, 8: 24e-6})  # 10 us + 1 us per hop, 2(t-1) hops
    assert fixed == pytest.approx(10e-6) and hop == pytest.approx(1e-6)


@pytest.mark.timeout(CALIBRATION_TIMEOUT)
@pytest.mark.slow
def test_calibrate_writes_a_profile_that_later_estimates_use(quick_calibration, tmp_path, monkeypatch, capsys):
    """`--calibrate --quick --backend gloo` writes to $TPKIT_PROFILE (run once per session: `quick_calibration`,
    which test_user_sequence's step 2 reads too)."""
    written, out = quick_calibration
    assert f"profile written to {written}" in out and "all_reduce over 2 ranks" in out
    path = tmp_path / "profile.json"
    shutil.copyfile(written, path)
    monkeypatch.setenv("TPKIT_PROFILE", str(path))
    profile = load_profile(str(path))
    hw = profile.hardware
    assert hw is not None and hw.interconnect.kind == "gloo" and profile.links["gloo"].hop_latency_s > 0
    assert hw.peak_flops_fp32 > 0 and hw.memory_bandwidth > 0 and hw.interconnect.bandwidth > 0
    two = profile.machine["2"]  # the in-step cost of a collective, measured on the converted reference model
    assert 0 <= two.collective_overhead_s < 0.1 and 0 <= two.train_collective_overhead_s < 0.1
    assert profile.machine["1"].collective_overhead_s == 0
    for rates in profile.machine.values():  # a quantized layer's call as the load builds it (quick: int4, int8)
        assert {"int4/bfloat16", "int8/bfloat16", "dense/bfloat16"} <= set(rates.quantized)
        assert set(rates.dtype_gemm) == {"bfloat16"}  # BLAS per dtype, as nn.Linear reads the weight (quick: bf16)
        assert all(1e7 < f < 1e14 for tables in rates.dtype_gemm.values() for _, t in tables for _, f in t)
        assert all(q.fixed_s >= 0 and 1e7 < q.bandwidth(1) < 1e13 for q in rates.quantized.values())
    from tpkit.quant import native

    for rates in profile.machine.values():  # what the products were timed with; the bandwidth at the end as well
        assert rates.product_build == native.build_id() and 1e8 < rates.stream_bandwidth_end < 1e13
    assert "quantized layer int4/bfloat16" in out and "dense bfloat16 layer's decode product" in out
    assert "GB/s at the start" in out and "at the end" in out
    assert "weight read as nn.Linear reads it, in bfloat16, by rows" in out
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":  # glibc unmaps a freed 64 MiB block
        assert all(r.fresh_bandwidth > 0 for r in profile.machine.values()) and "new pages for a tensor" in out
    # A later estimate (default location via $TPKIT_PROFILE) runs on the measured machine.
    assert main(["estimate", "gpt2", "--world-size", "1,2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"] == hw.name and data["profile"] == profile.name
    assert data["pricing"].startswith("priced by the measured profile")  # op by op, as the search prices it
    assert data["speed"]["parts"] == ["compute", "memory", "framework", "comm"]


def test_plot_writes_a_png(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("TPKIT_PROFILE", str(tmp_path / "none.json"))
    png = tmp_path / "est.png"
    assert main(["estimate", "llama-2-7b", "--world-size", "1,2,4,8", "--hardware", "A100-80GB", "--plot",
                 str(png)]) == 0
    assert f"plot written to {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert [p.name for p in tmp_path.iterdir()] == ["est.png"]  # no temporary left behind


def test_target_or_calibrate_is_required(capsys):
    assert main(["estimate"]) == 2
    assert "give a TARGET" in capsys.readouterr().err


def test_bad_profile_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text("[]")
    assert main(["estimate", "gpt2", "--profile", str(bad)]) == 2
    assert "not a tpkit speed profile" in capsys.readouterr().err
