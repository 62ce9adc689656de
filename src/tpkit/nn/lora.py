"""LoRA adapters (Hugging Face PEFT) on tpkit's linear layers, split as Megatron splits them: no collective added.

A LoRA adapter adds `scaling * B(A(x))` to a layer's output (A: `[r, in]`, B: `[out, r]`). On a
`ColumnParallelLinear` (output features split) A stays whole and B holds the rows of the base's output features
this rank holds (the same positions: whole heads, packed pieces, KV rows two ranks share); on a
`RowParallelLinear` (input features split) A holds the base's input columns and B stays whole, and the
adapter's product, a partial sum like the shard's, is added before the layer's one all-reduce. The branch runs
inside the base layer's forward (`adapter=`), on the input as the shard sees it, so it shares the base's
backward all-reduce of the input gradient and its forward hooks (KV-head expansion, gradient sums).

The whole factor's gradient is a sum over ranks (the column's A sees each rank's output rows, the row's B each
rank's partial input): `sum_grads` sums it in the backward, as it does for KV rows. Rows of B that two ranks
hold (a shared KV head) are summed over their holders, as the base's rows are.

The classes are PEFT's `lora.Linear` with their forward and initialisation changed: PEFT creates them through
its custom-module dispatch (`register`; `tpkit.convert.peft.seam` fills it into the configs PEFT dispatches with), initialises each adapter full size under the same random draws as on
one process (so a seeded run starts from the one-process adapter), and this rank keeps its slice. Merging,
unmerging, several adapters, `set_adapter` and `disable_adapter` are PEFT's own code on the local shards, which
is exact: a row or column slice of `B @ A` is `B_rows @ A` or `B @ A_columns`, the same sums.

Imports PEFT (an optional dependency): nothing in `tpkit.nn` imports this module at load time.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraConfig
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from .embedding import ParallelEmbedding, VocabParallelEmbedding
from .grad_sums import GradSum, sum_grads, sum_of, summed
from .lora_checks import DORA_REASON, PLAIN_INITS, LoraTPError, check_config  # noqa: F401 (public here too)
from .linear import ColumnParallelLinear, RowParallelLinear
from .lora_dropout import one_mask_dropout
from .lora_embedding import VocabParallelLoraEmbedding
from .quantized import quant_method_of
from .record import SplitsParameters

class _ParallelLoraLinear(LoraLinear, SplitsParameters):
    """PEFT's `lora.Linear` on a tpkit linear layer: `SPLIT` names the factor split with the base ('lora_B' on a
    column layer, 'lora_A' on a row layer); the other is whole, its gradient summed over the ranks."""

    SPLIT = ""
    BASE: type = nn.Module

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0,
                 lora_alpha: int = 1, **kwargs: Any) -> None:
        where = f"{kwargs.get('target_name') or type(base_layer).__name__}"
        check_config(config, where)
        kwargs.pop("fan_in_fan_out", None)
        self.__dict__["tp_name"] = kwargs.get("target_name")  # the layer's name, for messages
        super().__init__(base_layer, adapter_name, config, r=r, lora_alpha=lora_alpha, **kwargs)
        # tpkit's layers hold [out, in] whatever the original stored (GPT-2's Conv1D: [in, out]); the adapter's
        # factors are the same either way, only the merge's transpose depended on it.
        self.fan_in_fan_out = False
        self._declare_split()

    def split_dims(self) -> dict[str, int]:
        """The split factor's tensors (a model built by hand holds no record that says so)."""
        if self.get_base_layer().world_size == 1:
            return {}
        dim = self._slice_positions()[0]
        factor = getattr(self, self.SPLIT)
        return {f"{self.SPLIT}.{a}.{n}": dim if n == "weight" else 0 for a, m in factor.items()
                for n, p in m.named_parameters(recurse=False) if not (n == "bias" and dim == 1)}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._declare_split()

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        """The full layer's sizes: PEFT builds and initialises the adapter full size, then it is sliced."""
        return int(module.in_features), int(module.out_features)

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: LoraConfig, **kwargs: Any) -> None:
        check_config(config, kwargs.get("target_name") or type(self.get_base_layer()).__name__)
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        self.split_adapter(adapter_name)
        self.fan_in_fan_out = False

    # -------------------------------------------------------------------------------------------- the split
    def split_adapter(self, adapter_name: str) -> None:
        """Keep this rank's slice of adapter `adapter_name`'s split factor and install the whole factor's gradient
        sum: after PEFT builds the adapter full size, or when the converter wraps a base layer it split."""
        raise NotImplementedError

    @property
    def comm(self):
        return self.get_base_layer().comm

    def _local_positions(self, dim_size: int) -> tuple[int, ...]:
        """Positions of the full split dimension this rank's base shard holds, in local order."""
        base = self.get_base_layer()
        if base.partition_index is not None:
            return tuple(base.partition_index)
        start = sum(base.partition_sizes[:base.rank])
        return tuple(range(start, start + base.partition_sizes[base.rank]))

    def _slice_positions(self) -> tuple[int, int, tuple[int, ...]]:
        """(dim of the split factor's weight, its full size there, this rank's positions)."""
        raise NotImplementedError

    def _watch_loads(self) -> None:
        """Once per layer: a full-size adapter tensor loaded into it (a stock PEFT file, a one-process state dict)
        is cut to this rank's slice first (`take_slices`)."""
        if not self.__dict__.get("_tp_takes_slices"):
            self.register_load_state_dict_pre_hook(take_slices)
            self.__dict__["_tp_takes_slices"] = True

    def _cut(self, module: nn.Linear, name: str, dim: int, positions: tuple[int, ...]) -> None:
        """Keep `positions` of `module.<name>` along `dim` (a new Parameter: what it holds is the base's layout,
        which the model's record derives the adapter's from, `adapter_layouts.py`)."""
        p = getattr(module, name)
        if p is None:
            return
        index = torch.tensor(positions, dtype=torch.long, device=p.device)
        setattr(module, name, nn.Parameter(p.detach().index_select(dim, index).clone(), requires_grad=p.requires_grad))

    def merge(self, *args: Any, **kwargs: Any) -> None:
        """PEFT's merge, refused on a quantized base: its weight is packed integers, and the dequantized tensor
        `weight` gives is a copy, so adding the delta to it would merge nothing while the adapter stops running."""
        base = self.get_base_layer()
        method = quant_method_of(base)
        if method is not None:
            raise LoraTPError(f"{type(base).__name__}: cannot merge a LoRA adapter into a quantized base layer "
                              f"({method.describe()}): its weight is stored packed. Keep the adapter unmerged, "
                              f"or load the checkpoint with tpkit.from_pretrained(path, dequantize=True) to merge "
                              f"into dense weights")
        super().merge(*args, **kwargs)

    def _active(self) -> list[str]:
        return [a for a in self.active_adapters if a in self.lora_A.keys()]

    # -------------------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise NotImplementedError(f"{type(self).__name__}: a mixed batch (adapter_names=) is not supported under "
                                      f"tensor parallelism; call set_adapter() per batch")
        for key in ("alora_offsets",):
            kwargs.pop(key, None)
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if self.merged or not self._active():
            return self.base_layer(x, *args, **kwargs)
        return self.base_layer(x, *args, adapter=self._branch, **kwargs)

    def _branch(self, x: torch.Tensor) -> torch.Tensor:
        """The active adapters' sum on the input as the base's shard sees it."""
        out = None
        for name in self._active():
            a, b, scaling = self.lora_A[name], self.lora_B[name], self.scaling[name]
            h = a(self._drop(name, self._cast_input_dtype(x, a.weight.dtype)))
            d = self._up(b, h) * scaling
            out = d if out is None else out + d
        return out.to(_base_dtype(self.get_base_layer()))

    def _up(self, b: nn.Linear, h: torch.Tensor) -> torch.Tensor:
        return b(h)

    def _drop(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Adapter `name`'s dropout on the input as this shard sees it: PEFT's module at one rank or when it does
        nothing, else this rank's part of one mask for all ranks (`tpkit.nn.lora_dropout`)."""
        dropout = self.lora_dropout[name]
        p = float(getattr(dropout, "p", 0.0))
        if p == 0.0 or not dropout.training or self.comm.world_size == 1:
            return dropout(x)
        where = f"{self.__dict__.get('tp_name') or type(self).__name__} adapter {name!r}"
        if self.SPLIT == "lora_A":  # a row base: this rank's features of the input
            base = self.get_base_layer()
            return one_mask_dropout(x, p, self.comm, where, self._local_positions(base.in_features), base.in_features)
        return one_mask_dropout(x, p, self.comm, where)


class ColumnParallelLoraLinear(_ParallelLoraLinear):
    """LoRA on a `ColumnParallelLinear`: A whole (gradient summed over the ranks), B holds the base's output rows
    (rows two ranks hold summed over their holders)."""

    SPLIT = "lora_B"
    BASE = ColumnParallelLinear

    def _slice_positions(self) -> tuple[int, int, tuple[int, ...]]:
        base = self.get_base_layer()
        return 0, base.out_features, self._local_positions(base.out_features)

    def split_adapter(self, adapter_name: str) -> None:
        base = self.get_base_layer()
        b, a = self.lora_B[adapter_name], self.lora_A[adapter_name]
        rows = self._local_positions(base.out_features)
        for name in ("weight", "bias"):
            self._cut(b, name, 0, rows)
        b.out_features = len(rows)
        self._watch_loads()
        comm = base.comm
        sum_grads(a, ["weight"], comm)
        spec = _base_rows_sum(base)
        if spec is not None:
            sum_grads(b, {n: spec for n, p in b.named_parameters(recurse=False)}, comm)


class RowParallelLoraLinear(_ParallelLoraLinear):
    """LoRA on a `RowParallelLinear`: A holds the base's input columns, B whole (gradient summed over the ranks);
    B's product joins the base's partial sum before its one all-reduce, B's bias is added after it."""

    SPLIT = "lora_A"
    BASE = RowParallelLinear

    def _slice_positions(self) -> tuple[int, int, tuple[int, ...]]:
        base = self.get_base_layer()
        return 1, base.in_features, self._local_positions(base.in_features)

    def split_adapter(self, adapter_name: str) -> None:
        base = self.get_base_layer()
        a, b = self.lora_A[adapter_name], self.lora_B[adapter_name]
        self._cut(a, "weight", 1, self._local_positions(base.in_features))
        a.in_features = a.weight.shape[1]
        self._watch_loads()
        sum_grads(b, ["weight"], base.comm)

    def _up(self, b: nn.Linear, h: torch.Tensor) -> torch.Tensor:
        # B's bias is added once, after the reduction (forward below), so B's forward is not called: its weight
        # enters through the gradient sum its forward would apply (the one `sum_grads` records for it).
        return F.linear(h, summed(b._parameters["weight"], GradSum(), self.comm))

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = super().forward(x, *args, **kwargs)
        if self.disable_adapters or self.merged:
            return out
        sequence = self.get_base_layer().sequence_parallel
        for name in self._active():
            bias = self.lora_B[name].bias
            if bias is not None:  # on a sequence slice under sequence parallelism: its gradient summed over ranks
                bias = summed(bias, GradSum(), self.comm) if sequence else bias
                out = out + (bias * self.scaling[name]).to(out.dtype)
        return out


def take_slices(module: _ParallelLoraLinear, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load pre-hook: replace each full-size tensor of the split factor (and of the base layer, which PEFT saves
    for an LM head it targets, as `nn.Linear` stores it) in `state_dict` by this rank's slice; a tensor already of
    the local size is left alone. So stock adapter files and one-process state dicts load."""
    dim, full, positions = module._slice_positions()
    for key in [k for k in state_dict if k.startswith((f"{prefix}{module.SPLIT}.", f"{prefix}base_layer."))]:
        t, name = state_dict[key], key[len(prefix):]
        along = dim if name.endswith("weight") else 0
        if name == "base_layer.bias" and dim == 1:
            continue  # a row layer's bias is whole
        if isinstance(t, torch.Tensor) and t.dim() > along and t.shape[along] == full != len(positions):
            state_dict[key] = t.index_select(along, torch.tensor(positions, dtype=torch.long, device=t.device))


def _base_dtype(base: nn.Module) -> torch.dtype:
    """The base layer's compute dtype, without dequantizing a quantized base's weight to read it."""
    method = quant_method_of(base)
    return method.dtype if method is not None else base.weight.dtype


def _base_rows_sum(base: nn.Module) -> GradSum | None:
    """The base weight's per-row gradient sum (rows several ranks hold), which B's rows then share."""
    method = quant_method_of(base)
    spec = method.weight_sum if method is not None else sum_of(base, "weight")
    return spec if spec is not None and spec.rows is not None else None


def _refuse_embedding(target: nn.Module, adapter_name: str, config: LoraConfig, **kwargs: Any) -> nn.Module:
    name = kwargs.get("target_name") or type(target).__name__
    raise LoraTPError(f"{name} ({type(target).__name__}): LoRA on an embedding split along its features is not "
                      f"supported; leave it out of target_modules, or convert it split along the vocabulary "
                      f"(VocabParallelEmbedding, the default plan), where LoRA is supported")


#: tpkit layer type -> the LoRA layer PEFT builds on it (PEFT's custom-module dispatch).
LORA_LAYERS: dict[type, Any] = {ColumnParallelLinear: ColumnParallelLoraLinear,
                                RowParallelLinear: RowParallelLoraLinear,
                                VocabParallelEmbedding: VocabParallelLoraEmbedding,
                                ParallelEmbedding: _refuse_embedding}


def lora_layer_for(module: nn.Module) -> type | None:
    """The LoRA layer class for a tpkit layer (a summing subclass made by `sum_grads` included), or None."""
    cls = next((v for k, v in LORA_LAYERS.items() if isinstance(module, k)), None)
    return cls if isinstance(cls, type) else None


def register(config: LoraConfig) -> LoraConfig:
    """`config` with tpkit's layers registered in PEFT's custom-module dispatch (returns it, changed in place).
    The registration is not part of the saved `adapter_config.json`, which stays a stock PEFT file."""
    known = getattr(config, "_custom_modules", None) or {}
    missing = {k: v for k, v in LORA_LAYERS.items() if known.get(k) is not v}
    if missing:
        config._register_custom_module(missing)
    return config
