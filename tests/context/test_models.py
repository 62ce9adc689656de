"""A Hugging Face model made context-parallel computes what ONE process of plain transformers computes on the whole
sequences (use_cache=False, where HF finds packed documents): the loss, every gradient and the gathered logits,
float64, on thread-ranks; both methods, cp 1-4, padding, packed documents, sliding windows, tied embeddings with
q/k/v biases, on top of tensor parallelism; and what cannot be split exactly is refused before anything changes."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as tr

import tpkit
from tpkit.comm import run_threads

LLAMA = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(tr.LlamaConfig(**LLAMA)).double()


@pytest.fixture(scope="module")
def qwen2():
    """Tied embeddings, q/k/v biases, and a sliding window on the second layer."""
    torch.manual_seed(1)
    config = tr.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                            use_sliding_window=True, sliding_window=5, max_window_layers=1,
                            attn_implementation="sdpa")
    return tr.Qwen2ForCausalLM(config).double()


def _inputs(kind: str, rows: int, length: int) -> dict:
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, 97, (rows, length), generator=g)
    inputs = {"input_ids": ids, "labels": ids.clone()}
    if kind == "padding":
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[0, :4], mask[-1, -3:] = 0, 0
        inputs["attention_mask"] = mask
        inputs["labels"] = ids.masked_fill(mask == 0, -100)
    if kind == "documents":
        inputs["position_ids"] = torch.cat([torch.arange(9), torch.arange(length - 9)])[None].expand(rows, length)
    return inputs


def _reference(model, inputs):
    model.zero_grad()
    out = model(**inputs, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _context_parallel(model, inputs, cp, method="auto", tp=1):
    def rank(comm):
        groups = tpkit.comm.groups(comm, tp=tp, cp=cp)
        m = copy.deepcopy(model)
        if tp > 1:
            m = tpkit.parallelize(m, comm=groups.tp, mode="training")
        tpkit.context_parallel(m, groups.cp, method=method)
        out = m(**inputs)
        out.loss.backward()
        logits = tpkit.gather_sequence(out.logits, m)
        grads = {n: p.grad for n, p in m.named_parameters()}
        methods = dict(m._tp_record.context.methods)
        return out.loss.detach(), logits.detach(), grads, methods

    return run_threads(rank, cp * tp)


def _assert_equal(results, reference, rtol=1e-10):
    loss, logits, grads = reference
    for got_loss, got_logits, got_grads, _ in results:
        assert torch.allclose(got_loss.double(), loss.double(), rtol=1e-6, atol=0)  # HF's loss is float32
        assert torch.allclose(got_logits, logits, rtol=0, atol=1e-10)
        for name, want in grads.items():
            err = (got_grads[name] - want).norm() / want.norm()
            assert err < rtol, (name, err)


@pytest.mark.parametrize("cp,method,kind,length", [(2, "ring", "causal", 24), (2, "all_to_all", "causal", 24),
                                                   (3, "auto", "padding", 25), (4, "all_to_all", "documents", 32),
                                                   (2, "ring", "documents", 29), (2, "all_to_all", "padding", 20)])
def test_llama_equals_one_process(llama, cp, method, kind, length):
    inputs = _inputs(kind, 2, length)
    results = _context_parallel(llama, inputs, cp, method)
    _assert_equal(results, _reference(llama, inputs), rtol=1e-6)
    chosen = {m for m, _ in results[0][3].values()}
    assert chosen == ({"ring"} if method == "ring" or cp == 3 else {"all_to_all"})  # 8 heads do not divide by 3


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_qwen2_tied_biased_and_windowed_equals_one_process(qwen2, method):
    inputs = _inputs("causal", 2, 22)
    _assert_equal(_context_parallel(qwen2, inputs, 2, method), _reference(qwen2, inputs), rtol=1e-6)


@pytest.mark.parametrize("method", ["ring", "auto"])
def test_tp2_x_cp2_equals_one_process(llama, method):
    inputs = _inputs("padding", 2, 18)
    results = _context_parallel(llama, inputs, 2, method, tp=2)
    loss, logits, grads = _reference(llama, inputs)
    for got_loss, got_logits, got_grads, methods in results:  # TP's loss runs in float32, as HF's does
        assert torch.allclose(got_loss.double(), loss.double(), rtol=1e-6)
        assert torch.allclose(got_logits, logits, rtol=0, atol=1e-10)
    # one KV head per TP rank with cp 2: all-to-all repeats it; the ring splits no heads
    assert {m for m, _ in results[0][3].values()} == {"ring" if method == "ring" else "all_to_all"}


def test_the_all_to_all_path_compiles_whole_and_computes_the_same(llama):
    """torch.compile(fullgraph=True) of the decoder under context parallelism: no graph break (the all-to-alls are
    graph ops), the same hidden states and gradients as eager. The ring's point-to-point exchanges do not trace."""
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(9))

    def rank(comm):
        model = tpkit.context_parallel(copy.deepcopy(llama), comm, method="all_to_all")
        model(input_ids=ids, labels=ids)  # eager: the forward's split, the layers' method
        split = model._tp_record.context.batch.split
        local = {"input_ids": split.split(ids, 1, comm.rank), "use_cache": False,
                 "position_ids": split.split(torch.arange(20).expand(2, 20), 1, comm.rank)}
        results = []
        for run in (model.model, torch.compile(model.model, fullgraph=True, backend="aot_eager")):
            model.zero_grad()
            hidden = run(**local).last_hidden_state
            hidden.square().sum().backward()
            results.append((hidden.detach(), [p.grad.clone() for p in model.model.parameters()]))
        return results

    for (eager, eager_grads), (compiled, compiled_grads) in run_threads(rank, 2):
        assert torch.allclose(compiled, eager, rtol=0, atol=1e-12)
        for a, b in zip(compiled_grads, eager_grads):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("extra,method", [("sequence_parallel", "ring"), ("recompute", "all_to_all")])
def test_sequence_parallelism_and_recompute_inside_cp_equal_one_process(llama, extra, method):
    """Sequence parallelism splits the cp-local sequence over TP; recompute re-runs the attention's exchanges in
    the backward, in the same order on every rank."""
    ids = torch.randint(0, 97, (2, 26), generator=torch.Generator().manual_seed(11))
    loss, _, grads = _reference(llama, {"input_ids": ids, "labels": ids})
    want = torch.nn.utils.get_total_norm(list(grads.values()))

    def rank(comm):
        g = tpkit.comm.groups(comm, tp=2, cp=2)
        m = tpkit.parallelize(copy.deepcopy(llama), comm=g.tp, mode="training",
                              sequence_parallel=extra == "sequence_parallel")
        if extra == "recompute":
            tpkit.recompute(m)
        tpkit.context_parallel(m, g.cp, method=method)
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), tpkit.clip_grad_norm_(m.parameters(), 1e9)

    for got_loss, norm in run_threads(rank, 4):
        assert torch.allclose(got_loss.double(), loss.double(), rtol=1e-6)
        assert torch.allclose(norm.double(), want, rtol=1e-6)  # TP's loss runs in float32, as HF's does
