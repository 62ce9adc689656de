"""`SplitLogits`: this rank's vocabulary slice of a model's logits, which reads as the full logits.

In training mode a tensor-parallel LM head keeps its logits split over the vocabulary, and the model computes its
loss from that slice (`vocab_parallel_cross_entropy`: two small all-reduces, never a batch x sequence x vocabulary
tensor). What the model *returns* as `outputs.logits` is read by code that knows nothing of that: a user's own
cross-entropy, perplexity or `argmax` accuracy, `generate`, a Trainer's `compute_metrics`, TRL's metrics. On the
bare slice every one of them is silently wrong (half the vocabulary; local indices). So the model returns its slice
wrapped in this class, which behaves as the full tensor:

- its `shape` / `size()` / `numel()` are the full logits';
- operations that leave the vocabulary dimension alone stay on the slice, lazily: indexing the leading dims
  (`logits[:, :-1]`), `reshape` / `view` keeping the vocabulary last, `float()` / `to(dtype)`, `detach`, `clone`,
  `contiguous`. `vocab_parallel_cross_entropy` takes such a tensor and computes on its slice, as before;
- any other operation gathers the full logits once (an all-gather over the head's ranks, `gather_from_region`:
  its backward keeps this rank's slice of the gradient, so a loss computed on the gathered logits trains exactly)
  and runs on them; the gathered tensor is kept for the next operation.

The gather is collective: every rank of the head's group reads the logits the same way, as every rank ran the
forward. A read on one rank only waits for the others until the communicator's timeout (`CommError`). Under
`torch.compile` the model returns the bare slice (a compiled graph cannot return this class); read full logits
there with `tpkit.nn.gather_logits`.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_map

from ..comm.communicator import Communicator
from .mappings import gather_from_region

# Operations that keep the vocabulary dimension untouched when it stays last (checked per call below).
_ALIASING = {torch.Tensor.detach, torch.Tensor.clone, torch.Tensor.contiguous, torch.Tensor.float,
             torch.Tensor.double, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.requires_grad_,
             torch.detach, torch.clone}
_RESHAPES = {torch.Tensor.reshape, torch.Tensor.view, torch.reshape}
_PASSIVE = {torch.Tensor.dim, torch.Tensor.ndimension, torch.Tensor.is_floating_point, torch.Tensor.element_size,
            torch.Tensor.get_device, torch.Tensor.__len__}
# Attributes read through their descriptor's `__get__` (a new bound object at each read: known by name).
_PASSIVE_ATTRIBUTES = {"dtype", "device", "requires_grad", "grad_fn", "is_leaf", "ndim", "layout", "is_cuda",
                       "is_meta", "is_sparse", "is_quantized"}


class SplitLogits(torch.Tensor):
    """A rank's slice of logits split along the last dim over `comm` (`sizes`: every rank's width), which reads as
    the full logits (see the module docstring)."""

    comm: Communicator
    sizes: tuple[int, ...]
    _full: torch.Tensor | None

    @staticmethod
    def wrap(local: torch.Tensor, comm: Communicator, sizes: Sequence[int]) -> "SplitLogits":
        """`local` (this rank's slice, still in the autograd graph) read as the full logits."""
        with torch._C.DisableTorchFunctionSubclass():
            out = local.as_subclass(SplitLogits)
        out.comm, out.sizes, out._full = comm, tuple(int(s) for s in sizes), None
        out._local = local
        return out

    @property
    def vocab_start(self) -> int:
        return sum(self.sizes[:self.comm.rank])

    @property
    def vocab_size(self) -> int:
        return sum(self.sizes)

    def local(self) -> torch.Tensor:
        """This rank's slice as a plain tensor (of the gathered logits once they were gathered: an in-place change
        made to them shows)."""
        if self._full is not None:
            return self._full.narrow(-1, self.vocab_start, self.sizes[self.comm.rank])
        return self._local

    def full(self) -> torch.Tensor:
        """The full logits as a plain tensor (gathered once: collective)."""
        if self._full is None:
            self._full = gather_from_region(self._local, self.comm, -1, self.sizes)
        return self._full

    def _full_shape(self) -> torch.Size:
        return torch.Size((*self._local.shape[:-1], self.vocab_size))

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105 - the full values, as a plain tensor prints
        return f"SplitLogits({self.full()!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = next((a for a in (*args, *kwargs.values()) if isinstance(a, SplitLogits)), None)
        with torch._C.DisableTorchFunctionSubclass():
            if me is not None and me._full is None:
                lazy = _lazy(me, func, args, kwargs)
                if lazy is not None:
                    return lazy
            plain = tree_map(lambda a: a.full() if isinstance(a, SplitLogits) else a, (args, kwargs))
            return func(*plain[0], **plain[1])


def _lazy(me: SplitLogits, func, args: tuple, kwargs: dict) -> Any:
    """The result of `func` computed on `me`'s slice when `func` leaves the vocabulary dim alone (wrapped again, or a
    plain answer about the shape), else None."""
    if func in (torch.Tensor.size,) and args[0] is me:
        shape = me._full_shape()
        return shape if len(args) == 1 and not kwargs else shape[args[1] if len(args) > 1 else kwargs["dim"]]
    attribute = _attribute(func)
    if attribute == "shape":
        return me._full_shape()
    if func is torch.Tensor.numel:
        return me._full_shape().numel()
    if func in _PASSIVE or attribute in _PASSIVE_ATTRIBUTES:
        return func(me._local, *args[1:], **kwargs)
    if args and args[0] is not me or any(isinstance(a, SplitLogits) for a in (*args[1:], *kwargs.values())):
        return None
    rest = args[1:]
    if func in _ALIASING:
        return SplitLogits.wrap(func(me._local, *rest, **kwargs), me.comm, me.sizes)
    if func is torch.Tensor.to and _only_dtype(rest, kwargs):
        return SplitLogits.wrap(func(me._local, *rest, **kwargs), me.comm, me.sizes)
    if func in _RESHAPES:  # the vocabulary stays the last dim: the leading dims flatten the same on the slice
        shape = _shape_arg(rest, kwargs)
        if shape is None or not shape or shape[-1] != me.vocab_size:
            return None
        local = func(me._local, (*shape[:-1], me._local.shape[-1]))
        return SplitLogits.wrap(local, me.comm, me.sizes)
    if func is torch.Tensor.__getitem__ and not kwargs and _leaves_last_dim(rest[0], me._local.dim()):
        return SplitLogits.wrap(me._local[rest[0]], me.comm, me.sizes)
    return None


def _attribute(func) -> str | None:
    """The name of the tensor attribute `func` reads (the `__get__` of its descriptor), else None."""
    owner = getattr(func, "__self__", None)
    return getattr(owner, "__name__", None) if type(owner).__name__ == "getset_descriptor" else None


def _only_dtype(args: tuple, kwargs: dict) -> bool:
    """`.to(dtype)` / `.to(dtype=...)`: a change of dtype only (a device move gathers first)."""
    if set(kwargs) - {"dtype", "copy", "non_blocking"}:
        return False
    return (len(args) == 1 and isinstance(args[0], torch.dtype)) or (not args and "dtype" in kwargs)


def _shape_arg(args: tuple, kwargs: dict) -> tuple | None:
    shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    if "shape" in kwargs:
        shape = kwargs["shape"]
    if not all(isinstance(s, int) for s in shape):
        return None
    return tuple(shape)


def _leaves_last_dim(index: Any, dims: int) -> bool:
    """An index that selects along leading dims only: ints, slices, Ellipsis in front, and the last dim either
    untouched or a full `:`."""
    items = index if isinstance(index, tuple) else (index,)
    if any(i is None or isinstance(i, (bool, torch.Tensor)) or not isinstance(i, (int, slice, type(Ellipsis)))
           for i in items):
        return False
    if Ellipsis in items:  # what follows it indexes the trailing dims, the last one last
        after = items[items.index(Ellipsis) + 1:]
        return not after or after[-1] == slice(None)
    return len(items) < dims or (len(items) == dims and items[-1] == slice(None))


def gather_logits(logits: torch.Tensor, comm: Communicator | None = None,
                  sizes: Sequence[int] | None = None) -> torch.Tensor:
    """The full logits (a plain tensor): of a `SplitLogits` its gathered values; of a bare vocabulary slice (a
    compiled model's) the all-gather over `comm` (`sizes`: every rank's width); a full tensor as it is."""
    if isinstance(logits, SplitLogits):
        return logits.full()
    if comm is None or comm.world_size == 1:
        return logits
    return gather_from_region(logits, comm, -1, sizes)


def local_logits(logits: torch.Tensor) -> torch.Tensor:
    """This rank's slice as a plain tensor: of a `SplitLogits` its slice, of anything else itself."""
    return logits.local() if isinstance(logits, SplitLogits) else logits
