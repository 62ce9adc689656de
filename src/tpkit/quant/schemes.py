"""The shared pieces of every quantized format: what one layer stores and how its tensors follow the dense weight.

A format is data: a `WeightQuant` says how one linear layer's weight is stored (the integer or FP8 values, how
they are packed, the units their scales cover; `method` names its format family, `format` is that family's module
in the registry, `registry.py`), and `stored_tensors` lists the tensors that replace its `weight` in the state
dict, each with how its dims follow the dense `[out, in]` weight (`DimRule`). A `Quantization` is a checkpoint's:
its config as stored and the schemes by which its layers are matched. Every reader (the loader's byte ranges, the
layer's dequantization, the memory estimate) takes the facts from here; each format family's module
(`compressed_tensors.py`, `fp8.py`, `gptq.py`, `awq.py`) fills them in, and `registry.py` lists those in
`FORMATS`.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

#: quant_method -> its format family (a `format.Format`), filled by `registry.py` when `tpkit.quant` is imported
FORMATS: dict[str, Any] = {}


class QuantizationError(ValueError):
    """A quantized checkpoint tpkit cannot read as it is stored; names the method, scheme or layer and what is
    supported (`tpkit.quant.SUPPORTED`)."""


@dataclasses.dataclass(frozen=True)
class DimRule:
    """How one dim of a stored tensor follows the dense `[out, in]` weight: `dense` is the weight dim it runs along
    (None: its own, never split), `pack` dense entries packed into one stored entry, `group` dense entries sharing
    one stored entry (a scale's group or block)."""

    dense: int | None
    pack: int = 1
    group: int = 1

    @property
    def unit(self) -> int:
        return self.pack * self.group


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor a quantized layer stores in place of `weight`: its state-dict name, full shape, dtype (None:
    a floating dtype as the file holds it) and one `DimRule` per dim."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    dims: tuple[DimRule, ...]


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """How one layer's weight is stored. `layout`: "ct_pack" (compressed-tensors int packed into int32 along the
    input), "ct_int" (int8 values as they are), "float" (FP8 values, `scale_name` the scale), "gptq", "awq";
    `strategy`: "group", "channel", "tensor" or "block"; `act_order`: a `g_idx` maps each input column to its
    group (GPTQ desc_act)."""

    method: str
    layout: str
    bits: int
    symmetric: bool
    strategy: str
    group_size: int | None = None
    block: tuple[int, int] | None = None
    act_order: bool = False
    scale_name: str = "weight_scale"

    @property
    def format(self):
        """The format family this scheme belongs to (`format_of`)."""
        return format_of(self.method)

    def describe(self) -> str:
        what = {"group": f"group {self.group_size}", "channel": "per channel", "tensor": "per tensor",
                "block": f"block {self.block[0]}x{self.block[1]}" if self.block else "block"}[self.strategy]
        kind = "fp8" if self.layout == "float" else f"int{self.bits}"
        extra = (", asymmetric" if not self.symmetric else "") + (", act-order" if self.act_order else "")
        return f"{self.method} {kind} {what}{extra}"

    def units(self) -> tuple[int, int]:
        """The (out, in) sizes a split should keep whole when it can (packed words times groups or blocks): a split
        on these never cuts a group or a packed word."""
        return self._along(lambda r: r.unit)

    def packing(self) -> tuple[int, int]:
        """The (out, in) alignment a split must keep: dense entries packed into one stored word."""
        return self._along(lambda r: r.pack)

    def _along(self, size_of) -> tuple[int, int]:
        """`size_of(rule)` combined (lcm) over the stored tensors' dims that run along the weight's out / in dim,
        read from `stored_tensors` of a layer large enough that a per-channel or per-tensor scale (one entry for a
        whole dim) stands out from a group."""
        probe = 64 * math.lcm(32, self.group_size or 1, *(self.block or ()))
        out = [1, 1]
        for s in stored_tensors(self, probe, probe):
            for r in s.dims:
                if r.dense is not None and r.group < probe:
                    out[r.dense] = math.lcm(out[r.dense], size_of(r))
        return out[0], out[1]


def format_of(method: str):
    """The format family of `quant_method` `method` (`FORMATS`); `QuantizationError` for one tpkit does not read."""
    found = FORMATS.get(method)
    if found is None:
        raise QuantizationError(f"quantization_config: quant_method {method!r} is not supported; tpkit reads "
                                f"{'; '.join(f.supported for f in FORMATS.values())}. Load the model dequantized "
                                f"with transformers and save it unquantized, or use a checkpoint in one of those "
                                f"formats")
    return found


def groups(size: int, group: int) -> int:
    """How many entries of `group` cover `size` (the last one may be partial)."""
    return -(-size // group)


def stored_tensors(q: WeightQuant, out: int, in_: int) -> list[StoredTensor]:
    """The tensors a layer of `out` x `in_` features stores, as its checkpoint holds them (its format's)."""
    return q.format.stored_tensors(q, out, in_)


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization: its `quant_method`, the config as stored (written back by `consolidate`),
    and the schemes by which layers are matched (`scheme_for`)."""

    method: str
    config: Mapping[str, Any]
    groups: tuple[tuple[tuple[str, ...], WeightQuant], ...]  # (targets, scheme), compressed-tensors' config groups
    ignore: tuple[str, ...] = ()

    def scheme_for(self, name: str, class_name: str) -> WeightQuant | None:
        """The scheme of module `name` (of class `class_name`), or None when it is not quantized."""
        if any(_matches(name, class_name, t) for t in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(name, class_name, t) for t in targets):
                return scheme
        return None

    @property
    def stored_names(self) -> frozenset[str]:
        """Every tensor name (after the module's prefix) a quantized layer of this checkpoint may store."""
        return frozenset(s.name for _, q in self.groups for s in stored_tensors(q, 256, 256))

    def describe(self) -> str:
        return "; ".join(sorted({q.describe() for _, q in self.groups}))


def _matches(name: str, class_name: str, target: str) -> bool:
    """compressed-tensors' matching: `re:` a regular expression matched at the start of the module name, else a
    class name or an exact module name (HF's `modules_to_not_convert` entries also match as name suffixes)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == class_name or target == name or name.endswith("." + target)
