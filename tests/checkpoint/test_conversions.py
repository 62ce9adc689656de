"""transformers' stored-split, model-fused tensors (Mixtral / Qwen2-MoE experts: `experts.{e}.w1/w3` on disk,
`experts.gate_up_proj` in the model; Kimi-Linear's `q/k/v_conv1d`) and stored-fused, model-split ones (HRM's
`gqkv_proj` chunked, Lara-Mini's `in_proj` split by its targets' sizes) load through `from_pretrained` as pieces of
entries, each rank reading only what it holds, equal to transformers' own loading; an unreadable conversion is
named in the error."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import tpkit  # noqa: E402
from tests.checkpoint.fixtures import hf_logits, logits_of, rel  # noqa: E402



def _distinct(cls, cfg):
    """`cls(cfg)` (eager attention, seed 0) with every tensor drawn wide: a part read from the wrong place (a
    misplaced expert, a cut taken at another offset) shows in the weights and the logits."""
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model

def _moe(kind: str):
    import transformers as tr

    common = dict(vocab_size=103, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2)
    if kind == "mixtral":
        cfg = tr.MixtralConfig(intermediate_size=48, num_local_experts=4, **common)
        cls = tr.MixtralForCausalLM
    else:
        cfg = tr.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                num_experts=4, **common)
        cls = tr.Qwen2MoeForCausalLM
    return _distinct(cls, cfg)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def moe_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    _moe(request.param).save_pretrained(path)
    return path, hf_logits(path)


def test_expert_files_are_stored_split(moe_dir):
    from safetensors import safe_open

    path, _ = moe_dir
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert any(".experts.0." in k for k in keys) and not any(k.endswith("gate_up_proj") for k in keys)


@pytest.mark.parametrize("world", [2, 3])
def test_from_pretrained_fuses_experts_like_transformers(moe_dir, world):
    import transformers

    path, ref = moe_dir
    full = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()

    def body():
        model = tpkit.from_pretrained(path)
        layouts = tpkit.shard_layouts(model)
        differ = [k for k, v in model.state_dict().items() if not torch.equal(v, layouts[k].shard(full[k]))]
        split = all(layouts[k].local_shape != layouts[k].full_shape for k in layouts if k.endswith("gate_up_proj"))
        return rel(logits_of(model), ref), differ, split

    for err, differ, split in tpkit.launch(body, world, backend="threads"):
        assert err < 1e-5 and not differ, (err, differ)
        assert split, "the experts built on the meta device were left whole (their trace failed?)"


def test_unreadable_conversion_is_named(moe_dir, monkeypatch):
    """A converter whose operations tpkit does not read leaves its target missing, and the error says which."""
    from tpkit.checkpoint import conversions

    path, _ = moe_dir
    monkeypatch.setattr(conversions, "_JOINS", set())
    with pytest.raises(tpkit.CheckpointError, match="gate_up_proj.*rebuilt by MergeModulelist"):
        tpkit.from_pretrained(path)


def test_boxes_within_a_stored_tensor_read_exactly_their_part(tmp_path):
    """A model tensor cut out of a stored one (`Piece.within`) reads, at any split of its own, the bytes of its part
    only: rows of a row-major tensor (one run) and columns (a run per row)."""
    from tpkit.checkpoint.reader import read_region
    from tpkit.checkpoint.safetensors_file import read_header, write_file
    from tpkit.checkpoint.sources import Entry, Piece
    from tpkit.layout import ShardLayout

    full = torch.arange(9 * 10, dtype=torch.float32).reshape(9, 10)
    path = str(tmp_path / "f.safetensors")
    write_file(path, {"fused": full})
    headers = {path: read_header(path)}
    for cut in (0, 1):
        for start, stop in [(0, 4), (4, 7), (7, 9)]:
            part = full.narrow(cut, start, stop - start)
            within = (start, 0) if cut == 0 else (0, start)
            entry = Entry("part", tuple(part.shape), torch.float32,
                          (Piece(path, "fused", (0, 0), tuple(part.shape), within=within),))
            for dim in (None, 0, 1):
                for r in range(3):
                    lay = ShardLayout.replicated(part.shape, 3, r) if dim is None else \
                        ShardLayout.split(part.shape, dim, 3, r)
                    out = read_region(entry, lay, headers, torch.empty(lay.stored_local_shape))
                    assert torch.equal(out, lay.shard(part)), (cut, start, dim, r)


def _converted(kind: str):
    """A tiny model whose checkpoint transformers stores other than the model holds it: Kimi-Linear (experts
    stacked + concatenated, `q/k/v_conv1d` concatenated), HRM (`gqkv_proj` and `gate_up_proj` chunked), Lara-Mini
    (`in_proj` split into `in_proj_qkv/z/b/a` by their sizes)."""
    import transformers as tr

    ids = dict(vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "kimi_linear":
        cfg = tr.KimiLinearConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=4,
                                  qk_nope_head_dim=4, v_head_dim=8, head_dim=8, num_experts=4, num_experts_per_token=2,
                                  mlp_layer_types=["dense", "sparse"], layer_types=["linear_attention", "full_attention"],
                                  linear_head_dim=8, linear_num_heads=4, model_max_length=64, **ids)
        cls = tr.KimiLinearForCausalLM
    elif kind == "hrm_text":
        cfg = tr.HrmTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               head_dim=8, max_position_embeddings=64, **ids)
        cls = tr.HrmTextForCausalLM
    else:
        cfg = tr.LaraMiniConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                num_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"],
                                max_position_embeddings=64, sliding_window=16, **ids)
        cls = tr.LaraMiniForCausalLM
    return _distinct(cls, cfg)


@pytest.fixture(scope="module", params=["kimi_linear", "hrm_text", "lara_mini"])
def converted_dir(request, tmp_path_factory):
    """(directory, transformers' own `from_pretrained` state dict of it, the model keys the files do not hold)."""
    import transformers
    from safetensors import safe_open

    path = str(tmp_path_factory.mktemp(request.param))
    _converted(request.param).save_pretrained(path)
    full = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        stored = set(f.keys())
    return path, full, sorted(set(full) - stored)


@pytest.mark.parametrize("world", [2, 3])
def test_from_pretrained_joins_and_cuts_like_transformers(converted_dir, world):
    path, full, rebuilt = converted_dir
    assert rebuilt, "the checkpoint stores every model tensor as is: nothing converted to test"

    def body():
        model = tpkit.from_pretrained(path, progress=False)
        layouts = tpkit.shard_layouts(model)
        sd = model.state_dict()
        differ = [k for k in full if k not in sd or not torch.equal(sd[k], layouts[k].shard(full[k]))]
        return differ, [k for k in rebuilt if layouts[k].local_shape != layouts[k].full_shape]

    for differ, split in tpkit.launch(body, world, backend="threads"):
        assert not differ, differ
        assert split, f"none of the converted tensors {rebuilt[:4]} was split: their part reads go untested"


def test_unreadable_cut_is_named(tmp_path, monkeypatch):
    """A cut tpkit does not read leaves its targets missing, and the error names the converter."""
    from tpkit.checkpoint import conversions

    _converted("hrm_text").save_pretrained(tmp_path)
    monkeypatch.setattr(conversions, "_CUTS", set())
    with pytest.raises(tpkit.CheckpointError, match="lacks .*q_proj.*rebuilt by Chunk"):
        tpkit.from_pretrained(str(tmp_path), progress=False)


def test_special_floats_in_config_are_decoded():
    """transformers 5 writes Falcon-H1's `time_step_limit` (0, inf) as [0.0, {"__float__": "Infinity"}]; its config
    class refuses that dict, so the config must be read as transformers reads it."""
    import json
    import math

    import transformers

    from tpkit.checkpoint.pretrained import load_config
    from tpkit.checkpoint.sources import Source

    saved = json.loads(transformers.FalconH1Config(num_hidden_layers=1).to_json_string(use_diff=True))
    assert saved["time_step_limit"][1] == {"__float__": "Infinity"}
    config = load_config(Source("d", {}, {}, config=saved), "d")
    assert math.isinf(config.time_step_limit[1]) and saved["time_step_limit"][1] == {"__float__": "Infinity"}
