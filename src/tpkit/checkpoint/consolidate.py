"""`consolidate`: a tpkit checkpoint (any world size) back into a Hugging Face directory.

One process, one full tensor in memory at a time: the output header is known from the manifest alone, so each
tensor is assembled from its pieces (the same reader the loaders use, with a world-size-1 layout) and
streamed into the file in order. Tied keys (saved as aliases) are written once, as `save_pretrained` does;
above `max_shard_bytes` the output is split into shards with a `model.safetensors.index.json`. `config.json` and
`generation_config.json` are written as the model held them (`hf_config.py`: transformers' own form), and the
tokenizer files beside them (`tokenizer.py`): by default those of the directory the model was loaded from.

The output is always one complete model: a non-empty `out_dir` is refused (writing beside an existing index and
shards would leave transformers and tpkit loading different weights from one directory) unless
`overwrite=True`, which replaces a directory holding a model's files alone (a folder or any other file in it, a
Trainer's `checkpoint-N` say, is refused, never deleted); either way the files are written into a temporary
sibling directory, which then takes `out_dir`'s place (an atomic exchange where the system has one,
`renameat2(RENAME_EXCHANGE)`), so a run killed midway leaves the old directory as it was.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import uuid

import torch

from ..layout import ShardLayout
from .errors import CheckpointError
from .hf_config import CONFIG, GENERATION_CONFIG, text
from .load import open_source
from .manifest import fsync_dir
from .optimizer import PREFIX
from .progress import Progress
from .reader import read_region
from .safetensors_file import write_stream
from .tokenizer import copy_tokenizer, recorded_tokenizer, require_tokenizer


def consolidate(directory: str | os.PathLike, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 2**30,
                progress: bool | None = None, overwrite: bool = False,
                tokenizer: str | os.PathLike | None = "auto") -> str:
    """Write `out_dir/config.json`, `generation_config.json` (models that generate) and `model.safetensors` (or
    shards + index), with the tokenizer files beside them; returns `out_dir`. A non-empty `out_dir` is refused
    unless `overwrite=True`, which replaces it as a whole (refused when it holds anything but a model's files).
    `tokenizer`: "auto" copies those of the model directory
    the checkpoint records (none when it records none, or that directory has none: `tokenizer.recorded_tokenizer`
    says why); a directory copies its tokenizer files (CheckpointError, before anything is written, if it has
    none); None copies none."""
    directory, out_dir = os.fspath(directory), os.path.normpath(os.fspath(out_dir))
    source = open_source(directory)
    if source.manifest is None:
        raise CheckpointError(f"{directory}: not a tpkit checkpoint (no manifest)")
    _check_out_dir(directory, out_dir, overwrite)
    if isinstance(tokenizer, str) and tokenizer == "auto":
        tokenizer = recorded_tokenizer(source.manifest)[0]
    if tokenizer is not None:
        require_tokenizer(tokenizer)  # before anything is written
    tmp = f"{out_dir}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        _write(source, tmp, max_shard_bytes, progress)
        if tokenizer is not None:
            copy_tokenizer(tokenizer, tmp)
        _swap_in(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the new files on failure; the old directory after a swap
    return out_dir


def _check_out_dir(directory: str, out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"{out_dir}: exists and is not a directory; choose a directory to write the model into")
    real, source = os.path.realpath(out_dir), os.path.realpath(directory)
    if source == real or source.startswith(real + os.sep):
        raise CheckpointError(f"{out_dir}: holds the checkpoint {directory} being consolidated; choose another "
                              f"output directory")
    entries = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    foreign = [e for e in entries if not _model_file(out_dir, e)]
    if overwrite and foreign:
        raise CheckpointError(f"{out_dir}: holds {', '.join(foreign[:4])}{', ...' if len(foreign) > 4 else ''} besides "
                              f"a model's files; overwrite=True replaces the whole directory and would delete them "
                              f"(a Trainer's output_dir holds its checkpoint-N folders): choose another directory")
    if entries and not overwrite:
        raise CheckpointError(f"{out_dir}: not empty ({len(entries)} entries: {', '.join(entries[:4])}"
                              f"{', ...' if len(entries) > 4 else ''}); consolidate writes a whole model "
                              f"directory: choose a new or empty one, or replace this one with overwrite=True "
                              f"(tpkit consolidate --overwrite)")


#: Names a model directory holds (what consolidate, save_pretrained and a tokenizer write): overwrite=True replaces
#: a directory holding these alone.
MODEL_FILE_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja", ".tiktoken", ".md")


def _model_file(out_dir: str, name: str) -> bool:
    return os.path.isfile(os.path.join(out_dir, name)) and name.endswith(MODEL_FILE_SUFFIXES) and \
        not name.startswith(".")


def _write(source, out_dir: str, max_shard_bytes: int, progress: bool | None) -> None:
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
    files = {}
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, g in zip(names, shards) for k in g}}
        files["model.safetensors.index.json"] = json.dumps(index, indent=1)
    if source.config is not None:
        files[CONFIG] = text(source.config)
    if source.manifest.get("generation_config"):
        files[GENERATION_CONFIG] = text(source.manifest["generation_config"])
    for name, body in files.items():
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(out_dir)


def _swap_in(new: str, out_dir: str) -> None:
    """Put directory `new` at `out_dir`. Absent or empty `out_dir`: a rename. Otherwise the two are exchanged
    atomically (Linux `renameat2(RENAME_EXCHANGE)`) or, where that is missing, by two renames; `new` then holds the
    old directory, which the caller removes."""
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        os.replace(new, out_dir)
    elif not _exchange(new, out_dir):
        old = f"{out_dir}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out_dir, old)
        os.replace(new, out_dir)
        os.replace(old, new)
    fsync_dir(os.path.dirname(os.path.abspath(out_dir)))


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    return False
