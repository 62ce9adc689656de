"""estimate_speed on datasheet hardware: the datasheet's rates (ring collectives, matmuls at peak, every other op at
the memory bandwidth) fed to the op-by-op composition, against hand-computed figures."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tpkit.estimate.hardware import HARDWARE, Hardware, Interconnect, datasheet_rates, get_hardware
from tpkit.estimate.presets import preset_config
from tpkit.estimate.profile import IDEAL_PROFILE, LinkProfile
from tpkit.estimate.speed import estimate_speed

pytest.importorskip("transformers")

TOY = Hardware("toy", 1e12, 0.5e12, 1e9, 10**9, Interconnect("toy link", 1e9, 1e-6))


def tiny_llama():
    from transformers import LlamaConfig

    # 105,280 parameters: per layer attention 12,288, MLP 33,792, norms 128; embeddings and head 6,400 each.
    return LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2, vocab_size=100)


def test_datasheet_rates_by_hand():
    """A datasheet becomes the rates a calibration measures: matmuls at the fraction of peak for the element size,
    other work at the fraction of HBM bandwidth, no fixed cost per op, ring collectives over g ranks."""
    hw = Hardware("by hand", 400e12, 200e12, 2e12, 10**9, Interconnect("link", 100e9, 1e-6))
    rates = datasheet_rates(hw, 0.5, 0.8, LinkProfile(5e-6, 1e-6, 0.9), 4, bytes_per_element=2)
    bw = 0.9 * 100e9
    for m, width, stored in ((1, None, True), (64, 1024, False), (4096, 8192, False)):
        assert rates.flops_rate(m, width, stored) == pytest.approx(200e12, rel=1e-12)
    fp32 = datasheet_rates(hw, 0.5, 0.8, LinkProfile(5e-6, 1e-6, 0.9), 4, bytes_per_element=4)
    assert fp32.flops_rate(64) == pytest.approx(100e12, rel=1e-12)
    assert rates.weight_bandwidth(True) == rates.weight_bandwidth(False) == rates.copy_bandwidth == 1.6e12
    assert rates.op_overhead_s == rates.train_op_overhead_s == rates.collective_overhead_s == 0
    # all-reduce of 1 GB over 4: 2(t-1)/t of it crosses each link in 2(t-1) hops; gather / scatter: half of that
    assert rates.collective("all_reduce", 4).seconds(1e9) == pytest.approx(5e-6 + 2 * 3 / 4 * 1e9 / bw + 6e-6)
    assert rates.collective("all_gather", 4).seconds(0.25e9) == pytest.approx(5e-6 + 3 / 4 * 1e9 / bw + 3e-6)
    assert rates.collective("reduce_scatter", 4).seconds(1e9) == pytest.approx(5e-6 + 3 / 4 * 1e9 / bw + 3e-6)
    assert rates.collective("all_reduce", 2).seconds(1e9) == pytest.approx(5e-6 + 1e9 / bw + 2e-6)
    assert rates.collective("all_reduce", 1).seconds(1e9) == 0.0


def test_decode_by_hand():
    """Every op of one decoded token priced at the toy datasheet (1 GB/s: all of them bound by bytes), the
    collectives the plan adds at the ring's cost."""
    est = estimate_speed(tiny_llama(), [1, 2], hardware=TOY, mode="decode", batch_size=1, seq_len=100,
                         profile=IDEAL_PROFILE)
    one, two = est.row(1), est.row(2)
    # FLOPs: 2 * 98,560 matmul parameters (q, k, v, o, MLP, LM head) + 2 layers * 4 * 4 query heads * 101 keys * 16.
    assert one.flops_per_rank == 2 * 98_560 + 2 * 4 * 4 * 101 * 16
    # The kernels read every matmul weight once (bf16) and the KV cache (2 layers, k and v, 101 positions, 32 wide)
    assert one.bytes_per_rank > 98_560 * 2 + 2 * 2 * 101 * 32 * 2
    assert one.bound == "memory" and one.compute_s == 0 and one.framework_s == 0 and one.communication_s == 0
    assert one.memory_s == pytest.approx(one.bytes_per_rank / 1e9) and one.total_s == one.memory_s
    # t=2, rank 0: 2 query heads, 1 KV head, half the MLP (88) and half the vocabulary (50): 49,280 matmul weights.
    assert two.flops_per_rank == 2 * 49_280 + 2 * 4 * 2 * 101 * 16
    # 5 all-reduces of one token's 128 B (2 per layer, the embedding's) and the gather of this rank's 50 logits.
    assert two.collectives == 6 and two.communication_bytes == 5 * 128 + 100
    comm = 5 * (128 / 1e9 + 2e-6) + (100 / 1e9 + 1e-6)
    assert two.communication_s == pytest.approx(comm)
    assert two.total_s == pytest.approx(two.bytes_per_rank / 1e9 + comm)
    assert two.speedup == pytest.approx(one.total_s / two.total_s)
    assert two.tokens_per_s == pytest.approx(1 / two.total_s)


def test_training_scales_on_nvlink_and_less_on_pcie():
    cfg = preset_config("llama-2-70b")
    run = dict(mode="training", batch_size=4, seq_len=4096)
    nvlink = estimate_speed(cfg, [1, 2, 4, 8], hardware="H100-SXM", **run)
    pcie = estimate_speed(cfg, [1, 2, 4, 8], hardware="H100-SXM", interconnect="pcie", **run)
    speedups = [r.speedup for r in nvlink.rows]
    assert speedups == sorted(speedups) and 1 < speedups[-1] < 8
    assert all(p.speedup < n.speedup for p, n in zip(pcie.rows[1:], nvlink.rows[1:]))
    # the matmuls and attention divide over 8 ranks; the kernels bound by arithmetic take at most an eighth
    assert nvlink.row(8).flops_per_rank == pytest.approx(nvlink.row(1).flops_per_rank / 8, rel=0.01)
    assert 0 < nvlink.row(8).compute_s <= nvlink.row(1).compute_s / 8 * 1.01
    # full recompute runs the forward again: backward is about twice the forward (attention's 2.5 times)
    recompute = estimate_speed(cfg, 1, hardware="H100-SXM", recompute="full", **run).row(1)
    assert recompute.flops_per_rank == pytest.approx(4 / 3 * nvlink.row(1).flops_per_rank, rel=0.01)


def test_decode_is_bandwidth_bound_so_h200_is_faster():
    cfg = preset_config("llama-3-8b")
    h100 = estimate_speed(cfg, 1, hardware="H100-SXM", mode="decode", seq_len=2048).row(1)
    h200 = estimate_speed(cfg, 1, hardware="h200", mode="decode", seq_len=2048).row(1)
    assert h100.bound == "memory"
    assert h100.total_s / h200.total_s == pytest.approx(4800 / 3350)


def test_to_dict_and_summary():
    est = estimate_speed(tiny_llama(), [1, 2, 3], hardware="A100-80GB", mode="prefill", seq_len=64)
    d = json.loads(json.dumps(est.to_dict()))
    assert [r["world_size"] for r in d["rows"]] == [1, 2, 3] and d["hardware"] == "A100-80GB"
    assert "speedup" in est.summary() and "NVLink 3" in est.summary()


def test_hardware_presets():
    assert set(HARDWARE) == {"A100-80GB", "H100-SXM", "H200"}
    h = get_hardware("h100-sxm", "pcie")
    assert h.interconnect.bandwidth == 64e9 and h.peak_flops(2) == 989.4e12 and h.peak_flops(4) == 494.7e12
    with pytest.raises(ValueError, match="presets are"):
        get_hardware("TPU-v5")
    with pytest.raises(ValueError, match="interconnect"):
        get_hardware("H200", "infiniband")


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="serve"), "mode"), (dict(world_size=[0, 2]), "world sizes"), (dict(efficiency=1.5), "efficiency"),
    (dict(seq_len=0), "seq_len"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_speed(tiny_llama(), **kwargs)


def test_module_by_hand():
    """A module without a config is traced on its input, at the batch asked for (the example's 4 rows become 8)."""
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    est = estimate_speed(mlp, [1, 2], hardware=TOY, dtype=torch.float32, mode="training", batch_size=8,
                         input_shape=(4, 16), profile=IDEAL_PROFILE)
    one, two = est.row(1), est.row(2)
    # Forward: 2 * 8 samples * (16*64 + 64*16); backward: both weight gradients and the second layer's input
    # gradient (the input needs none), 3 more of 2 * 8 * 1024; t=2 halves the column -> row pair.
    assert one.flops_per_rank == 5 * 2 * 8 * 1024 and two.flops_per_rank == one.flops_per_rank / 2
    # all-reduces of the row layer's (8, 16) fp32 output: 512 B each, over 2 ranks at the ring's cost
    assert two.collectives >= 1 and two.communication_bytes == two.collectives * 8 * 16 * 4
    assert two.communication_s == pytest.approx(two.collectives * (512 / 1e9 + 2e-6))
    assert est.unit == "samples" and two.speedup == pytest.approx(one.total_s / two.total_s)
    prefill = estimate_speed(mlp, 1, hardware=TOY, dtype=torch.float32, mode="prefill", batch_size=8,
                             input_shape=(4, 16), profile=IDEAL_PROFILE).row(1)
    # one forward: two addmm (bias, input, weight, output), the ReLU's read and write, all fp32
    nbytes = 4 * ((64 + 8 * 16 + 64 * 16 + 8 * 64) + 2 * 8 * 64 + (16 + 8 * 64 + 16 * 64 + 8 * 16))
    assert prefill.flops_per_rank == 2 * 2 * 8 * 1024 and prefill.bytes_per_rank == nbytes
    assert prefill.total_s == pytest.approx(nbytes / 1e9)


def test_module_needs_an_input_and_cannot_decode():
    with pytest.raises(ValueError, match="example_input"):  # a norm first: no input can be inferred
        estimate_speed(nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)), 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="decode"):
        estimate_speed(nn.Linear(4, 4), 2, mode="decode", input_shape=(2, 4))
    with pytest.raises(TypeError, match="config or an nn.Module"):
        estimate_speed({"hidden_size": 4}, 2)


def test_encoders_do_not_decode():
    with pytest.raises(ValueError, match="encoder"):
        estimate_speed(preset_config("bert-base"), [1, 2], mode="decode")
    # One 512-token forward of a 110M encoder: ~0.1 ms of compute against 26 all-reduces and the all-gather of the MLM
    # head's dense (split alone): TP does not pay.
    two = estimate_speed(preset_config("bert-base"), [1, 2], mode="prefill", seq_len=512, hardware="H100-SXM").row(2)
    assert two.speedup < 1 and two.bound == "communication" and two.collectives == 2 * 12 + 1 + 1 + 1
