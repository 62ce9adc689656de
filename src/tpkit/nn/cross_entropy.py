"""Cross-entropy on vocabulary-parallel logits, without ever gathering the full logits.

Each rank holds `logits[..., start:end]` (a column-parallel LM head's output). The loss needs only three
numbers per token from the whole vocabulary: the max logit (for a stable softmax), the sum of exponentials
and the target's logit (plus the sum of logits for label smoothing). Those cross the wire, in two all-reduces
(a MAX, then one SUM of the stacked statistics), instead of `tokens x vocab` floats. All math is fp32 (fp64
for fp64 logits) whatever the logits' dtype; the backward needs no communication at all (softmax minus the
smoothed one-hot, locally).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..comm import traceable
from ..comm.communicator import Communicator
from ..comm.debug import debug_enabled
from ..comm.ops import ReduceOp
from ..layout import split_sizes
from ._layer import resolve_comm
from .split_logits import local_logits

_NAME = "vocab_parallel_cross_entropy"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, comm, vocab_start, vocab_size, ignore_index, label_smoothing):
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        global_max = traceable.all_reduce(x.max(dim=-1).values, comm, ReduceOp.MAX)
        x = x - global_max.unsqueeze(-1)
        valid = target != ignore_index
        local_target = target - vocab_start
        mine = valid & (local_target >= 0) & (local_target < x.shape[-1])
        index = local_target.masked_fill(~mine, 0).unsqueeze(-1)
        target_logit = x.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0)
        exp = x.exp()
        stats = [target_logit, exp.sum(dim=-1)]
        if label_smoothing > 0:
            stats.append(x.sum(dim=-1))
        stats = traceable.all_reduce_(torch.stack(stats), comm)  # our own temporary: in place
        log_z = stats[1].log()
        loss = log_z - stats[0]
        if label_smoothing > 0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - stats[2] / vocab_size)
        loss = loss.masked_fill(~valid, 0.0)
        softmax = exp.div_(stats[1].unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine, valid)
        ctx.label_smoothing, ctx.vocab_size, ctx.logits_dtype = label_smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, mine, valid = ctx.saved_tensors
        # Out of place: the saved softmax must survive for a second backward (retain_graph=True).
        grad = softmax.scatter_add(-1, index, -(1.0 - ctx.label_smoothing) * mine.unsqueeze(-1).to(softmax.dtype))
        if ctx.label_smoothing > 0:
            grad.sub_(ctx.label_smoothing / ctx.vocab_size)
        grad.mul_((grad_loss.to(grad.dtype) * valid).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None


def _vocab_range(logits: torch.Tensor, comm: Communicator, vocab_size: int | None,
                 partition_sizes: Sequence[int] | None) -> tuple[int, int]:
    """(start of this rank's vocabulary slice, full vocabulary size)."""
    local = logits.shape[-1]
    if partition_sizes is not None:
        sizes = [int(s) for s in partition_sizes]
        if len(sizes) != comm.world_size:
            raise ValueError(f"{_NAME}: partition_sizes {sizes} must have one entry per rank ({comm.world_size})")
    elif vocab_size is not None:
        sizes = split_sizes(int(vocab_size), comm.world_size)
    elif comm.world_size == 1:
        sizes = [local]
    else:
        mine = torch.tensor([local], dtype=torch.int64, device=logits.device)
        sizes = [int(s) for s in comm.all_gather(mine).tolist()]
    if sizes[comm.rank] != local:
        raise ValueError(f"{_NAME}: this rank (rank {comm.rank}) holds {local} logits per token, but the vocabulary "
                         f"split {sizes} gives it {sizes[comm.rank]}; pass the vocab_size / partition_sizes the "
                         f"LM head was split with")
    return sum(sizes[:comm.rank]), sum(sizes)


def _check_target(target: torch.Tensor, full: int, ignore_index: int) -> None:
    """Target ids in range (or ignore_index): a device-side assertion, no host sync, compiled graphs too; under
    TP_DEBUG=1 (eager) first say which ids are wrong."""
    valid = target != ignore_index
    if not torch.compiler.is_compiling() and debug_enabled():
        real = target[valid]
        bad = real[(real < 0) | (real >= full)]
        if bad.numel():
            values = bad.unique().tolist()
            raise IndexError(f"{_NAME}: target ids must be in 0..{full - 1} (vocabulary size) or ignore_index "
                             f"{ignore_index}; got {values[:10]}{' ...' if len(values) > 10 else ''}")
    torch._assert_async((~valid | ((target >= 0) & (target < full))).all(),
                        f"{_NAME}: target ids must be in 0..{full - 1} (vocabulary size) or ignore_index "
                        f"{ignore_index}; set TP_DEBUG=1 to see which were not")


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, reduction: str = "mean",
                                 comm: Communicator | None = None, *, vocab_size: int | None = None,
                                 partition_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """`F.cross_entropy(full_logits, target, ...)` from this rank's vocabulary slice of the logits.

    `logits`: `[..., vocab_local]` (classes in the LAST dim), `target`: `[...]` of global class ids. The split
    is `vocab_size` cut by the split rule, or explicit per-rank `partition_sizes`; with neither, the ranks
    exchange their slice sizes (one extra tiny all-gather per call). The loss is fp32 (fp64 for fp64 logits):
    per token for `reduction="none"` (0 where `target == ignore_index`), else the sum, or the mean over
    non-ignored tokens.
    Collective: every rank of the group calls it with the same `target`.
    """
    comm = resolve_comm(comm)
    logits = local_logits(logits)  # a model's `outputs.logits` (SplitLogits): its slice, never gathered
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError(f"{_NAME}: logits must be a floating tensor with classes in the last dim")
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex():
        raise TypeError(f"{_NAME}: target must be an integer tensor of class ids (probability targets are not "
                        f"supported)")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{_NAME}: target of shape {tuple(target.shape)} must match logits of shape "
                         f"{tuple(logits.shape)} without its last (class) dim, i.e. {tuple(logits.shape[:-1])}")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{_NAME}: reduction {reduction!r} must be 'none', 'mean' or 'sum'")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{_NAME}: label_smoothing {label_smoothing} must be in [0, 1]")
    start, full = _vocab_range(logits, comm, vocab_size, partition_sizes)
    _check_target(target, full, ignore_index)
    loss = _VocabParallelCrossEntropy.apply(logits, target, comm, start, full, ignore_index, float(label_smoothing))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


@torch.no_grad()
def vocab_parallel_statistics(logits: torch.Tensor, target: torch.Tensor, comm: Communicator | None = None, *,
                              vocab_size: int | None = None,
                              partition_sizes: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(entropy, is_top1)` per token of the softmax over the full vocabulary, from this rank's slice of the logits
    (classes in the last dim): the entropy `log Z - E[x]`, and whether `target` (global ids) is the first maximum,
    as `argmax` of the full logits would say. Computed in the logits' dtype promoted to fp32, no gradient; two
    all-reduces (a MAX of three statistics, a SUM of two). Collective, like `vocab_parallel_cross_entropy`."""
    comm = resolve_comm(comm)
    x = local_logits(logits)
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    start, _ = _vocab_range(x, comm, vocab_size, partition_sizes)
    local = target - start
    mine = (local >= 0) & (local < x.shape[-1])
    target_x = x.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    before = torch.arange(x.shape[-1], device=x.device) < local.unsqueeze(-1)
    peaks = torch.stack((x.amax(-1), target_x.masked_fill(~mine, -torch.inf),
                         x.masked_fill(~before, -torch.inf).amax(-1)))
    peaks = comm.all_reduce(peaks, ReduceOp.MAX) if comm.world_size > 1 else peaks
    top, target_top, before_top = peaks
    e = (x - top.unsqueeze(-1)).exp()
    sums = torch.stack((e.sum(-1), (e * x).sum(-1)))
    sums = comm.all_reduce(sums) if comm.world_size > 1 else sums
    entropy = top + sums[0].log() - sums[1] / sums[0]
    return entropy, (target_top >= top) & (target_top > before_top)
