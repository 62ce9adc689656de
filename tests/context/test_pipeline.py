"""Context parallelism inside pipeline stages (`tpkit.pipeline(..., cp=C)`) computes what ONE process of plain
transformers + torch computes on the whole sequences, float64.

On thread-ranks (no pipeline engine): a Llama's stages run in order on each cp rank, every stage cutting the
micro-batch's whole token ids itself (the later ones given the hidden states of this rank's tokens), give the whole
model's logits, loss and every gradient; the loss shares of `token_mean` sum to Hugging Face's token mean with
ignored labels and a length the split pads.

On 4 gloo processes (one launch, `tests/pipeline/cp_cases.py`): pp2 x cp2 trains a Llama read from a directory for
2 steps (1F1B, ring attention) and a tied Qwen2 (interleaved 1F1B, two stages per rank: the tokens reach every stage
of a rank; all-to-all attention) exactly as one process does:
the losses, the clipped norms, the first step's gradients and the final weights; the evaluation loss and the
whole-sequence logits before training; a checkpoint saved at pp2 x cp2 and consolidated equals the reference's
weights; a custom loss_fn under cp and sizes that do not divide the world are refused before anything changes.
"""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as tr

import tpkit
from tpkit.comm import run_threads
from tpkit.context.pipeline import StageContext, token_mean
from tpkit.pipeline import split_stages
from tpkit.pipeline.stage import stage_modules
from tests.pipeline.cp_cases import CASES, LENGTH, STEPS, launch_all, reference

LLAMA = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(tr.LlamaConfig(**LLAMA)).double()


def _ids(rows: int, length: int) -> torch.Tensor:
    return torch.randint(0, 97, (rows, length), generator=torch.Generator().manual_seed(length))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("cp,length,stages,method", [(2, 12, 2, "ring"), (3, 13, 3, "ring"), (2, 9, 3, "all_to_all")])
def test_stages_in_order_equal_one_process(llama, cp, length, stages, method):
    """Each cp rank holds every stage (one part): stage s runs on what stage s-1 returned, with the tokens."""
    x = _ids(2, length)
    llama.zero_grad()
    out = llama(input_ids=x, labels=x, use_cache=False)
    out.loss.backward()
    want = (out.loss.detach(), out.logits.detach(), {n: p.grad.clone() for n, p in llama.named_parameters()})

    def rank(comm):
        m = copy.deepcopy(llama)
        split = split_stages(m, stages)
        tpkit.context_parallel(m, comm, method=method)
        h = x
        for stage in stage_modules(m, split, list(range(stages)), StageContext(m)):
            h = stage(h, tokens=x)
        loss = token_mean(m.loss_function, h, x, m.config.vocab_size, comm)
        loss.backward()
        logits = tpkit.context.SequenceSplit(length, cp).gather(h.detach(), comm, 1)
        return loss.detach(), logits, {n: p.grad for n, p in m.named_parameters()}

    for loss, logits, grads in run_threads(rank, cp):
        assert torch.allclose(loss.double(), want[0].double(), rtol=1e-6, atol=0)  # HF's loss is float32
        assert torch.allclose(logits, want[1], rtol=0, atol=1e-10)
        for name, g in want[2].items():
            assert _rel(grads[name], g) < 1e-6, (name, _rel(grads[name], g))


@pytest.mark.parametrize("cp", [2, 3])
def test_loss_shares_sum_to_the_token_mean(cp):
    """Ignored labels (-100) anywhere, a length the split pads: the global mean over the labelled tokens."""
    torch.manual_seed(3)
    length, vocab = 11, 13
    logits = torch.randn(3, length, vocab, dtype=torch.float64)
    labels = torch.randint(0, vocab, (3, length))
    labels[0, :4], labels[2, -2:] = -100, -100
    from transformers.loss.loss_utils import ForCausalLMLoss

    want = ForCausalLMLoss(logits, labels, vocab)
    split = tpkit.context.SequenceSplit(length, cp)

    def rank(comm):
        mine = split.split(logits, 1, comm.rank)
        return token_mean(ForCausalLMLoss, mine, labels, vocab, comm)

    for got in run_threads(rank, cp):
        assert torch.allclose(got.double(), want.double(), rtol=1e-6, atol=0)


def test_a_stage_without_the_tokens_says_how_to_run_it(llama):
    def rank(comm):
        m = copy.deepcopy(llama)
        split = split_stages(m, 2)
        tpkit.context_parallel(m, comm, method="ring")
        stage = stage_modules(m, split, [1], StageContext(m))[0]
        with pytest.raises(ValueError, match="needs the micro-batch's whole token ids"):
            stage(torch.zeros(2, 6, 32, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"hidden states of shape \(2, 5, 32\) arrived"):
            stage(torch.zeros(2, 5, 32, dtype=torch.float64), tokens=_ids(2, 12))
        return True

    assert all(run_threads(rank, 2))


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> list[dict]:
    return launch_all(str(tmp_path_factory.mktemp("pipeline-cp")))


@pytest.mark.slow
@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_pp2_x_cp2_trains_as_one_process(launched, case):
    c = next(c for c in CASES if c.name == case)
    ref = reference(c.model)
    held = set()
    for r in launched:
        got = r["cases"][case]
        assert got["cp"] == (r["rank"] % 2, 2) and got["pp_rank"] == r["rank"] // 2  # world = pp x cp, cp inside
        assert got["methods"] == {c.cp_method}
        assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-6)
        if got["logits"] is not None:
            assert _rel(got["logits"], ref["logits"]) < 1e-10
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6), (got["losses"], ref["losses"])
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-6), (got["norms"], ref["norms"])
        for key, g in got["grads"].items():
            assert _rel(g, ref["grads"][key]) < 1e-6, (case, r["rank"], key, _rel(g, ref["grads"][key]))
        for key, p in got["params"].items():
            assert _rel(p, ref["params"][key]) < 1e-6, (case, r["rank"], key, _rel(p, ref["params"][key]))
            held.add(key)
    assert held == set(ref["params"]), sorted(set(ref["params"]) ^ held)
    assert len(ref["losses"]) == STEPS and LENGTH % 4  # the split pads every sequence


@pytest.mark.slow
def test_a_checkpoint_saved_at_pp2_x_cp2_consolidates_to_the_reference(launched):
    ref = reference("llama")
    consolidated = launched[0]["consolidated"]
    assert set(consolidated) == set(ref["params"])
    for key, t in consolidated.items():
        assert _rel(t, ref["params"][key]) < 1e-6, (key, _rel(t, ref["params"][key]))


@pytest.mark.slow
def test_what_cp_cannot_do_is_refused_before_anything_changes(launched):
    for r in launched:
        refused = r["refused"]
        assert "cp 2 with a loss_fn" in refused["loss_fn"] and "leave loss_fn out" in refused["loss_fn"]
        assert "pp 2 x cp 4 x tp 1 = 8 does not divide the world size 4" in refused["sizes"]
        assert refused["unchanged"]
