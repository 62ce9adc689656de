"""Tiny mixture-of-experts models for the conversion tests: Mixtral (fused 3-D experts), Qwen2-MoE (fused
experts plus a gated shared expert) and a hand-written MoE whose experts are separate nn.Linear modules."""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 103
_BUILD_LOCK = threading.Lock()


def mixtral(experts: str = "eager", **over) -> nn.Module:
    import transformers as tr

    kw = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=48, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=6, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
              router_jitter_noise=0.0)
    kw.update(over)
    return _build(tr.MixtralForCausalLM, tr.MixtralConfig(**kw), experts)


def qwen2_moe(experts: str = "eager", **over) -> nn.Module:
    import transformers as tr

    kw = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=48, moe_intermediate_size=24,
              shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6,
              num_experts=6, num_experts_per_tok=2, max_position_embeddings=64, decoder_sparse_step=1,
              norm_topk_prob=False)
    kw.update(over)
    return _build(tr.Qwen2MoeForCausalLM, tr.Qwen2MoeConfig(**kw), experts)


def _build(cls, config, experts: str = "eager") -> nn.Module:
    config._attn_implementation = "eager"
    config._experts_implementation = experts  # grouped_mm has no float64 kernel on CPU
    with _BUILD_LOCK:  # thread-ranks share the global RNG: seed and build atomically
        torch.manual_seed(1234)
        model = cls(config)
        with torch.no_grad():  # HF initialises the router to zeros or tiny values: give it a real spread
            for name, p in model.named_parameters():
                if name.endswith("gate.weight") or "experts" in name:
                    p.normal_(0, 0.3)
    return model


BUILDERS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe}


def inputs(batch: int = 2, seq: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(2, VOCAB, (batch, seq), generator=g)


def _step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One SGD step on the model's own loss (with the router's auxiliary loss when the config asks). SGD, not
    Adam: its update is the gradient itself, so the comparison measures the gradient's error. (The routers of
    Mixtral and Qwen2-MoE compute their softmax in float32 even in a float64 model, which leaves ~1e-7 relative
    noise in some gradients; Adam's first step, g / |g|, would blow that up on near-zero gradients.)"""
    out = model(input_ids=ids, labels=ids)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out.loss.backward()
    opt.step()
    return out.logits.detach()


def reference(name: str, **over) -> dict:
    """Single-device float64 logits, and every weight's update in one SGD step."""
    model = BUILDERS[name](**over).double()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    logits = _step(model, inputs())
    return {"logits": logits, "before": before,
            "update": {n: p.detach() - before[n] for n, p in model.named_parameters()}}


def rank_check(name: str, ref: dict, over: dict | None = None, plan="auto") -> dict:
    """On one rank: convert in float64, take one SGD step, compare the logits and every shard's update (relative
    to the largest update of that tensor)."""
    import tpkit

    comm = tpkit.get_communicator()
    model = tpkit.parallelize(BUILDERS[name](**(over or {})).double(), plan=plan, comm=comm)
    layouts = tpkit.shard_layouts(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    logits = _step(model, inputs())
    logit_err = ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
    step_err, worst = 0.0, None
    for n, p in model.named_parameters():
        assert torch.equal(before[n], layouts[n].shard(ref["before"][n])), n
        want = layouts[n].shard(ref["update"][n])
        err = ((p.detach() - before[n] - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        if err > step_err:
            step_err, worst = err, n
    share = sum(l.local_numel for l in layouts.values()) / sum(
        torch.Size(l.full_shape).numel() for l in layouts.values())
    return {"logit_err": logit_err, "step_err": step_err, "worst": worst, "share": share,
            "styles": dict(model.tp_plan.entries)}


# A hand-written MoE whose experts are separate nn.Linear modules (the older Mixtral / Qwen2-MoE layout).


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Top-k routing over separate experts; returns the combined output and the router logits."""

    def __init__(self, hidden: int = 32, inner: int = 40, experts: int = 5, top_k: int = 2, residual: bool = False):
        super().__init__()
        self.top_k, self.residual = top_k, residual
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(hidden, inner) for _ in range(experts))

    def forward(self, x):
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        logits = self.gate(flat)
        weights, chosen = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel():
                out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
        out = out.reshape(b, t, h)
        return (out + x if self.residual else out), logits


class TinyMoELM(nn.Module):
    """Embedding -> (norm -> MoE, residual) x 2 -> norm -> head; `aux` is a load-balancing style loss."""

    def __init__(self, hidden: int = 32, residual_inside: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(2))
        self.moes = nn.ModuleList(SparseMoE(hidden, residual=residual_inside) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, ids):
        h, aux = self.embed(ids), 0.0
        for norm, moe in zip(self.norms, self.moes):
            y, logits = moe(norm(h))
            h = h + y
            aux = aux + (logits.softmax(-1).mean(0) ** 2).sum()
        return self.head(self.norm(h)), aux


def custom_moe(**over) -> nn.Module:
    with _BUILD_LOCK:
        torch.manual_seed(4321)
        return TinyMoELM(**over)


def custom_check(ref: dict | None, over: dict | None = None, plan="auto") -> dict:
    """Reference (ref None) or one rank's float64 logits and SGD update of the custom MoE, loss = CE + aux."""
    import tpkit

    model = custom_moe(**(over or {})).double()
    if ref is not None:
        model = tpkit.parallelize(model, plan=plan, comm=tpkit.get_communicator())
    layouts = tpkit.shard_layouts(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = inputs()
    logits, aux = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1)) + 0.1 * aux
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss.backward()
    opt.step()
    update = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    if ref is None:
        return {"logits": logits.detach(), "update": update}
    err = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()  # noqa: E731
    steps = {n: err(u, layouts[n].shard(ref["update"][n])) for n, u in update.items()}
    worst = max(steps, key=steps.get)
    return {"logit_err": err(logits.detach(), ref["logits"]), "step_err": steps[worst], "worst": worst,
            "styles": dict(model.tp_plan.entries), "reasons": dict(model.tp_plan.reasons)}


COVERAGE = {"Mixtral": mixtral, "Qwen2-MoE (shared expert)": qwen2_moe,
            "custom MoE (separate experts)": custom_moe}  # rows of bench/coverage.py
