"""Context parallelism in the figures: what splitting every sequence over cp ranks (`tpkit.context_parallel`) changes
in one rank's memory and step time, on top of the same setup without it traced at the rank's share of the sequence.

What a rank of a cp group does (`tpkit.context`), and what the estimates take from it:
* its tokens: the zigzag split pads a sequence of S tokens to a multiple of 2 x cp and gives each rank two chunks,
  `local_tokens` = 2 ceil(S / 2cp) of them. Everything outside attention (projections, MLP, norms, the loss) runs
  on those tokens only, so the step is traced at that length; causal attention work is balanced over the ranks, so
  its kernels do 1/cp of the whole sequence's: cp times what a trace at the local length shows;
* attention, by one of two methods (`attention_method`, as the layer picks it at its first forward):
  all-to-all (Ulysses) turns [b, heads, S/cp, d] into [b, heads/cp, S, d] before the model's kernel, one all-to-all
  each for q, k and v, one back for the output, and the same four for the gradients in the backward (K/V heads
  fewer than cp are repeated to cp first); ring keeps its queries and passes its K/V block round the ring cp-1 times
  forward, and in the backward cp-1 times, each block followed by its gradient so far, plus one hop that takes each
  gradient home (`layer_traffic`): the next K/V block is posted before the current one is attended to, which on
  torch process groups overlaps the kernel; like every collective in `predict`, it is priced as if it did not
  (an upper bound);
* weights replicated over cp: one all-reduce over cp of every parameter's gradient in the backward;
* memory: the activations of `local_tokens` tokens, with what the method keeps differently (the all-to-all kernel
  keeps K/V at the repeated head count, an eager kernel its scores over all S keys; the ring keeps what a flash
  kernel keeps), and the working set of one layer's attention (`working_bytes`).

The split, the method rule and what a model must be to be split are tpkit.context's own (`SequenceSplit`,
`heads_fit`, `context_refusal` runs its checks), imported, so the estimates and the runtime cannot disagree.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from ..context.apply import attention_layers, hf_model
from ..context.attention import KERNELS, METHODS
from ..context.sequence import SequenceSplit
from ..context.ulysses import heads_fit
from .config import TransformerShape, transformer_shape
from .ranks import rank_widths


def local_tokens(seq_len: int, cp: int) -> int:
    """Tokens one rank holds of a sequence of `seq_len`: 2 x ceil(S / 2cp) (`SequenceSplit.local`); all of them at
    cp 1 (no split, no padding)."""
    return seq_len if cp == 1 else SequenceSplit(seq_len, cp).local


def context_refusal(model: nn.Module) -> str | None:
    """Why `model` cannot be made context-parallel, or None when it can: `tpkit.context_parallel`'s own checks (a
    Hugging Face model whose causal attention layers run a kernel tpkit wraps through the AttentionInterface, with
    nothing tpkit cannot split over the sequence), run without changing the model (a weightless one will do)."""
    try:
        hf = hf_model(model)
        kernel = hf.config._attn_implementation
        if kernel not in KERNELS:
            return f"{type(hf).__name__} runs attention kernel {kernel!r}; context parallelism wraps {KERNELS}"
        attention_layers(hf)
        transformer_shape(hf.config)  # the estimates price it from these sizes
    except (TypeError, ValueError, NotImplementedError) as exc:
        return str(exc)
    return None


def check_cp(cp: int, method: str) -> None:
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive int, got {cp!r}")
    if method not in METHODS:
        raise ValueError(f"cp_method must be one of {METHODS}, got {method!r}")


def check_priced(cp: int, goal: str, target) -> None:
    """Context parallelism is priced for training steps of a Hugging Face transformer (what tpkit.context splits)."""
    if cp > 1 and (goal not in ("train", "training") or not hasattr(getattr(target, "config", target), "model_type")):
        raise ValueError(f"context parallelism (cp={cp}) is priced for training steps of a Hugging Face transformer, "
                         f"not {goal!r} of {type(target).__name__}")


def resolve_method(heads: int, kv_heads: int, cp: int, asked: str = "auto") -> str:
    """The method a layer with these local heads takes for `asked` (all-to-all refused with the reason when it
    cannot split them; "auto" then takes the ring, as `tpkit.context` does)."""
    why = heads_fit(heads, kv_heads, cp)
    if asked == "all_to_all" and why:
        raise ValueError(f"context parallelism (method 'all_to_all'): {why}; use 'ring' (splits no heads) or 'auto'")
    return "ring" if asked == "ring" or why else "all_to_all"


def attention_method(shape: TransformerShape, tp: int, cp: int, asked: str = "auto", rank: int = 0) -> str:
    """The method TP rank `rank`'s attention takes at tp x cp (its local heads decide)."""
    heads, kv_heads, _, _ = rank_widths(shape, tp, rank)
    return resolve_method(heads, kv_heads, cp, asked)


def exchanged_kv_heads(kv_heads: int, cp: int) -> int:
    """K/V heads an all-to-all sends per rank: fewer than cp are repeated to cp (every rank then receives the one
    its query heads read)."""
    return cp if kv_heads < cp else kv_heads


@dataclasses.dataclass(frozen=True)
class LayerTraffic:
    """One attention layer's context-parallel messages in a training step: (kind, bytes of one rank's send buffer)
    forward and backward. Kinds: "all_to_all", and "send" (a ring step: each rank sends a buffer to the next rank
    while it receives one from the previous)."""

    method: str
    forward: tuple[tuple[str, float], ...]
    backward: tuple[tuple[str, float], ...]

    @property
    def nbytes(self) -> float:
        return sum(n for _, n in self.forward + self.backward)


def layer_traffic(shape: TransformerShape, batch: int, seq_len: int, item: int, tp: int, cp: int, method: str,
                  rank: int = 0) -> LayerTraffic:
    """The messages of one attention layer (see the module docstring) at a local micro-batch of `batch` sequences
    of `seq_len` tokens, `item` bytes per element:

        all-to-all: forward q, k, v, output, backward their gradients:
                    4 + 4 all-to-alls of b * S/cp * heads * d * item (K/V: the exchanged K/V heads)
        ring:       forward cp-1 sends of one K/V block (K and V of the rank's tokens: 2 * b * S/cp * kv * d * item),
                    backward cp-1 sends of the block and cp-1 of its gradient so far, then one of the gradient home
    """
    s, d = local_tokens(seq_len, cp), shape.head_dim
    heads, kv_heads, _, _ = rank_widths(shape, tp, rank)
    if method == "all_to_all":
        q = batch * s * heads * d * item
        kv = batch * s * exchanged_kv_heads(kv_heads, cp) * d * item
        four = (("all_to_all", q), ("all_to_all", kv), ("all_to_all", kv), ("all_to_all", q))
        return LayerTraffic(method, four, four)
    block = 2 * batch * s * kv_heads * d * item
    return LayerTraffic(method, (("send", block),) * (cp - 1), (("send", block),) * (2 * (cp - 1) + 1))


def working_bytes(shape: TransformerShape, batch: int, seq_len: int, item: int, tp: int, cp: int, method: str,
                  rank: int = 0) -> float:
    """What one layer's context-parallel attention holds while it runs, beyond what the layer keeps for backward
    (one layer at a time, so counted once per rank):

        all-to-all: the other copy of q, k, v and the output for heads/cp heads over the whole sequence (the
                    buffers an all-to-all fills beside the tensors it was given): b * S/cp * d * item * (2 heads + 2 kv)
        ring:       forward two K/V blocks (the one attended to and the one arriving) and the fp32 accumulator of the
                    rank's queries; backward the block and its gradient, each beside the one arriving (four blocks),
                    and the block's gradient at every query head; the larger. Where the CPU flash kernel is not
                    there (CUDA), the ring's block kernel in tensor ops holds a chunk pair's fp32 scores besides
                    (b * heads * (S/2cp)^2 * 4 bytes, a few times in its backward): not counted here
    """
    s, d = local_tokens(seq_len, cp), shape.head_dim
    heads, kv_heads, _, _ = rank_widths(shape, tp, rank)
    if method == "all_to_all":
        return batch * s * d * item * (2 * heads + 2 * exchanged_kv_heads(kv_heads, cp))
    block = 2 * batch * s * kv_heads * d * item
    return max(2 * block + 4 * batch * s * heads * d, 4 * block + 2 * batch * s * heads * d * item)


def context_seconds(traffic: LayerTraffic, layers: int, parameter_bytes, rates, cp: int, in_step: float) -> float:
    """The step's context-parallel communication at `rates` (`machine.MachineRates`): `layers` attention layers'
    messages and one all-reduce over cp per parameter (`parameter_bytes`: each tensor's bytes), each message with
    what a collective costs inside a step beyond an isolated call (`in_step`). An all-to-all is priced by the
    machine's "all_to_all" figures, else its all-gather's (`MachineRates.collective`); a ring step as one
    point-to-point message, the calibrated 2-rank all-gather of its bytes (what `pipeline.send_seconds` prices)."""
    if cp == 1:
        return 0.0
    seconds = 0.0
    for kind, nbytes in traffic.forward + traffic.backward:
        cost = rates.collective("all_to_all", cp) if kind == "all_to_all" else rates.collective("all_gather", 2)
        seconds += cost.seconds(nbytes) + in_step
    reduce = rates.collective("all_reduce", cp)
    return layers * seconds + sum(reduce.seconds(n) + in_step for n in parameter_bytes)


def context_messages(traffic: LayerTraffic, layers: int, parameters: int) -> int:
    """How many messages `context_seconds` prices."""
    return layers * (len(traffic.forward) + len(traffic.backward)) + parameters
