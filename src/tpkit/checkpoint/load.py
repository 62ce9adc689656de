"""`load_sharded` and the loader every entry point shares: validate everything, agree, then read.

The order is the point: (1) open the source (every header parsed), (2) match every model key to a source
entry and check full shape, dtype and that the pieces cover this rank's region, optimizer state included,
(3) one exchange so that all ranks raise the same `CheckpointError` if any rank found a problem, and only
then (4) read each rank's regions into the tensors. A checkpoint that fits the embeddings but not the MLP
fails at (2) with the model untouched.
"""
from __future__ import annotations

import json
import os
from typing import Callable

import torch
from torch import nn

from ..convert.layouts import check_grad_sums, shard_layouts
from ..quant.schemes import FP8_DTYPES
from ..nn._layer import resolve_comm
from ..nn.quantized import finish_loading
from ..nn.random import DATA_PARALLEL_RNG, get_rng_tracker
from . import optimizer as optim_state
from .agree import agree
from .allocate import computed_buffers, materialize
from .errors import CheckpointError
from .fill import Target, check_targets, read_targets
from .keys import key_finder
from .manifest import check_checksums, find_version, read_manifest
from .mesh import like, pipeline_of, rng_comm, unwrap
from .progress import Progress
from .reader import uncovered
from .sources import Source, hf_files, manifest_source, whole_files
from .staging import load_device, staging_for


def open_source(path: str, rank: int = 0, world: int = 1) -> Source:
    """A tpkit checkpoint (root, version or manifest), a Hugging Face directory, a plain safetensors file or a
    directory of them. Every header is parsed and checked; pieces' sha256 are checked where they are read."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    version = find_version(path)
    if version is not None:
        manifest = read_manifest(version)
        if any("sha256" in d for d in manifest.get("files", {}).values()):  # written before pieces had sha256
            check_checksums(version, manifest, rank, world)
        return manifest_source(version, manifest)
    if os.path.isfile(path):
        return whole_files([path], os.path.dirname(path))
    source = whole_files(hf_files(path), path)
    config = os.path.join(path, "config.json")
    if os.path.exists(config):
        with open(config) as f:
            source.config = json.load(f)
    return source


def model_targets(model: nn.Module, source: Source, find: Callable[[str], str | None], strict: bool,
                  missing_ok: Callable[[str], bool] = lambda k: False,
                  elsewhere: frozenset[str] = frozenset()) -> list[Target]:
    """A Target per distinct model tensor (tied keys share one), in the model tensor's dtype (`castable`). Raises
    CheckpointError for missing keys (strict, or always when `missing_ok` says no) and, when strict, for
    unexpected ones (`elsewhere`: keys other ranks' parts of the model hold, a pipeline's other stages)."""
    layouts = shard_layouts(model)
    sd = model.state_dict(keep_vars=True)
    targets, by_id, missing, used = [], {}, [], set()
    for key, t in sd.items():
        skey = find(key)
        if skey is None:
            missing.append(key)
            continue
        used.add(skey)
        if id(t) not in by_id:
            by_id[id(t)] = key
            targets.append(Target(skey, key, layouts[key], t.dtype, t))
    missing = [k for k in missing if id(sd[k]) not in by_id and (strict or not missing_ok(k))]
    if missing:
        raise CheckpointError(f"{source.root}: checkpoint lacks {len(missing)} tensor(s) of the model: "
                              f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if strict:  # a stored tensor is used when a target reads it, itself or as a piece of one transformers fuses
        read = used | {piece.name for k in used for piece in source.entries[k].pieces}
        extra = [k for k in source.entries if k not in read and k not in elsewhere
                 and not k.startswith(optim_state.PREFIX)
                 and not any(piece.name in read for piece in source.entries[k].pieces)]
        if extra:
            raise CheckpointError(f"{source.root}: checkpoint has {len(extra)} tensor(s) the model does not: "
                                  f"{extra[:5]}{' ...' if len(extra) > 5 else ''} (a checkpoint of another model?)")
    for t in targets:
        check_target(source, t)
    return targets


def castable(stored: torch.dtype, wanted: torch.dtype) -> bool:
    """Whether a stored tensor loads into a tensor of dtype `wanted`: the same dtype, or both floating and neither
    FP8 (cast on the way in, as torch's `load_state_dict` and transformers do: a bf16 checkpoint into a float32
    model is upcast exactly). FP8 values mean nothing without their scales, and integers are never cast."""
    return stored == wanted or (stored.is_floating_point and wanted.is_floating_point
                                and stored not in FP8_DTYPES and wanted not in FP8_DTYPES)


def check_target(source: Source, t: Target) -> None:
    """Full shape (before any slicing: a slice of the right local shape can still be the wrong tensor), dtype
    (`castable`), and that the pieces cover this rank's region."""
    e = source.entries[t.key]
    where = e.pieces[0].path if e.pieces else source.root
    if e.shape != t.layout.full_shape:
        raise CheckpointError(f"{where}: tensor {t.key!r} has shape {list(e.shape)}, the model's {t.name} is "
                              f"{list(t.layout.full_shape)}")
    if not castable(e.dtype, t.dtype):
        raise CheckpointError(f"{where}: tensor {t.key!r} is {e.dtype}, the model's {t.name} is {t.dtype}")
    if uncovered(e, t.layout):
        raise CheckpointError(f"{where}: tensor {t.key!r}: the checkpoint's pieces do not cover the region rank "
                              f"{t.layout.rank} needs")


def load_sharded(model: nn.Module, directory: str, optimizer=None, comm=None, strict: bool = True,
                 progress: bool | None = None, device: torch.device | str | int | None = None) -> dict:
    """Load a tpkit checkpoint (any saved world size), a plain safetensors file or a directory of them into
    the converted (or plain) `model`, each rank reading only its slices; optimizer state too. Collective.
    Tensors are filled where they are (a device destination through pinned staging buffers); a model
    converted on the meta device is first given memory on `device` (default: the rank's device), with its
    non-persistent buffers computed as its class computes them (`allocate.py`), or refused when they cannot
    be. Each tensor keeps the model's dtype: floating tensors are cast into it (`castable`), optimizer state into
    its parameter's (`optimizer.state_targets`), as torch's `load_state_dict`s do. Returns the manifest metadata:
    {"step", "extra", "config", "plan", "world_size"}."""
    comm = resolve_comm(comm)
    model, record = unwrap(model, comm)
    pipe = pipeline_of(model)
    elsewhere, copies = (pipe.keys, pipe.aliases) if pipe is not None else (frozenset(), {})
    device = load_device(device, comm)
    error, source, targets, section, computed, fills = None, None, [], {}, {}, None
    try:
        source = open_source(directory, comm.rank, comm.world_size)
        # a tpkit checkpoint holds the model's own keys; a Hugging Face directory may hold them as transformers names
        # or rebuilds them (NeoX's embed_out, experts one tensor per expert)
        find = (lambda k: k if k in source.entries else None) if source.manifest is not None else \
            key_finder(model, source)
        targets = model_targets(model, source, find, strict, elsewhere=elsewhere)
        if optimizer is not None:
            section = (source.manifest or {}).get("optimizer") or {}
            if not section and strict:
                raise CheckpointError(f"{source.root}: the checkpoint holds no optimizer state")
            targets += optimizer_targets(model, source, section, copies)
        computed = computed_buffers(model, source.root)
        fills = target_device(targets, device)
        check_targets(source, targets)  # before anything changes: the model is the caller's
    except Exception as exc:  # every rank must reach agree(), whatever went wrong
        error = exc
    agree(comm, error)
    if any(t.is_meta for t in model.state_dict(keep_vars=True).values()) or computed:
        materialize(model, device, computed, optimizer)
        current = model.state_dict(keep_vars=True)
        for t in targets:
            t.dest = current[t.name] if t.dest is not None else None
    place_state(model, section, targets)
    total = sum(t.layout.local_numel * source.entries[t.key].dtype.itemsize for t in targets)
    with Progress(f"loading {os.path.basename(directory.rstrip('/'))}", total, progress, comm.rank) as bar:
        values = read_targets(source, targets, bar, staging=staging_for(fills))
    finish_loading(model)  # quantized layers: what their products read, from the values just read
    if optimizer is not None and section:
        optim_state.restore(model, optimizer, section, values, place=like, copies=copies)
    check_grad_sums(model, f"load_sharded({directory!r})")
    manifest = source.manifest or {}
    restore_rng(manifest, comm, rng_comm(record, pipe, comm))
    return {"step": manifest.get("step"), "extra": manifest.get("extra"), "config": manifest.get("config"),
            "plan": manifest.get("plan"), "world_size": manifest.get("world_size")}


def target_device(targets: list[Target], meta_to: torch.device) -> torch.device:
    """The one device the targets' tensors live on besides the CPU (the CPU when none); a meta tensor will
    live on `meta_to`."""
    devices = {meta_to if t.dest.is_meta else t.dest.device for t in targets if t.dest is not None}
    devices = {d for d in devices if d.type != "cpu"}
    if len(devices) > 1:
        raise CheckpointError(f"the model's tensors are on several devices ({sorted(map(str, devices))}); "
                              f"load_sharded fills one device per rank")
    return devices.pop() if devices else torch.device("cpu")


def optimizer_targets(model: nn.Module, source: Source, section: dict,
                      copies: dict[str, str] | None = None) -> list[Target]:
    layouts = shard_layouts(model)
    out = []
    for key, lay, dtype in optim_state.state_targets(model, section, layouts, source.entries, copies):
        t = Target(key, key, lay, dtype)
        check_target(source, t)
        out.append(t)
    return out


def place_state(model: nn.Module, section: dict, targets: list[Target]) -> None:
    """Optimizer state shaped like its parameter is made on the parameter's device; scalars (AdamW's `step`)
    on the CPU, where torch's optimizers keep them."""
    params = dict(model.named_parameters())
    owner = {d["tensor"]: name for name, rec in (section or {}).get("state", {}).items() for d in rec.values()
             if isinstance(d, dict) and "tensor" in d}
    for t in targets:
        p = params.get(owner.get(t.key, ""))
        if t.dest is None and p is not None and tuple(t.layout.local_shape) == tuple(p.shape):
            t.device = p.device


def restore_rng(manifest: dict, comm, tracker_comm=None) -> None:
    """The RNG tracker's streams (of `tracker_comm`, the tp communicator of a data-parallel model, else
    `comm`'s), when the checkpoint was saved at this world size. At another world size per-rank streams do not map
    onto the new ranks, but the replicated stream (`DATA_PARALLEL_RNG`: LoRA dropout's one mask) does when every
    saved rank held it alike: it alone is restored, so a run resumed at another TP size draws the same masks."""
    saved = manifest.get("rng")
    if not saved:
        return
    decode = lambda d: {dev: torch.tensor(list(bytes.fromhex(h)), dtype=torch.uint8)  # noqa: E731
                        for dev, h in d.items()}
    tracker = get_rng_tracker(tracker_comm or comm)
    if len(saved) == comm.world_size:
        states = {name: decode(d) for name, d in saved[comm.rank].items()}
        if states:
            tracker.set_states(states)
        return
    replicated = [r.get(DATA_PARALLEL_RNG) for r in saved]
    if replicated[0] is not None and all(r == replicated[0] for r in replicated):
        tracker.set_states(dict(tracker.get_states(), **{DATA_PARALLEL_RNG: decode(replicated[0])}))
