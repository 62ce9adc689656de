"""Conv2d split over output channels (`ColumnParallelConv2d`) or input channels (`RowParallelConv2d`).

The same pair as the linear layers, with channels (dim -3 of `[N, C, H, W]` or `[C, H, W]`) in place of
features: Column holds filters `[out_local, in, kh, kw]` (`partition_dim` 0, bias sharded) and leaves its
output split over channels unless `gather_output`; Row holds `[out, in_local, kh, kw]` (`partition_dim` 1),
reduces the partial sums with one all-reduce and adds its replicated bias once. Grouped convolutions are not
supported (`groups` must be 1). Padding, padding modes, stride and dilation behave exactly as in `nn.Conv2d`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.communicator import Communicator
from ._layer import TensorParallelModule, check_module, check_positive, full_module, make_shard
from .mappings import copy_to_region, gather_from_region, reduce_from_region, scatter_to_region
from .partition import partition_sizes

_CHANNELS = -3


class _ParallelConv2d(TensorParallelModule):
    PARTITION_DIMS: dict[str, int | None] = {}

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride, padding, dilation, groups: int,
                 bias: bool, padding_mode: str, comm: Communicator | None, chunk: int, even: bool, device, dtype,
                 _full: nn.Conv2d | None = None):
        super().__init__()
        name = type(self).__name__
        if groups != 1:
            raise ValueError(f"{name}: groups={groups!r} is not supported (only groups=1)")
        check_positive(name, in_channels=in_channels, out_channels=out_channels)
        # A meta nn.Conv2d normalises every argument (tuples, "same", padding modes) exactly as torch does.
        shape = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, 1, bias, padding_mode,
                          device="meta")
        self._set_comm(comm)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding = shape.kernel_size, shape.stride, shape.padding
        self.dilation, self.padding_mode = shape.dilation, padding_mode
        self._reversed_padding_repeated_twice = shape._reversed_padding_repeated_twice
        dim = self.PARTITION_DIMS["weight"]
        split, what = (out_channels, "out_channels") if dim == 0 else (in_channels, "in_channels")
        self.partition_sizes = tuple(partition_sizes(split, self.world_size, chunk, layer=name, what=what, even=even))
        if _full is None:
            _full = full_module(lambda **kw: nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding,
                                                       dilation, 1, bias, padding_mode, **kw), device, dtype)
        for pname in ("weight", "bias"):
            tensor = getattr(_full, pname)
            self.register_parameter(pname, make_shard(
                tensor, self.PARTITION_DIMS[pname], self.partition_sizes, self.rank, device=device, dtype=dtype,
                requires_grad=True if tensor is None else tensor.requires_grad))

    def _conv(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return F.conv2d(x, self.weight, bias, self.stride, 0, self.dilation)
        return F.conv2d(x, self.weight, bias, self.stride, self.padding, self.dilation)

    @classmethod
    def from_module(cls, module: nn.Conv2d, comm: Communicator | None = None, *, device=None, dtype=None, **kwargs):
        """This rank's shard of an existing `nn.Conv2d` with `groups=1` (meta modules give meta shards)."""
        check_module(cls.__name__, module, nn.Conv2d, {"groups": 1})
        return cls(module.in_channels, module.out_channels, module.kernel_size, stride=module.stride,
                   padding=module.padding, dilation=module.dilation, bias=module.bias is not None,
                   padding_mode=module.padding_mode, comm=comm, device=device, dtype=dtype, _full=module, **kwargs)

    def _check_channels(self, x: torch.Tensor, expected: int, what: str) -> None:
        if x.dim() not in (3, 4) or x.shape[_CHANNELS] != expected:
            raise ValueError(f"{type(self).__name__}: input of shape {tuple(x.shape)} should be [N, C, H, W] or "
                             f"[C, H, W] with C = {expected} {what}")

    @property
    def in_channels_local(self) -> int:
        """Input channels this rank's filters take (all for a column layer, this rank's slice for a row layer);
        read from the weight `[out, in, kh, kw]`, like the linear layers' `in_features_local`."""
        return int(self.weight.shape[1])

    @property
    def out_channels_local(self) -> int:
        """Output channels this rank's filters produce (this rank's slice for a column layer, all for a row
        layer); read from the weight."""
        return int(self.weight.shape[0])

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, world_size={self.world_size}, rank={self.rank}, "
                f"local_weight={tuple(self.weight.shape)}")


class ColumnParallelConv2d(_ParallelConv2d):
    """Conv2d with its output channels (filters) split; the output stays split over channels unless
    `gather_output`. `chunk` keeps groups of channels together."""

    PARTITION_DIMS = {"weight": 0, "bias": 0}

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", gather_output: bool = False,
                 comm: Communicator | None = None, *, chunk: int = 1, even: bool = False, device=None,
                 dtype: torch.dtype | None = None, **private):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, comm, chunk, even, device, dtype, **private)
        self.gather_output = bool(gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return self._conv(x, self.bias)
        self._check_channels(x, self.in_channels, "input channels")
        y = self._conv(copy_to_region(x, self.comm), self.bias)
        if self.gather_output:
            y = gather_from_region(y, self.comm, _CHANNELS, self.partition_sizes)
        return y


class RowParallelConv2d(_ParallelConv2d):
    """Conv2d with its input channels split; partial sums are all-reduced, then the replicated bias is added.
    `input_is_parallel=False` takes the full input and keeps this rank's channels itself."""

    PARTITION_DIMS = {"weight": 1, "bias": None}

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", input_is_parallel: bool = True,
                 comm: Communicator | None = None, *, chunk: int = 1, even: bool = False, device=None,
                 dtype: torch.dtype | None = None, **private):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, comm, chunk, even, device, dtype, **private)
        self.input_is_parallel = bool(input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return self._conv(x, self.bias)
        if self.input_is_parallel:
            self._check_channels(x, self.partition_sizes[self.rank], f"(this rank's slice of {self.in_channels})")
        else:
            self._check_channels(x, self.in_channels, "input channels")
            x = scatter_to_region(x, self.comm, _CHANNELS, self.partition_sizes)
        y = reduce_from_region(self._conv(x, None), self.comm)
        if self.bias is None:
            return y
        return y + self.bias.view(-1, 1, 1)
