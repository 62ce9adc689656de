"""`Communicator.all_to_all` beyond the op matrix (`all_to_all_matrix.py`, run on every backend): random shapes
and sizes against a one-process reference, the autograd mapping, `torch.compile(fullgraph=True)`, the wrappers
(profiler, algorithms, shapes), the default primitive, and errors raised before any communication. Processes:
one gloo launch for everything that needs one."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpkit
from tpkit.comm import (AlgorithmCommunicator, CommError, CommProfiler, CommunicationOptimizer, Communicator,
                        CostModel, run_threads, split_sizes)
from tpkit.comm import traceable
from tpkit.comm.cost_model import coefficients
from tpkit.comm.profiler import bus_factor
from tpkit.comm.selector import mpich_choice
from tpkit.comm.shapes import ShapeCommunicator
from tpkit.nn import mappings

from .all_to_all_matrix import counts, reference

torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)


def _seeded(shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@st.composite
def calls(draw):
    """(world size, every rank's input shape, scatter_dim, gather_dim, every rank's scatter_sizes, gather_sizes)."""
    n = draw(st.integers(1, 4), label="world_size")
    ndim = draw(st.integers(1, 3), label="ndim")
    sd = draw(st.integers(-ndim, ndim - 1), label="scatter_dim")
    gd = draw(st.integers(-ndim, ndim - 1), label="gather_dim")
    base = draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim), label="shape")
    piece = st.integers(0, 3)
    if sd % ndim == gd % ndim:  # per-rank counts: rank i sends sent[i][j] to rank j
        sent = [draw(st.lists(piece, min_size=n, max_size=n)) for _ in range(n)]
        shapes = [[sum(sent[i]) if d == sd % ndim else s for d, s in enumerate(base)] for i in range(n)]
        return n, shapes, sd, gd, sent, [[sent[i][j] for i in range(n)] for j in range(n)]
    cut = draw(st.lists(piece, min_size=n, max_size=n), label="scatter_sizes")  # the same on every rank
    own = draw(st.lists(piece, min_size=n, max_size=n), label="gather dim of each rank")
    shapes = [[sum(cut) if d == sd % ndim else own[i] if d == gd % ndim else s for d, s in enumerate(base)]
              for i in range(n)]
    return n, shapes, sd, gd, [cut] * n, [own] * n


@settings(max_examples=25, deadline=None)
@given(call=calls())
def test_random_shapes_and_sizes_match_the_reference_on_threads(call):
    n, shapes, sd, gd, sent, received = call
    inputs = [_seeded(shape, 100 + r) for r, shape in enumerate(shapes)]

    def body(comm):
        r = comm.rank
        got = comm.all_to_all(inputs[r], sd, gd, sent[r], received[r])
        return got, reference(inputs, sd % len(shapes[0]), gd % len(shapes[0]), sent, r)

    for got, want in run_threads(body, n, timeout=30):
        assert got.shape == want.shape and torch.equal(got, want) and got.is_contiguous()


def test_world_size_one_is_a_contiguous_copy_and_the_mapping_an_identity():
    comm = tpkit.get_communicator()
    x = torch.arange(12.0).view(3, 4).t()
    out = comm.all_to_all(x, 0, 1)
    assert out is not x and out.is_contiguous() and torch.equal(out, x)
    assert mappings.all_to_all(x, comm, 0, 1) is x


def _autograd_body(comm) -> dict:
    """The mapping's output and input gradient against autograd through `reference`, float64, uneven sizes."""
    n, r = comm.world_size, comm.rank
    seq, sent = [1 + q % 2 for q in range(n)], counts(n)
    cases = {  # name: (every rank's input, scatter_dim, gather_dim, scatter_sizes (every rank's), gather_sizes)
        "heads -> sequence": ([_seeded((2, seq[q], 2 * n + 1, 3), q) for q in range(n)], -2, 1,
                              [split_sizes(2 * n + 1, n)] * n, [seq] * n),
        "one dim, counts": ([_seeded((sum(sent[q]), 2), 10 + q) for q in range(n)], 0, -2, sent,
                            [[sent[q][j] for q in range(n)] for j in range(n)]),
    }
    errors = {}
    for name, (xs, sd, gd, ss, gs) in cases.items():
        leaves = [x.clone().requires_grad_() for x in xs]
        outs = [reference(leaves, sd % xs[0].dim(), gd % xs[0].dim(), ss, q) for q in range(n)]
        grads = [_seeded(tuple(o.shape), 20 + q) for q, o in enumerate(outs)]
        sum((o * g).sum() for o, g in zip(outs, grads)).backward()
        x = xs[r].clone().requires_grad_()
        y = mappings.all_to_all(x, comm, sd, gd, ss[r], gs[r])
        y.backward(grads[r])
        errors[name] = max((y - outs[r]).abs().max().item(), (x.grad - leaves[r].grad).abs().max().item())
    return errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_autograd_mapping_backward_is_the_reverse_all_to_all(world_size):
    for errors in run_threads(_autograd_body, world_size):
        assert errors and max(errors.values()) < 1e-12, errors


def _compiled_body(comm) -> dict:
    """Forward and backward of a function around the mapping, compiled fullgraph, against eager."""
    n, r = comm.world_size, comm.rank
    seq = [1 + q % 2 for q in range(n)]

    def fn(x):
        y = mappings.all_to_all(x * 2, comm, 2, 1, None, seq)  # [B, S_r, H, D] -> [B, S, H_r, D]
        z = mappings.all_to_all(y.sin(), comm, 1, 2, seq, split_sizes(2 * n + 1, n))  # and back
        return z * x

    x = _seeded((2, seq[r], 2 * n + 1, 3), r)
    errors = {}
    for backend in ("aot_eager",):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = fn(a)
        want.sum().backward()
        got = torch.compile(fn, fullgraph=True, backend=backend)(b)
        got.sum().backward()
        errors[backend] = max((got - want).abs().max().item(), (b.grad - a.grad).abs().max().item())
    sent = counts(n)
    rows = _seeded((sum(sent[r]), 3), 30 + r)
    column = [sent[q][r] for q in range(n)]
    compiled = torch.compile(lambda t: traceable.all_to_all(t, comm, 0, 0, sent[r], column), fullgraph=True,
                             backend="eager")
    errors["traceable, one dim"] = (compiled(rows) - comm.all_to_all(rows, 0, 0, sent[r], column)).abs().max().item()
    return errors


def test_compile_fullgraph_on_threads():
    torch._dynamo.reset()
    for errors in run_threads(_compiled_body, 2):
        assert errors and max(errors.values()) < 1e-12, errors


def _gloo_body() -> dict:
    """One launch: shared memory for small exchanges (no gloo all_to_all_single), gloo for one too big; compiled
    fullgraph through the shared-memory custom op and through functional collectives (TPKIT_SHM=0)."""
    import torch.distributed as dist

    comm = tpkit.get_communicator()
    n, r = comm.world_size, comm.rank
    calls, real = [], dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        sent = counts(n)
        small = [_seeded((sum(sent[q]), 4), q) for q in range(n)]
        column = [sent[q][r] for q in range(n)]
        out = {"small": torch.equal(comm.all_to_all(small[r], 0, 0, sent[r], column), reference(small, 0, 0, sent, r))}
        out["small calls"], out["shm"] = len(calls), comm.shared_memory
        big = [_seeded((n * 40_000, 4), 10 + q, torch.float32) for q in range(n)]
        out["big"] = torch.equal(comm.all_to_all(big[r], 0, 1), reference(big, 0, 1, [split_sizes(n * 40_000, n)] * n, r))
        out["big calls"] = len(calls)
    finally:
        dist.all_to_all_single = real
    out["shm compiled"] = _compiled_body(comm)
    os.environ["TPKIT_SHM"] = "0"  # a communicator made now has no faster transport: functional collectives
    plain = comm.new_group(list(range(n)))
    out["functional"] = plain.__dict__.get("_functional_group") is not None
    out["functional compiled"] = _compiled_body(plain)
    return out


@pytest.mark.slow
def test_gloo_shared_memory_fallback_and_compile():
    for result in tpkit.launch(_gloo_body, 2, backend="gloo", timeout=240):
        assert result["shm"] and result["small"] and result["small calls"] == 0, result
        assert result["big"] and result["big calls"] == 1, result
        assert result["functional"], result
        for key in ("shm compiled", "functional compiled"):
            assert max(result[key].values()) < 1e-12, (key, result[key])


def _wrappers_body(comm) -> dict:
    n, r = comm.world_size, comm.rank
    sent = counts(n)
    rows = [_seeded((sum(sent[q]), 3), q) for q in range(n)]
    column = [sent[q][r] for q in range(n)]
    xs = [_seeded((4, 2 * n + 1), 10 + q) for q in range(n)]
    want_rows, want_x = comm.all_to_all(rows[r], 0, 0, sent[r], column), comm.all_to_all(xs[r], 1, 0)
    out = {}
    for name in ("pairwise", "direct", "auto"):
        fast = AlgorithmCommunicator(comm, {"all_to_all": name}, verify=0)
        same = torch.equal(fast.all_to_all(rows[r], 0, 0, sent[r], column), want_rows)
        one_dim = fast.last_algorithm, fast.last_note
        same &= torch.equal(fast.all_to_all(xs[r], 1, 0), want_x)
        out[name] = same, one_dim, fast.last_algorithm
    prof = CommProfiler(comm)
    out["profiled"] = torch.equal(prof.all_to_all(xs[r], 1, 0), want_x)
    out["records"] = prof.records
    opt = CommunicationOptimizer(comm)
    out["optimizer"] = torch.equal(opt.all_to_all(rows[r], 0, 0, sent[r], column), want_rows)
    out["default"] = (torch.equal(Communicator._all_to_all(comm, rows[r], 0, 0, sent[r], column, False).wait(),
                                  want_rows)
                      and torch.equal(Communicator._all_to_all(comm, xs[r], 1, 0, split_sizes(2 * n + 1, n),
                                                               [4] * n, False).wait(), want_x))
    return out


def test_algorithms_profiler_optimizer_and_the_default_primitive():
    n = 3
    for out in run_threads(_wrappers_body, n):
        for name in ("pairwise", "direct"):
            assert out[name] == (True, (name, ""), name), out[name]
        same, (one_dim, note), two_dims = out["auto"]
        assert same and one_dim == "builtin" and "one dim" in note and two_dims == "direct", out["auto"]
        assert out["profiled"] and out["optimizer"] and out["default"]
        (record,) = out["records"]
        assert record.op == "all_to_all" and record.bytes == 4 * (2 * n + 1) * 8 and record.world_size == n
        assert record.busbw == pytest.approx(record.algbw * (n - 1) / n)


def test_cost_model_selector_and_shapes():
    m = 1 << 20
    assert bus_factor("all_to_all", 4) == pytest.approx(0.75)
    assert coefficients("all_to_all", "pairwise", m, 4) == (3, 0.75 * m, 0.0)
    assert coefficients("all_to_all", "direct", m, 4) == (1, 0.75 * m, 0.0)
    assert coefficients("all_to_all", "builtin", m, 4) == coefficients("all_to_all", "pairwise", m, 4)
    assert mpich_choice("all_to_all", 4 * 32768 - 1, 4) == "direct"
    assert mpich_choice("all_to_all", 4 * 32768, 4) == "pairwise"
    models = run_threads(lambda comm: CostModel().calibrate(comm, sizes=(4096, 65536), iters=1,
                                                            collectives=("all_to_all",)).to_dict(), 2)
    assert models[0] == models[1]
    assert {"all_to_all/builtin@2", "all_to_all/pairwise@2", "all_to_all/direct@2"} <= set(models[0]["measured"])
    shapes = ShapeCommunicator(1, 3)
    got = shapes.all_to_all(torch.ones(2, 7, 5), 1, 2, None, [1, 5, 2])
    assert got.shape == (2, 2, 8) and not got.any()


def test_bad_arguments_raise_before_any_communication():
    def body(comm):
        if comm.rank == 0:  # alone: had it waited for rank 1, it would time out instead
            with pytest.raises(ValueError, match=r"all_to_all: scatter_sizes \[1, 1\] add up to 2, but scatter_dim 0 "
                                                 r"of the input of shape \(3, 2\) has size 3"):
                comm.all_to_all(torch.ones(3, 2), 0, 1, [1, 1])
            with pytest.raises(ValueError, match="gather_dim 2 is out of range"):
                comm.all_to_all(torch.ones(3, 2), 0, 2)
        return comm.all_to_all(torch.full((2, 1), float(comm.rank)), 0, 1).tolist()

    assert run_threads(body, 2, timeout=2) == [[[0.0, 1.0]], [[0.0, 1.0]]]


def test_a_closed_communicator_refuses_all_to_all():
    def body(comm):
        group = comm.new_group([0, 1])
        group.close()
        with pytest.raises(CommError, match="all_to_all: .* is closed"):
            group.all_to_all(torch.ones(2), 0, 0)
        return True

    assert run_threads(body, 2) == [True, True]
