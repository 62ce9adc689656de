"""House rule of the straight path (issue 55): one conversion enters each of its steps once, in order. Every way a
model reaches `parallelize` is converted under the rule (a re-entered step raises `StepReentered`), and the rule
itself is shown to catch a re-entry."""
from __future__ import annotations

import copy
import importlib
import threading

import pytest

pytest.importorskip("transformers")

import tpkit  # noqa: E402
from tpkit.convert.planning import decide  # noqa: E402
from tpkit.convert.state import StepReentered, step, steps_once  # noqa: E402

from tests.models import hf  # noqa: E402

parallelize_module = importlib.import_module("tpkit.convert.parallelize")  # (the package exports the function)

ORDER = ("without_adapters", "begin", "trace_model", "make_plan", "dry_run_plan", "check_dataflow", "expand_plan",
         "quantization_units", "lay_out", "build_and_swap", "record", "rewrap_adapters", "check_gradients")


def _entered(monkeypatch) -> dict[int, list[str]]:
    """Every step each thread-rank's conversion enters, in order (the marked step functions wrapped where
    `parallelize` calls them)."""
    seen: dict[int, list[str]] = {}
    for name in dir(parallelize_module):
        fn = getattr(parallelize_module, name)
        if getattr(fn, "conversion_step", False):
            def spy(*args, _fn=fn, _name=name, **kwargs):
                seen.setdefault(threading.get_ident(), []).append(_name)
                return _fn(*args, **kwargs)
            monkeypatch.setattr(parallelize_module, name, spy)
    return seen


def _convert(model, world=2, **kwargs):
    copies = [copy.deepcopy(model) for _ in range(world)]
    return tpkit.run_threads(lambda comm: tpkit.parallelize(copies[comm.rank], comm=comm, **kwargs), world)


def test_a_plain_llama_enters_each_step_once_in_order(monkeypatch):
    seen = _entered(monkeypatch)
    _convert(hf.hf_model("llama"))
    assert len(seen) == 2 and all(steps == list(ORDER) for steps in seen.values()), seen


@pytest.mark.parametrize("plan", ["auto", {"lm_head": "replicate"}, {"model.layers.*.mlp.*": "replicate"}])
def test_overrides_and_a_recorded_plan_enter_no_step_twice(plan):
    model = hf.hf_model("llama")
    plans = [m.tp_plan for m in _convert(model, plan=plan)]  # StepReentered would raise here
    again = _convert(model, plan=plans[0], recorded=True)
    assert again[0].tp_plan.to_dict() == plans[0].to_dict()


def test_a_peft_lora_model_enters_no_step_twice():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(hf.hf_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    converted = _convert(model)
    assert type(converted[0].base_model.model.model.layers[0].self_attn.q_proj).__name__ == "ColumnParallelLoraLinear"


def test_a_second_entry_of_a_step_is_caught():
    calls = []

    @step
    def once(x):
        calls.append(x)
        return x

    with steps_once():
        once(1)
        with pytest.raises(StepReentered, match="'once' entered twice"):
            once(2)
        with steps_once():  # a conversion inside another has its own scope
            once(3)
    once(4)  # outside any conversion, a step is a plain function
    assert calls == [1, 3, 4]


def test_reentering_the_plan_step_inside_parallelize_raises(monkeypatch):
    twice = decide.make_plan

    def again(s):
        return twice(twice(s))

    monkeypatch.setattr(parallelize_module, "make_plan", again)
    with pytest.raises(StepReentered, match="make_plan"):
        _convert(hf.hf_model("llama"), world=2)
