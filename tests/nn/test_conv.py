"""ColumnParallelConv2d / RowParallelConv2d against one nn.Conv2d: outputs, input and weight gradients for
uneven channel splits, strides, 'same' padding and non-zero padding modes; construction and errors."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tpkit
from tpkit.comm import create_communicators
from tpkit.nn import ColumnParallelConv2d, RowParallelConv2d

from .helpers import FP64_TOL, THREAD_SIZES, assert_small, local_slice, randn, rel_err, run

CONFIGS = [
    dict(in_channels=5, out_channels=7, kernel_size=3, padding=1, bias=True),
    dict(in_channels=6, out_channels=4, kernel_size=(3, 2), stride=2, bias=False),
    dict(in_channels=4, out_channels=5, kernel_size=3, padding="same", padding_mode="reflect", dilation=2),
    dict(in_channels=4, out_channels=6, kernel_size=3, padding=2, padding_mode="circular"),
]


def seeded_conv(config: dict, seed: int, dtype=torch.float64) -> nn.Conv2d:
    m = torch.nn.utils.skip_init(nn.Conv2d, dtype=dtype, **config)
    with torch.no_grad():
        m.weight.copy_(randn(m.weight.shape, seed, dtype))
        if m.bias is not None:
            m.bias.copy_(randn(m.bias.shape, seed + 1, dtype))
    return m


def conv_checks(dtype_name: str = "float64") -> dict:
    dtype = getattr(torch, dtype_name)
    r = tpkit.get_communicator().rank
    errors = {}
    for i, config in enumerate(CONFIGS):
        full = seeded_conv(config, i, dtype)
        for batched in (True, False):
            shape = ((2,) if batched else ()) + (config["in_channels"], 9, 8)
            x_full = randn(shape, 10 + i, dtype)
            x_ref = x_full.clone().requires_grad_()
            y_ref = full(x_ref)
            gy = randn(y_ref.shape, 20 + i, dtype)
            full.zero_grad()
            (y_ref * gy).sum().backward()
            for cls, flag in ((ColumnParallelConv2d, False), (ColumnParallelConv2d, True),
                              (RowParallelConv2d, True), (RowParallelConv2d, False)):
                layer = cls.from_module(full, **({"gather_output": flag} if cls is ColumnParallelConv2d
                                                  else {"input_is_parallel": flag}))
                sizes, tag = layer.partition_sizes, f"{cls.__name__} {i} batched={batched} flag={flag}"
                row_parallel_input = cls is RowParallelConv2d and flag
                x = (local_slice(x_full, -3, sizes, r) if row_parallel_input else x_full).clone().requires_grad_()
                y = layer(x)
                split_out = cls is ColumnParallelConv2d and not flag
                (y * (local_slice(gy, -3, sizes, r) if split_out else gy)).sum().backward()
                errors[f"{tag} out"] = rel_err(y, local_slice(y_ref, -3, sizes, r) if split_out else y_ref)
                errors[f"{tag} dx"] = rel_err(x.grad, local_slice(x_ref.grad, -3, sizes, r) if row_parallel_input
                                              else x_ref.grad)
                dim = cls.PARTITION_DIMS["weight"]
                errors[f"{tag} dW"] = rel_err(layer.weight.grad, local_slice(full.weight.grad, dim, sizes, r))
                if full.bias is not None:
                    want_db = full.bias.grad if dim == 1 else local_slice(full.bias.grad, 0, sizes, r)
                    errors[f"{tag} db"] = rel_err(layer.bias.grad, want_db)
    return errors


@pytest.mark.parametrize("world_size", THREAD_SIZES)
def test_convs_match_single_device_threads(world_size):
    assert_small(run(conv_checks, world_size, "threads"), FP64_TOL)


@pytest.mark.parametrize("cls", [ColumnParallelConv2d, RowParallelConv2d])
def test_construction_slices_single_device_init(cls):
    torch.manual_seed(5)
    ref = nn.Conv2d(5, 7, 3, padding=1)
    for comm in create_communicators(3):
        torch.manual_seed(5)
        layer = cls(5, 7, 3, padding=1, comm=comm)
        dim = cls.PARTITION_DIMS["weight"]
        assert torch.equal(layer.weight, local_slice(ref.weight, dim, layer.partition_sizes, comm.rank))
        assert torch.equal(layer.bias, ref.bias if dim == 1 else local_slice(ref.bias, 0, layer.partition_sizes,
                                                                             comm.rank))
    meta = cls.from_module(nn.Conv2d(8, 8, 1, device="meta"), comm=create_communicators(4)[1])
    assert meta.weight.is_meta and meta.weight.shape == ((2, 8, 1, 1) if dim == 0 else (8, 2, 1, 1))


def _input_errors() -> str:
    with pytest.raises(ValueError, match=r"RowParallelConv2d: input of shape \(1, 4, 5, 5\) should be \[N, C, H, W\] "
                                         r"or \[C, H, W\] with C = 2"):
        RowParallelConv2d(4, 4, 1)(torch.randn(1, 4, 5, 5))
    with pytest.raises(ValueError, match=r"ColumnParallelConv2d: input of shape \(5, 5\)"):
        ColumnParallelConv2d(4, 4, 1)(torch.randn(5, 5))
    return "ok"


@pytest.mark.parametrize("world_size, split", [(2, [5, 5]), (3, [4, 3, 3])])
def test_local_channels_are_the_filters_the_rank_holds(world_size, split):
    for comm in create_communicators(world_size):
        col, row = ColumnParallelConv2d(6, 10, 3, comm=comm), RowParallelConv2d(10, 6, 3, comm=comm)
        assert (col.in_channels_local, col.out_channels_local) == (6, split[comm.rank]) == col.weight.shape[1::-1]
        assert (row.in_channels_local, row.out_channels_local) == (split[comm.rank], 6) == row.weight.shape[1::-1]


def test_errors():
    assert run(_input_errors, 2, "threads") == ["ok", "ok"]
    comms = create_communicators(2)
    with pytest.raises(ValueError, match=r"ColumnParallelConv2d: groups=2 is not supported"):
        ColumnParallelConv2d(4, 4, 3, groups=2, comm=comms[0])
    with pytest.raises(ValueError, match=r"RowParallelConv2d.from_module: groups=4 is not supported"):
        RowParallelConv2d.from_module(nn.Conv2d(4, 4, 3, groups=4), comm=comms[0])
    with pytest.raises(ValueError, match=r"RowParallelConv2d: in_channels 1 has only 1 rows/columns, fewer than world "
                                         r"size 2"):
        RowParallelConv2d(1, 4, 3, comm=comms[0])
