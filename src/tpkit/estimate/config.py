"""What an estimate is asked about, read into what the formulas need: a Hugging Face config (or a model that
carries one) becomes a `TransformerShape`; any other module is left to be measured (`resolve_target`).

Reading the shape from the config, never from the weights, is what lets a 70B model cost nothing to estimate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class TransformerShape:
    """What the estimates need to know about a transformer, read from its Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    gated_mlp: bool = True
    activation: str = "silu"
    norm: str = "rms"                 # "rms" (HF RMSNorm: fp32 upcast) or "layer"
    norm_bias: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tied_embeddings: bool = False
    position_embeddings: int = 0      # learned absolute positions (GPT-2, OPT, BERT)
    token_type_embeddings: int = 0    # BERT
    embedding_norm: bool = False      # BERT: LayerNorm after the embeddings
    final_norm: bool = True
    mlm_head: bool = False            # BERT: dense h*h + LayerNorm before the decoder, decoder bias
    packed_qkv: bool = False          # GPT-2: q, k, v in one layer (c_attn, h x 3h)
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    embedding_dropout: float = 0.0
    softmax_fp32: bool = False        # eager softmax computed in fp32 (Llama family, OPT)
    logits_fp32: bool = True          # the loss upcasts logits to fp32 (HF causal LM loss; not BERT's MLM)
    is_decoder: bool = True
    position_offset: int = 0          # OPT keeps 2 extra position rows


def config_value(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _gpt2_shape(config, kind: str) -> TransformerShape:
    h = config.n_embd
    return TransformerShape(
        kind, config.vocab_size, h, config.n_layer, config.n_head, config.n_head, h // config.n_head,
        config.n_inner or 4 * h, gated_mlp=False, activation=config.activation_function, norm="layer",
        norm_bias=True, qkv_bias=True, out_bias=True, mlp_bias=True, packed_qkv=True,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        position_embeddings=config.n_positions, attention_dropout=config.attn_pdrop,
        hidden_dropout=config.resid_pdrop, embedding_dropout=config.embd_pdrop)


def _opt_shape(config, kind: str) -> TransformerShape:
    h = config.hidden_size
    if config.word_embed_proj_dim != h or not config.do_layer_norm_before:
        raise ValueError(f"OPT config with word_embed_proj_dim={config.word_embed_proj_dim} != hidden_size={h} "
                         "or post-norm (OPT-350m) is not modelled by the estimate; use a model object")
    return TransformerShape(
        kind, config.vocab_size, h, config.num_hidden_layers, config.num_attention_heads,
        config.num_attention_heads, h // config.num_attention_heads, config.ffn_dim, gated_mlp=False,
        activation=config.activation_function, norm="layer", norm_bias=config.layer_norm_elementwise_affine,
        qkv_bias=config.enable_bias, out_bias=config.enable_bias, mlp_bias=config.enable_bias,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        position_embeddings=config.max_position_embeddings, position_offset=2,
        attention_dropout=config.attention_dropout, hidden_dropout=config.dropout, softmax_fp32=True,
        final_norm=not getattr(config, "_remove_final_layer_norm", False))


def _bert_shape(config, kind: str) -> TransformerShape:
    h = config.hidden_size
    return TransformerShape(
        kind, config.vocab_size, h, config.num_hidden_layers, config.num_attention_heads,
        config.num_attention_heads, h // config.num_attention_heads, config.intermediate_size,
        gated_mlp=False, activation=config.hidden_act, norm="layer", norm_bias=True, qkv_bias=True,
        out_bias=True, mlp_bias=True, tied_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        position_embeddings=config.max_position_embeddings, token_type_embeddings=config.type_vocab_size,
        embedding_norm=True, final_norm=False, mlm_head=True,
        attention_dropout=config.attention_probs_dropout_prob, hidden_dropout=config.hidden_dropout_prob,
        embedding_dropout=config.hidden_dropout_prob, is_decoder=False, logits_fp32=False)


def _llama_like_shape(config, kind: str) -> TransformerShape:
    """Llama-like decoders: Llama, Mistral, Qwen2, and any config with the same attribute names."""
    h = config_value(config, "hidden_size")
    heads = config_value(config, "num_attention_heads")
    f = config_value(config, "intermediate_size")
    if h is None or heads is None or f is None or config_value(config, "num_hidden_layers") is None:
        raise ValueError(f"config of model_type {kind!r} lacks hidden_size/num_attention_heads/"
                         "intermediate_size/num_hidden_layers; pass a model object instead")
    bias = bool(config_value(config, "attention_bias", default=False))
    return TransformerShape(
        kind, config.vocab_size, h, config.num_hidden_layers, heads, config_value(config, "num_key_value_heads",
                                                                          default=heads),
        config_value(config, "head_dim", default=h // heads), f, gated_mlp=True,
        activation=config_value(config, "hidden_act", default="silu"), norm="rms",
        qkv_bias=True if kind == "qwen2" else bias, out_bias=bias, mlp_bias=bool(config_value(config, "mlp_bias",
                                                                                   default=False)),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_dropout=float(config_value(config, "attention_dropout", default=0.0)), softmax_fp32=True)


# The families whose configs name things their own way; every other model_type is read as Llama-like.
_READERS = {"gpt2": _gpt2_shape, "opt": _opt_shape, "bert": _bert_shape}


def transformer_shape(config) -> TransformerShape:
    """Read a Hugging Face config (Llama, Mistral, Qwen2, GPT-2, OPT, BERT and Llama-like others)."""
    kind = getattr(config, "model_type", "")
    return _READERS.get(kind, _llama_like_shape)(config, kind)


def own_dtype(model_or_config) -> torch.dtype:
    """A model's floating parameter dtype; bfloat16 for a config (the usual training and serving dtype)."""
    if isinstance(model_or_config, nn.Module):
        for p in model_or_config.parameters():
            if p.is_floating_point():
                return p.dtype
    return torch.bfloat16


def attention_kind(config, attention: str | None) -> str:
    if attention is None:
        attention = getattr(config, "_attn_implementation", None) or "sdpa"
    return "eager" if attention == "eager" else "flash"


def resolve_target(model_or_config, caller: str) -> tuple[Any, "TransformerShape | None"]:
    """(HF config or None, its transformer shape or None) of what an estimate was asked about.

    A model or config whose shape tpkit models gets the formulas; any other nn.Module is measured (shape None);
    anything else is refused, naming `caller`.
    """
    is_module = isinstance(model_or_config, nn.Module)
    config = getattr(model_or_config, "config", None) if is_module else model_or_config
    shape = None
    if config is not None and hasattr(config, "model_type"):
        try:
            shape = transformer_shape(config)
        except ValueError:
            if not is_module:
                raise
    if shape is None and not is_module:
        raise TypeError(f"{caller} needs a Hugging Face config or an nn.Module, got {type(model_or_config).__name__}")
    return config, shape
