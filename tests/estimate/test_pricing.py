"""One model of the machine for every command (issue 38): which machine is priced and says so, suggestions within
the devices present, `--calibrate` printing what it wrote, the estimate reading the written terms, and
`search --measure K` running K setups with progress. Nothing here times anything: the profiles are made up."""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

pytest.importorskip("transformers")

import transformers as tr  # noqa: E402

import tpkit  # noqa: E402
from tpkit.cli import main  # noqa: E402
from tpkit.estimate import calibrate, framework, pricing  # noqa: E402
from tpkit.estimate.framework import FrameworkCost  # noqa: E402
from tpkit.estimate.predict import Setup, kernel_seconds, predict, trace_setup  # noqa: E402
from tpkit.estimate.profile import load_profile  # noqa: E402
from tpkit.estimate.search import search as rank_setups  # noqa: E402
from tpkit.estimate.terms import profile_terms  # noqa: E402

from ..conftest import synthetic_profile  # noqa: E402


def llama(layers: int = 3) -> tr.LlamaConfig:
    return tr.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)


def test_a_named_datasheet_says_it_is_another_machine():
    p = pricing.machine_pricing(hardware="H100-SXM")
    assert not p.this_machine and not p.measured and p.hardware.name == "H100-SXM"
    assert p.origin.startswith("priced for H100-SXM") and "not this machine" in p.origin


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU host's rule")
def test_a_cpu_host_is_measured_never_priced_as_a_gpu(tmp_path, monkeypatch):
    path = tmp_path / "profile.json"
    monkeypatch.setenv("TPKIT_PROFILE", str(path))
    with pytest.raises(ValueError, match="tpkit estimate --calibrate"):
        pricing.machine_pricing(calibrate=False)
    calls = []
    monkeypatch.setattr(calibrate, "calibrate_profile", lambda *a, **k: calls.append(k) or synthetic_profile())
    p = pricing.machine_pricing()
    assert calls == [{"quick": True, "dp_wrappers": None}] and p.measured and p.this_machine and path.exists()
    assert "measured now" in p.origin and str(path) in p.origin
    assert pricing.machine_pricing().origin.startswith("priced by the measured profile")  # the next one reads it
    assert len(calls) == 1


def test_calibrate_prints_what_it_writes(tmp_path, monkeypatch, capsys):
    path = tmp_path / "p.json"
    monkeypatch.setattr(calibrate, "calibrate_profile", lambda *a, **k: synthetic_profile())
    assert main(["estimate", "--calibrate", "--quick", "--profile", str(path)]) == 0
    out = capsys.readouterr().out
    written = load_profile(str(path))
    lines = profile_terms(written)
    assert all(line in out for line in lines)
    # each measured term has its line: shared and alone bandwidth, matmul by rows, framework terms, collectives
    text = "\n".join(lines)
    for term in ("(alone)", "while all 2 stream at once", "matmul at width 1024", "AdamW per parameter tensor",
                 "framework, whole model: gpt2/decode", "framework, converted over 2 ranks: qwen2/train",
                 "framework, data parallel over 2 ranks: llama/train/fsdp", "once torch, tpkit and transformers",
                 "all_reduce over 2 ranks", "per further batch row", "per further logit",
                 "work between collectives when the ranks meet"):
        assert term in text, term


def _with_terms(profile, **changes):
    machine = {k: dataclasses.replace(r, **changes) for k, r in profile.machine.items()}
    return dataclasses.replace(profile, machine=machine)


def test_the_estimate_composes_the_written_terms_per_module():
    cfg, prof = llama(3), synthetic_profile()
    base = predict(cfg, Setup(1), "decode", 1, 32, prof, dtype=torch.float32)
    slower = _with_terms(prof, framework={"llama/decode": FrameworkCost(1e-3, 1.5e-3)})
    # one more millisecond per decoder layer: three more milliseconds for three layers, and nothing else moves
    again = predict(cfg, Setup(1), "decode", 1, 32, slower, dtype=torch.float32)
    assert again.overhead_s - base.overhead_s == pytest.approx(3e-3)
    assert again.kernels_s == base.kernels_s
    # decoding a batch adds what each further row and each further logit (row x vocabulary entry) costs
    rows = _with_terms(prof, framework={"llama/decode": FrameworkCost(1e-3, 1.5e-3, 2e-4, 1e-8)})
    b1 = predict(cfg, Setup(1), "decode", 1, 32, rows, dtype=torch.float32)
    b4 = predict(cfg, Setup(1), "decode", 4, 32, rows, dtype=torch.float32)
    assert b1.overhead_s - again.overhead_s == pytest.approx((cfg.vocab_size - 256) * 1e-8)
    assert b4.overhead_s - b1.overhead_s == pytest.approx(3 * 2e-4 + 3 * cfg.vocab_size * 1e-8)
    trained = [predict(cfg, Setup(1), "train", 4, 32, _with_terms(prof, framework={"llama/train": c}),
                       dtype=torch.float32).overhead_s
               for c in (FrameworkCost(1e-3, 0.0), FrameworkCost(1e-3, 0.0, 2e-4, 1e-8))]
    assert trained[0] == trained[1]  # a training step's terms are measured at its own batch: no row terms
    # training adds the optimizer's cost per parameter tensor, by the model's own tensor count
    t0 = predict(cfg, Setup(1), "train", 1, 32, prof, dtype=torch.float32)
    t1 = predict(cfg, Setup(1), "train", 1, 32, _with_terms(prof, optimizer_tensor_s=20e-6), dtype=torch.float32)
    tensors = sum(1 for _ in tr.LlamaForCausalLM(cfg).parameters())
    assert t1.overhead_s - t0.overhead_s == pytest.approx(tensors * 10e-6)
    # DDP uses the terms measured under DDP where there are some, else the whole model's
    ddp = Setup(1, 2, "ddp")
    plain = predict(cfg, ddp, "train", 2, 32, prof, dtype=torch.float32)
    under = predict(cfg, ddp, "train", 2, 32, _with_terms(prof, dp_framework={"llama/train/ddp": FrameworkCost(
        4e-3, 0.5e-3)}), dtype=torch.float32)
    assert under.overhead_s - plain.overhead_s == pytest.approx(3e-3)
    # TP uses the terms measured converted over the ranks; a family never measured falls back to the per-op cost
    tp = predict(cfg, Setup(2), "decode", 1, 32, _with_terms(prof, tp_framework={"llama/decode": FrameworkCost(
        5e-3, 0.0)}), dtype=torch.float32)
    assert tp.overhead_s == pytest.approx(5e-3)
    none = predict(cfg, Setup(1), "decode", 1, 32, _with_terms(prof, framework={}), dtype=torch.float32)
    assert none.overhead_s == pytest.approx(none.ops * prof.machine["1"].op_overhead_s)


def test_converted_kernels_take_the_measured_skew_longer_and_whole_ones_do_not():
    cfg, prof = llama(3), synthetic_profile()
    skewed = _with_terms(prof, skew=0.05, train_skew=0.02)
    for tp, goal in itertools.product((1, 2), ("decode", "train")):
        base, again = (predict(cfg, Setup(tp), goal, 2, 32, p, dtype=torch.float32) for p in (prof, skewed))
        factor = 1.0 if tp == 1 else 1.05 if goal == "decode" else 1.02
        assert again.kernels_s == pytest.approx(base.kernels_s * factor)
        assert again.overhead_s == base.overhead_s and again.tp_communication_s == base.tp_communication_s


def test_ranks_sharing_the_host_get_the_shared_bandwidth():
    cfg, prof = llama(3), synthetic_profile()
    assert prof.machine["2"].stream_bandwidth < prof.machine["1"].stream_bandwidth
    traced = trace_setup(cfg, Setup(2), "decode", 1, 32, dtype=torch.float32)
    p = predict(cfg, Setup(2), "decode", 1, 32, prof, traced=traced)
    ks = [kernel_seconds(t, prof.machine["2"]) for _, t in traced.rows]
    assert p.kernels_s == pytest.approx(ks[0] + (3 - 1) * (ks[1] - ks[0]))
    alone = [kernel_seconds(t, prof.machine["1"]) for _, t in traced.rows]
    assert alone[0] < ks[0]  # one rank alone streams faster than each of two at once


def test_suggestions_stay_within_the_devices_present(monkeypatch):
    monkeypatch.setattr(pricing, "local_devices", lambda: (2, "cores"))
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(llama(2))
    report = tpkit.analyze(model, max_world_size=8, mode="training")
    assert report.suggested_world_size <= 2
    assert "of the 2 cores here" in report.suggestion and "for another machine" in report.suggestion


def test_measure_runs_only_the_top_k_and_says_so(monkeypatch):
    ran = []
    result = rank_setups(llama(2), 2, "train", batch_size=2, seq_len=16, profile=synthetic_profile(), measure=2,
                         runner=lambda m, s, g, b, q: ran.append(s) or 0.01 * len(ran), dtype=torch.float32)
    assert len(ran) == 2 and [c.measured_s for c in result.candidates[:2]] == [0.01, 0.02]
    told = []
    monkeypatch.setattr(tpkit.setups, "run_setup", lambda *a, **k: 0.005)
    tpkit.search(llama(2), 2, "decode", batch_size=1, seq_len=16, measure=2, progress=told.append)
    assert len(told) == 12 and told[0].startswith("measuring 1/6:") and told[-1].startswith("measured 6/6:")


def test_estimate_and_search_give_one_figure(capsys):
    """The same setup priced by `tpkit estimate` and by `tpkit search` is one number."""
    cfg = llama(3)
    est = tpkit.estimate_speed(cfg, [1, 2], mode="training", batch_size=2, seq_len=32, dtype=torch.float32)
    res = rank_setups(cfg, 2, "train", batch_size=2, seq_len=32, profile=load_profile(), dtype=torch.float32,
                      alternatives=False)
    tp2 = next(c for c in res.candidates if c.setup == Setup(2))
    assert est.row(2).total_s == pytest.approx(tp2.prediction.seconds)
    assert json.dumps(est.to_dict())  # serialisable, parts named
    assert est.parts == ("compute", "memory", "framework", "comm")
    row = est.row(2)  # the parts are the prediction's: kernels (by arithmetic, by bytes), framework, communication
    assert row.compute_s + row.memory_s == pytest.approx(tp2.prediction.kernels_s)
    assert row.framework_s == tp2.prediction.overhead_s and row.communication_s == tp2.prediction.tp_communication_s


def test_the_framework_terms_are_solved_from_their_runs_exactly():
    """What each calibration run leaves beyond its kernels is the terms' own sum: solving the runs gives the terms
    back, and a run that left less than nothing gives 0, never a negative cost."""
    truth = FrameworkCost(6e-4, 2e-4, 1.5e-5, 5e-9)
    left = [truth.seconds(layers, rows, rows * vocab) for layers, rows, vocab in framework._runs("decode", None)]
    solved = framework._terms(left)
    for field in dataclasses.fields(FrameworkCost):
        assert getattr(solved, field.name) == pytest.approx(getattr(truth, field.name)), field.name
    training = [truth.seconds(layers) for layers, _, _ in framework._runs("train", None)]
    assert dataclasses.astuple(framework._terms(training)) == pytest.approx((6e-4, 2e-4, 0.0, 0.0))
    noisy = framework._terms([left[0], left[1], left[0] - 1e-4, left[0] - 2e-4])
    assert noisy.row_s == 0.0 and noisy.logit_s == 0.0
