"""Parameters and optimizer states per rank.

A transformer is counted from its shape as tpkit shards it (`parameter_counts`); a model object by the
converter's own analysis (`analysed_parameters`), so any head or model class is exact. Gradients are one copy
of the parameters in the training dtype; optimizer states follow mixed precision
(`optimizer_bytes_per_parameter`).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import TransformerShape
from .ranks import rank_widths

OPTIMIZERS = ("adamw", "sgd", "none")


def fullest_rank(shape: TransformerShape, world_size: int) -> int:
    """The rank holding the most parameters (rank 0 but for some uneven GQA layouts)."""
    totals = [sum(parameter_counts(shape, world_size, r).values()) for r in range(world_size)]
    return totals.index(max(totals))


def parameter_counts(shape: TransformerShape, world_size: int = 1, rank: int | None = None) -> dict[str, int]:
    """Parameters held by `rank` (default: the fullest rank) at TP `world_size`, by part, as tpkit shards.

    Column linears (q, k, v, gate, up, fc1) split their output and bias; row linears (o, down, fc2) split
    their input and keep the whole bias; the token embedding and the LM head split the vocabulary
    (`split_sizes`); learned position and token-type tables stay whole (splitting them would cost an
    all-reduce for little memory, so the planner replicates them); norms are replicated; tied weights count
    once.
    """
    t, h, d = world_size, shape.hidden_size, shape.head_dim
    if rank is None:
        rank = fullest_rank(shape, t) if t > 1 else 0
    q_heads, kv_heads, f, vocab = rank_widths(shape, t, rank)
    q, kv = q_heads * d, kv_heads * d
    norm = h * (2 if shape.norm_bias else 1)
    if shape.vocab_size < t:  # too few rows to split: whole on every rank
        vocab = shape.vocab_size

    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if shape.qkv_bias else 0) + (h if shape.out_bias else 0)
    mlp_in = 2 if shape.gated_mlp else 1
    mlp = mlp_in * h * f + f * h + (mlp_in * f + h if shape.mlp_bias else 0)
    embeddings = vocab * h  # position and token-type tables stay whole, as the planner decides
    embeddings += (shape.position_embeddings + shape.position_offset + shape.token_type_embeddings) * h
    lm_head = 0 if shape.tied_embeddings else vocab * h
    if shape.mlm_head:  # BERT: transform dense + LayerNorm (replicated), decoder bias (vocab-split)
        lm_head += h * h + h + 2 * h + vocab
    norms = shape.num_layers * 2 * norm + (norm if shape.final_norm else 0) + (norm if shape.embedding_norm else 0)
    return {"embeddings": embeddings, "attention": shape.num_layers * attention, "mlp": shape.num_layers * mlp,
            "norms": norms, "lm_head": lm_head}


def optimizer_bytes_per_parameter(optimizer: str, dtype: torch.dtype, master_weights: bool | None = None) -> int:
    """Optimizer state bytes per parameter (mixed precision by default for 16-bit parameters).

    AdamW keeps two moments in fp32 (8 bytes); with 16-bit parameters the standard mixed-precision recipe
    (Megatron, DeepSpeed) also keeps an fp32 master copy (4 more: 12). SGD keeps an fp32 momentum (4), plus
    the master copy for 16-bit parameters. Pass `master_weights=False` for plain `torch.optim` on bf16 params,
    whose states are in the parameter dtype.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    states = {"adamw": 2, "sgd": 1, "none": 0}[optimizer]
    if states == 0:
        return 0
    sixteen_bit = dtype.itemsize <= 2
    if master_weights is None:
        master_weights = sixteen_bit
    if master_weights:
        return 4 * states + (4 if sixteen_bit else 0)
    return states * dtype.itemsize


def analysed_parameters(model: nn.Module, world_size: int, mode: str, example=None) -> tuple[int, int] | None:
    """(parameters, parameters on the fullest rank) of a model object from the converter's analysis: the very
    plan `parallelize` applies, so any head or class (sequence classification, a bare encoder) is exact."""
    from ..convert import analyze

    first = next(model.parameters(), None)
    if first is None:
        return None
    report = analyze(model, world_size=world_size, max_world_size=world_size, mode=mode, device_memory=0,
                     example_inputs=example)
    elem = first.element_size()
    return report.per_rank_bytes[1] // elem, report.per_rank_bytes[world_size] // elem
