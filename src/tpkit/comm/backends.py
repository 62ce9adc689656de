"""`create_communicator(name)`: the backends by name (`BACKENDS`) and how each is made.

`torch` wraps an initialised torch.distributed process group. When nothing has initialised one yet, starting
it is process setup, which lives a layer above comm (`tpkit.distributed.init`: the launcher's environment,
the CUDA device, the process-wide default communicator). That layer registers its entry point here with
`set_torch_init`, so comm never imports it; `import tpkit` does so before any caller can get here.
"""
from __future__ import annotations

from typing import Any, Callable

from .communicator import Communicator
from .context import current_thread_communicator
from .optimizer import instrument
from .threads import create_communicators

# `init(backend, timeout) -> Communicator`, registered by tpkit.distributed (see the module docstring).
_torch_init: Callable[..., Communicator] | None = None


def set_torch_init(init: Callable[..., Communicator]) -> None:
    """Register how `create_communicator("torch")` starts torch.distributed when it is not initialised:
    `init(backend, timeout)` returns the communicator (and makes it the process default)."""
    global _torch_init
    _torch_init = init


def _make_threads(world_size: int = 1, timeout: float | None = None, **config) -> Communicator:
    if config:
        raise ValueError(f"threads backend: unknown options {sorted(config)}")
    current = current_thread_communicator()
    if current is not None and current.backend == "threads":
        return current
    if world_size != 1:
        raise ValueError(f"threads backend: a single call cannot make {world_size} thread-ranks; use "
                         f"tpkit.comm.run_threads(fn, {world_size}) or create_communicators({world_size})")
    return create_communicators(1, timeout)[0]


def _make_torch(group=None, timeout: float | None = None, backend: str | None = None, **config) -> Communicator:
    if config:
        raise ValueError(f"torch backend: unknown options {sorted(config)}")
    import torch.distributed as dist

    from .torch_backend import TorchCommunicator

    if not dist.is_initialized():
        if group is not None:
            raise ValueError("torch backend: a group was given but torch.distributed is not initialised")
        if _torch_init is None:
            raise RuntimeError("torch backend: torch.distributed is not initialised; call tpkit.init() or "
                               "torch.distributed.init_process_group() first")
        return _torch_init(backend, timeout)
    return TorchCommunicator(group, timeout)


def _make_mpi(**config) -> Communicator:
    from .mpi import MPICommunicator

    return MPICommunicator(**config)


BACKENDS: dict[str, Callable[..., Communicator]] = {
    "torch": _make_torch,
    "threads": _make_threads,
    "mpi": _make_mpi,
}


def create_communicator(backend: str, /, algorithm: Any = None, profile: bool = False, **config: Any) -> Communicator:
    """A communicator of the named backend: `torch` (nccl/gloo/mpi process groups; the keyword `backend=` picks which
    when torch.distributed is not yet initialised), `threads`, or `mpi` (mpi4py).

    `algorithm="auto" | name | {collective: name}` runs collectives through `AlgorithmCommunicator`;
    `profile=True` records them in a `CommProfiler` (see `instrument`)."""
    factory = BACKENDS.get(str(backend).lower())
    if factory is None:
        raise ValueError(f"unknown communication backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    return instrument(factory(**config), profile=profile, algorithm=algorithm)
