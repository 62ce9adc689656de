"""`CostModel`: how long a collective takes, from alpha (per message), beta (per byte moved) and gamma
(per byte reduced), after Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
Operations in MPICH" (2005).

Why: choosing an algorithm needs a prediction for sizes and world sizes not measured. Every algorithm's
time is `a*alpha + b*beta + c*gamma` with counts `(a, b, c)` that follow from its message pattern
(`coefficients`); `calibrate(comm)` times a few runs on the real backend and fits alpha, beta, gamma by
least squares on relative error. The backend's own ("builtin") collectives are black boxes, so each gets
its own measured curve per (collective, world size) -- and so does every measured algorithm: on a real
machine the per-message cost depends on the pattern (an oversubscribed CPU box pays more for all ranks
sending at once than alpha-beta says), so on the world size it was calibrated on the model interpolates
each algorithm's own measurements (linear in bytes between measured sizes, the last segment's slope
beyond), and uses the fitted formulas everywhere else.

Bytes follow nccl-tests: the tensor for all_reduce and broadcast, the whole gathered output for
all_gather, the whole input for reduce_scatter and all_to_all (one rank's send buffer).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from .algorithms import ALGORITHMS, COLLECTIVES
from .communicator import Communicator
from .ops import ReduceOp
from ..layout import split_sizes
from .timing import interleaved_times, slowest_rank_medians

BUILTIN = "builtin"
# What a builtin collective is, as a formula, until it is measured: gloo's all_reduce is a ring, its
# reduce_scatter is an all-reduce plus a copy, its all_gather a ring, its broadcast a tree and its all_to_all a
# pairwise exchange.
_BUILTIN_LIKE = {"all_reduce": ("all_reduce", "ring"), "all_gather": ("all_gather", "ring"),
                 "reduce_scatter": ("all_reduce", "ring"), "broadcast": ("broadcast", "binomial"),
                 "all_to_all": ("all_to_all", "pairwise")}


def _lg(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


def coefficients(collective: str, algorithm: str, nbytes: float, p: int) -> tuple[float, float, float]:
    """(messages on the critical path, bytes sent by one rank, bytes reduced by one rank).

    Non-powers of two pay for the fold (`p2` = largest power of two <= p): two extra messages, the whole
    vector (or block) in and the result out.
    """
    m = float(nbytes)
    if p <= 1:
        return 0.0, 0.0, 0.0
    p2 = 1 << (p.bit_length() - 1)
    folded = p != p2
    k2 = math.log2(p2)
    if collective == BUILTIN or algorithm == BUILTIN:
        collective, algorithm = _BUILTIN_LIKE[collective]
    key = (collective, algorithm)
    if key == ("all_reduce", "ring"):
        return 2 * (p - 1), 2 * (p - 1) / p * m, (p - 1) / p * m
    if key == ("all_reduce", "recursive_doubling"):
        a, b, c = k2, k2 * m, k2 * m
        return (a + 2, b + 2 * m, c + m) if folded else (a, b, c)
    if key == ("all_reduce", "rabenseifner"):
        a, b, c = 2 * k2, 2 * (p2 - 1) / p2 * m, (p2 - 1) / p2 * m
        return (a + 2, b + 2 * m, c + m) if folded else (a, b, c)
    if key == ("all_reduce", "tree"):
        return 2 * _lg(p), 2 * _lg(p) * m, _lg(p) * m
    # direct: every message of a round is in flight at once, so latencies overlap: one alpha per round
    if key == ("all_reduce", "direct"):
        return 2, 2 * (p - 1) / p * m, (p - 1) / p * m
    if key == ("all_gather", "direct"):
        return 1, (p - 1) / p * m, 0.0
    if key == ("reduce_scatter", "direct"):
        return 1, (p - 1) / p * m, (p - 1) / p * m
    if key == ("all_gather", "ring"):
        return p - 1, (p - 1) / p * m, 0.0
    if key == ("all_gather", "recursive_doubling"):
        a, b = k2, (p2 - 1) / p2 * m
        return (a + 2, b + m / p + m, 0.0) if folded else (a, b, 0.0)
    if key == ("all_gather", "bruck"):
        return _lg(p), (p - 1) / p * m, 0.0
    if key in (("reduce_scatter", "ring"), ("reduce_scatter", "pairwise")):
        return p - 1, (p - 1) / p * m, (p - 1) / p * m
    if key == ("reduce_scatter", "recursive_halving"):
        a, b, c = k2, (p2 - 1) / p2 * m, (p2 - 1) / p2 * m
        return (a + 2, b + m + m / p, c + m) if folded else (a, b, c)
    # all_to_all: every piece but one's own leaves once, (p-1)/p of the send buffer; nothing is reduced
    if key == ("all_to_all", "pairwise"):
        return p - 1, (p - 1) / p * m, 0.0
    if key == ("all_to_all", "direct"):
        return 1, (p - 1) / p * m, 0.0
    if key == ("broadcast", "binomial"):
        return _lg(p), _lg(p) * m, 0.0
    if key == ("broadcast", "scatter_allgather"):
        return _lg(p) + p - 1, 2 * (p - 1) / p * m, 0.0
    raise ValueError(f"CostModel: no formula for collective {collective!r} with algorithm {algorithm!r}; "
                     f"known: {', '.join(f'{c}/{a}' for c in ALGORITHMS for a in ALGORITHMS[c])} and builtin")


@dataclasses.dataclass
class CostModel:
    """alpha (s per message), beta (s per byte), gamma (s per reduced byte), plus measured curves
    `measured[(collective, algorithm, world_size)] = [(nbytes, seconds), ...]` ("builtin" included).

    The defaults describe a loopback gloo on a CPU box roughly; `calibrate` replaces them with measurements.
    """

    alpha: float = 50e-6
    beta: float = 1.0e-9
    gamma: float = 0.3e-9
    measured: dict[tuple[str, str, int], list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    calibrated: bool = False
    version: int = 0  # bumped by every fit, so cached decisions know they are stale

    def predict(self, collective: str, algorithm: str, nbytes: float, world_size: int) -> float:
        """Predicted seconds for one `collective` of `nbytes` (nccl-tests bytes) on `world_size` ranks."""
        if collective not in COLLECTIVES:
            raise ValueError(f"CostModel.predict: unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
        if world_size < 1 or nbytes < 0:
            raise ValueError(f"CostModel.predict: need world_size >= 1 and nbytes >= 0, got {world_size}, {nbytes}")
        if world_size == 1:
            return 0.0
        curve = self.measured.get((collective, algorithm, world_size))
        if curve is not None and len(curve) >= 2:
            return _interpolate(curve, float(nbytes))
        return self.formula(collective, algorithm, nbytes, world_size)

    def formula(self, collective: str, algorithm: str, nbytes: float, world_size: int) -> float:
        """The alpha-beta-gamma prediction alone (what `predict` falls back on without measurements)."""
        if world_size <= 1:
            return 0.0
        ka, kb, kc = coefficients(collective, algorithm, nbytes, world_size)
        extra = 0.0
        if algorithm == BUILTIN and collective == "reduce_scatter":
            extra = (world_size - 1) / world_size * nbytes * self.gamma  # the all-reduce's copy out
        return ka * self.alpha + kb * self.beta + kc * self.gamma + extra

    def fit(self, samples: Sequence[tuple[str, str, float, int, float]]) -> "CostModel":
        """Fit alpha, beta, gamma from the non-builtin samples (relative least squares, non-negative) and keep
        every (collective, algorithm, world size) measured at two or more sizes as its curve. Samples are
        `(collective, algorithm, nbytes, world_size, seconds)`."""
        ours = [s for s in samples if s[1] != BUILTIN]
        if ours:
            rows = [[c / t for c in coefficients(col, alg, nb, p)] for col, alg, nb, p, t in ours]
            self.alpha, self.beta, self.gamma = _nonneg_lstsq(rows, [1.0] * len(rows))
        groups: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
        for col, alg, nb, p, t in samples:
            groups.setdefault((col, alg, p), []).append((nb, t))
        for key, points in groups.items():
            if len({nb for nb, _ in points}) >= 2:
                self.measured[key] = sorted(points)
        self.calibrated = True
        self.version += 1
        return self

    def calibrate(self, comm: Communicator, sizes: Sequence[int] = (16 << 10, 256 << 10, 2 << 20, 16 << 20),
                  collectives: Sequence[str] = COLLECTIVES, iters: int = 3,
                  budget_s: float = 8.0) -> "CostModel":
        """Time every algorithm and the builtin of `collectives` at `sizes` on `comm`, then `fit`.

        Calls alternate (`timing.interleaved_times`, at least `iters` rounds, about `budget_s` seconds in
        all). Collective over `comm`: every rank calls it. Each rank's medians are combined with a MAX all-reduce,
        so every rank fits the same model and later picks the same algorithm (a must: ranks that pick
        different algorithms deadlock).
        """
        base = getattr(comm, "base", comm)
        p = base.world_size
        if p == 1:
            self.calibrated = True
            return self
        plan = [(col, alg) for col in collectives for alg in [BUILTIN, *ALGORITHMS[col]]]
        samples = []
        for nbytes in sizes:
            numel = _numel(nbytes, p)
            inputs = {col: torch.ones(numel // p if col == "all_gather" else numel, dtype=torch.float32)
                      for col in collectives}  # float32: the bytes below count 4 per element
            calls = [lambda col=col, alg=alg: _call(base, col, alg, inputs[col]) for col, alg in plan]
            times = interleaved_times(base, calls, budget_s / len(sizes), min_rounds=iters)
            medians = slowest_rank_medians(base, times)
            samples += [(col, alg, float(numel * 4), p, t) for (col, alg), t in zip(plan, medians)]
        self.samples = samples
        return self.fit(samples)

    def to_dict(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta, "gamma": self.gamma, "calibrated": self.calibrated,
                "measured": {f"{c}/{a}@{p}": [list(x) for x in v] for (c, a, p), v in self.measured.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        """The inverse of `to_dict` (for a model calibrated once and saved)."""
        model = cls(alpha=data["alpha"], beta=data["beta"], gamma=data["gamma"], calibrated=data["calibrated"])
        for key, curve in data.get("measured", {}).items():
            name, p = key.rsplit("@", 1)
            col, alg = name.split("/")
            model.measured[(col, alg, int(p))] = [(float(b), float(t)) for b, t in curve]
        return model


def _interpolate(curve: list[tuple[float, float]], nbytes: float) -> float:
    """Linear in bytes between the measured sizes around `nbytes`; the first time below the first size
    (latency does not shrink), the last segment's (non-negative) slope beyond the last."""
    if nbytes <= curve[0][0]:
        return curve[0][1]
    for (b0, t0), (b1, t1) in zip(curve, curve[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = curve[-2], curve[-1]
    return t1 + max(0.0, (t1 - t0) / (b1 - b0)) * (nbytes - b1)


def _numel(nbytes: int, p: int) -> int:
    """float32 elements of a collective of about `nbytes` (nccl-tests bytes), divisible by `p`."""
    numel = max(p, nbytes // 4)
    return numel - numel % p


def _call(comm: Communicator, collective: str, algorithm: str, x: torch.Tensor):
    """One call of `collective` with `algorithm` on float32 `x` (SUM, dim 0, root 0; all_to_all even pieces of
    dim 0)."""
    if collective == "all_to_all":
        if algorithm == BUILTIN:
            return comm.all_to_all(x, 0, 0)
        sizes = split_sizes(x.shape[0], comm.world_size)
        return ALGORITHMS[collective][algorithm](comm, x, 0, 0, sizes, [sizes[comm.rank]] * comm.world_size)
    if algorithm != BUILTIN:
        fn = ALGORITHMS[collective][algorithm]
        if collective in ("all_reduce", "reduce_scatter"):
            return fn(comm, x, ReduceOp.SUM) if collective == "all_reduce" else fn(comm, x, ReduceOp.SUM, 0, None)
        return fn(comm, x, 0) if collective == "broadcast" else fn(comm, x, 0, None)
    if collective == "all_reduce":
        return comm.all_reduce(x)
    if collective == "all_gather":
        return comm.all_gather(x)
    if collective == "reduce_scatter":
        return comm.reduce_scatter(x)
    return comm.broadcast(x, 0)


def _nonneg_lstsq(rows: list[list[float]], rhs: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (drop the negative ones and refit; at most a few rounds)."""
    k = len(rows[0])
    active = [j for j in range(k) if any(r[j] for r in rows)]
    while True:
        if not active:
            return [0.0] * k
        a = torch.tensor([[r[j] for j in active] for r in rows], dtype=torch.float64)
        b = torch.tensor(rhs, dtype=torch.float64).unsqueeze(1)
        sol = torch.linalg.lstsq(a, b, driver="gelsd").solution.squeeze(1).tolist()
        negative = [j for j, v in zip(active, sol) if v < 0]
        if not negative:
            out = [0.0] * k
            for j, v in zip(active, sol):
                out[j] = v
            return out
        active = [j for j in active if j not in negative]
