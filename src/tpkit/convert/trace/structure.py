"""Step 1 of conversion (trace): what a model is made of, independent of the world size.

`analyze_structure` runs the model's forward once on tiny inputs under the dataflow tracer (`dataflow.py`), then
finds its column -> row pairs (`pairs.py`) and its tied weights. The result, an `Analysis`, is remembered per
model object so `analyze`, `plan` and `parallelize` in a row trace a large model once.
"""
from __future__ import annotations

import contextlib
import copy as copying
import inspect
import dataclasses
import weakref
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from ..modules import is_conv2d, is_embedding, is_linear, linear_dims
from ..roles import Pair, Role
from .dataflow import Trace, parameterised_leaves, trace
from .analogy import towers, twins
from .pairs import find_pairs


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What the planner learned about a model, independent of the world size."""

    model: nn.Module
    leaves: Mapping[str, nn.Module]
    trace: Trace | None
    trace_error: str | None
    structures: Mapping[str, Role]       # module -> its role in an attention / MLP / conv pair
    pairs: tuple[Pair, ...]
    notes: Mapping[str, str]             # module -> why it is not part of a pair
    ties: Mapping[str, list[str]]        # module -> other modules sharing its weight
    total_params: int
    prefix: str | None
    traced_alone: frozenset[str] = frozenset()  # layers run only by a tower's own trace (analogy.towers)
    copy_bytes: int = 0                  # bytes a real copy holds (meta tensors as zeros): decides how it is run

    @property
    def untraced(self) -> bool:
        """Made without a trace on purpose (`untraced_structure`: a recorded plan's model, the whole model of a cut),
        not after a trace that failed: the plan applied on it had its dataflow checked where it was made."""
        return self.trace is None and self.trace_error is None


def default_inputs(model: nn.Module, seq: int = 4) -> list:
    """Tiny inputs to try for the trace, in order: HF models get token ids (an encoder-decoder its decoder's
    too), pixels or audio features, then the model's own `dummy_inputs`; others a batch shaped for their first
    layer, as [batch, features] and then [batch, seq, features]. `seq`: the token sequence's length (sequence
    parallelism's dry run needs one that divides by the world size). A model on the meta device gets meta ids first,
    then real ones (an embedding looks real ids up in a meta table): a forward may read their values (transformers'
    padding warning compares them with `pad_token_id`), which meta ids do not have."""
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    dtype = params[0].dtype if params and params[0].is_floating_point() else None
    cfg = getattr(model, "config", None)
    main = _main_input(model)
    if cfg is not None and main == "input_ids":
        both = getattr(cfg, "is_encoder_decoder", False)
        tried = []
        for at in [device] + ([torch.device("cpu")] if device.type == "meta" else []):
            ids = torch.full((2 if both else 1, seq), _plain_token(cfg), dtype=torch.long, device=at)
            tried.append({"input_ids": ids, "decoder_input_ids": ids} if both else {"input_ids": ids})
        return [*tried, *_own_dummy_inputs(model, device)]
    if cfg is not None and main == "pixel_values":
        size = getattr(cfg, "image_size", 32)
        size = size if isinstance(size, int) else size[0]
        return [{"pixel_values": torch.zeros(1, getattr(cfg, "num_channels", 3), size, size, device=device,
                                             dtype=dtype)}, *_own_dummy_inputs(model, device)]
    if cfg is not None and main == "input_features" and hasattr(cfg, "num_mel_bins"):
        frames = 2 * getattr(cfg, "max_source_positions", 8)  # Whisper-style encoders take exactly this many
        return [{"input_features": torch.zeros(1, cfg.num_mel_bins, frames, device=device, dtype=dtype)},
                *_own_dummy_inputs(model, device)]
    for m in model.modules():
        dtype = next(m.parameters(), torch.empty(0)).dtype
        if is_linear(m) or isinstance(m, nn.LayerNorm):
            n = linear_dims(m)[0] if is_linear(m) else m.normalized_shape[-1]
            return [(torch.zeros(2, n, device=device, dtype=dtype),),
                    (torch.zeros(2, seq, n, device=device, dtype=dtype),)]
        if is_conv2d(m):
            return [(torch.zeros(2, m.in_channels, 16, 16, device=device, dtype=dtype),)]
        if is_embedding(m):
            return [(torch.zeros(2, seq, dtype=torch.long, device=device),)]
    raise ValueError(f"cannot guess an input for {type(model).__name__}; pass example_inputs")


def _plain_token(cfg) -> int:
    """A token id that is none of the config's special tokens (a model may treat those apart), 0 when it cannot
    tell."""
    special: set = set()
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, k, None)
        special.update(value if isinstance(value, (list, tuple)) else [value])  # eos may be a list of ids
    vocab = getattr(cfg, "vocab_size", None)
    return next((i for i in range(min(vocab, 8)) if i not in special), 0) if isinstance(vocab, int) else 0


def _own_dummy_inputs(model: nn.Module, device: torch.device) -> list:
    """[the model's `dummy_inputs` (transformers' models have them) on `device`], or [] where it has none; integer
    inputs of a meta model stay real (see `default_inputs`)."""
    try:
        dummy = getattr(model, "dummy_inputs", None)
    except Exception:  # noqa: BLE001 - a property that fails is no input to try
        return []
    if not isinstance(dummy, Mapping) or not dummy or not all(isinstance(v, torch.Tensor) for v in dummy.values()):
        return []
    return [{k: v if device.type == "meta" and not v.is_floating_point() else v.to(device) for k, v in dummy.items()}]


def _main_input(model: nn.Module) -> str | None:
    """The model's main input: its `main_input_name`, unless its forward's first argument is another input
    kind (a vision encoder that inherits `input_ids` but reads `pixel_values`) or its forward takes no argument of
    that name (an audio encoder that inherits `input_ids` and reads `hidden_states`: its first argument then)."""
    main = getattr(model, "main_input_name", None)
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return main
    first = names[0] if names else None
    if first in ("pixel_values", "input_features") and first != main:
        return first
    return first if main is not None and main not in names else main


def _ties(leaves: dict[str, nn.Module]) -> dict[str, list[str]]:
    owners: dict[int, list[str]] = {}
    for name, m in leaves.items():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor):
            owners.setdefault(id(w), []).append(name)
    out = {}
    for names in owners.values():
        if len(names) > 1:
            for n in names:
                out[n] = [o for o in names if o != n]
    return out


_CACHE: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def structure_signature(modules: Mapping[str, nn.Module]) -> tuple:
    """What the analysis depends on: every module's name, class and parameter shapes (and identities)."""
    return tuple((n, type(m), tuple((k, tuple(p.shape), id(p)) for k, p in m.named_parameters(recurse=False)))
                 for n, m in modules.items())


def analyze_structure(model: nn.Module, example_inputs: Any = None, seq: int = 4) -> Analysis:
    """Trace the model once and find its attention blocks and column -> row pairs (world-size free).

    With the default inputs (sequences of `seq`) the result is remembered per model object until its modules or
    parameter shapes change, so `analyze`, `plan` and `parallelize` in a row trace a large model once."""
    if example_inputs is not None or seq != 4:
        return trace_structure(model, example_inputs, seq)
    modules = dict(model.named_modules())  # walked once: the signature and the trace read it
    sig = structure_signature(modules)
    hit = _CACHE.get(model)
    if hit is not None and hit[0] == sig:
        return dataclasses.replace(hit[1], model=model)
    a = trace_structure(model, None, modules=modules)
    _CACHE[model] = (sig, dataclasses.replace(a, model=None))
    return a


def untraced_structure(model: nn.Module, modules: Mapping[str, nn.Module] | None = None) -> Analysis:
    """The structure without a trace (leaves, ties, prefix): enough to apply a plan recorded for this model
    before, not to make or check one. `modules`: the model's by name, when the caller walked them."""
    leaves = parameterised_leaves(dict(model.named_modules()) if modules is None else modules)
    params = list(model.parameters())
    held = sum(t.nbytes for t in params + list(model.buffers()))  # a copy holds meta tensors as zeros
    return Analysis(model, leaves, None, None, {}, (), {}, _ties(leaves), sum(p.numel() for p in params),
                    base_prefix(model), copy_bytes=held)


def base_prefix(model: nn.Module) -> str | None:
    """The name of a transformers model's base model inside it (`model` in `LlamaForCausalLM`), which plan entries
    may leave out (as HF configs' `base_model_tp_plan` do); None when it has none."""
    prefix = getattr(model, "base_model_prefix", None) if hasattr(model, "config") else None
    return prefix if prefix and hasattr(model, prefix) else None


@contextlib.contextmanager
def traceable_experts(modules: Iterable[nn.Module]):
    """On the meta device, trace transformers' mixture-of-experts blocks through their `batched_mm` kernel:
    it computes the same sums as the others, but `grouped_mm`'s meta checks reject float32 and the eager
    loop asks which experts got tokens (`.item()`), and a failed trace would leave the whole model unsplit.
    Real tensors trace with the model's own choice. `modules`: every module of the model (what it reads: their
    parameters' device, their configs)."""
    modules = list(modules)
    on_meta = any(p is not None and p.device.type == "meta" for m in modules for p in m._parameters.values())
    configs = [m.config for m in modules if hasattr(getattr(m, "config", None), "_experts_implementation")]
    saved = [c._experts_implementation for c in configs]
    try:
        for c in configs:
            if on_meta and c._experts_implementation is not None:
                c._experts_implementation = "batched_mm"
        yield
    finally:
        for c, v in zip(configs, saved):
            c._experts_implementation = v


def trace_structure(model: nn.Module, example_inputs: Any = None, seq: int = 4,
                    modules: Mapping[str, nn.Module] | None = None) -> Analysis:
    """`analyze_structure` without the memory: trace the model as it is now (`modules`: its modules by name, when
    the caller walked them; the pairing and its helpers read them, not the model)."""
    modules = dict(model.named_modules()) if modules is None else modules
    analysis = untraced_structure(model, modules)
    try:
        candidates = default_inputs(model, seq) if example_inputs is None else [example_inputs]
    except ValueError as exc:
        return dataclasses.replace(analysis, trace_error=str(exc))
    error = None
    for inputs in candidates:
        try:
            with traceable_experts(modules.values()):
                found = trace(model, inputs, analysis.leaves)
        except Exception as exc:  # noqa: BLE001 - any failure means: no dataflow, replicate with the reason
            error = error or f"{type(exc).__name__}: {exc}"
            continue
        pairing = find_pairs(modules, dict(analysis.leaves), found)
        pairs, roles = twins(modules, analysis.leaves, found.calls, pairing.pairs, pairing.structures)
        alone = towers(modules, analysis.leaves, found.calls, trace_structure, roles)
        pairs, roles = pairs + alone.pairs, {**roles, **alone.roles}
        return dataclasses.replace(analysis, trace=found, structures={**pairing.structures, **roles},
                                   pairs=tuple(pairing.pairs) + tuple(pairs), notes={**pairing.notes, **alone.notes},
                                   traced_alone=frozenset(alone.ran))
    if example_inputs is None and _on_meta(model) and analysis.copy_bytes <= REAL_TRACE_BYTES:
        found = trace_structure(copy_on(model, meta=False), None, seq)  # a forward reading values, as in memory
        if found.trace is not None:
            return dataclasses.replace(found, model=model, leaves=analysis.leaves)
    return dataclasses.replace(analysis, trace_error=error or "no input to try")


REAL_TRACE_BYTES = 1 << 30  # a meta model whose forward needs values is traced on a zero-filled copy up to this


def _on_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))


def copy_on(model: nn.Module, meta: bool) -> nn.Module:
    """A deep copy of `model` with its parameters and buffers (and tensors kept as plain attributes) on the meta
    device when `meta`, else real: those on the meta device become zeros on the CPU, of their dtype and shape. A
    meta model's forward that reads values (`.item()`, a mask's `.all()`) runs on the real copy as the model's own
    would in memory, its dataflow the same (the trace here, the dry run in `planning/dryrun.py`)."""
    memo: dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in memo and meta != (t.device.type == "meta"):
            new = t.detach().to("meta") if meta else torch.zeros(t.shape, dtype=t.dtype)
            memo[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
    copy = copying.deepcopy(model, memo)
    for m in copy.modules():
        for k, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor) and meta != (v.device.type == "meta") and v.dim() > 0:
                setattr(m, k, v.to("meta") if meta else torch.zeros(v.shape, dtype=v.dtype))
    return copy
