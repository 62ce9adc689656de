"""Pipeline training on real gloo processes equals one process of plain transformers + torch.

One launch of 4 processes (`conftest.launched`, shared with test_checkpoint.py) runs every case of `cases.CASES` in
turn, each on the first `world` ranks: float64 Llama (5 layers) at pp3 (an uneven split), pp2, pp2 x tp2, pp2 x dp2 under DDP and FSDP2,
interleaved 1F1B and zero bubble with 2 stages per rank; a tied-embedding Qwen2 at pp2, pp2 x tp2 and ZBV (first and
last stage on one rank). For each: the evaluation loss and logits before training, then per step the loss and the
clipped global norm, the gradients of the first step (before clipping), and the parameters after AdamW, against
`cases.reference`. The micro-batch scaling: the pipeline's loss is the mean of its micro-batches' means, equal to
the batch mean (every micro-batch has as many tokens), and torch divides the gradients by their number.
"""
from __future__ import annotations

import pytest
import torch

from tests.pipeline.cases import CASES, reference

BY_NAME = {c.name: c for c in CASES}
# Relative error allowed on gradients (per tensor, of its largest entry): float64 throughout, but the loss is
# computed in float32 (transformers upcasts logits with `.float()`) and Llama / Qwen2 RMSNorm round to float32
# inside, so a different summation order (tensor parallelism's partial sums) moves results by float32 ulps.
GRAD_REL = {1: 1e-9, 2: 5e-6}


@pytest.fixture(scope="module")
def results(launched) -> dict:
    """Per case, every rank's result (the training part of the launch `conftest.launched` shares)."""
    out: dict[str, list[dict]] = {}
    for rank_results in launched["per_rank"]:
        for name, r in rank_results["cases"].items():
            out.setdefault(name, []).append(r)
    return out


@pytest.mark.slow
def test_bad_input_is_refused_before_anything_changes(results):
    for r in results["bad_inputs"]:
        assert "SplitError: cannot cut LlamaForCausalLM into 4 pipeline stages: it has 2 blocks" in r["pp"]
        assert "SplitError: cannot cut Sequential into pipeline stages: it has no repeated blocks" in r["blocks"]
        assert "schedule 'gpipe' runs one stage per rank" in r["schedule"]
        assert "pp 3 x tp 1 = 3 does not divide the world size 4" in r["layout"]
        assert all(r[k] for k in r if k.endswith("_unchanged"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen_tied_pp2", "qwen_tied_pp2_tp2", "qwen_tied_zbv"])
def test_the_sentinel_compares_the_tied_copies_across_stages(results, name):
    """After training the copies agree (the check passed); a drift of the last stage's copy raises on every rank."""
    for r in results[name]:  # ranks holding a copy name it; the others learn that another rank found one
        d = r["divergence"]
        if 0 in r["stages"] or len(r["starts"]) - 1 in r["stages"]:
            assert ("model.embed_tokens.weight" in d or "lm_head.weight" in d) and "tied" in d, d
        else:
            assert "other rank(s) of this model found copies that differ" in d, d


@pytest.fixture(scope="module")
def references() -> dict:
    return {name: reference(name) for name in ("llama", "qwen_tied")}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_training_equals_one_process(results, references, name):
    case, ranks = BY_NAME[name], results[name]
    ref = references[case.model]
    assert len(ranks) == case.world
    held = set()
    for r in ranks:
        if case.schedule == "zbv":
            assert "cannot run a forward without its backward" in r["eval_error"]
        else:
            assert r["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-6)
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-6), (r["rank"], r["losses"], ref["losses"])
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-6), (r["rank"], r["norms"], ref["norms"])
        assert r["replicas"] >= 0
        for key, (got, lay) in r["grads"].items():
            want = lay.shard(ref["grads"][key]) if lay.world_size > 1 else ref["grads"][key]
            assert _rel(got, want) < GRAD_REL[case.tp], (name, r["rank"], key, _rel(got, want))
        for key, (got, lay) in r["params"].items():
            want = lay.shard(ref["params"][key]) if lay.world_size > 1 else ref["params"][key]
            assert _rel(got, want) < 1e-4, (name, r["rank"], key, _rel(got, want))
            held.add(key)
    assert held == set(ref["params"]), sorted(set(ref["params"]) ^ held)  # every tensor is on some stage


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_pp2", "llama_pp3_gpipe", "llama_interleaved", "llama_pp2_dp2_fsdp"])
def test_evaluation_logits_equal_one_process(results, references, name):
    """Logits (whole: tp 1) on the ranks running the last stage; None elsewhere."""
    ranks = results[name]
    ref = references[BY_NAME[name].model]["logits"]
    last = [r for r in ranks if r["logits"] is not None]
    assert last and all(r["pp_rank"] == last[0]["pp_rank"] for r in last)
    for r in last:
        logits, d, n = r["logits"]
        assert torch.allclose(logits, ref.chunk(n)[d], rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_stages_sit_where_the_schedule_puts_them(results):
    assert [r["stages"] for r in results["llama_pp3_gpipe"]] == [(0,), (1,), (2,)]
    assert [r["stages"] for r in results["llama_interleaved"]] == [(0, 2), (1, 3)]
    assert [r["stages"] for r in results["qwen_tied_zbv"]] == [(0, 3), (1, 2)]
    assert [r["pp_rank"] for r in results["llama_pp2_tp2"]] == [0, 0, 1, 1]  # tp innermost
    assert results["llama_interleaved"][0]["starts"] == (0, 1, 2, 4)
