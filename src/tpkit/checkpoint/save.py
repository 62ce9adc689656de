"""`save_sharded`: every rank writes the parts of the full tensors it holds; the layout on disk does not depend
on the TP size.

For each tensor, rank r writes the positions of its segments that no lower rank holds (so a replicated
tensor, or a KV head several ranks share, is written once: by the first holder), each as one piece with its
offsets in the full tensor. Every rank can work out every other rank's pieces from the layouts
(`layout.for_rank`), so rank 0 writes the whole manifest after gathering only the pieces' sha256 and RNG
states, then moves `latest`: a save killed before that leaves the previous one in place. A failure on any rank
(a full disk) is agreed on by all (`agree`), the partial version removed and the same CheckpointError raised
everywhere; a rank that dies leaves its peers a CommError and the partial version to the next save's `prune`.
Fault points (`tpkit.faults`: save-start, write, save-files, save-latest) let tests kill or fail a save at
each of these moments in real processes. A
model under `tpkit.data_parallel` is saved with the world communicator: its TP layouts are spread over the
world ranks (`mesh.py`), so dp replicas are written once and the files look like any TP checkpoint's. One stage
of a pipeline (`tpkit.pipeline`) writes its own keys under their full-model names; its ranks know only those, so
the manifest's entries (and optimizer section) are gathered from every stage, a weight tied across the first and
last stage is written once (the last stage's key an alias, as a tied model's state dict has it), and the plan is
the whole model's: the directory is the ordinary checkpoint, whatever the pp x tp x dp it was saved at.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Callable

import torch
from torch import nn

from .. import faults
from ..convert.layouts import shard_layouts
from ..nn._layer import resolve_comm
from ..layout import ShardLayout
from ..nn.random import get_rng_tracker
from . import optimizer as optim_state
from .agree import agree, gather_bytes
from .errors import CheckpointError
from .hf_config import config_dict, generation_dict
from .mesh import pipeline_of, rng_comm, spread, spread_over, unwrap, whole_local, writer
from .manifest import (FORMAT, LATEST, MANIFEST, fsync_dir, next_version, point_latest, prune, rank_file, read_latest,
                       remove_version, write_json)
from .progress import Progress
from .safetensors_file import NAMES, write_file
from .tokenizer import model_source

# Called with the bytes written so far while a rank writes its file (tests kill a save halfway with it).
WRITE_HOOK: Callable[[int], None] | None = None


def owned_spans(layout: ShardLayout, rank: int, writer: int = 0) -> list[tuple[int, int, int]]:
    """`(start, stop, position in the rank's local tensor)` along `dim` of what `rank` writes: its segments
    minus what lower ranks hold. A replicated tensor: rank `writer` (0; a pipeline stage's first rank) writes
    `(0, size, 0)`."""
    if layout.dim is None or layout.is_replicated:
        return [(0, layout.full_shape[layout.dim] if layout.dim is not None else 0, 0)] if rank == writer else []
    lower = sorted(s for r in range(rank) for s in layout.segments(r))
    out, at = [], 0
    for a, b in layout.segments(rank):
        x = a
        for s, e in lower + [(b, b)]:
            if e <= x:
                continue
            if s > x:
                out.append((x, min(s, b), at + x - a))
            x = max(x, e)
            if x >= b:
                break
        at += b - a
    return out


def rank_pieces(key: str, layout: ShardLayout, rank: int, writer: int = 0) -> list[dict]:
    """The manifest pieces `rank` writes for `key` (tensor names in its file, offsets in the full tensor)."""
    out = []
    for i, (a, b, _) in enumerate(owned_spans(layout, rank, writer)):
        offsets = [0] * len(layout.full_shape)
        if layout.dim is not None and not layout.is_replicated:
            offsets[layout.dim] = a
        out.append({"file": rank_file(rank), "name": key if i == 0 else f"{key}#{i}", "offsets": offsets})
    return out


def local_pieces(key: str, tensor: torch.Tensor, layout: ShardLayout, writer: int = 0) -> dict[str, torch.Tensor]:
    """This rank's pieces of `key` as tensors in the stored orientation, named as in `rank_pieces`."""
    stored = tensor.detach().t() if layout.transposed else tensor.detach()
    out = {}
    for i, (a, b, at) in enumerate(owned_spans(layout, layout.rank, writer)):
        whole = layout.dim is None or layout.is_replicated
        out[key if i == 0 else f"{key}#{i}"] = stored if whole else stored.narrow(layout.dim, at, b - a)
    return out


def collect(model: nn.Module, optimizer, copies: dict[str, str] | None = None) -> tuple[
        dict[str, tuple[torch.Tensor, ShardLayout]], dict, dict]:
    """`({key: (tensor, layout)}, {alias key: key} for tied keys, optimizer manifest section)`. `copies`: keys
    holding a copy of another key's tensor (a pipeline's tied weight on its last stage), saved as aliases."""
    layouts = shard_layouts(model)
    tensors, aliases, seen = {}, dict(copies or {}), {}
    for key, t in model.state_dict(keep_vars=True).items():
        if key in aliases:
            continue
        if id(t) in seen:
            aliases[key] = seen[id(t)]
            continue
        seen[id(t)] = key
        tensors[key] = (t, layouts[key])
    section = {}
    if optimizer is not None:
        extra, section = optim_state.state_tensors(model, optimizer, layouts, skip=set(copies or ()))
        tensors.update(extra)
    return tensors, aliases, section


def save_sharded(model: nn.Module, directory: str, optimizer=None, step: int | None = None, comm=None,
                 extra: dict | None = None, progress: bool | None = None, keep: int | None = None) -> str:
    """Save `model` (and `optimizer`) under `directory` as a new version; collective. Returns the version
    directory. `extra` must be JSON-serialisable.

    `keep=N` keeps the newest N complete versions (the new one included) and removes older ones; with or without
    it, versions a killed save left without a manifest, older than the new one, are removed. A save that fails
    on any rank (a full disk, ...) raises `CheckpointError` on every rank naming the file, after the partial
    version is removed: `latest` still names the previous one."""
    comm = resolve_comm(comm)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"save_sharded: keep must be a positive int (versions to keep) or None, got {keep!r}")
    model, record = unwrap(model, comm)
    pipe = pipeline_of(model)
    tensors, aliases, section = collect(model, optimizer, pipe.aliases if pipe is not None else None)
    tp_size = spread_over(model, record, pipe)
    if tp_size is not None:  # FSDP2 shards gathered to TP-local tensors (collective, same order on every rank),
        # layouts spread over the world (a pipeline stage's over its own ranks)
        group = pipe.stage_size if pipe is not None else None
        tensors = {k: (whole_local(t), spread(lay, tp_size, comm.world_size, comm.rank, group))
                   for k, (t, lay) in tensors.items()}
    first = writer(comm.rank, pipe.stage_size if pipe is not None else None)  # of whole tensors
    json.dumps(extra)  # fail before writing anything
    version = _agree_version(comm, directory, step)
    name, rank = os.path.basename(version), comm.rank
    faults.at("save-start", rank, step)
    path = os.path.join(version, rank_file(rank))
    error, digest = None, {}
    try:
        os.makedirs(version, exist_ok=True)
        mine = {}
        for key, (t, lay) in tensors.items():
            mine.update(local_pieces(key, t, lay, first))
        total = sum(v.numel() * v.element_size() for v in mine.values())
        with Progress(f"saving {name}", total, progress, rank) as bar:
            def hook(n: int) -> None:
                bar.advance(n - bar.done)
                faults.at("write", rank, step, path)
                if WRITE_HOOK is not None:
                    WRITE_HOOK(n)
            digest = write_file(path, mine, {"format": "pt"}, hook)
    except Exception as exc:  # noqa: BLE001 - every rank must reach _settle, whatever failed
        error = CheckpointError(_failed(path, exc, directory))
    _settle(comm, directory, name, error)
    faults.at("save-files", rank, step)
    digests = [json.loads(d) for d in gather_bytes(comm, json.dumps(digest).encode())]
    rng = [json.loads(r) for r in gather_bytes(comm, json.dumps(_rng_states(rng_comm(record, pipe, comm))).encode())]
    entries = _entries(tensors, comm.world_size, digests, first)
    if pipe is not None:  # each stage knows its own keys
        entries, aliases, section = _merged(comm, entries, aliases, section)
    if rank == 0:
        target = os.path.join(version, MANIFEST)
        try:
            plan = pipe.plan if pipe is not None else getattr(model, "tp_plan", None)
            manifest = _manifest(model, entries, aliases, section, plan, comm.world_size, step, extra, rng, version)
            write_json(target, manifest)
            fsync_dir(version)
            faults.at("save-latest", rank, step)
            target = os.path.join(directory, LATEST)
            point_latest(directory, name)
        except Exception as exc:  # noqa: BLE001 - every rank must reach _settle, whatever failed
            if read_latest(directory) != name:  # else `latest` moved: the save is complete, whatever failed after
                error = CheckpointError(_failed(target, exc, directory))
    _settle(comm, directory, name, error)
    if rank == 0:
        try:
            prune(directory, keep, name)
        except OSError as exc:
            warnings.warn(f"save_sharded: saved {version}, but removing old versions failed: {exc}", stacklevel=2)
    comm.barrier()
    return version


def _failed(path: str, exc: Exception, directory: str) -> str:
    latest = read_latest(directory)
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return (f"{path}: could not write it ({why}); the partial version was removed and "
            f"{'latest still names ' + latest if latest else 'no version was saved before'}")


def _settle(comm, directory: str, name: str, error: CheckpointError | None) -> None:
    """Every rank learns whether any rank failed; if one did, rank 0 removes the partial version and every rank
    raises (the failing rank's message)."""
    try:
        agree(comm, error)
    except CheckpointError:
        if comm.rank == 0:
            remove_version(directory, name)
        raise


def _agree_version(comm, directory: str, step: int | None) -> str:
    """Rank 0 picks the next version name; every rank gets it (or the same CheckpointError)."""
    name, error = b"", None
    if comm.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            name = next_version(directory, step).encode()
        except OSError as exc:
            error = CheckpointError(f"{directory}: cannot create the checkpoint directory ({exc.strerror or exc})")
    agree(comm, error)
    return os.path.join(directory, gather_bytes(comm, name)[0].decode())


def _rng_states(comm) -> dict:
    states = get_rng_tracker(comm).get_states()
    return {name: {dev: bytes(s.tolist()).hex() for dev, s in d.items()} for name, d in states.items()}


def _entries(tensors, world: int, digests: list[dict], first: int) -> dict:
    """The manifest entry of every tensor in `tensors`: its full shape, dtype, and every rank's pieces (`first`
    writes the whole tensors)."""
    entries = {}
    for key, (t, lay) in tensors.items():
        pieces = [dict(p, sha256=digests[r][p["name"]])
                  for r in range(world) for p in rank_pieces(key, lay.for_rank(r), r, first)]
        entries[key] = {"shape": list(lay.full_shape), "dtype": NAMES[t.dtype], "pieces": pieces}
    return entries


def _merged(comm, entries: dict, aliases: dict, section: dict) -> tuple[dict, dict, dict]:
    """Every stage's entries, aliases and optimizer section (each rank's own, gathered: collective)."""
    mine = json.dumps({"entries": entries, "aliases": aliases, "section": section}).encode()
    out_entries, out_aliases, out_section = {}, {}, {}
    for part in (json.loads(b) for b in gather_bytes(comm, mine)):
        out_entries.update(part["entries"])
        out_aliases.update(part["aliases"])
        out_section = optim_state.merge_sections(out_section, part["section"])
    return out_entries, out_aliases, out_section


def _manifest(model, entries, aliases, section, plan, world, step, extra, rng, version) -> dict:
    entries = dict(entries)
    for alias, key in aliases.items():
        entries[alias] = dict(entries[key], alias_of=key)
    return {"format": FORMAT, "version": 2, "tpkit_version": _tpkit_version(), "world_size": world, "step": step,
            "extra": extra, "config": config_dict(model), "generation_config": generation_dict(model),
            "name_or_path": model_source(model),  # where its tokenizer is: consolidate copies it
            "plan": plan.to_dict() if hasattr(plan, "to_dict") else None,
            "files": {rank_file(r): {"bytes": os.path.getsize(os.path.join(version, rank_file(r)))}
                      for r in range(world)},
            "tensors": entries, "optimizer": section or None, "rng": rng if any(rng) else None}


def _tpkit_version() -> str:
    try:
        from importlib.metadata import version

        return version("tpkit")
    except Exception:
        return "unknown"
