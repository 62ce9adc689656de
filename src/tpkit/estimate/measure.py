"""Any other module is measured (`measure_step`): one forward of a weightless copy on fake tensors (the estimates'
one fake mode, `fake_step.fake_tensors`), the bytes autograd saves for backward deduplicated by storage,
attributed to a rank by the converter's plan (between a column and a row layer the activations are split) and
scaled linearly with the batch.

The split is followed leaf by leaf with forward hooks: after a column layer the activations are split over the
ranks until the row layer (or gather) that makes them whole again, which is where the plan's collectives sit.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..convert.registry import module_layouts
from ..convert.styles import (CHANNELWISE, COLWISE, COLWISE_REP, EMBEDDING_COLWISE, EMBEDDING_ROWWISE, REPLICATE, ROWWISE,
                              ROWWISE_REP, VOCAB_PARALLEL)

_OUT_SPLIT = {COLWISE, VOCAB_PARALLEL}                  # output stays split
_GATHERED = {COLWISE_REP, EMBEDDING_COLWISE}            # output all-gathered: full again
_REDUCED = {ROWWISE, ROWWISE_REP, EMBEDDING_ROWWISE}    # output all-reduced: full again


def _leaves(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules()
            if next(iter(m.parameters(recurse=False)), None) is not None or not next(iter(m.children()), None)}


def _fallback_style(m: nn.Module, sharded: bool, t: int) -> str:
    """Type rule when no plan exists: a Linear/Conv2d whose output divides starts a pair (column), the next
    one whose input divides ends it (row); embeddings split the vocabulary; BatchNorm inside a pair is split."""
    from torch.nn.modules.batchnorm import _BatchNorm

    if isinstance(m, nn.Embedding) and m.num_embeddings % t == 0:
        return EMBEDDING_ROWWISE
    if isinstance(m, _BatchNorm) and sharded:
        return CHANNELWISE
    if isinstance(m, nn.Linear) or (isinstance(m, nn.Conv2d) and m.groups == 1):
        n_in = m.in_features if isinstance(m, nn.Linear) else m.in_channels
        n_out = m.out_features if isinstance(m, nn.Linear) else m.out_channels
        if sharded and n_in % t == 0:
            return ROWWISE
        if not sharded and n_out % t == 0:
            return COLWISE
    return REPLICATE


def _param_bytes_per_rank(m: nn.Module, style: str, t: int) -> float:
    """Bytes of `m`'s own parameters on rank 0 under `style` (the converter's layouts, plain splits)."""
    layouts = module_layouts(m, style, None, t, 0)
    return float(sum(layouts[n].local_numel * p.element_size() for n, p in m.named_parameters(recurse=False)))


def _nbytes(x) -> int:
    """Bytes of a tensor, or of the tensors in a tuple or list (what hooks see as inputs and outputs)."""
    return sum(v.numel() * v.element_size() for v in (x if isinstance(x, (tuple, list)) else [x])
               if isinstance(v, torch.Tensor))


class _StepRecorder:
    """Follows one forward leaf by leaf, at world size 1 and on rank 0 of t.

    The forward hooks (`pre`, `post`) and the saved-tensor hook (`pack`) share this state: the style each leaf
    gets, whether the activations are split at this point of the forward, the bytes autograd saves (and whether
    they were split when saved), the largest live input + output of a leaf, the FLOPs outside and inside a
    split region, and the collectives the plan puts where a region ends.
    """

    def __init__(self, model: nn.Module, styles: dict[str, str] | None, world_size: int):
        from torch.utils.flop_counter import FlopCounterMode

        self.styles, self.t = styles, world_size
        self.sharded = False        # activations are split over the ranks here
        self.region = False         # inside a column -> row pair: FLOPs divide over the ranks
        self.in_one = 0.0           # the current leaf's input bytes on one device
        self.in_rank = 0.0          # ... and on rank 0
        self.live = [0.0, 0.0]      # largest input + output of one leaf: one device, rank 0
        self.mark = 0               # FLOPs already attributed to a side
        self.flops = [0, 0]         # FLOPs outside / inside a split region
        self.chosen: dict[str, str] = {}
        self.collectives: list[tuple[str, int]] = []
        self.saved: dict[int, tuple[int, bool]] = {}
        self.alive: list[torch.Tensor] = []
        self.param_ptrs = {p.untyped_storage()._cdata for p in model.parameters()}
        self.param_ptrs |= {b.untyped_storage()._cdata for b in model.buffers()}
        self.counter = FlopCounterMode(display=False)

    def style_of(self, name: str, module: nn.Module) -> str:
        """The plan's style for a leaf, decided once, on its first call (the type rule needs `sharded` then)."""
        if name not in self.chosen:
            self.chosen[name] = (self.styles.get(name, REPLICATE) if self.styles is not None
                                 else _fallback_style(module, self.sharded, self.t)) if self.t > 1 else REPLICATE
        return self.chosen[name]

    def account_flops(self) -> None:
        total = self.counter.get_total_flops()
        self.flops[1 if self.region else 0] += total - self.mark
        self.mark = total

    def pre(self, name: str):
        def hook(module, inputs):
            style = self.style_of(name, module)
            self.account_flops()
            if style in _OUT_SPLIT | {COLWISE_REP}:
                self.region = True
            self.in_rank = _nbytes(inputs) / (self.t if self.sharded else 1)
            self.in_one = _nbytes(inputs)
        return hook

    def post(self, name: str):
        def hook(module, inputs, output):
            self.account_flops()
            style = self.chosen.get(name, REPLICATE)
            if style in _OUT_SPLIT:
                self.sharded = True
            elif style in _GATHERED | _REDUCED:
                self.sharded = self.region = False
                self.collectives.append(("all_gather" if style in _GATHERED else "all_reduce", _nbytes(output)))
            out = _nbytes(output)
            self.live[0] = max(self.live[0], self.in_one + out)
            self.live[1] = max(self.live[1], self.in_rank + out / (self.t if self.sharded else 1))
        return hook

    def pack(self, x):
        st = x.untyped_storage()
        self.alive.append(x)  # no storage address is reused while counting
        if st._cdata not in self.param_ptrs and st._cdata not in self.saved:
            self.saved[st._cdata] = (st.nbytes(), self.sharded)
        return x

    def run(self, model: nn.Module, leaves: dict[str, nn.Module], args, kwargs, training: bool) -> None:
        """One forward with the hooks on (training: under saved_tensors_hooks; inference: no_grad)."""
        handles = [m.register_forward_pre_hook(self.pre(n)) for n, m in leaves.items()]
        handles += [m.register_forward_hook(self.post(n)) for n, m in leaves.items()]
        try:
            with self.counter:
                if training:
                    with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda x: x):
                        model(*args, **kwargs)
                else:
                    with torch.no_grad():
                        model(*args, **kwargs)
                self.account_flops()
        finally:
            for h in handles:
                h.remove()

    def activations(self, training: bool) -> tuple[float, float]:
        """(one device, rank 0): saved bytes, split ones divided by t, in training; the live peak in inference."""
        if training:
            one = float(sum(n for n, _ in self.saved.values()))
            many = float(sum(math.ceil(n / self.t) if sharded else n for n, sharded in self.saved.values()))
            return one, many
        return self.live[0], self.live[1]


def _parameter_bytes(leaves: dict[str, nn.Module], chosen: dict[str, str], t: int) -> tuple[float, float]:
    """(parameter bytes, on rank 0), each parameter counted once (at its first leaf: tied weights) and split as
    that leaf's style shards it."""
    seen, params_one, params_rank = set(), 0.0, 0.0
    for name, m in leaves.items():
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen |= {id(p) for p in own}
        if own:
            params_one += sum(p.numel() * p.element_size() for p in own)
            params_rank += _param_bytes_per_rank(m, chosen.get(name, REPLICATE), t)
    return params_one, params_rank


def _fake(v):
    """A tensor argument as an uninitialised one of its shape and dtype (inside the fake mode: fake)."""
    return torch.empty(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v


def measure_step(model: nn.Module, args=(), kwargs=None, styles=None, world_size: int = 1,
                 training: bool = True) -> dict[str, Any]:
    """Run `model(*args, **kwargs)` once and measure, at world size 1 and on rank 0 of `world_size`:
    activations (training: bytes saved for backward, deduplicated by storage, parameters excluded;
    inference: the largest input+output of one layer), parameter bytes, forward FLOPs (those inside a
    column -> row pair divide over the ranks) and the collectives the plan adds, in order, as
    `(kind, result bytes)` with kind "all_reduce" or "all_gather".

    `styles` maps module names to plan styles; None applies the type rule of `_fallback_style`.
    """
    from .calls import meta_copy
    from .fake_step import fake_tensors

    kwargs = kwargs or {}
    t = world_size
    model = meta_copy(model)  # never the user's weights, never real data: shapes are all it needs
    with fake_tensors(model):
        model = model.to_empty(device="cpu")
        args = tuple(_fake(a) for a in args)
        kwargs = {k: _fake(v) for k, v in kwargs.items()}
        leaves = _leaves(model)
        recorder = _StepRecorder(model, styles, t)
        recorder.run(model, leaves, args, kwargs, training)
    one, many = recorder.activations(training)
    params_one, params_rank = _parameter_bytes(leaves, recorder.chosen, t)
    collectives = recorder.collectives if t > 1 else []
    outside, inside = recorder.flops
    largest = float(max((n for _, n in collectives), default=0))
    return {"activations": one, "activations_per_rank": many, "communication": largest,
            "collectives": collectives, "parameter_bytes": params_one, "parameter_bytes_per_rank": params_rank,
            "flops": float(outside + inside), "flops_per_rank": outside + inside / t}
