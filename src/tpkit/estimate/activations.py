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

Context parallelism (cp ranks share each sequence, `context.py`) leaves the per-token terms as they are and counts
the rank's share of the tokens; attention keeps what its method keeps (`_attention_width`), and one layer's
context-parallel attention holds a working set besides (the part `context`).

Inference keeps nothing for backward: its figure is the live working set of one forward, plus the KV cache
(`transformer_inference_bytes`).
"""
from __future__ import annotations

from .config import TransformerShape
from .context import exchanged_kv_heads, local_tokens, resolve_method, working_bytes
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
                                 rank: int | None = None, cp: int = 1, cp_method: str = "auto") -> dict[str, float]:
    """Bytes kept for backward during training on `rank` (default: the rank that keeps the most), by part:
    `layers`, `embedding`, `final_norm` and `head` (the LM head's input and the logits the loss keeps).

    Context parallelism over `cp` ranks (`cp_method`: "auto", "all_to_all" or "ring", `context.py`): every part is
    that of the rank's `context.local_tokens` tokens, attention keeps what its method keeps (`_attention_width`),
    and a part `context` adds the working set of one layer's context-parallel attention (`context.working_bytes`)."""
    if rank is None:
        per_rank = [transformer_activation_bytes(shape, batch_size, seq_len, bytes_per_element, world_size,
                                                 sequence_parallel, recompute, attention, mask_bytes, r, cp, cp_method)
                    for r in range(world_size)]
        return max(per_rank, key=lambda parts: sum(parts.values()))
    t, B, b = world_size, bytes_per_element, batch_size
    s = local_tokens(seq_len, cp)
    h = shape.hidden_size
    tokens = s * b
    sp = t if sequence_parallel else 1
    a_r, kv_r, f, vocab = rank_widths(shape, t, rank)
    method = resolve_method(a_r, kv_r, cp, cp_method) if cp > 1 else None
    norm = (4 + B) * h if shape.norm == "rms" else B * h
    hidden_mask = mask_bytes * h if shape.hidden_dropout > 0 else 0

    # Per token. `full_width` is not split by TP (divided by t only under sequence parallelism).
    full_width = 2 * norm + 2 * B * h + 2 * hidden_mask
    attention_width, scores = _attention_width(shape, B, a_r, kv_r, attention, mask_bytes, s * cp, cp, method)
    split_width = _mlp_f_tensors(shape) * B * f + attention_width
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
    parts = {"layers": layers, "embedding": embedding, "final_norm": final_norm, "head": head}
    if method is not None:
        parts["context"] = working_bytes(shape, b, seq_len, B, t, cp, method, rank)
    return parts


def context_extra_bytes(shape: TransformerShape, batch_size: int, seq_len: int, bytes_per_element: int,
                        world_size: int = 1, sequence_parallel: bool = False, recompute: str = "none",
                        attention: str = "flash", cp: int = 1, cp_method: str = "auto") -> float:
    """What context parallelism over `cp` ranks adds to the activations of a rank's share of the tokens kept as a
    plain sequence of that length (what a trace at `context.local_tokens` counts): the attention's own terms (K/V
    at the exchanged head count, an eager kernel's scores over every key, the ring's flash terms in place of an
    eager kernel's) and one layer's working set. 0 at cp 1."""
    if cp == 1:
        return 0.0
    split = transformer_activation_bytes(shape, batch_size, seq_len, bytes_per_element, world_size, sequence_parallel,
                                         recompute, attention, cp=cp, cp_method=cp_method)
    plain = transformer_activation_bytes(shape, batch_size, local_tokens(seq_len, cp), bytes_per_element, world_size,
                                         sequence_parallel, recompute, attention)
    return sum(split.values()) - sum(plain.values())


def _attention_width(shape: TransformerShape, B: int, a_r: int, kv_r: int, attention: str, mask_bytes: int,
                     keys: int, cp: int = 1, method: str | None = None) -> tuple[float, float]:
    """(bytes per token the attention keeps besides its scores, bytes per token of its scores) on a rank with `a_r`
    query and `kv_r` K/V heads, whose queries see `keys` keys. Under context parallelism the ring keeps what a flash
    kernel keeps (its own kernel, whatever the model's); all-to-all runs the model's kernel on heads / cp heads of
    the whole sequence: per local token the same widths, K/V at the exchanged head count, an eager kernel's scores
    over all `keys` (the padded sequence). Either way the output projection's input is a tensor of its own under
    context parallelism (the reverse all-to-all's result, the ring's output transposed), where a plain fused kernel's
    output is that input itself: one more q-wide tensor, as `saved_tensors_hooks` counts on thread-ranks."""
    q, kv = a_r * shape.head_dim, kv_r * shape.head_dim
    apart = B * q if method is not None else 0  # the output projection's input: a copy of the kernel's output
    if method == "ring":
        attention = "flash"
    elif method == "all_to_all":
        kv = exchanged_kv_heads(kv_r, cp) * shape.head_dim
    if attention != "eager":
        return B * (2 * q + 2 * kv) + 4 * a_r + apart, 0.0   # q, k, v, output, fp32 log-sum-exp
    probs = (4 if shape.softmax_fp32 else B) + (B if shape.softmax_fp32 and B != 4 else 0)
    if shape.attention_dropout > 0:
        probs += mask_bytes + B
    return B * (2 * q + 2 * q) + apart, probs * a_r * keys   # q, k, v repeated to all heads, output-projection input


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
