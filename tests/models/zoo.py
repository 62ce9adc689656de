"""A zoo of tiny Hugging Face architectures not covered elsewhere in the tests, for the coverage checks.

`ZOO[name]()` builds one model: float64, eager attention, no dropout, weights from a fixed seed (built under a
lock, since thread-ranks share torch's global RNG; build outside the ranks and deep-copy per rank).
`example_inputs(name)` gives the keyword inputs its forward takes. Head counts are chosen so the heads
divide over 2 and 3 ranks where the architecture allows it (6 heads); the vocabulary is odd on purpose.
bench/ scripts read this file too (the coverage table on docs/reference/coverage.md), so keep builders cheap and deterministic.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch
from torch import nn

VOCAB = 101
_LOCK = threading.Lock()

# Shared tiny sizes: hidden 48 = 6 heads of 8; MLP 96 (divides by 2 and 3).
_DEC = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
            max_position_embeddings=64)
_NO_DROP = dict(attention_dropout=0.0)


def _build(cfg_name: str, cls_name: str, **kw) -> nn.Module:
    import transformers as tr

    config = getattr(tr, cfg_name)(**kw)
    config._attn_implementation = "eager"
    with _LOCK:
        torch.manual_seed(1234)
        model = getattr(tr, cls_name)(config)
    return model.double().eval()


def gemma():
    return _build("GemmaConfig", "GemmaForCausalLM", **_DEC, num_key_value_heads=3, head_dim=8)


def gemma2():
    return _build("Gemma2Config", "Gemma2ForCausalLM", **_DEC, num_key_value_heads=3, head_dim=8,
                  sliding_window=4, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)


def falcon():
    return _build("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2,
                  num_attention_heads=6, new_decoder_architecture=True, num_kv_heads=3, hidden_dropout=0.0,
                  attention_dropout=0.0, bias=False)


def gptj():
    return _build("GPTJConfig", "GPTJForCausalLM", vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=6, rotary_dim=4,
                  n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def codegen():
    # CodeGen packs qkv in 4 groups (its TPU layout, `mp_num = 4`): heads must divide by 4.
    return _build("CodeGenConfig", "CodeGenForCausalLM", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=8,
                  rotary_dim=4, n_positions=64, n_ctx=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def bloom():
    return _build("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6,
                  hidden_dropout=0.0, attention_dropout=0.0)


def stablelm():
    return _build("StableLmConfig", "StableLmForCausalLM", **_DEC, num_key_value_heads=6, partial_rotary_factor=0.5,
                  hidden_dropout=0.0, **_NO_DROP)


def starcoder2():
    return _build("Starcoder2Config", "Starcoder2ForCausalLM", **_DEC, num_key_value_heads=3, residual_dropout=0.0,
                  embedding_dropout=0.0, **_NO_DROP)


def olmo():
    return _build("OlmoConfig", "OlmoForCausalLM", **_DEC, num_key_value_heads=6, pad_token_id=0)


def cohere():
    return _build("CohereConfig", "CohereForCausalLM", **_DEC, num_key_value_heads=6, use_qk_norm=False)


def gpt_bigcode():
    return _build("GPTBigCodeConfig", "GPTBigCodeForCausalLM", vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=6,
                  n_positions=64, multi_query=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def roberta():
    return _build("RobertaConfig", "RobertaModel", vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2,
                  num_attention_heads=6, intermediate_size=96, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, max_position_embeddings=64, pad_token_id=1)


def distilbert():
    return _build("DistilBertConfig", "DistilBertModel", vocab_size=VOCAB, dim=48, n_layers=2, n_heads=6,
                  hidden_dim=96, dropout=0.0, attention_dropout=0.0, max_position_embeddings=64)


def vit():
    return _build("ViTConfig", "ViTModel", hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                  intermediate_size=96, image_size=16, patch_size=4, num_channels=3, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)


def granite():
    return _build("GraniteConfig", "GraniteForCausalLM", **_DEC, num_key_value_heads=3, **_NO_DROP)


def phi():
    return _build("PhiConfig", "PhiForCausalLM", **_DEC, num_key_value_heads=6, partial_rotary_factor=0.5,
                  resid_pdrop=0.0, embd_pdrop=0.0, **_NO_DROP)


ZOO: dict[str, Callable[[], nn.Module]] = {
    "gemma": gemma, "gemma2": gemma2, "falcon": falcon, "gptj": gptj, "codegen": codegen, "bloom": bloom,
    "stablelm": stablelm, "starcoder2": starcoder2, "olmo": olmo, "cohere": cohere, "gpt_bigcode": gpt_bigcode,
    "roberta": roberta, "distilbert": distilbert, "vit": vit, "granite": granite, "phi": phi,
}


def example_inputs(name: str) -> dict[str, torch.Tensor]:
    """Keyword inputs for `ZOO[name]()`: token ids (batch 2, sequence 6), or 16x16 pixels for ViT."""
    g = torch.Generator().manual_seed(7)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g, dtype=torch.float64)}
    return {"input_ids": torch.randint(2, VOCAB, (2, 6), generator=g)}
