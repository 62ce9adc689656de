"""Deciding on pipeline parallelism: the estimate prices a pp setup from the same setup without stages (its bubble,
(p - 1) / (v m + p - 1), and its stage sends at the calibrated 2-rank cost), the search ranks pp setups and picks
one where it wins (under a memory cap only it fits), `apply_setup` runs a pp setup on gloo ranks, and `tpkit analyze
--pp` shows the split and each stage's memory."""
from __future__ import annotations

import dataclasses
import json

import pytest

from tpkit.estimate.pipeline import bubble_fraction, pipelined, send_seconds
from tpkit.estimate.predict import Prediction, Setup, predict
from tpkit.estimate.search import search
from tests.conftest import synthetic_profile


def _config(layers: int = 4):
    import transformers as tr

    return tr.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("pp, m, v", [(2, 4, 1), (4, 8, 1), (2, 4, 2), (3, 3, 1)])
def test_a_pipeline_is_its_stage_share_plus_the_bubble_and_the_sends(pp, m, v):
    rates = synthetic_profile().rates(2)
    base = Prediction(Setup(1), "train", 1.7, 1.0, 0.5, 0.2, 0.3, 1000.0, 10, 2, 1500.0, activation_bytes=400.0)
    setup = Setup(1, pp=pp, microbatches=m, stages_per_rank=v, schedule="1f1b")
    got = pipelined(base, setup, rates, activation_bytes=2 ** 20)
    stage = (1.0 + 0.5 + 0.2) / pp
    send = rates.collective("all_gather", 2).seconds(2 ** 20 / m)
    assert got.bubble_s == pytest.approx(stage * (pp - 1) / (v * m))
    assert got.bubble_s / (stage + got.bubble_s) == pytest.approx(bubble_fraction(pp, m, v))
    assert got.pp_communication_s == pytest.approx(2 * (v * m + pp - 1) * send) and send == send_seconds(
        rates, 2 ** 20 / m)
    assert got.seconds == pytest.approx(stage + got.bubble_s + got.pp_communication_s + 0.3 / pp)
    assert got.memory_bytes == pytest.approx(600 / pp + 400 / pp * min(pp, m) / m)  # 1F1B: p micro-batches in flight
    gpipe = pipelined(base, dataclasses.replace(setup, schedule="gpipe"), rates, activation_bytes=2 ** 20)
    assert gpipe.memory_bytes == pytest.approx(1000 / pp)  # GPipe keeps every micro-batch's activations


def test_predict_prices_pp_from_the_setup_without_it():
    profile = synthetic_profile()
    flat = predict(_config(), Setup(1), "train", 8, 64, profile, ranks=2)
    staged = predict(_config(), Setup(1, pp=2, microbatches=4), "train", 8, 64, profile)
    assert staged.bubble_s > 0 and staged.pp_communication_s > 0 and staged.memory_bytes < flat.memory_bytes
    # each slot is one micro-batch (8 / 4 = 2 sequences) through a stage: every op runs m times, paying its fixed
    # cost each time, and its matmuls run at 2 sequences' rows, slower per row than the whole batch's
    micro = predict(_config(), Setup(1), "train", 2, 64, profile, ranks=2)
    assert staged.kernels_s == pytest.approx(micro.kernels_s * 4 / 2) and staged.kernels_s > flat.kernels_s / 2
    assert staged.overhead_s == pytest.approx(micro.overhead_s * 4 / 2) and staged.overhead_s > flat.overhead_s / 2
    more = predict(_config(), Setup(1, pp=2, microbatches=8), "train", 8, 64, profile)
    assert more.bubble_s < staged.bubble_s  # more micro-batches: a smaller bubble
    with pytest.raises(ValueError, match="pipeline parallelism .* is priced for training steps"):
        predict(_config(), Setup(1, pp=2), "decode", 1, 64, profile)
    assert Setup(2, 2, "fsdp", pp=2, microbatches=4).devices == 8
    assert Setup(2, pp=2, microbatches=4).label().startswith("pp2 1f1b m4, tp2")


def test_the_search_ranks_pp_setups_and_picks_one_where_only_it_fits():
    result = search(_config(), 2, "train", batch_size=8, seq_len=64, profile=synthetic_profile(), alternatives=False)
    staged = [c for c in result.candidates if c.pp > 1]
    assert staged and staged[0].microbatches == 8 and all(c.devices == 2 for c in result.candidates)
    others = min(c.prediction.memory_bytes for c in result.candidates if c.pp == 1)
    cap = staged[0].prediction.memory_bytes
    assert cap < others
    capped = search(_config(), 2, "train", memory_per_device=cap * 1.0001, batch_size=8, seq_len=64,
                    profile=synthetic_profile(), alternatives=False)
    assert capped.best.pp == 2 and capped.best.fits and not any(c.fits for c in capped.candidates if c.pp == 1)
    assert not [c for c in search(_config(1), 2, "train", batch_size=8, seq_len=64, profile=synthetic_profile(),
                                  alternatives=False).candidates if c.pp > 1]  # one layer: nothing to cut


@pytest.mark.slow
def test_apply_setup_runs_a_pp_setup(launched):
    """The search's pp setup applied on 2 of the shared launch's gloo ranks: a `tpkit.Pipeline` whose first step's
    loss is one process's."""
    from tests.pipeline.cases import reference

    want = reference("llama")["losses"][0]
    for rank, r in enumerate(launched["per_rank"][:2]):
        assert r["apply_setup"]["type"] == "Pipeline" and r["apply_setup"]["stages"] == (rank,)
        assert r["apply_setup"]["loss"] == pytest.approx(want, rel=1e-6)


def test_analyze_shows_the_split_and_each_stages_memory(tmp_path, capsys):
    """The text `analyze --pp` prints for training, from `pipeline_stages`; then the command itself, once (JSON, in
    inference: the world-size suggestion, a search per size, is not what is tested here)."""
    from tpkit.cli import main
    from tpkit.commands.analyze import pipeline_stages
    from tpkit.estimate.presets import load_target

    path = tmp_path / "config.json"
    path.write_text(_config(6).to_json_string())
    model, _ = load_target(str(path), device="meta")
    split, text = pipeline_stages(model, 3, 2, "training")
    assert "pipeline: 3 stages at tp 2 (weights, gradients and AdamW states per rank)" in text
    assert "stage 0: model.layers.0.." in text and "+ model.norm, lm_head" in text and text.count("GiB per rank") == 3
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(split["bytes_per_rank"]) == pytest.approx(weights * 4 / 2)  # float32: + gradients + 2 AdamW states
    common = (str(path), "--max-world-size", "1", "--device-memory", "1GB")
    assert main(["analyze", *common, "--pp", "7"]) == 2  # refused before the analysis runs
    assert "at most 6 stages" in capsys.readouterr().err
    assert main(["analyze", *common, "--pp", "3", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["pipeline"]
    assert len(stages["starts"]) == 3 and len(stages["bytes_per_rank"]) == 3 and stages["tp"] == 1
    assert sum(stages["bytes_per_rank"]) == pytest.approx(weights)  # inference: the weights alone
