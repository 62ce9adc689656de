"""Activations and parameters per rank from the traced graph: the bytes one forward saves for backward, read
off a weightless copy of the model converted for that rank and run on fake tensors.

Why not a formula: what autograd keeps depends on every op of the block (the activation's own saves, a fp32
upcast inside a norm, whether the attention kernel keeps probabilities or a log-sum-exp, CPU dropout masks in
the input dtype), and a formula per architecture is only as good as the last block shape someone wrote down
(on the test models: -15% to +56% for GPT-2, BERT, OPT and GPT-NeoX blocks). Here the model itself says:

1. a copy with meta parameters (nothing allocated; a config is built on the meta device with 1 and 2 layers);
2. for rank r of t, `parallelize` with a `ShapeCommunicator`: the very layers, head layout, sequence
   parallel region and vocab-parallel loss a real rank gets, so per-rank shapes are exact, uneven splits
   included;
3. one training forward (with labels, so the loss counts) of that copy on fake tensors, run by the estimates'
   one fake run (`fake_step.trace_step`, which the speed estimate's op trace runs too) under
   `saved_tensors_hooks`; saved tensors are counted once per storage, parameters and buffers excluded - exactly
   how the tests measure a real forward. No data is computed: a 70B layer costs what a 70-parameter one does.

A config is traced with 1 and 2 layers: the difference is one layer's bytes (per layer, per rank), and the
stack is extrapolated linearly (`outside + L * per_layer`), which is exact for the identical layers of these
models. Parameter shapes come from the same converted copy, so parameter, gradient and optimizer bytes are
exact, and so is an FSDP shard of them (`parameters(dp_size)`). Under expert parallelism (`ep`) the copy's experts
are the rank's own (`experts.spread_experts`), which FSDP2 leaves whole.

What it reflects: CPU kernels (the dispatch fake CPU tensors follow). On CUDA, dropout keeps a 1-byte mask and
fused attention a similar log-sum-exp; the Korthikanti-style formula (`activations.py`) models CUDA's masks and
is kept as a cross-check.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..convert.planning.planner import propose
from ..convert.trace import analyze_structure
from .calls import as_call, meta_copy, with_layers
from .fake_step import trace_step


@dataclass(frozen=True)
class TracedStep:
    """One rank's traced training forward: saved bytes and local parameter shapes, of a model with `layers[0]`
    and `layers[1]` transformer layers, extrapolated to `num_layers` (identical layers)."""

    rank: int
    world_size: int
    saved: tuple[int, int]
    shapes: tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]
    layers: tuple[int, int]
    num_layers: int
    experts: tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] = ((), ())  # spread over ep: not sharded

    def _extrapolate(self, a: float, b: float) -> float:
        if self.layers[0] == self.layers[1]:
            return a
        per_layer = (b - a) / (self.layers[1] - self.layers[0])
        return a + (self.num_layers - self.layers[0]) * per_layer

    @property
    def activations(self) -> float:
        """Bytes saved for backward by the whole model on this rank."""
        return self._extrapolate(*self.saved)

    @property
    def per_layer(self) -> float | None:
        """Bytes one transformer layer saves on this rank (None when the model was traced whole)."""
        if self.layers[0] == self.layers[1]:
            return None
        return (self.saved[1] - self.saved[0]) / (self.layers[1] - self.layers[0])

    def parameters(self, dp_size: int = 1) -> int:
        """Parameters on this rank; with `dp_size` > 1, its FSDP2 shard: dim 0 of every local tensor cut in
        `dp_size` chunks of ceil(dim0 / dp_size) rows (padded), the largest of which rank 0 holds; the expert
        weights of expert parallelism whole."""
        def count(shapes, dp):
            return sum(_fsdp_rows(s[0] if s else 1, dp) * math.prod(s[1:]) for s in shapes)
        return int(round(self._extrapolate(*(count(shapes, dp_size) - count(experts, dp_size) + count(experts, 1)
                                             for shapes, experts in zip(self.shapes, self.experts)))))

    def expert_parameters(self) -> int:
        """Expert weights this rank holds under expert parallelism (0 without it)."""
        return int(round(self._extrapolate(*(sum(math.prod(s) for s in e) for e in self.experts))))


def _fsdp_rows(rows: int, dp_size: int) -> int:
    return -(-rows // dp_size)


def _meta_example(example):
    """The example call on the meta device, for the planner's trace of a module without a config."""
    if example is None:
        return None
    def meta(v):
        return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
    args, kwargs = as_call(example)
    return {k: meta(v) for k, v in kwargs.items()} if kwargs else tuple(meta(a) for a in args)


def _trace_one(model: nn.Module, rank: int, world_size: int, sequence_parallel: bool, batch: int, seq: int,
               example, ep: int = 1):
    """(saved bytes, local parameter shapes, expert shapes) of a training forward of `model` (meta) as rank `rank`
    of `world_size` (and of `ep`: its experts kept whole by TP, spread over ep)."""
    plan = propose(analyze_structure(model), world_size, "training", {"fused_experts": "whole"})[0] \
        if ep > 1 and world_size > 1 else "auto"
    step = trace_step(model, "train", world_size, rank, batch, seq, plan=plan, sequence_parallel=sequence_parallel,
                      example=example, meta_example=_meta_example(example), backward=False, ep=ep)
    return step.saved_bytes, step.parameter_shapes, step.expert_shapes


def trace_rank(model_or_config, world_size: int, rank: int, dtype: torch.dtype, batch_size: int = 1,
               seq_len: int = 128, sequence_parallel: bool = False, attention: str | None = None,
               example_input=None, whole: bool = False, ep: int = 1) -> TracedStep:
    """Trace rank `rank` of TP `world_size` (see the module doc). `model_or_config`: an HF config, a model
    with one (rebuilt from it on meta, 1 and 2 layers, unless `whole`), or any module (copied to meta and
    traced whole; pass `example_input`, batch first). `ep`: its experts spread over ep ranks (ep rank `rank`)."""
    config = model_or_config if not isinstance(model_or_config, nn.Module) else getattr(model_or_config,
                                                                                        "config", None)
    layers = getattr(config, "num_hidden_layers", None) if config is not None else None
    results = []
    if isinstance(layers, int) and layers >= 2 and hasattr(config, "model_type") and not whole:
        model_cls = type(model_or_config) if isinstance(model_or_config, nn.Module) else None
        for n in (1, 2):
            model = with_layers(config, model_cls, n, dtype, attention)
            results.append(_trace_one(model, rank, world_size, sequence_parallel, batch_size, seq_len,
                                      example_input, ep))
        counted = (1, 2)
    else:
        if not isinstance(model_or_config, nn.Module) and not whole:
            raise TypeError(f"trace_rank needs an nn.Module or a Hugging Face config with num_hidden_layers >= 2, "
                            f"got {type(model_or_config).__name__}")
        model = (meta_copy(model_or_config) if isinstance(model_or_config, nn.Module)
                 else with_layers(config, None, layers, dtype, attention))
        model = model.to(dtype) if dtype is not None else model
        results = [_trace_one(model, rank, world_size, sequence_parallel, batch_size, seq_len, example_input,
                              ep)] * 2
        counted, layers = (0, 0), 0
    return TracedStep(rank, world_size, (results[0][0], results[1][0]), (results[0][1], results[1][1]), counted,
                      layers, (results[0][2], results[1][2]))


def trace_fullest_rank(model_or_config, world_size: int, dtype: torch.dtype, batch_size: int = 1,
                       seq_len: int = 128, sequence_parallel: bool = False, attention: str | None = None,
                       example_input=None, even: bool = False, ep: int = 1) -> TracedStep:
    """The traced rank that keeps the most (activations plus parameters). With `even` (every split divides)
    all ranks hold the same and only rank 0 is traced. `ep`: experts spread over ep ranks (TP rank r is ep rank r of
    its expert group's first tp group; ep rank 0 holds the most experts)."""
    ranks = [0] if even or world_size == 1 else range(world_size)
    steps = [trace_rank(model_or_config, world_size, r, dtype, batch_size, seq_len, sequence_parallel, attention,
                        example_input, ep=ep) for r in ranks]
    item = dtype.itemsize
    return max(steps, key=lambda s: s.activations + s.parameters() * item)
