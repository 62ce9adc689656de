"""The checks every backend must pass, written once and run on threads, gloo processes and under mpirun.

Each check runs on every rank of `comm` and records failures instead of asserting, so a process or MPI rank
can send its list back (or exit non-zero) and one launch covers the whole matrix. Every rank can rebuild
every other rank's input (seeded by rank), so each rank computes the single-process reference itself.
Inputs are small integers: sums and products are exact in every dtype, bfloat16 included, so results are
compared exactly except AVG on floating types (one rounding of the quotient).
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

import torch

import tpkit
from tpkit.comm import CommError, Handle, ReduceOp, split, split_range, split_sizes

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]


class Checker:
    """Collects failures as text; `failures` empty means the rank passed."""

    def __init__(self, label: str):
        self.label = label
        self.failures: list[str] = []
        self.count = 0

    def fail(self, what: str, detail: str) -> None:
        self.failures.append(f"[{self.label}] {what}: {detail}")

    def true(self, what: str, condition: bool, detail: str = "") -> None:
        self.count += 1
        if not condition:
            self.fail(what, detail or "condition is false")

    def same(self, what: str, got, want: torch.Tensor, exact: bool = True) -> None:
        self.count += 1
        if not isinstance(got, torch.Tensor):
            return self.fail(what, f"expected a tensor, got {type(got).__name__}")
        try:
            if exact:
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
            else:
                torch.testing.assert_close(got, want)
        except AssertionError as exc:
            self.fail(what, str(exc).replace("\n", " ")[:400])

    @contextmanager
    def raises(self, what: str, kind: type, *fragments: str):
        """The block must raise `kind` whose message contains every fragment."""
        self.count += 1
        try:
            yield
        except kind as exc:
            missing = [f for f in fragments if f not in str(exc)]
            if missing:
                self.fail(what, f"{kind.__name__} message {str(exc)!r} lacks {missing}")
        except Exception as exc:  # noqa: BLE001 - recorded as a failure
            self.fail(what, f"expected {kind.__name__}, got {type(exc).__name__}: {exc}")
        else:
            self.fail(what, f"expected {kind.__name__}, nothing was raised")


def rank_input(rank: int, shape: tuple, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Rank `rank`'s input: nonzero integers in -3..3, the same in every process."""
    g = torch.Generator().manual_seed(7919 * salt + rank)
    magnitude = torch.randint(1, 4, shape, generator=g)
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return (magnitude * sign).to(dtype)


def reference(tensors: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The reduction computed in float64 (exact for these inputs) / int64, cast back."""
    dtype = tensors[0].dtype
    wide = torch.stack([t.to(torch.float64 if dtype.is_floating_point else torch.int64) for t in tensors])
    if op is ReduceOp.SUM:
        out = wide.sum(0)
    elif op is ReduceOp.PRODUCT:
        out = wide.prod(0)
    elif op is ReduceOp.MAX:
        out = wide.amax(0)
    elif op is ReduceOp.MIN:
        out = wide.amin(0)
    elif dtype.is_floating_point:
        out = wide.sum(0) / len(tensors)
    else:
        out = torch.div(wide.sum(0), len(tensors), rounding_mode="trunc")
    return out.to(dtype)


def _exact(op: ReduceOp, dtype: torch.dtype) -> bool:
    return not (op is ReduceOp.AVG and dtype.is_floating_point)


def _reduce_scatter_case(comm, c: Checker, dtype, op, shape, dim, sizes, tag) -> None:
    n, r = comm.world_size, comm.rank
    inputs = [rank_input(q, shape, dtype, 2 + sum(shape) + dim % len(shape)) for q in range(n)]
    before = inputs[r].clone()
    full = reference(inputs, op)
    if sizes is None:
        start, end = split_range(shape[dim], n, r)
    else:
        start, end = sum(sizes[:r]), sum(sizes[:r + 1])
    got = comm.reduce_scatter(inputs[r], op=op, dim=dim, sizes=sizes)
    c.same(f"reduce_scatter {op.name} {dtype} shape {shape} dim {dim} {tag}", got,
           full.narrow(dim, start, end - start), _exact(op, dtype))
    c.same(f"reduce_scatter leaves its input alone ({dtype})", inputs[r], before)


def check_reductions(comm, c: Checker) -> None:
    """all_reduce and reduce_scatter: every ReduceOp x dtype; dims 0 and -1; even, default-uneven, given sizes."""
    n, r = comm.world_size, comm.rank
    for dtype in DTYPES:
        for op in ReduceOp:
            inputs = [rank_input(q, (5, 3), dtype, 1) for q in range(n)]
            before = inputs[r].clone()
            c.same(f"all_reduce {op.name} {dtype}", comm.all_reduce(inputs[r], op=op), reference(inputs, op),
                   _exact(op, dtype))
            c.same(f"all_reduce leaves its input alone ({op.name} {dtype})", inputs[r], before)
            for dim in (0, -1):
                for length in (2 * n, 2 * n + 1):  # even, and uneven by the default split rule
                    shape = (length, 3) if dim == 0 else (3, length)
                    _reduce_scatter_case(comm, c, dtype, op, shape, dim, None, "default sizes")
            given = [(q * 2) % 3 for q in range(n)]  # includes empty pieces
            given[-1] += 1
            _reduce_scatter_case(comm, c, dtype, op, (2, sum(given)), -1, given, f"sizes {given}")
    # big enough for the torch backend's piecewise CPU all_reduce (8 MiB and more), with a ragged last piece
    big = [rank_input(q, ((2 << 20) + 3,), torch.float32, 10) for q in range(n)] if comm.backend == "torch" else []
    for op in (ReduceOp.SUM, ReduceOp.AVG) if big else ():
        c.same(f"all_reduce {op.name} of an 8 MiB tensor", comm.all_reduce(big[r], op=op), reference(big, op),
               _exact(op, torch.float32))
    # a middle dim of a 3-d tensor
    _reduce_scatter_case(comm, c, torch.float32, ReduceOp.SUM, (2, 2 * n + 1, 3), 1, None, "3-d")


def check_gather_broadcast(comm, c: Checker) -> None:
    """all_gather (dims 0, -1, 1 of 3-d; even and uneven with sizes) and broadcast from the first and last rank."""
    n, r = comm.world_size, comm.rank
    for dtype in DTYPES:
        for dim in (0, -1):
            shape = (2, 3) if dim == 0 else (3, 2)
            shards = [rank_input(q, shape, dtype, 3) for q in range(n)]
            before = shards[r].clone()
            c.same(f"all_gather {dtype} dim {dim}", comm.all_gather(shards[r], dim=dim), torch.cat(shards, dim))
            c.same(f"all_gather leaves its input alone ({dtype})", shards[r], before)
            sizes = [(q * 2 + 1) % 3 for q in range(n)]  # uneven, with an empty shard when n >= 2
            uneven = [rank_input(q, (3, s) if dim else (s, 3), dtype, 4) for q, s in enumerate(sizes)]
            c.same(f"all_gather {dtype} dim {dim} sizes {sizes}", comm.all_gather(uneven[r], dim=dim, sizes=sizes),
                   torch.cat(uneven, dim))
        for src in sorted({0, n - 1}):
            values = [rank_input(q, (4, 2), dtype, 5) for q in range(n)]
            before = values[r].clone()
            c.same(f"broadcast {dtype} src {src}", comm.broadcast(values[r], src=src), values[src])
            c.same(f"broadcast leaves its input alone ({dtype})", values[r], before)
    sizes = split_sizes(2 * n + 1, n)
    shards = [rank_input(q, (2, s, 3), torch.float32, 6) for q, s in enumerate(sizes)]
    c.same("all_gather dim 1 of a 3-d tensor", comm.all_gather(shards[r], dim=1, sizes=sizes), torch.cat(shards, 1))
    c.same("all_gather of a non-contiguous tensor", comm.all_gather(shards[r].transpose(0, 2), dim=1, sizes=sizes),
           torch.cat([s.transpose(0, 2) for s in shards], 1))


def check_async(comm, c: Checker) -> None:
    """Async handles complete in issue order with sync operations between them; waits in any order."""
    n, r = comm.world_size, comm.rank
    xs = [rank_input(q, (4, 6), torch.float32, 8) for q in range(n)]
    h_sum = comm.all_reduce(xs[r], async_op=True)
    h_gather = comm.all_gather(xs[r], dim=-1, async_op=True)
    synced = comm.broadcast(xs[r], src=n - 1)  # sync operation issued after two async ones
    h_max = comm.reduce_scatter(xs[r], op="max", dim=-1, async_op=True)
    lo, hi = split_range(6, n, r)
    c.same("async reduce_scatter waited first", h_max.wait(), reference(xs, ReduceOp.MAX)[:, lo:hi])
    c.same("sync broadcast between async ops", synced, xs[n - 1])
    c.same("async all_gather", h_gather.wait(), torch.cat(xs, -1))
    c.same("async all_reduce waited last", h_sum.wait(), reference(xs, ReduceOp.SUM))
    c.true("handles report completion", all(h.is_completed() for h in (h_sum, h_gather, h_max)))
    c.true("wait() returns the same tensor twice", h_sum.wait() is h_sum.wait())
    pending = [comm.all_reduce(xs[r] * k, async_op=True) for k in range(1, 4)]
    comm.barrier()
    for k, h in enumerate(pending, start=1):
        c.same(f"async all_reduce #{k} after a barrier", h.wait(), reference(xs, ReduceOp.SUM) * k)


def check_point_to_point(comm, c: Checker) -> None:
    """A ring of send/recv, into a non-contiguous buffer, in float32 and bfloat16."""
    n, r = comm.world_size, comm.rank
    if n == 1:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    for dtype in (torch.float32, torch.bfloat16):
        payload = rank_input(r, (3, 4), dtype, 9)
        buf = torch.zeros(4, 3, dtype=dtype).t()  # non-contiguous (3, 4) view
        if r % 2 == 0:
            comm.send(payload, nxt)
            got = comm.recv(buf, prv)
        else:
            got = comm.recv(buf, prv)
            comm.send(payload, nxt)
        c.true(f"recv returns its buffer ({dtype})", got is buf)
        c.same(f"recv into a non-contiguous buffer ({dtype})", buf, rank_input(prv, (3, 4), dtype, 9))


def _members_view(group, world_rank: int) -> torch.Tensor:
    """The world ranks of a group's members, as a collective inside the group reports them."""
    return group.all_gather(torch.tensor([world_rank]))


def check_groups(comm, c: Checker) -> None:
    """new_group for members only; several and overlapping groups; nested groups; split layouts."""
    n, r = comm.world_size, comm.rank
    layouts = [sorted({0, n - 1}), list(range(0, max(1, n - 1))), list(range(min(1, n - 1), n)), list(range(n))]
    groups = [comm.new_group(members) for members in layouts]  # overlapping when n >= 3
    for members, group in zip(layouts, groups):
        if r not in members:
            c.true(f"non-member of {members} gets None", group is None, f"got {group!r}")
            continue
        if group is None:
            c.fail(f"member of {members}", "got None")
            continue
        c.true(f"group {members} size and rank", (group.world_size, group.rank) == (len(members), members.index(r)),
               f"got ({group.world_size}, {group.rank})")
        want_name = "world" if members == list(range(n)) else f"world{members}"
        c.true(f"group {members} name", group.name == want_name, f"got {group.name!r}")
        c.same(f"all_gather in group {members}", _members_view(group, r), torch.tensor(members))
        c.same(f"all_reduce stays in group {members}", group.all_reduce(torch.tensor([r + 1])),
               torch.tensor([sum(m + 1 for m in members)]))
    pair = groups[0]
    if pair is not None:
        nested = pair.new_group([0])
        c.true("nested group: first member only", (nested is not None) == (pair.rank == 0))
        if nested is not None:
            c.same("nested group of one", nested.all_reduce(torch.tensor([5.0])), torch.tensor([5.0]))
    for tp_size in (2, 3):
        if n % tp_size or n == tp_size:
            continue
        tp, dp = split(comm, tp_size)
        first = r - r % tp_size
        c.same(f"split tp {tp_size}: tp group", _members_view(tp, r), torch.tensor(list(range(first, first + tp_size))))
        c.same(f"split tp {tp_size}: dp group", _members_view(dp, r), torch.tensor(list(range(r % tp_size, n, tp_size))))
    # barrier: nobody leaves before everybody arrived
    time.sleep(0.01 * r)
    arrived = time.time()
    comm.barrier()
    left = time.time()
    latest = comm.all_reduce(torch.tensor([arrived], dtype=torch.float64), op="max").item()
    c.true("barrier waits for the last rank", left >= latest, f"left at {left}, last arrival {latest}")


def check_lifetime(comm, c: Checker) -> None:
    """barrier(async_op=True) returns a Handle that waits for every rank; close() and `with` release a group,
    after which each operation raises CommError naming it; closing twice is fine; the parent keeps working."""
    n, r = comm.world_size, comm.rank
    time.sleep(0.01 * r)
    arrived = time.time()
    handle = comm.barrier(async_op=True)
    c.true("barrier(async_op=True) returns a Handle", isinstance(handle, Handle), f"got {type(handle).__name__}")
    c.true("the barrier's wait() returns None", handle.wait() is None)
    left = time.time()
    latest = comm.all_reduce(torch.tensor([arrived], dtype=torch.float64), op="max").item()
    c.true("an async barrier's wait() waits for the last rank", left >= latest, f"left at {left}, last {latest}")
    c.true("a completed barrier handle says so", handle.is_completed())
    with comm.new_group(list(range(n))) as group:
        c.same("a group in a with block works", group.all_reduce(torch.tensor([r + 1.0])),
               torch.tensor([n * (n + 1) / 2]))
        c.true("open until the block ends", not group.closed)
    c.true("closed when the block ends", group.closed)
    calls = {"all_reduce": lambda: group.all_reduce(torch.ones(2)), "all_gather": lambda: group.all_gather(torch.ones(2)),
             "reduce_scatter": lambda: group.reduce_scatter(torch.ones(n)), "broadcast": lambda: group.broadcast(torch.ones(2)),
             "barrier": lambda: group.barrier(async_op=True), "new_group": lambda: group.new_group([0]),
             "all_reduce_": lambda: group.all_reduce_(torch.ones(2))}
    for op, call in calls.items():
        with c.raises(f"{op} on a closed communicator", CommError, f"{op}: ", "is closed", "group='world'"):
            call()
    group.close()  # again: nothing happens
    c.same("the parent works after a group closed", comm.all_reduce(torch.ones(1)), torch.full((1,), float(n)))


def check_bad_arguments(comm, c: Checker) -> None:
    """ValueError naming the value, raised before any peer is involved (so ranks may differ here)."""
    n, r = comm.world_size, comm.rank
    x = torch.ones(2, 3)
    with c.raises("dim out of range", ValueError, "dim 2", "(2, 3)"):
        comm.all_gather(x, dim=2)
    with c.raises("negative dim out of range", ValueError, "dim -3"):
        comm.reduce_scatter(x, dim=-3)
    with c.raises("src outside the group", ValueError, f"src {n}", comm.name):
        comm.broadcast(x, src=n)
    with c.raises("src that is not an int", ValueError, "src 0.5"):
        comm.broadcast(x, src=0.5)
    with c.raises("recv from a negative rank", ValueError, "src -1"):
        comm.recv(x, src=-1)
    with c.raises("send to itself", ValueError, f"dst {r}"):
        comm.send(x, r)
    with c.raises("group rank outside the world", ValueError, f"[{n}]"):
        comm.new_group([0, n])
    with c.raises("empty group", ValueError, "empty"):
        comm.new_group([])
    with c.raises("unknown reduce op", ValueError, "'median'"):
        comm.all_reduce(x, op="median")
    with c.raises("reduce_scatter sizes that do not add up", ValueError, "sizes"):
        comm.reduce_scatter(x, sizes=[3] * n)
    with c.raises("all_gather sizes that contradict the tensor", ValueError, f"sizes[{r}]"):
        comm.all_gather(x, sizes=[5] * n)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def debug_mode():
    """TP_DEBUG=1 for the block (the torch and mpi backends compare ranks' calls only then); yields the
    messages logged on logger `tpkit` meanwhile (and keeps them off the terminal)."""
    old = os.environ.get("TP_DEBUG")
    os.environ["TP_DEBUG"] = "1"
    logger = logging.getLogger("tpkit")
    records, propagate = _Records(), logger.propagate
    logger.addHandler(records)
    logger.propagate = False
    try:
        yield records.lines
    finally:
        logger.removeHandler(records)
        logger.propagate = propagate
        if old is None:
            del os.environ["TP_DEBUG"]
        else:
            os.environ["TP_DEBUG"] = old


def check_mismatches(comm, c: Checker) -> None:
    """Ranks that disagree on shape or dtype get CommError naming the operation and group, on every rank;
    the group still works afterwards."""
    n, r = comm.world_size, comm.rank
    if n == 1:
        return
    with c.raises("all_reduce with mismatched shapes", CommError, "all_reduce", comm.name):
        comm.all_reduce(torch.ones(2 + r))
    with c.raises("all_reduce with mismatched dtypes", CommError, "all_reduce", comm.name):
        comm.all_reduce(torch.ones(3, dtype=torch.float64 if r == 0 else torch.float32))
    with c.raises("broadcast with mismatched shapes", CommError, "broadcast"):
        comm.broadcast(torch.ones(2, 1 + r % 2), src=0)
    with c.raises("all_gather of uneven shards without sizes", CommError, "all_gather"):
        comm.all_gather(torch.ones(1 + r, 2))
    with c.raises("reduce_scatter with mismatched ops", CommError, "reduce_scatter"):
        comm.reduce_scatter(torch.ones(n, 2), op="max" if r == 0 else "sum")
    if r < 2:
        if r == 0:
            comm.send(torch.ones(3), 1)
        else:
            with c.raises("recv of a different shape", CommError, "recv", "shape"):
                comm.recv(torch.zeros(4), 0)
    c.same("the group works after mismatches", comm.all_reduce(torch.ones(2)), torch.full((2,), float(n)))


def check_seed_helpers(c: Checker, backend: str) -> None:
    """The seed-compatible helpers on the default communicator of this rank."""
    comm = tpkit.get_communicator()
    n, r = comm.world_size, comm.rank
    config = tpkit.init_tensor_parallel()
    c.true("init_tensor_parallel", (config.world_size, config.rank, config.backend) == (n, r, backend), f"{config}")
    c.true("get_tensor_parallel_config", tpkit.get_tensor_parallel_config() == config)
    c.true("device", config.device == torch.device("cpu"), str(config.device))
    c.same("all_reduce_sum", tpkit.all_reduce_sum(torch.tensor([r + 1.0])), torch.tensor([n * (n + 1) / 2]))
    c.same("broadcast_tensor", tpkit.broadcast_tensor(torch.tensor([r]), src=n - 1), torch.tensor([n - 1]))
    tpkit.synchronize_across_ranks()


def run_matrix(comm, label: str, mismatches: bool = True) -> tuple[list[str], int]:
    """Every check above (and all_to_all's) on `comm`; returns (failures, number of checks). `mismatches` runs
    the mismatch checks (under TP_DEBUG when the backend is not `threads`)."""
    from .all_to_all_matrix import check_all_to_all  # here: that module builds on this one
    c = Checker(f"{label} rank {comm.rank}/{comm.world_size}")
    for check in (check_reductions, check_gather_broadcast, check_all_to_all, check_async, check_point_to_point,
                  check_groups, check_lifetime, check_bad_arguments):
        try:
            check(comm, c)
        except Exception as exc:  # noqa: BLE001 - a crash is a failure, reported with the others
            c.fail(check.__name__, f"raised {type(exc).__name__}: {exc}")
            return c.failures, c.count
    if mismatches:
        try:
            if comm.backend == "threads":
                check_mismatches(comm, c)
            else:
                with debug_mode() as lines:
                    check_mismatches(comm, c)
                want = f"all_reduce shape=(2,) dtype=torch.float32 op=SUM group={comm.name}"
                c.true("TP_DEBUG logs each collective on logger tpkit", any(want in line for line in lines),
                       f"no line with {want!r} among {lines[-3:]}")
        except Exception as exc:  # noqa: BLE001
            c.fail("check_mismatches", f"raised {type(exc).__name__}: {exc}")
    return c.failures, c.count
