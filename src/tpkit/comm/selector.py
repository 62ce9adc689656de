"""`AlgorithmSelector`: which algorithm to run for a (collective, bytes, world size).

Why: the best algorithm changes with message size and group size. Before calibration the selector uses
MPICH's classic thresholds (Thakur et al. 2005, MPICH 3 defaults), which encode decades of measurements
on real networks; once its `CostModel` is calibrated it picks the fastest predicted, "builtin" included.
An algorithm must be predicted faster than builtin by `margin` (20%) to be chosen: a prediction is an
estimate, and the backend's own collective is the safe default.

Decisions are a pure function of (collective, bytes, world size) and the model, so every rank of a group
(same model after a collective `calibrate`) picks the same algorithm.
"""
from __future__ import annotations

from .algorithms import ALGORITHMS, COLLECTIVES
from .cost_model import BUILTIN, CostModel

# MPICH 3 defaults (MPIR_CVAR_*), in bytes.
ALLREDUCE_SHORT_MSG = 2048
ALLGATHER_SHORT_MSG = 81920
ALLGATHER_LONG_MSG = 524288
REDSCAT_LONG_MSG = 524288
BCAST_SHORT_MSG = 12288
BCAST_MIN_PROCS = 8
ALLTOALL_MEDIUM_MSG = 32768  # bytes per destination


def _is_pow2(p: int) -> bool:
    return p & (p - 1) == 0


def mpich_choice(collective: str, nbytes: int, world_size: int, itemsize: int = 4) -> str:
    """MPICH's classic choice for a collective of `nbytes` (nccl-tests bytes) on `world_size` ranks."""
    p = world_size
    if collective == "all_reduce":
        p2 = 1 << (p.bit_length() - 1)
        if nbytes < ALLREDUCE_SHORT_MSG or nbytes // itemsize < p2:
            return "recursive_doubling"
        return "rabenseifner"
    if collective == "all_gather":
        if nbytes < ALLGATHER_LONG_MSG and _is_pow2(p):
            return "recursive_doubling"
        if nbytes < ALLGATHER_SHORT_MSG:
            return "bruck"
        return "ring"
    if collective == "reduce_scatter":
        return "recursive_halving" if nbytes < REDSCAT_LONG_MSG else "pairwise"
    if collective == "all_to_all":  # MPICH's Bruck for tiny pieces is not here: direct below medium, then pairwise
        return "direct" if nbytes // p < ALLTOALL_MEDIUM_MSG else "pairwise"
    if collective == "broadcast":
        if nbytes < BCAST_SHORT_MSG or p < BCAST_MIN_PROCS:
            return "binomial"
        return "scatter_allgather"
    raise ValueError(f"AlgorithmSelector: unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")


class AlgorithmSelector:
    """Pick an algorithm per call; `model` (a `CostModel`) decides once calibrated, MPICH's rules before."""

    def __init__(self, model: CostModel | None = None, margin: float = 0.2):
        if not 0 <= margin < 1:
            raise ValueError(f"AlgorithmSelector: margin must be in [0, 1), got {margin}")
        self.model = model if model is not None else CostModel()
        self.margin = margin
        self._cache: dict[tuple, str] = {}
        self._cache_version = -1

    def select(self, collective: str, nbytes: int, world_size: int, itemsize: int = 4) -> str:
        """The algorithm name to run ("builtin" or a key of `ALGORITHMS[collective]`)."""
        key = (collective, nbytes, world_size, itemsize)
        if self._cache_version != self.model.version:
            self._cache.clear()
            self._cache_version = self.model.version
        choice = self._cache.get(key)
        if choice is None:
            choice = self._decide(collective, nbytes, world_size, itemsize)
            if len(self._cache) < 4096:
                self._cache[key] = choice
        return choice

    def _decide(self, collective: str, nbytes: int, world_size: int, itemsize: int) -> str:
        if collective not in COLLECTIVES:
            raise ValueError(f"AlgorithmSelector: unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
        if world_size <= 1:
            return BUILTIN
        if not self.model.calibrated:
            return mpich_choice(collective, nbytes, world_size, itemsize)
        return self.ranked(collective, nbytes, world_size)[0][0]

    def ranked(self, collective: str, nbytes: int, world_size: int) -> list[tuple[str, float]]:
        """Every candidate with its predicted seconds, best first (builtin credited with the margin)."""
        predict = self.model.predict
        builtin = predict(collective, BUILTIN, nbytes, world_size)
        scores = [(BUILTIN, builtin * (1 - self.margin))]
        scores += [(name, predict(collective, name, nbytes, world_size)) for name in ALGORITHMS[collective]]
        return sorted(scores, key=lambda item: item[1])

    def calibrate(self, comm, **kwargs) -> "AlgorithmSelector":
        """Calibrate the model on `comm` (collective over it); see `CostModel.calibrate`."""
        self.model.calibrate(comm, **kwargs)
        return self
