"""Per-head tensors (`convert/per_head.py`): T5's relative attention bias, an embedding with one column per head,
is split with the heads of every attention block it reaches; cross-attention splits by heads too. Forward,
gradients and one AdamW step equal the unconverted model's at world sizes 2 and 3 (float64, rel 1e-6)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tpkit.convert import PlanError, plan, verify

from tests.models.stepcheck import check

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
    assert p.details[BIAS].rows == tuple(f"encoder.block.{i}.layer.0.SelfAttention.o" for i in (0, 1))
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


def test_bloom_alibi_sliced_with_the_heads():
    """BLOOM packs qkv as [heads, 3, head_dim] and adds an ALiBi bias the model builds for all heads
    ([batch x heads, 1, keys]): the projection splits by head blocks, each rank's attention gets its heads' rows
    of the bias."""
    from tests.models.zoo import ZOO, example_inputs

    model, x = ZOO["bloom"](), example_inputs("bloom")
    p = plan(model, 2, example_inputs=x)
    qkv, dense = "transformer.h.0.self_attention.query_key_value", "transformer.h.0.self_attention.dense"
    assert p[qkv] == "colwise" and p.details[qkv].role == "qkv_heads"
    assert dict(p.details[dense].head_args) == {"alibi": "flat"}
    for world in (2, 3, 4):  # 6 heads: 3+3, 2+2+2, 2+2+1+1
        check(model, x, world)


def falcon(new_arch: bool) -> nn.Module:
    cfg = tr.FalconConfig(vocab_size=101, hidden_size=48, num_hidden_layers=1, num_attention_heads=6,
                          new_decoder_architecture=new_arch, multi_query=False, num_kv_heads=2 if new_arch else 6, hidden_dropout=0.0,
                          attention_dropout=0.0, bias=not new_arch)
    cfg._attn_implementation = "eager"
    torch.manual_seed(22)
    return tr.FalconForCausalLM(cfg).double()


@pytest.mark.parametrize("new_arch,world_size", [(True, 2), (True, 3), (True, 4), (False, 3)])
def test_falcon_grouped_and_per_head_qkv(new_arch, world_size):
    """Falcon's grouped qkv ([kv heads, group + 2, head_dim]; 2 KV heads, so at 3 and 4 ranks KV heads are shared
    by ranks holding different query heads of one group) and its older [heads, 3, head_dim] layout."""
    ids = {"input_ids": torch.randint(2, 101, (2, 6), generator=torch.Generator().manual_seed(9))}
    p = plan(falcon(new_arch), world_size, example_inputs=ids)
    qkv = "transformer.h.0.self_attention.query_key_value"
    assert p[qkv] == "colwise", p.reasons.get(qkv)
    assert p.details[qkv].role == ("qkv_groups" if new_arch else "qkv_heads")
    check(falcon(new_arch), ids, world_size)


def test_saved_plans_replay_exactly():
    """Plans with the new styles and details (per_head, multihead_attention, ALiBi head_args, grouped qkv)
    survive JSON and convert exactly when replayed."""
    from tpkit import Plan

    from .test_fastpath import encoder_layer, x
    from tests.models.zoo import ZOO, example_inputs

    cases = [(t5(True), t5_inputs(True)), (ZOO["bloom"](), example_inputs("bloom")), (falcon(True), None),
             (encoder_layer(), (x(),))]
    for model, inputs in cases:
        inputs = inputs or {"input_ids": torch.randint(2, 101, (2, 6), generator=torch.Generator().manual_seed(9))}
        saved = Plan.from_json(plan(model, 2, example_inputs=inputs).to_json())
        check(model, inputs, 2, plan=saved)


def _first(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]  # a tuple or a ModelOutput: logits / hidden states


def test_checkpoint_resharded_from_2_to_3_ranks(tmp_path):
    """The new layouts (per-head columns, MultiheadAttention's in_proj, grouped qkv) save at 2 ranks and load
    at 3: the loaded models equal the unconverted ones."""
    import copy

    import tpkit

    from tests.models.stepcheck import call
    from .test_fastpath import encoder_stack, x

    ids = {"input_ids": torch.randint(2, 101, (2, 6), generator=torch.Generator().manual_seed(9))}
    for i, (model, inputs) in enumerate([(t5(True), t5_inputs(True)), (encoder_stack(), (x(),)),
                                         (falcon(True), ids)]):
        want = _first(call(copy.deepcopy(model).eval(), inputs))
        blank = copy.deepcopy(model)
        with torch.no_grad():
            for p in blank.parameters():
                p.zero_()
        saves, loads = [copy.deepcopy(model) for _ in range(2)], [copy.deepcopy(blank) for _ in range(3)]
        where = str(tmp_path / str(i))

        def save():
            comm = tpkit.get_communicator()
            tpkit.save_sharded(tpkit.parallelize(saves[comm.rank], comm=comm, example_inputs=inputs), where,
                               comm=comm)

        def load():
            comm = tpkit.get_communicator()
            m = tpkit.parallelize(loads[comm.rank], comm=comm, example_inputs=inputs)
            tpkit.load_sharded(m, where, comm=comm)
            return _first(call(m.eval(), inputs))

        tpkit.launch(save, 2, backend="threads")
        for got in tpkit.launch(load, 3, backend="threads"):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
