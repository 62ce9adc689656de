"""`consolidate`: a tpkit checkpoint (any world size) back into a Hugging Face directory.

One process, one full tensor in memory at a time: the output header is known from the manifest alone, so each
tensor is assembled from its pieces (the same reader the loaders use, with a world-size-1 layout) and
streamed into the file in order. Tied keys (saved as aliases) are written once, as `save_pretrained` does;
above `max_shard_bytes` the output is split into shards with a `model.safetensors.index.json`.
"""
from __future__ import annotations

import json
import os

import torch

from ..layout import ShardLayout
from .errors import CheckpointError
from .load import open_source
from .optimizer import PREFIX
from .progress import Progress
from .reader import read_region
from .safetensors_file import write_stream


def consolidate(directory: str | os.PathLike, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 2**30,
                progress: bool | None = None) -> str:
    """Write `out_dir/config.json` and `model.safetensors` (or shards + index); returns `out_dir`."""
    source = open_source(os.fspath(directory))
    if source.manifest is None:
        raise CheckpointError(f"{directory}: not a tpkit checkpoint (no manifest)")
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    keys = [k for k, d in source.manifest["tensors"].items() if not k.startswith(PREFIX) and "alias_of" not in d]
    shards, size = [[]], 0
    for k in keys:
        e = source.entries[k]
        n = e.dtype.itemsize * int(torch.Size(e.shape).numel())
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = sum(source.entries[k].dtype.itemsize * int(torch.Size(source.entries[k].shape).numel()) for k in keys)

    def full(key: str) -> torch.Tensor:
        e = source.entries[key]
        return read_region(e, ShardLayout.replicated(e.shape, 1, 0), source.headers, torch.empty(e.shape, dtype=e.dtype))

    with Progress("consolidating", total, progress) as bar:
        for name, group in zip(names, shards):
            specs = [(k, source.entries[k].dtype, source.entries[k].shape) for k in group]
            write_stream(os.path.join(out_dir, name), specs, full, {"format": "pt"}, bar.advance)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, g in zip(names, shards) for k in g}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=1)
    if source.config is not None:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(source.config, f, indent=1)
    return out_dir
