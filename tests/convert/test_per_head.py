"""Per-head tensors (`convert/per_head.py`): T5's relative attention bias, an embedding with one column per head,
is split with the heads of every attention block it reaches; cross-attention splits by heads too. Forward,
gradients and one AdamW step equal the unconverted model's at world sizes 2 and 3 (float64, rel 1e-6)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tpkit.convert import PlanError, plan, verify

from .stepcheck import check

tr = pytest.importorskip("transformers")


def t5(encoder_only: bool = False, heads: int = 6) -> nn.Module:
    cfg = tr.T5Config(vocab_size=101, d_model=48, d_kv=8, d_ff=96, num_layers=2, num_decoder_layers=2,
                      num_heads=heads, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    cfg._attn_implementation = "eager"
    torch.manual_seed(21)
    cls = tr.T5EncoderModel if encoder_only else tr.T5ForConditionalGeneration
    return cls(cfg).double()


def t5_inputs(encoder_only: bool = False) -> dict:
    ids = torch.randint(2, 101, (2, 7), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids} if encoder_only else {"input_ids": ids, "decoder_input_ids": ids[:, :5]}


BIAS = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias"


def test_t5_plan_splits_the_bias_with_its_heads():
    p = plan(t5(), 2, example_inputs=t5_inputs())
    assert p[BIAS] == "per_head" and p[BIAS.replace("encoder", "decoder")] == "per_head"
    assert p.details[BIAS]["rows"] == [f"encoder.block.{i}.layer.0.SelfAttention.o" for i in (0, 1)]
    for n in ("q", "k", "v"):
        assert p[f"decoder.block.1.layer.1.EncDecAttention.{n}"] == "colwise"  # cross-attention
    assert p["encoder.block.1.layer.0.SelfAttention.o"] == "rowwise"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("encoder_only", [True, False])
def test_t5_forward_and_one_step(encoder_only, world_size):
    results = check(t5(encoder_only), t5_inputs(encoder_only), world_size)
    if world_size == 2:
        assert results[0]["share"] < 0.6, results[0]["share"]


def test_heads_that_do_not_split_keep_the_bias_whole():
    """4 heads over 3 ranks split 2,1,1 (whole heads): still exact. 1 head: nothing to split, all whole, and
    the reason (the attention's) is on the bias and on q/k/v."""
    check(t5(True, heads=4), t5_inputs(True), 3)
    p = plan(t5(True, heads=1), 2, example_inputs=t5_inputs(True))
    for n in (BIAS, BIAS.replace("relative_attention_bias", "q")):
        assert p[n] == "replicate" and "no reshape to heads of size 8" in p.reasons[n], p.reasons[n]


def test_bias_whole_while_heads_split_is_refused():
    model = t5(True)
    over = {BIAS: "replicate"}
    with pytest.raises(PlanError, match="o is 'rowwise'.*relative_attention_bias"):
        verify(model, t5_inputs(True), world_size=2, plan=over)
