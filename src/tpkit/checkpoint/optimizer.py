"""Optimizer state as checkpoint tensors keyed by parameter name, so it reshards like the parameters.

A state tensor shaped like its parameter (AdamW's `exp_avg`, `exp_avg_sq`, SGD's momentum) has the
parameter's layout; any other tensor (AdamW's scalar `step`) is replicated. Keys are
`optimizer/<parameter key>/<state name>`; non-tensor state and the param groups' hyperparameters go to the
manifest as JSON, the groups' parameters as keys.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from ..layout import ShardLayout

PREFIX = "optimizer/"


def named_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    yield from model.named_parameters()


def state_tensors(model: nn.Module, optimizer, layouts: dict[str, ShardLayout], skip: set[str] = frozenset()):
    """`({key: (tensor, layout)}, manifest section)` of `optimizer`'s state on this rank (none for the parameters
    named in `skip`: copies of another's, whose state is the other's)."""
    tensors, section = {}, {"state": {}, "param_groups": []}
    names = {id(p): n for n, p in named_params(model) if n not in skip}
    for name, p in named_params(model):
        st = optimizer.state.get(p)
        if not st or name in skip:
            continue
        rec = section["state"][name] = {}
        for sname, v in st.items():
            if isinstance(v, torch.Tensor):
                lay = layouts[name] if tuple(v.shape) == tuple(p.shape) else ShardLayout.replicated(
                    v.shape, layouts[name].world_size, layouts[name].rank)
                tensors[f"{PREFIX}{name}/{sname}"] = (v.detach(), lay)
                rec[sname] = {"tensor": f"{PREFIX}{name}/{sname}"}
            else:
                rec[sname] = {"value": v}
    for g in optimizer.param_groups:
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"
                 and isinstance(v, (int, float, bool, str, tuple, list, type(None)))}
        section["param_groups"].append({**hyper, "params": [names[id(p)] for p in g["params"] if id(p) in names]})
    return tensors, section


def merge_sections(a: dict, b: dict) -> dict:
    """Two optimizer sections of disjoint parameters (two pipeline stages') as one: the states together, each param
    group's parameters in order (the hyperparameters are the same)."""
    if not a or not b:
        return dict(a or b)
    groups = [dict(g, params=list(g["params"]) + [p for p in h["params"] if p not in g["params"]])
              for g, h in zip(a["param_groups"], b["param_groups"])]
    return {"state": {**a["state"], **b["state"]}, "param_groups": groups}


def saved_state(section: dict, name: str, copies: dict[str, str]) -> dict | None:
    """The saved state of parameter `name`, or of the one it copies (`copies`: a pipeline's tied weight)."""
    state = section.get("state", {})
    return state.get(name) if name in state else state.get(copies.get(name, ""))


def state_targets(model: nn.Module, section: dict, layouts: dict[str, ShardLayout], entries: dict,
                  copies: dict[str, str] | None = None):
    """`[(key, layout, dtype)]` of every saved state tensor this model's parameters need (the parameter's
    layout when the saved tensor has the parameter's full shape, replicated otherwise). The dtype is the one
    torch's `Optimizer.load_state_dict` gives: a floating parameter's (a run saved in bf16 resumes in float32
    with float32 moments), except for `step`, which keeps its own. `copies`: parameters whose state is another's."""
    out, seen = [], set()
    params = dict(named_params(model))
    for name in params:
        rec = saved_state(section, name, copies or {})
        if rec is None:
            continue
        for sname, d in rec.items():
            if "tensor" in d and d["tensor"] in entries and d["tensor"] not in seen:  # a copy's: read once
                seen.add(d["tensor"])
                e = entries[d["tensor"]]
                lay = layouts[name] if e.shape == layouts[name].full_shape else ShardLayout.replicated(
                    e.shape, layouts[name].world_size, layouts[name].rank)
                p = params[name]
                cast = sname != "step" and p.is_floating_point() and e.dtype.is_floating_point
                out.append((d["tensor"], lay, p.dtype if cast else e.dtype))
    return out


def restore(model: nn.Module, optimizer, section: dict, values: dict[str, torch.Tensor],
            place: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda value, param: value,
            copies: dict[str, str] | None = None) -> None:
    """Put the loaded state into `optimizer` (its current state for these parameters is replaced) and the
    saved hyperparameters into its param groups (matched by position). `place(value, param)` turns a loaded
    tensor into the form the optimizer keeps (an FSDP2 shard for a sharded parameter). `copies`: parameters whose
    state is another's (each gets its own tensors)."""
    for name, p in named_params(model):
        rec = saved_state(section, name, copies or {})
        if rec is None:
            continue
        state = {}
        for sname, d in rec.items():
            if "tensor" not in d:
                state[sname] = d["value"]
                continue
            value = values[d["tensor"]]
            state[sname] = place(value.clone() if name in (copies or {}) else value, p)  # a copy's own tensors
        optimizer.state[p] = state
    for g, saved in zip(optimizer.param_groups, section.get("param_groups", [])):
        for k, v in saved.items():
            if k != "params" and k in g:
                g[k] = tuple(v) if isinstance(g[k], tuple) else v
