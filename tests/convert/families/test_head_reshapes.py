"""A packed q/k/v cut into heads by a size the forward computes from a width and a constant (CodeGen's
`embed_dim // mp_num` with `mp_num = 4` in its forward) must not be split silently wrong: the dry run sees the
head size change and keeps the block whole. The same block cut by its head count splits, exactly."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tpkit
from tpkit.comm import run_threads
from tpkit.convert.planning import dryrun
from tpkit.convert.planning.head_reshapes import HeadReshapes, from_trace
from tpkit.convert.trace.dataflow import trace


class PackedAttention(nn.Module):
    """[groups, q | v | k of the group's heads, head_dim] packed, as CodeGen lays it out."""

    def __init__(self, d: int = 32, heads: int = 4, constant_groups: bool = True):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = d, heads, d // heads
        self.constant_groups = constant_groups
        self.qkv_proj, self.out_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        groups = 4 if self.constant_groups else self.num_heads  # the constant is the bug's pattern
        local = self.embed_dim // groups
        qkv = self.qkv_proj(x).view(b, t, -1, 3 * local)
        q, v, k = qkv.split(local, dim=-1)
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, constant_groups: bool):
        super().__init__()
        self.attn = PackedAttention(constant_groups=constant_groups)
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("constant_groups", [True, False])
def test_a_head_size_from_a_constant_is_kept_whole_and_the_rest_is_exact(world, constant_groups):
    torch.manual_seed(0)
    model = Block(constant_groups).double()
    x = torch.randn(2, 5, 32, dtype=torch.double)
    ref = model(x)
    ref.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    def body(comm):
        m = tpkit.parallelize(copy.deepcopy(model), comm=comm, example_inputs=(x,))
        out = m(x)
        out.square().sum().backward()
        return out, m.tp_plan, {n: p.grad for n, p in m.named_parameters()}

    for out, plan, got in run_threads(body, world):
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        assert plan["up"] == "colwise" and plan["down"] == "rowwise"  # the MLP splits either way
        if constant_groups:
            assert plan["attn.qkv_proj"] == "replicate"
            assert "wrong heads" in plan.kept_whole()["attn.qkv_proj"]
            torch.testing.assert_close(got["attn.qkv_proj.weight"], grads["attn.qkv_proj.weight"],
                                       rtol=1e-10, atol=1e-12)
        elif world == 2:  # 4 heads: 2 per rank, split by heads
            assert plan["attn.qkv_proj"] == "colwise" and plan["attn.out_proj"] == "rowwise"


def test_a_user_plan_splitting_such_a_block_is_refused_before_any_change():
    torch.manual_seed(0)
    model = Block(True).double()
    x = torch.randn(2, 5, 32, dtype=torch.double)
    before = {n: p.clone() for n, p in model.state_dict().items()}

    def body(comm):
        m = copy.deepcopy(model)
        with pytest.raises(tpkit.PlanError, match="wrong heads"):
            tpkit.parallelize(m, {"attn.qkv_proj": "colwise", "attn.out_proj": "rowwise"}, comm=comm,
                              example_inputs=(x,))
        return {n: torch.equal(p, before[n]) for n, p in m.state_dict().items()}

    for same in run_threads(body, 2):
        assert all(same.values())


def _recorded_by_a_run(model, inputs, watched):
    with HeadReshapes(model, watched) as seen, torch.no_grad():
        model(*inputs) if isinstance(inputs, tuple) else model(**inputs)
    return seen.seen


@pytest.mark.parametrize("which", ["block", "llama"])
def test_the_trace_records_the_head_sizes_a_run_of_the_whole_model_records(which):
    if which == "block":
        model, inputs, watched = Block(True).double(), (torch.randn(2, 5, 32, dtype=torch.double),), ["attn"]
    else:
        from tests.models import hf
        model = hf.hf_model("llama", num_hidden_layers=2)
        inputs = {"input_ids": torch.ones(1, 4, dtype=torch.long)}
        watched = [n for n, _ in model.named_modules() if n.endswith("self_attn")]
    t = trace(model, inputs)
    got = from_trace(t.head_cuts, watched)
    assert got == _recorded_by_a_run(model, inputs, watched)
    assert all(got[n] for n in watched)  # each cuts into heads: the comparison is not of empty lists


def test_the_dry_run_reads_the_whole_models_head_sizes_from_the_trace(monkeypatch):
    ran, read = [], []
    real, real_read = dryrun._Whole._run, dryrun.from_trace
    monkeypatch.setattr(dryrun._Whole, "_run", lambda self, on_meta: ran.append(on_meta) or real(self, on_meta))
    monkeypatch.setattr(dryrun, "from_trace", lambda *a: read.append(1) or real_read(*a))
    torch.manual_seed(0)
    model = Block(False).double()  # cut by its head count: the converted forward runs, its head sizes compared
    x = torch.randn(2, 5, 32, dtype=torch.double)
    m = run_threads(lambda comm: tpkit.parallelize(copy.deepcopy(model), comm=comm, example_inputs=(x,)).tp_plan, 2)
    assert all(plan["attn.qkv_proj"] == "colwise" and plan["attn.out_proj"] == "rowwise" for plan in m)
    assert read and ran == []  # compared with the trace's record: the whole model's forward was not run again


class _Raises(nn.Module):
    def forward(self, x):
        raise ValueError("a fast path that does not apply")


class _Catching(PackedAttention):
    """Tries a child that raises and catches it (a fused path with a fallback), then runs as its parent."""

    def __init__(self):
        super().__init__(constant_groups=False)
        self.fast = _Raises()

    def forward(self, x):
        try:
            return self.fast(x)
        except ValueError:
            return super().forward(x)


class _Router(nn.Module):
    """After the attention block, a reshape that adds an axis outside it (an MoE router's `view`)."""

    def __init__(self):
        super().__init__()
        self.attn = _Catching()

    def forward(self, x):
        y = self.attn(x)
        return y + y.view(*y.shape[:-1], 4, 8).sum(-1).repeat_interleave(8, dim=-1)


def test_a_forward_caught_raising_leaves_the_record_as_a_run_records_it():
    """The raising child's hooks still pop (`always_call`): the reshape after the block is not credited to it."""
    model, x = _Router().double(), torch.randn(2, 5, 32, dtype=torch.double)
    got = from_trace(trace(model, (x,)).head_cuts, ["attn"])
    assert got == _recorded_by_a_run(model, (x,), ["attn"]) and 8 not in got["attn"]


def test_the_trace_leaves_the_root_modules_output_alone():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    assert trace(model, (torch.randn(3, 8),)).escaped == {"2"}  # the output's producer: the output was kept
