"""estimate_speed: alpha-beta collectives and the per-rank roofline against hand-computed figures."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tpkit.estimate.hardware import HARDWARE, Hardware, Interconnect, get_hardware
from tpkit.estimate.presets import preset_config
from tpkit.estimate.profile import IDEAL_PROFILE
from tpkit.estimate.speed import estimate_speed, ring_all_gather_seconds, ring_all_reduce_seconds

pytest.importorskip("transformers")

TOY = Hardware("toy", 1e12, 0.5e12, 1e9, 10**9, Interconnect("toy link", 1e9, 1e-6))


def tiny_llama():
    from transformers import LlamaConfig

    # 105,280 parameters: per layer attention 12,288, MLP 33,792, norms 128; embeddings and head 6,400 each.
    return LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2, vocab_size=100)


def test_ring_collectives_by_hand():
    assert ring_all_reduce_seconds(1e9, 4, 100e9, 1e-6) == pytest.approx(2 * 3 / 4 * 0.01 + 6e-6)
    assert ring_all_gather_seconds(1e9, 4, 100e9, 1e-6) == pytest.approx(3 / 4 * 0.01 + 3e-6)
    assert ring_all_reduce_seconds(1e9, 1, 100e9, 1e-6) == 0.0


def test_decode_roofline_by_hand():
    est = estimate_speed(tiny_llama(), [1, 2], hardware=TOY, mode="decode", batch_size=1, seq_len=100,
                         profile=IDEAL_PROFILE)
    one, two = est.row(1), est.row(2)
    # t=1: weights 105,280 * 2 B + KV cache 2 layers * 2 (k, v) * 100 positions * 32 features * 2 B.
    assert one.bytes_per_rank == 105_280 * 2 + 2 * 2 * 100 * 32 * 2
    assert one.memory_s == pytest.approx(236_160 / 1e9) and one.total_s == one.memory_s
    # FLOPs: 2 * 98,560 matmul parameters + 2 layers * 4 * 100 context * 64 query features.
    assert one.flops_per_rank == 2 * 98_560 + 2 * 4 * 100 * 64
    assert one.bound == "memory" and one.communication_s == 0
    # t=2: 52,800 parameters on rank 0, half the KV cache; 5 all-reduces of 128 B and a gather of 200 B logits.
    assert two.bytes_per_rank == 52_800 * 2 + 2 * 2 * 100 * 16 * 2
    comm = 5 * (128 / 1e9 + 2e-6) + (0.5 * 200 / 1e9 + 1e-6)
    assert two.communication_s == pytest.approx(comm)
    assert two.total_s == pytest.approx(118_400 / 1e9 + comm)
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
    assert nvlink.row(8).compute_s == pytest.approx(nvlink.row(1).compute_s / 8, rel=0.01)
    recompute = estimate_speed(cfg, 1, hardware="H100-SXM", recompute="full", **run).row(1)
    assert recompute.flops_per_rank == pytest.approx(4 / 3 * nvlink.row(1).flops_per_rank)


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


def test_measured_module_by_hand():
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    est = estimate_speed(mlp, [1, 2], hardware=TOY, dtype=torch.float32, mode="training", batch_size=8,
                         input_shape=(4, 16), profile=IDEAL_PROFILE)
    one, two = est.row(1), est.row(2)
    # Forward: 2 * 8 samples * (16*64 + 64*16) multiply-adds; training = 3 x forward; t=2 halves the pair.
    assert one.flops_per_rank == 3 * 2 * 8 * 2048 and two.flops_per_rank == one.flops_per_rank / 2
    # One all-reduce of the (8, 16) fp32 output forward, its conjugate in backward.
    assert two.collectives == 2
    assert two.communication_s == pytest.approx(2 * ring_all_reduce_seconds(8 * 16 * 4, 2, 1e9, 1e-6))
    assert est.unit == "samples" and two.speedup == pytest.approx(one.total_s / two.total_s)


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
