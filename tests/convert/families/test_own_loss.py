"""Training mode keeps LM-head logits split over the vocabulary only where tpkit computes the loss (HF causal
LMs, or the user with `vocab_parallel_cross_entropy`). A model whose forward computes its own loss from full
logits (masked LM, seq2seq) gets them gathered instead: split logits crashed BertForMaskedLM and would have fed
T5's loss a wrong slice."""
from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import tpkit  # noqa: E402


def _models():
    import transformers as tr

    torch.manual_seed(0)
    bert = tr.BertForMaskedLM(tr.BertConfig(vocab_size=103, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                            intermediate_size=48, max_position_embeddings=64))
    t5 = tr.T5ForConditionalGeneration(tr.T5Config(vocab_size=103, d_model=32, d_ff=48, num_layers=1, num_heads=4,
                                                   d_kv=8, decoder_start_token_id=0))
    return {"bert": bert.double().eval(), "t5": t5.double().eval()}


@pytest.mark.parametrize("world", [2, 3])
def test_models_with_their_own_loss_train_on_gathered_logits(world):
    x = torch.randint(1, 103, (2, 6), generator=torch.Generator().manual_seed(3))
    for name, model in _models().items():
        ref = model(input_ids=x, labels=x)
        ref.loss.backward()
        ref_grad = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        def body(m=model):
            tp = tpkit.parallelize(copy.deepcopy(m), mode="training", example_inputs={"input_ids": x, "labels": x})
            tp.zero_grad(set_to_none=True)
            out = tp(input_ids=x, labels=x)
            out.loss.backward()
            lay = tpkit.shard_layouts(tp)
            # against the model's largest gradient: a key bias's true gradient is 0 (softmax ignores it), noise
            scale = max(g.abs().max().item() for g in ref_grad.values())
            err = max((p.grad - lay[n].shard(ref_grad[n])).abs().max().item() / scale
                      for n, p in tp.named_parameters() if n in ref_grad and p.grad is not None)
            alone = tp.tp_plan.split_alone()  # lone layers split with a gathered output are not the head
            head = next(n for n, s in tp.tp_plan.entries.items() if s == "colwise_rep" and n not in alone)
            return abs(out.loss.item() - ref.loss.item()) / ref.loss.item(), err, tp.tp_plan.reasons.get(head, "")

        for loss_err, grad_err, reason in tpkit.launch(body, world, backend="threads"):
            assert loss_err < 1e-10 and grad_err < 1e-6, (name, loss_err, grad_err)
            assert "computes its loss from full logits" in reason, (name, reason)


def test_causal_lms_keep_vocab_parallel_logits_in_training():
    from tests.models.hf import hf_model

    def body(m):
        return tpkit.parallelize(copy.deepcopy(m), mode="training").tp_plan.entries["lm_head"]

    assert tpkit.launch(body, 2, backend="threads", args=(hf_model("llama"),)) == ["vocab_parallel"] * 2
