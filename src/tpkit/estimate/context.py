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
  forward, and in the backward cp-1 times with the block's gradient beside it plus one hop that takes each
  gradient home (`layer_traffic`);
* weights replicated over cp: one all-reduce over cp of every parameter's gradient in the backward;
* memory: the activations of `local_tokens` tokens, with what the method keeps differently (the all-to-all kernel
  keeps K/V at the repeated head count, an eager kernel its scores over all S keys; the ring keeps what a flash
  kernel keeps), and the working set of one layer's attention (`working_bytes`).

The rules of the split and of the method choice are restated here, not imported: the estimates sit below the
layer that runs context parallelism and never import it (tests/estimate/test_context.py checks that both agree).
"""
from __future__ import annotations

import dataclasses

from .config import TransformerShape
from .ranks import rank_widths

METHODS = ("auto", "all_to_all", "ring")


def local_tokens(seq_len: int, cp: int) -> int:
    """Tokens one rank holds of a sequence of `seq_len`: 2 x ceil(S / 2cp) (`tpkit.context.SequenceSplit.local`)."""
    return seq_len if cp == 1 else 2 * -(-seq_len // (2 * cp))


def heads_refusal(heads: int, kv_heads: int, cp: int) -> str | None:
    """Why all-to-all cannot split these local heads over cp, or None (`tpkit.context.ulysses.heads_fit`)."""
    if heads % cp:
        return f"{heads} local query heads do not divide by cp {cp}"
    if kv_heads % cp and cp % kv_heads:
        return f"{kv_heads} local K/V heads neither divide by cp {cp} nor divide it"
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
    why = heads_refusal(heads, kv_heads, cp)
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
                    backward cp-1 sends of the block and its gradient (2 blocks) and one of the gradient home
    """
    s, d = local_tokens(seq_len, cp), shape.head_dim
    heads, kv_heads, _, _ = rank_widths(shape, tp, rank)
    if method == "all_to_all":
        q = batch * s * heads * d * item
        kv = batch * s * exchanged_kv_heads(kv_heads, cp) * d * item
        four = (("all_to_all", q), ("all_to_all", kv), ("all_to_all", kv), ("all_to_all", q))
        return LayerTraffic(method, four, four)
    block = 2 * batch * s * kv_heads * d * item
    return LayerTraffic(method, (("send", block),) * (cp - 1),
                        (("send", 2 * block),) * (cp - 1) + (("send", block),))


def working_bytes(shape: TransformerShape, batch: int, seq_len: int, item: int, tp: int, cp: int, method: str,
                  rank: int = 0) -> float:
    """What one layer's context-parallel attention holds while it runs, beyond what the layer keeps for backward
    (one layer at a time, so counted once per rank):

        all-to-all: the other copy of q, k, v and the output for heads/cp heads over the whole sequence (the
                    buffers an all-to-all fills beside the tensors it was given): b * S/cp * d * item * (2 heads + 2 kv)
        ring:       forward two K/V blocks (the one attended to and the one arriving) and the fp32 accumulator of the
                    rank's queries; backward the block with its gradient three times over (held, sent, arriving);
                    the larger
    """
    s, d = local_tokens(seq_len, cp), shape.head_dim
    heads, kv_heads, _, _ = rank_widths(shape, tp, rank)
    if method == "all_to_all":
        return batch * s * d * item * (2 * heads + 2 * exchanged_kv_heads(kv_heads, cp))
    block = 2 * batch * s * kv_heads * d * item
    return max(2 * block + 4 * batch * s * heads * d, 6 * block)


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
