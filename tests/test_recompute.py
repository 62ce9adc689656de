"""`tpkit.recompute` on converted models (thread-ranks): "full" and "selective" give exactly the gradients of no
recompute (bit for bit) while keeping less for the backward; "none" undoes; bad policies and models without an
attention interface are refused. Dropout through the RNG tracker under recompute, FSDP2 and DDP run on gloo
processes in tests/test_training.py."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import tpkit


def llama(attn: str = "eager") -> torch.nn.Module:
    import transformers as tr

    config = tr.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, use_cache=False)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(config)


IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def _saved_bytes_and_grads(base, policy):
    """This rank's loss, gradients and the bytes autograd keeps outside checkpointed regions."""
    model = tpkit.recompute(tpkit.parallelize(copy.deepcopy(base), mode="training"), policy)
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, sum(kept)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_full_and_selective_give_the_same_gradients_bit_for_bit(attn):
    base = llama(attn)
    runs = {p: tpkit.launch(_saved_bytes_and_grads, 2, backend="threads", args=(base, p))
            for p in ("none", "selective", "full")}
    for policy in ("selective", "full"):
        for rank in range(2):
            loss, grads, _ = runs[policy][rank]
            ref_loss, ref_grads, _ = runs["none"][rank]
            assert loss == ref_loss and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads), (policy, rank)
    kept = {p: runs[p][0][2] for p in runs}
    assert kept["full"] < kept["selective"] < kept["none"], kept


def test_none_undoes_and_a_deep_copy_recomputes_its_own_blocks():
    model = tpkit.recompute(llama(), "full")
    twin = copy.deepcopy(model)
    assert all(b.gradient_checkpointing for b in twin.model.layers)
    tpkit.recompute(model, "selective")
    assert not any(b.gradient_checkpointing for b in model.model.layers)
    assert model.model.layers[0].self_attn.config._attn_implementation == "tpkit_recompute"
    assert model.config._attn_implementation == "eager"  # the model's own config (masks, saves) is untouched
    tpkit.recompute(model, "none")
    assert model.model.layers[0].self_attn.config is model.config


def test_blocks_of_a_custom_model_get_a_checkpointed_forward():
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3)])
    x = torch.randn(4, 8)
    net(x).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    tpkit.recompute(net, "full", blocks=list(net))
    net(x).sum().backward()
    assert all(torch.equal(p.grad, r) for p, r in zip(net.parameters(), ref))
    tpkit.recompute(net, "none")
    assert "forward" not in net[0].__dict__


def test_bad_policy_and_selective_without_attention_interface():
    with pytest.raises(ValueError, match="policy 'some' is not one of"):
        tpkit.recompute(llama(), "some")
    with pytest.raises(ValueError, match="'selective' recomputes the attention core.*use 'full'"):
        tpkit.recompute(torch.nn.Sequential(torch.nn.Linear(2, 2)), "selective")
    with pytest.raises(ValueError, match="no repeated blocks"):
        tpkit.recompute(torch.nn.Linear(2, 2), "full")


class DropBlock(torch.nn.Module):
    """up (column) -> dropout on the sharded activation through the RNG tracker -> down (row) -> dropout on the
    replicated output from torch's default generator."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        h = torch.relu(self.up(x))
        with tpkit.nn.get_rng_tracker(getattr(self.up, "comm", None)).fork():
            h = torch.nn.functional.dropout(h, 0.3)
        return x + torch.nn.functional.dropout(self.down(h), 0.2)


class DropNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([DropBlock() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


DROP_PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}


def _dropout_grads(base, policy):
    model = tpkit.recompute(tpkit.parallelize(copy.deepcopy(base), plan=DROP_PLAN), policy)
    tpkit.nn.model_parallel_manual_seed(5)
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(2))).pow(2).mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_dropout_through_the_rng_tracker_is_recomputed_with_the_same_mask(monkeypatch):
    """The tracker has advanced by the time the backward recomputes a block; recompute replays it from the
    block's start. Without that (the control), the masks and gradients differ. One thread-rank: thread-ranks share
    torch's global generator, which checkpoint saves and restores (gloo ranks: tests/test_training.py)."""
    import sys

    torch.manual_seed(0)
    base = DropNet()
    ref = tpkit.launch(_dropout_grads, 1, backend="threads", args=(base, "none"))[0]
    got = tpkit.launch(_dropout_grads, 1, backend="threads", args=(base, "full"))[0]
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    module = sys.modules["tpkit.recompute"]  # `tpkit.recompute` is the function
    monkeypatch.setattr(module, "tracker_contexts", lambda comm: (contextlib.nullcontext(), contextlib.nullcontext()))
    control = tpkit.launch(_dropout_grads, 1, backend="threads", args=(base, "full"))[0]
    assert not all(torch.equal(control[n], ref[n]) for n in ref)
