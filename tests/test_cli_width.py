"""Tables the CLI writes to a pipe fit 100 columns unless `--wide` is given, every table-printing command takes
`--wide`, and `tpkit bench --plot` says where the plot went (issue 20 item 12)."""
from __future__ import annotations

import json
import os

import pytest

from tpkit.cli import build_parser, main

BENCH = ["bench", "--backend", "threads", "-n", "2", "-c", "all_reduce", "-b", "4K", "-e", "8K", "-a",
         "builtin,auto,recursive_doubling", "--repeats", "1", "--budget", "0", "--no-calibrate", "--no-progress"]


@pytest.fixture
def piped(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # capsys's stdout is no terminal: a pipe


@pytest.mark.parametrize("command", ["analyze", "estimate", "search", "verify", "bench", "demo"])
def test_every_table_command_takes_wide(command):
    required = {"search": ["x", "--devices", "2"], "bench": [], "demo": []}.get(command, ["x"])
    args = build_parser().parse_args([command, *required, "--wide"])
    assert args.wide is True
    assert build_parser().parse_args([command, *required]).wide is False


def test_estimate_piped_fits_100_columns_and_wide_does_not(capsys, piped):
    argv = ["estimate", "llama-2-70b", "--world-size", "1,2,4,8", "--mode", "training"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "left out to fit 100 columns:" in out
    assert main([*argv, "--wide"]) == 0
    wide = capsys.readouterr().out
    assert max(len(line) for line in wide.splitlines()) > 100 and "left out" not in wide


def test_bench_piped_fits_100_columns_and_wide_gives_the_fixed_columns(capsys, piped):
    assert main(BENCH) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert main([*BENCH, "--wide"]) == 0
    wide = capsys.readouterr().out
    header = next(line for line in wide.splitlines() if "time(us)" in line)
    assert len(header) > 100 and "vs builtin" in header and "count" in header


def test_bench_prints_where_its_plot_went(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    assert main([*BENCH, "--plot", "busbw.png"]) == 0
    path = os.path.join(str(tmp_path), "busbw.png")
    assert os.path.isfile(path)
    assert f"plot written to {path}" in capsys.readouterr().out
    assert main([*BENCH, "--plot", "again.png", "--json", "-"]) == 0  # JSON on stdout stays JSON
    captured = capsys.readouterr()
    json.loads(captured.out)
    assert f"plot written to {tmp_path / 'again.png'}" in captured.err
