"""Stages by module names, in one process: each stage's module, run in order on what the previous returned, gives
the whole model's output (Llama with rotary embeddings, GPT-2 with learned positions added before its blocks, a
custom model), one stage per part and two interleaved stages per part; a part holds exactly its stages' keys, under
the whole model's names; the placeholders keep the plain settings models read off their layers."""
from __future__ import annotations

import copy

import pytest
import torch

from tpkit.pipeline import HeldElsewhere, split_stages
from tpkit.pipeline.stage import held_names, prune, stage_modules
from tests.pipeline.cases import batch, llama, qwen_tied
from tests.pipeline.test_split import Blocks, gpt2

MODELS = {"llama": llama, "qwen_tied": qwen_tied, "gpt2": gpt2, "custom": lambda: Blocks().to(torch.float64)}


def _whole(model, x):
    with torch.no_grad():
        out = model(x) if isinstance(model, Blocks) else model(input_ids=x)
    return out if isinstance(out, torch.Tensor) else out.logits


def _run_stages(model, stages: int, per_part: int, x):
    """Cut `model` into `stages` stages held by `stages / per_part` parts (stage s in part s % parts) and run them
    in order; returns the last stage's output and the parts."""
    split = split_stages(model, stages)
    parts_n = stages // per_part
    parts = [prune(copy.deepcopy(model), split, [s for s in range(stages) if s % parts_n == p])
             for p in range(parts_n)]
    modules = {s: m for p, part in enumerate(parts)
               for s, m in zip([s for s in range(stages) if s % parts_n == p],
                               stage_modules(part, split, [s for s in range(stages) if s % parts_n == p]))}
    h = x
    with torch.no_grad():
        for s in range(stages):
            h = modules[s](h)
    return h, parts, split


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("stages, per_part", [(2, 1), (3, 1), (4, 2)])
def test_stages_in_order_give_the_whole_models_output(name, stages, per_part):
    model = MODELS[name]()
    x = batch(0) % 16 if name == "custom" else batch(0)
    want = _whole(model, x)
    got, parts, split = _run_stages(model, stages, per_part, x)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (got - want).abs().max()


def test_a_part_holds_its_stages_keys_under_the_whole_models_names():
    model = llama()
    keys = set(model.state_dict())
    _, parts, split = _run_stages(model, 4, 2, batch(0))
    first, second = (set(p.state_dict()) for p in parts)
    assert not first & second and first | second == keys
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in second and "model.norm.weight" in second
    assert {k.split(".")[2] for k in first if k.startswith("model.layers.")} == \
        {str(i) for s in (0, 2) for i in split.stage_blocks(s)}
    holder = parts[0].model.layers[split.stage_blocks(1).start]
    assert isinstance(holder, HeldElsewhere) and holder.held_by == 1 and not list(holder.parameters())
    assert "held by stage 1" in repr(holder)


def test_placeholders_keep_the_settings_of_the_layer_they_replace():
    model = qwen_tied()
    split = split_stages(model, 2)
    layer = model.model.layers[3]
    layer.attention_type = "sliding_attention"  # models read settings like this one off their layers
    prune(model, split, [0])
    holder = model.model.layers[3]
    assert isinstance(holder, HeldElsewhere) and holder.attention_type == "sliding_attention"
    assert holder.kind == "block" and isinstance(model.lm_head, HeldElsewhere) and model.lm_head.kind == "after"
    assert held_names(split, [0]) == {"model.embed_tokens"} | {f"model.layers.{i}" for i in split.stage_blocks(0)}


def test_a_stage_shell_leaves_the_part_as_it_is():
    """Two stages on one part: each runs a shell whose containers hold placeholders where the other stage's blocks
    are; the part itself (its state dict, its hooks) is unchanged."""
    model = llama(4)
    split = split_stages(model, 4)
    part = prune(model, split, [0, 2])
    before = dict(part.state_dict(keep_vars=True))
    first, third = stage_modules(part, split, [0, 2])
    assert first.module is not part and first.module.model.layers is not part.model.layers
    assert isinstance(first.module.model.layers[2], HeldElsewhere) and not isinstance(part.model.layers[2],
                                                                                      HeldElsewhere)
    assert first.module.model.layers[0] is part.model.layers[0]  # the same layers, not copies
    assert dict(part.state_dict(keep_vars=True)).keys() == before.keys()
    assert all(part.state_dict(keep_vars=True)[k] is v for k, v in before.items())
