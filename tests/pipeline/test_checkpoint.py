"""Checkpoints of pipeline stages, on 4 gloo processes (the checkpoint part of the launch `conftest.launched` shares): each stage writes its own keys under the whole model's names,
so the directory is the ordinary one. From a Hugging Face directory each rank reads its part (`tpkit.pipeline(path,
...)`); a pp2 x tp2 checkpoint resumes at pp2 x tp2 (bit for bit the uninterrupted run), at tp2 alone, and a tp2
checkpoint back at pp2 x tp2; a tied Qwen2 saved at pp2 x dp2 (FSDP2, optimizer state of the tied weight once)
resumes under ZBV (both tied copies on one rank) and in one plain process; `consolidate` writes a directory
transformers loads. Every state is checked against one process of plain transformers + AdamW after the same steps.
"""
from __future__ import annotations

import os

import pytest
import torch

import tpkit
from tests.pipeline.cases import LR, MAX_NORM, MODELS, _train_model, batch


def _reference_states(name: str, steps: int) -> list[dict[str, torch.Tensor]]:
    """Parameters after each step of one process of plain transformers + torch (the state before step 0 first)."""
    model = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    states = [{k: p.detach().clone() for k, p in model.named_parameters(remove_duplicate=False)}]
    for step in range(steps):
        x = batch(step)
        model(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        states.append({k: p.detach().clone() for k, p in model.named_parameters(remove_duplicate=False)})
    return states


def _close(snapshot: dict, want: dict[str, torch.Tensor], rel: float = 1e-4) -> None:
    for key, (got, lay) in snapshot.items():
        ref = lay.shard(want[key]) if lay.world_size > 1 else want[key]
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < rel, (key, err)


@pytest.fixture(scope="module")
def saved(launched):
    """What the checkpoint part of the shared launch (`cases.run_checkpoints`) kept, and its directory."""
    return [r["checkpoint"] for r in launched["per_rank"]], launched["checkpoints"]


@pytest.mark.slow
def test_each_rank_holds_its_part_and_a_resume_at_the_same_layout_is_the_uninterrupted_run(saved):
    per_rank, _ = saved
    llama = MODELS["llama"]()
    keys = set(llama.state_dict())
    first, last = set(per_rank[0]["part_keys"]), set(per_rank[2]["part_keys"])
    assert per_rank[1]["part_keys"] == per_rank[0]["part_keys"] and not first & last and first | last == keys
    for r in per_rank:
        assert r["uninterrupted"].keys() == r["resumed_same"].keys()
        assert all(torch.equal(r["uninterrupted"][k][0], r["resumed_same"][k][0]) for k in r["uninterrupted"])


@pytest.mark.slow
def test_a_pp2_tp2_checkpoint_resumes_at_tp2_alone_and_back(saved):
    per_rank, _ = saved
    states = _reference_states("llama", 3)
    for r in per_rank:
        _close(r["uninterrupted"], states[2])
        _close(r["pp2tp2_step3"], states[3])
    for r in per_rank[:2]:
        _close(r["tp2_step2"], states[2])


@pytest.mark.slow
def test_a_tied_model_saved_at_pp2_dp2_resumes_under_zbv_and_in_one_plain_process(saved):
    per_rank, root = saved
    states = _reference_states("qwen_tied", 2)
    for r in per_rank[:2]:
        _close(r["qwen_zbv_step2"], states[2])
    model = MODELS["qwen_tied"]()  # one process, no conversion: the checkpoint is the ordinary one
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.warns(UserWarning, match="saved by 4 ranks, this run has 1: random streams start afresh"):
        assert tpkit.Checkpointer(os.path.join(root, "qwen"), every=1).resume(model, opt) == 1
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _train_model(model, opt, [1])
    for k, p in model.named_parameters(remove_duplicate=False):
        assert ((p - states[2][k]).abs().max() / states[2][k].abs().max()).item() < 1e-4, k


@pytest.mark.slow
def test_consolidate_writes_a_directory_transformers_loads(saved, tmp_path):
    import transformers as tr

    _, root = saved
    states = {"llama": _reference_states("llama", 1)[1], "qwen": _reference_states("qwen_tied", 1)[1]}
    for name, ckpt in (("llama", os.path.join(root, "llama")), ("qwen", os.path.join(root, "qwen"))):
        out = str(tmp_path / name)
        tpkit.consolidate(ckpt, out)
        model = tr.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
        for k, p in model.named_parameters(remove_duplicate=False):
            want = states[name][k]
            assert ((p - want).abs().max() / want.abs().max()).item() < 1e-4, (name, k)
