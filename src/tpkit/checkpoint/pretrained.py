"""`from_pretrained`: build on the meta device, parallelize, then read only this rank's bytes.

The model is built from its config with parameters on the meta device but buffers real, so everything the
model's own init computes (rotary `inv_freq`, which is non-persistent and never in a file; persistent buffers
a file may lack) has exactly the value a normal load gives. `parallelize` works on meta parameters; each is
then allocated at its local shape (tied parameters stay one tensor) and filled from the files through the
shared loader (`load.py`), which validates everything and agrees across ranks before reading.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import torch
from torch import nn

from ..convert.parallelize import parallelize
from ..convert.plan import Plan
from ..nn._layer import resolve_comm
from .agree import agree
from .conversions import transformers_keys
from .errors import CheckpointError
from .hf_config import load_generation_config
from .load import Source, model_targets, open_source, read_targets
from .memory import empty_for_load
from .progress import Progress

# Building patches nn.Module.register_parameter and the default dtype process-wide: one build at a time.
_BUILD_LOCK = threading.Lock()
_LEGACY = {"gamma": "weight", "beta": "bias"}


@contextlib.contextmanager
def meta_parameters(dtype: torch.dtype | None) -> Iterator[None]:
    """Parameters registered inside go to the meta device; buffers stay real (computed by the module's init).
    Floating defaults are `dtype` inside, as transformers builds its models. Only the building thread's
    parameters go to meta (thread-ranks may be building other models meanwhile)."""
    with _BUILD_LOCK:  # read the original inside the lock, or a waiting build would restore our patch
        original, builder = nn.Module.register_parameter, threading.get_ident()

        def register(self, name, param):
            if param is not None and param.device.type != "meta" and threading.get_ident() == builder:
                param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            original(self, name, param)

        saved_dtype = torch.get_default_dtype()
        nn.Module.register_parameter = register
        try:
            if dtype is not None and dtype.is_floating_point:
                torch.set_default_dtype(dtype)
            yield
        finally:
            nn.Module.register_parameter = original
            torch.set_default_dtype(saved_dtype)


def materialize(model: nn.Module) -> None:
    """Replace every meta parameter with an uninitialised CPU one of the same (local) shape; a parameter
    shared by several modules (tied weights) stays shared."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in made:
                new = nn.Parameter(empty_for_load(p.shape, p.dtype), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)  # tensor-parallel attributes set by the layers
                made[id(p)] = new
            module._parameters[name] = made[id(p)]


def resolve_dtype(dtype, config) -> torch.dtype:
    """`dtype` (a torch.dtype, its name, or "auto"/None for the config's `dtype`/`torch_dtype`, else float32),
    as transformers resolves it."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def key_finder(model: nn.Module, source: Source, notes: list[str] | None = None):
    """Model key -> checkpoint key: exact; legacy `gamma`/`beta`; with or without the base-model prefix (a
    bare `LlamaModel` checkpoint loads into `LlamaForCausalLM`); else as transformers renames or rebuilds it
    (`conversions.py`, which adds fused entries to `source`). transformers' table is built (~0.5 s: a
    thousand regexes) only when a key is not found otherwise, which a checkpoint saved by tpkit never needs.
    `notes` receives the conversions tpkit could not read."""
    names = {}
    for k in source.entries:
        head, _, last = k.rpartition(".")
        if last in _LEGACY:
            names.setdefault(f"{head}.{_LEGACY[last]}" if head else _LEGACY[last], k)
    names.update({k: k for k in source.entries})
    prefix = getattr(model, "base_model_prefix", "") or ""
    renamed: dict[str, str] | None = None if source.manifest is None else {}

    def find(key: str) -> str | None:
        nonlocal renamed
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


def build(config, model_cls, dtype: torch.dtype) -> nn.Module:
    import transformers

    with meta_parameters(dtype):
        if model_cls is not None:
            return model_cls(config) if not hasattr(model_cls, "_from_config") else model_cls._from_config(config)
        return transformers.AutoModelForCausalLM.from_config(config)


def load_config(source: Source, path: str):
    import transformers

    if source.config is None:
        raise CheckpointError(f"{path}: no config.json (or manifest config) to build the model from")
    d = dict(source.config)
    model_type = d.pop("model_type", None)
    if model_type is None:
        raise CheckpointError(f"{path}: config has no model_type")
    return transformers.AutoConfig.for_model(model_type, **d)


def recorded_plan(source: Source, plan, world: int, mode: str):
    """`(plan, recorded)`: a tpkit checkpoint saved at this world size and mode carries the plan its model was
    converted with; with `plan="auto"` that plan is applied as recorded (no trace: a reload is mostly reading)."""
    saved = (source.manifest or {}).get("plan")
    if isinstance(plan, str) and plan == "auto" and saved and saved.get("world_size") == world \
            and saved.get("mode") == mode:
        return Plan.from_dict(saved), True
    return plan, False


def from_pretrained(path: str | os.PathLike, comm=None, plan="auto", mode: str = "inference", dtype=None,
                    model_cls=None, progress: bool | None = None) -> nn.Module:
    """A Hugging Face directory (single file or index + shards) or a tpkit checkpoint, built and converted
    for this rank, each rank reading only its slices. Equals `transformers...from_pretrained(path)` followed
    by `tpkit.parallelize(model, plan, comm, mode=mode)`. Collective; returns the model in eval mode."""
    path, comm = os.fspath(path), resolve_comm(comm)
    error, source, config = None, None, None
    try:
        source = open_source(path, comm.rank, comm.world_size)
        config = load_config(source, path)
    except Exception as exc:  # every rank reaches agree(), whatever failed
        error = exc
    agree(comm, error)
    target_dtype = resolve_dtype(dtype, config)
    model = build(config, model_cls, target_dtype)
    generation = load_generation_config(path, source.manifest)  # as transformers does: generation_config.json
    if generation is not None and getattr(model, "generation_config", None) is not None:
        model.generation_config = generation
    plan, recorded = recorded_plan(source, plan, comm.world_size, mode)
    parallelize(model, plan, comm, mode=mode, recorded=recorded)
    materialize(model)
    buffers = {n for n, _ in model.named_buffers()}
    error, targets, notes = None, [], []
    try:
        targets = model_targets(model, source, key_finder(model, source, notes), strict=False, convert=True,
                                missing_ok=lambda k: k in buffers)
    except CheckpointError as exc:
        error = CheckpointError(f"{exc}; transformers rebuilds {notes[:2]} in ways tpkit does not read") if notes \
            else exc
    except Exception as exc:
        error = exc
    agree(comm, error)
    total = sum(t.layout.local_numel * source.entries[t.key].dtype.itemsize for t in targets)
    error = None
    with Progress(f"loading {os.path.basename(path.rstrip('/'))}", total, progress, comm.rank) as bar:
        try:  # the model is new: pieces are checked from the bytes as read, and on error it is dropped
            read_targets(source, targets, bar, verify=True)
        except Exception as exc:
            error = exc
    agree(comm, error)
    return model.eval()
