"""Backend-independent pieces of `tpkit.comm`: the factory, ReduceOp, the split rule, Handle, errors."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpkit
from tpkit.comm import BACKENDS, CommError, Handle, ReduceOp, create_communicator, run_threads, split_range, split_sizes
from tpkit.comm.ops import reduce_tensors


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        create_communicator("nccl2")
    message = str(info.value)
    assert "'nccl2'" in message
    for name in ("torch", "threads", "mpi"):
        assert name in message
    assert set(BACKENDS) >= {"torch", "threads", "mpi"}


def _torch_with_backend_keyword():
    comm = create_communicator("torch", backend="gloo")
    return comm.world_size, comm.all_reduce(torch.ones(1)).tolist()


def test_torch_factory_takes_the_process_group_backend_as_a_keyword():
    """`backend=` after the positional backend name is the torch process-group backend, not a clash."""
    assert tpkit.launch(_torch_with_backend_keyword, 2, backend="gloo") == [(2, [2.0]), (2, [2.0])]


def test_threads_factory_gives_a_world_of_one_outside_launch_and_the_rank_inside():
    comm = create_communicator("threads")
    assert (comm.world_size, comm.rank, comm.backend) == (1, 0, "threads")
    assert torch.equal(comm.all_reduce(torch.arange(3.0), op="avg"), torch.arange(3.0))
    inside = tpkit.launch(lambda: create_communicator("threads").rank, 3, backend="threads")
    assert inside == [0, 1, 2]
    with pytest.raises(ValueError, match="run_threads"):
        create_communicator("threads", world_size=4)


def test_mpi_factory_without_mpirun_is_a_world_of_one_or_a_clear_import_error():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install mpi4py"):
            create_communicator("mpi")
        return
    pytest.skip("mpi4py is installed: the mpi backend is tested under mpirun in test_mpi.py")


@pytest.mark.parametrize("text, op", [("sum", ReduceOp.SUM), ("AVG", ReduceOp.AVG), (" max ", ReduceOp.MAX),
                                      ("min", ReduceOp.MIN), ("product", ReduceOp.PRODUCT), (ReduceOp.MIN, ReduceOp.MIN)])
def test_reduce_op_parse(text, op):
    assert ReduceOp.parse(text) is op


def test_reduce_op_parse_rejects_unknown_names_listing_valid_ones():
    with pytest.raises(ValueError, match=r"'mean'.*SUM, AVG, MAX, MIN, PRODUCT"):
        ReduceOp.parse("mean")


def test_integer_average_truncates_toward_zero():
    got = reduce_tensors([torch.tensor([-5, 5, 7]), torch.tensor([0, 0, 0])], ReduceOp.AVG)
    assert got.tolist() == [-2, 2, 3]


@settings(max_examples=40, deadline=None)
@given(size=st.integers(0, 200), world=st.integers(1, 9))
def test_split_sizes_is_tensor_split(size, world):
    sizes = split_sizes(size, world)
    assert sizes == [len(piece) for piece in torch.arange(size).tensor_split(world)]
    ranges = [split_range(size, world, r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@settings(max_examples=15, deadline=None)
@given(world=st.integers(1, 4), rows=st.integers(0, 9), cols=st.integers(1, 4), dim=st.sampled_from([0, 1, -1, -2]))
def test_reduce_scatter_then_all_gather_is_all_reduce(world, rows, cols, dim):
    """For any shape and dim: all_gather(reduce_scatter(x)) == all_reduce(x), with the default split rule."""
    def body(comm):
        x = torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols) * (comm.rank + 1)
        d = dim % 2
        sizes = split_sizes(x.shape[d], comm.world_size)
        piece = comm.reduce_scatter(x, dim=dim)
        return torch.equal(comm.all_gather(piece, dim=dim, sizes=sizes), comm.all_reduce(x))
    assert all(run_threads(body, world))


def test_split_rule_errors():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        split_sizes(4, 0)
    with pytest.raises(ValueError, match="rank 3 is not in 0..2"):
        split_range(4, 3, 3)


def test_handle_waits_once_and_caches():
    calls = []
    handle = Handle(lambda: calls.append(1) or torch.ones(1), lambda: bool(calls))
    assert not handle.is_completed()
    first = handle.wait()
    assert handle.wait() is first and calls == [1] and handle.is_completed()
    done = Handle.completed(torch.zeros(2))
    assert done.is_completed() and torch.equal(done.wait(), torch.zeros(2))


def test_comm_error_is_a_runtime_error():
    assert issubclass(CommError, RuntimeError)


def test_collectives_check_their_argument_type():
    comm = create_communicator("threads")
    with pytest.raises(TypeError, match="expected a torch.Tensor, got list"):
        comm.all_reduce([1.0, 2.0])
    with pytest.raises(ValueError, match="0-d tensor"):
        comm.all_gather(torch.tensor(1.0))


def test_run_threads_makes_each_rank_the_threads_default():
    """Layers built with comm=None inside run_threads see their thread-rank, not a world of one."""
    import tpkit
    from tpkit.comm import run_threads

    results = run_threads(lambda comm: (tpkit.get_communicator() is comm, tpkit.nn.ColumnParallelLinear(4, 6).world_size), 3)
    assert results == [(True, 3)] * 3
    assert tpkit.get_communicator().world_size == 1  # the calling thread is unaffected


def test_avg_of_bool_is_refused_up_front():
    from tpkit.comm import create_communicators

    comm = create_communicators(1)[0]
    for call in (lambda t: comm.all_reduce(t, "avg"), lambda t: comm.reduce_scatter(t, "avg")):
        with pytest.raises(TypeError, match="AVG has no meaning for bool"):
            call(torch.ones(4, dtype=torch.bool))
    assert comm.all_reduce(torch.ones(4, dtype=torch.bool), "max").all()
