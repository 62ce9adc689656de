"""Tiny float64 models, their batches, the single-process reference (plain transformers + torch, no tpkit), and
the rank body of the pipeline cases: one gloo launch runs every case in turn, each on the first `world` ranks."""
from __future__ import annotations

import dataclasses
import functools
import os

import torch

import tpkit

VOCAB, SEQ, ROWS = 96, 8, 4
LR, MAX_NORM, STEPS = 1e-3, 1.0, 2


def llama(layers: int = 5):
    """A float64 Llama (untied): 5 layers split 3 ways is uneven."""
    import transformers as tr

    torch.manual_seed(0)
    config = tr.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return tr.LlamaForCausalLM(config).to(torch.float64)


def qwen_tied(layers: int = 4):
    """A float64 Qwen2 whose LM head is its input embedding."""
    import transformers as tr

    torch.manual_seed(0)
    config = tr.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            tie_word_embeddings=True)
    model = tr.Qwen2ForCausalLM(config).to(torch.float64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


MODELS = {"llama": llama, "qwen_tied": qwen_tied}


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 + step))


@functools.lru_cache(maxsize=None)
def reference(name: str) -> dict:
    """One process, no tpkit (once per model and test session: callers only read it)."""
    return one_process(MODELS[name](), batch)


def one_process(model, batch_of) -> dict:
    """`model(input_ids=x, labels=x).loss`, backward, torch's clip_grad_norm_, AdamW on the batches `batch_of(step)`:
    the losses, norms, first gradients, final parameters, and the first batch's logits and eval loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {"losses": [], "norms": [], "grads": {}, "eval_loss": None, "logits": None}
    with torch.no_grad():
        out["logits"] = model(input_ids=batch_of(0)).logits
        out["eval_loss"] = model(input_ids=batch_of(0), labels=batch_of(0)).loss.item()
    for step in range(STEPS):
        x = batch_of(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if step == 0:
            out["grads"] = {k: p.grad.clone() for k, p in model.named_parameters(remove_duplicate=False)}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = {k: p.detach().clone() for k, p in model.named_parameters(remove_duplicate=False)}
    return out


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str
    world: int
    pp: int
    tp: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    dp_mode: str = "fsdp"
    microbatches: int = 2
    starts: tuple[int, ...] | None = None


CASES = [
    Case("llama_pp3_gpipe", "llama", 3, pp=3, schedule="gpipe", microbatches=4),
    Case("llama_pp2", "llama", 2, pp=2),
    Case("llama_pp2_tp2", "llama", 4, pp=2, tp=2),
    Case("llama_pp2_dp2_ddp", "llama", 4, pp=2, dp_mode="ddp"),
    Case("llama_pp2_dp2_fsdp", "llama", 4, pp=2, dp_mode="fsdp"),
    Case("llama_interleaved", "llama", 2, pp=2, schedule="interleaved1f1b", stages_per_rank=2, microbatches=2,
         starts=(0, 1, 2, 4)),
    Case("llama_interleaved_zb", "llama", 2, pp=2, schedule="interleaved_zb", stages_per_rank=2),
    Case("qwen_tied_pp2", "qwen_tied", 2, pp=2),
    Case("qwen_tied_pp2_tp2", "qwen_tied", 4, pp=2, tp=2),
    Case("qwen_tied_zbv", "qwen_tied", 2, pp=2, schedule="zbv", stages_per_rank=2),
]


def _whole(t):
    """An FSDP2 shard gathered to the TP-local tensor (collective over dp, same order on every dp rank)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _snapshot(model, grads: bool) -> dict:
    layouts = tpkit.shard_layouts(model)
    out = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        t = p.grad if grads else p
        out[key] = (_whole(t).detach().clone(), layouts[key])
    return out


def run_case(comm, case: Case) -> dict:
    """The case on `comm`: the pipeline's eval, then STEPS training steps as the reference does them."""
    model = MODELS[case.model]()
    pipe = tpkit.pipeline(model, comm, pp=case.pp, tp=case.tp, schedule=case.schedule,
                          stages_per_rank=case.stages_per_rank, microbatches=case.microbatches,
                          dp_mode=case.dp_mode, starts=case.starts)
    dp = pipe.groups.dp
    out = {"rank": comm.rank, "pp_rank": pipe.groups.pp_rank, "stages": pipe.facts.stages,
           "starts": pipe.split.starts, "losses": [], "norms": []}
    x = batch(0).chunk(dp.world_size)[dp.rank]
    if case.schedule == "zbv":  # torch's ZBV runs no forward without backward: refused before anything runs
        try:
            pipe.eval(x, x)
        except ValueError as exc:
            out["eval_error"] = str(exc)
    else:
        out["eval_loss"] = (dp.all_reduce(pipe.eval(x, x)) / dp.world_size).item()
        logits = pipe.eval(x)
        out["logits"] = None if logits is None else (logits.clone(), dp.rank, dp.world_size)
    opt = torch.optim.AdamW(pipe.model.parameters(), lr=LR)
    for step in range(STEPS):
        mine = batch(step).chunk(dp.world_size)[dp.rank]
        loss = dp.all_reduce(pipe.step(mine, mine)) / dp.world_size
        if step == 0:
            out["grads"] = _snapshot(pipe.model, grads=True)
        out["norms"].append(tpkit.clip_grad_norm_(pipe.model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = _snapshot(pipe.model, grads=False)
    out["replicas"] = tpkit.check_replicas(pipe.model).tensors
    if case.model == "qwen_tied":  # the last stage's copy of the tied weight drifts: every rank raises
        if pipe.holds_last:
            with torch.no_grad():
                tpkit_local(pipe.model.lm_head.weight).add_(1e-3)
        try:
            tpkit.check_replicas(pipe.model, grads=False)
        except tpkit.ReplicaError as exc:
            out["divergence"] = str(exc)
    return out


def tpkit_local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def bad_inputs(world) -> dict:
    """Models that cannot be cut as asked: refused before anything changes (no collective: every rank refuses)."""
    from torch import nn

    out = {}
    for key, model, kwargs in (("pp", llama(2), {"pp": 4}), ("blocks", nn.Sequential(nn.Linear(4, 4)), {"pp": 2}),
                               ("schedule", llama(2), {"pp": 2, "schedule": "gpipe", "stages_per_rank": 2}),
                               ("layout", llama(5), {"pp": 3})):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            tpkit.pipeline(model, world, **kwargs)
        except ValueError as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
        after = model.state_dict()
        out[key + "_unchanged"] = after.keys() == before.keys() and all(torch.equal(after[k], v)
                                                                       for k, v in before.items())
    return out


def run_cases(world, cases: list[Case]) -> dict:
    """Every case in turn on the first `case.world` ranks of `world` (each rank creates every subgroup)."""
    out = {}
    for case in cases:
        comm = world if case.world == world.world_size else world.new_group(list(range(case.world)))
        if comm is not None:
            out[case.name] = run_case(comm, case)
        world.barrier()
    out["bad_inputs"] = bad_inputs(world)
    return out


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


def run_checkpoints(world, llama_dir: str, qwen_dir: str, root: str) -> dict:
    """The checkpoint cases of test_checkpoint.py: saved, resumed at the same layout, at tp2 alone and back, a tied
    model under FSDP2 resumed under ZBV."""
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


def run_apply_setup(comm) -> dict:
    """`apply_setup` of a search's pp setup: the `tpkit.Pipeline`, one training step (the reference's first loss)."""
    from tpkit.estimate.predict import Setup
    from tpkit.setups import apply_setup

    pipe = apply_setup(llama(), Setup(1, pp=2, microbatches=2), comm, goal="train")
    return {"type": type(pipe).__name__, "stages": pipe.facts.stages, "loss": pipe.step(batch(0), batch(0)).item()}


def run_all(world, cases: list[Case], llama_dir: str, qwen_dir: str, root: str) -> dict:
    """Everything the pipeline tests run on 4 gloo processes, in one launch (a launch costs 10-30 s here): the
    training cases, the checkpoint cases, a pp setup applied."""
    out = {"cases": run_cases(world, cases), "checkpoint": run_checkpoints(world, llama_dir, qwen_dir, root)}
    pair = world.new_group([0, 1])
    if pair is not None:
        out["apply_setup"] = run_apply_setup(pair)
    world.barrier()
    return out
