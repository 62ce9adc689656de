"""Random streams for dropout under tensor parallelism.

Two rules. Dropout on a replicated activation (after a RowParallelLinear) must drop the same elements on every
rank, or the replicas drift apart: it uses torch's default generator, seeded identically on all TP ranks. Dropout
on a sharded activation (attention probabilities of this rank's heads, a column-parallel output) must drop
independent elements on each rank, or the full activation's mask would repeat with period `1/N`: it runs inside
`get_rng_tracker().fork()`, which swaps in a per-rank stream seeded `seed + 2718 + rank` (Megatron's offset) and
swaps it back afterwards, so the default stream is untouched.

`model_parallel_manual_seed(seed)` sets both up. `fork(DATA_PARALLEL_RNG)` is a third stream seeded `seed` on every
rank: identical across ranks and independent of the default generator, for replicated dropout on the `threads`
backend, where all thread-ranks share one process-wide default generator.

A fork holds a process-wide lock for its body (thread-ranks would otherwise swap the shared generator under each
other), so the body must not wait for other ranks: no collectives inside `fork()`.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator

import torch

from ..comm.communicator import Communicator
from ._layer import resolve_comm

MODEL_PARALLEL_RNG = "model-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718

_lock = threading.RLock()
_trackers: "weakref.WeakKeyDictionary[Communicator, RNGStatesTracker]" = weakref.WeakKeyDictionary()


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class RNGStatesTracker:
    """Named generator states that `fork(name)` swaps in and out of torch's default CPU (and CUDA) generator."""

    def __init__(self) -> None:
        self._seeds: dict[str, int] = {}
        self._states: dict[str, dict[str, torch.Tensor]] = {}

    def reset(self) -> None:
        self._seeds.clear()
        self._states.clear()

    def add(self, name: str, seed: int) -> None:
        """Register stream `name`, seeded with `seed`."""
        if name in self._seeds:
            raise ValueError(f"RNG tracker: stream {name!r} already exists; call reset() first to reseed it")
        if seed in self._seeds.values():
            raise ValueError(f"RNG tracker: seed {seed} is already used by another stream; streams must differ")
        self._seeds[name] = int(seed)
        self._states[name] = {"cpu": torch.Generator().manual_seed(int(seed)).get_state()}

    def __contains__(self, name: str) -> bool:
        """Whether stream `name` is registered (so a caller can refuse clearly before forking)."""
        return name in self._states

    def get_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """A copy of every stream's state (for checkpoints)."""
        return {name: {dev: s.clone() for dev, s in states.items()} for name, states in self._states.items()}

    def set_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore states from `get_states()`."""
        self._states = {name: {dev: s.clone() for dev, s in st.items()} for name, st in states.items()}
        self._seeds = {name: self._seeds.get(name, -1) for name in self._states}

    def _cuda_state(self, name: str) -> torch.Tensor:
        saved = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(self._seeds[name])
        state = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(saved)
        return state

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the body with stream `name` as torch's default generator; its advance is kept for next time."""
        if name not in self._states:
            raise ValueError(f"RNG tracker: no stream {name!r} (known: {sorted(self._states)}); call "
                             f"tpkit.nn.model_parallel_manual_seed(seed) first")
        states = self._states[name]
        with _lock:
            saved_cpu = torch.get_rng_state()
            use_cuda = _cuda_ready()
            if use_cuda:
                saved_cuda = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(states["cuda"] if "cuda" in states else self._cuda_state(name))
            torch.set_rng_state(states["cpu"])
            try:
                yield
            finally:
                states["cpu"] = torch.get_rng_state()
                torch.set_rng_state(saved_cpu)
                if use_cuda:
                    states["cuda"] = torch.cuda.get_rng_state()
                    torch.cuda.set_rng_state(saved_cuda)


    @contextlib.contextmanager
    def generator(self, name: str, device: torch.device | str = "cpu") -> Iterator[torch.Generator]:
        """Stream `name` as a `torch.Generator` of its own on `device`, for draws that pass `generator=`; its
        advance is kept. Unlike `fork`, torch's default generator is not touched, so nothing that sets it meanwhile
        (another thread-rank, a checkpoint restoring its RNG state) can interleave with the draw."""
        if name not in self._states:
            raise ValueError(f"RNG tracker: no stream {name!r} (known: {sorted(self._states)}); call "
                             f"tpkit.nn.model_parallel_manual_seed(seed) first")
        device = torch.device(device)
        key = "cpu" if device.type == "cpu" else "cuda"
        with _lock:
            states = self._states[name]
            g = torch.Generator(device=device)
            g.set_state(states[key] if key in states else self._cuda_state(name))
            yield g
            states[key] = g.get_state()


def get_rng_tracker(comm: Communicator | None = None) -> RNGStatesTracker:
    """The tracker of this rank (one per communicator, so thread-ranks each have their own)."""
    comm = resolve_comm(comm)
    with _lock:
        tracker = _trackers.get(comm)
        if tracker is None:
            tracker = _trackers[comm] = RNGStatesTracker()
        return tracker


def model_parallel_manual_seed(seed: int, comm: Communicator | None = None) -> RNGStatesTracker:
    """Seed torch's default generator with `seed` (same on every TP rank: replicated dropout agrees) and this
    rank's tracker with `seed + 2718 + rank` (sharded dropout differs) and `seed` (DATA_PARALLEL_RNG)."""
    comm = resolve_comm(comm)
    torch.manual_seed(seed)
    tracker = get_rng_tracker(comm)
    tracker.reset()
    tracker.add(DATA_PARALLEL_RNG, seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + comm.rank)
    return tracker
