"""Tiny float64 models, their batches, the single-process reference (plain transformers + torch, no tpkit), and
the rank body of the pipeline cases: one gloo launch runs every case in turn, each on the first `world` ranks."""
from __future__ import annotations

import dataclasses

import torch

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


def reference(name: str) -> dict:
    """One process, no tpkit: `model(input_ids=x, labels=x).loss`, backward, torch's clip_grad_norm_, AdamW."""
    model = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {"losses": [], "norms": [], "grads": {}, "eval_loss": None, "logits": None}
    with torch.no_grad():
        out["logits"] = model(input_ids=batch(0)).logits
        out["eval_loss"] = model(input_ids=batch(0), labels=batch(0)).loss.item()
    for step in range(STEPS):
        x = batch(step)
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


def _whole(t):
    """An FSDP2 shard gathered to the TP-local tensor (collective over dp, same order on every dp rank)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _snapshot(model, grads: bool) -> dict:
    import tpkit

    layouts = tpkit.shard_layouts(model)
    out = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        t = p.grad if grads else p
        out[key] = (_whole(t).detach().clone(), layouts[key])
    return out


def run_case(comm, case: Case) -> dict:
    """The case on `comm`: the pipeline's eval, then STEPS training steps as the reference does them."""
    import tpkit

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
    import tpkit
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
