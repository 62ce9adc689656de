"""`from_pretrained`: build on the meta device, parallelize, then read only this rank's bytes.

The model is built from its config with parameters on the meta device but buffers real, so everything the
model's own init computes (rotary `inv_freq`, which is non-persistent and never in a file; persistent buffers
a file may lack) has exactly the value a normal load gives. `parallelize` works on meta parameters; each is
then allocated at its local shape on the load's device (tied parameters stay one tensor; `allocate.py`), the
buffers are moved there, and everything is filled from the files through the shared loader (`load.py`, which
validates everything and agrees across ranks before reading; `fill.py`, which keeps several reads in flight
and, for a device, goes through pinned staging buffers).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from ..convert.layouts import check_grad_sums
from ..convert.parallelize import parallelize
from ..convert.plan import Plan
from ..convert.quantized import dequantize_layers, quantize_layers
from ..quant import read_quantization
from ..quant.schemes import FP8_DTYPES
from ..convert.transformers_threads import transformers_name
from ..nn._layer import resolve_comm
from .agree import agree
from .allocate import materialize, meta_parameters, place_buffers
from .errors import CheckpointError
from .fill import map_weights, read_targets
from .hf_config import load_generation_config
from .keys import key_finder
from .load import Source, model_targets, open_source
from .progress import Progress
from .staging import load_device, staging_for

def resolve_dtype(dtype, config) -> torch.dtype:
    """`dtype` (a torch.dtype, its name, or "auto"/None for the config's `dtype`/`torch_dtype`, else float32),
    as transformers resolves it."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def build(config, model_cls, dtype: torch.dtype) -> nn.Module:
    with meta_parameters(dtype):
        if model_cls is not None:
            return model_cls(config) if not hasattr(model_cls, "_from_config") else model_cls._from_config(config)
        return transformers_name("AutoModelForCausalLM").from_config(config)


def load_config(source: Source, path: str):
    if source.config is None:
        raise CheckpointError(f"{path}: no config.json (or manifest config) to build the model from")
    d = dict(source.config)
    model_type = d.pop("model_type", None)
    if model_type is None:
        raise CheckpointError(f"{path}: config has no model_type")
    config = transformers_name("AutoConfig").for_model(model_type, **d)
    # as transformers' from_pretrained records where it loaded from (the model copies it as `name_or_path`): PEFT
    # writes it into adapter_config.json as base_model_name_or_path
    config.name_or_path = path
    return config


def recorded_plan(source: Source, plan, world: int, mode: str):
    """`(plan, recorded)`: a tpkit checkpoint saved at this world size and mode carries the plan its model was
    converted with; with `plan="auto"` that plan is applied as recorded (no trace: a reload is mostly reading)."""
    saved = (source.manifest or {}).get("plan")
    if isinstance(plan, str) and plan == "auto" and saved and saved.get("world_size") == world \
            and saved.get("mode") == mode:
        return Plan.from_dict(saved), True
    return plan, False


def _entry_dtype(source: Source, key: str) -> torch.dtype | None:
    e = source.entries.get(key)
    return e.dtype if e is not None else None


def stored_keys(source: Source, quant) -> list[str]:
    """The checkpoint's keys that hold quantized tensors: a name only quantized layers store, or a `weight` of
    integer or FP8 values."""
    names = quant.stored_names - {"weight"}
    return [k for k, e in source.entries.items() if k.rpartition(".")[2] in names or (
        k.endswith("weight") and (not e.dtype.is_floating_point or e.dtype in FP8_DTYPES))]


def from_pretrained(path: str | os.PathLike, comm=None, plan="auto", mode: str = "inference", dtype=None,
                    model_cls=None, progress: bool | None = None,
                    device: torch.device | str | int | None = None, reuse: bool | None = None,
                    dequantize: bool = False) -> nn.Module:
    """A Hugging Face directory (single file or index + shards) or a tpkit checkpoint, built and converted
    for this rank, each rank reading only its slices. Equals `transformers...from_pretrained(path)` followed
    by `tpkit.parallelize(model, plan, comm, mode=mode)`, with every parameter and buffer on `device` (default:
    the rank's device: the current CUDA device under nccl, else the CPU). Collective; returns the model in
    eval mode. `reuse`: as for `parallelize` (default on; `TPKIT_PLAN_REUSE=0` turns it off): repeated blocks are
    planned from the distinct ones without tracing them.

    A quantized checkpoint (its config has a `quantization_config`: compressed-tensors, FP8 block, GPTQ, AWQ;
    `tpkit.quant.SUPPORTED`) loads packed: each rank reads its slice of the packed weights and of their scales,
    zero points and `g_idx`, split in whole groups where the split can, and its quantized layers dequantize per call
    in `dtype` (`tpkit.nn.quantized`). `dequantize=True` holds the dequantized weights instead (dense, trainable).
    An unsupported method or scheme raises `QuantizationError` before any weight is read."""
    path, comm = os.fspath(path), resolve_comm(comm)
    device = load_device(device, comm)
    error, source, config = None, None, None
    quant = None
    try:
        source = open_source(path, comm.rank, comm.world_size)
        config = load_config(source, path)
        quant = read_quantization((source.config or {}).get("quantization_config"))
    except Exception as exc:  # every rank reaches agree(), whatever failed
        error = exc
    agree(comm, error)
    target_dtype = resolve_dtype(dtype, config)
    model = build(config, model_cls, target_dtype)
    generation = load_generation_config(path, source.manifest)  # as transformers does: generation_config.json
    if generation is not None and getattr(model, "generation_config", None) is not None:
        model.generation_config = generation
    plan, recorded = recorded_plan(source, plan, comm.world_size, mode)
    parallelize(model, plan, comm, mode=mode, recorded=recorded, reuse=reuse, quantization=quant)
    notes: list[str] = []
    find = key_finder(model, source, notes)
    quantized: list[str] = []
    if quant is not None:
        error = None
        try:
            quantized = quantize_layers(model, quant, target_dtype, find, lambda k: _entry_dtype(source, k),
                                        stored_keys(source, quant))
        except Exception as exc:
            error = exc
        agree(comm, error)
    materialize(model, device)
    place_buffers(model, device)
    stored = {f"{n}." for n in quantized}
    buffers = {n for n, _ in model.named_buffers() if not n.startswith(tuple(stored))}
    error, targets = None, []
    try:
        targets = model_targets(model, source, find, strict=False, convert=True, missing_ok=lambda k: k in buffers)
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
            read_targets(source, targets, bar, verify=True, staging=staging_for(device), mapped=map_weights())
        except Exception as exc:
            error = exc
    agree(comm, error)
    if dequantize and quantized:
        dequantize_layers(model, comm)
    check_grad_sums(model, f"from_pretrained({path!r})")
    return model.eval()
