"""A plain `nn.Linear` a conversion keeps whole at world size 1 (every one) multiplies at decode as a split layer's
shard does (`tpkit.nn.decode_linear.DecodeLinear`): a world-1 `from_pretrained` decodes with one process of
transformers' logits and tokens, its state dict is transformers', stock PEFT wraps it as a Linear, and outside a
decode its forward is `F.linear` bit for bit."""
from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpkit
from tpkit.nn.decode_linear import DecodeLinear, adopt_decode_products
from tpkit.quant import products

from .helpers import assert_greedy_up_to_ties

tr = pytest.importorskip("transformers")


def _llama(dtype: torch.dtype):
    torch.manual_seed(0)
    config = tr.LlamaConfig(vocab_size=384, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return tr.LlamaForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_world_1_from_pretrained_decodes_with_transformers_logits_and_tokens(dtype, tolerance, tmp_path,
                                                                             forced_native):
    """A float32 and a bf16 checkpoint loaded by `tpkit.from_pretrained` in one process: every Linear is a
    `DecodeLinear` (still an `nn.Linear`), the state dict is transformers' own, tensor for tensor; the product runs in
    every layer at a decode's rows, and the logits and greedy tokens are those of transformers' own load."""
    _llama(dtype).save_pretrained(tmp_path)
    want = tr.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto").eval()
    got = tpkit.from_pretrained(str(tmp_path), progress=False)
    linears = [m for m in got.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2 * 7 + 1 and all(type(m) is DecodeLinear for m in linears)
    mine, theirs = got.state_dict(), want.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = torch.tensor([[3, 17, 250, 9]])
    with torch.no_grad():
        logits, reference = got(ids).logits, want(ids).logits
    assert forced_native == [products.NATIVE_DENSE[dtype]] * (2 * 7 + 1)
    assert float((logits.float() - reference.float()).abs().max() / reference.float().abs().max()) < tolerance
    tokens = got.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if dtype == torch.float32:
        assert torch.equal(tokens, want.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
    else:  # bf16 ties (docs/how-to/generate.md): each token is the exact model's choice on its prefix, up to a tie
        assert_greedy_up_to_ties(tokens, tr.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64), 4)


def test_outside_a_decode_the_forward_is_f_linear_exactly():
    """A gradient asked for, autocast, more than 8 rows, float64: `F.linear` itself (outputs and gradients equal bit
    for bit); a wrong width raises `F.linear`'s error; the class survives `deepcopy`, pickling and
    `load_state_dict(assign=True)`."""
    torch.manual_seed(1)
    plain = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 8, bias=False))
    ours = copy.deepcopy(plain)
    assert adopt_decode_products(ours) == ["0", "1"] and all(type(m) is DecodeLinear for m in ours)
    x = torch.randn(3, 24, requires_grad=True)
    y, want = ours(x), plain(x)
    assert torch.equal(y, want)
    y.sum().backward(), want.sum().backward()
    for a, b in zip(ours.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)
    with torch.no_grad():
        assert torch.equal(ours(torch.ones(9, 24)), plain(torch.ones(9, 24)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(ours(x), plain(x))
        assert torch.equal(ours.double()(x.double()), plain.double()(x.double()))
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            ours.float()(torch.ones(2, 23))
    for again in (copy.deepcopy(ours), torch.load(_saved(ours), weights_only=False)):
        assert [type(m) for m in again] == [DecodeLinear, DecodeLinear]
    fresh, shifted = copy.deepcopy(ours).float(), {k: v + 1 for k, v in plain.float().state_dict().items()}
    fresh.load_state_dict(shifted, assign=True)
    assert [type(m) for m in fresh] == [DecodeLinear, DecodeLinear]
    assert torch.equal(fresh[0].weight, shifted["0.weight"])
    with torch.no_grad():
        rows = torch.randn(9, 24)
        want = F.linear(F.linear(rows, shifted["0.weight"], shifted["0.bias"]), shifted["1.weight"])
        assert torch.equal(fresh(rows), want)


def _saved(module: nn.Module) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return buffer


def test_only_plain_linears_are_adopted_and_a_rewritten_one_keeps_its_rewrite():
    """Only modules whose class is exactly `nn.Linear` before tpkit's rewrites: a subclass with its own forward and
    other layers are left as they are; a Linear tpkit rewrote (here its weight counted twice in the forward, as a
    gradient sum rewrites one) becomes a `DecodeLinear` whose forward still reads the rewritten weight."""
    from tpkit.nn.rewrites import Rewrite, base_class, rewrite, rewrites_of

    class Offset(nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1

    class Doubled(Rewrite):
        def read(self, module, name, stored):
            return stored * 2

    model = nn.Sequential(nn.Linear(4, 4), Offset(4, 4), nn.Conv1d(4, 4, 1), nn.Embedding(5, 4), nn.Linear(4, 3))
    rewrite(model[4], "weight", Doubled())
    assert adopt_decode_products(model) == ["0", "4"]
    assert [type(m) for m in model[:4]] == [DecodeLinear, Offset, nn.Conv1d, nn.Embedding]
    assert isinstance(model[4], DecodeLinear) and base_class(model[4]) is DecodeLinear and rewrites_of(model[4])
    x = torch.randn(9, 4)
    with torch.no_grad():
        assert torch.equal(model[4](x), F.linear(x, model[4].weight * 2, model[4].bias))


def test_stock_peft_wraps_it_as_a_linear_and_gives_plain_peft_outputs_and_gradients(forced_native):
    """`peft.get_peft_model` on a world-1 converted float32 Llama gives the same model as on transformers' own: a
    training step's LoRA gradients and a decode's logits within float32 rounding. (A frozen base layer whose input needs
    no gradient either, the first attention's projections, takes tpkit's product in training too, as a split layer's
    shard does: nothing flows back through it.)"""
    peft = pytest.importorskip("peft")
    base = _llama(torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    torch.manual_seed(2)
    want = peft.get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(2)
    got = peft.get_peft_model(tpkit.parallelize(copy.deepcopy(base)), config)
    assert isinstance(got.base_model.model.model.layers[0].self_attn.q_proj.base_layer, DecodeLinear)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    for m in (want, got):
        m(ids, labels=ids).loss.backward()
    assert forced_native  # (the first layer's q, k, v)
    grads = {n: p.grad for n, p in want.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * 3 * 2
    for n, p in got.named_parameters():
        if p.requires_grad:
            assert float((p.grad - grads[n]).abs().max() / grads[n].abs().max()) < 1e-5, n
    forced_native.clear()
    with torch.no_grad():
        logits, reference = got(ids).logits, want(ids).logits
    assert forced_native and set(forced_native) == {"fp32"}
    assert float((logits - reference).abs().max() / reference.abs().max()) < 1e-5


def test_a_world_1_model_compiled_with_dynamic_shapes_decodes_as_transformers(tmp_path):
    """`torch.compile(forward, dynamic=True)` right after the load, before any eager decode: each layer's choice is
    made as dynamo traces it (fake tensors, symbolic sizes: `products._traced_dense_choice`), and the compiled model
    gives transformers' logits and greedy tokens."""
    _llama(torch.float32).save_pretrained(tmp_path)
    want = tr.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    got = tpkit.from_pretrained(str(tmp_path), progress=False)
    got.forward = torch.compile(got.forward, dynamic=True)
    ids = torch.tensor([[3, 17, 250]])
    with torch.no_grad():
        logits, reference = got(ids).logits, want(ids).logits
        assert float((logits - reference).abs().max() / reference.abs().max()) < 1e-5
        tokens = got.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(tokens, want.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))


def test_world_1_meta_load_sharded_and_save_pretrained_against_transformers(tmp_path, forced_native):
    """A bf16 Llama built on the meta device, converted at world 1 and filled by `load_sharded` from transformers'
    checkpoint: its Linear layers are `DecodeLinear`, its decode runs tpkit's product, its logits are transformers' own;
    `save_pretrained` of it writes a checkpoint transformers loads back to the same state dict."""
    _llama(torch.bfloat16).save_pretrained(tmp_path / "ck")
    want = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "ck", dtype="auto").eval()
    with torch.device("meta"):
        meta = tr.LlamaForCausalLM._from_config(want.config, dtype=torch.bfloat16)
    got = tpkit.parallelize(meta)
    tpkit.load_sharded(got, str(tmp_path / "ck"))
    got.eval()
    assert all(type(m) is DecodeLinear for m in got.modules() if isinstance(m, nn.Linear))
    ids = torch.tensor([[3, 17, 250, 9]])
    with torch.no_grad():
        logits, reference = got(ids).logits.float(), want(ids).logits.float()
    assert forced_native == ["bf16"] * (2 * 7 + 1)
    assert float((logits - reference).abs().max() / reference.abs().max()) < 3e-2
    got.save_pretrained(tmp_path / "saved")
    back = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype="auto").state_dict()
    theirs = want.state_dict()
    assert back.keys() == theirs.keys() and all(torch.equal(back[k], theirs[k]) for k in back)


@pytest.mark.parametrize("world", [2, 3])
def test_a_linear_kept_whole_on_several_ranks_stays_torch_s_and_its_replicas_round_alike(world, monkeypatch):
    """Qwen2-MoE's shared-expert gate (hidden -> 1) is kept whole at 2 and 3 ranks: a replica on each rank, so it stays
    a plain `nn.Linear` (a `DecodeLinear` times its product choice on each rank apart), even when each rank would
    choose another product; every rank's gate gives the same bits at each decode step."""
    torch.manual_seed(0)
    config = tr.Qwen2MoeConfig(hidden_size=96, intermediate_size=192, moe_intermediate_size=48,
                               shared_expert_intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                               num_key_value_heads=3, vocab_size=256, num_experts=4, num_experts_per_tok=2)
    base = tr.Qwen2MoeForCausalLM(config).eval()
    order: dict[int, int] = {}  # each rank thread by its first call: ranks 0, 2 take torch's product, rank 1 tpkit's

    def disagreeing(*args, **kwargs) -> int:
        return order.setdefault(threading.get_ident(), len(order) % 2)
    monkeypatch.setattr(products, "dense_choice", disagreeing)

    def rank(comm):
        model = tpkit.parallelize(copy.deepcopy(base), comm=comm)
        gates = [m for n, m in model.named_modules() if n.endswith("shared_expert_gate")]
        seen = []
        for gate in gates:
            gate.register_forward_hook(lambda m, args, out: seen.append(out.clone()))
        model.generate(torch.tensor([[3, 17, 50, 9]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
        return [type(g) for g in gates], seen

    results = tpkit.run_threads(rank, world)
    for kinds, seen in results:
        assert kinds == [nn.Linear, nn.Linear] and len(seen) == 2 * 4
        assert all(torch.equal(a, b) for a, b in zip(seen, results[0][1]))
