"""A step traced once per process (`tpkit.estimate.trace_memo`): asked again for the same config, split and shapes,
the estimate reuses the trace; anything a trace is made of that changes (a config field, the dtype, the split, the
local batch, a family registered) traces again, and a module the key cannot stand for is traced every time. Every
reused figure is checked against a fresh trace's."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers as tr  # noqa: E402

from tpkit.convert import Family, register_family, unregister_family  # noqa: E402
from tpkit.estimate import predict as predict_module, trace_memo  # noqa: E402
from tpkit.estimate.predict import Setup, trace_setup  # noqa: E402
from tpkit.estimate.search import search  # noqa: E402

from ..conftest import synthetic_profile  # noqa: E402


def llama(layers: int = 3, ff: int = 64) -> tr.LlamaConfig:
    return tr.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=ff, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture
def traces(monkeypatch):
    """The traces made from here on (each call of `trace_step`), with nothing kept from before."""
    trace_memo.forget()
    made = []
    real = predict_module.trace_step
    monkeypatch.setattr(predict_module, "trace_step", lambda *a, **k: made.append(a[2:4]) or real(*a, **k))
    yield made
    trace_memo.forget()


def _figures(traced) -> list:
    return [(n, t.ops, t.collectives, t.saved_bytes, t.peak_bytes) for n, t in traced.rows]


def test_the_same_step_is_traced_once_and_is_what_a_fresh_trace_gives(traces):
    first = trace_setup(llama(), Setup(2), "train", 2, 16, dtype=torch.float32)
    assert len(traces) == 2  # 1 and 2 layers, extrapolated to 3
    again = trace_setup(llama(), Setup(2), "train", 2, 16, dtype=torch.float32)  # an equal config, a new object
    assert again is first and len(traces) == 2
    trace_memo.forget()
    fresh = trace_setup(llama(), Setup(2), "train", 2, 16, dtype=torch.float32)
    assert fresh is not first and len(traces) == 4 and _figures(fresh) == _figures(first)


@pytest.mark.parametrize("change", ["config", "dtype", "split", "local batch", "seq", "goal", "attention"])
def test_whatever_a_trace_is_made_of_changes_traces_again(traces, change):
    base = dict(config=llama(), setup=Setup(2), goal="decode", batch=2, seq=8, dtype=torch.float32, attention=None)
    other = dict(base, **{"config": dict(config=llama(ff=96)), "dtype": dict(dtype=torch.bfloat16),
                          "split": dict(setup=Setup(1)),
                          "local batch": dict(setup=Setup(2, 2, "replicas")),  # 1 row per replica
                          "seq": dict(seq=4), "goal": dict(goal="prefill"),
                          "attention": dict(attention="eager")}[change])

    def traced(a):
        return trace_setup(a["config"], a["setup"], a["goal"], a["batch"], a["seq"], dtype=a["dtype"],
                           attention=a["attention"])
    before = traced(base)
    after = traced(other)
    assert after is not before and len(traces) == 4 and _figures(after) != _figures(before)


def test_setups_alike_in_their_split_and_local_batch_share_a_trace(traces):
    """DP mode and recompute are priced, not traced; dp replicas at the same local batch trace the same step."""
    one = trace_setup(llama(), Setup(1, 2, "ddp", recompute="full"), "train", 4, 16, dtype=torch.float32)
    two = trace_setup(llama(), Setup(1, 2, "fsdp"), "train", 4, 16, dtype=torch.float32)
    three = trace_setup(llama(), Setup(1), "train", 2, 16, dtype=torch.float32)
    assert one is two is three and len(traces) == 2


def test_a_module_without_a_key_is_traced_each_time(traces):
    """A module of at most two layers is traced as it is (its own weights and code): nothing kept."""
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(llama(layers=2))
    first = trace_setup(model, Setup(2), "decode", 1, 8)
    second = trace_setup(model, Setup(2), "decode", 1, 8)
    assert first is not second and len(traces) == 2 and _figures(first) == _figures(second)


def test_a_split_the_planner_refuses_is_refused_again_without_a_trace(monkeypatch):
    from tpkit.convert import PlanError

    trace_memo.forget()
    tries = []

    def refuse(*a, **k):
        tries.append(1)
        raise PlanError("no such split")
    monkeypatch.setattr(predict_module, "trace_step", refuse)
    for _ in range(2):
        with pytest.raises(PlanError, match="no such split"):
            trace_setup(llama(), Setup(2), "train", 2, 16, dtype=torch.float32)
    assert len(tries) == 1
    monkeypatch.setattr(predict_module, "trace_step", lambda *a, **k: tries.append(1) or 1 / 0)
    for _ in range(2):  # any other error: not kept
        with pytest.raises(ZeroDivisionError):
            trace_setup(llama(), Setup(2), "train", 2, 8, dtype=torch.float32)
    assert len(tries) == 3
    trace_memo.forget()


class _Nothing(Family):
    name = "test_trace_memo_nothing"
    styles = ()

    def detect(self, analysis):
        return []

    def propose(self, draft, found):
        return iter(())


def test_a_family_registered_since_traces_again(traces):
    first = trace_setup(llama(), Setup(2), "decode", 1, 8, dtype=torch.float32)
    family = register_family(_Nothing())
    try:
        second = trace_setup(llama(), Setup(2), "decode", 1, 8, dtype=torch.float32)
    finally:
        unregister_family(family.name)
    third = trace_setup(llama(), Setup(2), "decode", 1, 8, dtype=torch.float32)
    assert len({id(first), id(second), id(third)}) == 3 and len(traces) == 6


def test_only_the_most_recent_traces_are_kept(traces, monkeypatch):
    monkeypatch.setattr(trace_memo, "KEEP", 2)
    for seq in (4, 8, 12):
        trace_setup(llama(), Setup(1), "decode", 1, seq, dtype=torch.float32)
    assert len(trace_memo._KEPT) == 2 and len(traces) == 6
    trace_setup(llama(), Setup(1), "decode", 1, 12, dtype=torch.float32)  # kept
    trace_setup(llama(), Setup(1), "decode", 1, 4, dtype=torch.float32)  # dropped first: traced again
    assert len(traces) == 8


def test_a_search_priced_from_kept_traces_is_the_search_priced_afresh(traces):
    """The first search traces afresh (nothing kept), the second reads every trace kept: the same ranking, to the
    last second and byte."""
    profile = synthetic_profile()
    first = search(llama(), 2, "decode", batch_size=2, seq_len=8, profile=profile, dtype=torch.float32)
    made = len(traces)
    again = search(llama(), 2, "decode", batch_size=2, seq_len=8, profile=profile, dtype=torch.float32)
    assert made and len(traces) == made
    assert [(c.setup.label(), c.prediction) for c in first.candidates] == \
        [(c.setup.label(), c.prediction) for c in again.candidates]
