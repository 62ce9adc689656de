"""`plan=` strings that are neither a plan word nor a file: a PlanError that lists what is accepted (issue 20
item 4), raised before the model changes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import tpkit
from tpkit.convert import PlanError, parallelize, plan, verify
from tpkit.convert.plan import PLAN_WORDS


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _raises(plan_arg) -> str:
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PlanError) as info:
        parallelize(model, plan_arg)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(type(m) in (nn.Sequential, nn.Linear, nn.ReLU) for m in model.modules())
    return str(info.value)


def test_a_misspelt_word_suggests_the_close_one_and_lists_the_accepted_forms():
    text = _raises("autoo")
    assert "'autoo'" in text and "did you mean 'auto'?" in text
    for form in ("'auto'", "plan JSON file", "mapping", "Plan"):
        assert form in text, (form, text)
    assert not isinstance(PlanError(""), FileNotFoundError)


def test_a_style_name_alone_says_styles_are_given_per_module():
    for style in ("colwise", "rowwise", "replicate"):
        text = _raises(style)
        assert "style is given per module" in text and f"{{'*.q_proj': '{style}'}}" in text, text
        assert "did you mean" not in text


def test_a_string_far_from_any_word_has_no_suggestion():
    text = _raises("my_plan.json")
    assert "neither a known word nor an existing file" in text and "did you mean" not in text
    text = _raises(Path("/nonexistent/plan.json"))
    assert "no plan file at '/nonexistent/plan.json'" in text


def test_verify_checks_the_plan_argument_too():
    with pytest.raises(PlanError, match="did you mean 'auto'"):
        verify(_mlp, torch.zeros(2, 8), world_size=2, plan="Auto")


def test_the_accepted_forms_still_work(tmp_path):
    assert PLAN_WORDS == ("auto",)
    model = _mlp()
    p = plan(model, 1)
    p.save(tmp_path / "p.json")
    for arg in ("auto", str(tmp_path / "p.json"), tmp_path / "p.json", p, {"0": "colwise", "2": "rowwise"}):
        m = parallelize(_mlp(), arg)
        assert isinstance(m.tp_plan, tpkit.convert.Plan)
