"""The estimate against the real thing: parameter bytes per rank equal what `parallelize` leaves on each rank,
and the TP activation formula is within 10% of what a parallelized rank saves for backward."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit.comm import run_threads
from tpkit.estimate import estimate_memory, transformer_activation_bytes, transformer_shape
from tpkit.convert.parallelize import parallelize
from tpkit.estimate.presets import build_model

transformers = pytest.importorskip("transformers")

from .test_estimate import measured_activation_bytes, tiny_configs  # noqa: E402


def _held_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _parallelized_bytes(config, world_size, cls=None):
    def body(comm):
        model = cls(config) if cls is not None else build_model(config, device="meta")
        return _held_bytes(parallelize(model, "auto", comm, mode="training"))

    return max(run_threads(body, world_size))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2", "opt"])
@pytest.mark.parametrize("t", [2, 3, 4])
def test_config_estimate_equals_parallelized_bytes(family, t):
    config = tiny_configs()[family]
    est = estimate_memory(config, t, dtype=torch.float32, mode="training")
    assert est.per_rank.parameters == _parallelized_bytes(config, t)


@settings(max_examples=8, deadline=None)
@given(kv=st.integers(1, 4), group=st.integers(1, 3), head_dim=st.sampled_from([4, 8]), f=st.integers(8, 48),
       vocab=st.integers(5, 60), t=st.integers(2, 5), tied=st.booleans(), bias=st.booleans())
def test_random_llama_shapes_equal_parallelized_bytes(kv, group, head_dim, f, vocab, t, tied, bias):
    """Uneven heads, KV heads fewer than ranks, heads fewer than ranks (attention replicated), odd widths."""
    from transformers import LlamaConfig

    heads = kv * group
    config = LlamaConfig(hidden_size=heads * head_dim, intermediate_size=f, num_attention_heads=heads,
                         num_key_value_heads=kv, num_hidden_layers=1, vocab_size=vocab, tie_word_embeddings=tied,
                         attention_bias=bias, mlp_bias=bias)
    est = estimate_memory(config, t, dtype=torch.float32, mode="training")
    assert est.per_rank.parameters == _parallelized_bytes(config, t)


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("cls_name", ["BertModel", "BertForMaskedLM"])
def test_model_estimate_equals_parallelized_bytes_for_an_encoder(t, cls_name):
    # The model path counts what the converter's plan holds; BertForMaskedLM's head bias is held twice in the
    # module tree (cls.predictions.bias is decoder.bias) and must stay one vocab-split tensor.
    cls = getattr(transformers, cls_name)
    config = tiny_configs()["bert"]
    with torch.device("meta"):
        model = cls(config)
    est = estimate_memory(model, t, dtype=torch.float32, mode="training")
    assert est.per_rank.parameters == _parallelized_bytes(config, t, cls=cls)


@pytest.mark.parametrize("t,sp_free_heads", [(2, 4), (4, 2)])
def test_tp_activation_formula_against_a_parallelized_rank(t, sp_free_heads):
    """Per-rank bytes saved by the decoder body (embedding, layers, final norm) on thread-ranks."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=128, intermediate_size=344, num_attention_heads=8,
                         num_key_value_heads=sp_free_heads, num_hidden_layers=2, vocab_size=1000,
                         attn_implementation="sdpa")
    ids = torch.randint(0, 1000, (2, 64))

    def body(comm):
        torch.manual_seed(0)
        model = build_model(config, device="cpu").train()
        parallelize(model, "auto", comm, mode="training")
        return measured_activation_bytes(model.model, input_ids=ids)

    measured = run_threads(body, t)
    parts = transformer_activation_bytes(transformer_shape(config), 2, 64, 4, t, attention="flash")
    expected = parts["layers"] + parts["embedding"] + parts["final_norm"]
    assert max(measured) == pytest.approx(expected, rel=0.10)
    one = transformer_activation_bytes(transformer_shape(config), 2, 64, 4, 1, attention="flash")
    assert expected < one["layers"] + one["embedding"] + one["final_norm"]


def _custom_models():
    from torch import nn

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(24, 96), nn.GELU(), nn.Linear(96, 24), nn.LayerNorm(24), nn.Linear(24, 10))
    cnn = nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(), nn.Conv2d(12, 6, 1))
    return {"mlp": (mlp, torch.randn(4, 24)), "cnn": (cnn, torch.randn(2, 3, 8, 8))}


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("t", [2, 3])
def test_custom_module_estimate_equals_parallelized_bytes(name, t):
    import copy

    model, x = _custom_models()[name]
    est = estimate_memory(model, t, dtype=torch.float32, mode="training", example_input=x)

    def body(comm):
        return _held_bytes(parallelize(copy.deepcopy(model), "auto", comm, mode="training", example_inputs=(x,)))

    held = run_threads(body, t)
    assert est.per_rank.parameters == max(held) < est.single.parameters


def _gloo_rank_body(families):
    """On one gloo process: parameter bytes held after parallelize for each family, and the bytes a
    parallelized Llama body saves for backward."""
    import tpkit

    from tpkit.convert.parallelize import parallelize as parallelize_
    from tpkit.estimate.presets import build_model as build

    from tests.estimate.test_estimate import measured_activation_bytes as saved_bytes, tiny_configs as configs

    comm = tpkit.get_communicator()
    held = {}
    for family in families:
        model = parallelize_(build(configs()[family], device="meta"), "auto", comm, mode="training")
        held[family] = _held_bytes(model)
    torch.manual_seed(0)
    llama = parallelize_(build(configs()["llama"], device="cpu").train(), "auto", comm, mode="training")
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1))
    return held, saved_bytes(llama.model, input_ids=ids)


def test_estimates_against_two_gloo_processes():
    import tpkit

    families = ["llama", "qwen2", "gpt2", "opt"]
    results = tpkit.launch(_gloo_rank_body, 2, backend="gloo", args=(families,), timeout=120)
    for family in families:
        est = estimate_memory(tiny_configs()[family], 2, dtype=torch.float32, mode="training")
        assert est.per_rank.parameters == max(r[0][family] for r in results), family
    shape = transformer_shape(tiny_configs()["llama"])
    parts = transformer_activation_bytes(shape, 2, 64, 4, 2, attention="flash")
    expected = parts["layers"] + parts["embedding"] + parts["final_norm"]
    assert max(r[1] for r in results) == pytest.approx(expected, rel=0.10)
