"""Checkpoints of pipeline stages, on 4 gloo processes: each stage writes its own keys under the whole model's names,
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
from tests.pipeline.cases import LR, MAX_NORM, MODELS, _snapshot, batch


def _train_pipe(pipe, opt, steps) -> None:
    dp = pipe.groups.dp
    for step in steps:
        mine = batch(step).chunk(dp.world_size)[dp.rank]
        pipe.step(mine, mine)
        tpkit.clip_grad_norm_(pipe.model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()


def _train_model(model, opt, steps) -> None:
    for step in steps:
        x = batch(step)
        model(input_ids=x, labels=x).loss.backward()
        tpkit.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()


def _pipe(path, comm, **kw):
    pipe = tpkit.pipeline(path, comm, dtype=torch.float64, **kw)
    pipe.model.train()
    return pipe, torch.optim.AdamW(pipe.model.parameters(), lr=LR)


def run(world, llama_dir: str, qwen_dir: str, root: str) -> dict:
    out = {}
    # Llama at pp2 x tp2 from the HF directory: one step, saved; a second step (the uninterrupted run)
    pipe, opt = _pipe(llama_dir, world, pp=2, tp=2)
    out["part_keys"] = sorted(pipe.model.state_dict())
    _train_pipe(pipe, opt, [0])
    v1 = tpkit.save_sharded(pipe.model, os.path.join(root, "llama"), optimizer=opt, step=1, comm=world)
    _train_pipe(pipe, opt, [1])
    out["uninterrupted"] = _snapshot(pipe.model, grads=False)
    # resumed at the same layout: bit for bit
    pipe, opt = _pipe(llama_dir, world, pp=2, tp=2)
    assert tpkit.load_sharded(pipe.model, v1, optimizer=opt, comm=world)["step"] == 1
    _train_pipe(pipe, opt, [1])
    out["resumed_same"] = _snapshot(pipe.model, grads=False)
    # resumed at tp2 alone (ranks 0 and 1), one step, saved there; back at pp2 x tp2 for a third step
    tp2 = world.new_group([0, 1])
    if tp2 is not None:
        model = tpkit.parallelize(MODELS["llama"](), comm=tp2, mode="training")
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        tpkit.load_sharded(model, v1, optimizer=opt, comm=tp2)
        _train_model(model, opt, [1])
        out["tp2_step2"] = _snapshot(model, grads=False)
        tpkit.save_sharded(model, os.path.join(root, "llama-tp2"), optimizer=opt, step=2, comm=tp2)
    world.barrier()
    pipe, opt = _pipe(llama_dir, world, pp=2, tp=2)
    tpkit.Checkpointer(os.path.join(root, "llama-tp2"), every=1, comm=world).resume(pipe.model, opt)
    _train_pipe(pipe, opt, [2])
    out["pp2tp2_step3"] = _snapshot(pipe.model, grads=False)
    # tied Qwen2 at pp2 x dp2 under FSDP2, saved by the Checkpointer; resumed under ZBV on ranks 0 and 1
    pipe, opt = _pipe(qwen_dir, world, pp=2, dp_mode="fsdp")
    _train_pipe(pipe, opt, [0])
    tpkit.Checkpointer(os.path.join(root, "qwen"), every=1, comm=world).maybe_save(1, pipe.model, opt)
    pair = world.new_group([0, 1])
    if pair is not None:
        pipe, opt = _pipe(qwen_dir, pair, pp=2, schedule="zbv", stages_per_rank=2)
        assert tpkit.Checkpointer(os.path.join(root, "qwen"), every=1, comm=pair).resume(pipe.model, opt) == 1
        _train_pipe(pipe, opt, [1])
        out["qwen_zbv_step2"] = _snapshot(pipe.model, grads=False)
    world.barrier()
    return out


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
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline-ckpt")
    dirs = {}
    for name in ("llama", "qwen_tied"):
        dirs[name] = str(root / f"hf-{name}")
        MODELS[name]().save_pretrained(dirs[name])
    per_rank = tpkit.launch(run, 4, backend="gloo", args=(dirs["llama"], dirs["qwen_tied"], str(root / "ck")),
                            pass_comm=True, timeout=120)
    return per_rank, str(root / "ck")


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
