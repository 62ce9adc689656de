"""`tpkit estimate`: JSON output equals the library's figures; tables render; bad arguments are refused."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from tpkit.cli import main
from tpkit.estimate import estimate_memory
from tpkit.tables import format_bytes
from tpkit.estimate.presets import preset_config
from tpkit.estimate.speed import estimate_speed

from ..convert.rendered import rows, tables

pytest.importorskip("transformers")


def test_json_output_matches_the_library(capsys):
    rc = main(["estimate", "llama-3-8b", "--world-size", "1,2,3,8", "--mode", "training", "--batch-size", "2",
               "--seq-len", "512", "--sequence-parallel", "--recompute", "selective", "--hardware", "A100-80GB",
               "--interconnect", "pcie", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    cfg = preset_config("llama-3-8b")
    assert [m["world_size"] for m in out["memory"]] == [1, 2, 3, 8]
    for m in out["memory"]:
        ref = estimate_memory(cfg, m["world_size"], dtype=torch.bfloat16, mode="training", batch_size=2, seq_len=512,
                              sequence_parallel=True, recompute="selective")
        assert m["per_rank"] == ref.per_rank.to_dict()
    speed = estimate_speed(cfg, [1, 2, 3, 8], hardware="A100-80GB", interconnect="pcie", mode="training",
                           batch_size=2, seq_len=512, sequence_parallel=True, recompute="selective")
    assert [r["speedup"] for r in out["speed"]["rows"]] == [r.speedup for r in speed.rows]
    assert out["speed"]["interconnect"].startswith("PCIe gen4")


def test_tables(capsys):
    assert main(["estimate", "gpt2", "--world-size", "1,2", "--dtype", "fp32", "--hardware", "H100-SXM"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("priced for H100-SXM") and "not this machine" in " ".join(text.split()[:40])
    assert "memory per rank" in text and "fits H100-SXM" in text and "speed: decode" in text
    # No --hardware on a measured machine: its profile prices it, op by op, said in the first line (issue 38)
    assert main(["estimate", "gpt2", "--world-size", "1,2"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("priced by the measured profile") and "H100" not in text
    assert "fits synthetic: 2 cores" in text and "framework" in text and "float32" in text
    assert main(["estimate", "bert-base", "--world-size", "1,2"]) == 0  # an encoder: one forward, no decode
    assert "speed: prefill" in capsys.readouterr().out


@pytest.mark.parametrize("columns", [None, "80"])
def test_tables_piped_and_at_80_columns(capsys, monkeypatch, columns):
    """With --wide, every column at full width; at 80 columns every line fits, world size / total / fits stay, the
    columns left out are named, and each figure is whole on its row."""
    argv = ["estimate", "llama-2-70b", "--world-size", "1,2,4,8", "--mode", "training", "--hardware", "H100-SXM"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
        argv.append("--wide")
    else:
        monkeypatch.setenv("COLUMNS", columns)
    assert main(argv) == 0
    out = capsys.readouterr().out
    (memory, mem_lines), (speed, speed_lines) = tables(out)
    if columns:
        assert max(len(line) for line in out.splitlines()) <= 80
        assert {"world size", "total", "fits H100-SXM"} <= set(memory) and len(memory) < 10
        assert {"world size", "time/step", "tokens/s", "speedup"} <= set(speed) and len(speed) < 8
        assert out.count("left out to fit 80 columns:") == 2
    else:
        assert memory == ["world size", "params", "grads", "optimizer", "activations", "kv cache", "comm buf",
                          "total", "saves", "fits H100-SXM"]
        assert speed == ["world size", "compute", "memory", "framework", "comm", "time/step", "tokens/s", "speedup",
                         "bound"]
        assert "left out" not in out
    fields = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer_states", "total": "total",
              "activations": "activations", "kv cache": "kv_cache", "comm buf": "communication_buffers"}
    for row, m in zip(rows(mem_lines, 0), data["memory"], strict=True):
        assert row[0] == [str(m["world_size"])]
        for header, cell in zip(memory, row):
            if header in fields:
                assert cell == [format_bytes(m["per_rank"][fields[header]])], header
    for row, r in zip(rows(speed_lines, 0), data["speed"]["rows"], strict=True):
        cells = dict(zip(speed, row))
        assert cells["world size"] == [str(r["world_size"])] and cells["speedup"] == [f"{r['speedup']:.2f}x"]
        assert cells["tokens/s"] == [f"{r['tokens_per_s']:,.0f}"]


def test_module_factory_with_input_shape(tmp_path, monkeypatch, capsys):
    (tmp_path / "cli_models.py").write_text(textwrap.dedent("""
        import torch
        def mlp():
            return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cli_models", raising=False)
    assert main(["estimate", "cli_models:mlp", "--world-size", "1,2", "--dtype", "fp32", "--mode", "training",
                 "--input-shape", "4,16", "--batch-size", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["world_size"] for r in out["speed"]["rows"]] == [1, 2] and out["speed"]["unit"] == "samples"
    one, two = out["memory"]
    assert one["parameters_total"] == 16 * 64 + 64 + 64 * 16 + 16
    assert two["parameters_per_rank"] == 16 * 32 + 32 + 32 * 16 + 16
    assert one["per_rank"]["activations"] == 2 * (4 * 16 * 4 + 4 * 64 * 4)  # batch 4 measured, scaled to 8


@pytest.mark.parametrize("argv", [["estimate", "gpt2", "--world-size", "0,2"],
                                  ["estimate", "gpt2", "--world-size", "two"],
                                  ["estimate", "gpt2", "--dtype", "int8"]])
def test_bad_arguments_exit(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert "error" in capsys.readouterr().err


def test_bad_target_is_one_clear_line(capsys):
    assert main(["estimate", "llama-9-9b"]) == 2
    err = capsys.readouterr().err
    assert "not a preset" in err and "Traceback" not in err
    assert main(["estimate", "torch.nn:Identity"]) == 2  # a module with no config and no --input-shape
    assert "input_shape" in capsys.readouterr().err
