"""The zoo sweep's models (issue 24): every transformers class for causal LM, masked LM, seq2seq LM, sequence and
image classification, each built from its own config class shrunk GENERICALLY.

No config is written per architecture: `shrink` walks the default config's attributes and sets each by its role,
found from its name (through the config's own `attribute_map`, so GPT-2's `n_embd` is a hidden size): hidden 96,
12 heads of 8, 6 KV heads, 2 layers, MLP 192, 4 experts (2 per token), vocabulary 211 (odd), 64 positions,
32-pixel images in patches of at most 4, no dropout. Nested configs (`text_config`, `vision_config`, ...) are shrunk the same way; lists
as long as the layer count are cut to it. `build` makes the model in float64 with eager attention from a fixed
seed; `inputs` gives its keyword inputs from its main input name.
"""
from __future__ import annotations

import re
import threading
from typing import Any

import torch

TASKS = {"causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
         "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
         "sequence": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
         "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"}
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, MLP, EXPERTS = 211, 96, 12, 6, 8, 2, 192, 4
MAX_PARAMS = 12_000_000
SEQ, BATCH, IMAGE = 8, 2, 32
_LOCK = threading.Lock()

# role -> names a config may use for it (after its attribute_map); values are what the sweep sets
_ROLES: dict[str, tuple[tuple[str, ...], Any]] = {
    "hidden": (("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "dim", "model_dim", "hidden_dim",
                "d_embed", "word_embed_proj_dim", "embedding_dim"), HIDDEN),
    "heads": (("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
               "decoder_attention_heads", "attention_heads"), HEADS),
    "kv": (("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "n_head_kv",
            "num_key_value_groups_heads"), KV_HEADS),
    "head_dim": (("head_dim", "d_kv", "attention_head_size", "kv_channels", "v_head_dim", "head_size"), HEAD_DIM),
    "layers": (("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
                "num_decoder_layers", "num_encoder_layers", "depth", "num_blocks"), LAYERS),
    "mlp": (("intermediate_size", "ffn_dim", "n_inner", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim",
             "ffn_hidden_size", "mlp_dim", "inner_hidden_size", "feed_forward_size", "hidden_dim_ffn",
             "intermediate_dim"), MLP),
    "moe_mlp": (("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                 "moe_ffn_hidden_size"), MLP // 2),
    "experts": (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"),
                EXPERTS),
    "topk": (("num_experts_per_tok", "top_k", "moe_top_k", "num_selected_experts", "moe_k"), 2),
    "vocab": (("vocab_size",), VOCAB),
    "positions": (("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "max_sequence_length",
                   "seq_length", "max_len"), 64),
    "image": (("image_size", "img_size", "input_size"), IMAGE),
    "embedding": (("embedding_size", "embed_size", "projection_dim"), 48),
    "rotary": (("rotary_dim", "rotary_emb_base_dim", "qk_rope_head_dim", "qk_nope_head_dim"), 4),
    "lora": (("kv_lora_rank", "q_lora_rank"), 24),
    "first_k_dense": (("first_k_dense_replace",), 1),
    "patch": (("patch_size",), 4),
    "expert_groups": (("n_group", "topk_group", "num_expert_group", "topk_groups"), 1),
}
_BY_NAME = {name: role for role, (names, _) in _ROLES.items() for name in names}


def classes() -> list[tuple[str, str, str]]:
    """`(task, model_type, class name)` for every class the five auto mappings name, in a fixed order."""
    from transformers.models.auto import modeling_auto

    out = []
    for task, mapping in TASKS.items():
        for model_type, names in getattr(modeling_auto, mapping).items():
            for cls in names if isinstance(names, (list, tuple)) else (names,):
                out.append((task, model_type, cls))
    return sorted(set(out), key=lambda r: (r[1], r[2]))


def _role(config_cls, name: str) -> str | None:
    inverse = {v: k for k, v in getattr(config_cls, "attribute_map", {}).items()}
    return _BY_NAME.get(inverse.get(name, name)) or _BY_NAME.get(name)


def _value(role: str, old: Any) -> Any:
    new = _ROLES[role][1]
    if isinstance(old, bool) or old is None:
        return old
    if isinstance(old, int):
        return min(old, new) if role in ("topk", "first_k_dense", "patch") else new
    if isinstance(old, list) and old and all(isinstance(v, int) and not isinstance(v, bool) for v in old):
        return [new] * len(old) if role != "layers" else [1] * len(old)
    return old


def shrunk(config_cls, values: dict) -> dict:
    """Keyword overrides for `config_cls` from its default `values` (a `to_dict()`)."""
    out: dict[str, Any] = {}
    layers = next((values[k] for k in values if _role(config_cls, k) == "layers" and isinstance(values[k], int)),
                  None)
    for k, v in values.items():
        role = _role(config_cls, k)
        if role is not None:
            new = _value(role, v)
            if new != v:
                out[k] = new
        elif isinstance(v, float) and re.search(r"drop|pdrop", k) and v > 0:
            out[k] = 0.0
        elif isinstance(v, int) and not isinstance(v, bool) and k.endswith("token_id") and v >= VOCAB:
            out[k] = 2
        elif isinstance(v, dict) and k.endswith("config") and "model_type" in v:
            out[k] = _shrunk_nested(v)
        elif isinstance(v, list) and layers and len(v) == layers and layers > LAYERS:
            out[k] = v[:LAYERS]
        elif isinstance(v, list) and re.search(r"hidden_sizes|embed_dims|dims$|widths|channels", k) and v and \
                all(isinstance(x, int) for x in v):
            out[k] = [24 * (i + 1) for i in range(len(v))]
        elif isinstance(v, list) and re.search(r"depths$", k) and v and all(isinstance(x, int) for x in v):
            out[k] = [1] * len(v)
    if values.get("pad_token_id") is None and "pad_token_id" in values:
        out["pad_token_id"] = 0
    return out


def _shrunk_nested(values: dict) -> dict:
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[values["model_type"]]
    return {**values, **shrunk(cls, values)}


def config_for(model_type: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    config = cls(**shrunk(cls, cls().to_dict()))
    for c in [config] + [getattr(config, k) for k in vars(config) if k.endswith("config")]:
        if hasattr(c, "_attn_implementation"):
            try:
                c._attn_implementation = "eager"
            except Exception:  # noqa: BLE001 - configs that refuse eager keep their own
                pass
        if hasattr(c, "_experts_implementation"):
            c._experts_implementation = "eager"  # grouped_mm takes no float64
        if hasattr(c, "use_cache"):
            c.use_cache = False
    return config


def build(model_type: str, cls_name: str) -> torch.nn.Module:
    """The shrunk model, float64, eval, weights from a fixed seed; raises with the reason when it cannot."""
    import transformers

    cls = getattr(transformers, cls_name)
    config = config_for(model_type)
    with torch.device("meta"):
        n = sum(p.numel() for p in cls(config).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{n / 1e6:.0f}M parameters after the generic shrink (limit {MAX_PARAMS / 1e6:.0f}M)")
    with _LOCK:
        torch.manual_seed(1234)
        model = cls(config)
    return model.double().eval()


def inputs(model: torch.nn.Module, task: str) -> dict:
    """Keyword inputs from the model's main input name (token ids in [3, vocab), or pixels)."""
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    main = getattr(model, "main_input_name", "input_ids")
    if main == "pixel_values":
        size = getattr(cfg, "image_size", IMAGE)
        size = size if isinstance(size, int) else size[0]
        return {"pixel_values": torch.randn(BATCH, getattr(cfg, "num_channels", 3), size, size, generator=g,
                                            dtype=torch.float64)}
    if main != "input_ids":
        raise ValueError(f"main input {main!r}: the sweep makes token ids and pixels only")
    vocab = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", VOCAB)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    eos = getattr(cfg, "eos_token_id", None)
    if task == "sequence" and isinstance(eos, int) and 0 <= eos < vocab:
        ids[ids == eos] = 3 if eos != 3 else 4
        ids[:, -1] = eos  # one end-of-sequence token per row (BART-style heads read the hidden state there)
    out = {"input_ids": ids}
    if task == "seq2seq":
        out["decoder_input_ids"] = torch.randint(3, vocab, (BATCH, SEQ // 2), generator=g)
    elif getattr(cfg, "is_encoder_decoder", False):  # a classifier over an encoder-decoder: the same tokens
        out["decoder_input_ids"] = ids.clone()
    return out
