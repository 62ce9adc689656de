"""A model directory's tokenizer files, copied beside consolidated weights.

A tpkit checkpoint holds weights and configs, never the tokenizer; `consolidate` copies the tokenizer files of a
model directory into its output so the result loads with `AutoTokenizer` as the original did: by default the
directory the checkpoint's model was loaded from, which `save_sharded` records in the manifest (`name_or_path`,
what `from_pretrained` sets as transformers does), followed through a tpkit checkpoint that was itself the source.
The files are copied byte for byte (not re-saved through `AutoTokenizer`): exactly the user's, no transformers
needed, nothing unpickled. `examples/finetune.py --consolidate` and `tpkit consolidate` both go through here.
"""
from __future__ import annotations

import json
import os
import shutil

from .errors import CheckpointError
from .manifest import MANIFEST, find_version

# What transformers' tokenizers read and write (tokenization_utils_base: tokenizer.json, tokenizer_config.json,
# special_tokens_map.json, added_tokens.json, chat_template.jinja / .json, the additional_chat_templates/ folder)
# and the vocabulary files of the slow tokenizers (sentencepiece models, BPE vocab + merges, WordPiece vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.json", "merges.txt", "vocab.txt")
TEMPLATE_DIR = "additional_chat_templates"
_HOPS = 8  # a checkpoint loaded from a checkpoint loaded from ...: how far the recorded source is followed


def tokenizer_files(directory: str | os.PathLike) -> list[str]:
    """The tokenizer files `directory` holds (paths relative to it), empty when it holds none or is not a
    directory."""
    directory = os.fspath(directory)
    found = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]
    templates = os.path.join(directory, TEMPLATE_DIR)
    if os.path.isdir(templates):
        found += sorted(f"{TEMPLATE_DIR}/{n}" for n in os.listdir(templates)
                        if n.endswith(".jinja") and os.path.isfile(os.path.join(templates, n)))
    return found


def model_source(model) -> str | None:
    """Where `model` was loaded from (`name_or_path`, as `from_pretrained` and transformers set it), absolute when it
    is a local directory (a checkpoint is consolidated from anywhere); None when it was not loaded from a path."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        return None
    return os.path.abspath(name) if os.path.isdir(name) else str(name)


def recorded_tokenizer(manifest: dict) -> tuple[str | None, str]:
    """(the directory whose tokenizer files a checkpoint's model came with, or None; what was found, in words),
    following the recorded source through tpkit checkpoints that were themselves loaded from a directory."""
    source = manifest.get("name_or_path")
    if not source:
        return None, ("the checkpoint records no model directory (its model was not loaded from one, or it was saved "
                      "before tpkit recorded it)")
    for _ in range(_HOPS):
        if not os.path.isdir(source):
            return None, f"the model directory the checkpoint records, {source}, is not a directory here"
        if tokenizer_files(source):
            return source, f"from {source}, the model directory the checkpoint records"
        further = _recorded_source(source)
        if not further:
            break
        source = further
    return None, f"no tokenizer files in {source}, the model directory the checkpoint records"


def _recorded_source(directory: str) -> str | None:
    """The model directory a tpkit checkpoint at `directory` records, or None (not a checkpoint, or none recorded)."""
    try:
        version = find_version(directory)
    except CheckpointError:
        return None
    if version is None:
        return None
    with open(os.path.join(version, MANIFEST)) as f:
        return json.load(f).get("name_or_path")


def require_tokenizer(source: str | os.PathLike) -> list[str]:
    """`tokenizer_files(source)`; CheckpointError naming `source` and the way out when there are none."""
    names = tokenizer_files(source)
    if not names:
        raise CheckpointError(f"{os.fspath(source)}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); "
                              f"name the model directory the tokenizer is in, or copy none (tokenizer=None, CLI: "
                              f"--no-tokenizer)")
    return names


def copy_tokenizer(source: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """Copy `source`'s tokenizer files into `out_dir` (each fsynced), byte for byte; returns their names."""
    source, out_dir = os.fspath(source), os.fspath(out_dir)
    names = require_tokenizer(source)
    for name in names:
        target = os.path.join(out_dir, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(source, name), target)
        with open(target, "rb+") as f:
            os.fsync(f.fileno())
    return names
