"""Fused fast paths: forwards that bypass the layers `parallelize` swaps, and what to do about them.

Some forwards do not call every layer they own. PyTorch's `nn.TransformerEncoderLayer` in `eval()` under
`no_grad` hands all its weights to one fused kernel (`torch._transformer_encoder_layer_fwd`), reading
`linear1.weight` and the attention's `in_proj_weight` directly: after a swap it would read this rank's shards as
if they were whole and return wrong numbers without an error. Others always read a child's weight directly
(`F.multi_head_attention_forward(..., self.out_proj.weight, ...)`, a head computing `x @ self.embed.weight.T`).

Two rules, so a converted model is exact in train and eval, with and without grad:
- known fast paths (the table below) are switched off, per module, wherever anything inside them is split, by
  the attribute PyTorch itself reads to decide; the slow path calls the (swapped) layers one by one;
- a layer whose parameters the traced forward reads outside the layer's own forward (`Trace.read_directly`) is
  never split: this family, first in the registry, keeps it whole with the reason, so every later family
  leaves it (and every layer paired with it) whole; a user plan that splits it is refused before anything
  changes. A `nn.MultiheadAttention` reading its own `out_proj` is left to the MultiheadAttention family,
  whose replacement calls the layer.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from torch import nn

from ..errors import PlanError
from ..family import Checked, Choice, Draft, Family, Planned, Proposal
from ..styles import REPLICATE


def _encoder_layer_off(m: nn.Module) -> dict:
    # The fused kernel runs only when `activation_relu_or_gelu` is set; the slow path uses `self.activation`.
    return {"activation_relu_or_gelu": 0} if getattr(m, "activation_relu_or_gelu", 0) else {}


def _encoder_off(m: nn.Module) -> dict:
    # The stack converts padded batches to nested tensors for its layers' fused kernel; off with the kernel.
    return {"use_nested_tensor": False} if getattr(m, "use_nested_tensor", False) else {}


# Module class -> the attribute values that turn its fast path off (empty when it is already off).
FAST_PATHS: dict[type, Callable[[nn.Module], dict]] = {
    nn.TransformerEncoderLayer: _encoder_layer_off,
    nn.TransformerEncoder: _encoder_off,
}


def direct_read_reason(name: str, op: str) -> str:
    return (f"its parameters are read directly by `{op}` outside its own forward (a fused fast path or a parent "
            f"using its weight); a shard there would be taken for the whole tensor, so it stays whole")


class FastPaths(Family):
    """Layers read directly stay whole (planned first); known fused fast paths are switched off around splits."""

    name = "fast_paths"

    def detect(self, analysis) -> Mapping[str, str]:
        """Layers read directly, other than by the MultiheadAttention that owns them: layer -> the op."""
        t = analysis.trace
        return {} if t is None else {n: op for n, op in t.read_directly.items() if n not in t.readers}

    def propose(self, draft: Draft, found: Mapping[str, str]) -> list[Proposal]:
        return [Proposal(self.name, name, (Choice("whole", {name: REPLICATE},
                                                  reasons={name: direct_read_reason(name, op)}),))
                for name, op in found.items()]

    def validate(self, planned: Planned) -> Checked | None:
        """Refuse a plan that splits a layer whose weight some other code reads directly (unless that code is a
        MultiheadAttention replaced by a split one, which calls the layer)."""
        t = planned.analysis.trace
        if t is None or planned.world_size == 1:
            return None
        for name, op in t.read_directly.items():
            s = planned.style_of(name)
            reader = t.readers.get(name)
            if planned.style_object(name).splits and not (reader and planned.style_object(reader).owns_module):
                raise PlanError(f"{name}: planned {s!r}, but {direct_read_reason(name, op)}; plan it 'replicate'")
        return None

    def attributes(self, planned: Planned) -> Mapping[str, Mapping[str, Any]]:
        """`{module name: attributes to set}` switching off the fast path of every known fast-path module that
        holds a layer this plan splits (modules holding nothing split keep theirs: their weights are whole)."""
        if planned.world_size == 1:
            return {}
        split = [n for n in planned.styles if planned.style_object(n).splits]
        out: dict[str, dict] = {}
        for name, m in planned.model.named_modules():
            rule = next((f for cls, f in FAST_PATHS.items() if type(m) is cls), None)
            if rule is None:
                continue
            inside = [n for n in split if name == "" or n == name or n.startswith(name + ".")]
            change = rule(m) if inside else {}
            if change:
                out[name] = change
        return out
