"""Process setup: reading the launcher's environment, the default communicator, the seed helpers."""
from __future__ import annotations

import pytest
import torch

import tpkit
from tpkit.distributed import default_backend, read_launch_env

LAUNCH_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "PMIX_RANK",
               "MPI_LOCALRANKID"]


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_launcher_means_a_world_of_one(clean_env):
    env = read_launch_env()
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (0, 1, 0, "none")


def test_torchrun_variables(clean_env):
    clean_env.setenv("RANK", "5")
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("MASTER_ADDR", "node0")
    clean_env.setenv("MASTER_PORT", "29501")
    env = read_launch_env()
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.launcher) == (
        5, 8, 1, "node0", 29501, "torchrun")


def test_torchrun_variables_win_over_mpi_ones(clean_env):
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "0")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert (read_launch_env().rank, read_launch_env().world_size) == (1, 2)


def test_open_mpi_variables(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "3")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "4")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    env = read_launch_env()
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (3, 4, 1, "mpirun")


def test_pmi_variables_and_local_rank_default(clean_env):
    clean_env.setenv("PMI_RANK", "2")
    clean_env.setenv("PMI_SIZE", "3")
    env = read_launch_env()
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (2, 3, 2, "mpirun")


@pytest.mark.parametrize("variables, message", [
    ({"RANK": "0"}, "WORLD_SIZE is not"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4 is not in 0..3"),
    ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not an integer"),
    ({"OMPI_COMM_WORLD_RANK": "1"}, "names a rank but no size"),
])
def test_bad_launch_environment(clean_env, variables, message):
    for name, value in variables.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        read_launch_env()


def test_default_backend_follows_cuda():
    assert default_backend() == ("nccl" if torch.cuda.is_available() else "gloo")


def test_get_communicator_outside_any_launch_is_a_world_of_one():
    comm = tpkit.get_communicator()
    assert (comm.world_size, comm.rank) == (1, 0)
    assert torch.equal(tpkit.all_reduce_sum(torch.ones(2)), torch.ones(2))
    assert torch.equal(tpkit.broadcast_tensor(torch.arange(3)), torch.arange(3))
    tpkit.synchronize_across_ranks()
    config = tpkit.get_tensor_parallel_config()
    assert (config.world_size, config.rank, config.device) == (1, 0, torch.device("cpu"))


def test_init_threads_outside_launch_is_a_world_of_one():
    assert tpkit.init(backend="threads").world_size == 1


def test_init_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'tcp'; valid: nccl, gloo, mpi, threads"):
        tpkit.init(backend="tcp")


def test_use_communicator_scopes_the_default():
    comms = tpkit.comm.create_communicators(1)
    with tpkit.use_communicator(comms[0]):
        assert tpkit.get_communicator() is comms[0]
    assert tpkit.get_communicator() is not comms[0]


def test_multi_node_mpirun_without_master_addr_is_refused(clean_env, monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    with pytest.raises(ValueError, match=r"spans several nodes \(8 ranks, 4 on this node\).*MASTER_ADDR"):
        tpkit.init("gloo")


def _shutdown_keeps_a_user_process_group():
    """Run in a fresh process: a process group the user made survives tpkit.shutdown()."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tpkit.distributed.shutdown()  # forget what launch's init adopted
    comm = tpkit.init("gloo")      # adopts the user's group
    tpkit.shutdown()
    alive = dist.is_initialized()
    dist.destroy_process_group()
    return alive, comm.world_size


def test_shutdown_leaves_a_process_group_it_did_not_start():
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_shutdown_keeps_a_user_process_group) == (True, 1)


def _shutdown_closes_and_init_starts_again():
    """A launched gloo rank: the communicator init made uses shared memory; shutdown() closes it (mapping
    released, operations refused); init() afterwards starts a new group that communicates."""
    comm = tpkit.get_communicator()
    comm.all_reduce(torch.ones(4))  # sets up the shared-memory channel (a collective)
    channel = comm._shm
    tpkit.shutdown()
    again = tpkit.init("gloo")
    out = again.all_reduce(torch.full((2,), float(again.rank + 1)))
    return {"had_channel": bool(channel), "channel_closed": bool(channel) and channel.closed,
            "closed": comm.closed, "new": again is not comm, "out": out.tolist(), "shm": again.shared_memory}


def test_shutdown_closes_the_communicator_and_init_starts_again():
    results = tpkit.launch(_shutdown_closes_and_init_starts_again, 2, timeout=60)
    for r in results:
        assert r == {"had_channel": True, "channel_closed": True, "closed": True, "new": True, "out": [3.0, 3.0],
                     "shm": True}, r


def _init_with_profile_and_auto():
    """Run in a fresh process (no launcher: a world of one)."""
    import torch

    comm = tpkit.init("gloo", profile=True, algorithm="auto")
    out = comm.all_reduce(torch.ones(4))
    ops = [r.to_dict()["op"] for r in comm.records]
    tpkit.shutdown()
    return type(comm).__name__, out.tolist(), ops


def test_init_wraps_in_profiler_and_algorithm_selection():
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        name, out, ops = pool.apply(_init_with_profile_and_auto)
    assert name == "CommProfiler" and out == [1.0] * 4 and ops == ["all_reduce"]


# ---------------------------------------------------------------------------------------------------------
# Under a launcher without init(): never a silent world of one.

def test_a_torchrun_rank_without_init_is_refused_not_a_world_of_one(clean_env):
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 \(torchrun.*tpkit\.init\(\)"):
        tpkit.get_communicator()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    with pytest.raises(RuntimeError, match="every rank would hold the whole model"):
        tpkit.parallelize(model)
    with pytest.raises(RuntimeError, match="tpkit.init"):
        tpkit.nn.ColumnParallelLinear(8, 16)


def test_a_world_of_one_under_torchrun_is_still_a_world_of_one(clean_env):
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    assert tpkit.get_communicator().world_size == 1


def _adopts_the_scripts_own_group():
    """Run in a fresh process that looks like torchrun's rank 0 of 2 after the script made its own group."""
    import os

    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="2")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm = tpkit.get_communicator()
    name = type(comm).__name__
    dist.destroy_process_group()
    return name


def test_a_launched_rank_adopts_a_group_the_script_started():
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_adopts_the_scripts_own_group) == "TorchCommunicator"


# ---------------------------------------------------------------------------------------------------------
# torchrun --max-restarts: the next generation comes up after a worker is SIGKILLed.

RESTART_SCRIPT = '''
import os, signal, torch, tpkit
comm = tpkit.init("gloo", timeout=60)
generation = tpkit.distributed.restart_count()
for i in range(3):
    comm.all_reduce(torch.ones(1))
    if generation == 0 and comm.rank == 1 and i == 1:
        os.kill(os.getpid(), signal.SIGKILL)
print(f"generation {generation} rank {comm.rank} done", flush=True)
comm.barrier()
os._exit(0)  # what is checked is the restart; gloo's teardown once aborted a rank whose peer tore down first
'''


@pytest.mark.slow
def test_torchrun_restarts_a_killed_generation(tmp_path):
    """torch's env:// rendezvous reads the dead generation's addresses from torchrun's shared store and fails or
    hangs connecting; init() meets in a store prefixed by the restart count and comes up."""
    from tests.torchrun import torchrun

    script = tmp_path / "restart.py"
    script.write_text(RESTART_SCRIPT)
    code, output, _ = torchrun(str(script), nproc=2, max_restarts=1, timeout=120)
    assert code == 0, output
    assert "generation 0 rank 1 done" not in output
    for rank in (0, 1):
        assert f"generation 1 rank {rank} done" in output, output
