"""Context parallelism in the estimates: a rank's share of the tokens and the method it takes, activations shrink
with cp as they must, the longest sequence that fits grows with it, the all-to-all and ring traffic formulas, the
all-to-all priced from the all-gather, the attention split in the step time, the search picking cp where only it
fits, nothing moving at cp 1, and the `estimate` and `analyze` commands. Shapes, fake steps and thread-ranks only:
no process is launched."""
from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

pytest.importorskip("transformers")

import transformers as tr  # noqa: E402

import tpkit  # noqa: E402
from tpkit.estimate import estimate_memory, transformer_activation_bytes, transformer_shape  # noqa: E402
from tpkit.estimate.context import (attention_method, context_refusal, context_seconds,  # noqa: E402
                                    exchanged_kv_heads, layer_traffic, local_tokens, working_bytes)
from tpkit.estimate.machine import CollectiveCost, MachineRates  # noqa: E402
from tpkit.estimate.predict import ATTENTION_CORE, Setup, kernel_seconds, predict, trace_setup  # noqa: E402
from tpkit.estimate.search import candidates, search  # noqa: E402
from tpkit.estimate.sequences import activation_bytes, longest_sequence, sequence_memory  # noqa: E402
from tpkit.setups import sequence_table  # noqa: E402

from .test_search import PROFILE, llama  # noqa: E402


def shape(**over):
    kw = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, max_position_embeddings=32768)
    return transformer_shape(tr.LlamaConfig(**{**kw, **over}))


def total(parts: dict) -> float:
    return sum(parts.values())


def test_a_rank_s_share_of_the_tokens_and_its_method():
    """The zigzag split pads to a multiple of 2cp; cp 1 is no split at all. All-to-all where the rank's heads
    divide by cp (K/V heads dividing cp or divided by it), the ring otherwise or when asked."""
    assert local_tokens(1000, 4) == 2 * math.ceil(1000 / 8) == 250 and local_tokens(1001, 4) == 252
    assert local_tokens(1001, 1) == 1001
    s = shape()  # 16 heads, 4 K/V heads
    assert attention_method(s, 2, 8) == "all_to_all" and attention_method(s, 4, 8) == "ring"  # 8, 4 local heads
    assert attention_method(s, 1, 3) == "ring" and attention_method(s, 1, 2, "ring") == "ring"
    with pytest.raises(ValueError, match="do not divide by cp 3"):
        attention_method(s, 1, 3, "all_to_all")


@pytest.mark.parametrize("method,attention", [("all_to_all", "flash"), ("ring", "flash"), ("all_to_all", "eager")])
def test_activations_per_rank_shrink_with_cp(method, attention):
    """A long sequence: cp2 keeps at most 0.6x of cp1's activation bytes per rank, cp4 at most 0.35x (the rank's
    share of the tokens, plus what the method keeps and one layer's working set)."""
    s, seq = shape(), 32768
    one, two, four = (total(transformer_activation_bytes(s, 1, seq, 2, 1, attention=attention, cp=cp, cp_method=method))
                      for cp in (1, 2, 4))
    assert two <= 0.6 * one and four <= 0.35 * one
    assert two >= 0.5 * one and four >= 0.25 * one  # the split cannot save more than its share


def test_the_traced_estimate_shrinks_the_same_way_and_says_so():
    cfg = llama(4, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                max_position_embeddings=8192)
    est = {cp: estimate_memory(cfg, 1, mode="training", seq_len=8192, cp=cp) for cp in (1, 2, 4)}
    acts = {cp: e.per_rank.activations for cp, e in est.items()}
    assert acts[2] <= 0.6 * acts[1] and acts[4] <= 0.35 * acts[1]
    assert est[2].activation_method == "traced" and est[2].cp == 2 and est[2].cp_method == "all_to_all"
    assert any("each rank holds 4096 of the 8192 tokens" in n for n in est[2].notes)
    assert est[2].per_rank.parameters == est[1].per_rank.parameters  # weights replicated over cp
    assert est[4].to_dict()["cp"] == 4 and "cp 4 all_to_all" in est[4].summary()
    with pytest.raises(ValueError, match="splits training sequences"):
        estimate_memory(cfg, 1, mode="inference", cp=2)
    with pytest.raises(ValueError, match="cp_method must be one of"):
        estimate_memory(cfg, 1, mode="training", cp=2, cp_method="ulysses")


@pytest.mark.parametrize("method", ["all_to_all", "ring"])
def test_the_estimate_is_what_a_context_parallel_forward_saves(method):
    """What each rank of a real context-parallel forward (thread-ranks) saves for the backward, counted as the tests
    count it (`fake_step.saved_bytes`), is the traced estimate less the attention's working set (held while a layer
    runs, not saved): within 1% (measured: -0.1% all-to-all, +0.0% ring; the rest is the split's int64 indices)."""
    from tpkit.estimate.fake_step import saved_bytes

    cfg = llama(2, hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=4,
                vocab_size=1024, max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 1024, (1, 1000), generator=torch.Generator().manual_seed(0))
    copies = [copy.deepcopy(model) for _ in range(2)]

    def body(comm):
        tpkit.context_parallel(copies[comm.rank], comm, method=method)
        return saved_bytes(copies[comm.rank], (), {"input_ids": ids, "labels": ids})
    measured = max(tpkit.run_threads(body, 2))
    est = estimate_memory(cfg, 1, dtype=torch.float32, mode="training", seq_len=1000, cp=2, cp_method=method)
    held = est.per_rank.activations - working_bytes(transformer_shape(cfg), 1, 1000, 4, 1, 2, method)
    assert held == pytest.approx(measured, rel=0.01)


def test_cp1_figures_are_unchanged():
    s = shape()
    for attention in ("flash", "eager"):
        assert transformer_activation_bytes(s, 2, 4096, 2, 2, True, "none", attention) == \
            transformer_activation_bytes(s, 2, 4096, 2, 2, True, "none", attention, cp=1, cp_method="ring")
    cfg = llama(4)
    plain, explicit = (predict(cfg, setup, "train", 2, 64, PROFILE, dtype=torch.float32)
                       for setup in (Setup(2), Setup(2, cp=1, cp_method="ring")))
    assert dataclasses.replace(explicit, setup=plain.setup) == plain and plain.cp_communication_s == 0.0
    assert Setup(2).label() == "tp2" and Setup(2).devices == 2


def test_the_longest_sequence_that_fits_grows_with_cp():
    s, budget = shape(), 24 * 2 ** 30
    longest = {cp: longest_sequence(s, budget, 2, cp=cp) for cp in (1, 2, 4)}
    assert 1.8 <= longest[2] / longest[1] <= 2.1 and 3.5 <= longest[4] / longest[1] <= 4.2
    for cp, n in longest.items():  # the longest: it fits, one more token does not
        assert activation_bytes(s, n, 2, cp=cp) <= budget < activation_bytes(s, n + 2 * cp, 2, cp=cp)
    table = sequence_memory(s, 2, 1, (1, 2, 4), budget=budget + 2 ** 30, held=2 ** 30, max_positions=32768)
    assert [r.longest for r in table.rows] == [longest[1], longest[2], longest[4]]
    assert [r.method for r in table.rows] == [None, "all_to_all", "all_to_all"]
    assert "longest fitting" in table.summary() and table.to_dict()["rows"][1]["cp"] == 2
    assert longest_sequence(s, 0, 2) == 0


def test_analyze_shows_activations_by_sequence_length_and_cp():
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(llama(2)).float()
    report = tpkit.analyze(model, max_world_size=2, mode="training", device_memory="1GB", profile=PROFILE)
    seq = report.sequences
    assert [r.cp for r in seq.rows] == [1, 2, 4, 8] and seq.tp == report.world_size
    assert seq.held == report.per_rank_memory[report.world_size] and seq.budget == 2 ** 30
    assert seq.rows[1].longest > 1.6 * seq.rows[0].longest  # (a 64-wide toy: the split's own copies weigh more)
    assert "training activations per rank by sequence length" in report.summary()
    assert report.to_dict()["sequences"]["rows"][0]["cp"] == 1
    assert sequence_table(model, dataclasses.replace(report, mode="inference")) is None
    bert = tr.BertForMaskedLM(tr.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=128))
    refused = sequence_table(bert, dataclasses.replace(report, world_size=1, per_rank_memory={1: 0}))
    assert [r.cp for r in refused.rows] == [1] and refused.notes[0].startswith("no context parallelism: context_parallel:")


def test_all_to_all_and_ring_traffic():
    """Per attention layer: all-to-all sends q, k, v, the output forward and their gradients backward (4 + 4
    buffers of b * S/cp * heads * d, K/V at the exchanged head count); the ring sends a K/V block cp-1 times
    forward, the block and then its gradient so far cp-1 times backward, and the gradient home once: (3cp - 2)
    blocks."""
    s = shape()  # 16 heads, 4 KV heads, head dim 64
    b, seq, item, d = 2, 8192, 2, 64
    for cp in (2, 4, 8):
        local = seq // cp
        q, kv = b * local * 16 * d * item, b * local * exchanged_kv_heads(4, cp) * d * item
        a2a = layer_traffic(s, b, seq, item, 1, cp, "all_to_all")
        assert a2a.forward == a2a.backward == (("all_to_all", q), ("all_to_all", kv), ("all_to_all", kv),
                                               ("all_to_all", q))
        assert a2a.nbytes == 2 * (2 * q + 2 * kv)
        ring = layer_traffic(s, b, seq, item, 1, cp, "ring")
        block = 2 * b * local * 4 * d * item
        assert ring.forward == (("send", block),) * (cp - 1)
        assert ring.backward == (("send", block),) * (2 * (cp - 1) + 1)  # the block, its gradient so far; home
        assert ring.nbytes == (3 * cp - 2) * block
    assert exchanged_kv_heads(4, 8) == 8 and exchanged_kv_heads(4, 2) == 4  # fewer K/V heads than cp: repeated
    # at tp 2 a rank's heads are halved, and so is what it sends
    assert layer_traffic(s, b, seq, item, 2, 2, "all_to_all").nbytes * 2 == layer_traffic(
        s, b, seq, item, 1, 2, "all_to_all").nbytes
    assert working_bytes(s, b, seq, item, 1, 4, "all_to_all") == b * (seq // 4) * d * item * (2 * 16 + 2 * 4)


def test_an_all_to_all_is_priced_from_the_all_gather_when_not_measured():
    """An all-to-all of an n-byte buffer moves (g-1)/g of it, as the all-gather of an n/g-byte input."""
    line = {k: {"4": CollectiveCost(30e-6, 5e9)} for k in ("all_reduce", "all_gather")}
    timed = {k: {"4": CollectiveCost(30e-6, 5e9, ((1e3, 40e-6), (1e6, 300e-6), (8e6, 2e-3)))}
             for k in ("all_reduce", "all_gather")}
    for coll in (line, timed):
        rates = MachineRates(4, 1, 0.0, 0.0, ((1, 1e9),), 1e9, 1e9, coll)
        for n in (512.0, 4e5, 3e6, 9e7):
            assert rates.collective("all_to_all", 4).seconds(n) == pytest.approx(
                rates.collective("all_gather", 4).seconds(n / 4), rel=1e-12)
    own = MachineRates(4, 1, 0.0, 0.0, ((1, 1e9),), 1e9, 1e9, {**line, "all_to_all": {"4": CollectiveCost(1e-3, 1e6)}})
    assert own.collective("all_to_all", 4).seconds(1e6) == pytest.approx(1e-3 + 1.0)


def test_the_step_splits_attention_and_prices_the_cp_traffic():
    """cp2 on one TP rank: the step is traced at the rank's share of the tokens, its attention kernels counted
    twice (1/cp of the whole sequence's), and the communication is each layer's messages plus one all-reduce per
    parameter; the all-to-all and the ring differ by their layers' messages alone."""
    cfg, batch, seq, cp = llama(4, max_position_embeddings=4096), 2, 1024, 2
    rates = PROFILE.rates(2)
    local = trace_setup(cfg, Setup(1), "train", batch, local_tokens(seq, cp), dtype=torch.float32)
    flat = predict(cfg, Setup(1), "train", batch, local_tokens(seq, cp), PROFILE, ranks=2, traced=local)
    split = {m: predict(cfg, Setup(1, cp=cp, cp_method=m), "train", batch, seq, PROFILE, dtype=torch.float32)
             for m in ("all_to_all", "ring")}
    one, two = (kernel_seconds(t, rates, names=ATTENTION_CORE) for _, t in local.rows)  # traced at 1 and 2 layers
    core = one + 3 * (two - one)  # at 4
    assert rates.train_skew == 0.0  # (else the split's kernels wait for the slower rank: longer by that skew)
    for p in split.values():
        assert p.setup.devices == 2 and p.kernels_s == pytest.approx(flat.kernels_s + (cp - 1) * core, rel=1e-9)
        assert p.cp_communication_s > 0 and p.tp_communication_s == 0.0
        assert p.seconds == pytest.approx(p.kernels_s + p.overhead_s + p.cp_communication_s, rel=1e-12)
    shp = transformer_shape(cfg)
    layer = {m: context_seconds(layer_traffic(shp, batch, seq, 4, 1, cp, m), 1, [], rates, cp,
                                rates.train_collective_overhead_s) for m in split}
    assert split["all_to_all"].cp_communication_s - split["ring"].cp_communication_s == pytest.approx(
        4 * (layer["all_to_all"] - layer["ring"]), rel=1e-9)
    plain = predict(cfg, Setup(1), "train", batch, seq, PROFILE, dtype=torch.float32)
    assert split["all_to_all"].memory_bytes < plain.memory_bytes
    with pytest.raises(ValueError, match="priced for training steps"):
        predict(cfg, Setup(1, cp=2), "decode", 1, 64, PROFILE, dtype=torch.float32)


def test_the_search_picks_cp2_when_the_sequence_only_fits_with_it():
    """One layer (so no pipeline stages, which would halve the weights too): at a long sequence the activations
    dominate, TP without sequence parallelism leaves the residual stream whole on every rank, data parallelism
    shares out the batch but not a sequence; cp2 halves them all."""
    cfg, seq = llama(1, max_position_embeddings=8192), 2048
    found = search(cfg, 2, "train", batch_size=1, seq_len=seq, profile=PROFILE, dtype=torch.float32,
                   alternatives=False)
    with_cp = [c for c in found.candidates if c.cp > 1]
    without = [c for c in found.candidates if c.cp == 1]
    assert {c.setup.label() for c in with_cp} == {"tp1, cp2", "tp1, cp2, fsdp over cp"}
    cap = (min(c.prediction.memory_bytes for c in with_cp) + min(c.prediction.memory_bytes for c in without)) / 2
    capped = search(cfg, 2, "train", cap, 1, seq, PROFILE, dtype=torch.float32, alternatives=False)
    assert capped.best.cp == 2 and capped.best.fits and {c.cp for c in capped.fitting} == {2}
    assert capped.best.context_parallel_kwargs() == {"method": "auto"} and "context-parallel" in capped.explain()
    with pytest.raises(ValueError, match="no setup fits"):  # without context parallelism nothing does
        search(cfg, 2, "train", cap, 1, seq, PROFILE, dtype=torch.float32, alternatives=False, context=False)


def test_cp_candidates_only_for_training_a_model_that_can_split_its_attention():
    model = tr.LlamaForCausalLM(llama(2))
    train = {s.label() for s in candidates(model, 4, "train", context=True)}
    assert {"tp1, cp2, dp2 ddp", "tp1, cp2, dp2 fsdp", "tp1, cp4", "tp1, cp4, fsdp over cp", "tp2, cp2",
            "tp1, cp4, recompute full"} <= train
    assert not any(s.cp > 1 for s in candidates(model, 4, "train"))  # not asked for: none
    assert not any(s.cp > 1 for s in candidates(model, 4, "decode", context=True))
    bert = tr.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128)
    why = context_refusal(tr.BertForMaskedLM(bert))  # tpkit.context's own words (an encoder: not a causal LM)
    assert why.startswith("context_parallel:") and context_refusal(model) is None
    refused = search(bert, 2, "train", batch_size=1, seq_len=16, profile=PROFILE, dtype=torch.float32,
                     alternatives=False)
    assert all(c.cp == 1 for c in refused.candidates) and f"no context parallelism: {why}" in refused.notes


@pytest.mark.parametrize("method", ["auto", "ring"])
def test_tpkit_search_offers_cp_and_its_pick_applies(method):
    """A cp setup `tpkit.search` returns runs under `apply_setup` (either method) and gives the loss one process
    gives (thread-ranks)."""
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(llama(2)).float()
    found = tpkit.search(model, 2, "train", batch_size=1, seq_len=32, profile=PROFILE)
    cp2 = next(c for c in found.candidates if c.setup.label() == "tp1, cp2")
    ids = torch.randint(3, 512, (1, 32), generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(model)(input_ids=ids, labels=ids).loss.item()
    copies = [copy.deepcopy(model) for _ in range(2)]

    def body(comm):
        m = tpkit.apply_setup(copies[comm.rank], dataclasses.replace(cp2.setup, cp_method=method), comm)
        return m(input_ids=ids, labels=ids).loss.item()
    assert max(abs(x - ref) for x in tpkit.run_threads(body, 2)) < 1e-5


def test_the_estimate_command_prices_cp(capsys):
    from tpkit.cli import main
    from tpkit.estimate.presets import preset_config
    from tpkit.estimate.speed import estimate_speed

    argv = ["estimate", "llama-3-8b", "--world-size", "1,2", "--mode", "training", "--seq-len", "8192", "--cp", "2",
            "--hardware", "H100-SXM"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = preset_config("llama-3-8b")
    for m in out["memory"]:
        ref = estimate_memory(cfg, m["world_size"], dtype=torch.bfloat16, mode="training", seq_len=8192, cp=2)
        assert m["cp"] == 2 and m["cp_method"] == "all_to_all" and m["per_rank"] == ref.per_rank.to_dict()
    speed = estimate_speed(cfg, [1, 2], hardware="H100-SXM", mode="training", seq_len=8192, cp=2)
    assert out["speed"]["cp"] == 2 and [r["total_s"] for r in out["speed"]["rows"]] == [r.total_s for r in speed.rows]
    plain = estimate_speed(cfg, [1, 2], hardware="H100-SXM", mode="training", seq_len=8192)
    assert speed.rows[0].total_s < plain.rows[0].total_s  # twice the devices on the same step
    assert main(argv) == 0
    assert "each world size x cp 2" in " ".join(capsys.readouterr().out.split())
    assert main(["estimate", "llama-3-8b", "--cp", "2", "--hardware", "H100-SXM"]) == 2  # inference: refused
    assert "splits training sequences" in capsys.readouterr().err


def test_the_analyze_command_shows_the_sequence_table(capsys, tmp_path):
    from tpkit.cli import main
    from tpkit.estimate.profile import save_profile

    llama(2, max_position_embeddings=4096).save_pretrained(tmp_path)
    profile = save_profile(PROFILE, str(tmp_path / "profile.json"))
    argv = ["analyze", str(tmp_path / "config.json"), "--mode", "training", "--max-world-size", "2",
            "--device-memory", "256MB", "--profile", profile]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sequences"]["rows"]
    assert [r["cp"] for r in rows] == [1, 2, 4, 8] and rows[3]["longest"] > rows[0]["longest"] > 0
    assert main([*argv, "--wide"]) == 0
    assert "training activations per rank by sequence length" in capsys.readouterr().out


def test_fsdp_shards_over_dp_x_cp():
    """FSDP2 spans every rank holding the same weights: dp x cp (over cp alone at dp 1); DDP averages over dp."""
    cfg = llama(4, max_position_embeddings=4096)
    alone, sharded, ddp = (predict(cfg, s, "train", 2, 512, PROFILE, ranks=4, dtype=torch.float32)
                           for s in (Setup(1, cp=4), Setup(1, 1, "fsdp", cp=4), Setup(1, 2, "ddp", cp=2)))
    assert Setup(1, 1, "fsdp", cp=4).engine == 4 and Setup(1, 2, "ddp", cp=2).engine == 2
    assert sharded.memory_bytes < alone.memory_bytes and sharded.dp_communication_s > 0 == alone.dp_communication_s
    est = {m: estimate_memory(cfg, 1, dtype=torch.float32, mode="training", seq_len=512, cp=4, dp_mode=m)
           for m in (None, "fsdp")}
    assert est["fsdp"].per_rank.optimizer_states == pytest.approx(est[None].per_rank.optimizer_states / 4, rel=0.05)
    assert any("dp x cp = 4 ranks" in n for n in est["fsdp"].notes)
    assert est["fsdp"].per_rank.activations == est[None].per_rank.activations
