"""Which checkpoint tensor holds each model key: exact, or the way transformers names or rebuilds it.

A Hugging Face directory may store a key under a legacy name (`gamma` / `beta`), without (or with) the base
model's prefix, renamed (NeoX's `lm_head.weight` is stored as `embed_out.weight`), or split into pieces that
transformers fuses on load (Mixtral's experts, one tensor per expert, become one `gate_up_proj`). `from_pretrained`
and `load_sharded` of such a directory both read through `key_finder`.
"""
from __future__ import annotations

from torch import nn

from .conversions import transformers_keys
from .mesh import pipeline_of
from .sources import Source

_LEGACY = {"gamma": "weight", "beta": "bias"}


def key_finder(model: nn.Module, source: Source, notes: list[str] | None = None):
    """Model key -> checkpoint key: exact; legacy `gamma`/`beta`; with or without the base-model prefix (a
    bare `LlamaModel` checkpoint loads into `LlamaForCausalLM`); else as transformers renames or rebuilds it
    (`conversions.py`, which adds fused entries to `source`). transformers' table is built (~0.5 s: a
    thousand regexes) only when a key is not found otherwise, which a checkpoint saved by tpkit never needs.
    `notes` receives the conversions tpkit could not read. A pipeline stage's copy of a tied weight (the last
    stage's LM head) is read as the tensor it copies (a tied model's checkpoint stores it once)."""
    names = {}
    for k in source.entries:
        head, _, last = k.rpartition(".")
        if last in _LEGACY:
            names.setdefault(f"{head}.{_LEGACY[last]}" if head else _LEGACY[last], k)
    names.update({k: k for k in source.entries})
    prefix = getattr(model, "base_model_prefix", "") or ""
    renamed: dict[str, str] | None = None if source.manifest is None else {}
    pipe = pipeline_of(model)
    copies = pipe.aliases if pipe is not None else {}

    def find(key: str) -> str | None:
        nonlocal renamed
        if key in copies and key not in names:
            return find(copies[key])
        options = [key]
        if prefix:
            options += [key[len(prefix) + 1:]] if key.startswith(prefix + ".") else [f"{prefix}.{key}"]
        found = next((names[o] for o in options if o in names), None)
        if found is None and renamed is None:
            renamed, unread = transformers_keys(model, source)
            if notes is not None:
                notes.extend(unread)
        return found if found is not None else next((renamed[o] for o in options if o in renamed), None)

    return find
