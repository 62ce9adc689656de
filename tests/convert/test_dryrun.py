"""The dry run (issue 20 item 8): a model whose forward reshapes a packed projection with a hard-coded group
count must not crash after conversion; the block stays whole with the reason, a user's plan is refused."""
from __future__ import annotations

import copy
import dataclasses
import importlib

import pytest
import torch
from torch import nn

import tpkit
from tpkit.comm import run_threads
from tpkit.comm.shapes import ShapeCommunicator
from tpkit.convert.errors import PlanError


class GroupedQKV(nn.Module):
    """A packed qkv projection viewed as 4 groups of (q, v, k) by a constant computed at construction."""

    def __init__(self, heads: int = 4, head_dim: int = 8):
        super().__init__()
        d = heads * head_dim
        self.qkv_proj = nn.Linear(d, 3 * d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.num_attention_heads, self.head_dim, self.group_dim = heads, head_dim, d // 4

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv_proj(x).reshape(b, t, 4, -1)  # 4: the hard-coded group count
        q, v, k = torch.split(qkv, self.group_dim, dim=-1)
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        a = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        return self.out_proj(a.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = GroupedQKV()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _model():
    torch.manual_seed(0)
    return Model().double(), torch.randn(2, 5, 32, dtype=torch.double)


@pytest.mark.parametrize("world", [2, 3])
def test_a_block_that_fails_on_the_dry_run_stays_whole_with_the_reason(world):
    model, x = _model()
    ref = model(x)

    def body(comm):
        m = tpkit.parallelize(copy.deepcopy(model), comm=comm, example_inputs=(x,))
        return m(x), dict(m.tp_plan.entries), m.tp_plan.reasons

    results = run_threads(body, world)
    for out, entries, reasons in results:
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for i in (0, 1):  # every repeated block: the attention whole, the MLP still split
            assert entries[f"layers.{i}.attn.qkv_proj"] == "replicate"
            assert "converted forward fails" in reasons[f"layers.{i}.attn.qkv_proj"]
            assert entries[f"layers.{i}.up"] == "colwise"
    assert len({tuple(sorted(e.items())) for _, e, _ in results}) == 1  # every rank the same plan


def test_a_user_plan_that_fails_the_dry_run_is_refused_before_any_change():
    model, x = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = tpkit.plan(model, 2, example_inputs=(x,))
    assert plan["layers.0.attn.qkv_proj"] == "colwise"

    for rank in (0, 1):  # no data moves before the refusal: a shapes-only communicator stands for the ranks
        with pytest.raises(PlanError, match="dry run"):
            tpkit.parallelize(model, plan, comm=ShapeCommunicator(rank, 2), example_inputs=(x,))
    assert all(type(m) in (Model, Block, GroupedQKV, nn.Linear, nn.ModuleList) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_shape_communicator_returns_this_ranks_shapes():
    comm = ShapeCommunicator(2, 3)
    t = torch.empty(7, 4, device="meta")
    assert comm.all_reduce(t).shape == (7, 4)
    assert comm.all_gather(t, dim=1).shape == (7, 12)
    assert comm.all_gather(t, dim=0, sizes=[8, 8, 7]).shape == (23, 4)
    assert comm.reduce_scatter(t, dim=0).shape == (2, 4)


class NeedsValues(nn.Module):
    """Longformer's pattern: the forward reads a value (`.item()`, so it cannot run on meta tensors) and checks
    the hidden size against an attribute the converter sets to the local size."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.out = nn.Linear(32, 32)
        self.num_heads, self.head_dim, self.embed_dim = 4, 8, 32

    def forward(self, x):
        b, t, d = x.shape
        assert d == self.embed_dim, f"hidden_states should have embed_dim = {self.embed_dim}, but has {d}"
        pad = int((x.abs().sum() > -1).item())  # a value the forward needs: always 1
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.query, self.key, self.value))
        a = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        return self.out(a.transpose(1, 2).reshape(b, t, -1)) * pad


def test_a_forward_that_needs_values_is_dry_run_on_a_real_copy():
    torch.manual_seed(0)
    model, x = nn.Sequential(NeedsValues(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).double(), \
        torch.randn(2, 5, 32, dtype=torch.double)
    ref = model(x)

    def body(comm):
        m = tpkit.parallelize(copy.deepcopy(model), comm=comm, example_inputs=(x,))
        return m(x), m.tp_plan

    for out, plan in run_threads(body, 2):
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        assert plan["0.query"] == plan["0.out"] == "replicate"  # the pair stays whole together
        assert "embed_dim" in plan.reasons["0.out"]
        assert plan["1"] == "colwise"


class CachesInEval(nn.Module):
    """Levit's pattern: in eval mode the forward caches a tensor computed from a parameter, in a dict."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.bias = nn.Parameter(torch.randn(8))
        self.cache = {}

    def forward(self, x):
        if self.training:
            b = self.bias * 2
        else:
            b = self.cache.setdefault("b", self.bias * 2)
        return self.down(torch.relu(self.up(x))) + b


def test_the_trace_leaves_no_cache_behind():
    from tpkit.convert.trace import analyze_structure

    model = CachesInEval().double().eval()
    analyze_structure(model, (torch.randn(3, 8, dtype=torch.double),))
    assert model.cache == {}
    model(torch.randn(3, 8, dtype=torch.double)).sum().backward()
    assert model.bias.grad is not None


class Uncopyable(Model):
    """A model that refuses a deep copy (a handle to something outside Python, say)."""

    def __deepcopy__(self, memo):
        raise TypeError("cannot deep-copy this model")


def test_a_model_that_cannot_be_copied_is_converted_without_a_dry_run():
    torch.manual_seed(0)
    model, x = Uncopyable().double(), torch.randn(2, 5, 32, dtype=torch.double)
    plan = tpkit.parallelize(model, comm=ShapeCommunicator(0, 2), example_inputs=(x,)).tp_plan
    assert plan["layers.0.attn.qkv_proj"] == "colwise"  # no dry run kept it whole


def test_a_forward_that_needs_values_on_a_large_model_is_not_dry_run(monkeypatch):
    """Its forward cannot run on meta tensors and a real copy would cost too much: converted as planned."""
    dryrun = importlib.import_module("tpkit.convert.planning.dryrun")
    monkeypatch.setattr(dryrun, "REAL_COPY_BYTES", 1)
    torch.manual_seed(0)
    model, x = nn.Sequential(NeedsValues(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).double(), \
        torch.randn(2, 5, 32, dtype=torch.double)
    plan = tpkit.parallelize(model, comm=ShapeCommunicator(0, 2), example_inputs=(x,)).tp_plan
    assert plan["0.query"] == "colwise" and "0.query" not in plan.reasons


def _copies_run(monkeypatch) -> list[bool]:
    """Records, for each forward the dry run makes, whether it ran on meta tensors."""
    dryrun = importlib.import_module("tpkit.convert.planning.dryrun")
    kinds, run = [], dryrun._run

    def recorded(model, inputs, on_meta):
        kinds.append(on_meta)
        return run(model, inputs, on_meta)
    monkeypatch.setattr(dryrun, "_run", recorded)
    return kinds


def test_a_tiny_model_is_dry_run_on_a_real_copy_first_meta_weights_as_zeros(monkeypatch):
    """Meta kernels are Python: a tiny model's forward is ~15x cheaper on real tensors. A model on the meta device is
    run there with zeros for weights; above `REAL_FIRST_BYTES` the meta run alone, and the same plan either way."""
    dryrun = importlib.import_module("tpkit.convert.planning.dryrun")
    kinds = _copies_run(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).double()
    x = torch.randn(2, 5, 32, dtype=torch.double)
    meta = copy.deepcopy(model).to("meta")
    plans = []
    for limit in (dryrun.REAL_FIRST_BYTES, 0):
        monkeypatch.setattr(dryrun, "REAL_FIRST_BYTES", limit)
        for m, inputs in ((copy.deepcopy(model), x), (copy.deepcopy(meta), x.to("meta"))):
            kinds.clear()
            plans.append(tpkit.parallelize(m, comm=ShapeCommunicator(0, 3), example_inputs=(inputs,)).tp_plan.to_dict())
            assert kinds and all(k is (limit == 0) for k in kinds), (limit, kinds)
            assert all(p.device == m[0].weight.device for p in m.parameters())  # the model itself stays where it was
    assert plans[0]["entries"] == {"0": "colwise", "2": "rowwise"} and all(p == plans[0] for p in plans)


class FailsOffMeta(nn.Module):
    """A forward that fails on real tensors only: the real-copy run first cannot pass it."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        if x.device.type != "meta":
            raise RuntimeError("runs on meta tensors only")
        return self.down(torch.relu(self.up(x)))


def test_a_failure_on_the_real_copy_first_is_decided_on_meta_tensors(monkeypatch):
    """Only a clean pass on the real copy is taken: a failure there (here a forward that runs on meta tensors only)
    is decided by the meta run, which keeps the plan as it would without the real copy first."""
    kinds = _copies_run(monkeypatch)
    x = torch.randn(2, 5, 32, device="meta")
    plan = tpkit.parallelize(FailsOffMeta().to("meta"), comm=ShapeCommunicator(0, 2), example_inputs=(x,)).tp_plan
    assert kinds[0] is False and True in kinds
    assert plan["up"] == "colwise" and plan["down"] == "rowwise" and not plan.reasons.get("up")


@dataclasses.dataclass
class GaveUp(NotImplementedError):
    """A dataclass exception: it defines __eq__, so it cannot be hashed."""

    reason: str


class FastPath(nn.Module):
    """An optional fast path holding layers of its own: it starts, then gives up (raises), and its caller falls
    back, as a model with a kernel it cannot always use does."""

    def __init__(self):
        super().__init__()
        self.proj, self.back = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        self.proj(x)
        raise GaveUp("no fast path for this input")


class FallbackBlock(nn.Module):
    """Tries its fast path, then, in its own code, a gated MLP whose hidden features it views as 4 groups of a
    value and a gate of 8 each (a size fixed at construction: it fails once `up` is split)."""

    def __init__(self):
        super().__init__()
        self.fast = FastPath()
        self.up, self.down, self.half = nn.Linear(32, 64), nn.Linear(32, 32), 8

    def forward(self, x):
        try:
            return self.fast(x)
        except NotImplementedError:
            pass
        value, gate = torch.split(self.up(x).reshape(*x.shape[:-1], 4, -1), self.half, dim=-1)
        return x + self.down((value * gate.sigmoid()).flatten(-2))


def test_a_failure_is_placed_where_it_happened_not_in_a_child_that_raised_and_was_caught():
    """A child that raised and whose caller caught it has left the forward: a later failure in the caller's own
    code is the caller's, not the child's."""
    from tpkit.convert.planning import dryrun

    torch.manual_seed(0)
    model = nn.Sequential(FallbackBlock()).double()
    model[0].up = nn.Linear(32, 48).double()  # 48 features: groups of 12, not a value and a gate of 8
    running, error = dryrun._run(model, (torch.randn(2, 32, dtype=torch.double),), on_meta=False)
    assert running == ("", "0") and error.startswith("RuntimeError")

