"""Quantized fused experts: a MoE layer's 3-D expert weights held as the checkpoint's quantized tensors, stacked.

transformers 5 keeps a MoE layer's experts as one module with 3-D parameters (`gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I]); a quantized checkpoint stores one quantized linear layer per expert projection
(`experts.{e}.w1.weight_packed`, `...weight_scale`, ...), which the loader reads as those tensors stacked over the
experts, gate and up concatenated (`tpkit.checkpoint.conversions.quantized_expert_entries`). `ExpertsQuantMethod`
holds one parameter that way: a child module under the parameter's name holding the stacked tensors
(`<experts>.gate_up_proj.weight_packed` [E, 2I, H/8], ...: each rank's slice, split as the dense parameter is: whole
experts under expert parallelism, every expert's rows or columns under tensor parallelism, the stored tensors
following them as a linear layer's do, `tpkit.quant.layouts`), and the parameter's name read through the one rewrite
protocol (`rewrites.py`), which dequantizes every local expert in the compute dtype as transformers' loader does.
The experts' own forward runs unchanged on that tensor; the weights are frozen.
"""
from __future__ import annotations

import copy
from typing import Mapping

import torch
from torch import nn

from ..layout import ShardLayout
from ..quant import QuantizationError, WeightQuant, dequantize, positions, stored_layout, stored_tensors
from .quantized import StoredWeight
from .rewrites import rewrite, rewrites_of

_MAP = "tp_qmap_{}_{}"


def _as_linear(dense: ShardLayout) -> ShardLayout:
    """The layout of one expert's `[out, in]` matrix from the stacked parameter's `[E, out, in]` (whole when the
    experts dim is the split one)."""
    shape = tuple(dense.full_shape[1:])
    if dense.dim in (1, 2) and not dense.is_replicated:
        return ShardLayout(shape, dense.world_size, dense.rank, dense.dim - 1, dense.pieces)
    return ShardLayout.replicated(shape, dense.world_size, dense.rank)


def _stacked(dense: ShardLayout, per_expert: ShardLayout, shape: tuple[int, ...]) -> ShardLayout:
    """A stored tensor's layout stacked over the experts: split with the experts under expert parallelism, else as
    one expert's (`per_expert`) one dim further in."""
    full = (dense.full_shape[0],) + tuple(shape)
    if dense.dim == 0 and not dense.is_replicated:
        return ShardLayout(full, dense.world_size, dense.rank, 0, dense.pieces)
    if per_expert.dim is None:
        return ShardLayout.replicated(full, dense.world_size, dense.rank)
    return ShardLayout(full, dense.world_size, dense.rank, per_expert.dim + 1, per_expert.pieces)


class ExpertsQuantMethod(StoredWeight):
    """How one stacked expert parameter is stored and read (see the module docstring)."""

    def create_weights(self, module: nn.Module, name: str, dense: ShardLayout, device,
                       where: str = "") -> dict[str, ShardLayout]:
        """Hold parameter `name` of `module` (the experts, its 3-D Parameter `[E, out, in]` of layout `dense`) as the
        stacked stored tensors, empty on `device`; returns their layouts by stored name (relative to the module:
        `<name>.<stored>`). Checks everything first."""
        where = f"{where}.{name}" if where else name
        if dense.transposed or len(dense.full_shape) != 3:
            raise QuantizationError(f"{where}: quantized experts are read as [experts, out, in] weights, not "
                                    f"{list(dense.full_shape)}{' transposed' if dense.transposed else ''}")
        if self.scheme.act_order:
            raise QuantizationError(f"{where}: quantized experts with act-order (g_idx) are not read; load with "
                                    f"dequantize=True")
        one = _as_linear(dense)
        specs = {s.name: s for s in stored_tensors(self.scheme, *one.full_shape) if s.name != "weight_shape"}
        per_expert = {n: stored_layout(one, s, where) for n, s in specs.items()}  # raises before anything changes
        layouts = {n: _stacked(dense, per_expert[n], s.shape) for n, s in specs.items()}
        device = torch.device(device if device is not None else "meta")
        holder, maps = nn.Module(), []
        for n, s in specs.items():
            dtype = s.dtype or self.stored_dtypes.get(n, self.dtype)
            holder.register_buffer(n, torch.empty(layouts[n].local_shape, dtype=dtype, device=device))
            for i in range(len(s.dims)):
                m = positions(one, s, i)
                if m is not None:
                    maps.append((n, i))
                    holder.register_buffer(_MAP.format(n, i), m.to(device if device.type != "meta" else "cpu"),
                                           persistent=False)
        self.specs, self.layouts, self.dense, self.maps = specs, layouts, dense, tuple(maps)
        del module._parameters[name]
        module._modules[name] = holder
        rewrite(module, name, self)
        return {f"{name}.{n}": lay for n, lay in layouts.items()}

    def read(self, module: nn.Module, name: str, stored: torch.Tensor | None) -> torch.Tensor:
        """The parameter as the experts' forward reads it: every local expert's dense slice, stacked."""
        b = module._modules[name]._buffers
        maps = {key: b[_MAP.format(*key)] for key in self.maps}
        shape = tuple(self.dense.local_shape[1:])
        experts = [dequantize(self.scheme, self.specs, {n: b[n][e] for n in self.specs}, maps, shape, self.dtype,
                              self.format) for e in range(self.dense.local_shape[0])]
        return torch.stack(experts)

    def describe(self) -> str:
        return self.scheme.describe()


def experts_methods_of(module: nn.Module) -> dict[str, ExpertsQuantMethod]:
    """The stacked expert parameters of `module` held quantized, by name."""
    return {n: how for n, how in rewrites_of(module).items() if isinstance(how, ExpertsQuantMethod)}


def copy_with(module: nn.Module, layouts: Mapping[str, ShardLayout], methods: Mapping[str, ExpertsQuantMethod],
              where: str = "") -> nn.Module:
    """A copy of the experts `module` (its settings, not its weights) holding this rank's part of each parameter
    of `layouts`: a slice of the dense parameter, or the stored tensors of the ones in `methods` (empty: a load
    fills them)."""
    keep = {id(t): t for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))}
    if getattr(module, "config", None) is not None:
        keep[id(module.config)] = module.config
    new = copy.deepcopy(module, keep)
    for pname, lay in layouts.items():
        p = getattr(module, pname)
        if pname in methods:
            methods[pname].create_weights(new, pname, lay, p.device, where)
        else:
            setattr(new, pname, nn.Parameter(lay.shard(p.detach()).clone(), requires_grad=p.requires_grad))
    return new
