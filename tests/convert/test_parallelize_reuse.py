"""Plan reuse in `parallelize` (and so in `from_pretrained`): a model whose blocks repeat is traced, planned and
dry-run cut to its distinct blocks, and the conversion equals the one the whole trace gives: the same recorded
plan, the same per-rank parameters, the same outputs and gradients (float64), at 2 and 3 ranks, on thread-ranks
and gloo processes; models whose blocks differ, overrides, and a dry run that keeps blocks whole included."""
from __future__ import annotations

import copy
import importlib
import logging

import pytest
import torch

pytest.importorskip("transformers")

import tpkit  # noqa: E402
from tpkit.comm.shapes import ShapeCommunicator  # noqa: E402
from tpkit.convert.planning.decide import trace_model  # noqa: E402
from tpkit.convert.state import ConversionState, read_request  # noqa: E402

from tests.convert.test_dryrun import Block as GroupedBlock, Model as GroupedModel, NeedsValues  # noqa: E402
from tests.convert.test_plan_reuse import _deeper, _Stack  # noqa: E402
from tests.models import hf, moe, zoo  # noqa: E402

REL = 1e-9


def _llama():
    return _deeper(hf.hf_model("llama")).double()


def _gemma2():  # layer_types alternate sliding / full attention
    return _deeper(zoo.gemma2(), 6).double()


def _dense_then_moe():  # a dense first block before MoE blocks
    return _deeper(moe.qwen2_moe(mlp_only_layers=[0]), 4).double()


def _gemma3():  # every sixth layer full attention; per-head q/k norms (replicated_with_grad_allreduce)
    import transformers as tr

    cfg = tr.Gemma3TextConfig(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=14,
                              num_attention_heads=6, num_key_value_heads=3, head_dim=8, sliding_window=4,
                              max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return tr.Gemma3ForCausalLM(cfg).double().eval()


def _bart():  # two lists of blocks (encoder, decoder), each cut
    import transformers as tr

    torch.manual_seed(0)
    return tr.BartForConditionalGeneration(tr.BartConfig(
        vocab_size=101, d_model=48, encoder_layers=5, decoder_layers=5, encoder_attention_heads=6,
        decoder_attention_heads=6, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)).double().eval()


def _post_norm_stack():  # pre- and post-norm blocks alternating
    torch.manual_seed(3)
    return _Stack("bpbpbpb").double()


def _grouped():  # the dry run keeps every attention whole
    torch.manual_seed(0)
    model = GroupedModel()
    model.layers = torch.nn.ModuleList([GroupedBlock() for _ in range(5)])
    return model.double()


BUILDERS = {"llama": _llama, "gemma2": _gemma2, "dense_then_moe": _dense_then_moe, "gemma3": _gemma3, "bart": _bart,
            "post_norm": _post_norm_stack, "grouped": _grouped}


def _inputs(model):
    if isinstance(model, GroupedModel):
        return (torch.randn(2, 5, 32, dtype=torch.double, generator=torch.Generator().manual_seed(1)),)
    g = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size if hasattr(model, "config") else 97
    return (torch.randint(2, vocab, (2, 6), generator=g),)


def _example(model):
    return _inputs(model) if isinstance(model, GroupedModel) else None


def _run(model, plan_arg, comm, reuse, mode="inference"):
    """Convert a copy with reuse on or off: (recorded plan, per-rank state, output, gradients)."""
    m = tpkit.parallelize(copy.deepcopy(model), plan_arg, comm, mode=mode, reuse=reuse, example_inputs=_example(model))
    out = m(*_inputs(model))
    out = out.logits if hasattr(out, "logits") else out
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
    state = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return m.tp_plan.to_dict(), state, out.detach(), grads


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _compare(on, off) -> list[str]:
    """What differs between the conversions with reuse on and off (nothing, for a sound reuse)."""
    (plan_on, state_on, out_on, grads_on), (plan_off, state_off, out_off, grads_off) = on, off
    bad = []
    if plan_on != plan_off:
        bad.append("plan")
    if state_on.keys() != state_off.keys() or any(not torch.equal(state_on[k], state_off[k]) for k in state_on):
        bad.append("state")
    if _rel(out_on, out_off) > REL:
        bad.append(f"output {_rel(out_on, out_off)}")
    if grads_on.keys() != grads_off.keys() or any(_rel(grads_on[k], grads_off[k]) > REL for k in grads_on):
        bad.append("grads")
    return bad


def _both(model, plan_arg, comm, mode="inference"):
    return _compare(_run(model, plan_arg, comm, True, mode), _run(model, plan_arg, comm, False, mode))


def _took_reuse(model, world, plan_arg="auto", mode="inference") -> bool:
    """Whether `parallelize`'s trace step takes the model cut to its distinct blocks."""
    m = copy.deepcopy(model)
    request = read_request(plan_arg, dict(m.named_modules()), world)
    return trace_model(ConversionState(m, ShapeCommunicator(0, world), mode, request, _example(model))).cut


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_reuse_converts_as_the_whole_trace_on_threads(name, world):
    model = BUILDERS[name]()
    assert _took_reuse(model, world)
    for bad in tpkit.comm.run_threads(lambda comm: _both(model, "auto", comm), world):
        assert not bad, bad


def test_the_dry_run_on_the_cut_keeps_every_block_whole():
    model = _grouped()
    plans = tpkit.comm.run_threads(lambda comm: _run(model, "auto", comm, True)[0], 2)
    for i in range(5):
        assert plans[0]["entries"][f"layers.{i}.attn.qkv_proj"] == "replicate"
        assert "converted forward fails" in plans[0]["reasons"][f"layers.{i}.attn.qkv_proj"]
        assert plans[0]["entries"][f"layers.{i}.up"] == "colwise"


def test_training_mode_and_overrides():
    model = _llama()
    uniform = {f"model.layers.*.mlp.{p}_proj": "replicate" for p in ("gate", "up", "down")}
    single = {f"model.layers.4.mlp.{p}_proj": "replicate" for p in ("gate", "up", "down")}
    assert _took_reuse(model, 2, mode="training") and _took_reuse(model, 2, uniform)
    assert not _took_reuse(model, 2, single)  # one block past the cut singled out: the whole trace plans
    for plan_arg, mode in (("auto", "training"), (uniform, "inference"), (single, "inference")):
        for bad in tpkit.comm.run_threads(lambda comm: _both(model, plan_arg, comm, mode), 2):
            assert not bad, (plan_arg, mode, bad)


def test_an_override_naming_no_module_raises_as_before():
    model = _llama()
    with pytest.raises(tpkit.convert.PlanError, match="names no module"):
        tpkit.parallelize(copy.deepcopy(model), {"model.layers.9.mlp": "replicate"}, ShapeCommunicator(0, 2))


def test_the_switches_and_one_kept_whole_notice(monkeypatch, caplog):
    par = importlib.import_module("tpkit.convert.planning.decide")  # where the trace step calls it
    model = hf.hf_model("llama", num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=4)
    calls = []
    real = par.analyze_structure
    monkeypatch.setattr(par, "analyze_structure", lambda *a, **k: calls.append(1) or real(*a, **k))
    caplog.set_level(logging.INFO, logger="tpkit")
    on = tpkit.comm.run_threads(lambda comm: tpkit.parallelize(copy.deepcopy(model), comm=comm).tp_plan.to_dict(), 3)
    assert not calls  # the whole model was not traced
    notices = [r.getMessage() for r in caplog.records if r.name.startswith("tpkit")]
    assert len(notices) == 1 and "16 modules split alone" in notices[0]
    monkeypatch.setenv("TPKIT_PLAN_REUSE", "0")
    caplog.clear()
    off = tpkit.comm.run_threads(lambda comm: tpkit.parallelize(copy.deepcopy(model), comm=comm).tp_plan.to_dict(), 3)
    assert calls and on == off
    assert [r.getMessage() for r in caplog.records if r.name.startswith("tpkit")] == notices


def _gloo_body(names):
    comm = tpkit.get_communicator()
    return {name: _both(BUILDERS[name](), "auto", comm) for name in names}


def test_reuse_converts_as_the_whole_trace_on_gloo():
    for result in tpkit.launch(_gloo_body, 2, backend="gloo", args=(["llama", "gemma2", "dense_then_moe"],),
                               timeout=300):
        assert all(not bad for bad in result.values()), result


BAD = ({"model.layers.*.mlp.down_proj": "replicate"},  # a split output into a whole layer (step 4 on the cut)
       {"model.layers.0.mlp.*": "colwise", "model.layers.0.mlp.*_proj": "rowwise"},
       {"model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce"})


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_override_raises_the_same_error_and_changes_nothing(bad):
    model = _llama()
    errors = []
    for reuse in (True, False):
        m = copy.deepcopy(model)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with pytest.raises(tpkit.convert.PlanError) as info:
            tpkit.parallelize(m, bad, ShapeCommunicator(0, 2), reuse=reuse)
        errors.append(str(info.value))
        assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
        assert model.model.layers.__len__() == len(m.model.layers)
    assert errors[0] == errors[1]


class _ValueStack(torch.nn.Module):
    """Blocks whose forward reads a value (`.item()`: no dry run on meta tensors, a real copy or none)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(NeedsValues() for _ in range(5))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_the_real_copy_rule_goes_by_the_whole_model(monkeypatch):
    """A model too large for a real-copy dry run is not dry-run, though its cut would be small enough."""
    torch.manual_seed(0)
    model, x = _ValueStack().double(), torch.randn(2, 5, 32, dtype=torch.double)
    dryrun = importlib.import_module("tpkit.convert.planning.dryrun")
    whole = sum(p.nbytes for p in model.parameters())
    for limit, dry_run in ((dryrun.REAL_COPY_BYTES, True), (whole // 2, False)):
        monkeypatch.setattr(dryrun, "REAL_COPY_BYTES", limit)
        plans = [tpkit.parallelize(copy.deepcopy(model), comm=ShapeCommunicator(0, 2), example_inputs=(x,),
                                   reuse=reuse).tp_plan.to_dict() for reuse in (True, False)]
        assert plans[0] == plans[1]
        assert (plans[0]["entries"]["layers.4.query"] == "replicate") == dry_run
