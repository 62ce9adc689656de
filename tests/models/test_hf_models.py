"""Hugging Face models converted by `parallelize`: logits, one AdamW step and greedy generation equal the
single-device model's, on thread-ranks (world size 4) and gloo processes (world size 2)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import tpkit  # noqa: E402

from .hf import DECODERS, MODELS, gloo_body, rank_check  # noqa: E402

TOL = 1e-4


def _assert_rank(name: str, result: dict, rank: int) -> None:
    assert result["logit_err"] < TOL, f"{name} rank {rank}: logits rel err {result['logit_err']:.2e}"
    assert result["step_err"] < TOL, f"{name} rank {rank}: AdamW step rel err {result['step_err']:.2e}"
    if name in DECODERS:
        assert result["same_tokens"], f"{name} rank {rank}: generate() gave different tokens"


@pytest.mark.parametrize("name", MODELS)
def test_threads_world_size_4(name, hf_reference):
    ref = hf_reference(name)
    for rank, result in enumerate(tpkit.launch(rank_check, 4, backend="threads", args=(name, ref))):
        _assert_rank(name, result, rank)


def test_llama_two_kv_heads_world_size_4(hf_reference):
    """KV heads (2) < ranks (4): each KV head is replicated on two ranks, gradients summed across them."""
    over = {"num_key_value_heads": 2}
    ref = hf_reference("llama", **over)
    for rank, result in enumerate(tpkit.launch(rank_check, 4, backend="threads", args=("llama", ref, over))):
        _assert_rank("llama", result, rank)


def test_llama_kv_heads_shared_by_some_ranks_only_world_size_3(hf_reference):
    """4 heads, 2 KV heads on 3 ranks: ranks 1 and 2 share KV head 1, rank 0 holds head 0 alone; rank 0 must
    still join the KV gradient sum (it once skipped it, and backward failed with mismatched all-reduces)."""
    over = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    ref = hf_reference("llama", **over)
    for rank, result in enumerate(tpkit.launch(rank_check, 3, backend="threads", args=("llama", ref, over))):
        _assert_rank("llama", result, rank)


@pytest.mark.slow
def test_gloo_world_size_2_all_models(hf_reference):
    refs = {n: hf_reference(n) for n in MODELS}
    results = tpkit.launch(gloo_body, 2, backend="gloo", args=(MODELS, refs), timeout=240)
    for rank, per_model in enumerate(results):
        for name in MODELS:
            _assert_rank(name, per_model[name], rank)


def test_phi3_packed_qkv_and_gate_up():
    """Phi-3 packs q, k, v in one projection (sliced `qkv[..., a:b]`, GQA) and gate/up in another (chunk):
    both are split piece by piece, KV heads replicated at 4 ranks; forward and gradients checked."""
    import torch
    import transformers as tr

    from tpkit.convert import plan, verify

    cfg = tr.Phi3Config(vocab_size=103, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tr.Phi3ForCausalLM(cfg)
    p = plan(model, 4)
    assert p.details["model.layers.0.self_attn.qkv_proj"].pieces == (64, 16, 16)
    assert p.details["model.layers.0.mlp.gate_up_proj"].pieces == (80, 80)
    ids = torch.randint(0, 103, (2, 6), generator=torch.Generator().manual_seed(0))
    for world in (3, 4):
        report = verify(model, {"input_ids": ids}, world_size=world, backward=True)
        assert report.ok, report.summary()


def test_qwen3_per_head_norms():
    """Qwen3 normalises q and k per head (q_norm / k_norm over head_dim) between the projections and the
    attention: the heads split through them, their weights stay whole and their gradients are summed."""
    import torch
    import transformers as tr

    from tpkit.convert import plan, verify

    cfg = tr.Qwen3Config(vocab_size=103, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tr.Qwen3ForCausalLM(cfg)
    p = plan(model, 4)
    assert p["model.layers.0.self_attn.q_proj"] == "colwise"
    assert p["model.layers.0.self_attn.k_norm"] == "replicated_with_grad_allreduce"
    ids = torch.randint(0, 103, (2, 6), generator=torch.Generator().manual_seed(0))
    report = verify(model, {"input_ids": ids}, world_size=4, backward=True)
    assert report.ok, report.summary()
    assert any("k_norm" in g.name for g in report.gradients)


def test_gpt_neox_interleaved_qkv():
    """GPT-NeoX packs each head's q, k, v side by side ([heads, 3 x head_dim]): split by whole head blocks."""
    import torch
    import transformers as tr

    from tpkit.convert import plan, verify

    cfg = tr.GPTNeoXConfig(vocab_size=103, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                           num_attention_heads=6, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tr.GPTNeoXForCausalLM(cfg)
    p = plan(model, 4)
    assert p["gpt_neox.layers.0.attention.query_key_value"] == "colwise"
    assert p.details["gpt_neox.layers.0.attention.query_key_value"].role == "qkv_heads"
    ids = torch.randint(0, 103, (2, 6), generator=torch.Generator().manual_seed(0))
    report = verify(model, {"input_ids": ids}, world_size=4, backward=True)  # 6 heads: 2, 2, 1, 1
    assert report.ok, report.summary()


def test_clip_grad_norm_with_replicated_kv_heads():
    """KV heads (2) < ranks (4): the replicated K/V rows count once, so the global gradient norm of the
    converted model equals the single-device model's."""
    import torch
    import transformers as tr

    cfg = tr.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(cfg).double()
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    model.zero_grad()

    def body():
        import copy

        tp = tpkit.parallelize(copy.deepcopy(model))
        tp(ids, labels=ids).loss.backward()
        return tpkit.clip_grad_norm_(tp.parameters(), 1e9)

    for norm in tpkit.launch(body, 4, backend="threads"):
        torch.testing.assert_close(norm, expected, rtol=1e-9, atol=0)
