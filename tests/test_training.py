"""Training tools on converted models, tp2 x dp2 on 4 gloo processes (one launch) against one device:

- recompute under FSDP2: "full" and "selective" give bit for bit the gradients of no recompute, dropout through
  the RNG tracker included; the loss equals one device's;
- torch.autocast (bf16 on CPU) with TP layers, vocab-parallel cross entropy and DDP: loss, gradient norm and
  logits within bf16 tolerance of one device under autocast;
- gradient accumulation of 4 micro-batches with `tpkit.no_sync` (DDP and FSDP2): loss, gradient norm and the
  weights after one AdamW step equal one device's single batch of 4x the size (rel 1e-6, fp32).
"""
from __future__ import annotations

import copy

import pytest
import torch

import tpkit
from tests.test_recompute import DROP_PLAN, DropNet

VOCAB, SEQ, MICRO, ACCUM, LR = 64, 8, 2, 4, 1e-2  # each dp rank: ACCUM micro-batches of MICRO sequences


def tiny_llama() -> torch.nn.Module:
    import transformers as tr

    config = tr.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(config)


def global_batch() -> torch.Tensor:
    """2 dp ranks x ACCUM micro-batches x MICRO sequences."""
    return torch.randint(0, VOCAB, (2 * ACCUM * MICRO, SEQ), generator=torch.Generator().manual_seed(3))


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).abs().max() / b.abs().max()).item()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _logits(model, tp, ids) -> torch.Tensor:
    """The full logits: a training-mode model's vocabulary slices read as the whole (`tpkit.nn.SplitLogits`)."""
    with torch.no_grad():
        return model(input_ids=ids).logits.float().full()


def _body(base, drop_base):
    comm = tpkit.get_communicator()
    tp, dp = tpkit.comm.split(comm, 2)
    ids = global_batch()
    mine = ids.chunk(dp.world_size)[dp.rank]
    out = {}

    # Recompute under FSDP2, dropout through the tracker: same gradients bit for bit.
    for policy in ("none", "full"):
        model = tpkit.data_parallel(tpkit.parallelize(copy.deepcopy(drop_base), comm=tp, plan=DROP_PLAN), dp)
        tpkit.recompute(model, policy)
        tpkit.data_parallel_manual_seed(7, tp, dp)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(4)).chunk(dp.world_size)[dp.rank]
        model(x).pow(2).mean().backward()
        out[f"dropout-{policy}"] = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
    for policy in ("none", "selective", "full"):
        model = tpkit.data_parallel(tpkit.parallelize(copy.deepcopy(base), comm=tp, mode="training"), dp)
        tpkit.recompute(model, policy)
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        out[f"llama-{policy}"] = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
        out[f"loss-{policy}"] = (dp.all_reduce(loss.detach()) / dp.world_size).item()

    # Autocast, bf16 on CPU, under DDP.
    model = tpkit.data_parallel(tpkit.parallelize(copy.deepcopy(base), comm=tp, mode="training"), dp, mode="ddp")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    out["autocast"] = ((dp.all_reduce(loss.detach().float()) / dp.world_size).item(),
                       tpkit.clip_grad_norm_(model.parameters(), float("inf")).item())  # the 2-norm, no clipping
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out["autocast-logits"] = _logits(model, tp, ids[:2])

    # Accumulation: ACCUM micro-batches per dp rank, the data-parallel reduction once.
    for mode in ("ddp", "fsdp"):
        model = tpkit.data_parallel(tpkit.parallelize(copy.deepcopy(base), comm=tp, mode="training"), dp, mode=mode)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        total = 0.0
        for i, micro in enumerate(mine.chunk(ACCUM)):
            with tpkit.no_sync(model, enabled=i < ACCUM - 1):
                loss = model(input_ids=micro, labels=micro).loss / ACCUM
                loss.backward()
            total += loss.detach()
        norm = tpkit.clip_grad_norm_(model.parameters(), float("inf"))
        opt.step()
        out[f"accumulate-{mode}"] = ((dp.all_reduce(total) / dp.world_size).item(), norm.item(),
                                     _logits(model, tp, ids[:2]))
    return out


def _reference(base, autocast: bool = False) -> dict:
    model = copy.deepcopy(base)
    ids = global_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # the 2-norm, nothing clipped
    if autocast:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return {"loss": loss.item(), "norm": norm.item(), "logits": model(input_ids=ids[:2]).logits.float()}
    opt.step()
    with torch.no_grad():
        return {"loss": loss.item(), "norm": norm.item(), "logits": model(input_ids=ids[:2]).logits}


pytestmark = pytest.mark.slow  # one launch of 4 gloo processes


@pytest.fixture(scope="module")
def runs():
    torch.manual_seed(0)
    drop_base = DropNet()
    base = tiny_llama()
    return tpkit.launch(_body, 4, backend="gloo", args=(base, drop_base), timeout=120), base


def test_recompute_is_exact_under_fsdp_with_tracker_dropout(runs):
    results, base = runs
    ref = _reference(base)
    for rank, out in enumerate(results):
        for name in ("dropout-full",):
            assert all(torch.equal(out[name][n], g) for n, g in out["dropout-none"].items()), (rank, name)
        for name in ("llama-selective", "llama-full"):
            assert all(torch.equal(out[name][n], g) for n, g in out["llama-none"].items()), (rank, name)
            assert out[name.replace("llama", "loss")] == out["loss-none"]
        assert rel(out["loss-none"], ref["loss"]) < 1e-6


def test_autocast_with_tp_and_vocab_parallel_cross_entropy(runs):
    results, base = runs
    ref = _reference(base, autocast=True)
    loss, norm = results[0]["autocast"]
    assert rel(loss, ref["loss"]) < 1e-3 and rel(norm, ref["norm"]) < 1e-2, (loss, ref["loss"], norm, ref["norm"])
    assert rel(results[0]["autocast-logits"], ref["logits"]) < 2e-2


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_accumulating_four_micro_batches_equals_one_batch_four_times_the_size(runs, mode):
    results, base = runs
    ref = _reference(base)
    for out in results:
        loss, norm, logits = out[f"accumulate-{mode}"]
        assert rel(loss, ref["loss"]) < 1e-6 and rel(norm, ref["norm"]) < 1e-6, (loss, ref["loss"], norm, ref["norm"])
        assert rel(logits, ref["logits"]) < 1e-6
