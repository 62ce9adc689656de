"""Plan reuse: a model's repeated blocks take the traced block's plan entries without being traced, and the plan
equals the one the whole trace makes, on every model the tests convert (made deeper so blocks repeat), at 2 and 3
ranks. Models whose blocks differ (alternating sliding / full attention, a dense block before MoE blocks, pre- and
post-norm blocks) get their own plan per kind of block."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpkit
from tpkit.comm.shapes import ShapeCommunicator
from tpkit.convert.planning import decide
from tpkit.convert.state import ConversionState, read_request
from tpkit.convert.trace.blocks import analyze_blocks, repeated_blocks

from ..models.custom import Block
from ..models.moe import SparseMoE

DEPTH = 6


def _reused_plan(model: nn.Module, world: int, mode: str, inputs) -> ConversionState | None:
    """The state after the trace and plan steps when they stayed on the model cut to its distinct blocks, else
    None (the whole model traced)."""
    request = read_request("auto", dict(model.named_modules()), world)
    s = ConversionState(model, ShapeCommunicator(0, world), mode, request, inputs)
    s = decide.make_plan(decide.trace_model(s))
    return s if s.cut else None


def _same(model: nn.Module, worlds=(2, 3), modes=("inference",)) -> None:
    """Reuse on and off give one plan (entries, reasons, details), and reuse did take the short path."""
    for world in worlds:
        for mode in modes:
            full = tpkit.plan(model, world, mode=mode, reuse=False)
            assert _reused_plan(model, world, mode, None) is not None, "reuse fell back to the whole trace"
            reused = tpkit.plan(model, world, mode=mode)
            assert reused.entries == full.entries
            assert reused.reasons == full.reasons
            assert {k: v.to_dict() for k, v in reused.details.items()} == \
                {k: v.to_dict() for k, v in full.details.items()}
            assert reused.to_dict() == full.to_dict()


def _deeper(model: nn.Module, depth: int = DEPTH) -> nn.Module:
    """The same Hugging Face architecture and sizes with `depth` blocks (per-layer lists recomputed)."""
    cfg = model.config
    data = cfg.to_dict()
    data[cfg.attribute_map.get("num_hidden_layers", "num_hidden_layers")] = depth
    data.pop("layer_types", None)
    new = type(cfg).from_dict(data)
    new._attn_implementation = "eager"
    if hasattr(cfg, "_experts_implementation"):
        new._experts_implementation = cfg._experts_implementation
    torch.manual_seed(0)
    return type(model)(new).eval()


def _zoo():
    pytest.importorskip("transformers")
    from ..models import hf, moe, zoo

    out = {f"zoo:{n}": b for n, b in zoo.ZOO.items()}
    out.update({f"hf:{n}": (lambda n=n: hf.hf_model(n)) for n in (*hf.MODELS, "phi3", "neox")})
    out.update({f"moe:{n}": b for n, b in moe.BUILDERS.items()})
    return out


ZOO_NAMES = ["zoo:" + n for n in ("bloom", "codegen", "cohere", "distilbert", "falcon", "gemma", "gemma2",
                                  "gpt_bigcode", "gptj", "granite", "olmo", "phi", "roberta", "stablelm",
                                  "starcoder2", "vit")] + \
            ["hf:" + n for n in ("llama", "mistral", "qwen2", "gpt2", "bert", "opt", "phi3", "neox")] + \
            ["moe:mixtral", "moe:qwen2_moe"]


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_reuse_equals_the_whole_trace_on_every_model(name):
    model = _deeper(_zoo()[name]())
    (blocks,) = repeated_blocks(model)
    assert blocks.length == DEPTH and blocks.keep < DEPTH
    _same(model)


def test_training_mode_and_the_switches(monkeypatch):
    from ..models import hf

    model = _deeper(hf.hf_model("qwen2"))  # tied embeddings
    _same(model, worlds=(2,), modes=("training",))
    monkeypatch.setenv("TPKIT_PLAN_REUSE", "0")
    calls = []
    monkeypatch.setattr(decide, "analyze_blocks", lambda *a: calls.append(a))
    tpkit.plan(model, 2)
    assert not calls  # the environment turned it off
    monkeypatch.delenv("TPKIT_PLAN_REUSE")
    tpkit.plan(model, 2, reuse=False)
    assert not calls
    tpkit.plan(model, 2)
    assert calls


def test_alternating_sliding_and_full_attention():
    """Gemma 2's layer_types alternate sliding / full attention: two kinds of block, each planned from its own."""
    from ..models import zoo

    model = _deeper(zoo.gemma2(), 6)
    assert list(model.config.layer_types[:2]) == ["sliding_attention", "full_attention"]
    (blocks,) = repeated_blocks(model)
    assert blocks.keep == 4 and blocks.source == (0, 1, 2, 1, 2, 3)
    _same(model)


def test_gemma3_five_sliding_to_one_full():
    """Gemma 3: every sixth layer full attention (a periodic config setting and layer_types)."""
    tr = pytest.importorskip("transformers")
    cfg = tr.Gemma3TextConfig(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=14,
                              num_attention_heads=6, num_key_value_heads=3, head_dim=8, sliding_window=4,
                              max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tr.Gemma3ForCausalLM(cfg).eval()
    (blocks,) = repeated_blocks(model)
    assert blocks.keep == 8 and blocks.source[11] == 5  # layer 11 is full attention, as layer 5
    _same(model)


def test_encoder_decoder_lists_and_a_block_that_reads_another():
    """BART: two lists, each cut. T5: later blocks read the first block's relative position bias, a fact naming
    another block, so the whole trace plans (and reuse equals it)."""
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bart = tr.BartForConditionalGeneration(tr.BartConfig(
        vocab_size=101, d_model=48, encoder_layers=5, decoder_layers=5, encoder_attention_heads=6,
        decoder_attention_heads=6, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64)).eval()
    assert len(repeated_blocks(bart)) == 2
    _same(bart)
    t5 = tr.T5ForConditionalGeneration(tr.T5Config(vocab_size=101, d_model=48, d_kv=8, d_ff=96, num_layers=5,
                                                   num_heads=6, decoder_start_token_id=0)).eval()
    assert len(repeated_blocks(t5)) == 2 and _reused_plan(t5, 2, "inference", None) is None
    assert tpkit.plan(t5, 2).to_dict() == tpkit.plan(t5, 2, reuse=False).to_dict()


def test_layer_types_in_the_config_alone_split_the_blocks():
    """A per-layer setting only the config holds (read at forward time) still makes two kinds of block."""
    from ..models import hf

    model = _deeper(hf.hf_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1), 4)
    sigs = repeated_blocks(model)[0].source
    assert sigs[0] != sigs[1] or model.config.layer_types[0] == model.config.layer_types[1]
    _same(model)


def test_a_dense_block_before_moe_blocks():
    from ..models import moe

    model = _deeper(moe.qwen2_moe(mlp_only_layers=[0]), 4)
    assert type(model.model.layers[0].mlp).__name__ != type(model.model.layers[1].mlp).__name__
    (blocks,) = repeated_blocks(model)
    assert blocks.source == (0, 1, 1, 2)  # the dense block is itself
    _same(model)
    p = tpkit.plan(model, 2)
    assert "model.layers.0.mlp.gate_proj" in p and "model.layers.0.mlp.shared_expert.gate_proj" not in p
    assert all(f"model.layers.{i}.mlp.shared_expert.gate_proj" in p for i in (1, 2, 3))


def test_deepseek_v3_first_k_dense_blocks():
    """DeepSeek-V3's first `first_k_dense_replace` blocks are dense, the rest MoE (multi-head latent attention)."""
    tr = pytest.importorskip("transformers")
    cfg = tr.DeepseekV3Config(vocab_size=101, hidden_size=48, intermediate_size=96, moe_intermediate_size=24,
                              num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=6, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
                              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                              max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tr.DeepseekV3ForCausalLM(cfg).eval()
    (blocks,) = repeated_blocks(model)
    assert blocks.source == (0, 1, 1, 1, 2)
    _same(model)
    p = tpkit.plan(model, 2)
    assert "model.layers.0.mlp.down_proj" in p and all(f"model.layers.{i}.mlp.experts" in p for i in range(1, 5))


def test_overrides_name_blocks_the_trace_left_out():
    from ..models import hf

    model = _deeper(hf.hf_model("llama"))
    over = {"model.layers.4.mlp.down_proj": "replicate", "model.layers.*.mlp.up_proj": "replicate"}
    assert tpkit.plan(model, 2, overrides=over).to_dict() == tpkit.plan(model, 2, overrides=over, reuse=False).to_dict()


class _Stack(nn.Module):
    """Embedding -> blocks -> norm -> head, where a block is a `Block`, a post-norm `Block`, or a dense MLP /
    separate-experts MoE."""

    def __init__(self, kinds: str, dim: int = 48):
        super().__init__()
        self.embed = nn.Embedding(97, dim)
        self.blocks = nn.ModuleList(_block(k, dim) for k in kinds)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 97, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


class _PostNorm(Block):
    """The same modules as `Block`, post-norm: the sublayers read the stream, the norms close each residual."""

    def __init__(self, dim):
        super().__init__(dim)
        self.post_norm = True

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2) for f in (self.wq, self.wk, self.wv))
        att = (q @ k.transpose(-1, -2)).softmax(-1)
        x = self.norm1(x + self.wo((att @ v).transpose(1, 2).reshape(b, s, -1)))
        return self.norm2(x + self.fc2(F.gelu(self.fc1(x))))


class _MoE(nn.Module):
    """A residual MoE block: soft routing (every expert runs, weighted), or top-2 (`hard`: which experts run
    depends on the weights, so one block's trace says nothing of another's)."""

    def __init__(self, dim, hard=False):
        super().__init__()
        self.hard = hard
        self.norm, self.moe = nn.LayerNorm(dim), SparseMoE(dim, 40, experts=4)

    def forward(self, x):
        h = self.norm(x)
        if self.hard:
            return x + self.moe(h)[0]
        weights = self.moe.gate(h).softmax(-1)
        return x + sum(e(h) * weights[..., i:i + 1] for i, e in enumerate(self.moe.experts))


def _block(kind: str, dim: int) -> nn.Module:
    return {"b": lambda: Block(dim), "p": lambda: _PostNorm(dim), "m": lambda: _MoE(dim),
            "h": lambda: _MoE(dim, hard=True)}[kind]()


@pytest.mark.parametrize("kinds, source", [("bbbbb", (0, 0, 0, 0, 1)), ("bpbpbpb", (0, 1, 0, 1, 0, 1, 2)),
                                           ("bmmmmm", (0, 1, 1, 1, 1, 2)), ("mbbbbbb", (0, 1, 1, 1, 1, 1, 2))])
def test_custom_stacks(kinds, source):
    torch.manual_seed(3)
    model = _Stack(kinds)
    (blocks,) = repeated_blocks(model)
    assert blocks.source == source
    _same(model)


def test_blocks_that_never_repeat_are_traced_whole():
    """A last block unlike the others (or no repeats at all) leaves nothing to copy: the whole trace plans."""
    torch.manual_seed(3)
    for kinds in ("bbbbm", "bpmbp"):
        model = _Stack(kinds)
        assert repeated_blocks(model) == []
        assert tpkit.plan(model, 2).to_dict() == tpkit.plan(model, 2, reuse=False).to_dict()


def test_experts_a_block_did_not_run_fall_back():
    """Top-2 routing runs different experts in different blocks: the whole trace plans (and reuse equals it)."""
    torch.manual_seed(3)
    model = _Stack("bhhhhh")
    assert len(repeated_blocks(model)) == 1 and analyze_blocks(model) is None
    assert tpkit.plan(model, 2).to_dict() == tpkit.plan(model, 2, reuse=False).to_dict()


def test_shared_weights_across_blocks_fall_back():
    torch.manual_seed(3)
    model = _Stack("bbbb")
    model.blocks[3].fc1.weight = model.blocks[0].fc1.weight
    assert analyze_blocks(model) is None
    model = _Stack("bbbb")
    model.blocks = nn.ModuleList([model.blocks[0]] * 4)  # one block object repeated
    assert repeated_blocks(model) == []


def test_the_model_is_restored_and_deep_copies_plan_alike():
    from ..models import hf

    model = _deeper(hf.hf_model("llama"))
    layers = model.model.layers
    tpkit.plan(model, 2)
    assert model.model.layers is layers and len(layers) == DEPTH
    short, _ = analyze_blocks(model)
    assert short.total_params == sum(p.numel() for p in model.parameters())  # the vocabulary's share reads it
    assert tpkit.plan(copy.deepcopy(model), 2).to_dict() == tpkit.plan(model, 2).to_dict()


def _tiny(config_cls, **extra) -> nn.Module:
    """A 6-layer transformers model of `config_cls`'s architecture, tiny."""
    import transformers

    cfg = getattr(transformers, config_cls)(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                                            num_attention_heads=4, num_key_value_heads=2, **extra)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


NAMING = {"Olmo2Config": ("model.layers.3.self_attn.q_norm", "gathered_norm"),
          "BitNetConfig": ("model.layers.3.mlp.ffn_sub_norm", "gathered_norm"),
          "ApertusConfig": ("model.layers.3.mlp.act_fn", "replicated_with_grad_allreduce"),
          "LagunaConfig": ("model.layers.3.self_attn.g_proj", "colwise")}


@pytest.mark.parametrize("config_cls", sorted(NAMING))
def test_gathered_norms_scalar_activations_and_gates_reuse(config_cls):
    """OLMo-2's q/k norms and BitNet's sub-norms (gathered), Apertus' xIELU (passed through) and Laguna's attention
    gate name other layers in their plan details: renamed block by block, the plan equals the whole trace's."""
    model = _tiny(config_cls)
    name, style = NAMING[config_cls]
    assert tpkit.plan(model, 2)[name] == style
    _same(model)


def test_layers_split_alone_reuse():
    """Attention with fewer heads than ranks: its projections are split alone (their reasons name the block), and
    renamed block by block the plan equals the whole trace's."""
    from ..models import hf

    model = _deeper(hf.hf_model("llama", num_attention_heads=2, num_key_value_heads=2))
    assert len(tpkit.plan(model, 3).split_alone()) == DEPTH * 4
    _same(model, worlds=(3,))
