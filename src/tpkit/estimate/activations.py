"""Activations per rank, by formula: what autograd keeps for backward in training, the live working set in
inference.

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

Inference keeps nothing for backward: its figure is the live working set of one forward, plus the KV cache
(`transformer_inference_bytes`).
"""
from __future__ import annotations

from .config import TransformerShape
from .ranks import rank_cache_heads, rank_widths

_RECOMPUTE = ("none", "selective", "full")


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


def normalise_recompute(recompute) -> str:
    if recompute is True:
        return "full"
    if recompute in (False, None):
        return "none"
    if recompute not in _RECOMPUTE:
        raise ValueError(f"recompute must be one of {_RECOMPUTE} (or a bool), got {recompute!r}")
    return recompute


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
    a_r, kv_r, f, vocab = rank_widths(shape, t, rank)
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
    q_heads, kv_heads, f, logits = rank_widths(shape, t, rank)  # logits: this rank's vocabulary shard
    q, kv = q_heads * shape.head_dim, kv_heads * shape.head_dim
    scores = q_heads * seq_len * (4 if shape.softmax_fp32 else B) / B if attention == "eager" else 0
    live = 2 * h + max(2 * q + 2 * kv + scores, (3 if shape.gated_mlp else 2) * f)
    cached = rank_cache_heads(shape.num_heads, shape.num_kv_heads, t, rank) * shape.head_dim
    kv_cache = 2 * shape.num_layers * cached * tokens * B if shape.is_decoder else 0
    return {"activations": tokens * B * (live + logits), "kv_cache": kv_cache}
