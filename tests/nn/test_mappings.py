"""Each conjugate mapping against its definition (forward and gradient), on random uneven shapes and world sizes."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpkit
from tpkit.comm import split_sizes
from tpkit.nn import (copy_to_region, gather_from_region, gather_from_sequence_region, reduce_from_region,
                      reduce_scatter_to_sequence_region, scatter_to_region, scatter_to_sequence_region)
from tpkit.nn.mappings import all_to_all

from .helpers import FP64_TOL, local_slice, randn, rel_err, run


def mapping_checks(shape: tuple, dim: int) -> dict:
    """Every mapping on rank-specific inputs x_r and upstream gradients g_r (seeded by rank), against sums,
    concatenations and slices computed from all ranks' tensors."""
    comm = tpkit.get_communicator()
    r, n = comm.rank, comm.world_size
    full_len = shape[dim]
    sizes = split_sizes(full_len, n)
    shard_shape = lambda k: tuple(sizes[k] if d == dim % len(shape) else s for d, s in enumerate(shape))  # noqa: E731
    xs_full = [randn(shape, 10 + k) for k in range(n)]  # per-rank full-size tensors
    xs_shard = [randn(shard_shape(k), 20 + k) for k in range(n)]  # per-rank shards
    gs_full = [randn(shape, 30 + k) for k in range(n)]
    gs_shard = [randn(shard_shape(k), 40 + k) for k in range(n)]
    total = lambda ts: torch.stack(ts).sum(0)  # noqa: E731
    errors = {}

    def check(name, fn, x, g, want_out, want_grad):
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(g)
        errors[f"{name} out"] = rel_err(y, want_out)
        errors[f"{name} grad"] = rel_err(x.grad, want_grad)

    check("copy", lambda x: copy_to_region(x, comm), xs_full[r], gs_full[r], xs_full[r], total(gs_full))
    check("reduce", lambda x: reduce_from_region(x, comm), xs_full[r], gs_full[0], total(xs_full), gs_full[0])
    for name, scatter in (("scatter", scatter_to_region), ("seq scatter", scatter_to_sequence_region)):
        check(name, lambda x: scatter(x, comm, dim), xs_full[0], gs_shard[r], local_slice(xs_full[0], dim, sizes, r),
              torch.cat(gs_shard, dim))
    check("gather", lambda x: gather_from_region(x, comm, dim, sizes), xs_shard[r], gs_full[0],
          torch.cat(xs_shard, dim), local_slice(gs_full[0], dim, sizes, r))
    check("seq gather", lambda x: gather_from_sequence_region(x, comm, dim, sizes), xs_shard[r], gs_full[r],
          torch.cat(xs_shard, dim), local_slice(total(gs_full), dim, sizes, r))
    check("seq reduce-scatter", lambda x: reduce_scatter_to_sequence_region(x, comm, dim), xs_full[r], gs_shard[r],
          local_slice(total(xs_full), dim, sizes, r), torch.cat(gs_shard, dim))
    # all_to_all from `dim` to the next dim (to itself for a 1-d tensor): the reference by cutting and concatenating,
    # its gradient by autograd through that
    other = (dim + 1) % len(shape)
    leaves = [x.clone().requires_grad_() for x in xs_full]
    outs = [torch.cat([local_slice(x, dim, sizes, k) for x in leaves], other) for k in range(n)]
    gs_out = [randn(tuple(o.shape), 50 + k) for k, o in enumerate(outs)]
    sum((o * g).sum() for o, g in zip(outs, gs_out)).backward()
    check("all_to_all", lambda x: all_to_all(x, comm, dim, other), xs_full[r], gs_out[r], outs[r], leaves[r].grad)
    return errors


@settings(max_examples=12, deadline=None)
@given(world_size=st.integers(1, 4), data=st.data())
def test_mappings_match_definitions_uneven(world_size, data):
    ndim = data.draw(st.integers(1, 3), label="ndim")
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim), label="shape"))
    dim = data.draw(st.integers(-ndim, ndim - 1), label="dim")
    shape = tuple(s + world_size if d == dim % ndim else s for d, s in enumerate(shape))  # every rank gets >= 1
    for errors in run(mapping_checks, world_size, "threads", shape, dim):
        assert errors and max(errors.values()) < FP64_TOL, errors


def test_world_size_one_returns_input_itself():
    comm = tpkit.get_communicator()
    x = torch.randn(3, 4, requires_grad=True)
    for fn in (copy_to_region, reduce_from_region, scatter_to_region, gather_from_region, scatter_to_sequence_region,
               gather_from_sequence_region, reduce_scatter_to_sequence_region):
        assert fn(x, comm) is x
    assert all_to_all(x, comm, 0, -1) is x


def _errors() -> str:
    comm = tpkit.get_communicator()
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"dim 2 is out of range for a tensor of shape \(4, 6\)"):
        scatter_to_region(x, comm, 2)
    with pytest.raises(ValueError, match=r"split: sizes \[1, 2\] do not cut dim 1 of size 6"):
        scatter_to_region(x, comm, -1, [1, 2])
    return "ok"


def test_errors():
    assert run(_errors, 2, "threads") == ["ok", "ok"]
