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


def _inference_forwards() -> list[str]:
    """Every mapping a decoded token calls, three ways on this rank: recorded (autograd on, an input that needs a
    gradient), under `no_grad`, and on an input that needs none; the last two must give the recorded forward's
    values, with no autograd node, and leave the input as the recorded one does (in place only when asked)."""
    comm = tpkit.get_communicator()
    n, r = comm.world_size, comm.rank
    sizes = split_sizes(7, n)
    bad = []
    cases = {"copy": (lambda x: copy_to_region(x, comm), (5, 7)),
             "reduce": (lambda x: reduce_from_region(x, comm), (5, 7)),
             "reduce in place": (lambda x: reduce_from_region(x, comm, inplace=True), (5, 7)),
             "gather": (lambda x: gather_from_region(x, comm, -1, sizes), (5, sizes[r]))}
    for name, (fn, shape) in cases.items():
        base = randn(shape, 60 + r)
        want = fn(base.clone().requires_grad_() * 1.0)  # a non-leaf: in place is allowed on it
        if want.grad_fn is None:
            bad.append(f"{name}: the recorded call made no node")
        for how in ("no_grad", "no gradient"):
            x = base.clone()
            with torch.no_grad() if how == "no_grad" else torch.enable_grad():
                y = fn(x.requires_grad_() if how == "no_grad" else x)
            if y.grad_fn is not None or rel_err(y, want.detach()) > 0:
                bad.append(f"{name} ({how}): node {y.grad_fn}, rel err {rel_err(y, want.detach()):.1e}")
            if name == "reduce in place" and rel_err(x.detach(), want.detach()) > 0:
                bad.append(f"{name} ({how}): the input was not summed into")
            if name == "reduce" and rel_err(x.detach(), base) > 0:
                bad.append(f"{name} ({how}): the input changed")
    return bad


@pytest.mark.parametrize("world", [2, 3])
def test_inference_runs_each_mapping_forward_without_an_autograd_node(world, monkeypatch):
    from tpkit.nn import mappings

    applied = []  # (the Function, whether autograd records it), every apply
    for cls in (mappings._CopyToRegion, mappings._ReduceFromRegion, mappings._GatherFromRegion):
        real = cls.apply
        monkeypatch.setattr(cls, "apply", lambda x, *a, _r=real, _c=cls: applied.append(
            (_c.__name__, torch.is_grad_enabled() and x.requires_grad)) or _r(x, *a))
    for bad in run(_inference_forwards, world, "threads"):
        assert not bad, bad
    assert len(applied) == 4 * world and all(recorded for _, recorded in applied), applied  # the recorded calls only
