"""`tpkit analyze` and `tpkit verify` from the command line (in-process through `tpkit.cli.main`)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from tpkit.cli import main  # noqa: E402
from tpkit.convert import Plan  # noqa: E402


def test_analyze_preset_json(capsys, tmp_path):
    plan_file = tmp_path / "plan.json"
    assert main(["analyze", "gpt2", "--world-size", "4", "--device-memory", "80GB", "--json",
                 "--plan-out", str(plan_file)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total_params"] == 124_439_808  # GPT-2 small, built on meta from the preset
    assert data["suggested_world_size"] == 1 and data["world_size"] == 4
    styles = {r["name"]: r["style"] for r in data["layers"]}
    assert styles["transformer.h.0.attn.c_attn"] == "colwise" and styles["transformer.h.11.mlp.c_proj"] == "rowwise"
    assert Plan.load(plan_file).entries == data["plan"]["entries"]


def test_analyze_table_and_bad_target(capsys):
    assert main(["analyze", "llama-2-7b", "--device-memory", "24GB", "--max-world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.*.mlp.down_proj (x32)" in out and "suggested world size: 2" in out
    assert main(["analyze", "no-such-model"]) == 2
    assert "not a preset" in capsys.readouterr().err


def test_verify_module_factory_and_plan_file(capsys, tmp_path):
    assert main(["verify", "tests.convert.models:block", "--world-size", "3", "--backward"]) == 0
    assert "PASS at world size 3" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"entries": {"wq": "colwise"}}))
    assert main(["verify", "tests.convert.models:block", "--world-size", "2", "--plan", str(bad)]) == 2
    assert "conflicting entries" in capsys.readouterr().err


def test_demo_on_threads(capsys):
    """The `make demo` body (on thread-ranks here; `make demo` runs it on 2 gloo processes)."""
    assert main(["demo", "--backend", "threads", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "rowwise" in out and "vocab_parallel_cross_entropy" in out and "rank 1" in out


def test_analyze_help_says_device_memory_units_are_binary(capsys):
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    assert "GB and GiB both mean 2**30 bytes" in " ".join(capsys.readouterr().out.split())


def test_demo_without_transformers_says_which_extra(capsys, monkeypatch):
    """tpkit installed without the `hf` extra: a clear hint and exit code 2, not a traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    assert main(["demo", "--backend", "threads", "--steps", "1"]) == 2
    assert "pip install 'tpkit[hf]'" in capsys.readouterr().err
