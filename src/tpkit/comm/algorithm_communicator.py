"""`AlgorithmCommunicator`: run each collective with a chosen algorithm instead of the backend's own.

Why a wrapper: layers call `comm.all_reduce(...)` and should not know which algorithm runs. The choice is
`algorithm="auto"` (ask an `AlgorithmSelector`), `"builtin"`, one algorithm name (used by every collective
that has it, builtin for the rest), or a dict `{collective: name}`. Calls an algorithm cannot serve go to
the builtin and say why in `last_algorithm` / `last_note` (the profiler records both): `async_op=True`
(the algorithms run synchronously; the builtin overlaps), bool tensors, tensors not on the backend's device
(the builtin path stages them), world size 1, and under `auto` an all_to_all within one dim (each rank knows
only its own sizes, so the ranks could not agree on a size to choose by). Algorithms talk to the backend
communicator under all wrappers (`base`) directly.

`auto` checks the selector: a prediction is only a prediction, and on a shared or unusual machine it can
be wrong by more than any algorithm wins. The first `2 * verify` calls of each (collective, size) alternate
the predicted algorithm and builtin and time them; then one tiny all-reduce agrees the slowest rank's
medians and every rank keeps the faster (the candidate only if `verify_margin` faster). From then on the
decision is a dictionary lookup.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Mapping, Sequence

import torch

from . import checks
from .algorithms import ALGORITHMS, COLLECTIVES
from .communicator import Communicator
from .cost_model import BUILTIN
from .ops import ReduceOp
from .selector import AlgorithmSelector
from .wrapper import WrappedCommunicator


def _resolve(algorithm: "str | Mapping[str, str]") -> dict[str, str]:
    """{collective: "auto" | "builtin" | name} from the user's option; unknown names raise here."""
    if isinstance(algorithm, Mapping):
        bad = [c for c in algorithm if c not in COLLECTIVES]
        if bad:
            raise ValueError(f"AlgorithmCommunicator: unknown collectives {bad} in algorithm=; "
                             f"valid: {', '.join(COLLECTIVES)}")
        chosen = {c: str(algorithm.get(c, BUILTIN)) for c in COLLECTIVES}
        for c, name in chosen.items():
            if name not in ("auto", BUILTIN, *ALGORITHMS[c]):
                raise ValueError(f"AlgorithmCommunicator: {c} has no algorithm {name!r}; valid: auto, builtin, "
                                 f"{', '.join(ALGORITHMS[c])}")
        return chosen
    name = str(algorithm)
    if name in ("auto", BUILTIN):
        return {c: name for c in COLLECTIVES}
    if not any(name in ALGORITHMS[c] for c in COLLECTIVES):
        known = sorted({a for c in COLLECTIVES for a in ALGORITHMS[c]})
        raise ValueError(f"AlgorithmCommunicator: unknown algorithm {name!r}; valid: auto, builtin, {', '.join(known)}")
    return {c: name if name in ALGORITHMS[c] else BUILTIN for c in COLLECTIVES}


@dataclasses.dataclass
class _Trial:
    """Timings of a predicted algorithm against builtin for one (collective, size), until decided."""

    candidate: str
    times: dict[str, list[float]]
    decision: str | None = None
    note: str = ""


class AlgorithmCommunicator(WrappedCommunicator):
    """A Communicator whose collectives run the algorithm `algorithm` names (see module docstring)."""

    def __init__(self, inner: Communicator, algorithm: "str | Mapping[str, str]" = "auto",
                 selector: AlgorithmSelector | None = None, verify: int = 8, verify_margin: float = 0.05):
        super().__init__(inner)
        if verify < 0 or not 0 <= verify_margin < 1:
            raise ValueError(f"AlgorithmCommunicator: need verify >= 0 and 0 <= verify_margin < 1, got {verify}, "
                             f"{verify_margin}")
        self.algorithm = algorithm
        self.choices = _resolve(algorithm)
        self.selector = selector if selector is not None else AlgorithmSelector()
        self.verify, self.verify_margin = int(verify), float(verify_margin)
        self.last_algorithm = BUILTIN
        self.last_note = ""
        self._trials: dict[tuple, _Trial] = {}
        self._trial: _Trial | None = None
        self._device_type = "cuda" if getattr(self.base, "torch_backend", None) == "nccl" else "cpu"
        self._on_cuda = self._device_type == "cuda"

    def _rewrap(self, group: Communicator) -> Communicator:
        return AlgorithmCommunicator(group, self.algorithm, self.selector, self.verify, self.verify_margin)

    def calibrate(self, **kwargs) -> "AlgorithmCommunicator":
        """Fit the selector's cost model on this group (collective: every rank calls it)."""
        self.selector.calibrate(self.base, **kwargs)
        return self

    def choose(self, collective: str, tensor: torch.Tensor, nbytes: int, async_op: bool) -> tuple[str, str]:
        """(algorithm, note): the algorithm this call runs and, if it fell back to builtin, why."""
        wanted = self.choices[collective]
        if wanted == BUILTIN or self.world_size == 1:
            return BUILTIN, ""
        if async_op:
            return BUILTIN, f"async_op: {wanted} runs synchronously, builtin overlaps"
        if tensor.dtype == torch.bool:
            return BUILTIN, f"{wanted} does not reduce bool tensors"
        if tensor.is_cuda != self._on_cuda:
            return BUILTIN, f"{tensor.device.type} tensor on a {self._device_type} backend: builtin stages it"
        if wanted == "auto":
            return self._auto(collective, nbytes, tensor.element_size())
        return wanted, ""

    def _auto(self, collective: str, nbytes: int, itemsize: int) -> tuple[str, str]:
        choice = self.selector.select(collective, nbytes, self.world_size, itemsize)
        if choice == BUILTIN or self.verify == 0:
            return choice, ""
        key = (collective, nbytes, itemsize, choice)
        trial = self._trials.get(key)
        if trial is None:
            if len(self._trials) > 4096:
                self._trials.clear()
            trial = self._trials[key] = _Trial(choice, {BUILTIN: [], choice: []})
        if trial.decision is not None:
            return trial.decision, trial.note
        self._trial = trial
        done = len(trial.times[BUILTIN]) + len(trial.times[choice])
        note = f"verifying {choice} against builtin ({done + 1}/{2 * self.verify})"
        return (BUILTIN if done % 2 == 0 else choice), note

    def _pick(self, collective: str, tensor: torch.Tensor, nbytes: int, async_op: bool) -> str:
        self._trial = None
        self.last_algorithm, self.last_note = self.choose(collective, tensor, nbytes, async_op)
        return self.last_algorithm

    def _run(self, call, tensor: torch.Tensor):
        """`call()`, timed when this call is one of a verification trial's."""
        trial = self._trial
        if trial is None:
            return call()
        self._trial = None
        sync = torch.cuda.synchronize if tensor.is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        out = call()
        sync()
        trial.times[self.last_algorithm].append(time.perf_counter() - start)
        if all(len(t) >= self.verify for t in trial.times.values()):
            self._decide(trial)
        return out

    def _decide(self, trial: _Trial) -> None:
        """Every rank agrees on the slowest rank's medians (one all-reduce) and keeps the faster."""
        medians = [statistics.median(trial.times[BUILTIN]), statistics.median(trial.times[trial.candidate])]
        device = torch.device("cuda", torch.cuda.current_device()) if self._device_type == "cuda" else None
        agreed = self.base.all_reduce(torch.tensor(medians, dtype=torch.float64, device=device), op=ReduceOp.MAX)
        builtin, candidate = agreed.tolist()
        ratio = builtin / candidate if candidate > 0 else float("inf")
        if candidate < builtin * (1 - self.verify_margin):
            trial.decision, trial.note = trial.candidate, f"verified: {ratio:.2f}x builtin"
        else:
            trial.decision = BUILTIN
            trial.note = f"predicted {trial.candidate} measured {ratio:.2f}x builtin: kept builtin"

    # Builtin calls go straight to `inner` (which validates); the checks here guard the algorithm paths.
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False):
        self._check_tensor("all_reduce", tensor)
        name = self._pick("all_reduce", tensor, tensor.numel() * tensor.element_size(), async_op)
        if name == BUILTIN:
            if self._trial is None:  # the common case: no timing, no closure
                return self.inner.all_reduce(tensor, op=op, async_op=async_op)
            return self._run(lambda: self.inner.all_reduce(tensor, op=op, async_op=async_op), tensor)
        op = ReduceOp.parse(op)
        with self._guard("all_reduce"):
            return self._run(lambda: ALGORITHMS["all_reduce"][name](self.base, tensor, op), tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None,
                   async_op: bool = False):
        self._check_tensor("all_gather", tensor)
        dim = self._check_dim("all_gather", tensor, dim)
        sizes = self._check_gather_sizes(tensor, dim, sizes)
        rows = tensor.shape[dim] * self.world_size if sizes is None else sum(sizes)
        row_bytes = tensor.element_size() * math.prod(s for d, s in enumerate(tensor.shape) if d != dim)
        # the same on every rank (shards differ only along dim), so every rank picks the same algorithm
        name = self._pick("all_gather", tensor, rows * row_bytes, async_op)
        if name == BUILTIN or row_bytes == 0:
            if self._trial is None:  # the common case: no timing, no closure
                return self.inner.all_gather(tensor, dim=dim, sizes=sizes, async_op=async_op)
            return self._run(lambda: self.inner.all_gather(tensor, dim=dim, sizes=sizes, async_op=async_op), tensor)
        with self._guard("all_gather"):
            return self._run(lambda: ALGORITHMS["all_gather"][name](self.base, tensor, dim, sizes), tensor)

    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int,
                   scatter_sizes: Sequence[int] | None = None, gather_sizes: Sequence[int] | None = None,
                   async_op: bool = False):
        self._check_tensor("all_to_all", tensor)
        sd, gd, ss, gs = checks.check_all_to_all(tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes,
                                                 self.world_size, self.rank)
        # Every rank must pick the same algorithm. With two dims every rank knows every rank's send buffer, and
        # `auto` decides on their mean; with one dim each rank knows only its own sizes: builtin, unless named.
        row = tensor.element_size() * math.prod(s for d, s in enumerate(tensor.shape) if d not in (sd, gd))
        nbytes = row * sum(ss) * sum(gs) // self.world_size if sd != gd else 0
        if sd == gd and self.choices["all_to_all"] == "auto":
            name, self._trial = BUILTIN, None
            self.last_algorithm, self.last_note = BUILTIN, "auto: one dim's sizes differ per rank, builtin"
        else:
            name = self._pick("all_to_all", tensor, nbytes, async_op)
        if name == BUILTIN:
            call = lambda: self.inner.all_to_all(tensor, sd, gd, ss, gs, async_op=async_op)  # noqa: E731
            return call() if self._trial is None else self._run(call, tensor)
        with self._guard("all_to_all"):
            return self._run(lambda: ALGORITHMS["all_to_all"][name](self.base, tensor, sd, gd, ss, gs), tensor)

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, dim: int = 0,
                       sizes: Sequence[int] | None = None, async_op: bool = False):
        self._check_tensor("reduce_scatter", tensor)
        name = self._pick("reduce_scatter", tensor, tensor.numel() * tensor.element_size(), async_op)
        if name == BUILTIN or tensor.numel() == 0:
            if self._trial is None:
                return self.inner.reduce_scatter(tensor, op=op, dim=dim, sizes=sizes, async_op=async_op)
            return self._run(lambda: self.inner.reduce_scatter(tensor, op=op, dim=dim, sizes=sizes, async_op=async_op),
                             tensor)
        op = ReduceOp.parse(op)
        dim = self._check_dim("reduce_scatter", tensor, dim)
        sizes = self._check_scatter_sizes(tensor, dim, sizes)
        with self._guard("reduce_scatter"):
            return self._run(lambda: ALGORITHMS["reduce_scatter"][name](self.base, tensor, op, dim, sizes), tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        self._check_tensor("broadcast", tensor)
        name = self._pick("broadcast", tensor, tensor.numel() * tensor.element_size(), async_op)
        if name == BUILTIN:
            if self._trial is None:  # the common case: no timing, no closure
                return self.inner.broadcast(tensor, src=src, async_op=async_op)
            return self._run(lambda: self.inner.broadcast(tensor, src=src, async_op=async_op), tensor)
        self._check_rank("broadcast", src, "src")
        with self._guard("broadcast"):
            return self._run(lambda: ALGORITHMS["broadcast"][name](self.base, tensor, src), tensor)
