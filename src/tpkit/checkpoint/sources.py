"""Where each full tensor of a checkpoint lives: `{key: Entry}`, whatever wrote the files.

An `Entry` is a full tensor (shape, dtype) stored as boxes ("pieces") in safetensors files, each piece with its
offsets in the full tensor. A Hugging Face directory or a plain safetensors file has one piece per tensor (the
whole of it); a tpkit checkpoint has one piece per part a saving rank held. Loaders only ever ask "which
pieces overlap the region this rank needs", so every writer looks the same to them.
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch

from .errors import CheckpointError
from .safetensors_file import DTYPES, Header, read_header


@dataclasses.dataclass(frozen=True)
class Piece:
    """A box of the full tensor: stored as tensor `name` of file `path`, starting at `offsets`; `sha256` of its
    bytes when the writer recorded one (tpkit checkpoints). `within`: None when the box is the whole stored tensor
    (its elements in row-major order); else the box is the part of the stored tensor (of the same rank) starting
    there: one of the tensors transformers cuts a fused stored tensor into on load (`conversions.py`: q, k and v
    of a stored `query_key_value`)."""

    path: str
    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    sha256: str | None = None
    within: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Entry:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

    @property
    def is_whole(self) -> bool:
        """One piece that is the whole tensor and the whole of its stored tensor (a Hugging Face or plain file)."""
        return len(self.pieces) == 1 and self.pieces[0].shape == self.shape and not any(self.pieces[0].offsets) \
            and self.pieces[0].within is None


@dataclasses.dataclass
class Source:
    """A checkpoint opened for reading: its entries, the parsed headers, and its manifest (tpkit) or config."""

    root: str
    entries: dict[str, Entry]
    headers: dict[str, Header]
    manifest: dict | None = None
    config: dict | None = None


def whole_files(paths: list[str], root: str) -> Source:
    """Files of full tensors (Hugging Face shards, `safetensors.torch.save_file` output). Every header is
    parsed (and so checked) now."""
    headers = {p: read_header(p) for p in paths}
    entries: dict[str, Entry] = {}
    for p, h in headers.items():
        for name, info in h.tensors.items():
            if name in entries:
                raise CheckpointError(f"{p}: tensor {name!r} is also in {entries[name].pieces[0].path}")
            entries[name] = Entry(name, info.shape, info.dtype,
                                  (Piece(p, name, (0,) * len(info.shape), info.shape),))
    return Source(root, entries, headers)


def hf_files(directory: str) -> list[str]:
    """The safetensors files of a Hugging Face directory: the index's shards, or model.safetensors."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: corrupt index ({exc})") from None
        return [os.path.join(directory, n) for n in dict.fromkeys(weight_map.values())]
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not found:
        raise CheckpointError(f"{directory}: no model.safetensors, index or .safetensors files")
    return [os.path.join(directory, n) for n in found]


def manifest_source(directory: str, manifest: dict) -> Source:
    """A tpkit checkpoint version directory from its manifest (see `manifest.py`)."""
    headers: dict[str, Header] = {}
    for name in manifest.get("files", {}):
        headers[os.path.join(directory, name)] = read_header(os.path.join(directory, name))
    entries = {}
    for key, d in manifest["tensors"].items():
        pieces = []
        for p in d["pieces"]:
            path = os.path.join(directory, p["file"])
            info = headers[path].tensors.get(p["name"]) if path in headers else None
            if info is None:
                raise CheckpointError(f"{path}: tensor {p['name']!r} (of {key}) named by the manifest is not in the file")
            if info.dtype != DTYPES[d["dtype"]]:
                raise CheckpointError(f"{path}: tensor {p['name']!r} (of {key}) is {info.dtype}, the manifest says "
                                      f"{d['dtype']}")
            pieces.append(Piece(path, p["name"], tuple(p["offsets"]), info.shape, p.get("sha256")))
        entry = Entry(key, tuple(d["shape"]), DTYPES[d["dtype"]], tuple(pieces))
        for piece in entry.pieces:
            if len(piece.offsets) != len(entry.shape) or any(
                    o + s > f for o, s, f in zip(piece.offsets, piece.shape, entry.shape)):
                raise CheckpointError(f"{piece.path}: tensor {piece.name!r} at {list(piece.offsets)} lies outside "
                                      f"{key}'s shape {list(entry.shape)}")
        entries[key] = entry
    return Source(directory, entries, headers, manifest=manifest, config=manifest.get("config"))
