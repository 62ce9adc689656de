"""Memory per rank before buying the devices: parameters, gradients, optimizer states, activations,
KV cache and communication buffers, at world size 1 and at world size t.

Transformers (a Hugging Face config, or a model that carries one) are estimated from their shape alone,
so a 70B model costs nothing to estimate. Other modules are measured on one small real step and scaled.

`estimate_memory` is the entry: it checks the options, then takes the formula path (`activations`, `params`,
`communication`) for a transformer or the measured path (`step`, `measure`) for any other module; both end in
the same `MemoryEstimate`.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .activations import _normalise_recompute, transformer_activation_bytes, transformer_inference_bytes
from .communication import largest_collective_bytes
from .config import _attention_kind, _get, _own_dtype, resolve_target
from .measure import measure_step
from .params import _OPTIMIZERS, _analysed_parameters, optimizer_bytes_per_parameter, parameter_counts
from .ranks import rank_heads
from .report import _MODES, Breakdown, MemoryEstimate
from .step import prepare_module_step


def estimate_memory(model_or_config, world_size: int, dtype: torch.dtype | None = None,
                    mode: str = "inference", optimizer: str = "adamw", batch_size: int = 1,
                    seq_len: int | None = None, sequence_parallel: bool = False, recompute="none",
                    attention: str | None = None, master_weights: bool | None = None,
                    example_input=None, input_shape: Iterable[int] | None = None) -> MemoryEstimate:
    """Estimate memory on one device and per rank at TP `world_size`.

    `model_or_config`: a Hugging Face config, a model with a `.config`, or any `nn.Module` (then pass
    `example_input` or `input_shape` with a batch dimension first; activations are measured on one step
    of a copy and scaled by `batch_size`). `dtype`: of parameters and activations; default the model's
    own, bfloat16 for a config. `attention`: "eager" or "sdpa"/"flash" (default: the config's own
    implementation, else fused). Inference counts the forward working set of `batch_size` x `seq_len`
    tokens and a KV cache of `seq_len` positions; training counts gradients, optimizer states (see
    `optimizer_bytes_per_parameter`) and activations kept for backward.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {optimizer!r}")
    dtype = dtype or _own_dtype(model_or_config)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    recompute = _normalise_recompute(recompute)
    config, shape = resolve_target(model_or_config, "estimate_memory")
    if shape is not None:
        counted = _analysed_parameters(model_or_config, world_size, mode) if isinstance(model_or_config,
                                                                                          nn.Module) else None
        return _estimate_transformer(shape, config, world_size, dtype, mode, optimizer, batch_size, seq_len,
                                     sequence_parallel, recompute, attention, master_weights, counted)
    return _estimate_module(model_or_config, world_size, dtype, mode, optimizer, batch_size, master_weights,
                            example_input, input_shape, seq_len)


def _assemble(world_size, dtype, mode, optimizer, batch_size, seq_len, sequence_parallel, recompute, master_weights,
              params_one, params_rank, act_one, act_rank, kv_one, kv_rank, comm_rank, comm_what, notes):
    B = dtype.itemsize
    training = mode == "training"
    opt = optimizer_bytes_per_parameter(optimizer, dtype, master_weights) if training else 0

    def breakdown(params, acts, kv, comm):
        return Breakdown(parameters=params * B, gradients=params * B if training else 0,
                         optimizer_states=params * opt, activations=acts, kv_cache=kv, communication_buffers=comm)

    return MemoryEstimate(world_size, mode, str(dtype).replace("torch.", ""), optimizer if training else "none",
                          batch_size, seq_len, sequence_parallel, recompute,
                          single=breakdown(params_one, act_one, kv_one, 0.0),
                          per_rank=breakdown(params_rank, act_rank, kv_rank, comm_rank),
                          parameters_total=params_one, parameters_per_rank=params_rank,
                          largest_collective=comm_what, notes=notes)


def _estimate_transformer(shape, config, world_size, dtype, mode, optimizer, batch_size, seq_len,
                          sequence_parallel, recompute, attention, master_weights, counted=None) -> MemoryEstimate:
    if seq_len is None:
        seq_len = min(int(_get(config, "max_position_embeddings", "n_positions", default=2048)), 4096)
    B = dtype.itemsize
    kind = _attention_kind(config, attention)
    if counted is not None:
        params_one, params_rank = counted
    else:
        params_one = sum(parameter_counts(shape, 1).values())
        params_rank = sum(parameter_counts(shape, world_size).values())
    notes = [f"{shape.model_type}: {shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_heads} heads "
             f"({shape.num_kv_heads} KV), MLP {shape.intermediate_size}{' gated' if shape.gated_mlp else ''}, "
             f"vocab {shape.vocab_size}; {kind} attention"]
    if not rank_heads(shape.num_heads, shape.num_kv_heads, world_size)[2]:
        notes.append(f"{shape.num_heads} query heads in {shape.num_kv_heads} KV groups have no layout over "
                     f"{world_size} ranks: attention is counted replicated")
    elif shape.num_kv_heads < world_size:
        notes.append(f"{shape.num_kv_heads} KV heads < world size {world_size}: each rank holds a replica of the "
                     f"KV heads its query heads use")
    if shape.num_heads % world_size or shape.intermediate_size % world_size or shape.vocab_size % world_size:
        notes.append("uneven split (heads, MLP width or vocabulary not divisible): figures are the fullest rank's")
    if mode == "training":
        acts = [sum(transformer_activation_bytes(shape, batch_size, seq_len, B, t, sequence_parallel and t > 1,
                                                 recompute, kind).values()) for t in (1, world_size)]
        kv = [0.0, 0.0]
        opt = optimizer_bytes_per_parameter(optimizer, dtype, master_weights)
        notes.append(f"optimizer {optimizer}: {opt} bytes per parameter"
                     + (" (fp32 master copy + fp32 states)" if opt and B <= 2 and master_weights is not False else ""))
    else:
        one = transformer_inference_bytes(shape, batch_size, seq_len, B, 1, kind)
        many = transformer_inference_bytes(shape, batch_size, seq_len, B, world_size, kind)
        acts = [one["activations"], many["activations"]]
        kv = [one["kv_cache"], many["kv_cache"]]
    comm, what = largest_collective_bytes(shape, batch_size, seq_len, B, world_size, mode, sequence_parallel)
    return _assemble(world_size, dtype, mode, optimizer, batch_size, seq_len, sequence_parallel, recompute,
                     master_weights, params_one, params_rank, acts[0], acts[1], kv[0], kv[1], comm, what, notes)


def _estimate_module(model, world_size, dtype, mode, optimizer, batch_size, master_weights, example_input,
                     input_shape, seq_len=None) -> MemoryEstimate:
    step = prepare_module_step(model, world_size, dtype, mode, example_input, input_shape, seq_len)
    scale = batch_size / step["batch"]
    training = mode == "training"
    notes = [f"{type(model).__name__}: activations measured on one step with batch {step['batch']} and scaled "
             f"linearly to batch {batch_size}" + ("; a loss computed outside the model is not counted" if training
                                                  else "")] + step["notes"]
    m = measure_step(step["work"], step["args"], step["kwargs"], step["styles"], world_size, training)
    B = dtype.itemsize
    params_one, params_rank = m["parameter_bytes"] / B, m["parameter_bytes_per_rank"] / B
    if step["styles"] is not None:  # the converter's own count of the plan's shard shapes (packed, heads)
        try:
            counted = _analysed_parameters(model, world_size, mode, step["planned_inputs"])
        except Exception:  # noqa: BLE001 - the measured count above stands
            counted = None
        if counted is not None:
            params_one, params_rank = counted
    return _assemble(world_size, dtype, mode, optimizer, batch_size, None, False, "none", master_weights,
                     int(params_one), int(params_rank), m["activations"] * scale, m["activations_per_rank"] * scale,
                     0.0, 0.0, m["communication"] * scale,
                     "largest all-reduce / all-gather result seen in the step" if world_size > 1 else
                     "none (world size 1)", notes)
