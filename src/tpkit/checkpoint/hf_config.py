"""A model's `config.json` and `generation_config.json` as transformers writes them, kept through a tpkit checkpoint.

`save_pretrained` writes each config as its difference from the defaults (`to_json_string(use_diff=True)`:
sorted keys, two-space indent, a final newline). The manifest keeps exactly that dict, and `consolidate` writes
it back the same way, so a model loaded from a Hugging Face directory comes out of save -> consolidate with the
same two files, byte for byte (the defaults transformers fills in on load are not written out as if they had
been chosen). Without transformers' objects (a custom model) there is nothing to keep.
"""
from __future__ import annotations

import json
import os

from ..convert.transformers_threads import transformers_name

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"


def config_dict(model) -> dict | None:
    """The model's config as `save_pretrained` writes it, or None: its `dtype` is the dtype the weights are in (the
    first floating parameter's, transformers' `model.dtype`), so the directory `consolidate` writes loads in the dtype
    it was saved in whatever the config said before (a model cast after loading)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_json_string"):
        return None
    d = json.loads(config.to_json_string(use_diff=True))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        d["dtype"] = str(dtype).removeprefix("torch.")
    return d


def generation_dict(model) -> dict | None:
    """The model's generation config as `save_pretrained` writes it (models that generate), or None."""
    generation = getattr(model, "generation_config", None)
    can = getattr(model, "can_generate", None)
    if generation is None or not hasattr(generation, "to_json_string") or (callable(can) and not can()):
        return None
    return json.loads(generation.to_json_string(use_diff=True))


_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decoded_floats(obj):
    """`obj` (a config read from JSON) with the floats JSON cannot hold decoded: transformers 5 writes `inf` as
    `{"__float__": "Infinity"}` (Falcon-H1's and Nemotron-H's `time_step_limit`) and decodes it on load, as
    `from_pretrained` must too (those config classes refuse the dict). Older files hold a bare `Infinity`, which
    `json` reads as the float already."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in _FLOATS:
            return _FLOATS[obj["__float__"]]
        return {k: decoded_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decoded_floats(v) for v in obj]
    return obj


def text(d: dict) -> str:
    """`d` as transformers serialises a config."""
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def load_generation_config(path: str, manifest: dict | None):
    """The generation config a Hugging Face directory (`generation_config.json`) or a tpkit checkpoint (its manifest)
    holds, as a transformers `GenerationConfig`; None when there is none."""
    generation_config = transformers_name("GenerationConfig")
    if manifest is not None:
        saved = manifest.get("generation_config")
        return generation_config.from_dict(saved) if saved else None
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, GENERATION_CONFIG)):
        return generation_config.from_pretrained(path)
    return None
