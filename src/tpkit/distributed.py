"""Process setup: read the launcher's environment, start the right backend, remember the communicator.

`init()` is what a script under `torchrun` or `mpirun` calls first. `get_communicator()` is what layers call
when no communicator is passed: the one `init()` made, the current thread-rank's under the `threads`
backend, or a world of one - but never a world of one in a process that a launcher started as one rank of
several (every rank would silently hold the whole model): there it adopts a process group the script started
itself, or raises with the fix.

Restarts under torchrun. Since torch 2.5 torchrun's agent hosts one TCPStore for the whole job and every
generation of workers (`--max-restarts`) meets in it; torch's `env://` rendezvous adds no per-generation
prefix (it assumes a fresh store per restart), so the keys of the killed generation are still there and the
new one's gloo reads them: it connects to the dead processes' ports and fails or hangs inside
`init_process_group` (pytorch/pytorch#135712). `init()` therefore connects to the agent's store itself and
meets in `PrefixStore("tpkit/generation-<TORCHELASTIC_RESTART_COUNT>")`. The count is per agent: consistent on
one node (`--standalone`); a multi-node job whose agents restart unevenly should also export
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` to each torchrun (a fresh store per rendezvous round).
"""
from __future__ import annotations

import dataclasses
import datetime
import os


import torch

from .comm.backends import set_torch_init
from .comm.communicator import Communicator
from .comm.context import current_thread_communicator, process_communicator, set_process_communicator, use_communicator
from .comm.optimizer import instrument

_started_process_group = False  # whether init() called init_process_group (so shutdown() may destroy it)
_made: Communicator | None = None  # the communicator init() made (shutdown() closes it)
_groups_started = 0  # process groups init() started in this process (each meets under its own store prefix)
_single: Communicator | None = None


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits, as its launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    launcher: str  # "torchrun", "mpirun" or "none"


def _int_env(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def read_launch_env() -> LaunchEnv:
    """Rank, world size and local rank from torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or Open MPI / PMI."""
    rank = _int_env("RANK")
    if rank is not None:
        world = _int_env("WORLD_SIZE")
        if world is None:
            raise ValueError("RANK is set but WORLD_SIZE is not; launch with torchrun or set both")
        launcher = "torchrun"
        local = _int_env("LOCAL_RANK")
    else:
        rank = _int_env("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
        world = _int_env("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        local = _int_env("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
        if (rank is None) != (world is None):
            raise ValueError("the MPI launch environment names a rank but no size, or a size but no rank "
                             "(OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE or PMI_RANK / PMI_SIZE); launch with mpirun")
        launcher = "mpirun" if rank is not None else "none"
        rank, world = (rank, world) if rank is not None and world is not None else (0, 1)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1} (world size {world}) in the launch environment")
    port = _int_env("MASTER_PORT")
    return LaunchEnv(rank, world, rank if local is None else local, os.environ.get("MASTER_ADDR"), port, launcher)


def default_backend() -> str:
    """nccl when CUDA is usable, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init(backend: str | None = None, timeout: float | None = None, profile: bool = False,
         algorithm=None) -> Communicator:
    """Start this process's communication from the launcher's environment and make it the default.

    `backend`: None (nccl with CUDA, else gloo), "nccl", "gloo", "mpi" (mpi4py, under mpirun) or "threads"
    (a world of one outside `launch`). Binds the CUDA device from LOCAL_RANK when using nccl. Calling it
    again returns the existing communicator. `profile=True` records every collective in a `CommProfiler`
    (the returned communicator is a `CommProfiler`: `.records`, `.stats()`); `algorithm="auto" | name | {collective: name}` runs collectives
    through `AlgorithmCommunicator` (see `tpkit.comm.instrument`).
    """
    global _made
    current = current_thread_communicator() or process_communicator()
    if current is not None:
        return current
    backend = (backend or default_backend()).lower()
    if backend == "threads":
        return get_communicator()
    if backend == "mpi":
        from .comm.mpi import MPICommunicator
        _made = instrument(MPICommunicator(timeout=timeout), profile=profile, algorithm=algorithm)
        set_process_communicator(_made)
        return _made
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"unknown backend {backend!r}; valid: nccl, gloo, mpi, threads")
    import torch.distributed as dist

    from .comm.torch_backend import TorchCommunicator

    if not dist.is_initialized():
        _start_process_group(backend, timeout)
    _made = instrument(TorchCommunicator(timeout=timeout), profile=profile, algorithm=algorithm)
    set_process_communicator(_made)
    return _made


def _start_process_group(backend: str, timeout: float | None) -> None:
    """torch.distributed's world group for `init`, from the launch environment."""
    global _started_process_group, _groups_started
    import torch.distributed as dist

    env = read_launch_env()
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is False; use 'gloo'")
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    kwargs = {}
    if timeout is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout)
    if env.world_size == 1 and env.master_addr is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    else:
        _check_rendezvous_address(env)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        store = generation_store(env, timeout)
        if store is None:
            dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                                    **kwargs)
        else:
            dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, **kwargs)
    _started_process_group = True
    _groups_started += 1


set_torch_init(init)  # create_communicator("torch") starts torch.distributed through init (comm cannot import it)


def generation_store(env: LaunchEnv, timeout: float | None = None):
    """Under a launcher that hosts the store for every generation of workers (torchrun's agent, `tpkit.launch`;
    `TORCHELASTIC_USE_AGENT_STORE=True`): a client of it, prefixed by this generation
    (`TORCHELASTIC_RESTART_COUNT`), so a restarted generation never reads the keys of the one that died; and by
    how many groups this process started before (`init` after `shutdown`: torch names the new world group as
    it named the old one, so it would meet the old group's keys and hang). Every rank shuts down and starts
    again together, so the count agrees across ranks. None otherwise (`env://` then starts a fresh store on
    rank 0)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    wait = datetime.timedelta(seconds=timeout if timeout is not None else 300.0)
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                           is_master=False, timeout=wait)
    again = f"/init-{_groups_started}" if _groups_started else ""
    return dist.PrefixStore(f"tpkit/generation-{restart_count()}{again}", client)


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (0 in the first generation, and without torchrun)."""
    return _int_env("TORCHELASTIC_RESTART_COUNT") or 0


def _check_rendezvous_address(env: LaunchEnv) -> None:
    """Under a multi-node mpirun, 127.0.0.1 is not rank 0's address: say so instead of timing out later."""
    local_world = _int_env("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    if env.launcher == "mpirun" and env.master_addr is None and local_world is not None and local_world < env.world_size:
        raise ValueError(f"this mpirun spans several nodes ({env.world_size} ranks, {local_world} on this node) but "
                         f"MASTER_ADDR is not set; export MASTER_ADDR=<rank 0's host> (and MASTER_PORT) to every "
                         f"rank, e.g. mpirun -x MASTER_ADDR=node0 -x MASTER_PORT=29500 ..., or use init('mpi')")


def shutdown() -> None:
    """Close the communicator `init` made and forget the default; tear down torch.distributed only if `init`
    started it. Collective, like `Communicator.close`: call it on every rank.

    Closing releases what the communicator holds (its shared-memory mapping, its async worker thread, an MPI
    communicator) rather than leaving it to the interpreter's exit; `init()` afterwards starts afresh. A
    communicator passed to `set_communicator` belongs to the caller and is only forgotten.
    """
    global _made, _started_process_group
    from .comm import torch_backend

    made, _made = _made, None
    set_process_communicator(None)
    try:
        if made is not None:
            made.close()
    finally:
        if _started_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            torch_backend._LOCAL_GROUPS.clear()
            _started_process_group = False


def get_communicator() -> Communicator:
    """The communicator layers use by default: this thread-rank's, the one `init` made, or a world of one.

    In a process a launcher started as one rank of several (torchrun's RANK / WORLD_SIZE, mpirun's) and with no
    communicator yet, a world of one would give every rank the whole model: a torch.distributed group the script
    started itself is adopted (as `init()` would), otherwise this raises RuntimeError saying to call `init()`.
    """
    global _single
    comm = current_thread_communicator() or process_communicator()
    if comm is not None:
        return comm
    launched = _launched_world()
    if launched is not None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return init()
        raise RuntimeError(
            f"tpkit: this process is rank {launched.rank} of {launched.world_size} ({launched.launcher}: "
            f"{'RANK / WORLD_SIZE' if launched.launcher == 'torchrun' else 'its rank and size variables'}) but no "
            f"communicator was set up, so tpkit would run it as a world of one and every rank would hold the whole "
            f"model. Call `comm = tpkit.init()` at the start of the script (or pass comm=...; "
            f"tpkit.set_communicator(comm) to choose one)")
    if _single is None:
        from .comm.threads import create_communicators
        _single = create_communicators(1)[0]
    return _single


def _launched_world() -> LaunchEnv | None:
    """The launch environment when it names a world of several ranks; None otherwise (or when it is malformed:
    `init()` reports that)."""
    try:
        env = read_launch_env()
    except ValueError:
        return None
    return env if env.world_size > 1 else None


def set_communicator(comm: Communicator | None) -> None:
    """Make `comm` the default for the whole process (None forgets it)."""
    set_process_communicator(comm)


@dataclasses.dataclass(frozen=True)
class TPConfig:
    """The seed API's view of the tensor-parallel setup."""

    world_size: int
    rank: int
    backend: str
    device: torch.device


def _device_for(comm: Communicator) -> torch.device:
    if getattr(comm, "torch_backend", None) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_tensor_parallel(backend: str | None = None, timeout: float | None = None) -> TPConfig:
    """Seed-compatible: `init()` and describe the result."""
    init(backend, timeout)
    return get_tensor_parallel_config()


def get_tensor_parallel_config() -> TPConfig:
    """Seed-compatible description of the default communicator."""
    comm = get_communicator()
    name = getattr(comm, "torch_backend", None) or comm.backend
    return TPConfig(comm.world_size, comm.rank, name, _device_for(comm))


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Seed-compatible: the sum of `tensor` over the default communicator's ranks."""
    return get_communicator().all_reduce(tensor)


def broadcast_tensor(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Seed-compatible: rank `src`'s `tensor` on every rank."""
    return get_communicator().broadcast(tensor, src=src)


def synchronize_across_ranks() -> None:
    """Seed-compatible: a barrier over the default communicator."""
    get_communicator().barrier()
