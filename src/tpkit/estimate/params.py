"""Parameters and optimizer states per rank.

A transformer is counted from its shape as tpkit shards it (`parameter_counts`); a model object by the
converter's own analysis (`analysed_parameters`), so any head or model class is exact. Gradients are one copy
of the parameters in the training dtype; optimizer states follow mixed precision
(`optimizer_bytes_per_parameter`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..comm import split_sizes
from ..convert.families.lone_layers import GATHER_FRACTION
from .config import TransformerShape
from .ranks import rank_heads, rank_widths

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

    alone = split_alone(shape, t)
    if "attention" in alone:  # no head layout: each projection whole, or split alone by its output rows
        held = [(i, split_sizes(o, t)[rank] if (i, o, b) in alone["attention"] else o, b)
                for i, o, b in _attention_layers(shape)]
        attention = sum(i * o + (o if b else 0) for i, o, b in held)
    else:
        attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if shape.qkv_bias else 0) + (h if shape.out_bias else 0)
    mlp_in = 2 if shape.gated_mlp else 1
    mlp = mlp_in * h * f + f * h + (mlp_in * f + h if shape.mlp_bias else 0)
    embeddings = vocab * h  # position and token-type tables stay whole, as the planner decides
    embeddings += (shape.position_embeddings + shape.position_offset + shape.token_type_embeddings) * h
    lm_head = 0 if shape.tied_embeddings else vocab * h
    if shape.mlm_head:  # BERT: transform dense (split alone, or whole) + LayerNorm (whole), decoder bias (vocab-split)
        dense = split_sizes(h, t)[rank] if "mlm_head" in alone else h
        lm_head += h * dense + dense + 2 * h + vocab
    norms = shape.num_layers * 2 * norm + (norm if shape.final_norm else 0) + (norm if shape.embedding_norm else 0)
    return {"embeddings": embeddings, "attention": shape.num_layers * attention, "mlp": shape.num_layers * mlp,
            "norms": norms, "lm_head": lm_head}


def _attention_layers(shape: TransformerShape) -> list[tuple[int, int, bool]]:
    """(in, out, bias) of one block's attention projections: q, k, v (or GPT-2's packed c_attn) and o."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    ins = [(h, q + 2 * kv, shape.qkv_bias)] if shape.packed_qkv else [(h, q, shape.qkv_bias), (h, kv, shape.qkv_bias),
                                                                      (h, kv, shape.qkv_bias)]
    return ins + [(q, h, shape.out_bias)]


def split_alone(shape: TransformerShape, world_size: int) -> dict[str, list[tuple[int, int, bool]]]:
    """The layers the planner splits alone at TP `world_size` (`convert/families/lone_layers.py`: no partner, at
    least 1 / GATHER_FRACTION of the largest layer, at least one output row per rank), by part: `attention` (its
    projections, when its heads have no layout over the ranks) and `mlm_head` (BERT's transform dense), each
    `(in, out, bias)`. Each costs an all-gather of its output per call."""
    if world_size == 1:
        return {}
    h, f = shape.hidden_size, shape.intermediate_size
    layers = _attention_layers(shape) + [(h, f, False), (f, h, False)]
    floor = max(i * o for i, o, _ in layers) / GATHER_FRACTION
    parts = {"attention": _attention_layers(shape) if not rank_heads(shape.num_heads, shape.num_kv_heads,
                                                                     world_size)[2] else [],
             "mlm_head": [(h, h, True)] if shape.mlm_head else []}
    out = {part: [(i, o, b) for i, o, b in found if i * o >= floor and o >= world_size] for part, found in parts.items()}
    return {part: found for part, found in out.items() if found}


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


def quantized_weights(shape: TransformerShape, quant, world_size: int, rank: int,
                      dtype: torch.dtype) -> tuple[int, int]:
    """(weights, bytes) `rank` holds of the block linear layers a quantized checkpoint stores packed (`quant`, a
    `tpkit.quant.Quantization`), loaded in `dtype` (its scales stored in it): `weights` at the dense split
    `parameter_counts` counts (what the stored tensors replace), `bytes` what the load holds of each layer on the
    rank's layout (`_block_layouts`: whole heads, the MLP's features in whole groups): its stored tensors and what
    it keeps beside them, counted as `tpkit.analyze` counts them (`convert.quantized.held_weight_bytes`).
    Embeddings and the LM head count as the dense parameters they are unless the checkpoint's scheme names them."""
    from ..convert.quantized import held_weight_bytes

    q_heads, kv_heads, f, _ = rank_widths(shape, world_size, rank)
    h, d = shape.hidden_size, shape.head_dim
    dense = {"self_attn.q_proj": q_heads * d * h, "self_attn.k_proj": kv_heads * d * h,
             "self_attn.v_proj": kv_heads * d * h, "self_attn.o_proj": h * q_heads * d, "mlp.gate_proj": f * h,
             "mlp.up_proj": f * h, "mlp.down_proj": h * f}
    weights = stored = 0
    for name, layout in _block_layouts(shape, quant, world_size, rank).items():
        scheme = quant.scheme_for(f"model.layers.0.{name}", "Linear")
        if scheme is None or dense[name] == 0:
            continue
        weights += dense[name]
        stored += held_weight_bytes(scheme, layout, dtype)
    return weights * shape.num_layers, stored * shape.num_layers


def _block_layouts(shape: TransformerShape, quant, world_size: int, rank: int) -> dict:
    """The dense weights' layouts of one block's linear layers on `rank`, as the load lays them out: attention in
    whole heads (`tpkit.layout.head_layout`; replicated where no layout exists), the MLP's features split in whole
    units (`mlp_unit`)."""
    from ..layout import HeadLayoutError, Piece, ShardLayout, head_layout, head_spans

    h, d, f, w = shape.hidden_size, shape.head_dim, shape.intermediate_size, world_size
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    try:
        heads = head_layout(shape.num_heads, shape.num_kv_heads, w, spread=shape.num_kv_heads < shape.num_heads) \
            if w > 1 else None
    except HeadLayoutError:
        heads = None

    def split(full, dim, piece):
        return ShardLayout(full, w, rank, dim, (piece,)) if piece is not None else ShardLayout.replicated(full, w, rank)

    q_piece = Piece(0, q, head_spans(heads.q_heads, d)) if heads else None
    kv_piece = Piece(0, kv, head_spans(heads.kv_heads, d)) if heads else None
    f_piece = Piece.split(0, f, w, mlp_unit(shape, quant, w) or 1) if w > 1 else None
    out = {"self_attn.q_proj": split((q, h), 0, q_piece), "self_attn.k_proj": split((kv, h), 0, kv_piece),
           "self_attn.v_proj": split((kv, h), 0, kv_piece), "self_attn.o_proj": split((h, q), 1, q_piece)}
    for name in (["mlp.gate_proj", "mlp.up_proj"] if shape.gated_mlp else ["mlp.up_proj"]):
        out[name] = split((f, h), 0, f_piece)
    out["mlp.down_proj"] = split((h, f), 1, f_piece)
    return out


def fullest_quantized(shape, quant, world_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """(weights, stored bytes) for the per-rank breakdown of a quantized checkpoint: of the rank that holds the most
    bytes once its layers are stored quantized (whole groups move the fullest rank: not always the dense one). The
    breakdown subtracts `weights` from the dense fullest rank's count, so the other rank's dense difference is
    folded into it: its parameters, gradients and optimizer states are then that rank's."""
    if world_size == 1:
        return quantized_weights(shape, quant, 1, 0, dtype)
    B = dtype.itemsize
    dense = [sum(parameter_counts(shape, world_size, r).values()) for r in range(world_size)]
    held = [quantized_weights(shape, quant, world_size, r, dtype) for r in range(world_size)]
    r = max(range(world_size), key=lambda r: (dense[r] - held[r][0]) * B + held[r][1])
    return held[r][0] + max(dense) - dense[r], held[r][1]


def mlp_unit(shape: TransformerShape, quant, world_size: int) -> int | None:
    """The features a quantized MLP's split keeps whole (`tpkit.convert.quantized.with_units`, the load's rule:
    the lcm of its layers' groups and packed words, else of their packed words, where every rank gets one), or
    None for the plain split."""
    names = (["mlp.gate_proj", "mlp.up_proj"] if shape.gated_mlp else ["mlp.up_proj"]) + ["mlp.down_proj"]
    unit = pack = 1
    for name in names:
        scheme = quant.scheme_for(f"model.layers.0.{name}", "Linear")
        if scheme is not None:
            dim = 1 if name == "mlp.down_proj" else 0
            unit, pack = math.lcm(unit, scheme.units()[dim]), math.lcm(pack, scheme.packing()[dim])
    f = shape.intermediate_size
    chosen = next((u for u in (unit, pack) if f % u == 0 and f // u >= world_size), None)
    return chosen if world_size > 1 and chosen not in (None, 1) else None
