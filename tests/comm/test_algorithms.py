"""Every send/recv algorithm equals the builtin collective (threads 1..8, gloo 2..4), every op and dim."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpkit
from tpkit.comm import ALGORITHMS, AlgorithmCommunicator, ReduceOp, create_communicator, run_threads, split_sizes
from tpkit.comm.ops import reduce_tensors

SHAPE = (6, 5)


def _inputs(n: int, shape=SHAPE, dtype=torch.float64) -> list[torch.Tensor]:
    """Every rank's input, reproducible on any rank (so each can compute the reference locally)."""
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(1000 + r)
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g, dtype=dtype) + 0.5)
        else:
            out.append(torch.randint(-20, 20, shape, generator=g, dtype=dtype))
    return out


def _ref_reduce_scatter(xs, op, dim, sizes, rank):
    full = reduce_tensors(xs, op)
    start = sum(sizes[:rank])
    return full.narrow(dim, start, sizes[rank])


def check_algorithms(comm, against_builtin: bool) -> list[str]:
    """Run every algorithm with every op and dim; return a description of each mismatch (empty = all good).

    The reference is computed locally from every rank's input; on threads it is also the builtin's result.
    """
    n, rank = comm.world_size, comm.rank
    bad: list[str] = []

    def same(what, got, ref, exact=False):
        if got.shape != ref.shape or got.dtype != ref.dtype:
            bad.append(f"{what}: shape {tuple(got.shape)} {got.dtype} != {tuple(ref.shape)} {ref.dtype}")
        elif not (torch.equal(got, ref) if exact else torch.allclose(got, ref, rtol=1e-12, atol=1e-12)):
            bad.append(f"{what}: max error {(got - ref).abs().max().item()}")

    for dtype in (torch.float64, torch.int64):
        xs = _inputs(n, dtype=dtype)
        x, snapshot = xs[rank], xs[rank].clone()
        exact = not dtype.is_floating_point
        for op in ReduceOp:
            ref = reduce_tensors(xs, op)
            if against_builtin:
                same(f"builtin all_reduce {op.name}", comm.all_reduce(x, op), ref, exact)
            for name, fn in ALGORITHMS["all_reduce"].items():
                same(f"all_reduce/{name} {op.name} {dtype}", fn(comm, x, op), ref, exact)
            for dim in (0, -1):
                d = dim % x.dim()
                sizes = split_sizes(x.shape[d], n)
                ref = _ref_reduce_scatter(xs, op, d, sizes, rank)
                if against_builtin:
                    same(f"builtin reduce_scatter {op.name} dim {dim}", comm.reduce_scatter(x, op, dim=dim), ref, exact)
                for name, fn in ALGORITHMS["reduce_scatter"].items():
                    same(f"reduce_scatter/{name} {op.name} dim {dim} {dtype}", fn(comm, x, op, d, sizes), ref, exact)
        for dim in (0, -1):
            d = dim % x.dim()
            ref = torch.cat(xs, dim=d)
            if against_builtin:
                same(f"builtin all_gather dim {dim}", comm.all_gather(x, dim=dim), ref, True)
            for name, fn in ALGORITHMS["all_gather"].items():
                same(f"all_gather/{name} dim {dim} {dtype}", fn(comm, x, d, None), ref, True)
        for src in sorted({0, n - 1}):
            for name, fn in ALGORITHMS["broadcast"].items():
                same(f"broadcast/{name} src {src} {dtype}", fn(comm, x, src), xs[src], True)
        if not torch.equal(x, snapshot):
            bad.append(f"input modified ({dtype})")
    # uneven shards: rank r holds r % 3 rows (some ranks none)
    sizes = [r % 3 for r in range(n)]
    parts = [torch.arange(s * 4, dtype=torch.float64).reshape(s, 4) + 100 * r for r, s in enumerate(sizes)]
    for name, fn in ALGORITHMS["all_gather"].items():
        same(f"all_gather/{name} uneven {sizes}", fn(comm, parts[rank], 0, sizes), torch.cat(parts), True)
    rows = sum(sizes)
    xs = [torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) * (r + 1) for r in range(n)]
    for name, fn in ALGORITHMS["reduce_scatter"].items():
        same(f"reduce_scatter/{name} uneven {sizes}", fn(comm, xs[rank], ReduceOp.SUM, 0, sizes),
             _ref_reduce_scatter(xs, ReduceOp.SUM, 0, sizes, rank), True)
    _check_all_to_all(comm, same)
    return bad


def _check_all_to_all(comm, same) -> None:
    """all_to_all: one dim with per-pair counts (zeros included), and two dims of a permuted input."""
    n, rank = comm.world_size, comm.rank
    sent = [[(i + 2 * j) % 3 for j in range(n)] for i in range(n)]
    rows = [torch.arange(sum(sent[i]) * 2, dtype=torch.float64).reshape(-1, 2) + 100 * i for i in range(n)]
    want = torch.cat([rows[i][sum(sent[i][:rank]):sum(sent[i][:rank + 1])] for i in range(n)])
    heads = split_sizes(2 * n + 1, n)
    xs = [x.transpose(0, 1) for x in _inputs(n, (3, 2 * n + 1))]  # (2n + 1, 3), permuted
    want_x = torch.cat([x[sum(heads[:rank]):sum(heads[:rank + 1])] for x in xs], dim=1)
    for name, fn in ALGORITHMS["all_to_all"].items():
        same(f"all_to_all/{name} one dim {sent}", fn(comm, rows[rank], 0, 0, sent[rank], [s[rank] for s in sent]),
             want, True)
        same(f"all_to_all/{name} two dims", fn(comm, xs[rank], 0, 1, heads, [3] * n), want_x, True)


@pytest.mark.parametrize("world_size", range(1, 9))
def test_every_algorithm_matches_builtin_on_threads(world_size):
    results = run_threads(lambda comm: check_algorithms(comm, against_builtin=True), world_size, timeout=60)
    assert results == [[]] * world_size, results


def _gloo_body():
    return check_algorithms(tpkit.get_communicator(), against_builtin=False)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_algorithm_matches_reference_on_gloo(world_size):
    assert tpkit.launch(_gloo_body, world_size, backend="gloo", timeout=120) == [[]] * world_size


@settings(max_examples=12, deadline=None)
@given(world_size=st.integers(1, 6), rows=st.integers(0, 9), cols=st.integers(1, 4), dim=st.sampled_from([0, 1, -1]),
       algorithm=st.sampled_from(["ring", "bruck", "recursive_doubling", "pairwise", "recursive_halving", "direct"]))
def test_algorithm_communicator_matches_builtin_for_any_shape(world_size, rows, cols, dim, algorithm):
    def body(comm):
        fast = AlgorithmCommunicator(comm, algorithm)
        x = torch.randn(rows, cols, dtype=torch.float64) + comm.rank
        out = []
        for c in (comm, fast):
            out.append((c.all_reduce(x), c.all_gather(x, dim=dim), c.reduce_scatter(x, dim=dim), c.broadcast(x, src=0),
                        c.all_to_all(x, dim, 1 - dim % 2)))
        return out
    for builtin, ours in run_threads(body, world_size):
        for a, b in zip(builtin, ours):
            assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_algorithm_option_validation_and_fallbacks():
    with pytest.raises(ValueError, match="unknown algorithm 'fastest'.*valid: auto, builtin"):
        run_threads(lambda comm: AlgorithmCommunicator(comm, "fastest"), 2)
    with pytest.raises(ValueError, match="all_gather has no algorithm 'pairwise'"):
        run_threads(lambda comm: AlgorithmCommunicator(comm, {"all_gather": "pairwise"}), 2)

    def body(comm):
        fast = AlgorithmCommunicator(comm, {"all_reduce": "ring", "all_gather": "bruck"})
        x = torch.arange(4.0) + comm.rank
        seen = []
        fast.all_reduce(x)
        seen.append((fast.last_algorithm, fast.last_note))
        handle = fast.all_reduce(x, async_op=True)
        seen.append((fast.last_algorithm, fast.last_note, handle.wait().tolist()))
        fast.reduce_scatter(x)  # not named in the dict: builtin
        seen.append((fast.last_algorithm,))
        fast.all_reduce(x > 1)
        seen.append((fast.last_algorithm, fast.last_note))
        group = fast.new_group([0, 1])
        seen.append(type(group).__name__ if group is not None else None)
        with pytest.raises(ValueError, match=r"all_gather: sizes\[.*\] = 5 but this rank's tensor has size 4"):
            fast.all_gather(x, sizes=[5, 5, 5])
        return seen

    seen = run_threads(body, 3)[0]
    assert seen[0] == ("ring", "")
    assert seen[1][0] == "builtin" and "async_op" in seen[1][1] and seen[1][2] == [3.0, 6.0, 9.0, 12.0]
    assert seen[2] == ("builtin",)
    assert seen[3][0] == "builtin" and "bool" in seen[3][1]
    assert seen[4] == "AlgorithmCommunicator"


def _made_by_create_communicator():
    made = create_communicator("threads", algorithm="direct")
    out = made.all_gather(torch.tensor([float(made.rank)]))
    return type(made).__name__, made.last_algorithm, out.tolist()


def test_create_communicator_algorithm_option():
    assert tpkit.launch(_made_by_create_communicator, 3, backend="threads") == [
        ("AlgorithmCommunicator", "direct", [0.0, 1.0, 2.0])] * 3
