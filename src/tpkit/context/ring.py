"""Ring attention: queries stay, K/V blocks travel round the cp group, softmax combined online.

Each rank keeps its queries (its two zigzag chunks, every head) and passes its K/V block to the next rank cp-1
times; at each step it attends to the block it holds with the CPU flash kernel
(`aten._scaled_dot_product_flash_attention_for_cpu`, which returns the log-sum-exp of each row) and merges the
result into its running output by the rows' log-sum-exps (the online softmax). Only two K/V blocks are held at a
time (the one attended to and the one arriving), never the whole sequence's.

The next block is posted before the current one is attended to (`PointToPoint.start`: on torch process groups
the transfer runs during the kernel). The backward is written out (a custom autograd Function): the K/V blocks go
round again, each followed by its gradient's accumulator; each rank adds its queries' share to the block it holds with the kernel's backward, run
with the FINAL output and log-sum-exp of its rows (exactly the one-process softmax), and after the last step
each accumulator takes one more hop home. Heads need not divide by cp, and K/V heads may be fewer than cp: nothing
is split by heads. Chunk pairs wholly in the future are skipped (zigzag: every rank computes the same number of
score entries); a diagonal pair is causal; with padding or packed documents each pair gets its own mask.

Point-to-point exchanges are not traceable by torch.compile: a compiled model graph-breaks around this function
(the all-to-all method compiles whole).
"""
from __future__ import annotations

import os

import torch

from ..comm.algorithms.point_to_point import PointToPoint
from ..comm.communicator import Communicator
from .batch import ContextBatch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
# The block kernel: torch's CPU flash kernel on CPU tensors; elsewhere (CUDA) the same block written in tensor ops
# (`_math`), whose backward takes the final log-sum-exp as the flash one does. TPKIT_RING_KERNEL=math forces it.
KERNEL_ENV = "TPKIT_RING_KERNEL"


def _use_flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and os.environ.get(KERNEL_ENV, "flash") != "math"


def _scores(q, k, causal: bool, mask, scale: float) -> torch.Tensor:
    s = torch.matmul(q.float() if q.dtype != torch.float64 else q, k.transpose(-1, -2).to(
        torch.float32 if q.dtype != torch.float64 else q.dtype)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s + mask.to(s.dtype) if mask is not None else s


def _math(q, k, v, causal: bool, mask, scale: float):
    """(output, log-sum-exp) of one block: the flash kernel's results, in tensor ops."""
    s = _scores(q, k, causal, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), v), lse


def _math_backward(grad_out, q, k, v, out, lse, causal: bool, mask, scale: float):
    """(dq, dk, dv) of one block, given the rows' FINAL output and log-sum-exp (as the flash backward takes them)."""
    p = torch.exp(_scores(q, k, causal, mask, scale) - lse[..., None].to(torch.float32 if q.dtype != torch.float64
                                                                           else q.dtype))
    work = p.dtype
    dv = torch.matmul(p.transpose(-1, -2), grad_out.to(work))
    dp = torch.matmul(grad_out.to(work), v.transpose(-1, -2).to(work))
    ds = p * (dp - (grad_out.to(work) * out.to(work)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.to(work)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(work)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _block(q, k, v, causal: bool, mask, scale: float):
    if _use_flash(q):
        return _flash(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return _math(q, k, v, causal, mask, scale)


def _block_backward(grad_out, q, k, v, out, lse, causal: bool, mask, scale: float):
    if _use_flash(q):
        return _flash_backward(grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    return _math_backward(grad_out, q, k, v, out, lse, causal, mask, scale)


def _pairs(batch: ContextBatch, holder: int, window: int | None):
    """(query half, key half, kind, query chunk, key chunk) for this rank's queries against the block of rank
    `holder`: kind is 'causal' (the diagonal), 'full' (wholly in the past) or 'masked' (padding, documents, a
    sliding window); pairs in the future are left out."""
    split, masked = batch.split, batch.masked or window is not None
    mine, theirs = split.chunk_ids(batch.rank), split.chunk_ids(holder)
    for qh, a in enumerate(mine):
        for kh, b in enumerate(theirs):
            if b > a:
                continue
            yield qh, kh, "masked" if masked else ("causal" if a == b else "full"), a, b


def _mask(batch: ContextBatch, a: int, b: int, window: int | None, dtype, device):
    """The additive mask of query chunk `a` against key chunk `b`, and which query rows see any key there (the
    kernel gives a row that sees none a log-sum-exp of 0, not -inf: the merge must not count it)."""
    c = batch.split.chunk
    q_pos = torch.arange(a * c, (a + 1) * c, device=device)
    k_pos = torch.arange(b * c, (b + 1) * c, device=device)
    ok = batch.allowed(q_pos, k_pos, window)
    return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill(~ok, float("-inf")), ok.any(-1)


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand`: each K/V head's query group summed."""
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(2)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: Communicator, batch: ContextBatch, scale: float, window: int | None):
        groups = q.shape[1] // k.shape[1]
        c = batch.split.chunk
        p2p, cp, rank = PointToPoint(comm), comm.world_size, comm.rank
        acc = torch.zeros(q.shape, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc.dtype, device=q.device)
        block = torch.stack([k, v]).contiguous()
        for step in range(cp):
            holder = (rank - step) % cp
            arriving = torch.empty_like(block) if step < cp - 1 else None
            # the next block travels while this one is attended to
            arrived = p2p.start(block, (rank + 1) % cp, arriving, (rank - 1) % cp) if arriving is not None else None
            kb, vb = _expand(block[0], groups), _expand(block[1], groups)
            for qh, kh, kind, a, b in _pairs(batch, holder, window):
                qs, ks = slice(qh * c, (qh + 1) * c), slice(kh * c, (kh + 1) * c)
                mask, seen = _mask(batch, a, b, window, q.dtype, q.device) if kind == "masked" else (None, None)
                o, l = _block(q[:, :, qs], kb[:, :, ks], vb[:, :, ks], kind == "causal", mask, scale)
                l = l.to(acc.dtype) if seen is None else l.to(acc.dtype).masked_fill(~seen, float("-inf"))
                new = torch.logaddexp(lse[:, :, qs], l)
                keep_old = torch.exp(lse[:, :, qs] - new).nan_to_num(0.0)
                take = torch.exp(l - new).nan_to_num(0.0)
                seen_part = torch.nan_to_num(o.to(acc.dtype)) * take[..., None]
                acc[:, :, qs] = acc[:, :, qs] * keep_old[..., None] + seen_part
                lse[:, :, qs] = new
            if arrived is not None:
                arrived()
                block = arriving
        out = acc.to(q.dtype)
        # a row that saw no key (all padding) keeps output 0; +inf makes its probabilities 0 in the backward too
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.batch, ctx.scale, ctx.window = comm, batch, scale, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, batch, scale, window = ctx.comm, ctx.batch, ctx.scale, ctx.window
        groups = q.shape[1] // k.shape[1]
        c = batch.split.chunk
        p2p, cp, rank = PointToPoint(comm), comm.world_size, comm.rank
        grad_out = grad_out.contiguous()
        lse = lse.to(torch.float32) if q.dtype != torch.float64 else lse
        dq = torch.zeros_like(q)
        block = torch.stack([k, v]).contiguous()
        dblock = torch.zeros_like(block)
        for step in range(cp):
            holder = (rank - step) % cp
            nxt, prev = (rank + 1) % cp, (rank - 1) % cp
            arriving = torch.empty_like(block) if step < cp - 1 else None
            arrived = p2p.start(block, nxt, arriving, prev) if arriving is not None else None  # K/V: during the work
            kb, vb = _expand(block[0], groups), _expand(block[1], groups)
            dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
            for qh, kh, kind, a, b in _pairs(batch, holder, window):
                qs, ks = slice(qh * c, (qh + 1) * c), slice(kh * c, (kh + 1) * c)
                mask = _mask(batch, a, b, window, q.dtype, q.device)[0] if kind == "masked" else None
                gq, gk, gv = _block_backward(grad_out[:, :, qs], q[:, :, qs], kb[:, :, ks], vb[:, :, ks],
                                             out[:, :, qs], lse[:, :, qs].contiguous(), kind == "causal", mask, scale)
                dq[:, :, qs] += gq
                dk[:, :, ks] += gk
                dv[:, :, ks] += gv
            dblock += torch.stack([_fold(dk, groups), _fold(dv, groups)])
            if arrived is not None:  # the block's gradient so far follows it (it was complete only now)
                arrived()
                block, moving = arriving, torch.empty_like(dblock)
                p2p.exchange(dblock, nxt, moving, prev)
                dblock = moving
            elif cp > 1:  # the last holder sends each gradient home
                home = torch.empty_like(dblock)
                p2p.exchange(dblock.contiguous(), nxt, home, prev)
                dblock = home
        return dq, dblock[0], dblock[1], None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, batch: ContextBatch,
                   scale: float, window: int | None = None) -> torch.Tensor:
    """Attention of this rank's queries [batch, heads, local, dim] over the whole sequence's keys, whose K/V
    [batch, kv heads, local, dim] every rank holds its zigzag tokens of; returns [batch, heads, local, dim]."""
    return _Ring.apply(q.contiguous(), k.contiguous(), v.contiguous(), comm, batch, scale, window)
