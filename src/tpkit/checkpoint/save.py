"""`save_sharded`: every rank writes the parts of the full tensors it holds; the layout on disk does not depend
on the TP size.

For each tensor, rank r writes the positions of its segments that no lower rank holds (so a replicated
tensor, or a KV head several ranks share, is written once: by the first holder), each as one piece with its
offsets in the full tensor. Every rank can work out every other rank's pieces from the layouts
(`layout.for_rank`), so rank 0 writes the whole manifest after gathering only the pieces' sha256 and RNG
states. Then a barrier, then `latest` moves: a save killed before that leaves the previous one in place. A
model under `tpkit.data_parallel` is saved with the world communicator: its TP layouts are spread over the
world ranks (`mesh.py`), so dp replicas are written once and the files look like any TP checkpoint's.
"""
from __future__ import annotations

import json
import os
from typing import Callable

import torch
from torch import nn

from ..convert.layouts import shard_layouts
from ..nn._layer import resolve_comm
from ..layout import ShardLayout
from ..nn.random import get_rng_tracker
from . import optimizer as optim_state
from .agree import gather_bytes
from .mesh import spread, unwrap, whole_local
from .manifest import FORMAT, MANIFEST, fsync_dir, next_version, point_latest, rank_file, write_json
from .progress import Progress
from .safetensors_file import NAMES, write_file

# Called with the bytes written so far while a rank writes its file (tests kill a save halfway with it).
WRITE_HOOK: Callable[[int], None] | None = None


def owned_spans(layout: ShardLayout, rank: int) -> list[tuple[int, int, int]]:
    """`(start, stop, position in the rank's local tensor)` along `dim` of what `rank` writes: its segments
    minus what lower ranks hold. A replicated tensor: rank 0 writes `(0, size, 0)`."""
    if layout.dim is None or layout.is_replicated:
        return [(0, layout.full_shape[layout.dim] if layout.dim is not None else 0, 0)] if rank == 0 else []
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


def rank_pieces(key: str, layout: ShardLayout, rank: int) -> list[dict]:
    """The manifest pieces `rank` writes for `key` (tensor names in its file, offsets in the full tensor)."""
    out = []
    for i, (a, b, _) in enumerate(owned_spans(layout, rank)):
        offsets = [0] * len(layout.full_shape)
        if layout.dim is not None and not layout.is_replicated:
            offsets[layout.dim] = a
        out.append({"file": rank_file(rank), "name": key if i == 0 else f"{key}#{i}", "offsets": offsets})
    return out


def local_pieces(key: str, tensor: torch.Tensor, layout: ShardLayout) -> dict[str, torch.Tensor]:
    """This rank's pieces of `key` as tensors in the stored orientation, named as in `rank_pieces`."""
    stored = tensor.detach().t() if layout.transposed else tensor.detach()
    out = {}
    for i, (a, b, at) in enumerate(owned_spans(layout, layout.rank)):
        whole = layout.dim is None or layout.is_replicated
        out[key if i == 0 else f"{key}#{i}"] = stored if whole else stored.narrow(layout.dim, at, b - a)
    return out


def collect(model: nn.Module, optimizer) -> tuple[dict[str, tuple[torch.Tensor, ShardLayout]], dict, dict]:
    """`({key: (tensor, layout)}, {alias key: key} for tied keys, optimizer manifest section)`."""
    layouts = shard_layouts(model)
    tensors, aliases, seen = {}, {}, {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            aliases[key] = seen[id(t)]
            continue
        seen[id(t)] = key
        tensors[key] = (t, layouts[key])
    section = {}
    if optimizer is not None:
        extra, section = optim_state.state_tensors(model, optimizer, layouts)
        tensors.update(extra)
    return tensors, aliases, section


def save_sharded(model: nn.Module, directory: str, optimizer=None, step: int | None = None, comm=None,
                 extra: dict | None = None, progress: bool | None = None) -> str:
    """Save `model` (and `optimizer`) under `directory` as a new version; collective. Returns the version
    directory. `extra` must be JSON-serialisable."""
    comm = resolve_comm(comm)
    model, record = unwrap(model, comm)
    tensors, aliases, section = collect(model, optimizer)
    if record is not None:  # FSDP2 shards gathered to TP-local tensors (collective, same order on every rank)
        tensors = {k: (whole_local(t), spread(lay, record.tp_size, comm.world_size, comm.rank))
                   for k, (t, lay) in tensors.items()}
    json.dumps(extra)  # fail before writing anything
    version = _agree_version(comm, directory, step)
    os.makedirs(version, exist_ok=True)
    mine = {}
    for key, (t, lay) in tensors.items():
        mine.update(local_pieces(key, t, lay))
    total = sum(v.numel() * v.element_size() for v in mine.values())
    with Progress(f"saving {os.path.basename(version)}", total, progress, comm.rank) as bar:
        def hook(n: int) -> None:
            bar.advance(n - bar.done)
            if WRITE_HOOK is not None:
                WRITE_HOOK(n)
        digest = write_file(os.path.join(version, rank_file(comm.rank)), mine, {"format": "pt"}, hook)
    digests = [json.loads(d) for d in gather_bytes(comm, json.dumps(digest).encode())]
    rng_comm = record.tp_comm if record is not None and record.tp_comm is not None else comm
    rng = [json.loads(r) for r in gather_bytes(comm, json.dumps(_rng_states(rng_comm)).encode())]
    if comm.rank == 0:
        manifest = _manifest(model, tensors, aliases, section, comm.world_size, step, extra, digests, rng, version)
        write_json(os.path.join(version, MANIFEST), manifest)
        fsync_dir(version)
    comm.barrier()
    if comm.rank == 0:
        point_latest(directory, os.path.basename(version))
    comm.barrier()
    return version


def _agree_version(comm, directory: str, step: int | None) -> str:
    """Rank 0 picks the next version name; every rank gets it."""
    name = b""
    if comm.rank == 0:
        os.makedirs(directory, exist_ok=True)
        name = next_version(directory, step).encode()
    return os.path.join(directory, gather_bytes(comm, name)[0].decode())


def _rng_states(comm) -> dict:
    states = get_rng_tracker(comm).get_states()
    return {name: {dev: bytes(s.tolist()).hex() for dev, s in d.items()} for name, d in states.items()}


def _manifest(model, tensors, aliases, section, world, step, extra, digests, rng, version) -> dict:
    entries = {}
    for key, (t, lay) in tensors.items():
        pieces = [dict(p, sha256=digests[r][p["name"]])
                  for r in range(world) for p in rank_pieces(key, lay.for_rank(r), r)]
        entries[key] = {"shape": list(lay.full_shape), "dtype": NAMES[t.dtype], "pieces": pieces}
    for alias, key in aliases.items():
        entries[alias] = dict(entries[key], alias_of=key)
    config = getattr(model, "config", None)
    plan = getattr(model, "tp_plan", None)
    return {"format": FORMAT, "version": 2, "tpkit_version": _tpkit_version(), "world_size": world, "step": step,
            "extra": extra, "config": json.loads(config.to_json_string(use_diff=False)) if hasattr(config, "to_json_string") else None,
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
