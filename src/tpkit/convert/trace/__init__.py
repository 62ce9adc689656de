"""Step 1 of conversion: trace a model's forward once and read its structure (world-size free).

    dataflow   the tracer: which layer's output reaches which layer's input, through which kind of ops
    flat       the leaves of an op's arguments and results (torch's pytree flattening, fast for plain containers)
    pieces     packed projections: one layer's output cut into pieces (q | k | v) along its features
    heads      what an attention module states of its heads, and its per-head arguments
    pairs      column -> row pairs (MLP, conv) found in the dataflow; attention blocks (`attention`)
    structure  `Analysis`: the traced dataflow, the pairs, the ties, remembered per model object
    blocks     repeated blocks: their signatures, and the model cut to its distinct blocks for the trace
"""
from __future__ import annotations

from .dataflow import Call, Tag, Trace, parameterised_leaves, trace
from .structure import Analysis, analyze_structure, base_prefix, default_inputs, traceable_experts, untraced_structure

__all__ = ["Analysis", "Call", "Tag", "Trace", "analyze_structure", "base_prefix", "default_inputs",
           "parameterised_leaves", "trace", "traceable_experts", "untraced_structure"]
