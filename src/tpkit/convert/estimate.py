"""Memory per rank before buying the devices: parameters, gradients, optimizer states, activations,
KV cache and communication buffers, at world size 1 and at world size t.

Transformers (a Hugging Face config, or a model that carries one) are estimated from their shape alone,
so a 70B model costs nothing to estimate. Other modules are measured on one small real step and scaled.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198), which counts, per layer, every tensor an op keeps for its backward. For their
GPT (16-bit, LayerNorm, GeLU MLP of 4h, eager attention, dropout everywhere with 1-byte masks) that gives

    no TP:           s*b*h*(34 + 5*a*s/h)          bytes per layer
    TP t:            s*b*h*(10 + 24/t + 5*a*s/(h*t))
    TP t + SP:       s*b*h/t*(34 + 5*a*s/h)
    selective:       the 5*a*s/h term (softmax, its dropout mask and output) is recomputed, so dropped
    full recompute:  only the layer input, 2*s*b*h (/t with SP), per layer

(`korthikanti_layer_bytes` is exactly that). `transformer_activation_bytes` keeps the paper's method but
counts the terms of the actual architecture, with these adaptations, each checked against the bytes that
`torch.autograd.graph.saved_tensors_hooks` sees on Hugging Face models:

* bytes per element B is the training dtype, not a fixed 2; dropout masks are 1 byte (CUDA's bool mask;
  CPU kernels keep a mask of the input dtype instead) and vanish when the dropout probability is 0;
* MLP of width f (intermediate_size), not 4h. A fused activation keeps its input and the next linear its
  output (2*B*f); ReLU keeps only its output (B*f); GPT-2's python `gelu_new` keeps 4 tensors plus the
  output (5*B*f). A gated (SwiGLU) MLP adds the up projection and the product: 2*B*f more;
* attention with grouped query heads: q is a*d wide, k and v g*d wide. With fused attention (SDPA /
  FlashAttention, the Hugging Face default) no s*s matrix is kept: q, k, v, the output and a fp32
  log-sum-exp of a*s per token. Eager attention keeps q and k and v repeated to all a heads (HF
  `repeat_kv`), the softmax probabilities (fp32 when the model upcasts the softmax, as Llama does, then also
  their cast copy), the dropout mask and output when p > 0, and the output projection's input;
* RMSNorm as Hugging Face writes it upcasts its input to fp32 and keeps it plus the normalised input:
  (4 + B)*h per norm instead of LayerNorm's B*h;
* the causal-LM loss upcasts logits to fp32 and the cross entropy keeps them: 4*v per token (vocab-parallel:
  v/t; BERT's masked-LM loss keeps them in the model dtype); the embedding keeps its int64 indices;
* full recompute also holds the one layer being rebuilt during backward, which the paper leaves out.

What TP divides: everything inside attention and the MLP (whole heads per rank from the converter's head
layout, KV heads replicated when fewer than t; f cut by `tpkit.comm.split_sizes`); what it does not (norms,
the inputs of the first linears, dropout masks of the residual stream) is divided by t only with sequence
parallelism. Per-rank figures are those of the most loaded rank (rank 0 under tpkit's split rule, except
for some uneven GQA layouts where a later rank holds an extra KV head).

Communication buffers are the largest collective result a rank holds (an all-reduced (b, s, h) activation,
or gathered (b, s, v) logits for inference), not a flat percentage. Optimizer states follow mixed precision
(`optimizer_bytes_per_parameter`).

Any other module is measured (`measure_step`): one forward of a copy, the bytes autograd saves for backward
deduplicated by storage, attributed to a rank by the converter's plan (between a column and a row layer the
activations are split) and scaled linearly with the batch.
"""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from tpkit.comm.sharding import split_sizes

_RECOMPUTE = ("none", "selective", "full")
_OPTIMIZERS = ("adamw", "sgd", "none")
_MODES = ("inference", "training")


# ----------------------------------------------------------------------------------------- the paper


def korthikanti_layer_bytes(seq_len: int, batch_size: int, hidden: int, heads: int, world_size: int = 1,
                            sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Activation bytes of one GPT layer exactly as in Korthikanti et al. 2022 (16-bit, Table 2)."""
    s, b, h, a, t = seq_len, batch_size, hidden, heads, world_size
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    score = 0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return s * b * h / t * (34 + score)
    return s * b * h * (10 + 24 / t + score / t)


# ------------------------------------------------------------------------------- transformer shapes


@dataclass(frozen=True)
class TransformerShape:
    """What the estimates need to know about a transformer, read from its Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    gated_mlp: bool = True
    activation: str = "silu"
    norm: str = "rms"                 # "rms" (HF RMSNorm: fp32 upcast) or "layer"
    norm_bias: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tied_embeddings: bool = False
    position_embeddings: int = 0      # learned absolute positions (GPT-2, OPT, BERT)
    token_type_embeddings: int = 0    # BERT
    embedding_norm: bool = False      # BERT: LayerNorm after the embeddings
    final_norm: bool = True
    mlm_head: bool = False            # BERT: dense h*h + LayerNorm before the decoder, decoder bias
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    embedding_dropout: float = 0.0
    softmax_fp32: bool = False        # eager softmax computed in fp32 (Llama family, OPT)
    logits_fp32: bool = True          # the loss upcasts logits to fp32 (HF causal LM loss; not BERT's MLM)
    is_decoder: bool = True
    position_offset: int = 0          # OPT keeps 2 extra position rows

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim


def _get(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def transformer_shape(config) -> TransformerShape:
    """Read a Hugging Face config (Llama, Mistral, Qwen2, GPT-2, OPT, BERT and Llama-like others)."""
    kind = getattr(config, "model_type", "")
    if kind == "gpt2":
        h = config.n_embd
        return TransformerShape(
            kind, config.vocab_size, h, config.n_layer, config.n_head, config.n_head, h // config.n_head,
            config.n_inner or 4 * h, gated_mlp=False, activation=config.activation_function, norm="layer",
            norm_bias=True, qkv_bias=True, out_bias=True, mlp_bias=True,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            position_embeddings=config.n_positions, attention_dropout=config.attn_pdrop,
            hidden_dropout=config.resid_pdrop, embedding_dropout=config.embd_pdrop)
    if kind == "opt":
        h = config.hidden_size
        if config.word_embed_proj_dim != h or not config.do_layer_norm_before:
            raise ValueError(f"OPT config with word_embed_proj_dim={config.word_embed_proj_dim} != hidden_size={h} "
                             "or post-norm (OPT-350m) is not modelled by the estimate; use a model object")
        return TransformerShape(
            kind, config.vocab_size, h, config.num_hidden_layers, config.num_attention_heads,
            config.num_attention_heads, h // config.num_attention_heads, config.ffn_dim, gated_mlp=False,
            activation=config.activation_function, norm="layer", norm_bias=config.layer_norm_elementwise_affine,
            qkv_bias=config.enable_bias, out_bias=config.enable_bias, mlp_bias=config.enable_bias,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            position_embeddings=config.max_position_embeddings, position_offset=2,
            attention_dropout=config.attention_dropout, hidden_dropout=config.dropout, softmax_fp32=True,
            final_norm=not getattr(config, "_remove_final_layer_norm", False))
    if kind == "bert":
        h = config.hidden_size
        return TransformerShape(
            kind, config.vocab_size, h, config.num_hidden_layers, config.num_attention_heads,
            config.num_attention_heads, h // config.num_attention_heads, config.intermediate_size,
            gated_mlp=False, activation=config.hidden_act, norm="layer", norm_bias=True, qkv_bias=True,
            out_bias=True, mlp_bias=True, tied_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            position_embeddings=config.max_position_embeddings, token_type_embeddings=config.type_vocab_size,
            embedding_norm=True, final_norm=False, mlm_head=True,
            attention_dropout=config.attention_probs_dropout_prob, hidden_dropout=config.hidden_dropout_prob,
            embedding_dropout=config.hidden_dropout_prob, is_decoder=False, logits_fp32=False)
    # Llama-like decoders: Llama, Mistral, Qwen2, and any config with the same attribute names.
    h = _get(config, "hidden_size")
    heads = _get(config, "num_attention_heads")
    f = _get(config, "intermediate_size")
    if h is None or heads is None or f is None or _get(config, "num_hidden_layers") is None:
        raise ValueError(f"config of model_type {kind!r} lacks hidden_size/num_attention_heads/"
                         "intermediate_size/num_hidden_layers; pass a model object instead")
    bias = bool(_get(config, "attention_bias", default=False))
    return TransformerShape(
        kind, config.vocab_size, h, config.num_hidden_layers, heads, _get(config, "num_key_value_heads",
                                                                          default=heads),
        _get(config, "head_dim", default=h // heads), f, gated_mlp=True,
        activation=_get(config, "hidden_act", default="silu"), norm="rms",
        qkv_bias=True if kind == "qwen2" else bias, out_bias=bias, mlp_bias=bool(_get(config, "mlp_bias",
                                                                                   default=False)),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_dropout=float(_get(config, "attention_dropout", default=0.0)), softmax_fp32=True)


# ----------------------------------------------------------------------------------- per-rank sizes


@functools.lru_cache(maxsize=256)
def _head_layout(num_heads: int, num_kv_heads: int, world_size: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(query heads per rank, KV heads per rank) as `parallelize` lays them out, or None (no layout)."""
    try:
        from tpkit.convert.heads import HeadLayoutError, head_layout
    except ImportError:  # the converter's module is missing: contiguous query heads, the KV heads they read
        sizes = split_sizes(num_heads, world_size)
        if sizes[-1] == 0 or num_heads % num_kv_heads:
            return None
        group, start, kv = num_heads // num_kv_heads, 0, []
        for n in sizes:
            kv.append((start + n - 1) // group - start // group + 1)
            start += n
        return tuple(sizes), tuple(kv)
    try:
        layout = head_layout(num_heads, num_kv_heads, world_size)
    except HeadLayoutError:
        return None
    return tuple(len(q) for q in layout.q_heads), tuple(len(k) for k in layout.kv_heads)


def rank_heads(num_heads: int, num_kv_heads: int, world_size: int, rank: int = 0) -> tuple[int, int, bool]:
    """(query heads, KV heads, split?) on `rank`, as `parallelize` lays them out.

    The layout is the converter's (`tpkit.convert.heads.head_layout`: whole heads, GQA groups kept together,
    KV heads replicated when fewer than ranks; with uneven splits a later rank may hold more KV heads than
    rank 0). When no layout exists the attention stays replicated.
    """
    if world_size == 1:
        return num_heads, num_kv_heads, True
    layout = _head_layout(num_heads, num_kv_heads, world_size)
    if layout is None:
        return num_heads, num_kv_heads, False
    return layout[0][rank], layout[1][rank], True


def heads_per_rank(num_heads: int, world_size: int, num_kv_heads: int | None = None, rank: int = 0) -> int:
    """Query heads on `rank`."""
    return rank_heads(num_heads, num_kv_heads or num_heads, world_size, rank)[0]


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, world_size: int, rank: int = 0) -> int:
    """KV heads on `rank`: its share, or a replica of those its query heads read when KV heads < t."""
    return rank_heads(num_heads, num_kv_heads, world_size, rank)[1]


def _rank_widths(shape: TransformerShape, t: int, rank: int) -> tuple[int, int, int, int]:
    """(query heads, KV heads, MLP width, vocabulary rows) that `rank` holds."""
    q_heads, kv_heads, _ = rank_heads(shape.num_heads, shape.num_kv_heads, t, rank)
    return q_heads, kv_heads, split_sizes(shape.intermediate_size, t)[rank], split_sizes(shape.vocab_size, t)[rank]


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
    q_heads, kv_heads, f, vocab = _rank_widths(shape, t, rank)
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


# ------------------------------------------------------------------------------- activation formula

# f-wide tensors a non-gated MLP keeps: activation saves + the second linear's input (see module doc).
_ACTIVATION_F_TENSORS = {"relu": 1, "gelu_new": 5}


def _mlp_f_tensors(shape: TransformerShape) -> int:
    base = _ACTIVATION_F_TENSORS.get(shape.activation, 2)
    return base + (2 if shape.gated_mlp else 0)


def transformer_activation_bytes(shape: TransformerShape, batch_size: int, seq_len: int, bytes_per_element: int,
                                 world_size: int = 1, sequence_parallel: bool = False, recompute: str = "none",
                                 attention: str = "flash", mask_bytes: int = 1,
                                 rank: int | None = None) -> dict[str, float]:
    """Bytes kept for backward during training on `rank` (default: the rank that keeps the most), by part:
    `layers`, `embedding`, `final_norm` and `head` (the LM head's input and the logits the loss keeps)."""
    if rank is None:
        per_rank = [transformer_activation_bytes(shape, batch_size, seq_len, bytes_per_element, world_size,
                                                 sequence_parallel, recompute, attention, mask_bytes, r)
                    for r in range(world_size)]
        return max(per_rank, key=lambda parts: sum(parts.values()))
    t, B, s, b = world_size, bytes_per_element, seq_len, batch_size
    h = shape.hidden_size
    tokens = s * b
    sp = t if sequence_parallel else 1
    a_r, kv_r, f, vocab = _rank_widths(shape, t, rank)
    q, kv = a_r * shape.head_dim, kv_r * shape.head_dim
    norm = (4 + B) * h if shape.norm == "rms" else B * h
    hidden_mask = mask_bytes * h if shape.hidden_dropout > 0 else 0

    # Per token. `full_width` is not split by TP (divided by t only under sequence parallelism).
    full_width = 2 * norm + 2 * B * h + 2 * hidden_mask
    split_width = _mlp_f_tensors(shape) * B * f
    if attention == "eager":
        split_width += B * (2 * q + 2 * q)      # q, k and v repeated to all heads, output-projection input
        probs = (4 if shape.softmax_fp32 else B) + (B if shape.softmax_fp32 and B != 4 else 0)
        if shape.attention_dropout > 0:
            probs += mask_bytes + B
        scores = probs * a_r * s
    else:
        split_width += B * (2 * q + 2 * kv) + 4 * a_r   # q, k, v, output, fp32 log-sum-exp
        scores = 0
    if recompute == "selective":
        scores = 0
    layer = tokens * (full_width / sp + split_width + scores)
    if recompute == "full":  # keep each layer's input; one layer is rebuilt at a time during backward
        layers = shape.num_layers * tokens * B * h / sp + layer
    else:
        layers = shape.num_layers * layer

    embedding = tokens * 8  # int64 token ids
    if shape.embedding_dropout > 0:
        embedding += tokens * mask_bytes * h / sp
    if shape.embedding_norm:
        embedding += tokens * B * h / sp
    final_norm = tokens * norm / sp if shape.final_norm else 0.0
    head = tokens * ((4 if shape.logits_fp32 else B) * vocab + B * h / sp)  # logits for the loss, LM-head input
    if shape.mlm_head:                                 # dense input, GeLU input, LayerNorm input
        head += tokens * 3 * B * h / sp
    return {"layers": layers, "embedding": embedding, "final_norm": final_norm, "head": head}


def transformer_inference_bytes(shape: TransformerShape, batch_size: int, seq_len: int, bytes_per_element: int,
                                world_size: int = 1, attention: str = "flash",
                                rank: int | None = None) -> dict[str, float]:
    """Rank 0's live working set of an inference forward (nothing is kept for backward) and KV cache.

    Working set: the residual stream and norm output, plus the larger of attention (q, k, v, output, and for
    eager attention the s*s scores of this rank's heads) and the MLP (its f-wide tensors), plus this rank's
    logits. Gathering them to the full vocabulary (the column-parallel LM head of generation) is counted as
    the communication buffer.
    """
    if rank is None:
        per_rank = [transformer_inference_bytes(shape, batch_size, seq_len, bytes_per_element, world_size, attention,
                                                r) for r in range(world_size)]
        return max(per_rank, key=lambda parts: sum(parts.values()))
    t, B, tokens, h = world_size, bytes_per_element, batch_size * seq_len, shape.hidden_size
    q_heads, kv_heads, f, logits = _rank_widths(shape, t, rank)  # logits: this rank's vocabulary shard
    q, kv = q_heads * shape.head_dim, kv_heads * shape.head_dim
    scores = q_heads * seq_len * (4 if shape.softmax_fp32 else B) / B if attention == "eager" else 0
    live = 2 * h + max(2 * q + 2 * kv + scores, (3 if shape.gated_mlp else 2) * f)
    kv_cache = 2 * shape.num_layers * kv * tokens * B if shape.is_decoder else 0
    return {"activations": tokens * B * (live + logits), "kv_cache": kv_cache}


def largest_collective_bytes(shape: TransformerShape, batch_size: int, seq_len: int, bytes_per_element: int,
                             world_size: int, mode: str, sequence_parallel: bool = False) -> tuple[float, str]:
    """Bytes of the largest collective result a rank must hold, and which collective it is.

    Row-parallel layers all-reduce a (b, s, h) activation (with sequence parallelism: all-gather it back,
    the same size); inference gathers the vocab-parallel logits to (b, s, v); training keeps logits
    vocab-parallel, whose cross entropy all-reduces only (b, s) statistics.
    """
    if world_size == 1:
        return 0.0, "none (world size 1)"
    tokens = batch_size * seq_len
    what = ("all-gather of a sequence-parallel activation (b*s*h)" if sequence_parallel
            else "all-reduce of a row-parallel output (b*s*h)")
    candidates = [(tokens * shape.hidden_size * bytes_per_element, what)]
    if mode == "inference":
        candidates.append((tokens * shape.vocab_size * bytes_per_element, "all-gather of the logits (b*s*v)"))
    return max(candidates)


# ---------------------------------------------------------------------------------- the estimate


@dataclass
class Breakdown:
    """Bytes on one rank."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer_states: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    communication_buffers: float = 0.0

    @property
    def total(self) -> float:
        return (self.parameters + self.gradients + self.optimizer_states + self.activations + self.kv_cache
                + self.communication_buffers)

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


@dataclass
class MemoryEstimate:
    """Memory on one device (`single`) and on the most loaded of `world_size` TP ranks (`per_rank`)."""

    world_size: int
    mode: str
    dtype: str
    optimizer: str
    batch_size: int
    seq_len: int | None
    sequence_parallel: bool
    recompute: str
    single: Breakdown
    per_rank: Breakdown
    parameters_total: int
    parameters_per_rank: int
    largest_collective: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.per_rank.total

    @property
    def savings_bytes(self) -> float:
        return self.single.total - self.per_rank.total

    @property
    def savings_percent(self) -> float:
        return 100.0 * self.savings_bytes / self.single.total if self.single.total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "mode": self.mode, "dtype": self.dtype, "optimizer": self.optimizer,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "sequence_parallel": self.sequence_parallel,
                "recompute": self.recompute, "parameters_total": self.parameters_total,
                "parameters_per_rank": self.parameters_per_rank, "single_device": self.single.to_dict(),
                "per_rank": self.per_rank.to_dict(), "savings_bytes": self.savings_bytes,
                "savings_percent": self.savings_percent, "largest_collective": self.largest_collective,
                "notes": list(self.notes)}

    def summary(self) -> str:
        """A terminal table: each part on one device and per rank."""
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"memory: {self.mode}, {self.dtype}",
                      caption=f"batch {self.batch_size}" + (f" x seq {self.seq_len}" if self.seq_len else "")
                      + (", sequence parallel" if self.sequence_parallel else "")
                      + (f", {self.recompute} recompute" if self.recompute != "none" else ""))
        table.add_column("part")
        table.add_column("1 device", justify="right")
        table.add_column(f"per rank (t={self.world_size})", justify="right")
        for name in ("parameters", "gradients", "optimizer_states", "activations", "kv_cache",
                     "communication_buffers"):
            one, many = getattr(self.single, name), getattr(self.per_rank, name)
            if one or many:
                table.add_row(name.replace("_", " "), format_bytes(one), format_bytes(many))
        table.add_row("total", format_bytes(self.single.total), format_bytes(self.per_rank.total), style="bold")
        console = Console(width=100, record=True, force_terminal=False, color_system=None)
        with console.capture() as capture:
            console.print(table)
            console.print(f"saves {format_bytes(self.savings_bytes)} per rank ({self.savings_percent:.1f}%); "
                          f"largest collective: {self.largest_collective}")
            for note in self.notes:
                console.print(f"note: {note}")
        return capture.get()


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def optimizer_bytes_per_parameter(optimizer: str, dtype: torch.dtype, master_weights: bool | None = None) -> int:
    """Optimizer state bytes per parameter (mixed precision by default for 16-bit parameters).

    AdamW keeps two moments in fp32 (8 bytes); with 16-bit parameters the standard mixed-precision recipe
    (Megatron, DeepSpeed) also keeps an fp32 master copy (4 more: 12). SGD keeps an fp32 momentum (4), plus
    the master copy for 16-bit parameters. Pass `master_weights=False` for plain `torch.optim` on bf16 params,
    whose states are in the parameter dtype.
    """
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {optimizer!r}")
    states = {"adamw": 2, "sgd": 1, "none": 0}[optimizer]
    if states == 0:
        return 0
    sixteen_bit = dtype.itemsize <= 2
    if master_weights is None:
        master_weights = sixteen_bit
    if master_weights:
        return 4 * states + (4 if sixteen_bit else 0)
    return states * dtype.itemsize


def _own_dtype(model_or_config) -> torch.dtype:
    """A model's floating parameter dtype; bfloat16 for a config (the usual training and serving dtype)."""
    if isinstance(model_or_config, nn.Module):
        for p in model_or_config.parameters():
            if p.is_floating_point():
                return p.dtype
    return torch.bfloat16


def _normalise_recompute(recompute) -> str:
    if recompute is True:
        return "full"
    if recompute in (False, None):
        return "none"
    if recompute not in _RECOMPUTE:
        raise ValueError(f"recompute must be one of {_RECOMPUTE} (or a bool), got {recompute!r}")
    return recompute


def _attention_kind(config, attention: str | None) -> str:
    if attention is None:
        attention = getattr(config, "_attn_implementation", None) or "sdpa"
    return "eager" if attention == "eager" else "flash"


def resolve_target(model_or_config, caller: str) -> tuple[Any, "TransformerShape | None"]:
    """(HF config or None, its transformer shape or None) of what an estimate was asked about.

    A model or config whose shape tpkit models gets the formulas; any other nn.Module is measured (shape None);
    anything else is refused, naming `caller`.
    """
    is_module = isinstance(model_or_config, nn.Module)
    config = getattr(model_or_config, "config", None) if is_module else model_or_config
    shape = None
    if config is not None and hasattr(config, "model_type"):
        try:
            shape = transformer_shape(config)
        except ValueError:
            if not is_module:
                raise
    if shape is None and not is_module:
        raise TypeError(f"{caller} needs a Hugging Face config or an nn.Module, got {type(model_or_config).__name__}")
    return config, shape


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


def _analysed_parameters(model: nn.Module, world_size: int, mode: str, example=None) -> tuple[int, int] | None:
    """(parameters, parameters on the fullest rank) of a model object from the converter's analysis: the very
    plan `parallelize` applies, so any head or class (sequence classification, a bare encoder) is exact."""
    try:
        from tpkit.convert.analyze import analyze
    except ImportError:
        return None
    first = next(model.parameters(), None)
    if first is None:
        return None
    report = analyze(model, world_size=world_size, max_world_size=world_size, mode=mode, device_memory=0,
                     example_inputs=example)
    elem = first.element_size()
    return report.per_rank_bytes[1] // elem, report.per_rank_bytes[world_size] // elem


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


# ---------------------------------------------------------------------- other modules: measured


_OUT_SPLIT = {"colwise", "vocab_parallel"}                  # output stays split
_GATHERED = {"colwise_rep", "embedding_colwise"}            # output all-gathered: full again
_REDUCED = {"rowwise", "rowwise_rep", "embedding_rowwise"}  # output all-reduced: full again


def _leaves(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules()
            if next(iter(m.parameters(recurse=False)), None) is not None or not next(iter(m.children()), None)}


def _planned_styles(model: nn.Module, world_size: int, mode: str, example) -> tuple[dict[str, str] | None, str]:
    """`{module name: style}` from the converter's planner (what `parallelize` will do), or None and why."""
    try:
        from tpkit.convert.planner import plan as make_plan
    except ImportError as exc:
        return None, f"the converter's planner is not available ({exc})"
    try:
        p = make_plan(model, world_size, mode=mode, example_inputs=example)
    except Exception as exc:  # noqa: BLE001 - fall back to the type rule, and say so
        return None, f"the planner failed ({type(exc).__name__}: {exc})"
    styles = {name: style for name in dict(model.named_modules()) if (style := p.style_for(name))}
    split = [n for n, st in styles.items() if st != "replicate"]
    why = "" if split or not p.reasons else f"the plan splits nothing: {next(iter(p.reasons.values()))}"
    return styles, why


def _fallback_style(m: nn.Module, sharded: bool, t: int) -> str:
    """Type rule when no plan exists: a Linear/Conv2d whose output divides starts a pair (column), the next
    one whose input divides ends it (row); embeddings split the vocabulary; BatchNorm inside a pair is split."""
    from torch.nn.modules.batchnorm import _BatchNorm

    if isinstance(m, nn.Embedding) and m.num_embeddings % t == 0:
        return "embedding_rowwise"
    if isinstance(m, _BatchNorm) and sharded:
        return "channelwise"
    if isinstance(m, nn.Linear) or (isinstance(m, nn.Conv2d) and m.groups == 1):
        n_in = m.in_features if isinstance(m, nn.Linear) else m.in_channels
        n_out = m.out_features if isinstance(m, nn.Linear) else m.out_channels
        if sharded and n_in % t == 0:
            return "rowwise"
        if not sharded and n_out % t == 0:
            return "colwise"
    return "replicate"


def _param_bytes_per_rank(m: nn.Module, style: str, t: int) -> float:
    """Bytes of `m`'s own parameters on rank 0 under `style` (dims as tpkit shards them)."""
    transposed = type(m).__name__ == "Conv1D"  # Hugging Face's linear with a (in, out) weight
    total = 0.0
    for pname, p in m.named_parameters(recurse=False):
        dim = None
        if style in _OUT_SPLIT | {"colwise_rep", "embedding_rowwise", "channelwise"}:
            dim = (1 if transposed and pname == "weight" else 0) if p.dim() else None
            if style == "embedding_rowwise" and pname != "weight":
                dim = None
        elif style in {"rowwise", "rowwise_rep"}:
            dim = (0 if transposed else 1) if pname == "weight" else None
        elif style == "embedding_colwise":
            dim = 1 if pname == "weight" else None
        if dim is None or p.dim() <= dim:
            total += p.numel() * p.element_size()
        else:
            total += p.numel() // p.shape[dim] * split_sizes(p.shape[dim], t)[0] * p.element_size()
    return total


def _as_call(example):
    if isinstance(example, dict):
        return (), example
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    return (example,), {}


def _first_tensor(example) -> torch.Tensor | None:
    args, kwargs = _as_call(example)
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


def _runnable_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy to run one step on: real CPU storage (meta models get uninitialised memory, which is enough
    to see sizes) in the estimate's dtype; the user's model and its BatchNorm statistics stay untouched."""
    work = copy.deepcopy(model)
    if any(p.is_meta for p in work.parameters()) or any(b.is_meta for b in work.buffers()):
        work = work.to_empty(device="cpu")
        with torch.no_grad():
            for p in work.parameters():
                p.normal_(0, 0.02)
    return work.to(dtype)


def _example(model: nn.Module, dtype: torch.dtype, example_input, input_shape):
    if example_input is not None:
        def cast(v):
            return v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        args, kwargs = _as_call(example_input)
        return (tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()})
    if input_shape is not None:
        first = next((m for m in model.modules() if isinstance(m, (nn.Embedding, nn.Linear, nn.Conv2d))), None)
        if isinstance(first, nn.Embedding):
            return (torch.zeros(tuple(input_shape), dtype=torch.long),), {}
        return (torch.randn(tuple(input_shape), dtype=dtype),), {}
    raise ValueError(f"estimate_memory: {type(model).__name__} is not a transformer with a Hugging Face config; "
                     "pass example_input=... (a tensor, tuple or dict, batch first) or input_shape=(batch, ...) "
                     "so its activations can be measured on one small step")


def measure_step(model: nn.Module, args=(), kwargs=None, styles=None, world_size: int = 1,
                 training: bool = True) -> dict[str, Any]:
    """Run `model(*args, **kwargs)` once and measure, at world size 1 and on rank 0 of `world_size`:
    activations (training: bytes saved for backward, deduplicated by storage, parameters excluded;
    inference: the largest input+output of one layer), parameter bytes, forward FLOPs (those inside a
    column -> row pair divide over the ranks) and the collectives the plan adds, in order, as
    `(kind, result bytes)` with kind "all_reduce" or "all_gather".

    `styles` maps module names to plan styles; None applies the type rule of `_fallback_style`.
    """
    from torch.utils.flop_counter import FlopCounterMode

    kwargs = kwargs or {}
    t = world_size
    leaves = _leaves(model)
    state = {"sharded": False, "region": False, "in": 0.0, "in1": 0.0, "live": [0.0, 0.0], "mark": 0,
             "flops": [0, 0]}  # flops outside / inside a split region
    chosen: dict[str, str] = {}
    collectives: list[int] = []
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    param_ptrs |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    saved: dict[int, tuple[int, bool]] = {}
    counter = FlopCounterMode(display=False)

    def nbytes(x) -> int:
        return sum(v.numel() * v.element_size() for v in (x if isinstance(x, (tuple, list)) else [x])
                   if isinstance(v, torch.Tensor))

    def account_flops():
        total = counter.get_total_flops()
        state["flops"][1 if state["region"] else 0] += total - state["mark"]
        state["mark"] = total

    def pre(name):
        def hook(module, inputs):
            if name not in chosen:
                chosen[name] = (styles.get(name, "replicate") if styles is not None
                                else _fallback_style(module, state["sharded"], t)) if t > 1 else "replicate"
            account_flops()
            if chosen[name] in _OUT_SPLIT | {"colwise_rep"}:
                state["region"] = True
            state["in"] = nbytes(inputs) / (t if state["sharded"] else 1)
            state["in1"] = nbytes(inputs)
        return hook

    def post(name):
        def hook(module, inputs, output):
            account_flops()
            style = chosen.get(name, "replicate")
            if style in _OUT_SPLIT:
                state["sharded"] = True
            elif style in _GATHERED | _REDUCED:
                state["sharded"] = state["region"] = False
                collectives.append(("all_gather" if style in _GATHERED else "all_reduce", nbytes(output)))
            out = nbytes(output)
            state["live"][0] = max(state["live"][0], state["in1"] + out)
            state["live"][1] = max(state["live"][1], state["in"] + out / (t if state["sharded"] else 1))
        return hook

    def pack(x):
        st = x.untyped_storage()
        if st.data_ptr() not in param_ptrs and st.data_ptr() not in saved:
            saved[st.data_ptr()] = (st.nbytes(), state["sharded"])
        return x

    handles = [m.register_forward_pre_hook(pre(n)) for n, m in leaves.items()]
    handles += [m.register_forward_hook(post(n)) for n, m in leaves.items()]
    try:
        with counter:
            if training:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                    model(*args, **kwargs)
            else:
                with torch.no_grad():
                    model(*args, **kwargs)
            account_flops()
    finally:
        for h in handles:
            h.remove()
    if training:
        one = float(sum(n for n, _ in saved.values()))
        many = float(sum(math.ceil(n / t) if sharded else n for n, sharded in saved.values()))
    else:
        one, many = state["live"]
    seen, params_one, params_rank = set(), 0.0, 0.0
    for name, m in leaves.items():
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen |= {id(p) for p in own}
        if own:
            params_one += sum(p.numel() * p.element_size() for p in own)
            params_rank += _param_bytes_per_rank(m, chosen.get(name, "replicate"), t)
    collectives = collectives if t > 1 else []
    outside, inside = state["flops"]
    largest = float(max((n for _, n in collectives), default=0))
    return {"activations": one, "activations_per_rank": many, "communication": largest,
            "collectives": collectives, "parameter_bytes": params_one, "parameter_bytes_per_rank": params_rank,
            "flops": float(outside + inside), "flops_per_rank": outside + inside / t}


def prepare_module_step(model: nn.Module, world_size: int, dtype: torch.dtype, mode: str, example_input=None,
                        input_shape=None, seq_len: int | None = None) -> dict[str, Any]:
    """Everything a measured step needs: the example call, its batch, the plan styles (or why not), a
    runnable copy of the model. Shared by the memory and the speed estimate of non-transformer modules."""
    if example_input is None and input_shape is None and getattr(model, "main_input_name", "") == "input_ids":
        example_input = {"input_ids": torch.zeros(1, seq_len or 128, dtype=torch.long)}
    args, kwargs = _example(model, dtype, example_input, input_shape)
    first = _first_tensor(args) if args else _first_tensor(kwargs)
    notes, styles, planned = [], None, ()
    if world_size > 1:
        first_param = next(model.parameters(), None)
        device = first_param.device if first_param is not None else torch.device("cpu")
        own = first_param.dtype if first_param is not None else dtype

        def as_model(v):  # the planner traces the model itself: its device and dtype
            if not isinstance(v, torch.Tensor):
                return v
            return v.to(device, own) if v.is_floating_point() else v.to(device)
        planned = tuple(as_model(a) for a in args) if args else {k: as_model(v) for k, v in kwargs.items()}
        styles, why = _planned_styles(model, world_size, mode if mode in _MODES else "inference", planned)
        if styles is None:
            notes.append(f"per-rank split by layer type (Linear/Conv2d pairs whose sizes divide, embeddings by "
                         f"vocabulary) because {why}")
        elif why:
            notes.append(why)
    work = _runnable_copy(model, dtype)
    work.train(mode == "training")
    return {"args": args, "kwargs": kwargs, "batch": int(first.shape[0]) if first is not None and first.dim() else 1,
            "styles": styles, "planned_inputs": planned, "work": work, "notes": notes}


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


__all__ = ["Breakdown", "MemoryEstimate", "TransformerShape", "estimate_memory", "format_bytes", "heads_per_rank",
           "korthikanti_layer_bytes", "kv_heads_per_rank", "largest_collective_bytes", "measure_step",
           "optimizer_bytes_per_parameter", "parameter_counts", "prepare_module_step", "rank_heads", "fullest_rank",
           "transformer_activation_bytes", "transformer_inference_bytes", "transformer_shape"]
