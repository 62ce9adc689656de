"""The zigzag split: a partition of the sequence, its inverse, balanced causal work, padding to 2 x cp, and the
ring attention against torch's sdpa on the whole sequence (outputs and gradients, every mask kind), float64."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tpkit.comm import run_threads
from tpkit.context.batch import shard_inputs
from tpkit.context.ring import ring_attention
from tpkit.context.sequence import SequenceSplit


@given(length=st.integers(1, 200), cp=st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_every_position_is_held_once_and_gathering_inverts_the_split(length, cp):
    split = SequenceSplit(length, cp)
    held = torch.cat([split.indices(r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(split.padded))
    assert split.padded % (2 * cp) == 0 and 0 <= split.pad < 2 * cp
    x = torch.arange(length)[None]
    pieces = torch.cat([split.split(x, 1, r) for r in range(cp)], 1)
    assert torch.equal(pieces[:, split.natural()][:, :length], x)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_zigzag_gives_every_rank_the_same_causal_work(cp):
    split = SequenceSplit(64 * cp, cp)
    work = [int(sum(q + 1 for q in split.indices(r).tolist())) for r in range(cp)]  # keys each query sees
    assert max(work) == min(work)
    contiguous = [sum(range(r * 128 + 1, (r + 1) * 128 + 1)) for r in range(cp)]
    assert max(contiguous) > 2 * min(contiguous)  # what zigzag avoids


def test_a_bad_split_is_refused_naming_the_sizes():
    with pytest.raises(ValueError, match="length 0 and cp 2"):
        SequenceSplit(0, 2)
    with pytest.raises(ValueError, match="has 5 entries along dim 1, the sequence has 6"):
        SequenceSplit(6, 2).split(torch.zeros(1, 5), 1, 0)


def _masks(kind: str, rows: int, length: int):
    """(the model inputs that make the mask, and the window) for each mask kind."""
    g = torch.Generator().manual_seed(3)
    if kind == "padding":
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[0, :3], mask[1, -4:] = 0, 0  # left padding in one row, right in the other
        return {"attention_mask": mask}, None
    if kind == "documents":
        cuts = sorted(torch.randint(1, length, (2,), generator=g).tolist())
        pos = torch.cat([torch.arange(cuts[0]), torch.arange(cuts[1] - cuts[0]), torch.arange(length - cuts[1])])
        return {"position_ids": pos[None].expand(rows, length)}, None
    if kind == "window":
        return {}, 5
    return {}, None


@pytest.mark.parametrize("cp,length,kind,kernel", [(1, 12, "causal", "flash"), (2, 16, "causal", "flash"),
                                                   (3, 17, "padding", "flash"), (2, 21, "documents", "flash"),
                                                   (4, 24, "window", "flash"), (3, 30, "documents", "flash"),
                                                   (2, 19, "padding", "math"), (3, 22, "window", "math")])
def test_ring_attention_equals_sdpa_on_the_whole_sequence(cp, length, kind, kernel, monkeypatch):
    """Both block kernels: the CPU flash one, and the tensor-op one other devices run (forced here)."""
    monkeypatch.setenv("TPKIT_RING_KERNEL", kernel)
    rows, heads, kv_heads, dim = 2, 4, 2, 8
    g = torch.Generator().manual_seed(cp * 100 + length)
    q = torch.randn(rows, heads, length, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(rows, kv_heads, length, dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(rows, kv_heads, length, dim, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(rows, heads, length, dim, generator=g, dtype=torch.float64)
    inputs, window = _masks(kind, rows, length)
    positions = torch.arange(length)
    reference_batch = shard_inputs({"input_ids": torch.zeros(rows, length, dtype=torch.long), **inputs}, 0, 1)[1]
    allowed = reference_batch.allowed(positions, positions, window)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                             attn_mask=allowed)
    want.backward(grad)
    expected = [t.grad.clone() for t in (q, k, v)]

    def rank(comm):
        _, batch = shard_inputs({"input_ids": torch.zeros(rows, length, dtype=torch.long), **inputs}, comm.rank, cp)
        split = batch.split
        local = [split.split(t.detach(), 2, comm.rank).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, comm, batch, dim ** -0.5, window)
        out.backward(split.split(grad, 2, comm.rank))
        return out.detach(), [t.grad for t in local]

    results = run_threads(rank, cp)
    split = SequenceSplit(length, cp)
    got = torch.cat([r[0] for r in results], 2)[:, :, split.natural()][:, :, :length]
    assert torch.allclose(got, want.detach(), rtol=0, atol=1e-12)
    for i, name in enumerate("qkv"):
        grads = torch.cat([r[1][i] for r in results], 2)[:, :, split.natural()][:, :, :length]
        assert torch.allclose(grads, expected[i], rtol=0, atol=1e-12), name


@pytest.mark.parametrize("kernel", ["flash", "math"])
def test_ring_attention_in_bf16_is_within_bf16_rounding_of_sdpa(kernel, monkeypatch):
    """Users' checkpoints are bf16: the ring merges its blocks in float32 and stays at bf16's rounding."""
    monkeypatch.setenv("TPKIT_RING_KERNEL", kernel)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 40, 16, generator=g).bfloat16()
    k, v = (torch.randn(2, 2, 40, 16, generator=g).bfloat16() for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1),
                                                             v.float().repeat_interleave(2, 1), is_causal=True)

    def rank(comm):
        _, batch = shard_inputs({"input_ids": torch.zeros(2, 40, dtype=torch.long)}, comm.rank, 2)
        return ring_attention(*(batch.split.split(t, 2, comm.rank) for t in (q, k, v)), comm, batch, 0.25)

    split = SequenceSplit(40, 2)
    got = torch.cat(run_threads(rank, 2), 2)[:, :, split.natural()]
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() / want.abs().max() < 1e-2
