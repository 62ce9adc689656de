"""`tpkit.launch` argument checks and failure reporting (process launches are tested in tests/comm/test_gloo.py)."""
from __future__ import annotations

import sys

import pytest

import tpkit


def test_results_come_back_in_rank_order():
    assert tpkit.launch(lambda: tpkit.get_communicator().rank * 10, 4, backend="threads") == [0, 10, 20, 30]


def test_args_are_passed():
    assert tpkit.launch(lambda a, b: a + b + tpkit.get_communicator().rank, 2, backend="threads", args=(1, 2)) == [3, 4]


def test_a_rank_failure_is_reraised_with_its_rank():
    def body():
        if tpkit.get_communicator().rank == 2:
            raise ZeroDivisionError("bad shard on rank 2")
        tpkit.get_communicator().barrier()  # the others wait for rank 2 and are aborted, not blamed

    with pytest.raises(ZeroDivisionError, match="bad shard") as info:
        tpkit.launch(body, 3, backend="threads", timeout=30)
    assert info.value.rank == 2
    assert "raised on rank 2" in info.value.__notes__


@pytest.mark.parametrize("world_size", [0, -1, 1.5, "2"])
def test_world_size_must_be_a_positive_int(world_size):
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        tpkit.launch(lambda: None, world_size, backend="threads")


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'tcp'; valid: gloo, nccl, threads"):
        tpkit.launch(lambda: None, 2, backend="tcp")


def test_mpi_needs_mpirun():
    with pytest.raises(ValueError, match="mpirun -n 2"):
        tpkit.launch(lambda: None, 2, backend="mpi")


def _rank_sum(comm, offset):
    import torch

    return comm.all_reduce(torch.tensor([comm.rank + offset])).item()


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_pass_comm_gives_fn_its_rank_communicator(backend):
    """`launch(fn, pass_comm=True)` calls `fn(comm, *args)`, as `run_threads` does; the old form stays."""
    assert tpkit.launch(_rank_sum, 2, backend=backend, args=(10,), pass_comm=True) == [21, 21]


def _wants_comm(comm, offset, scale=1):
    return (comm.rank + offset) * scale


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_a_fn_that_wants_comm_without_pass_comm_is_refused_before_any_rank_starts(backend, monkeypatch):
    launch_module = sys.modules["tpkit.launch"]

    def started(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch_module, "_launch_processes", started)
    monkeypatch.setattr(launch_module, "run_on_threads", started)
    with pytest.raises(TypeError, match=r"_wants_comm\(comm, offset, scale=1\) takes the rank's communicator as "
                                        r"its first parameter 'comm', but pass_comm is False.*missing a required "
                                        r"argument: 'offset'.*pass pass_comm=True"):
        tpkit.launch(_wants_comm, 2, backend=backend, args=(5,))  # 5 would go to comm, offset missing
    with pytest.raises(TypeError, match=r"missing a required argument: 'comm'.*pass pass_comm=True"):
        tpkit.launch(lambda comm: comm.rank, 2, backend=backend)


def test_a_comm_the_caller_passes_in_args_is_not_refused():
    class Mine:
        rank = 7

    assert tpkit.launch(_wants_comm, 2, backend="threads", args=(Mine(), 1)) == [8, 8]
    with pytest.raises(TypeError, match="takes from 2 to 3 positional arguments but 5"):  # wrong either way
        tpkit.launch(_wants_comm, 1, backend="threads", args=(1, 2, 3, 4, 5))


def _threads() -> int:
    import torch

    return torch.get_num_threads()


@pytest.fixture
def no_thread_settings(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TPKIT_THREADS", raising=False)
    return monkeypatch


def test_process_ranks_run_one_thread_each_unless_told_otherwise(no_thread_settings):
    """Several ranks on one host: one intra-op thread each by default; `threads=` overrides it, and any
    OMP_NUM_THREADS (the precedence of TPKIT_THREADS and OMP_NUM_THREADS: test_set_threads_rule)."""
    assert tpkit.launch(_threads, 2) == [1, 1]
    no_thread_settings.setenv("OMP_NUM_THREADS", "1")
    assert tpkit.launch(_threads, 2, threads=2) == [2, 2]


def test_set_threads_rule(no_thread_settings):
    import torch

    from tpkit.launch import set_threads

    before = torch.get_num_threads()
    try:
        assert set_threads(local_ranks=1) == before  # alone on the host: torch's default stays
        assert set_threads(local_ranks=2) == 1 == torch.get_num_threads()
        no_thread_settings.setenv("LOCAL_WORLD_SIZE", "4")
        torch.set_num_threads(2)
        assert set_threads() == 1  # the launcher's count of local ranks
        assert set_threads(2) == 2 == torch.get_num_threads()
        no_thread_settings.setenv("OMP_NUM_THREADS", "2")
        assert set_threads() == 2  # the user's setting is left alone
        no_thread_settings.setenv("TPKIT_THREADS", "1")
        assert set_threads() == 1 == torch.get_num_threads()
        no_thread_settings.setenv("TPKIT_THREADS", "many")
        with pytest.raises(ValueError, match="TPKIT_THREADS='many' is not an integer"):
            set_threads()
        with pytest.raises(ValueError, match="threads must be a positive int"):
            set_threads(0)
        with pytest.raises(ValueError, match="launch: threads must be a positive int"):
            tpkit.launch(_threads, 2, threads=0)
    finally:
        torch.set_num_threads(before)


def test_thread_ranks_share_the_pool_and_get_it_back(no_thread_settings):
    import torch

    before = torch.get_num_threads()
    assert tpkit.launch(_threads, 2, backend="threads", threads=1) == [1, 1]
    assert torch.get_num_threads() == before



_SCRIPT = """
import tpkit


def body():
    return tpkit.get_communicator().rank


{main}
"""
_MAIN = """print("model built", flush=True)
print(tpkit.launch(body, 2, backend="gloo", timeout=30), flush=True)
"""


@pytest.mark.slow
def test_an_unguarded_script_gets_the_guard_named_and_a_guarded_one_runs(tmp_path):
    """Process ranks import the script again (forked or spawned). A script calling `launch` on its top level gets, in
    each rank, a RuntimeError naming the `if __name__ == "__main__":` guard (not multiprocessing's generic text), and
    in the parent a LaunchError saying the rank failed while starting, with the same hint (issue 49 item 3). The
    same script guarded builds its model once and returns the ranks' results."""
    import os
    import subprocess
    import textwrap

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}

    def run(main: str) -> subprocess.CompletedProcess:
        script = tmp_path / "script.py"
        script.write_text(_SCRIPT.format(main=main))
        return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)

    bad = run(_MAIN)
    assert bad.returncode != 0
    assert bad.stdout.count("model built") == 3  # the parent's and each rank's: what the guard saves
    # the message itself, once per rank (the two ranks' tracebacks may interleave between "RuntimeError" and its
    # message; the source line shown in each traceback ends before "it was importing again")
    assert bad.stderr.count("from the top level of the script it was importing again") == 2, bad.stderr
    assert "RuntimeError" in bad.stderr
    assert "bootstrapping phase" not in bad.stderr  # tpkit's error comes before multiprocessing's generic one
    parent = bad.stderr.strip().splitlines()[-2]
    assert parent.startswith("tpkit.launch.LaunchError: rank") and "while starting, before it ran body" in parent
    assert 'if __name__ == "__main__":' in parent
    good = run('if __name__ == "__main__":\n' + textwrap.indent(_MAIN, "    "))
    assert good.returncode == 0, good.stderr
    assert good.stdout.splitlines() == ["model built", "[0, 1]"]


def _environment_and_output(name: str) -> str | None:
    import os

    print(f"rank says {os.environ.get(name)}", flush=True)
    print("rank on stderr", file=sys.stderr, flush=True)
    return os.environ.get(name)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_process_rank_gets_the_callers_environment_and_streams_of_now(method, monkeypatch, capfd):
    """Ranks forked from the fork server (started by an earlier launch, under an earlier environment and earlier
    output streams) see what a spawned rank sees: the caller's environment and stdout / stderr at this launch."""
    from tpkit.launch import start_method

    monkeypatch.setenv("TPKIT_START_METHOD", method)
    assert start_method("gloo") == method and start_method("nccl") == "spawn"
    tpkit.launch(_threads, 1)  # the server (forkserver) exists before the variable below is set
    capfd.readouterr()
    monkeypatch.setenv("TPKIT_TEST_LATE", "set after the server started")
    monkeypatch.delenv("TPKIT_THREADS", raising=False)
    assert tpkit.launch(_environment_and_output, 2, args=("TPKIT_TEST_LATE",)) == ["set after the server started"] * 2
    out, err = capfd.readouterr()
    assert out.count("rank says set after the server started") == 2 and err.count("rank on stderr") == 2


def test_an_unknown_start_method_is_refused(monkeypatch):
    monkeypatch.setenv("TPKIT_START_METHOD", "fork")
    with pytest.raises(ValueError, match="TPKIT_START_METHOD='fork' is not one of forkserver, spawn"):
        tpkit.launch(_threads, 2)


def _count(tensors: list) -> int:
    return len(tensors)


def test_more_tensors_than_a_fork_server_hands_over_start_spawned(monkeypatch):
    """Each tensor argument is one shared-memory file descriptor; a fork server hands over at most 256 a rank."""
    import torch

    monkeypatch.setenv("TPKIT_START_METHOD", "forkserver")
    many = [torch.full((2,), float(i)) for i in range(300)]
    assert tpkit.launch(_count, 2, args=(many,)) == [300, 300]
