"""`tpkit estimate`: JSON output equals the library's figures; tables render; bad arguments are refused."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from tpkit.cli import main
from tpkit.convert.estimate import estimate_memory
from tpkit.convert.presets import preset_config
from tpkit.convert.speed import estimate_speed

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
    assert main(["estimate", "gpt2", "--world-size", "1,2", "--dtype", "fp32"]) == 0
    text = capsys.readouterr().out
    assert "memory per rank" in text and "fits H100-SXM" in text and "speed: decode" in text
    assert main(["estimate", "bert-base", "--world-size", "1,2"]) == 0  # an encoder: one forward, no decode
    assert "speed: prefill" in capsys.readouterr().out


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
