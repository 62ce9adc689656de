"""Checkpoints of attention modules whose own parameters follow the heads (`convert/families/head_params.py`):
`from_pretrained` reads each rank's heads of the attention sinks (GraniteSWA, 4 heads spread 2/1/1 at 3 ranks), and
`save_sharded` at 2 ranks loads back at 3 (DeBERTa-style q/v biases of heads x head_dim)."""
from __future__ import annotations

import copy

import pytest
import torch

import tpkit
from tests.convert.families.test_head_params import X, model as minimal

tr = pytest.importorskip("transformers")


def granite_swa(path: str) -> torch.nn.Module:
    cfg = tr.GraniteSWAConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(41)
    m = tr.GraniteSWAForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.sinks.normal_()
    m.save_pretrained(path)
    return m


IDS = torch.randint(3, 101, (2, 7), generator=torch.Generator().manual_seed(2))


def _pretrained(path: str, full: dict, ref: torch.Tensor):
    m = tpkit.from_pretrained(path)
    lays = tpkit.shard_layouts(m)
    differ = [k for k, v in m.state_dict().items() if not torch.equal(v, lays[k].shard(full[k]))]
    with torch.no_grad():
        err = ((m(input_ids=IDS).logits - ref).abs().max() / ref.abs().max()).item()
    return err, differ, tuple(m.model.layers[0].self_attn.sinks.shape), m.tp_plan["model.layers.0.self_attn"]


def test_from_pretrained_reads_each_ranks_sinks(tmp_path):
    hf = granite_swa(str(tmp_path))
    with torch.no_grad():
        ref = hf(input_ids=IDS).logits
    got = tpkit.launch(_pretrained, 3, backend="threads", args=(str(tmp_path), hf.state_dict(), ref))
    assert [g[2] for g in got] == [(2,), (1,), (1,)]
    for err, differ, _, style in got:
        assert err < 1e-5 and not differ and style == "head_parameters", (err, differ, style)


def _save(copies, directory):
    comm = tpkit.get_communicator()
    m = tpkit.parallelize(copies[comm.rank], "auto", comm, example_inputs=X)
    tpkit.save_sharded(m, directory, step=1)


def _load(copies, directory, full):
    comm = tpkit.get_communicator()
    m = tpkit.parallelize(copies[comm.rank], "auto", comm, example_inputs=X)
    tpkit.load_sharded(m, directory)
    lays = tpkit.shard_layouts(m)
    return [k for k, v in m.state_dict().items() if not torch.equal(v, lays[k].shard(full[k]))]


def test_saved_at_two_ranks_loads_at_three(tmp_path):
    saved = minimal("qv_bias")
    tpkit.launch(_save, 2, backend="threads", args=([copy.deepcopy(saved) for _ in range(2)], str(tmp_path)))
    fresh = [minimal("qv_bias") for _ in range(3)]
    for m in fresh:
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
    for differ in tpkit.launch(_load, 3, backend="threads", args=(fresh, str(tmp_path), saved.state_dict())):
        assert not differ, differ
