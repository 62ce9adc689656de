"""estimate_memory: the paper's formulas, parameter counts against real models and real shards, activations
against the bytes autograd actually saves (torch.autograd.graph.saved_tensors_hooks)."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tpkit.estimate import (TransformerShape, estimate_memory, korthikanti_layer_bytes, measure_step,
                                    optimizer_bytes_per_parameter, parameter_counts, transformer_activation_bytes,
                                    transformer_shape)
from tpkit.estimate.presets import build_model

transformers = pytest.importorskip("transformers")


def tiny_configs(attn="sdpa", dropout=0.0):
    """Tiny configs of each family, small enough to run on CPU in milliseconds."""
    from transformers import BertConfig, GPT2Config, LlamaConfig, MistralConfig, OPTConfig, Qwen2Config

    common = dict(num_hidden_layers=2, vocab_size=1000, attn_implementation=attn)
    return {
        "llama": LlamaConfig(hidden_size=128, intermediate_size=344, num_attention_heads=8, num_key_value_heads=4,
                             **common),
        "mistral": MistralConfig(hidden_size=128, intermediate_size=344, num_attention_heads=8,
                                 num_key_value_heads=2, **common),
        "qwen2": Qwen2Config(hidden_size=128, intermediate_size=344, num_attention_heads=8, num_key_value_heads=2,
                             **common),
        "gpt2": GPT2Config(n_embd=128, n_head=8, n_layer=2, vocab_size=1000, n_positions=128,
                           attn_implementation=attn, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout),
        "opt": OPTConfig(hidden_size=128, num_attention_heads=8, ffn_dim=512, word_embed_proj_dim=128,
                         max_position_embeddings=128, dropout=dropout, attention_dropout=dropout, **common),
        "bert": BertConfig(hidden_size=128, num_attention_heads=8, intermediate_size=512, max_position_embeddings=128,
                           hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, **common),
    }


# ------------------------------------------------------------------------------------------- formulas


def test_korthikanti_formula_by_hand():
    # s=2, b=1, h=4, a=2: s*b*h = 8 and 5*a*s/h = 5.
    assert korthikanti_layer_bytes(2, 1, 4, 2) == 8 * (34 + 5)
    assert korthikanti_layer_bytes(2, 1, 4, 2, world_size=2) == 8 * (10 + 12 + 2.5)
    assert korthikanti_layer_bytes(2, 1, 4, 2, world_size=2, sequence_parallel=True) == 8 / 2 * 39
    assert korthikanti_layer_bytes(2, 1, 4, 2, recompute="selective") == 8 * 34
    assert korthikanti_layer_bytes(2, 1, 4, 2, world_size=2, recompute="full") == 16
    assert korthikanti_layer_bytes(2, 1, 4, 2, world_size=2, sequence_parallel=True, recompute="full") == 8


def paper_gpt(h, a, layers=2, vocab=64):
    """The paper's model: LayerNorm, GeLU MLP of 4h, dropout everywhere, fp16 softmax."""
    return TransformerShape("gpt", vocab, h, layers, a, a, h // a, 4 * h, gated_mlp=False, activation="gelu",
                            norm="layer", attention_dropout=0.1, hidden_dropout=0.1, softmax_fp32=False)


@settings(max_examples=25, deadline=None)
@given(heads=st.sampled_from([4, 8, 16]), head_dim=st.sampled_from([8, 32]), s=st.integers(1, 512),
       b=st.integers(1, 4), t=st.sampled_from([1, 2, 4]), sp=st.booleans(),
       recompute=st.sampled_from(["none", "selective", "full"]))
def test_architecture_formula_reduces_to_the_paper(heads, head_dim, s, b, t, sp, recompute):
    shape = paper_gpt(heads * head_dim, heads)
    layers = transformer_activation_bytes(shape, b, s, 2, t, sp, recompute, attention="eager")["layers"]
    paper = korthikanti_layer_bytes(s, b, shape.hidden_size, heads, t, sp, recompute)
    if recompute == "full":  # ours also holds the one layer rebuilt during backward
        one_layer = transformer_activation_bytes(shape, b, s, 2, t, sp, "none", attention="eager")["layers"] / 2
        assert layers == pytest.approx(2 * paper + one_layer)
    else:
        assert layers == pytest.approx(2 * paper)


def test_optimizer_bytes_per_parameter():
    assert optimizer_bytes_per_parameter("adamw", torch.bfloat16) == 12  # fp32 master + 2 fp32 moments
    assert optimizer_bytes_per_parameter("adamw", torch.float32) == 8
    assert optimizer_bytes_per_parameter("sgd", torch.bfloat16) == 8
    assert optimizer_bytes_per_parameter("sgd", torch.float32) == 4
    assert optimizer_bytes_per_parameter("adamw", torch.bfloat16, master_weights=False) == 4
    assert optimizer_bytes_per_parameter("none", torch.float32) == 0


# ------------------------------------------------------------------------------------------ parameters


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2", "opt", "bert"])
def test_parameter_count_equals_hf_numel(family):
    config = tiny_configs()[family]
    model = build_model(config)  # meta: shapes only
    assert sum(parameter_counts(transformer_shape(config)).values()) == sum(p.numel() for p in model.parameters())


def test_per_rank_parameters_by_hand():
    from transformers import LlamaConfig

    # h=64, 4 heads of 16, 2 KV heads, MLP 176, vocab 100, 2 layers, untied.
    cfg = LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=100)
    shape = transformer_shape(cfg)
    # t=2: q 2 heads (32), kv 1 head (16); attention 64*(32+2*16) + 32*64; MLP 3*64*88; norms 2*64 per layer.
    per_layer = 64 * 64 + 32 * 64 + 3 * 64 * 88 + 128
    assert sum(parameter_counts(shape, 2).values()) == 2 * per_layer + 2 * 50 * 64 + 64
    # t=4: 2 KV heads < 4 ranks: each rank holds 1 query head and a replica of its KV head.
    per_layer = 64 * (16 + 32) + 16 * 64 + 3 * 64 * 44 + 128
    assert sum(parameter_counts(shape, 4).values()) == 2 * per_layer + 2 * 25 * 64 + 64
    # t=3 (uneven): query heads [2, 1, 1], rank 0 reads KV head 0 only; MLP [59, 59, 58]; vocab [34, 33, 33].
    per_layer = 64 * (32 + 32) + 32 * 64 + 3 * 64 * 59 + 128
    assert sum(parameter_counts(shape, 3).values()) == 2 * per_layer + 2 * 34 * 64 + 64
    # t=5: fewer query heads than ranks: no head layout; each projection is split alone by its output rows (q and o
    # 64 -> 13 on rank 0, k and v 32 -> 7), as the planner does, and said so.
    per_layer = 64 * (13 + 7 + 7) + 64 * 13 + 3 * 64 * 36 + 128
    assert sum(parameter_counts(shape, 5).values()) == 2 * per_layer + 2 * 20 * 64 + 64
    assert any("split alone" in n for n in estimate_memory(cfg, 5, dtype=torch.float32).notes)


def test_fullest_rank_is_not_always_rank_0():
    from transformers import LlamaConfig

    from tpkit.estimate import fullest_rank

    # 9 query heads of 4 in 3 KV groups over 5 ranks: query heads [2, 2, 2, 2, 1]; rank 1 holds heads 2 and 3,
    # which read KV heads 0 and 1, so it holds 2 KV heads where rank 0 holds 1. MLP 8 -> [2, 2, 2, 1, 1].
    cfg = LlamaConfig(hidden_size=36, intermediate_size=8, num_attention_heads=9, num_key_value_heads=3,
                      num_hidden_layers=1, vocab_size=5)
    shape = transformer_shape(cfg)
    norms, mlp, vocab_rows = 3 * 36, 3 * 36 * 2, 2 * 36
    assert sum(parameter_counts(shape, 5, rank=0).values()) == 36 * (8 + 2 * 4) + 8 * 36 + mlp + norms + vocab_rows
    assert sum(parameter_counts(shape, 5, rank=1).values()) == 36 * (8 + 2 * 8) + 8 * 36 + mlp + norms + vocab_rows
    assert fullest_rank(shape, 5) == 1
    assert parameter_counts(shape, 5) == parameter_counts(shape, 5, rank=1)


def _tp_shard_bytes(comm, layers):
    """Rank 0's bytes after sharding an MLP's linears with the real tpkit.nn layers."""
    from tpkit.nn import ColumnParallelLinear, RowParallelLinear

    col = ColumnParallelLinear.from_module(layers[0], comm)
    row = RowParallelLinear.from_module(layers[2], comm)
    return sum(p.numel() * p.element_size() for m in (col, row) for p in m.parameters())


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_module_parameters_match_real_shards(t):
    from tpkit.comm import run_threads

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(24, 96), nn.ReLU(), nn.Linear(96, 24))
    est = estimate_memory(mlp, t, dtype=torch.float32, mode="training", input_shape=(4, 24))
    sharded = run_threads(lambda comm: _tp_shard_bytes(comm, mlp), t)[0]
    assert est.per_rank.parameters == sharded
    assert est.parameters_total == sum(p.numel() for p in mlp.parameters())


# ----------------------------------------------------------------------------------------- activations


def measured_activation_bytes(model, **inputs) -> int:
    """Bytes autograd saves for backward in one forward (parameters excluded, storages counted once)."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen = {}

    def pack(x):
        ptr = x.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(**inputs)
    return sum(seen.values())


@pytest.mark.parametrize("family,attn,dtype", [
    ("llama", "sdpa", torch.float32), ("llama", "eager", torch.bfloat16), ("mistral", "sdpa", torch.bfloat16),
    ("qwen2", "eager", torch.float32), ("gpt2", "eager", torch.float32), ("opt", "sdpa", torch.bfloat16),
    ("bert", "sdpa", torch.float32),
])
def test_activation_estimate_within_10_percent_of_saved_tensors(family, attn, dtype):
    config = tiny_configs(attn)[family]
    torch.manual_seed(0)
    model = build_model(config, device="cpu", dtype=dtype).train()
    ids = torch.randint(0, config.vocab_size, (2, 64))
    measured = measured_activation_bytes(model, input_ids=ids, labels=ids)
    est = estimate_memory(config, 1, dtype=dtype, mode="training", batch_size=2, seq_len=64)
    assert est.per_rank.activations == pytest.approx(measured, rel=0.10)
    # The attention implementation comes from the model when a model is given.
    assert estimate_memory(model, 1, dtype=dtype, mode="training", batch_size=2,
                           seq_len=64).per_rank.activations == est.per_rank.activations


def test_activation_options_order():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=8,
                      num_hidden_layers=4, vocab_size=1000)
    run = dict(dtype=torch.bfloat16, mode="training", batch_size=2, seq_len=1024, attention="eager")
    none = estimate_memory(cfg, 4, **run).per_rank.activations
    sp = estimate_memory(cfg, 4, sequence_parallel=True, **run).per_rank.activations
    selective = estimate_memory(cfg, 4, recompute="selective", **run).per_rank.activations
    full = estimate_memory(cfg, 4, recompute="full", **run).per_rank.activations
    one = estimate_memory(cfg, 1, **run).per_rank.activations
    assert full < selective < none < one and sp < none
    flash = estimate_memory(cfg, 4, **{**run, "attention": "sdpa"}).activations_formula
    # The formula (recompute is not traced, so `selective` is the formula's): fused attention keeps no s*s scores (what selective recompute drops) but a fp32 log-sum-exp per head:
    # 4 layers * 2048 tokens * 2 heads per rank * 4 bytes.
    assert flash == selective + 4 * 2048 * 2 * 4


def test_module_activations_by_hand():
    mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    # fp32, measured at batch 8: the input (8*64*4) and ReLU's output (8*256*4, also the 2nd linear's input).
    est = estimate_memory(mlp, 1, dtype=torch.float32, mode="training", batch_size=32, input_shape=(8, 64))
    assert est.per_rank.activations == 4 * (8 * 64 * 4 + 8 * 256 * 4)
    # t=2: ReLU's output lies between the column and the row layer: split. The input is whole.
    est2 = estimate_memory(mlp, 2, dtype=torch.float32, mode="training", batch_size=32, input_shape=(8, 64))
    assert est2.per_rank.activations == 4 * (8 * 64 * 4 + 8 * 128 * 4)
    assert est2.per_rank.communication_buffers == 32 * 64 * 4  # the row layer's all-reduced output
    # The user's model is not run or changed.
    assert all(p.grad is None for p in mlp.parameters())


def test_module_on_meta_device_is_measured_on_a_copy():
    with torch.device("meta"):
        cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))
    est = estimate_memory(cnn, 2, dtype=torch.float32, mode="training", example_input=torch.zeros(2, 3, 8, 8))
    assert est.per_rank.activations > 0 and est.per_rank.parameters < est.single.parameters
    assert all(p.is_meta for p in cnn.parameters())


def test_measure_step_world_size_one():
    lin = nn.Linear(8, 8)
    out = measure_step(lin, (torch.randn(3, 8, requires_grad=False),))
    assert out["activations"] == 3 * 8 * 4 and out["parameter_bytes"] == (64 + 8) * 4


# -------------------------------------------------------------------------------------- whole estimate


def test_training_totals_and_savings():
    cfg = tiny_configs()["llama"]
    one = estimate_memory(cfg, 1, dtype=torch.bfloat16, mode="training", batch_size=2, seq_len=32)
    est = estimate_memory(cfg, 2, dtype=torch.bfloat16, mode="training", batch_size=2, seq_len=32)
    p = est.parameters_per_rank
    assert est.per_rank.parameters == 2 * p and est.per_rank.gradients == 2 * p
    assert est.per_rank.optimizer_states == 12 * p
    assert est.single.total == one.per_rank.total and one.per_rank.communication_buffers == 0
    assert est.per_rank.communication_buffers == 2 * 32 * 128 * 2  # all-reduce of (b, s, h) in bf16
    assert est.savings_bytes == est.single.total - est.per_rank.total > 0
    d = json.loads(json.dumps(est.to_dict()))
    assert d["per_rank"]["total"] == est.per_rank.total and d["world_size"] == 2
    text = est.summary()
    assert "per rank (t=2)" in text and "optimizer states" in text


def test_inference_kv_cache_and_logit_gather():
    cfg = tiny_configs()["llama"]  # 2 layers, 4 KV heads of 16
    est = estimate_memory(cfg, 2, dtype=torch.bfloat16, mode="inference", batch_size=3, seq_len=50)
    assert est.per_rank.kv_cache == 2 * 2 * 3 * 50 * (2 * 16) * 2
    assert est.single.kv_cache == 2 * est.per_rank.kv_cache
    assert est.per_rank.gradients == 0 and est.per_rank.optimizer_states == 0
    assert est.per_rank.communication_buffers == 3 * 50 * 1000 * 2  # gathered logits (b, s, v)


def test_70b_preset_fits_only_when_split():
    from tpkit.estimate.presets import preset_config

    cfg = preset_config("llama-2-70b")
    e1 = estimate_memory(cfg, 1, mode="inference", batch_size=1, seq_len=4096)
    e8 = estimate_memory(cfg, 8, mode="inference", batch_size=1, seq_len=4096)
    assert e1.per_rank.parameters > 128 * 1024**3 and e8.per_rank.total < 80 * 1024**3


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=0), "world_size"), (dict(world_size=2, mode="serve"), "mode"),
    (dict(world_size=2, mode="training", optimizer="lion"), "optimizer"),
    (dict(world_size=2, recompute="some"), "recompute"), (dict(world_size=2, batch_size=0), "batch_size"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_memory(tiny_configs()["llama"], **kwargs)


def test_module_without_input_says_what_to_pass():
    with pytest.raises(ValueError, match="example_input"):
        estimate_memory(nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)), 2)  # no input follows from a norm
    with pytest.raises(TypeError, match="config or an nn.Module"):
        estimate_memory({"hidden_size": 3}, 2)


def test_dtype_defaults_to_the_models_own():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).to(torch.float64)
    est = estimate_memory(mlp, 2, input_shape=(2, 8))
    assert est.dtype == "float64" and est.single.parameters == 8 * sum(p.numel() for p in mlp.parameters())
    assert estimate_memory(tiny_configs()["llama"], 1).dtype == "bfloat16"


def test_rank_heads_follow_the_spread_layout():
    """16 query / 4 KV heads at 3 ranks as the converter lays them out (issue 20 item 9): 6/5/5 query heads, 2 KV
    heads each; every rank's groups are unequal, so its attention (and KV cache) sees one KV head per query head."""
    from tpkit.estimate import rank_heads
    from tpkit.estimate.ranks import rank_cache_heads

    assert [rank_heads(16, 4, 3, r) for r in range(3)] == [(6, 2, True), (5, 2, True), (5, 2, True)]
    assert [rank_cache_heads(16, 4, 3, r) for r in range(3)] == [6, 5, 5]
    assert [rank_cache_heads(16, 4, 4, r) for r in range(4)] == [1, 1, 1, 1]  # even: today's layout and cache
