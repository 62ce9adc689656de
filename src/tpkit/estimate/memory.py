"""Memory per rank before buying the devices: parameters, gradients, optimizer states, activations,
KV cache and communication buffers, at world size 1 and at world size t.

Transformers (a Hugging Face config, or a model that carries one) are estimated from their shape alone,
so a 70B model costs nothing to estimate. Other modules are measured on one small real step and scaled.

`estimate_memory` is the entry: it checks the options, then takes the formula path (`activations`, `params`,
`communication`) for a transformer or the measured path (`step`, `measure`) for any other module; both end in
the same `MemoryEstimate`.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn

from ..convert.peft.adapters import adapter_tensors, bare_model, peft_layers
from ..convert.planning.decide import plan
from ..quant import config_quantization
from .activations import (context_extra_bytes, normalise_recompute, transformer_activation_bytes,
                          transformer_inference_bytes)
from .calls import with_layers
from .communication import largest_collective_bytes
from .config import attention_kind, config_value, own_dtype, resolve_target
from .context import attention_method, check_cp, local_tokens
from .experts import check_ep, memory_experts
from .measure import measure_step
from .params import (OPTIMIZERS, analysed_parameters, fullest_quantized, optimizer_bytes_per_parameter,
                     parameter_counts, quantized_weights)
from .ranks import rank_heads
from .report import MODES, Breakdown, MemoryEstimate
from .step import prepare_module_step


def estimate_memory(model_or_config, world_size: int, dtype: torch.dtype | None = None,
                    mode: str = "inference", optimizer: str = "adamw", batch_size: int = 1,
                    seq_len: int | None = None, sequence_parallel: bool = False, recompute="none",
                    attention: str | None = None, master_weights: bool | None = None,
                    example_input=None, input_shape: Iterable[int] | None = None, dp_size: int = 1,
                    dp_mode: str | None = None, cp: int = 1, cp_method: str = "auto", ep: int = 1) -> MemoryEstimate:
    """Estimate memory on one device and per rank at TP `world_size`.

    `model_or_config`: a Hugging Face config, a model with a `.config`, or any `nn.Module` (then pass
    `example_input` or `input_shape` with a batch dimension first; activations are measured on one step
    of a copy and scaled by `batch_size`). `dtype`: of parameters and activations; default the model's
    own, bfloat16 for a config. `attention`: "eager" or "sdpa"/"flash" (default: the config's own
    implementation, else fused). Inference counts the forward working set of `batch_size` x `seq_len`
    tokens and a KV cache of `seq_len` positions; training counts gradients, optimizer states (see
    `optimizer_bytes_per_parameter`) and activations kept for backward.

    Training activations come from the traced graph (`traced.py`: the bytes a fake forward of this rank's
    converted copy saves for backward) when the model can be built and converted; else from the formula
    (`activations.py`, also reported as `activations_formula`), and recompute other than "none" always does.

    2-D layouts: `world_size` is the TP size; `dp_size` data-parallel replicas of it (world_size * dp_size
    devices in all). `dp_mode="fsdp"`: each rank's TP-local parameters, gradients and optimizer states are
    further cut by FSDP2 along dim 0 of every local tensor (ceil(rows / dp_size) rows, padded); `"ddp"`: they
    are replicated. Either way `batch_size` is the local micro-batch, so activations do not change.

    Context parallelism (training a transformer): `cp` ranks share each sequence (`tpkit.context_parallel`,
    `cp_method` "auto", "all_to_all" or "ring"); per rank, the activations of its share of the tokens, traced as a
    plain sequence of that length, plus what the method keeps differently and one layer's working set
    (`activations.context_extra_bytes`). Weights, gradients and optimizer states are replicated over cp, except
    that `dp_mode="fsdp"` shards them over dp x cp (`dp_size` may then be 1), as tpkit's runs do.

    Expert parallelism (a model with fused experts, `tpkit.expert_parallel`): `ep` ranks of dp_size x cp x world_size
    share each MoE layer's experts (ep a multiple of `world_size`, dividing that product, at most the experts), TP
    keeping them whole; a rank holds its ceil(E / ep) experts, their gradients and optimizer states (counted whole
    under FSDP2 too, which at runtime shards them over the expert-data group: an upper bound there); everything else
    as without it (`experts.py`). `expert_parameters_per_rank` says how many it holds.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    dtype = dtype or own_dtype(model_or_config)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    recompute = normalise_recompute(recompute)
    _check_dp(dp_size, dp_mode)
    check_cp(cp, cp_method)
    check_ep(ep)
    if cp > 1 and mode != "training":
        raise ValueError(f"estimate_memory: context parallelism (cp={cp}) splits training sequences; generation runs "
                         f"with it off (tpkit.context_off) and holds the whole K/V cache: use mode='training'")
    if isinstance(model_or_config, nn.Module) and peft_layers(model_or_config)[1]:
        with bare_model(model_or_config) as (target, wrapped):  # PEFT LoRA: the bare model, then the adapter
            est = estimate_memory(target, world_size, dtype, mode, optimizer, batch_size, seq_len, sequence_parallel,
                                  recompute, attention, master_weights, example_input, input_shape, dp_size, dp_mode,
                                  cp, cp_method, ep)
            the_plan = plan(target, world_size, mode=mode) if world_size > 1 else None
        return _with_adapter(est, wrapped, the_plan, optimizer, master_weights)
    config, shape = resolve_target(model_or_config, "estimate_memory")
    if cp > 1 and shape is None:
        raise ValueError(f"estimate_memory: context parallelism (cp={cp}) splits the attention of a Hugging Face "
                         f"transformer; {type(model_or_config).__name__} has no config tpkit models")
    engine = dp_size * cp if dp_mode == "fsdp" else dp_size  # FSDP2 shards over dp x cp, DDP averages over dp
    dp = (engine, dp_mode if engine > 1 else None)
    experts = memory_experts(model_or_config, dtype, ep, world_size, dp_size, cp, shape is not None)
    if shape is not None:
        counted = _counted(model_or_config, shape, world_size, mode, dtype, experts)
        est = _estimate_transformer(shape, config, world_size, dtype, mode, optimizer, batch_size, seq_len,
                                    sequence_parallel, recompute, attention, master_weights, counted,
                                    model_or_config, dp, (cp, cp_method), (ep, experts))
    else:
        est = _estimate_module(model_or_config, world_size, dtype, mode, optimizer, batch_size, master_weights,
                               example_input, input_shape, seq_len, dp)
    est.dp_size, est.dp_mode = dp_size, dp[1]
    if cp > 1 and dp[1] == "fsdp":
        est.notes.append(f"FSDP2 shards over dp x cp = {engine} ranks (every rank that holds the same weights)")
    return est


def _counted(model_or_config, shape, world_size: int, mode: str, dtype, experts) -> tuple[int, int] | None:
    """(parameters, on the fullest rank) as the converter counts them: a model object's own analysis, a MoE config's
    weightless build (the shape's formula has no experts); None: the formula's."""
    if isinstance(model_or_config, nn.Module):
        return analysed_parameters(model_or_config, world_size, mode)
    if experts is not None:
        return analysed_parameters(with_layers(model_or_config, None, shape.num_layers, dtype), world_size, mode)
    return None


def _with_adapter(est: MemoryEstimate, wrapped: dict, the_plan, optimizer: str,
                  master_weights: bool | None) -> MemoryEstimate:
    """`est` (of the bare model) for LoRA training: the adapter's weights added (split as its base layers), the
    base frozen, so gradients and optimizer states are the adapter's only. Activations are the bare model's (the
    adapter's `r` features per token and target are not counted)."""
    dtype = getattr(torch, est.dtype)
    B, training = dtype.itemsize, est.mode == "training"
    opt = optimizer_bytes_per_parameter(optimizer, dtype, master_weights) if training else 0
    out = []
    for world, b in ((1, est.single), (est.world_size, est.per_rank)):
        records = adapter_tensors(wrapped, the_plan, world)
        held = sum(t["per_rank"] for t in records)
        trained = sum(t["per_rank"] for t in records if t["trainable"]) if training else 0
        out.append((held, dataclasses.replace(b, parameters=b.parameters + held * B, gradients=trained * B,
                                              optimizer_states=trained * opt)))
    (one, est.single), (rank, est.per_rank) = out
    est.parameters_total += one
    est.parameters_per_rank += rank
    if training:
        est.notes.append(f"LoRA: the base model is frozen; gradients and {optimizer} states for the adapter's "
                         f"{rank} parameters per rank only")
    return est


def _check_dp(dp_size, dp_mode) -> None:
    if not isinstance(dp_size, int) or isinstance(dp_size, bool) or dp_size < 1:
        raise ValueError(f"estimate_memory: dp_size must be a positive int, got {dp_size!r}")
    if dp_mode not in (None, "fsdp", "ddp"):
        raise ValueError(f"estimate_memory: dp_mode must be None, 'fsdp' or 'ddp', got {dp_mode!r}")
    if dp_size > 1 and dp_mode is None:
        raise ValueError(f"estimate_memory: dp_size={dp_size} needs dp_mode='fsdp' (shard parameters, gradients "
                         f"and optimizer states over the replicas) or 'ddp' (replicate them)")


def _assemble(world_size, dtype, mode, optimizer, batch_size, seq_len, sequence_parallel, recompute, master_weights,
              params_one, params_rank, act_one, act_rank, kv_one, kv_rank, comm_rank, comm_what, notes,
              params_sharded=None, quantized=((0, 0), (0, 0)), **extra):
    """The result. `params_sharded`: parameters a rank holds after FSDP (default `params_rank`); `quantized`:
    (weights, stored bytes) on one device and per rank of the layers a quantized checkpoint stores packed (frozen:
    no gradient, no optimizer state)."""
    B = dtype.itemsize
    training = mode == "training"
    opt = optimizer_bytes_per_parameter(optimizer, dtype, master_weights) if training else 0

    def breakdown(params, acts, kv, comm, packed):
        dense = params - packed[0]
        return Breakdown(parameters=dense * B + packed[1], gradients=dense * B if training else 0,
                         optimizer_states=dense * opt, activations=acts, kv_cache=kv, communication_buffers=comm)

    held = params_rank if params_sharded is None else params_sharded
    return MemoryEstimate(world_size, mode, str(dtype).replace("torch.", ""), optimizer if training else "none",
                          batch_size, seq_len, sequence_parallel, recompute,
                          single=breakdown(params_one, act_one, kv_one, 0.0, quantized[0]),
                          per_rank=breakdown(held, act_rank, kv_rank, comm_rank, quantized[1]),
                          parameters_total=params_one, parameters_per_rank=held,
                          largest_collective=comm_what, notes=notes, **extra)


def _even(shape, t: int) -> bool:
    """Every split divides, so all ranks hold the same and tracing rank 0 is enough."""
    kv = shape.num_kv_heads
    return (shape.num_heads % t == 0 and shape.intermediate_size % t == 0 and shape.vocab_size % t == 0
            and (kv % t == 0 or t % kv == 0))


def _traced(subject, world_size, dtype, batch_size, seq_len, sequence_parallel, attention, even, example=None,
            local=None, ep=1):
    """(traced step at t=1, at t=world_size) or (None, why): the graph path of the estimate (`traced.py`); the
    second at `local` tokens when given (a context-parallel rank's share of the sequence), its experts over `ep`."""
    from .traced import trace_fullest_rank

    local = local or seq_len
    try:
        one = trace_fullest_rank(subject, 1, dtype, batch_size, seq_len, False, attention, example, True)
        many = one if world_size == 1 and local == seq_len and ep == 1 else trace_fullest_rank(
            subject, world_size, dtype, batch_size, local, sequence_parallel, attention, example, even, ep)
    except Exception as exc:  # noqa: BLE001 - the formula / measured path stands, and the note says why
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"
    return (one, many), ""


def _fsdp_note(dp) -> str:
    size, how = dp
    return (f"{how} over {size} data-parallel replicas: " + (
        "parameters, gradients and optimizer states are FSDP2 shards (dim 0 of each TP-local tensor, padded); "
        "a layer's parameters are all-gathered while it runs" if how == "fsdp" else
        "parameters, gradients and optimizer states replicated; gradients all-reduced")
        + "; activations are for the local micro-batch")


def _estimate_transformer(shape, config, world_size, dtype, mode, optimizer, batch_size, seq_len, sequence_parallel,
                          recompute, attention, master_weights, counted, subject, dp, context=(1, "auto"),
                          experts=(1, None)) -> MemoryEstimate:
    if seq_len is None:
        seq_len = min(int(config_value(config, "max_position_embeddings", "n_positions", default=2048)), 4096)
    B = dtype.itemsize
    kind = attention_kind(config, attention)
    if counted is not None:
        params_one, params_rank = counted
    else:
        params_one = sum(parameter_counts(shape, 1).values())
        params_rank = sum(parameter_counts(shape, world_size).values())
    notes = [f"{shape.model_type}: {shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_heads} heads "
             f"({shape.num_kv_heads} KV), MLP {shape.intermediate_size}{' gated' if shape.gated_mlp else ''}, "
             f"vocab {shape.vocab_size}; {kind} attention"]
    notes += _layout_notes(shape, world_size)
    sp = sequence_parallel and world_size > 1
    cp = context[0]
    local = local_tokens(seq_len, cp)
    traced, why = (None, "")
    if mode == "training" and recompute == "none" or dp[1] == "fsdp":
        traced, why = _traced(subject, world_size, dtype, batch_size, seq_len, sp, attention,
                              _even(shape, world_size), local=local, ep=experts[0])
    extra = {}
    if traced is not None:
        params_one, params_rank = traced[0].parameters(), traced[1].parameters()
    held = _expert_share(experts, world_size, traced, extra, notes)
    if experts[0] > 1 and traced is None:  # counted with the TP plan's experts: the rank's share of them instead
        params_rank += held - experts[1].held(1, world_size)
    if dp[1] == "fsdp":
        spread = held if experts[0] > 1 else 0  # counted whole: an upper bound (FSDP2 shards them over edp)
        extra["params_sharded"] = (traced[1].parameters(dp[0]) if traced is not None
                                   else -(-(params_rank - spread) // dp[0]) + spread)
        notes.append(_fsdp_note(dp) + ("" if traced is not None else f" (per-tensor padding not counted: {why})"))
    elif dp[1] == "ddp":
        notes.append(_fsdp_note(dp))
    if mode == "training":
        acts = _training_activations(shape, batch_size, seq_len, B, world_size, sp, recompute, kind, traced, why,
                                     context, notes, extra)
        kv = [0.0, 0.0]
        opt = optimizer_bytes_per_parameter(optimizer, dtype, master_weights)
        notes.append(f"optimizer {optimizer}: {opt} bytes per parameter"
                     + (" (fp32 master copy + fp32 states)" if opt and B <= 2 and master_weights is not False else ""))
    else:
        one = transformer_inference_bytes(shape, batch_size, seq_len, B, 1, kind)
        many = transformer_inference_bytes(shape, batch_size, seq_len, B, world_size, kind)
        acts = [one["activations"], many["activations"]]
        kv = [one["kv_cache"], many["kv_cache"]]
    quant = config_quantization(config)
    if quant is not None:
        extra["quantized"] = (quantized_weights(shape, quant, 1, 0, dtype),
                              fullest_quantized(shape, quant, world_size, dtype))
        w, b = extra["quantized"][0]
        notes.append(f"linear layers stored quantized ({quant.describe()}): {b / max(w, 1):.3f} bytes per weight as "
                     f"stored, frozen in training (no gradient or optimizer state)")
    comm, what = largest_collective_bytes(shape, batch_size, local, B, world_size, mode, sequence_parallel)
    return _assemble(world_size, dtype, mode, optimizer, batch_size, seq_len, sequence_parallel, recompute,
                     master_weights, params_one, params_rank, acts[0], acts[1], kv[0], kv[1], comm, what, notes,
                     **extra)


def _expert_share(experts, world_size, traced, extra: dict, notes: list) -> int:
    """Expert parameters the fullest rank holds (traced when `traced`; `extra` and `notes` filled in); 0 without
    experts counted apart."""
    ep, layers = experts
    if layers is None:
        return 0
    held = traced[1].expert_parameters() if traced is not None and ep > 1 else layers.held(ep, world_size)
    extra.update(ep=ep, expert_parameters_per_rank=held)
    whole = -(-layers.num_experts // ep)
    notes.append(f"{len(layers.infos)} MoE layers of {layers.num_experts} experts: " + (
        f"expert parallel over ep {ep}, each rank holds {whole} of them whole (the fullest), with their gradients and "
        f"optimizer states (summed over the ranks holding the same experts; counted whole under FSDP2, which shards "
        f"them over those ranks: an upper bound)"
        if ep > 1 else f"{held:,} expert parameters per rank as the TP plan splits them (ep 1)"))
    return held


def _training_activations(shape, batch_size, seq_len, B, world_size, sp, recompute, kind, traced, why, context,
                          notes: list, extra: dict) -> list[float]:
    """[activations on one device, per rank] of a training step (`notes` and `extra` filled in): traced when
    `traced` (the fake forward's saved bytes) and no recompute, else by formula; under context parallelism
    (`context` = (cp, method asked)) the rank's share of the tokens, plus what the method changes
    (`context_extra_bytes`, by formula on top of a trace)."""
    cp, asked = context
    formula = [sum(transformer_activation_bytes(shape, batch_size, seq_len, B, t, sp and t > 1, recompute, kind,
                                                cp=c, cp_method=asked).values())
               for t, c in ((1, 1), (world_size, cp))]
    acts = formula
    extra["activations_formula"] = formula[1]
    if traced is not None and recompute == "none":
        added = context_extra_bytes(shape, batch_size, seq_len, B, world_size, sp, recompute, kind, cp, asked)
        acts = [traced[0].activations, traced[1].activations + added]
        extra.update(activation_method="traced", activations_per_layer=traced[1].per_layer)
        notes.append(f"activations traced (bytes a fake forward of this rank's converted copy saves for "
                     f"backward); formula cross-check {formula[1] / acts[1] - 1:+.0%}")
    elif recompute != "none":
        notes.append(f"activations by formula ({recompute} recompute is not traced)")
    else:
        notes.append(f"activations by formula: tracing failed ({why})")
    if cp > 1:
        method = attention_method(shape, world_size, cp, asked)
        local = local_tokens(seq_len, cp)
        extra.update(cp=cp, cp_method=method)
        notes.append(f"context parallel over cp {cp} ({method} attention): each rank holds {local} of the {seq_len} "
                     f"tokens (zigzag split, padded to a multiple of {2 * cp})"
                     + (", traced at that length plus what the method keeps and its working set by formula"
                        if extra.get("activation_method") == "traced" else "")
                     + "; weights, gradients and optimizer states replicated over cp")
    return acts


def _layout_notes(shape, world_size) -> list[str]:
    notes = []
    if not rank_heads(shape.num_heads, shape.num_kv_heads, world_size)[2]:
        notes.append(f"{shape.num_heads} query heads in {shape.num_kv_heads} KV groups have no layout over "
                     f"{world_size} ranks: attention is not split by heads; its projections are counted split "
                     f"alone (output all-gathered), as the planner splits them")
    elif shape.num_kv_heads < world_size:
        notes.append(f"{shape.num_kv_heads} KV heads < world size {world_size}: each rank holds a replica of the "
                     f"KV heads its query heads use")
    if shape.num_heads % world_size or shape.intermediate_size % world_size or shape.vocab_size % world_size:
        notes.append("uneven split (heads, MLP width or vocabulary not divisible): figures are the fullest rank's")
    return notes


def _estimate_module(model, world_size, dtype, mode, optimizer, batch_size, master_weights, example_input,
                     input_shape, seq_len, dp) -> MemoryEstimate:
    step = prepare_module_step(model, world_size, dtype, mode, example_input, input_shape, seq_len)
    scale = batch_size / step["batch"]
    training = mode == "training"
    m = measure_step(step["work"], step["args"], step["kwargs"], step["styles"], world_size, training)
    B = dtype.itemsize
    params_one, params_rank = m["parameter_bytes"] / B, m["parameter_bytes_per_rank"] / B
    acts = [m["activations"] * scale, m["activations_per_rank"] * scale]
    traced, extra, how = None, {}, "measured on one fake step"
    if training or dp[1] == "fsdp":
        example = step["kwargs"] if step["kwargs"] else step["args"]
        traced, why = _traced(model, world_size, dtype, step["batch"], seq_len or 1, False, None, False, example)
        if traced is None:
            how += f" (tracing the converted copy failed: {why})"
    if traced is not None:
        params_one, params_rank = traced[0].parameters(), traced[1].parameters()
        if training:
            acts = [traced[0].activations * scale, traced[1].activations * scale]
            how, extra["activation_method"] = "traced on this rank's converted copy", "traced"
    elif step["styles"] is not None:  # the converter's own count of the plan's shard shapes (packed, heads)
        try:
            counted = analysed_parameters(model, world_size, mode, step["planned_inputs"])
        except Exception:  # noqa: BLE001 - the measured count above stands
            counted = None
        if counted is not None:
            params_one, params_rank = counted
    if training and traced is None:
        extra["activation_method"] = "measured"
    notes = [f"{type(model).__name__}: activations {how} with batch {step['batch']} and scaled linearly to batch "
             f"{batch_size}" + ("; a loss computed outside the model is not counted" if training else "")]
    notes += step["notes"]
    if dp[1] is not None:
        notes.append(_fsdp_note(dp))
    if dp[1] == "fsdp":
        extra["params_sharded"] = traced[1].parameters(dp[0]) if traced is not None else -(-int(params_rank)
                                                                                             // dp[0])
    return _assemble(world_size, dtype, mode, optimizer, batch_size, None, False, "none", master_weights,
                     int(params_one), int(params_rank), acts[0], acts[1], 0.0, 0.0, m["communication"] * scale,
                     "largest all-reduce / all-gather result seen in the step" if world_size > 1 else
                     "none (world size 1)", notes, **extra)
