"""Per-head layers kept as a list, one module per head, each applied to its own slice of the heads (StableLM's
`qk_layernorm`: a LayerNorm per head zipped with `torch.split(heads, 1, dim=1)`). Split by heads, every rank would
apply the modules of the first heads to its own heads; the attention stays whole, with the reason in the plan, and
the converted model's logits equal the unconverted model's (float64, thread-ranks)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tpkit
from tpkit.comm import run_threads

VOCAB = 101
REASON = "applied to slices of its heads"


def _stablelm(qk_layernorm: bool) -> nn.Module:
    tr = pytest.importorskip("transformers")
    cfg = tr.StableLmConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                            qk_layernorm=qk_layernorm)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tr.StableLmForCausalLM(cfg).double().eval()
    with torch.no_grad():  # every per-head norm its own weights (they start as ones, which would hide the bug)
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def _converted_logits(model: nn.Module, world: int) -> list:
    """(logits, plan) per rank: each rank converts its own deep copy (thread-ranks share torch's RNG)."""
    copies = [copy.deepcopy(model) for _ in range(world)]
    ids = _ids()

    def body(comm):
        m = tpkit.parallelize(copies[comm.rank], comm=comm)
        with torch.no_grad():
            return m(input_ids=ids).logits, m.tp_plan

    return run_threads(body, world)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("world", [2, 3])
def test_stablelm_qk_layernorm_keeps_attention_whole(world):
    model = _stablelm(qk_layernorm=True)
    with torch.no_grad():
        want = model(input_ids=_ids()).logits
    for rank, (logits, plan) in enumerate(_converted_logits(model, world)):
        assert _rel(logits, want) < 1e-9, f"rank {rank}: logits rel err {_rel(logits, want):.2e}"
        for layer in range(2):
            attn = f"model.layers.{layer}.self_attn"
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                assert plan[f"{attn}.{proj}"] != "colwise" and plan[f"{attn}.{proj}"] != "rowwise", plan.entries
                assert REASON in plan.reasons[f"{attn}.{proj}"], plan.reasons.get(f"{attn}.{proj}")
            assert f"{attn}.q_layernorm.norms" in plan.reasons[f"{attn}.o_proj"]
            assert plan[f"{attn}.q_layernorm.norms.0"] == "replicate"


def test_stablelm_without_qk_layernorm_splits_its_attention():
    model = _stablelm(qk_layernorm=False)
    with torch.no_grad():
        want = model(input_ids=_ids()).logits
    for logits, plan in _converted_logits(model, 2):
        assert _rel(logits, want) < 1e-9
        assert plan["model.layers.0.self_attn.q_proj"] == "colwise"
        assert plan["model.layers.0.self_attn.o_proj"] == "rowwise"


class _ScaledHeads(nn.Module):
    """Attention whose query heads pass, `group` at a time, through their own module of a list, taken apart with
    `split` along a [batch, seq, heads, head_dim] view (not StableLM's layout, nor its class): any such list is
    found, also when a slice holds as many heads as there are KV heads."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 4, group: int = 1):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim, self.group = heads, kv_heads, dim // heads, group
        self.q_proj, self.o_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k_proj, self.v_proj = nn.Linear(dim, kv_heads * self.head_dim), nn.Linear(dim, kv_heads * self.head_dim)
        self.per_head = nn.ModuleList(nn.LayerNorm(self.head_dim) for _ in range(heads // group))

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        q = torch.cat([norm(h) for norm, h in zip(self.per_head, q.split(self.group, dim=2))], dim=2).transpose(1, 2)
        k, v = (p(x).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
                for p in (self.k_proj, self.v_proj))
        n = self.num_heads // self.num_key_value_heads
        k, v = (t[:, :, None].expand(b, self.num_key_value_heads, n, s, self.head_dim).reshape(b, -1, s, self.head_dim)
                for t in (k, v))
        out = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim ** 0.5, -1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("kv_heads, group", [(4, 1), (2, 2)])
def test_any_list_of_per_head_modules_keeps_the_block_whole(kv_heads, group):
    torch.manual_seed(0)
    model = _ScaledHeads(kv_heads=kv_heads, group=group).double()
    with torch.no_grad():
        for p in model.per_head.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(x)
    copies = [copy.deepcopy(model) for _ in range(2)]

    def body(comm):
        m = tpkit.parallelize(copies[comm.rank], comm=comm, example_inputs=(x,))
        with torch.no_grad():
            return m(x), m.tp_plan

    for out, plan in run_threads(body, 2):
        assert _rel(out, want) < 1e-9, _rel(out, want)
        assert plan["q_proj"] != "colwise" and REASON in plan.reasons["o_proj"], (plan.entries, plan.reasons)


def test_one_module_on_all_the_heads_still_splits():
    """The same attention with one norm for all its heads (Qwen3's q_norm) splits by heads."""
    torch.manual_seed(0)
    model = _ScaledHeads(kv_heads=2, group=4).double()
    plan = tpkit.plan(model, 2, example_inputs=(torch.randn(2, 5, 32, dtype=torch.float64),))
    assert plan["q_proj"] == "colwise" and plan["o_proj"] == "rowwise", (plan.entries, plan.reasons)
