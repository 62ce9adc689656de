"""The rank side of tests/context/test_pipeline.py: pipelines whose stages split every sequence over cp ranks
(`tpkit.pipeline(..., cp=2)`), on 4 gloo processes in one launch (a launch costs 10-20 s on this 2-core box), and
the single-process reference (plain transformers + torch, no tpkit) on the same whole sequences."""
from __future__ import annotations

import dataclasses
import functools
import glob
import os

import torch

import tpkit
from tests.pipeline.cases import LR, MAX_NORM, STEPS, VOCAB, llama, one_process, qwen_tied

ROWS, LENGTH = 4, 10  # 10 tokens over cp 2: four chunks of 3, the last padded
MODELS = {"llama": llama, "qwen_tied": qwen_tied}


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(200 + step))


@functools.lru_cache(maxsize=None)
def reference(name: str) -> dict:
    """One process, no tpkit, on the whole sequences."""
    return one_process(MODELS[name](), batch)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str
    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    from_directory: bool = False  # read by each rank from a Hugging Face directory, as examples/finetune.py does
    cp_method: str = "ring"


CASES = [Case("llama_pp2_cp2", "llama", from_directory=True),
         Case("qwen_tied_pp2_cp2_interleaved_a2a", "qwen_tied", "interleaved1f1b", 2, cp_method="all_to_all")]


def run_case(world, case: Case, directory: str, root: str) -> dict:
    """The case at pp2 x cp2 on the 4 ranks: eval, then STEPS training steps as the reference does them (every
    rank given the whole batch); the llama case's weights saved at the end."""
    model = directory if case.from_directory else MODELS[case.model]()
    pipe = tpkit.pipeline(model, world, pp=2, cp=2, cp_method=case.cp_method, schedule=case.schedule,
                          stages_per_rank=case.stages_per_rank, microbatches=2, dtype=torch.float64)
    pipe.model.train()
    cp = pipe.groups.cp
    out = {"cp": (cp.rank, cp.world_size), "pp_rank": pipe.groups.pp_rank, "losses": [], "norms": []}
    out["eval_loss"] = pipe.eval(batch(0), batch(0)).item()
    out["logits"] = pipe.eval(batch(0))
    opt = torch.optim.AdamW(pipe.model.parameters(), lr=LR)
    for step in range(STEPS):
        loss = pipe.step(batch(step), batch(step))
        if step == 0:
            out["grads"] = {k: p.grad.clone() for k, p in pipe.model.named_parameters(remove_duplicate=False)}
        out["norms"].append(tpkit.clip_grad_norm_(pipe.model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = {k: p.detach().clone() for k, p in pipe.model.named_parameters(remove_duplicate=False)}
    out["methods"] = {m for m, _ in tpkit.context.context_of(pipe.model).methods.values()}  # chosen at the first forward
    if case.from_directory:
        tpkit.save_sharded(pipe.model, os.path.join(root, case.name), step=STEPS, comm=world)
    return out


def refusals(world) -> dict:
    """What cp cannot do, refused before the model changes (every rank refuses alike: no collective runs)."""
    out = {}
    model = llama(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for key, kwargs in (("loss_fn", {"cp": 2, "loss_fn": lambda out, labels: out.sum()}), ("sizes", {"cp": 4})):
        try:
            tpkit.pipeline(model, world, pp=2, **kwargs)
        except ValueError as exc:
            out[key] = str(exc)
    after = model.state_dict()
    out["unchanged"] = after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    return out


def run_all(world, directory: str, root: str) -> dict:
    out = {"rank": world.rank, "cases": {c.name: run_case(world, c, directory, root) for c in CASES},
           "refused": refusals(world)}
    world.barrier()  # every rank's part of the checkpoint is written
    if world.rank == 0:  # one process reads the pieces back
        from safetensors.torch import load_file

        target = os.path.join(root, "consolidated")
        tpkit.consolidate(os.path.join(root, CASES[0].name), target, tokenizer=None)
        out["consolidated"] = {k: v for f in sorted(glob.glob(os.path.join(target, "*.safetensors")))
                               for k, v in load_file(f).items()}
    return out


def launch_all(root: str) -> list[dict]:
    """The one launch of 4 gloo processes; every rank's results in rank order."""
    directory = os.path.join(root, "hf-llama")
    llama().save_pretrained(directory)
    return tpkit.launch(run_all, 4, backend="gloo", args=(directory, root), pass_comm=True, timeout=120)
