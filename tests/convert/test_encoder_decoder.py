"""Encoder-decoder models (T5, BART) converted without `example_inputs`: the trace gets decoder inputs too
(or the model's own `dummy_inputs`), so attention and MLPs split and outputs match (issue 20 item 6)."""
from __future__ import annotations

import copy

import pytest
import torch

tr = pytest.importorskip("transformers")

import tpkit  # noqa: E402
from tpkit.convert import parallelize  # noqa: E402
from tpkit.convert.trace import analyze_structure  # noqa: E402
from tpkit.convert.trace.structure import default_inputs  # noqa: E402


def _t5():
    cfg = tr.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=64, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return tr.T5ForConditionalGeneration(cfg).double().eval()


def _bart():
    cfg = tr.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64,
                        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    return tr.BartForConditionalGeneration(cfg).double().eval()


# (builder, {module: style} that must be split, a column-split weight and its full output rows)
CASES = {
    "t5": (_t5, {"encoder.block.0.layer.0.SelfAttention.q": "colwise", "encoder.block.0.layer.0.SelfAttention.o":
                 "rowwise", "decoder.block.1.layer.1.EncDecAttention.k": "colwise",
                 "encoder.block.1.layer.1.DenseReluDense.wi": "colwise",
                 "decoder.block.0.layer.2.DenseReluDense.wo": "rowwise"},
           ("encoder.block.0.layer.0.SelfAttention.q.weight", 32)),
    "bart": (_bart, {"model.encoder.layers.0.self_attn.q_proj": "colwise",
                     "model.encoder.layers.0.self_attn.out_proj": "rowwise",
                     "model.decoder.layers.1.encoder_attn.v_proj": "colwise", "model.decoder.layers.0.fc1": "colwise",
                     "model.encoder.layers.1.fc2": "rowwise"},
             ("model.decoder.layers.0.fc1.weight", 64)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_encoder_decoder_without_example_inputs_is_traced_split_and_exact(name):
    build, split, (weight, rows) = CASES[name]
    model = build()  # once, outside the threads: thread-ranks share the RNG
    a = analyze_structure(model)
    assert a.trace is not None, a.trace_error
    torch.manual_seed(1)
    ids, dec = torch.randint(2, 64, (2, 7)), torch.randint(2, 64, (2, 5))
    with torch.no_grad():
        ref = model(input_ids=ids, decoder_input_ids=dec).logits
    copies = [copy.deepcopy(model) for _ in range(2)]

    def body(comm):
        m = parallelize(copies[comm.rank], "auto", comm)
        with torch.no_grad():
            out = m(input_ids=ids, decoder_input_ids=dec).logits
        return m.tp_plan, dict(m.named_parameters())[weight].shape[0], out

    for the_plan, local_rows, out in tpkit.comm.run_threads(body, 2):
        assert {n: the_plan.get(n) for n in split} == split
        assert local_rows == rows // 2
        assert (out - ref).abs().max() / ref.abs().max() < 1e-10


def test_the_models_own_dummy_inputs_are_tried_after_the_guess():
    class NeedsAMask(tr.T5ForConditionalGeneration):  # a forward the usual guess does not satisfy
        def forward(self, input_ids=None, decoder_input_ids=None, decoder_attention_mask=None, **kw):
            assert decoder_attention_mask is not None, "this model needs decoder_attention_mask"
            return super().forward(input_ids=input_ids, decoder_input_ids=decoder_input_ids,
                                   decoder_attention_mask=decoder_attention_mask, **kw)

    model = NeedsAMask(_t5().config)
    candidates = default_inputs(model)
    assert set(candidates[0]) == {"input_ids", "decoder_input_ids"} and candidates[0]["input_ids"].shape == (2, 4)
    assert set(candidates[-1]) == set(model.dummy_inputs)
    a = analyze_structure(model)
    assert a.trace is not None, a.trace_error
    assert a.structures  # attention found through the dummy inputs' trace
