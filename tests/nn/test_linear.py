"""ColumnParallelLinear / RowParallelLinear against one nn.Linear: outputs, input and weight gradients, uneven
splits, construction from sizes (same slice as the single-device init) and every error case."""
from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from torch import nn

import tpkit
from tpkit.comm import create_communicators
from tpkit.nn import ColumnParallelLinear, RowParallelLinear

from .helpers import (FP32_TOL, FP64_TOL, THREAD_SIZES, assert_small, local_slice, randn, rel_err, run,
                      seeded_linear)

SHAPES = [(12, 10), (7, 9), (5, 4)]  # 10 on 3 ranks, 9 on 2 and 4 ranks, 4 features on 3 ranks


def _column_errors(in_f, out_f, bias, gather, dtype, seed) -> dict:
    comm = tpkit.get_communicator()
    full = seeded_linear(in_f, out_f, bias, seed, dtype)
    layer = ColumnParallelLinear.from_module(full, gather_output=gather)
    sizes, r = layer.partition_sizes, comm.rank
    x = randn((2, 4, in_f), seed + 2, dtype).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    gy = randn((2, 4, out_f), seed + 3, dtype)
    y_ref = full(x_ref)
    (y_ref * gy).sum().backward()
    y = layer(x)
    (y * (gy if gather else local_slice(gy, -1, sizes, r))).sum().backward()
    tag = f"column{in_f}x{out_f} bias={bias} gather={gather}"
    errors = {
        f"{tag} out": rel_err(y, y_ref if gather else local_slice(y_ref, -1, sizes, r)),
        f"{tag} dx": rel_err(x.grad, x_ref.grad),
        f"{tag} dW": rel_err(layer.weight.grad, local_slice(full.weight.grad, 0, sizes, r)),
    }
    if bias:
        errors[f"{tag} db"] = rel_err(layer.bias.grad, local_slice(full.bias.grad, 0, sizes, r))
    return errors


def _row_errors(in_f, out_f, bias, parallel_input, dtype, seed) -> dict:
    comm = tpkit.get_communicator()
    full = seeded_linear(in_f, out_f, bias, seed, dtype)
    layer = RowParallelLinear.from_module(full, input_is_parallel=parallel_input)
    sizes, r = layer.partition_sizes, comm.rank
    x_full = randn((3, in_f), seed + 2, dtype)
    x = (local_slice(x_full, -1, sizes, r) if parallel_input else x_full).clone().requires_grad_()
    x_ref = x_full.clone().requires_grad_()
    gy = randn((3, out_f), seed + 3, dtype)
    (full(x_ref) * gy).sum().backward()
    y = layer(x)
    (y * gy).sum().backward()
    tag = f"row{in_f}x{out_f} bias={bias} parallel_input={parallel_input}"
    errors = {
        f"{tag} out": rel_err(y, full(x_full)),
        f"{tag} dx": rel_err(x.grad, local_slice(x_ref.grad, -1, sizes, r) if parallel_input else x_ref.grad),
        f"{tag} dW": rel_err(layer.weight.grad, local_slice(full.weight.grad, 1, sizes, r)),
    }
    if bias:
        errors[f"{tag} db"] = rel_err(layer.bias.grad, full.bias.grad)
    return errors


def linear_checks(dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    errors: dict = {}
    for i, (in_f, out_f) in enumerate(SHAPES):
        for bias in (True, False):
            for flag in (True, False):
                errors.update(_column_errors(in_f, out_f, bias, flag, dtype, 10 * i))
                errors.update(_row_errors(out_f, in_f, bias, flag, dtype, 10 * i + 5))
    return errors


@pytest.mark.parametrize("world_size", THREAD_SIZES)
def test_linear_matches_single_device_threads(world_size):
    assert_small(run(linear_checks, world_size, "threads", "float64"), FP64_TOL)
    assert_small(run(linear_checks, world_size, "threads", "float32"), FP32_TOL)


def _random_shape_errors(in_f: int, out_f: int, bias: bool, seed: int) -> dict:
    return {**_column_errors(in_f, out_f, bias, seed % 2 == 0, torch.float64, seed),
            **_row_errors(in_f, out_f, bias, seed % 3 != 0, torch.float64, seed)}


@settings(max_examples=10, deadline=None)
@given(world_size=st.integers(1, 4), extra_in=st.integers(0, 9), extra_out=st.integers(0, 9), bias=st.booleans(),
       seed=st.integers(0, 100))
def test_linear_random_uneven_shapes(world_size, extra_in, extra_out, bias, seed):
    results = run(_random_shape_errors, world_size, "threads", world_size + extra_in, world_size + extra_out, bias,
                  seed)
    assert_small(results, FP64_TOL)


@pytest.mark.parametrize("world_size", [1, 3, 4])
@pytest.mark.parametrize("cls,dim", [(ColumnParallelLinear, 0), (RowParallelLinear, 1)])
def test_construction_slices_single_device_init(world_size, cls, dim):
    """Built from sizes under one seed, rank r holds exactly rank r's slice of nn.Linear under that seed."""
    torch.manual_seed(7)
    ref = nn.Linear(10, 11)
    after_ref = torch.rand(1)
    for comm in create_communicators(world_size):
        torch.manual_seed(7)
        layer = cls(10, 11, comm=comm)
        assert torch.equal(torch.rand(1), after_ref), "construction must consume the RNG exactly like nn.Linear"
        sizes = layer.partition_sizes
        assert sum(sizes) == (11 if dim == 0 else 10)
        assert torch.equal(layer.weight, local_slice(ref.weight, dim, sizes, comm.rank))
        want_bias = local_slice(ref.bias, 0, sizes, comm.rank) if dim == 0 else ref.bias
        assert torch.equal(layer.bias, want_bias)
        # what is split is the layer's fact, by name (never an attribute of the Parameter)
        split = ({"weight": 0, "bias": 0} if dim == 0 else {"weight": 1}) if world_size > 1 else {}
        assert layer.split_dims() == split and not vars(layer.weight)


@pytest.mark.parametrize("world_size, split", [(2, [5, 5]), (3, [4, 3, 3])])
def test_local_features_are_the_shard_the_rank_holds(world_size, split):
    """`in_features_local` / `out_features_local` (the seed's names): the local weight's [out, in], uneven splits
    included; read-only."""
    for comm in create_communicators(world_size):
        col, row = ColumnParallelLinear(6, 10, comm=comm), RowParallelLinear(10, 6, comm=comm)
        assert (col.in_features_local, col.out_features_local) == (6, split[comm.rank]) == (
            col.weight.shape[1], col.weight.shape[0])
        assert (row.in_features_local, row.out_features_local) == (split[comm.rank], 6) == (
            row.weight.shape[1], row.weight.shape[0])
        with pytest.raises(AttributeError):
            col.out_features_local = 10
    held = ColumnParallelLinear.from_module(nn.Linear(6, 10), create_communicators(2)[1], index=[0, 1, 2, 9, 3],
                                            partition_sizes=[5, 5])
    assert held.out_features_local == 5  # an explicit index: what the rank holds


def test_meta_dtype_and_shared_tensors():
    comms = create_communicators(3)
    meta = ColumnParallelLinear(10, 8, comm=comms[2], device="meta", dtype=torch.bfloat16)
    assert meta.weight.is_meta and meta.weight.shape == (2, 10) and meta.weight.dtype == torch.bfloat16
    full_meta = nn.Linear(10, 8, device="meta")
    shard = RowParallelLinear.from_module(full_meta, comm=comms[0])
    assert shard.weight.is_meta and shard.weight.shape == (8, 4) and shard.bias.shape == (8,)
    full = seeded_linear(6, 4, True, 0, torch.float32)
    one = ColumnParallelLinear.from_module(full)  # world size 1 holds the module's own tensors
    assert one.weight.data_ptr() == full.weight.data_ptr()
    half = ColumnParallelLinear.from_module(full, comm=comms[1], dtype=torch.float64)
    assert half.weight.dtype == torch.float64 and torch.equal(half.weight, full.weight[2:3].double())
    assert half.weight.data_ptr() != full.weight.data_ptr()
    frozen = seeded_linear(6, 4, True, 0, torch.float32).requires_grad_(False)
    assert not RowParallelLinear.from_module(frozen, comm=comms[1]).weight.requires_grad


def _deepcopy_shares_comm() -> float:
    layer = RowParallelLinear(6, 4, input_is_parallel=False)
    twin = copy.deepcopy(layer)
    assert twin.comm is layer.comm and twin.weight is not layer.weight and torch.equal(twin.weight, layer.weight)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    return rel_err(twin(x), layer(x))


def test_deepcopy_shares_the_communicator():
    assert max(run(_deepcopy_shares_comm, 2, "threads")) == 0.0


def test_world_size_one_is_plain_linear():
    """No autograd Function at world size 1: the graph node is the one nn.Linear makes."""
    x = torch.randn(3, 5, 8, requires_grad=True)
    for layer in (ColumnParallelLinear(8, 4), RowParallelLinear(8, 4)):
        assert type(layer(x).grad_fn) is type(nn.Linear(8, 4)(x).grad_fn)


def _error_checks() -> str:
    comm = tpkit.get_communicator()
    row = RowParallelLinear(8, 4)
    col = ColumnParallelLinear(8, 4)
    for bad, layer in ((torch.randn(2, 8), row), (torch.randn(2, 5), col)):
        with pytest.raises(ValueError, match=f"{type(layer).__name__}: input of shape"):
            layer(bad)
    with pytest.raises(ValueError, match=r"RowParallelLinear.*sequence length.*multiple of the world size 2"):
        RowParallelLinear(8, 4, sequence_parallel=True)(torch.randn(3, 4))
    return f"ok {comm.rank}"


def test_forward_errors():
    assert run(_error_checks, 2, "threads") == ["ok 0", "ok 1"]


def test_construction_errors():
    comms = create_communicators(4)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: out_features must be a positive int, got 0"):
        ColumnParallelLinear(8, 0, comm=comms[0])
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: out_features 3 has only 3 rows/columns, fewer than "
                                         r"world size 4, so some rank would hold nothing; valid world sizes: 1\.\.3"):
        ColumnParallelLinear(8, 3, comm=comms[0])
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: out_features 20 is not a whole number of chunks of "
                                         r"8"):
        ColumnParallelLinear(8, 20, comm=comms[0], chunk=8)
    with pytest.raises(ValueError, match=r"RowParallelLinear: in_features 24 has only 3 chunks of 8, fewer than "
                                         r"world size 4.*valid world sizes: 1\.\.3"):
        RowParallelLinear(24, 8, comm=comms[0], chunk=8)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: out_features 48 \(6 chunks of 8\) cannot be split "
                                         r"evenly over world size 4; valid world sizes: \[1, 2, 3, 6\]"):
        ColumnParallelLinear(8, 48, comm=comms[0], chunk=8, even=True)
    with pytest.raises(ValueError, match="gather_output=True and sequence_parallel=True"):
        ColumnParallelLinear(8, 8, gather_output=True, sequence_parallel=True, comm=comms[0])
    with pytest.raises(ValueError, match="sequence_parallel=True needs input_is_parallel=True"):
        RowParallelLinear(8, 8, input_is_parallel=False, sequence_parallel=True, comm=comms[0])
    with pytest.raises(TypeError, match=r"ColumnParallelLinear.from_module: expected a torch.nn.Linear, got Conv2d"):
        ColumnParallelLinear.from_module(nn.Conv2d(2, 2, 1), comm=comms[0])


def test_chunks_keep_units_whole():
    comms = create_communicators(3)
    layers = [ColumnParallelLinear(4, 5 * 8, comm=c, chunk=8, device="meta") for c in comms]
    assert [l.partition_sizes for l in layers] == [(16, 16, 8)] * 3
    assert [l.weight.shape[0] for l in layers] == [16, 16, 8]


def _strided(n: int, world: int, rank: int) -> list[int]:
    """Every world-th feature starting at rank: a layout the contiguous split rule never produces."""
    return list(range(rank, n, world))


def _explicit_index_errors() -> dict:
    comm = tpkit.get_communicator()
    n, r = comm.world_size, comm.rank
    col_full, row_full = seeded_linear(5, 7, True, 10), seeded_linear(7, 4, True, 20)
    x = randn((3, 5), 1, torch.float64).requires_grad_(True)
    sizes = [len(_strided(7, n, q)) for q in range(n)]
    rows = _strided(7, n, r)
    col = ColumnParallelLinear.from_module(col_full, index=rows, partition_sizes=sizes)
    row = RowParallelLinear.from_module(row_full, index=rows, partition_sizes=sizes)
    y = row(torch.nn.functional.gelu(col(x)))
    y.sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    y_ref = row_full(torch.nn.functional.gelu(col_full(xr)))
    y_ref.sum().backward()
    return {"output": rel_err(y, y_ref), "input grad": rel_err(x.grad, xr.grad),
            "column weight grad": rel_err(col.weight.grad, col_full.weight.grad[rows]),
            "column bias grad": rel_err(col.bias.grad, col_full.bias.grad[rows]),
            "row weight grad": rel_err(row.weight.grad, row_full.weight.grad[:, rows]),
            "index recorded": 0.0 if col.partition_index == tuple(rows) else 1.0}


@pytest.mark.parametrize("world_size", [2, 3])
def test_explicit_index_shards_equal_the_full_layers(world_size):
    """from_module(index=, partition_sizes=) holds the named features, and a Column -> Row pair built that way
    equals the full pair (outputs and gradients)."""
    assert_small(run(_explicit_index_errors, world_size, "threads"), FP64_TOL)


def test_explicit_index_errors():
    comm = create_communicators(1)[0]
    lin = nn.Linear(4, 6)
    with pytest.raises(ValueError, match="index and partition_sizes go together"):
        ColumnParallelLinear.from_module(lin, comm, index=[0, 1])
    with pytest.raises(ValueError, match=r"index picks 2 of the 6 out_features but partition_sizes gives rank 0 3"):
        ColumnParallelLinear.from_module(lin, comm, index=[0, 1], partition_sizes=[3])
    with pytest.raises(ValueError, match=r"index entries \[6\] are outside the 6 out_features"):
        ColumnParallelLinear.from_module(lin, comm, index=[0, 6], partition_sizes=[2])
    with pytest.raises(ValueError, match="gather_output=True needs the contiguous split"):
        ColumnParallelLinear.from_module(lin, comm, index=[1, 0], partition_sizes=[2], gather_output=True)
    with pytest.raises(ValueError, match="input_is_parallel=False slices the input contiguously"):
        RowParallelLinear.from_module(lin, comm, index=[1, 0], partition_sizes=[2], input_is_parallel=False)
