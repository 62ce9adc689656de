"""One check body for the coverage tests: a converted model's forward and one AdamW step, in float64, equal the
unconverted model's on every rank (thread-ranks through `tpkit.launch`).

The model is built once, outside the ranks, and deep-copied per rank (thread-ranks share torch's global RNG).
Errors are relative: outputs to their largest magnitude; gradients and updated weights to the tensor's own
largest magnitude, floored (some gradients are zero in theory, a key bias for instance, and hold only
rounding noise; a weight's floor is the step size, as Adam's first step moves every weight by about lr).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import tpkit
from tpkit.convert.verify import named_tensors

LR = 1e-2
#: Styles of a layer whose output stays whole: replicated, or split alone with its output all-gathered (a layer the
#: planner could not pair; `tpkit/convert/families/lone_layers.py`).
UNPAIRED = ("replicate", "colwise_rep")


def call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)


def weighted_loss(out: Any) -> torch.Tensor:
    """Every floating output element with its own fixed weight (a plain sum would hide errors that cancel)."""
    total = 0.0
    for t in named_tensors(out).values():
        w = torch.randn(t.shape, generator=torch.Generator().manual_seed(1234), dtype=t.dtype)
        total = total + (t * w).sum()
    return total


def _rel(got: torch.Tensor | None, want: torch.Tensor, floor: float = 0.0) -> float:
    if got is None or got.shape != want.shape:
        return float("inf")
    if not want.numel():
        return 0.0
    scale = max(want.detach().abs().max().item(), floor)
    err = (got.detach() - want.detach()).abs().max().item()
    return err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))


def _no_grad_outputs(model: nn.Module, inputs: Any) -> dict:
    with torch.no_grad():
        return {f"no_grad {k}": v for k, v in named_tensors(call(model, inputs)).items()}


def reference(model: nn.Module, inputs: Any, train: bool = False, grad: bool = True) -> dict:
    """The unconverted model's outputs (also under `no_grad` when `grad` is False: fused fast paths run
    there), gradients and weights after one AdamW step."""
    ref = copy.deepcopy(model).train(train)
    outs = {} if grad else _no_grad_outputs(ref, inputs)
    out = call(ref, inputs)
    outs.update({k: v.detach() for k, v in named_tensors(out).items()})
    weighted_loss(out).backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    torch.optim.AdamW(ref.parameters(), lr=LR).step()
    after = {n: p.detach() for n, p in ref.named_parameters()}
    top = max((g.abs().max().item() for g in grads.values()), default=0.0)
    # A gradient that is zero but for rounding (a key bias: softmax ignores it) has no direction; AdamW divides it by
    # its own size, so its step is rounding noise scaled up to ~1e-9 of the learning rate: such steps are not compared
    noise = {n for n, g in grads.items() if g.abs().max().item() <= 1e-12 * top}
    return {"outputs": outs, "grads": grads, "after": after, "grad_floor": 1e-3 * top, "noise": noise}


def rank_errors(copies: list, inputs: Any, ref: dict, plan: Any = "auto", train: bool = False,
                grad: bool = True) -> dict:
    """On one rank: convert its copy, compare outputs, gradients and the weights after one AdamW step."""
    comm = tpkit.get_communicator()
    model = copies[comm.rank]
    tpkit.parallelize(model, plan, comm, example_inputs=inputs)
    model.train(train)
    got = {} if grad else _no_grad_outputs(model, inputs)
    out = call(model, inputs)
    got.update(named_tensors(out))
    errs = {f"out {k}": _rel(got.get(k), v) for k, v in ref["outputs"].items()}
    weighted_loss(out).backward()
    layouts = tpkit.shard_layouts(model)
    for n, p in model.named_parameters():
        if n in ref["grads"]:
            want = layouts[n].shard(ref["grads"][n])
            errs[f"grad {n}"] = _rel(p.grad, want, ref["grad_floor"])
    torch.optim.AdamW(model.parameters(), lr=LR).step()
    for n, p in model.named_parameters():
        if n not in ref["noise"]:
            errs[f"step {n}"] = _rel(p, layouts[n].shard(ref["after"][n]), LR)
    local = sum(torch.Size(lay.local_shape).numel() for lay in layouts.values())
    full = sum(torch.Size(lay.full_shape).numel() for lay in layouts.values())
    return {"errors": errs, "share": local / full, "plan": model.tp_plan if hasattr(model, "tp_plan") else None}


def check(model: nn.Module, inputs: Any, world_size: int, plan: Any = "auto", train: bool = False,
          grad: bool = True, tol: float = 1e-6, backend: str = "threads") -> list[dict]:
    """Run `rank_errors` on `world_size` ranks (threads, or gloo processes); assert every error is within `tol`;
    the per-rank results. `train` picks the mode; `grad=False` also compares a forward under `torch.no_grad()`."""
    return check_each([(model, inputs)], world_size, plan, train, grad, tol, backend)[0]


def rank_errors_each(cases: list) -> list[dict]:
    """`rank_errors` of each of `cases` (its `rank_errors` arguments), one after the other on the same ranks."""
    return [rank_errors(*case) for case in cases]


def check_each(models: list, world_size: int, plan: Any = "auto", train: bool = False, grad: bool = True,
               tol: float = 1e-6, backend: str = "threads") -> list[list[dict]]:
    """`check` of each (model, inputs) of `models` in one launch of the ranks (one start of the gloo processes for
    all): per model, the per-rank results."""
    cases = [([copy.deepcopy(model) for _ in range(world_size)], inputs,
              reference(model, inputs, train, grad), plan, train, grad) for model, inputs in models]
    per_rank = tpkit.launch(rank_errors_each, world_size, backend=backend, args=(cases,),
                            **({"timeout": 240} if backend != "threads" else {}))
    out = []
    for i in range(len(cases)):
        results = [r[i] for r in per_rank]
        for rank, r in enumerate(results):
            bad = {k: v for k, v in r["errors"].items() if not v <= tol}
            assert not bad, f"rank {rank} of {world_size}: errors above {tol}: {dict(list(bad.items())[:6])}"
        out.append(results)
    return out
