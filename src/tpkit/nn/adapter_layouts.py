"""Which part of a PEFT LoRA adapter's tensors a rank holds: derived from its base layer's weight layout, so the
adapter's rows or columns are exactly the base's (whole heads, packed pieces, KV rows two ranks share).

`shard_layouts` reads these for the keys PEFT adds (`<layer>.base_layer.*`, `<layer>.lora_A.<adapter>.weight`,
`<layer>.lora_B.<adapter>.weight` / `.bias`), so checkpoints, `save_pretrained`'s gather and tests slice adapters
as they slice any tensor; on an embedding split along the vocabulary, `<layer>.lora_embedding_A.<adapter>` holds
the base's vocabulary rows as its columns and `lora_embedding_B` is whole. A module PEFT trains a copy of
(`modules_to_save`: `<module>.original_module.*` and `<module>.modules_to_save.<adapter>.*`) is split as the
original: both keys take the original's layout.
"""
from __future__ import annotations

import re

from ..layout import ShardLayout

_SAVED_KEY = re.compile(r"\.(original_module|modules_to_save\.[^.]+)\.")
_EMBEDDING_KEY = re.compile(r"^(?P<layer>.+)\.lora_embedding_(?P<factor>A|B)\.(?P<adapter>[^.]+)$")
_ADAPTER_KEY = re.compile(r"^(?P<layer>.+)\.(?P<factor>lora_A|lora_B)\.(?P<adapter>[^.]+)\.(?P<tensor>weight|bias)$")


def adapter_layout(key: str, known: dict[str, ShardLayout], shape: tuple[int, ...], world: int,
                   rank: int) -> ShardLayout | None:
    """The layout of a LoRA-wrapped layer's tensor under its PEFT key, from its base weight's layout (`known`,
    keyed as the unwrapped model): the base's own tensors under `.base_layer.`; on a column split (output rows)
    B's rows and bias as the base's rows, A whole; on a row split (input columns) A's columns as the base's, B
    whole. None for a key that is neither."""
    if ".base_layer." in key:
        return known.get(key.replace(".base_layer.", "."))
    if _SAVED_KEY.search(key):  # a module_to_save's original or trained copy: the original's layout
        return known.get(_SAVED_KEY.sub(".", key, count=1))
    embedding = _EMBEDDING_KEY.match(key)
    if embedding is not None:  # A [r, vocab]: the base's vocabulary rows as its columns; B whole
        base = known.get(embedding["layer"] + ".weight")
        if base is not None and base.dim == 0 and embedding["factor"] == "A":
            return ShardLayout((shape[0], base.full_shape[0]), base.world_size, base.rank, 1, base.pieces)
        return ShardLayout.replicated(shape, world, rank)
    match = _ADAPTER_KEY.match(key)
    if match is None:
        return None
    base = known.get(match["layer"] + ".weight")
    if base is None or base.dim is None:
        return ShardLayout.replicated(shape, world, rank)
    output_dim = 1 if base.transposed else 0  # the base's output features, as the original stores them
    column = base.dim == output_dim
    factor, tensor = match["factor"], match["tensor"]
    size = base.full_shape[base.dim]  # `shape` is this rank's: the split dim takes the base's full size
    if column and factor == "lora_B":
        return ShardLayout((size,) + tuple(shape[1:]), base.world_size, base.rank, 0, base.pieces)
    if not column and factor == "lora_A" and tensor == "weight":
        return ShardLayout((shape[0], size), base.world_size, base.rank, 1, base.pieces)
    return ShardLayout.replicated(shape, base.world_size, base.rank)
