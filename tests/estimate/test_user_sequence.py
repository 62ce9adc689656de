"""The new user's sequence of issue 38 on one model, for real: `tpkit estimate` with no profile (this machine is
measured first, said so, never priced as a GPU), `--calibrate --quick`, `estimate` again, `analyze`, `search`;
every figure must agree with the others and with the written profile."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from tpkit.cli import main  # noqa: E402
from tpkit.estimate.hardware import local_devices  # noqa: E402
from tpkit.estimate.predict import Setup, predict  # noqa: E402
from tpkit.estimate.presets import load_target  # noqa: E402
from tpkit.estimate.profile import load_profile  # noqa: E402
from tpkit.estimate.terms import profile_terms  # noqa: E402

from .conftest import CALIBRATION_TIMEOUT  # noqa: E402

CONFIG = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1024,
          "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 128,
          "tie_word_embeddings": False}


def _peak_rss_of_training(batch: int, seq: int) -> int:
    """In a fresh rank process: the config's model trained 3 steps (AdamW, float32); its peak resident bytes."""
    import transformers as tr

    from tpkit.estimate.process_memory import rss_bytes

    kwargs = dict(CONFIG)
    config = tr.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(0)
    model = tr.AutoModelForCausalLM.from_config(config).float().train()
    ids = torch.randint(3, config.vocab_size, (batch, seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return rss_bytes("VmHWM")


@pytest.mark.timeout(CALIBRATION_TIMEOUT)
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU host's sequence")
def test_estimate_calibrate_estimate_analyze_search_agree(quick_calibration, tmp_path, monkeypatch, capsys):
    profile = tmp_path / "profile.json"
    monkeypatch.setenv("TPKIT_PROFILE", str(profile))
    target = tmp_path / "config.json"
    target.write_text(json.dumps(CONFIG))
    train = ["--mode", "training", "--batch-size", "2", "--seq-len", "32"]

    # 1. before any calibration: this machine is measured now (a quick calibration over gloo, written to
    # $TPKIT_PROFILE), and the first line says so. The measurement is the one `estimate --calibrate --quick` makes,
    # which step 2 checks (`quick_calibration`, once per session): here it is taken from there, not made twice.
    from tpkit.estimate import calibrate

    calls = []
    calibrated, out = quick_calibration

    def measured(*args, **kwargs):
        calls.append((args, kwargs))
        return load_profile(calibrated)

    with monkeypatch.context() as mp:
        mp.setattr(calibrate, "calibrate_profile", measured)
        assert main(["estimate", str(target), *train]) == 0
    first = " ".join(capsys.readouterr().out.split())
    assert first.startswith("priced by this machine measured now") and "H100" not in first and profile.exists()
    assert len(calls) == 1 and calls[0][0][:2] == ("gloo", (2,)) and calls[0][1].get("quick") is True
    assert load_profile(str(profile)).to_dict() == load_profile(calibrated).to_dict()  # written where it said

    # 2. --calibrate prints every term it wrote. `estimate --calibrate --quick` (gloo, the default backend) writing to
    # $TPKIT_PROFILE is run once per session (`quick_calibration`, test_estimate_calibrate reads it too): its profile
    # now stands at this test's $TPKIT_PROFILE, over step 1's, as the command would have written it there
    shutil.copyfile(calibrated, profile)
    written = load_profile(str(profile))
    assert all(line in out for line in profile_terms(written))

    # 3. the estimate now reads that profile: its figures are predict's with the written rates
    assert main(["estimate", str(target), *train, "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["pricing"].startswith("priced by the measured profile")
    _, config = load_target(str(target), build=False)
    devices = local_devices()[0]
    rows = {r["world_size"]: r for r in est["speed"]["rows"]}
    assert max(rows) <= max(devices, 1)
    for t, row in rows.items():
        p = predict(config, Setup(t), "train", 2, 32, written, dtype=torch.float32)
        assert row["total_s"] == pytest.approx(p.seconds, rel=1e-9)

    # memory: a process's predicted peak (the traced step's tensors + imports + runtime, stated apart) against the
    # peak resident size of a real training step in a fresh process
    from tpkit.launch import launch

    measured = launch(_peak_rss_of_training, 1, args=(2, 32))[0]
    assert rows[1]["process_bytes"] == pytest.approx(measured, rel=0.35), (rows[1]["process_bytes"], measured)
    assert rows[1]["process_bytes"] > rows[1]["memory_bytes"] > 0

    # 4. analyze suggests no more ranks than the machine has, priced the same way
    assert main(["analyze", str(target), "--mode", "training", "--max-world-size", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["suggested_world_size"] <= devices
    assert "priced by the measured profile" in report["suggestion"]

    # 5. the search's TP setups are priced as the estimate priced them
    assert main(["search", str(target), "--devices", "2", "--goal", "train", "--batch-size", "2", "--seq-len", "32",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    plain = {c["setup"]["tp"]: c["seconds"] for c in result["candidates"] if c["setup"]["dp"] == 1
             and not c["setup"]["sequence_parallel"] and c["setup"]["recompute"] == "none" and not c["setup"]["choices"]}
    if 2 in rows:
        assert plain[2] == pytest.approx(rows[2]["total_s"], rel=1e-9)
    assert result["notes"][0].startswith("priced by the measured profile")
    assert re.search(r"suggested world size: \d+ of the \d+ cores here", report["suggestion"])
