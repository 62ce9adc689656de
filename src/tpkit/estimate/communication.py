"""Communication buffers: the largest collective result a rank must hold.

Not a flat percentage: an all-reduced (b, s, h) activation, or gathered (b, s, v) logits for inference, whichever
is larger, because that one buffer is what a rank must find room for on top of everything else.
"""
from __future__ import annotations

from .config import TransformerShape


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
