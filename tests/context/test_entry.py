"""`tpkit.context_parallel` at the user's door: what it refuses (before changing anything, naming the layer or the
setting and the way out), what survives the paths models take (deepcopy, load_state_dict(assign=True)), the eager
kernel, generation with the split switched off, and a bad sequence."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as tr

import tpkit
from tpkit.comm import create_communicators, run_threads

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(tr.LlamaConfig(**TINY, attn_implementation="sdpa")).double()


def _unchanged(model):
    assert model.config._attn_implementation == "sdpa"
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert getattr(model, "_tp_record", None) is None or model._tp_record.context is None


def test_bad_arguments_and_unsplittable_attention_are_refused_before_any_change(llama):
    comm = create_communicators(1)[0]
    model = copy.deepcopy(llama)
    with pytest.raises(ValueError, match="method 'zigzag'; choose one of"):
        tpkit.context_parallel(model, comm, method="zigzag")
    with pytest.raises(TypeError, match="cp_comm must be a tpkit Communicator"):
        tpkit.context_parallel(model, "cp")
    with pytest.raises(TypeError, match="Sequential is not a Hugging Face model"):
        tpkit.context_parallel(torch.nn.Sequential(torch.nn.Linear(2, 2)), comm)
    _unchanged(model)
    flex = copy.deepcopy(llama)
    flex.config._attn_implementation = "flex_attention"
    with pytest.raises(NotImplementedError, match="kernel 'flex_attention'.*attn_implementation='sdpa'"):
        tpkit.context_parallel(flex, comm)
    gemma = tr.Gemma2ForCausalLM(tr.Gemma2Config(**TINY, head_dim=8, attn_implementation="eager"))
    with pytest.raises(NotImplementedError, match="logit soft-capping"):
        tpkit.context_parallel(gemma, comm)
    assert gemma.config._attn_implementation == "eager"
    tpkit.context_parallel(model, comm)
    with pytest.raises(ValueError, match="already context-parallel"):
        tpkit.context_parallel(model, comm)


def test_generation_needs_the_split_off_and_then_gives_transformers_greedy_tokens(llama):
    prompt = torch.randint(0, 61, (1, 7), generator=torch.Generator().manual_seed(5))
    want = llama.generate(prompt, max_new_tokens=5, do_sample=False)

    def rank(comm):
        model = tpkit.context_parallel(copy.deepcopy(llama), comm)
        with pytest.raises(NotImplementedError, match="context_off"):
            model.generate(prompt, max_new_tokens=2, do_sample=False)
        with tpkit.context_off(model):
            got = model.generate(prompt, max_new_tokens=5, do_sample=False)
        assert model.config._attn_implementation == "tpkit_context"  # the split is back
        return got

    for got in run_threads(rank, 2):
        assert torch.equal(got, want)


def test_the_eager_kernel_deepcopy_and_assign_loading_keep_the_exact_gradients(llama):
    eager = copy.deepcopy(llama)
    eager.config._attn_implementation = "eager"
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(6))
    llama.zero_grad()
    llama(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    want = {n: p.grad.clone() for n, p in llama.named_parameters()}
    state = {k: v.clone() for k, v in llama.state_dict().items()}

    def rank(comm):
        out = []
        for path in ("eager", "deepcopy", "assign"):
            model = tpkit.context_parallel(copy.deepcopy(eager if path == "eager" else llama), comm, method="ring")
            if path == "deepcopy":
                model = copy.deepcopy(model)
            if path == "assign":
                model.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
            model(input_ids=ids, labels=ids).loss.backward()
            out.append({n: p.grad for n, p in model.named_parameters()})
        return out

    for grads in run_threads(rank, 2):
        for path in grads:
            for name, g in want.items():
                assert torch.allclose(path[name], g, rtol=1e-9, atol=1e-12), name


def test_a_model_without_whole_sequences_or_with_a_4d_mask_is_refused(llama):
    def rank(comm):
        model = tpkit.context_parallel(copy.deepcopy(llama), comm, method="ring")
        with pytest.raises(ValueError, match="needs input_ids or inputs_embeds"):
            model(input_ids=torch.tensor(3))
        with pytest.raises(ValueError, match="custom 4-D masks"):
            model(input_ids=torch.zeros(1, 6, dtype=torch.long), attention_mask=torch.ones(1, 1, 6, 6))
        with pytest.raises(ValueError, match="not run a context-parallel forward yet"):
            tpkit.gather_sequence(torch.zeros(1, 4), tpkit.context_parallel(copy.deepcopy(llama), comm))
        return True

    assert all(run_threads(rank, 2))


def test_the_replica_sentinel_compares_the_cp_ranks_copies(llama):
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(8))

    def rank(comm):
        g = tpkit.comm.groups(comm, tp=2, cp=2)
        model = tpkit.context_parallel(tpkit.parallelize(copy.deepcopy(llama), comm=g.tp, mode="training"), g.cp)
        model(input_ids=ids, labels=ids).loss.backward()
        report = tpkit.check_replicas(model)
        if g.cp.rank == 1 and g.tp.rank == 0:  # one cp rank's copy drifts: a rank-local update
            with torch.no_grad():
                model.model.norm.weight.add_(1e-3)
        with pytest.raises(tpkit.ReplicaError) as caught:
            tpkit.check_replicas(model, grads=False)
        return report.tensors, str(caught.value)

    results = run_threads(rank, 4)
    assert all(checked > 0 for checked, _ in results)
    assert any("model.norm.weight" in e and "cp rank" in e for _, e in results), results


def test_an_attention_layer_the_interface_does_not_reach_is_refused_by_name(llama):
    """A layer attending over the sequence by its own code would see only this rank's tokens: refused."""
    class OwnAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.softmax(x @ x.transpose(-1, -2), -1) @ self.proj(x)

    model = copy.deepcopy(llama)
    model.model.extra = OwnAttention()
    with pytest.raises(NotImplementedError, match=r"model.extra \(OwnAttention\)"):
        tpkit.context_parallel(model, create_communicators(1)[0])
    _unchanged(model)
