"""`launch`: run a function on N local ranks, for tests, examples and notebooks.

Processes (gloo, or nccl with one GPU per rank) get the same environment torchrun would give them, so the
function under test goes through the real `tpkit.init()` path. The `threads` backend runs the ranks as
threads of this process, each with its own default communicator. Either way the results come back in rank
order, and a failure is re-raised marked with its rank (the rank whose error caused the others, not a
peer that merely saw it die).

`set_threads` sizes a rank's intra-op CPU thread pool: one thread per rank when several ranks share the host
(each rank's default pool has a thread per core, so N ranks run N x cores threads: on 2 cores, a run with 2
threads per rank was measured 5x slower than with 1), unless the user said otherwise. `launch` calls it in
every process rank; scripts under torchrun or mpirun call it first thing (the examples do).

Process ranks start as fresh interpreters would (none inherits the caller's state), each importing the calling
script again, as module `__mp_main__`, to find `fn`. gloo ranks come from a fork server that imported torch and tpkit
(and `TPKIT_PRELOAD`'s modules: transformers' modeling core, say) once (`TPKIT_START_METHOD`, default "forkserver"
where the platform has one): a 2-rank launch then takes 0.09 s instead of the 1.9 s fresh interpreters spend importing
them (`bench/launch.py`, 2-core box), most of a short run. What a
spawned rank would get from the caller at this moment, a forked one gets too: the environment and the caller's stdout
and stderr are handed over before anything is unpickled (the server was started earlier, with what was current then).
nccl ranks, and `TPKIT_START_METHOD=spawn`, use "spawn" (CUDA must not meet a forked process).

A script whose top level calls `launch` must guard that call (and the model building before it) with
`if __name__ == "__main__":`, or every rank re-runs it; `launch` called while a rank is importing the script raises
`RuntimeError` saying so, and the parent's error names the rank that failed while starting.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable, Sequence

import torch

from .comm.errors import CommError
from .comm.threads import create_communicators, mark_rank, raise_first_failure, run_on_threads


class LaunchError(RuntimeError):
    """A rank failed in a way that could not be re-raised as its own exception (it died, or its error
    could not be sent back); `rank` says which."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


THREADS_VARIABLE = "TPKIT_THREADS"

GUARD_HINT = ("guard the script's top level with `if __name__ == \"__main__\":` (the function the ranks run stays at "
              "module level): each process rank imports the script again to find it")


def set_threads(threads: int | None = None, local_ranks: int | None = None) -> int:
    """Set this rank's intra-op CPU threads (`torch.set_num_threads`) and return the number in effect. The first
    of these that applies decides:

    1. `threads`, when given;
    2. the environment variable `TPKIT_THREADS=N`;
    3. `OMP_NUM_THREADS`, when set: torch sized its pool from it at import, and it is left as it is (torchrun
       sets it to 1 for `--nproc-per-node` > 1 unless the user set it; `OMP_NUM_THREADS=4 torchrun ...` gives 4);
    4. one thread when more than one rank runs on this host: `local_ranks`, else the launcher's count
       (`LOCAL_WORLD_SIZE` from torchrun, `OMPI_COMM_WORLD_LOCAL_SIZE` / `MPI_LOCALNRANKS` from mpirun, else the
       world size); a rank alone on its host keeps torch's default (a thread per core).

    Threads are per process: call it in each rank, not in a process running thread-ranks (they share one pool).
    """
    source = "threads"
    if threads is None:
        threads, source = _env_int(THREADS_VARIABLE), THREADS_VARIABLE
    if threads is None and os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    if threads is None:
        local = local_ranks if local_ranks is not None else _env_int(
            "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE",
            "PMI_SIZE")
        if local is None or local <= 1:
            return torch.get_num_threads()
        threads = 1
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"set_threads: {source} must be a positive int (intra-op threads per rank), got {threads!r}")
    torch.set_num_threads(threads)
    return threads


def _env_int(*names: str) -> int | None:
    """The first of `names` set in the environment, as an int (ValueError naming it if it is not one)."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn: Callable[..., Any], world_size: int, backend: str = "gloo", args: Sequence[Any] = (),
           timeout: float | None = None, pass_comm: bool = False, threads: int | None = None) -> list:
    """Run `fn(*args)` on `world_size` local ranks; return their results in rank order.

    `pass_comm=True` calls `fn(comm, *args)` instead, `comm` being the rank's communicator (what
    `tpkit.comm.run_threads` passes). An explicit flag rather than a look at `fn`'s signature: a parameter
    named `comm` may be the caller's own argument, and partials and builtins have no reliable signature. The
    signature is only read to refuse, before any rank starts, a call that would fail on every rank for want
    of `comm` (`TypeError` saying to pass `pass_comm=True`).

    `backend`: "gloo" or "nccl" (one process per rank; `fn` must be picklable, i.e. defined at module
    level) or "threads". Process ranks are spawned and import the calling script again: a script keeps its model
    building and this call under `if __name__ == "__main__":`, or every rank re-runs them (a `launch` reached that
    way raises RuntimeError naming the guard). `timeout` bounds every collective (seconds) and, for processes, the whole run
    waits at most that long after the first failure for the other ranks to notice it.

    `threads`: intra-op CPU threads of each process rank. Default: `set_threads`'s rule with `world_size` ranks on
    this host, i.e. `TPKIT_THREADS` or `OMP_NUM_THREADS` if set, else one thread per rank when there are several
    (so N ranks do not fight over the cores). Thread-ranks share this process's pool: there `threads`, when
    given, sizes it for the run and the previous size is restored after.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch: world_size must be a positive int, got {world_size!r}")
    _check_not_starting_a_rank()
    args = tuple(args)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"launch: threads must be a positive int (intra-op threads per rank), got {threads!r}")
    if not pass_comm:
        _check_comm_is_not_missing(fn, args)
    if backend == "threads":
        comms = create_communicators(world_size, timeout)
        before = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            return run_on_threads(lambda comm: fn(comm, *args) if pass_comm else fn(*args), comms)
        finally:
            torch.set_num_threads(before)
    if backend == "mpi":
        raise ValueError("launch: backend 'mpi' needs processes started by mpirun; run "
                         f"`mpirun -n {world_size} python your_script.py` and call tpkit.init('mpi') there")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"launch: unknown backend {backend!r}; valid: gloo, nccl, threads")
    return _launch_processes(fn, world_size, backend, args, timeout, pass_comm, threads)


def _check_not_starting_a_rank() -> None:
    """Raise RuntimeError when this process is a spawned rank still importing the calling script (`__mp_main__`):
    the script's top level calls `launch` unguarded, so every rank re-runs it (the model building before it
    included). multiprocessing's own check would fire later, from inside `launch`, with a generic message."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(f"launch: called while a rank process was starting, from the top level of the script "
                           f"it was importing again (as __mp_main__); {GUARD_HINT}")


def _check_comm_is_not_missing(fn: Callable[..., Any], args: tuple) -> None:
    """Raise TypeError when `fn(*args)` cannot bind but `fn(comm, *args)` can and `fn`'s first parameter is
    named `comm`: `fn` wants the rank's communicator and `pass_comm=True` was forgotten (every rank would fail
    with "missing 1 required positional argument"). Silent where the signature cannot be read (builtins, some C
    callables) or the call binds: the ranks then report what happens."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    first = next(iter(signature.parameters.values()), None)
    if first is None or first.name != "comm" or first.kind not in (first.POSITIONAL_ONLY,
                                                                   first.POSITIONAL_OR_KEYWORD):
        return
    try:
        signature.bind(*args)
        return
    except TypeError as exc:
        error = str(exc)
    try:
        signature.bind(None, *args)
    except TypeError:
        return  # wrong with or without comm: not a forgotten pass_comm
    name = getattr(fn, "__qualname__", None) or repr(fn)
    raise TypeError(f"launch: {name}{signature} takes the rank's communicator as its first parameter 'comm', but "
                    f"pass_comm is False, so every rank would call it as fn(*args) and fail ({error}); pass "
                    f"pass_comm=True (launch(fn, n, pass_comm=True) calls fn(comm, *args))")


def _worker(inherited: None, rank: int, world_size: int, port: int, backend: str, fn, args, timeout, pass_comm,
            threads, results) -> None:
    # `inherited` did its work while this call's arguments were unpickled (`_Inherited`): nothing left to read.
    # The parent hosts the rendezvous store, as torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE): its port
    # stays bound for the whole run, so a concurrent launch can never pick the same one.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    from . import distributed

    results.put((rank, "started", None))  # a rank that dies before this failed while starting (see the module doc)
    try:
        set_threads(threads, local_ranks=world_size)
        comm = distributed.init(backend, timeout)
        value = fn(comm, *args) if pass_comm else fn(*args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
        text = "".join(traceback.format_exception(exc))
        try:
            payload = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - some exceptions cannot be pickled; send the text instead
            payload = None
        results.put((rank, "error", (payload, text)))
    finally:
        try:
            distributed.shutdown()
        except Exception:  # noqa: BLE001 - a broken group cannot always be torn down cleanly
            pass
    _exit_quickly(results)


def _exit_quickly(results) -> None:
    """End a worker without the interpreter's slow teardown (seconds with torch loaded, on a busy machine):
    deliver the result, run the atexit handlers and flush the output, then leave."""
    import atexit
    import sys

    results.close()
    results.join_thread()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream has nothing left to flush
            pass
    os._exit(0)


START_METHODS = ("forkserver", "spawn")
PRELOAD = ["torch", "torch.distributed", "tpkit"]  # what every rank imports first: imported once, by the server
PRELOAD_VARIABLE = "TPKIT_PRELOAD"  # more modules the server imports (comma-separated), in the first launch's env


def preload() -> list[str]:
    """torch and tpkit, then `TPKIT_PRELOAD`'s modules (one that fails to import is skipped)."""
    return PRELOAD + [m.strip() for m in os.environ.get(PRELOAD_VARIABLE, "").split(",") if m.strip()]


def start_method(backend: str) -> str:
    """How process ranks start (see the module doc): "spawn" for nccl, else `TPKIT_START_METHOD` (default
    "forkserver", or "spawn" where the platform has no fork server)."""
    import multiprocessing

    chosen = os.environ.get("TPKIT_START_METHOD", "forkserver")
    if chosen not in START_METHODS:
        raise ValueError(f"launch: TPKIT_START_METHOD={chosen!r} is not one of {', '.join(START_METHODS)}")
    if backend == "nccl" or chosen not in multiprocessing.get_all_start_methods():
        return "spawn"
    return chosen


class _Inherited:
    """What a rank takes from the caller at launch: pickled first among the rank's arguments, it is applied while
    they are unpickled, before `fn` (and the module that defines it) is imported. A forked rank otherwise holds the
    fork server's environment and output streams, those of whatever test or cell first started it."""

    def __reduce__(self):
        from multiprocessing import reduction

        streams = tuple(reduction.DupFd(fd) if _is_open(fd) else None for fd in (1, 2))
        return _inherit, (dict(os.environ), *streams)


def _is_open(fd: int) -> bool:
    with contextlib.suppress(OSError):
        return os.fstat(fd) is not None
    return False


def _inherit(environ: dict, stdout, stderr) -> None:
    os.environ.clear()
    os.environ.update(environ)
    for fd, stream in ((1, stdout), (2, stderr)):
        if stream is not None:
            handed = stream.detach()
            os.dup2(handed, fd)
            os.close(handed)


def _start_ranks(method: str, rank_args: tuple) -> tuple:
    """Start one process per rank with `method` (see the module doc): (the results queue, the processes)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(preload())  # read when the server starts (the first launch), ignored after
    results = ctx.Queue()
    inherited = _Inherited() if method == "forkserver" else None
    procs = [ctx.Process(target=_worker, daemon=True, args=(inherited, r, *rank_args, results))
             for r in range(rank_args[0])]
    for p in procs:
        p.start()
    return results, procs


def _launch_processes(fn, world_size, backend, args, timeout, pass_comm, threads) -> list:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    rank_args = (world_size, store.port, backend, fn, args, timeout, pass_comm, threads)
    try:
        results, procs = _start_ranks(start_method(backend), rank_args)
    except ValueError as error:
        if "too many fds" not in str(error):
            raise
        # `args` hold more tensors than a fork server can hand over (each shared storage is a file descriptor,
        # at most 256 a rank): start this launch's ranks spawned, as nccl's are (none had started).
        results, procs = _start_ranks("spawn", rank_args)
    values: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size
    reported = [False] * world_size
    started = [False] * world_size
    grace = 30.0 if timeout is None else float(timeout) + 10.0
    first_failure: float | None = None
    try:
        while not all(reported):
            try:
                rank, status, payload = results.get(timeout=0.1)
            except queue_module.Empty:
                rank = None
            if rank is not None and status == "started":
                started[rank] = True
                continue
            if rank is not None:
                reported[rank] = True
                if status == "ok":
                    values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    errors[rank] = _rebuild_error(rank, *payload)
                    first_failure = first_failure or time.monotonic()
                continue
            for r, p in enumerate(procs):
                if not reported[r] and p.exitcode is not None:
                    # Give the queue a moment: a rank that exits right after reporting is not dead.
                    time.sleep(0.2)
                    if results.empty() and not reported[r]:
                        reported[r] = True
                        errors[r] = LaunchError(f"rank {r} died with exit code {p.exitcode} without reporting"
                                                + ("" if started[r] else f", while starting, before it ran "
                                                   f"{getattr(fn, '__qualname__', 'fn')} (its traceback is above, "
                                                   f"on stderr); if it says the script was imported again: "
                                                   f"{GUARD_HINT}"), r)
                        first_failure = first_failure or time.monotonic()
            if first_failure is not None and time.monotonic() - first_failure > grace:
                for r in range(world_size):
                    if not reported[r]:
                        errors[r] = CommError(f"rank {r} did not finish within {grace:g}s after another "
                                              f"rank failed (aborted: killed by launch)")
                break
    finally:
        # Every rank has reported; what is left is teardown, which can block on a broken group: a short
        # grace, then the stragglers are killed.
        deadline = time.monotonic() + 3.0
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store
    raise_first_failure(_deaths_first(errors))
    return values


def _deaths_first(errors: list[BaseException | None]) -> list[BaseException | None]:
    """When the only other failures are CommErrors, a rank that died (killed, no report) caused them: keep just
    the deaths, so the re-raised error names the dead rank rather than a peer that saw it go."""
    died = [isinstance(e, LaunchError) and "died" in str(e) for e in errors]
    knock_on = all(e is None or d or isinstance(e, CommError) for e, d in zip(errors, died))
    return [e if d else None for e, d in zip(errors, died)] if any(died) and knock_on else errors


def _rebuild_error(rank: int, payload: bytes | None, text: str) -> BaseException:
    exc: BaseException | None = None
    with contextlib.suppress(Exception):  # an error that cannot be unpickled: its text
        exc = pickle.loads(payload) if payload is not None else None
    if exc is None:
        return LaunchError(f"rank {rank} failed:\n{text}", rank)
    mark_rank(exc, rank)
    if hasattr(exc, "add_note"):
        exc.add_note(f"traceback on rank {rank}:\n{text}")
    return exc
