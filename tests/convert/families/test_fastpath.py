"""Fused fast paths and direct weight reads (`convert/fastpath.py`): PyTorch's encoder layer in eval under
no_grad runs one fused kernel that reads its children's weights directly; a converted model must still equal
the unconverted one in every mode (train / eval x grad / no_grad), at world sizes 2 and 3, in float64. A layer
whose weight some other code reads directly is left whole, with the reason in the plan."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpkit.convert import PlanError, conversion_of, plan, verify

from tests.models.stepcheck import check

MODES = [(False, False), (False, True), (True, False), (True, True)]  # (train, grad)


def encoder_layer() -> nn.Module:
    torch.manual_seed(11)
    return nn.TransformerEncoderLayer(48, 6, 96, dropout=0.0, batch_first=True).double()


def encoder_stack() -> nn.Module:
    torch.manual_seed(12)
    layer = nn.TransformerEncoderLayer(48, 6, 96, dropout=0.0, batch_first=True, activation="gelu")
    return nn.TransformerEncoder(layer, 2).double()


def x() -> torch.Tensor:
    return torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def test_fused_kernel_runs_unconverted_and_not_converted(monkeypatch):
    """The hazard is real: in eval under no_grad the unconverted layer runs the fused kernel (which would read the
    shards as whole weights); the converted layers do not, and still give the same numbers."""
    import tpkit

    fused = torch._transformer_encoder_layer_fwd
    calls = []
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a, **k: calls.append(1) or fused(*a, **k))
    model = encoder_layer().eval()
    with torch.no_grad():
        want = model(x())
    assert calls == [1]
    copies = [encoder_layer().eval() for _ in range(2)]

    def body():
        comm = tpkit.get_communicator()
        m = tpkit.parallelize(copies[comm.rank], comm=comm)
        with torch.no_grad():
            return m(x()), conversion_of(m).updated_attributes

    for got, updated in tpkit.launch(body, 2, backend="threads"):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert updated[""] == {"activation_relu_or_gelu": 0}
    assert calls == [1]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("train,grad", MODES)
def test_encoder_layer_every_mode(train, grad, world_size):
    results = check(encoder_layer(), (x(),), world_size, train=train, grad=grad)
    p = results[0]["plan"]
    assert p["linear1"] == "colwise" and p["linear2"] == "rowwise"
    assert p["self_attn"] == "multihead_attention" and p["self_attn.out_proj"] == "rowwise"
    if world_size == 2:
        assert results[0]["share"] < 0.55, results[0]["share"]  # only the norms and the row biases stay whole


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("train,grad", MODES)
def test_encoder_stack_every_mode(train, grad, world_size):
    check(encoder_stack(), (x(),), world_size, train=train, grad=grad)


@pytest.mark.parametrize("train,grad", MODES)
def test_multihead_attention_alone_every_mode(train, grad):
    """The model itself is the attention: nothing to swap it in, so it stays whole (and exact)."""
    torch.manual_seed(13)
    mha = nn.MultiheadAttention(48, 6, batch_first=True).double()
    check(mha, (x(), x(), x()), 2, train=train, grad=grad)


class CrossAttention(nn.Module):
    """nn.MultiheadAttention called with masks and attention weights asked for (averaged or per head)."""

    def __init__(self, average: bool, batch_first: bool):
        super().__init__()
        self.average, self.batch_first = average, batch_first
        self.attn = nn.MultiheadAttention(48, 6, batch_first=batch_first)
        self.proj = nn.Linear(48, 48)

    def forward(self, q, kv, key_padding_mask, attn_mask):
        if not self.batch_first:
            q, kv = q.transpose(0, 1), kv.transpose(0, 1)
        out, w = self.attn(self.proj(q), kv, kv, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                           need_weights=True, average_attn_weights=self.average)
        return out, w


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("average,batch_first,mask3d", [(True, True, False), (False, False, True)])
def test_multihead_attention_split_with_masks_and_weights(average, batch_first, mask3d, world_size):
    torch.manual_seed(15)
    model = CrossAttention(average, batch_first).double()
    g = torch.Generator().manual_seed(5)
    q, kv = torch.randn(2, 4, 48, generator=g, dtype=torch.float64), torch.randn(2, 7, 48, generator=g,
                                                                                 dtype=torch.float64)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    mask = torch.randn(12 if mask3d else 1, 4, 7, generator=g, dtype=torch.float64)
    mask = mask if mask3d else mask[0] > 1.0  # per-head float mask, or one boolean mask for all heads
    for train, grad in MODES:
        results = check(model, (q, kv, pad, mask), world_size, train=train, grad=grad)
    assert results[0]["plan"]["attn"] == "multihead_attention"


class ReadsChildWeight(nn.Module):
    """A parent that uses its children's weights directly: `F.linear(h, self.fc1.weight)` beside calling fc1,
    and logits as `h @ self.embed.weight.T` (a hand-tied head)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(97, 24)
        self.fc1, self.fc2 = nn.Linear(24, 48), nn.Linear(48, 24)
        self.up, self.down = nn.Linear(24, 40), nn.Linear(40, 24)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.fc2(F.gelu(self.fc1(h))) + 0.1 * F.linear(h, self.fc1.weight)[..., :24]
        h = h + self.down(torch.relu(self.up(h)))
        return h @ self.embed.weight.T


def reads_child_weight() -> nn.Module:
    torch.manual_seed(14)
    return ReadsChildWeight().double()


def ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(4))


def test_direct_weight_reads_stay_whole_with_reason():
    p = plan(reads_child_weight(), 2, example_inputs=(ids(),))
    for name in ("fc1", "embed"):
        assert p[name] == "replicate", (name, p.entries)
        assert "read directly" in p.reasons[name]
    assert p["up"] == "colwise" and p["down"] == "rowwise"  # the rest still splits
    assert p["fc2"] == "colwise_rep"  # its partner stays whole: split alone, its output gathered


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("train,grad", MODES)
def test_direct_weight_reads_exact_every_mode(train, grad, world_size):
    check(reads_child_weight(), (ids(),), world_size, train=train, grad=grad)


def test_a_plan_splitting_a_directly_read_layer_is_refused():
    model = reads_child_weight()
    with pytest.raises(PlanError, match="fc1: planned 'colwise', but its parameters are read directly"):
        verify(model, (ids(),), world_size=2, plan={"fc1": "colwise", "fc2": "rowwise"})


def test_analyze_counts_the_attention_it_splits():
    """`analyze` counts nn.MultiheadAttention's own in_proj (a container's parameters) and shows it split."""
    import tpkit

    model = encoder_stack()
    report = tpkit.analyze(model, world_size=2)
    assert report.total_params == sum(p.numel() for p in model.parameters())
    row = next(r for r in report.layers if r.name == "layers.0.self_attn")
    assert row.style == "multihead_attention" and row.bytes_per_rank == row.bytes // 2
    assert report.parallelizable_percent > 95
