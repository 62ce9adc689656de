"""`from_pretrained`: build on the meta device, parallelize, then read only this rank's bytes.

The model is built from its config with parameters on the meta device but buffers real, so everything the
model's own init computes (rotary `inv_freq`, which is non-persistent and never in a file; persistent buffers
a file may lack) has exactly the value a normal load gives. `parallelize` works on meta parameters; each is
then allocated at its local shape on the load's device (tied parameters stay one tensor; `allocate.py`), the
buffers are moved there, and everything is filled from the files through the shared loader (`load.py`, which
validates everything and agrees across ranks before reading; `fill.py`, which keeps several reads in flight
and, for a device, goes through pinned staging buffers).

The build is in the dtype asked for, as transformers builds for `from_pretrained(dtype=...)`: its `_from_config`
gets `dtype=` (without it, it builds in the config's dtype whatever was asked, and a bf16 checkpoint asked for
float32 stayed bf16), and the load casts each stored tensor into the model's tensor.

A quantized checkpoint passes through once: its config is read (`tpkit.quant`), the layers it stores quantized are
found from its keys (`convert.quantized.plan_quantized`), the conversion plans and builds those layers holding the
stored tensors (`tpkit.nn.quantized`) and attaches the record and checks the gradient sums once; then the slices
are read and each layer keeps its tensors as its product reads them (`finish_loading`). `dequantize=True` builds
the layers dense and computes their weights from the stored slices read beside them (`dequantized.py`).
"""
from __future__ import annotations

import os
import re
from typing import Callable

import torch
from torch import nn

from ..convert.conversion import conversion_of
from ..convert.parallelize import parallelize
from ..convert.plan import Plan
from ..convert.quantized import plan_quantized, record_layouts
from ..quant import read_quantization
from ..quant.schemes import FP8_DTYPES
from ..convert.transformers_threads import config_dtype, transformers_name
from ..nn._layer import resolve_comm
from ..nn.quantized import finish_loading
from . import dequantized, plan_cache
from .agree import agree
from .allocate import materialize, meta_parameters, place_buffers
from .errors import CheckpointError
from .conversions import quantized_expert_entries
from .fill import map_weights, read_targets
from .hf_config import decoded_floats, load_generation_config
from .keys import key_finder
from .load import Source, model_targets, open_source
from .progress import Progress
from .staging import load_device, staging_for


def resolve_dtype(dtype, config, source: Source | None = None) -> torch.dtype:
    """`dtype` as the installed transformers' `from_pretrained` resolves it: a floating torch.dtype or its name;
    "auto": the config's `dtype` (`torch_dtype` in older configs), else the first floating, non-FP8 tensor of the
    checkpoint, else float32; None: "auto" under transformers 5, torch's default dtype (float32) under 4.x.
    Raises ValueError for anything else."""
    given = dtype
    if dtype is None and not none_means_auto():
        dtype = torch.get_default_dtype()
    if dtype in (None, "auto"):
        dtype = config_dtype(config) or _stored_dtype(source)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype in FP8_DTYPES:
        raise ValueError(f"from_pretrained: dtype={given!r} is not a dtype to compute in; pass a floating torch dtype "
                         f"or its name (torch.bfloat16, 'float32', ...), or 'auto' / None for the checkpoint's")
    return dtype


def none_means_auto() -> bool:
    """Whether the installed transformers loads `from_pretrained(path)` (no dtype) in the checkpoint's dtype: 5.0 on
    (None becomes "auto"); 4.x loads in torch's default dtype."""
    return int(str(transformers_name("__version__")).split(".")[0]) >= 5


def _stored_dtype(source: Source | None) -> torch.dtype:
    """The dtype transformers takes when the config names none: in the first file (by name), the first tensor (by
    name) that is floating and not FP8 (a quantized layer's values); float32 when there is none."""
    entries = source.entries.values() if source is not None else ()
    floating = [(e.pieces[0].path if e.pieces else "", e.key, e.dtype) for e in entries
                if e.dtype.is_floating_point and e.dtype not in FP8_DTYPES]
    return min(floating)[2] if floating else torch.float32


def build(config, model_cls, dtype: torch.dtype, build_kwargs: dict | None = None) -> nn.Module:
    """The model of `config` with parameters on meta in `dtype` (buffers real). A transformers class builds through
    `_from_config(config, dtype=dtype)`, which builds in `dtype` and records it as `config.dtype`, as
    `from_pretrained(dtype=...)` does; without `dtype=` it would build in the config's dtype whatever was asked.
    Tensors the model keeps in float32 at this dtype (`_keep_in_fp32_modules`) go to float32 (`keep_float32`).
    `build_kwargs`: transformers' build keywords (`attn_implementation`, ...; `transformers_kwargs`)."""
    extra = dict(build_kwargs or {})
    with meta_parameters(dtype):
        if model_cls is not None and not hasattr(model_cls, "_from_config"):
            return model_cls(config)
        cls = model_cls if model_cls is not None else transformers_name("AutoModelForCausalLM")
        model = cls._from_config(config, dtype=dtype, **extra) if model_cls is not None else \
            cls.from_config(config, dtype=dtype, **extra)
    keep_float32(model, dtype)
    return model


def keep_float32(model: nn.Module, dtype: torch.dtype) -> None:
    """The tensors transformers loads in float32 at `dtype` (its `_get_dtype_plan`: `_keep_in_fp32_modules` at
    float16, `_keep_in_fp32_modules_strict` at float16 and bfloat16; a state-dict key matches a pattern anywhere,
    `*` any run) made float32 on the built model, so the load reads them as transformers does. Ties stay ties."""
    plan = getattr(model, "_get_dtype_plan", None)
    patterns = [re.compile(k.replace("*", ".*")) for k, v in (plan(dtype) if plan is not None else {}).items()
                if v == torch.float32]
    if not patterns:
        return
    holders: dict[int, list[tuple[dict, str]]] = {}
    chosen: dict[int, torch.Tensor] = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None or not t.is_floating_point() or t.dtype == torch.float32 or \
                        name in m._non_persistent_buffers_set and table is m._buffers:  # never in a file
                    continue
                holders.setdefault(id(t), []).append((table, name))
                if any(p.search(f"{prefix}{'.' if prefix else ''}{name}") for p in patterns):
                    chosen[id(t)] = t
    for key, t in chosen.items():
        new = t.detach().to(torch.float32)
        new = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        for table, name in holders[key]:
            table[name] = new


#: transformers' `from_pretrained` keywords for where to find a model, moot for a local directory: accepted, unused.
LOCATION_KEYWORDS = ("local_files_only", "cache_dir", "token", "use_safetensors", "low_cpu_mem_usage",
                     "weights_only", "force_download", "proxies", "resume_download")
#: ... and those that would change what is loaded in a way tpkit does not: refused, with the way.
REFUSED_KEYWORDS = {
    "device_map": "tpkit places every rank's slices itself: pass device= (default: the rank's device)",
    "tp_plan": "the model is split by tpkit: pass plan= (a mapping of tpkit / Hugging Face tp_plan styles)",
    "tp_size": "the model is split by tpkit over comm=",
    "distributed_config": "the model is split by tpkit over comm=",
    "quantization_config": "tpkit reads the checkpoint's own quantization_config (tpkit.quant.SUPPORTED); "
                           "quantizing on load (bitsandbytes, ...) is not supported",
    "revision": "tpkit reads the directory given: check the revision out there",
    "trust_remote_code": "pass the model's class as model_cls= (tpkit builds it from the config)",
    "output_loading_info": "tpkit's load raises on any missing or unexpected tensor (CheckpointError)",
}
#: transformers' keywords for building the model from its config (`_from_config`).
BUILD_KEYWORDS = ("attn_implementation", "experts_implementation")


def transformers_kwargs(kwargs: dict, config) -> tuple[dict, torch.dtype | str | None]:
    """Split `from_pretrained`'s extra keywords as transformers' `from_pretrained` takes them: the build keywords
    (returned), `torch_dtype` (returned: `dtype`'s old name), config attributes (set on `config`, as transformers
    does); location keywords are accepted and unused. Raises TypeError for a keyword transformers would not take
    either, ValueError for one tpkit refuses (with the way), before anything is built."""
    build, torch_dtype = {}, kwargs.pop("torch_dtype", None)
    refused = [k for k in kwargs if k in REFUSED_KEYWORDS]
    if refused:
        raise ValueError("from_pretrained: " + "; ".join(f"{k}= is not supported ({REFUSED_KEYWORDS[k]})"
                                                         for k in refused))
    unknown = [k for k in kwargs if k not in BUILD_KEYWORDS and k not in LOCATION_KEYWORDS and not hasattr(config, k)]
    if unknown:
        raise TypeError(f"from_pretrained: unexpected keyword argument(s) {unknown}: neither tpkit's nor transformers' "
                        f"(its build keywords {list(BUILD_KEYWORDS)}, or attributes of {type(config).__name__})")
    for k, v in kwargs.items():
        if k in BUILD_KEYWORDS:
            build[k] = v
        elif k not in LOCATION_KEYWORDS:
            setattr(config, k, v)
    return build, torch_dtype


def load_config(source: Source, path: str):
    """The checkpoint's config as transformers reads it: `config.json` (or the manifest's copy) with the floats JSON
    cannot hold decoded (`hf_config.decoded_floats`), built by the class of its `model_type`."""
    if source.config is None:
        raise CheckpointError(f"{path}: no config.json (or manifest config) to build the model from")
    d = decoded_floats(source.config)
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
    converted with; with `plan="auto"` that plan is applied as recorded (no trace: a reload is mostly reading; a plan
    made while the model's forward replaced some of its modules is traced again: `state.read_request`)."""
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
                    dequantize: bool = False, convert: Callable[[nn.Module], None] | None = None,
                    **kwargs) -> nn.Module:
    """A Hugging Face directory (single file or index + shards) or a tpkit checkpoint, built and converted
    for this rank, each rank reading only its slices. Equals `transformers...from_pretrained(path)` followed
    by `tpkit.parallelize(model, plan, comm, mode=mode)`, with every parameter and buffer on `device` (default:
    the rank's device: the current CUDA device under nccl, else the CPU). Collective; returns the model in
    eval mode. `reuse`: as for `parallelize` (default on; `TPKIT_PLAN_REUSE=0` turns it off): repeated blocks are
    planned from the distinct ones without tracing them. With `plan="auto"` on a dense checkpoint, the plan decided
    for the same model, loaded the same way, before is applied as recorded (`plan_cache`; `TPKIT_PLAN_CACHE=0`).

    `dtype`, as the installed transformers' `from_pretrained(path, dtype=...)`: "auto" is the checkpoint's (its
    config's `dtype`, else its first floating tensor's), and so is None under transformers 5 (4.x: float32); a floating torch dtype or its name casts every parameter and
    persistent buffer the file holds to it (tensors transformers keeps in float32 at that dtype stay float32), and
    `model.config.dtype` records it. Anything else is a `ValueError`.

    A quantized checkpoint (its config has a `quantization_config`: compressed-tensors, FP8 block, GPTQ, AWQ;
    `tpkit.quant.SUPPORTED`) loads packed: each rank reads its slice of the packed weights and of their scales,
    zero points and `g_idx`, split in whole groups where the split can, and its quantized layers compute in `dtype`
    (`tpkit.nn.quantized`), their weights those transformers' load holds at that dtype (`tpkit.quant.dequant`).
    `dequantize=True` builds dense layers holding the dequantized weights instead (trainable).
    An unsupported method or scheme raises `QuantizationError` before any weight is read. `convert(model)` converts
    the meta-built model instead of `parallelize` (`tpkit.pipeline` of a path: one rank's stages, their tensors read).

    Other keywords are transformers' `from_pretrained`'s, taken as it takes them (`transformers_kwargs`):
    `attn_implementation=` (and `experts_implementation=`) build the model so, `torch_dtype=` is `dtype`'s old name,
    a config attribute (`use_cache=False`, ...) is set on the config; keywords for finding a model on the Hub are
    moot for a directory and unused; `device_map`, `tp_plan`, `quantization_config`, `trust_remote_code`, ... raise
    `ValueError` naming tpkit's way."""
    path, comm = os.fspath(path), resolve_comm(comm)
    device = load_device(device, comm)
    error, source, config, quant = None, None, None, None
    try:
        source = open_source(path, comm.rank, comm.world_size)
        config = load_config(source, path)
        quant = read_quantization((source.config or {}).get("quantization_config"))
    except Exception as exc:  # every rank reaches agree(), whatever failed
        error = exc
    agree(comm, error)
    build_kwargs, torch_dtype = transformers_kwargs(dict(kwargs), config)
    target_dtype = resolve_dtype(dtype if dtype is not None or torch_dtype is None else torch_dtype, config, source)
    model = build(config, model_cls, target_dtype, build_kwargs)
    _set_generation_config(model, path, source)
    notes: list[str] = []
    quantized, find = _quantized_layers(model, source, quant, target_dtype, dequantize, comm, notes)
    plan, recorded, cached = _decided_plan(model, config, source, plan, convert is None and quantized is None,
                                           target_dtype, build_kwargs, comm, mode, reuse)
    if convert is None:  # (a pipeline's `convert` refuses quantized models itself)
        convert = lambda m: parallelize(m, plan, comm, mode=mode, recorded=recorded, reuse=reuse,  # noqa: E731
                                        quantization=quantized)
    _convert(model, convert, cached, recorded, comm.rank)
    find = find or key_finder(model, source, notes)  # after the conversion: a pipeline stage's copies of tied weights
    materialize(model, device)
    place_buffers(model, device)
    error, targets, held = None, [], {}
    try:
        if quantized is not None and dequantize:
            held = dequantized.holders(model, quantized, device)
        targets = model_targets(model, source, find, strict=False, missing_ok=_not_in_files(model, held))
        targets += dequantized.targets(source, held, find)
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
    dequantized.fill_weights(model, held)
    finish_loading(model)
    return model.eval()


def _set_generation_config(model: nn.Module, path: str, source: Source) -> None:
    """As transformers does: the directory's generation_config.json (or the manifest's) on the model."""
    generation = load_generation_config(path, source.manifest)
    if generation is not None and getattr(model, "generation_config", None) is not None:
        model.generation_config = generation


def _decided_plan(model: nn.Module, config, source: Source, plan, parallelized_dense: bool, dtype: torch.dtype,
                  build_kwargs: dict, comm, mode: str, reuse: bool | None):
    """(the plan to convert with, whether it is applied as recorded, the plan cache's key or None): a tpkit
    checkpoint's recorded plan (`recorded_plan`); for "auto" on a dense checkpoint that `parallelize` converts, the
    plan cache's (`plan_cache.lookup`); else `plan` as given."""
    plan, recorded = recorded_plan(source, plan, comm.world_size, mode)
    if recorded or not parallelized_dense or not (isinstance(plan, str) and plan == "auto"):
        return plan, recorded, None
    return plan_cache.lookup(model, config, source, dtype, build_kwargs, comm, mode, reuse)


def _convert(model: nn.Module, convert: Callable[[nn.Module], None], cached: str | None, recorded: bool,
             rank: int) -> None:
    """`convert(model)`; under the plan cache's key `cached`, the plan decided is stored (by rank 0) unless the
    model's forward replaced some of its modules meanwhile (`Plan.replaced_by_forward`: applied as recorded, without
    that forward, it would meet the modules from before), and a stored plan that fails is deleted (`plan_cache`)."""
    try:
        convert(model)
    except Exception as exc:
        if cached is not None and recorded:
            plan_cache.forget(cached, exc)
        raise
    if cached is not None and not recorded and rank == 0 and not conversion_of(model).plan.replaced_by_forward:
        plan_cache.write(cached, conversion_of(model).plan)


def _quantized_layers(model: nn.Module, source, quant, dtype, dequantize: bool, comm, notes: list[str]):
    """(which layers the checkpoint stores quantized, built so by the conversion: planned once on every rank; the key
    finder it planned with), or (None, None) for a dense checkpoint. The stacked per-expert tensors join `source`
    first: the finder reads them."""
    if quant is None:
        return None, None
    error, quantized, find = None, None, None
    try:
        experts, taken = quantized_expert_entries(model, source, quant)
        find = key_finder(model, source, notes)
        quantized = plan_quantized(model, quant, dtype, find, lambda k: _entry_dtype(source, k),
                                   stored_keys(source, quant), packed=not dequantize, experts=experts, taken=taken)
    except Exception as exc:  # every rank reaches agree(), whatever failed
        error = exc
    agree(comm, error)
    return quantized, find


def _not_in_files(model: nn.Module, held: dict[str, nn.Module]):
    """Which model keys a checkpoint need not hold: buffers computed by the model (not a quantized layer's stored
    tensors), and the dense weights of layers loaded dequantized (computed from their stored tensors)."""
    stored = set(record_layouts(dict(model.named_modules())))
    computed = {n for n, _ in model.named_buffers() if n not in stored} | {k for k, _ in dequantized.dense_keys(held)}
    return computed.__contains__
