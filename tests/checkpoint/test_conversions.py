"""transformers' stored-split, model-fused tensors (Mixtral / Qwen2-MoE experts: `experts.{e}.w1/w3` on disk,
`experts.gate_up_proj` in the model) load through `from_pretrained` as pieces of one entry, each rank reading
only what it holds; an unreadable conversion is named in the error."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import tpkit  # noqa: E402
from tests.checkpoint.fixtures import hf_logits, logits_of, rel  # noqa: E402


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
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # experts distinct enough that a misplaced one shows in the logits
    return model


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
    monkeypatch.setattr(conversions, "_READABLE", set())
    with pytest.raises(tpkit.CheckpointError, match="gate_up_proj.*rebuilt by MergeModulelist"):
        tpkit.from_pretrained(path)
