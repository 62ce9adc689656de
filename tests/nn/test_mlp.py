"""Whole blocks against their single-device twins: Column -> GELU -> Row MLP and a SwiGLU MLP, with and without
sequence parallelism (norms on sequence shards, their gradients summed in the backward), an embedding -> MLP -> LM head -> vocab-parallel
cross-entropy model, and three AdamW steps (with global-norm clipping) that leave every shard equal to the slice
of the single-device weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpkit
from tpkit.nn import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, clip_grad_norm_,
                      mark_sequence_parallel, sync_sequence_parallel_grads, vocab_parallel_cross_entropy)
from tpkit.nn.record import SplitsParameters

from .helpers import FP64_TOL, THREAD_SIZES, assert_small, local_slice, randn, rel_err, run, seeded_embedding, \
    seeded_linear

HIDDEN, FFN, VOCAB, BATCH, SEQ = 6, 10, 11, 2, 12  # 10 and 11 do not divide by 3 or 4; 12 tokens do


class Mlp(nn.Module):
    """norm -> up -> GELU -> down, or norm -> SwiGLU(gate, up) -> down."""

    def __init__(self, swiglu: bool, seed: int, dtype):
        super().__init__()
        self.swiglu = swiglu
        self.norm = nn.RMSNorm(HIDDEN, dtype=dtype) if swiglu else nn.LayerNorm(HIDDEN, dtype=dtype)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.1 * randn(HIDDEN, seed + 7, dtype))
        self.up = seeded_linear(HIDDEN, FFN, not swiglu, seed, dtype)
        self.gate = seeded_linear(HIDDEN, FFN, False, seed + 2, dtype) if swiglu else None
        self.down = seeded_linear(FFN, HIDDEN, not swiglu, seed + 4, dtype)

    def forward(self, x):
        h = self.norm(x)
        inner = F.silu(self.gate(h)) * self.up(h) if self.swiglu else F.gelu(self.up(h))
        return x + self.down(inner)


def parallelize_mlp(mlp: Mlp, sequence_parallel: bool) -> Mlp:
    """Swap the linears for their TP shards (a tiny stand-in for tpkit.parallelize)."""
    sp = dict(sequence_parallel=sequence_parallel)
    mlp.up = ColumnParallelLinear.from_module(mlp.up, **sp)
    if mlp.gate is not None:
        mlp.gate = ColumnParallelLinear.from_module(mlp.gate, **sp)
    mlp.down = RowParallelLinear.from_module(mlp.down, **sp)
    if sequence_parallel:
        mark_sequence_parallel(mlp.norm)  # its gradient summed over the ranks in every backward
    return mlp


def _full_view(name: str, tp: nn.Module, ref_param, rank: int) -> torch.Tensor:
    """The slice of the single-device tensor that `tp`'s parameter `name` should equal (its layer says which)."""
    owner, _, pname = name.rpartition(".")
    layer = tp.get_submodule(owner)
    if isinstance(layer, SplitsParameters) and pname in layer.split_dims():
        return local_slice(ref_param, layer.split_dims()[pname], layer.partition_sizes, rank)
    return ref_param


def _compare_params(tag: str, tp: nn.Module, ref: nn.Module, rank: int, grads: bool) -> dict:
    errors = {}
    ref_params = dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        want = ref_params[name].grad if grads else ref_params[name]
        errors[f"{tag} {'grad' if grads else 'param'} {name}"] = rel_err(p.grad if grads else p,
                                                                         _full_view(name, tp, want, rank))
    assert len(errors) == len(ref_params)
    return errors


def mlp_checks(dtype_name: str = "float64") -> dict:
    dtype = getattr(torch, dtype_name)
    comm = tpkit.get_communicator()
    r, n = comm.rank, comm.world_size
    seq_sizes = [SEQ // n] * n
    errors = {}
    for swiglu in (False, True):
        for sp in (False, True):
            tag = f"{'swiglu' if swiglu else 'gelu'} sp={sp}"
            ref, tp = Mlp(swiglu, 3, dtype), parallelize_mlp(Mlp(swiglu, 3, dtype), sp)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
            tp_opt = torch.optim.AdamW(tp.parameters(), lr=0.05, weight_decay=0.1)
            for step in range(3):
                x_full = randn((BATCH, SEQ, HIDDEN), 100 + step, dtype)
                gy_full = randn((BATCH, SEQ, HIDDEN), 200 + step, dtype)
                x_ref = x_full.clone().requires_grad_()
                y_ref = ref(x_ref)
                (y_ref * gy_full).sum().backward()
                x = (local_slice(x_full, 1, seq_sizes, r) if sp else x_full).clone().requires_grad_()
                y = tp(x)
                gy = local_slice(gy_full, 1, seq_sizes, r) if sp else gy_full
                (y * gy).sum().backward()  # under sp the norms' (and the row bias's) sums run in the backward
                if step == 0:
                    errors[f"{tag} out"] = rel_err(y, local_slice(y_ref, 1, seq_sizes, r) if sp else y_ref)
                    want_dx = local_slice(x_ref.grad, 1, seq_sizes, r) if sp else x_ref.grad
                    errors[f"{tag} dx"] = rel_err(x.grad, want_dx)
                    errors.update(_compare_params(tag, tp, ref, r, grads=True))
                norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
                norm_tp = clip_grad_norm_(tp.parameters(), 1.0)
                errors[f"{tag} step {step} grad norm"] = rel_err(norm_tp.double(), norm_ref.double())
                ref_opt.step(), tp_opt.step()
                ref_opt.zero_grad(), tp_opt.zero_grad()
            errors.update(_compare_params(f"{tag} after 3 AdamW steps", tp, ref, r, grads=False))
    return errors


def lm_checks(dtype_name: str = "float64") -> dict:
    """embedding -> MLP -> column-parallel LM head -> vocab-parallel cross-entropy == the single-device loss."""
    dtype = getattr(torch, dtype_name)
    comm = tpkit.get_communicator()
    r = comm.rank
    errors = {}
    for sp in (False, True):
        ref = nn.ModuleDict(dict(emb=seeded_embedding(VOCAB, HIDDEN, 5, dtype=dtype), mlp=Mlp(True, 9, dtype),
                                 head=seeded_linear(HIDDEN, VOCAB, False, 11, dtype)))
        tp = nn.ModuleDict(dict(
            emb=VocabParallelEmbedding.from_module(seeded_embedding(VOCAB, HIDDEN, 5, dtype=dtype),
                                                   sequence_parallel=sp),
            mlp=parallelize_mlp(Mlp(True, 9, dtype), sp),
            head=ColumnParallelLinear.from_module(seeded_linear(HIDDEN, VOCAB, False, 11, dtype),
                                                  sequence_parallel=sp)))
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
        target[0, :3] = -100
        loss_ref = F.cross_entropy(ref["head"](ref["mlp"](ref["emb"](ids))).flatten(0, 1), target.flatten(),
                                   label_smoothing=0.1)
        loss_ref.backward()
        logits = tp["head"](tp["mlp"](tp["emb"](ids)))
        loss = vocab_parallel_cross_entropy(logits, target, label_smoothing=0.1, vocab_size=VOCAB)
        loss.backward()
        errors[f"lm sp={sp} loss"] = rel_err(loss.double(), loss_ref.double())
        errors.update(_compare_params(f"lm sp={sp}", tp, ref, r, grads=True))
    return errors


@pytest.mark.parametrize("world_size", THREAD_SIZES)
def test_mlps_and_training_match_single_device_threads(world_size):
    assert_small(run(mlp_checks, world_size, "threads"), FP64_TOL)
    assert_small(run(lm_checks, world_size, "threads"), FP64_TOL)


def test_sequence_parallel_grads_are_partial_without_the_mark():
    """The mark is what makes norm gradients right: without it they differ from the single-device ones; with it
    the backward alone gives them, whatever Parameter the norm holds by then; the old post-backward sync has
    nothing left to do."""
    def body():
        ref = Mlp(False, 3, torch.float64)
        tp, unmarked = parallelize_mlp(Mlp(False, 3, torch.float64), True), Mlp(False, 3, torch.float64)
        unmarked.up = ColumnParallelLinear.from_module(unmarked.up, sequence_parallel=True)
        unmarked.down = RowParallelLinear.from_module(unmarked.down, sequence_parallel=True)
        tp.load_state_dict({k: v.clone() for k, v in tp.state_dict().items()}, assign=True)
        x = local_slice(randn((BATCH, SEQ, HIDDEN), 1), 1, [SEQ // 2] * 2, tpkit.get_communicator().rank)
        ref(randn((BATCH, SEQ, HIDDEN), 1)).sum().backward()
        tp(x).sum().backward()
        unmarked(x).sum().backward()
        with pytest.warns(DeprecationWarning, match="no longer needed"):
            synced = sync_sequence_parallel_grads(tp)
        return (rel_err(unmarked.norm.weight.grad, ref.norm.weight.grad), synced,
                rel_err(tp.norm.weight.grad, ref.norm.weight.grad), rel_err(tp.down.bias.grad, ref.down.bias.grad))
    for before, synced, after, bias in run(body, 2, "threads"):
        assert before > 1e-3 and synced == 0 and after < FP64_TOL and bias < FP64_TOL


def test_mark_sequence_parallel_rejects_shards_and_bare_parameters():
    layer = ColumnParallelLinear(4, 4, comm=tpkit.comm.threads.create_communicators(2)[0])
    with pytest.raises(ValueError, match=r"mark_sequence_parallel: ColumnParallelLinear.weight is a tensor-parallel"):
        mark_sequence_parallel(layer)
    with pytest.raises(TypeError, match=r"pass the module that holds the parameters"):
        mark_sequence_parallel([layer.weight])
