"""Where a model is cut: the block list (HF's base_model_pp_plan, else the repeated blocks), the modules before and
after it, the balanced split against a brute force over every cut, the explicit override, the ties across the
first and last stage, and the errors (no blocks, more stages than blocks, a bad override) raised before anything
changes."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import tpkit
from tpkit.pipeline import SplitError, bubble_fraction, split_stages
from tpkit.pipeline.split import find_blocks
from tpkit.pipeline.tied import TiedPair, tied_pairs
from tests.pipeline.cases import llama, qwen_tied


def gpt2(layers: int = 4):
    import transformers as tr

    torch.manual_seed(0)
    config = tr.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=96, n_positions=32, bos_token_id=0,
                           eos_token_id=0)
    return tr.GPT2LMHeadModel(config).to(torch.float64).eval()  # no dropout


class Blocks(nn.Module):
    """A custom model: an embedding, a ModuleList of blocks, a head."""

    def __init__(self, n: int = 4, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n))
        self.head = nn.Linear(width, 16)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_the_blocks_and_the_modules_around_them():
    s = split_stages(llama(), 2)  # base_model_pp_plan names "layers"
    assert (s.blocks, s.num_blocks, s.first, s.last) == ("model.layers", 5, ("model.embed_tokens",),
                                                         ("model.norm", "lm_head"))
    s = split_stages(gpt2(), 2)  # no pp plan: _no_split_modules (GPT2Block)
    assert (s.blocks, s.first, s.last) == ("transformer.h", ("transformer.wte", "transformer.wpe"),
                                           ("transformer.ln_f", "lm_head"))
    s = split_stages(Blocks(), 4)  # no config: the longest ModuleList
    assert (s.blocks, s.starts, s.first, s.last) == ("blocks", (0, 1, 2, 3), ("embed",), ("head",))
    assert s.owner("blocks.2.0") == 2 and s.owner("embed") == 0 and s.owner("head") == 3 and s.owner("") is None


def _costs(model, split) -> tuple[list, list, list]:
    """FLOPs and bytes per block, and of the first / last modules, counted here from the parameters."""
    def cost(modules):
        flops = sum(2 * p.numel() for m in modules for sub in m.modules() if not isinstance(sub, nn.Embedding)
                    for p in sub.parameters(recurse=False) if p.dim() >= 2)
        nbytes = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
        return flops, nbytes
    blocks = model.get_submodule(split.blocks)
    return ([cost([b]) for b in blocks], cost([model.get_submodule(n) for n in split.first]),
            cost([model.get_submodule(n) for n in split.last]))


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_the_balanced_split_minimises_the_largest_load(stages):
    model = llama()  # its LM head and embedding are large next to a block: the end stages get fewer blocks
    split = split_stages(model, stages)
    blocks, head, tail = _costs(model, split)
    total = [sum(b[k] for b in blocks) + head[k] + tail[k] for k in (0, 1)]

    def loads(starts):
        ends = list(starts[1:]) + [len(blocks)]
        out = []
        for s, (a, b) in enumerate(zip(starts, ends)):
            c = [sum(blocks[i][k] for i in range(a, b)) + (head[k] if s == 0 else 0)
                 + (tail[k] if s == len(starts) - 1 else 0) for k in (0, 1)]
            out.append(max(c[0] / total[0], c[1] / total[1]))
        return out

    every = [(0,) + cut for cut in itertools.combinations(range(1, len(blocks)), stages - 1)]
    best = min(max(loads(s)) for s in every)
    assert max(split.loads) == pytest.approx(best, rel=1e-12) and list(split.loads) == pytest.approx(
        loads(split.starts), rel=1e-12)
    assert split.num_stages == stages and split.describe().count("stage ") == stages


def test_the_split_follows_the_cost_not_the_count():
    """A large vocabulary: the embedding (bytes) and the LM head (FLOPs and bytes) weigh several blocks each, so the
    end stages take fewer blocks than an even count would give them."""
    import transformers as tr

    config = tr.LlamaConfig(vocab_size=2000, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
                            num_attention_heads=4, num_key_value_heads=2)
    split = split_stages(tr.LlamaForCausalLM(config), 3)
    assert [len(split.stage_blocks(s)) for s in range(3)] == [1, 3, 1], split.describe()


def test_starts_override_the_split_and_bad_ones_say_what_is_valid():
    assert split_stages(llama(), 3, starts=[0, 2, 4]).starts == (0, 2, 4)
    for bad in ([1, 2, 4], [0, 4, 2], [0, 2], [0, 2, 5]):
        with pytest.raises(SplitError, match=r"starts=.* must be 3 increasing block indices, the first 0 and the "
                                             r"last below 5 \(the blocks of model.layers\)"):
            split_stages(llama(), 3, starts=bad)


def test_more_stages_than_blocks_and_no_blocks_are_refused():
    with pytest.raises(SplitError, match=r"into 6 pipeline stages: it has 5 blocks \(model.layers\) .* at most 5"):
        split_stages(llama(), 6)
    with pytest.raises(SplitError, match="Sequential into pipeline stages: it has no repeated blocks"):
        split_stages(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), 2)


def test_a_weight_tied_across_the_first_and_last_stage_is_one_pair():
    model = qwen_tied()
    assert tied_pairs(model, split_stages(model, 2)) == [TiedPair("model.embed_tokens.weight", "lm_head.weight")]
    assert tied_pairs(llama(), split_stages(llama(), 2)) == []
    model = Blocks()
    model.blocks[3][0].weight = model.blocks[1][0].weight  # shared by stages 1 and 3 of 4
    with pytest.raises(SplitError, match=r"one parameter used by stages \[1, 3\]"):
        tied_pairs(model, split_stages(model, 4))


def test_find_blocks_prefers_the_pp_plan():
    name, lst = find_blocks(qwen_tied())
    assert name == "model.layers" and len(lst) == 4


def test_the_bubble():
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19) and bubble_fraction(4, 8, 2) < bubble_fraction(4, 8)
    assert bubble_fraction(1, 8) == 0


def test_public_names():
    assert tpkit.split_stages is split_stages and tpkit.SplitError is SplitError



def test_a_parts_plan_keeps_the_modules_the_forward_replaced():
    """A part is converted with the whole model's plan cut to it, as recorded: a plan made while the model's forward
    replaced some of its modules (BigBird's attention) keeps saying so, so that the part is traced again
    (`test_a_recorded_plan_made_while_the_forward_replaced_modules_is_traced_again`)."""
    from tpkit.convert.plan import Plan
    from tpkit.pipeline import compose

    part = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    plan = Plan({"0": "colwise", "1": "rowwise", "2": "colwise"}, world_size=2, replaced_by_forward=["0"])
    cut = compose.part_plan(plan, part)
    assert dict(cut.entries) == {"0": "colwise", "1": "rowwise"} and cut.replaced_by_forward == ("0",)
