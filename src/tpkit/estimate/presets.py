"""Built-in model shapes and the resolution of a CLI TARGET into (model or None, config).

The presets carry the published sizes of each checkpoint's `config.json` (Hugging Face hub), so
`tpkit analyze llama-2-70b` or `tpkit estimate llama-3-8b` work offline, with no weights: the model is built
on the meta device, which allocates nothing and takes well under a second even for 70B parameters.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

import torch

from ..convert.transformers_threads import building, transformers_name

_LLAMA2 = dict(model_type="llama", vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
               hidden_act="silu", tie_word_embeddings=False)
_LLAMA3 = dict(model_type="llama", vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=500000.0, hidden_act="silu", tie_word_embeddings=False)

PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": dict(_LLAMA2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32),
    "llama-2-13b": dict(_LLAMA2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40),
    "llama-2-70b": dict(_LLAMA2, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8),
    "llama-3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768, sliding_window=4096, rms_norm_eps=1e-5,
                       hidden_act="silu", tie_word_embeddings=False),
    "qwen2-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     hidden_act="silu", tie_word_embeddings=False),
    "gpt2": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
    "gpt2-medium": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25),
    "opt-1.3b": dict(model_type="opt", vocab_size=50272, hidden_size=2048, ffn_dim=8192, num_hidden_layers=24,
                     num_attention_heads=32, max_position_embeddings=2048, word_embed_proj_dim=2048,
                     do_layer_norm_before=True),
    "bert-base": dict(model_type="bert", vocab_size=30522, hidden_size=768, intermediate_size=3072,
                      num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=512,
                      type_vocab_size=2),
    "bert-large": dict(model_type="bert", vocab_size=30522, hidden_size=1024, intermediate_size=4096,
                       num_hidden_layers=24, num_attention_heads=16, max_position_embeddings=512,
                       type_vocab_size=2),
}

# Published parameter counts (as printed by the model cards), kept for the tests and the CLI's sanity line.
PUBLISHED_PARAMETERS = {"llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248, "gpt2": 124_439_808,
                        "gpt2-xl": 1_557_611_200, "mistral-7b": 7_241_732_096}


def preset_config(name: str):
    """The Hugging Face config object of a built-in preset."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; built-in presets are {', '.join(sorted(PRESETS))}")
    kwargs = dict(PRESETS[key])
    return transformers_name("AutoConfig").for_model(kwargs.pop("model_type"), **kwargs)


def _auto_class(config):
    """The auto class that gives the model its usual head: masked LM for encoders, causal LM otherwise."""
    if getattr(config, "model_type", None) in {"bert", "roberta", "distilbert", "albert", "electra"}:
        return transformers_name("AutoModelForMaskedLM")
    return transformers_name("AutoModelForCausalLM")


def build_model(config, device: str | torch.device = "meta", dtype: torch.dtype | None = None):
    """Build the Hugging Face model of `config` with no weights on `device` (meta by default: instant).

    Why meta: analysis and estimates need shapes and module types only, and a 70B model would not fit
    in host memory. Load weights later with `tpkit.load_sharded` after `parallelize`.
    """
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"build_model: dtype must be a floating dtype (the model is built with it as torch's "
                         f"default), got {dtype}; build in a floating dtype and convert afterwards")
    auto = _auto_class(config)
    # `building`: torch's default dtype is process-wide and transformers sets it during the build anyway, so
    # builds of thread-ranks go one at a time (see convert/transformers_threads.py).
    with building(dtype), torch.device(device):
        return auto.from_config(config)


def load_target(target: str, device: str | torch.device = "meta", build: bool = True):
    """Resolve a CLI TARGET to `(model or None, config)`.

    TARGET may be a preset name (`llama-2-7b`), a `config.json` path or a model directory (read with
    `AutoConfig.from_pretrained` on the local path; no download), or `package.module:factory`, whose
    factory is imported and called with no arguments and may return a model or a config. With `build`,
    Hugging Face configs are built into a weightless model on `device`.
    """
    config = None
    model = None
    if target.lower() in PRESETS:
        config = preset_config(target)
    elif os.path.exists(target):
        config = _config_from_path(target)
    elif ":" in target:
        module_name, _, attr = target.partition(":")
        # The `tpkit` console script runs with its own bin directory, not the working directory, on sys.path;
        # `mymodels:build` should find ./mymodels.py as `python -m tpkit` would (uvicorn does the same).
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot import {attr!r} from module {module_name!r} (target {target!r}): {exc}")
        made = factory() if callable(factory) and not isinstance(factory, torch.nn.Module) else factory
        if isinstance(made, torch.nn.Module):
            return made, getattr(made, "config", None)
        config = made
    else:
        raise ValueError(f"target {target!r} is not a preset ({', '.join(sorted(PRESETS))}), "
                         "an existing config.json or model directory, nor a 'module:factory' path")
    if build and hasattr(config, "model_type"):
        model = build_model(config, device=device)
    return model, config


def _config_from_path(path: str):
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(f"directory {path!r} has no config.json; pass a model directory or a config file")
        return transformers_name("AutoConfig").from_pretrained(path, local_files_only=True)
    with open(path) as f:
        raw = json.load(f)
    if "model_type" not in raw:
        raise ValueError(f"{path!r} has no 'model_type'; it does not look like a Hugging Face config.json")
    kwargs = dict(raw)
    return transformers_name("AutoConfig").for_model(kwargs.pop("model_type"), **kwargs)
