"""Tensor parallel x data parallel (`tpkit.data_parallel`) on 4 gloo ranks, tp2 x dp2, against one device.

One launch does everything (the box has 2 cores and 4 processes take a while to start): the mesh's groups,
3 AdamW steps with global clipping under FSDP2 (with and without sequence parallelism) and under DDP with the global
batch split over dp, the dropout
streams, and a 2-D checkpoint reloaded at tp2 x dp2, at tp4 and at tp2 without dp, each followed by one more
step. The single-device reference runs here, on a deep copy of the same model, with the whole global batch.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tpkit

VOCAB, SEQ, BATCH, STEPS, LR, MAX_NORM = 64, 8, 4, 3, 1e-2, 0.5


def tiny_llama() -> torch.nn.Module:
    import transformers as tr

    config = tr.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(config)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS + 1)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def reference(model: torch.nn.Module) -> dict:
    """Single device: losses and clip norms of STEPS + 1 steps, logits after STEPS and after STEPS + 1, bytes."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {"loss": [], "norm": [], "logits": []}
    for i, ids in enumerate(batches()):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out["norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        out["loss"].append(loss.item())
        if i >= STEPS - 1:
            with torch.no_grad():
                out["logits"].append(model(input_ids=batches()[0]).logits)
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    out["bytes"] = sum(t.numel() * t.element_size() for t in list(model.parameters()) + state)
    return out


# ---------------------------------------------------------------------------------------------------------
# Per-rank bodies (module level: spawned processes import them).

def _step(model, opt, ids, tp, dp, clip_comm=None) -> tuple[float, float]:
    """One step on this dp rank's share of `ids`; returns (global loss, clip norm)."""
    share = ids.chunk(dp.world_size)[dp.rank] if dp is not None else ids
    loss = model(input_ids=share, labels=share).loss
    loss.backward()
    norm = tpkit.clip_grad_norm_(model.parameters(), MAX_NORM, comm=clip_comm)
    opt.step()
    opt.zero_grad()
    total = dp.all_reduce(loss.detach()) / dp.world_size if dp is not None else loss.detach()
    return total.item(), norm.item()


def _logits(model, tp) -> torch.Tensor:
    with torch.no_grad():  # vocab-parallel (training mode): the slices read as the full logits
        return model(input_ids=batches()[0]).logits.full()


def _replicated_grad_gap(model, tp) -> float:
    """After a backward: the largest difference across TP ranks of the TP-replicated parameters' gradients."""
    from torch.distributed.tensor import DTensor

    worst = 0.0
    for name, p in model.named_parameters():
        if "norm" in name and p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            both = tp.all_gather(g.unsqueeze(0))
            worst = max(worst, (both[0] - both[1]).abs().max().item())
    return worst


def _train(model0, mode, tp, dp, sp=False):
    model = tpkit.parallelize(copy.deepcopy(model0), comm=tp, mode="training", sequence_parallel=sp)
    wrapped = tpkit.data_parallel(model, dp, mode=mode)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    losses, norms, gap = [], [], None
    for i, ids in enumerate(batches()[:STEPS]):
        if i == 0:  # a step by hand, to look at the gradients before clipping
            share = ids.chunk(dp.world_size)[dp.rank]
            wrapped(input_ids=share, labels=share).loss.backward()
            gap = _replicated_grad_gap(model, tp)
            opt.zero_grad()
        loss, norm = _step(wrapped, opt, ids, tp, dp)
        losses.append(loss)
        norms.append(norm)
    from tpkit.data_parallel import local_bytes

    out = {"loss": losses, "norm": norms, "gap": gap, "logits": _logits(wrapped, tp), "bytes": local_bytes(wrapped, opt)}
    return wrapped, opt, out


def _resume(model0, directory, tp, dp, world, mode=None):
    """Load the checkpoint into a fresh model on this layout, then logits, one step, logits."""
    model = tpkit.parallelize(copy.deepcopy(model0), comm=tp, mode="training")
    if mode is not None:
        model = tpkit.data_parallel(model, dp, mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=LR * 7)  # the checkpoint's lr must win
    meta = tpkit.load_sharded(model, directory, optimizer=opt, comm=world)
    before = _logits(model, tp)
    loss, norm = _step(model, opt, batches()[STEPS], tp, dp, clip_comm=None if mode else tp)
    return {"step": meta["step"], "logits": before, "loss": loss, "norm": norm, "after": _logits(model, tp)}


def _rng(tp, dp) -> dict:
    from tpkit.nn import get_rng_tracker

    tpkit.data_parallel_manual_seed(11, tp, dp)
    replicated = F.dropout(torch.ones(256), 0.5)
    with get_rng_tracker(tp).fork():
        sharded = F.dropout(torch.ones(256), 0.5)
    return {"replicated": replicated, "sharded": sharded}


def body_2d(model0, directory):
    import torch.distributed as dist

    world = tpkit.get_communicator()
    tp, dp = tpkit.comm.split(world, 2)
    mesh = tpkit.device_mesh(world, 2)
    out = {"groups": (dist.get_process_group_ranks(mesh.get_group("tp")), dist.get_process_group_ranks(tp.process_group),
                      dist.get_process_group_ranks(mesh.get_group("dp")), dist.get_process_group_ranks(dp.process_group))}
    out["rng"] = _rng(tp, dp)
    _, _, out["ddp"] = _train(model0, "ddp", tp, dp)
    _, _, out["fsdp_sp"] = _train(model0, "fsdp", tp, dp, sp=True)  # the norms' sums run inside the backward,
    #                                                                  before FSDP2 reduce-scatters over dp
    wrapped, opt, out["fsdp"] = _train(model0, "fsdp", tp, dp)
    tpkit.save_sharded(wrapped, directory, optimizer=opt, step=STEPS, comm=world)
    out["resume_2d"] = _resume(model0, directory, tp, dp, world, mode="fsdp")
    out["resume_tp4"] = _resume(model0, directory, world, None, world)
    out["resume_tp2"] = _resume(model0, directory, tp, None, tp)
    return out


# ---------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_tp2_dp2_equals_one_device_and_checkpoints_reshard(tmp_path):
    model0 = tiny_llama()
    ref = reference(copy.deepcopy(model0))
    results = tpkit.launch(body_2d, 4, backend="gloo", args=(model0, str(tmp_path)), timeout=300)
    for rank, r in enumerate(results):
        tp_ranks, split_tp, dp_ranks, split_dp = r["groups"]
        assert tp_ranks == split_tp == [rank - rank % 2, rank - rank % 2 + 1]
        assert dp_ranks == split_dp == [rank % 2, rank % 2 + 2]
        for mode in ("fsdp", "ddp", "fsdp_sp"):
            got = r[mode]
            assert got["gap"] == 0.0, (mode, got["gap"])  # TP-replicated gradients equal on both TP ranks
            for a, b in zip(got["loss"], ref["loss"]):
                assert abs(a - b) <= 1e-5 * abs(b), (mode, got["loss"], ref["loss"])
            assert abs(got["norm"][0] - ref["norm"][0]) <= 1e-5 * ref["norm"][0], (mode, got["norm"], ref["norm"])
            for a, b in zip(got["norm"][1:], ref["norm"][1:]):
                assert abs(a - b) <= 5e-5 * b, (mode, got["norm"], ref["norm"])
            assert rel(got["logits"], ref["logits"][0]) < 1e-3, (mode, rel(got["logits"], ref["logits"][0]))
        assert r["fsdp"]["bytes"] <= 0.30 * ref["bytes"], (r["fsdp"]["bytes"], ref["bytes"])
        for layout in ("resume_2d", "resume_tp4", "resume_tp2"):
            got = r[layout]
            assert got["step"] == STEPS
            assert rel(got["logits"], r["fsdp"]["logits"]) < 1e-5, (layout, rel(got["logits"], r["fsdp"]["logits"]))
            assert abs(got["loss"] - ref["loss"][STEPS]) <= 1e-5 * ref["loss"][STEPS], (layout, got["loss"])
            assert abs(got["norm"] - ref["norm"][STEPS]) <= 5e-5 * ref["norm"][STEPS], (layout, got["norm"])
            assert rel(got["after"], ref["logits"][1]) < 1e-3, (layout, rel(got["after"], ref["logits"][1]))
    masks = [r["rng"] for r in results]
    assert torch.equal(masks[0]["replicated"], masks[1]["replicated"])       # tp ranks: replicated dropout agrees
    assert torch.equal(masks[2]["replicated"], masks[3]["replicated"])
    assert not torch.equal(masks[0]["replicated"], masks[2]["replicated"])   # dp ranks: different samples
    sharded = [m["sharded"] for m in masks]
    assert all(not torch.equal(sharded[i], sharded[j]) for i in range(4) for j in range(i + 1, 4))


def test_data_parallel_needs_a_process_group_and_a_known_mode():
    comm = tpkit.get_communicator()  # a world of one, no process group
    with pytest.raises(TypeError, match="torch-backend communicator"):
        tpkit.data_parallel(torch.nn.Linear(2, 2), comm)
    with pytest.raises(ValueError, match="mode 'zero'"):
        tpkit.data_parallel(torch.nn.Linear(2, 2), comm, mode="zero")
    with pytest.raises(TypeError, match="torch-backend communicator"):
        tpkit.device_mesh(comm, 1)
