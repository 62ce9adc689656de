"""`AlgorithmCommunicator`: run each collective with a chosen algorithm instead of the backend's own.

Why a wrapper: layers call `comm.all_reduce(...)` and should not know which algorithm runs. The choice is
`algorithm="auto"` (ask an `AlgorithmSelector`), `"builtin"`, one algorithm name (used by every collective
that has it, builtin for the rest), or a dict `{collective: name}`. Calls an algorithm cannot serve go to
the builtin and say why in `last_algorithm` / `last_note` (the profiler records both): `async_op=True`
(the algorithms run synchronously; the builtin overlaps), bool tensors, tensors not on the backend's device
(the builtin path stages them), and world size 1. Algorithms talk to the backend communicator under all
wrappers (`base`) directly.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from .algorithms import ALGORITHMS, COLLECTIVES
from .communicator import Communicator
from .cost_model import BUILTIN
from .ops import ReduceOp
from .selector import AlgorithmSelector
from .sharding import split_sizes
from .wrapper import WrappedCommunicator


def _resolve(algorithm: "str | Mapping[str, str]") -> dict[str, str]:
    """{collective: "auto" | "builtin" | name} from the user's option; unknown names raise here."""
    if isinstance(algorithm, Mapping):
        bad = [c for c in algorithm if c not in COLLECTIVES]
        if bad:
            raise ValueError(f"AlgorithmCommunicator: unknown collectives {bad} in algorithm=; valid: {', '.join(COLLECTIVES)}")
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


class AlgorithmCommunicator(WrappedCommunicator):
    """A Communicator whose collectives run the algorithm `algorithm` names (see module docstring)."""

    def __init__(self, inner: Communicator, algorithm: "str | Mapping[str, str]" = "auto",
                 selector: AlgorithmSelector | None = None):
        super().__init__(inner)
        self.algorithm = algorithm
        self.choices = _resolve(algorithm)
        self.selector = selector if selector is not None else AlgorithmSelector()
        self.last_algorithm = BUILTIN
        self.last_note = ""
        self._device_type = "cuda" if getattr(self.base, "torch_backend", None) == "nccl" else "cpu"

    def _rewrap(self, group: Communicator) -> Communicator:
        return AlgorithmCommunicator(group, self.algorithm, self.selector)

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
        if tensor.device.type != self._device_type:
            return BUILTIN, f"{tensor.device.type} tensor on a {self._device_type} backend: builtin stages it"
        if wanted == "auto":
            return self.selector.select(collective, nbytes, self.world_size, tensor.element_size()), ""
        return wanted, ""

    def _pick(self, collective: str, tensor: torch.Tensor, nbytes: int, async_op: bool) -> str:
        self.last_algorithm, self.last_note = self.choose(collective, tensor, nbytes, async_op)
        return self.last_algorithm

    # Builtin calls go straight to `inner` (which validates); the checks here guard the algorithm paths.
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False):
        self._check_tensor("all_reduce", tensor)
        name = self._pick("all_reduce", tensor, tensor.numel() * tensor.element_size(), async_op)
        if name == BUILTIN:
            return self.inner.all_reduce(tensor, op=op, async_op=async_op)
        op = ReduceOp.parse(op)
        with self._guard("all_reduce"):
            return ALGORITHMS["all_reduce"][name](self.base, tensor, op)

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
            return self.inner.all_gather(tensor, dim=dim, sizes=sizes, async_op=async_op)
        with self._guard("all_gather"):
            return ALGORITHMS["all_gather"][name](self.base, tensor, dim, sizes)

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, dim: int = 0,
                       sizes: Sequence[int] | None = None, async_op: bool = False):
        self._check_tensor("reduce_scatter", tensor)
        name = self._pick("reduce_scatter", tensor, tensor.numel() * tensor.element_size(), async_op)
        if name == BUILTIN or tensor.numel() == 0:
            return self.inner.reduce_scatter(tensor, op=op, dim=dim, sizes=sizes, async_op=async_op)
        op = ReduceOp.parse(op)
        dim = self._check_dim("reduce_scatter", tensor, dim)
        if sizes is None:
            sizes = split_sizes(tensor.shape[dim], self.world_size)
        else:
            sizes = [int(s) for s in sizes]
            if len(sizes) != self.world_size or sum(sizes) != tensor.shape[dim] or min(sizes) < 0:
                raise ValueError(
                    f"reduce_scatter: sizes {sizes} must have {self.world_size} non-negative entries summing to "
                    f"the size of dim {dim} ({tensor.shape[dim]}) of the input of shape {tuple(tensor.shape)}")
        with self._guard("reduce_scatter"):
            return ALGORITHMS["reduce_scatter"][name](self.base, tensor, op, dim, sizes)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        self._check_tensor("broadcast", tensor)
        name = self._pick("broadcast", tensor, tensor.numel() * tensor.element_size(), async_op)
        if name == BUILTIN:
            return self.inner.broadcast(tensor, src=src, async_op=async_op)
        self._check_rank("broadcast", src, "src")
        with self._guard("broadcast"):
            return ALGORITHMS["broadcast"][name](self.base, tensor, src)
