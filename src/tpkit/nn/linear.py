"""Column- and row-parallel linear layers (Megatron convention).

`ColumnParallelLinear` splits the OUTPUT features: weight rows and bias are sharded (`partition_dim` 0), the
forward needs no communication, and the gradient of the replicated input is all-reduced. `RowParallelLinear`
splits the INPUT features (`partition_dim` 1 of the weight): each rank multiplies its slice of the input and
one all-reduce sums the partial products; the bias is replicated and added once, after the reduction.
Column followed by Row is the Megatron MLP: one all-reduce forward, one backward.

With `sequence_parallel=True` the activations outside the pair are split along the sequence dim
(`sequence_dim`, default -2: the dim before the features, so `[batch, seq, hidden]` and `[seq, hidden]` both
work; use 0 for Megatron's `[seq, batch, hidden]`): Column all-gathers its input (backward reduce-scatter),
Row reduce-scatters its output (backward all-gather); same bytes as the all-reduce, but the norms and dropout
in between run on 1/N of the tokens. The sequence length must then be a multiple of the world size; the gradients
of replicated parameters used on sequence shards (the Row bias, norms) are summed over the ranks in the backward
(`mark_sequence_parallel`).

At world size 1 `forward` is exactly `F.linear(x, weight, bias)`: no autograd Function, no copy.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..layout import ShardLayout
from ._layer import (TensorParallelModule, check_index, check_last_dim, check_module, check_positive,
                     check_sequence_divisible, full_module, make_shard)
from .mappings import (copy_to_region, gather_from_region, gather_from_sequence_region, reduce_from_region,
                       reduce_scatter_to_sequence_region, scatter_to_region)
from .partition import partition_sizes
from ..quant.products import faster_linear
from .quantized import QuantMethod, plain_layout
from .sequence_parallel import mark_sequence_parallel

#: A branch added to a layer's local product (a LoRA adapter): the region's input in, a local output out.
Adapter = Callable[[torch.Tensor], torch.Tensor]


class _ParallelLinear(TensorParallelModule):
    """Shared construction of both linear layers; subclasses say which dim of the weight is split."""

    PARTITION_DIMS: dict[str, int | None] = {}
    _split_what = ""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Communicator | None,
                 sequence_parallel: bool, sequence_dim: int, chunk: int, even: bool, device, dtype,
                 _full: nn.Linear | None = None, _index: Sequence[int] | None = None,
                 _sizes: Sequence[int] | None = None, quant_method: QuantMethod | None = None,
                 weight_layout: ShardLayout | None = None):
        super().__init__()
        name = type(self).__name__
        check_positive(name, in_features=in_features, out_features=out_features)
        self._set_comm(comm)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), int(sequence_dim)
        split = in_features if self.PARTITION_DIMS["weight"] == 1 else out_features
        if _index is None:
            self.partition_sizes = tuple(partition_sizes(split, self.world_size, chunk, layer=name,
                                                         what=self._split_what, even=even))
        else:
            _index, sizes = check_index(name, self._split_what, split, _index, _sizes or [], self.rank,
                                        self.world_size)
            self.partition_sizes = tuple(sizes)
        self.partition_index = None if _index is None else tuple(_index)
        if _full is None:
            _full = full_module(lambda **kw: nn.Linear(in_features, out_features, bias, **kw), device, dtype)
        for pname in ("weight", "bias") if quant_method is None else ("bias",):
            dim = self.PARTITION_DIMS[pname]
            tensor = getattr(_full, pname)
            param = make_shard(tensor, dim, self.partition_sizes, self.rank, device=device, dtype=dtype,
                               requires_grad=True if tensor is None else tensor.requires_grad,
                               index=None if dim is None else _index)
            self.register_parameter(pname, param)
        self.quant_method = None
        if quant_method is not None:  # the weight stored in the checkpoint's format (`tpkit.nn.quantized`)
            if weight_layout is None and _index is not None:
                raise TypeError(f"{name}: a quantized layer with an explicit index needs its dense weight_layout")
            dense_dim = self.PARTITION_DIMS["weight"]
            full = (out_features, in_features)
            quant_method.create_weights(self, weight_layout or plain_layout(full, dense_dim, self.partition_sizes,
                                                                            self.rank),
                                        device if device is not None else _full.weight.device, name)

    @classmethod
    def from_module(cls, module: nn.Linear, comm: Communicator | None = None, *, device=None, dtype=None,
                    index: Sequence[int] | None = None, partition_sizes: Sequence[int] | None = None, **kwargs):
        """This rank's shard of an existing `nn.Linear` (meta modules give meta shards); with `quant_method` (a
        `tpkit.nn.quantized.QuantMethod`, and the dense `weight_layout` for an explicit index) the layer holds the
        format's stored tensors instead of a weight, empty (a load fills them).

        The shard is a copy, so the full module can be freed; at world size 1 the layer holds the module's own
        tensors. `device` / `dtype` move the shards; other keywords are the constructor's. `index` (with every
        rank's `partition_sizes`) picks explicit features of the split dimension instead of the split rule's
        contiguous slice: whole attention heads, KV heads held by several ranks (sizes may then add up to more
        than the full size), or the pieces of a packed projection.
        """
        check_module(cls.__name__, module, nn.Linear, {})
        if (index is None) != (partition_sizes is None):
            raise ValueError(f"{cls.__name__}.from_module: index and partition_sizes go together; got only one")
        return cls(module.in_features, module.out_features, module.bias is not None, comm=comm, device=device,
                   dtype=dtype, _full=module, _index=index, _sizes=partition_sizes, **kwargs)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x W^T + bias` with this rank's weight: the one product the forward computes (a quantized layer's method
        computes it from the stored weights, `tpkit.nn.quantized`; a bf16 / fp16 / float32 weight at a few rows goes
        through the faster of `F.linear` and tpkit's compiled product, `tpkit.quant.products.faster_linear`)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return faster_linear(x, self.weight, bias)

    @property
    def in_features_local(self) -> int:
        """Input features this rank's shard multiplies (the seed's name): all of them for a column layer, this
        rank's slice for a row layer. Read from the weight (`[out, in]`), so it is what the rank holds, explicit
        index and uneven splits included."""
        return self._local_shape()[1]

    @property
    def out_features_local(self) -> int:
        """Output features this rank's shard produces (the seed's name): this rank's slice for a column layer,
        all of them for a row layer (before its all-reduce they are partial sums). Read from the weight."""
        return self._local_shape()[0]

    def _local_shape(self) -> tuple[int, int]:
        """The local weight's `[out, in]` (a quantized layer's without dequantizing it)."""
        return self.quant_method.shape if self.quant_method is not None else tuple(self.weight.shape)

    def extra_repr(self) -> str:
        quant = f", quantized={self.quant_method.describe()}" if self.quant_method is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"world_size={self.world_size}, rank={self.rank}, local_weight={self._local_shape()}{quant}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class ColumnParallelLinear(_ParallelLinear):
    """`y = x W^T + b` with W's rows (output features) split over ranks; `y` stays split unless `gather_output`.

    `chunk`: output features come in units of `chunk` that must stay on one rank (e.g. `head_dim`);
    `even=True` also demands the same number of units on every rank. Weight `[out_local, in]`, bias `[out_local]`.
    """

    PARTITION_DIMS = {"weight": 0, "bias": 0}
    _split_what = "out_features"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 comm: Communicator | None = None, *, sequence_parallel: bool = False, sequence_dim: int = -2,
                 chunk: int = 1, even: bool = False, device=None, dtype: torch.dtype | None = None, **private):
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True and sequence_parallel=True cannot be combined; "
                             "the output of a sequence-parallel column layer feeds a RowParallelLinear")
        super().__init__(in_features, out_features, bias, comm, sequence_parallel, sequence_dim, chunk, even, device,
                         dtype, **private)
        self.gather_output = bool(gather_output)
        if self.gather_output and self.partition_index is not None:
            raise ValueError("ColumnParallelLinear: gather_output=True needs the contiguous split; an explicit index "
                             "would gather the features out of order")
        self.output_size_per_partition = self.partition_sizes[self.rank]

    def forward(self, x: torch.Tensor, adapter: Adapter | None = None) -> torch.Tensor:
        """`adapter` (a LoRA branch, `tpkit.nn.lora`): called on the input as this layer's shard multiplies it
        (after the copy / gather into the region) and added to the local output before any gather, so the branch
        shares the layer's one backward all-reduce of the input gradient and its forward hooks."""
        if self.world_size == 1:
            y = self.matmul(x, self.bias)
            return y if adapter is None else y + adapter(x)
        check_last_dim("ColumnParallelLinear", x, self.in_features, "input features")
        if self.sequence_parallel:
            x = gather_from_sequence_region(x, self.comm, self.sequence_dim)
        else:
            x = copy_to_region(x, self.comm)
        y = self.matmul(x, self.bias)
        if adapter is not None:
            y = y + adapter(x)
        if self.gather_output:
            y = gather_from_region(y, self.comm, -1, self.partition_sizes)
        return y

    def extra_repr(self) -> str:
        return super().extra_repr() + (", gather_output=True" if self.gather_output else "")


class RowParallelLinear(_ParallelLinear):
    """`y = x W^T + b` with W's columns (input features) split; partial products are summed across ranks.

    `input_is_parallel=True` (the default) expects this rank's slice of the input features (a
    ColumnParallelLinear's output); False takes the full input and keeps the slice itself. The bias is
    replicated and added after the reduction. Weight `[out, in_local]`, bias `[out]`.
    """

    PARTITION_DIMS = {"weight": 1, "bias": None}
    _split_what = "in_features"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 comm: Communicator | None = None, *, sequence_parallel: bool = False, sequence_dim: int = -2,
                 chunk: int = 1, even: bool = False, device=None, dtype: torch.dtype | None = None, **private):
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        super().__init__(in_features, out_features, bias, comm, sequence_parallel, sequence_dim, chunk, even, device,
                         dtype, **private)
        self.input_is_parallel = bool(input_is_parallel)
        if not self.input_is_parallel and self.partition_index is not None:
            raise ValueError("RowParallelLinear: input_is_parallel=False slices the input contiguously; an explicit "
                             "index needs the matching slice of the input (input_is_parallel=True)")
        self.input_size_per_partition = self.partition_sizes[self.rank]
        if self.sequence_parallel and self.bias is not None:
            mark_sequence_parallel(self, self.comm, ["bias"])  # added to this rank's slice of the sequence

    def forward(self, x: torch.Tensor, adapter: Adapter | None = None) -> torch.Tensor:
        """`adapter` (a LoRA branch, `tpkit.nn.lora`): called on this rank's slice of the input; its result, a
        partial sum like the shard's product, is added before the one all-reduce (no collective of its own)."""
        if self.world_size == 1:
            y = self.matmul(x, self.bias)
            return y if adapter is None else y + adapter(x)
        if self.input_is_parallel:
            check_last_dim("RowParallelLinear", x, self.input_size_per_partition,
                           f"input features (this rank's slice of {self.in_features}; pass input_is_parallel=False "
                           f"for the full input)")
        else:
            check_last_dim("RowParallelLinear", x, self.in_features, "input features")
            x = scatter_to_region(x, self.comm, -1, self.partition_sizes)
        y = self.matmul(x, None)
        if adapter is not None:
            y = y + adapter(x)
        if self.sequence_parallel:
            check_sequence_divisible("RowParallelLinear", y, self.sequence_dim, self.world_size)
            y = reduce_scatter_to_sequence_region(y, self.comm, self.sequence_dim)
        else:
            y = reduce_from_region(y, self.comm, inplace=True)  # `y` is this layer's own partial product
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.input_is_parallel else ", input_is_parallel=False")
