"""Sequence parallelism through `parallelize(..., sequence_parallel=True)`: the residual stream and its norms
run on sequence shards; loss, every gradient (the norms' summed in the backward itself) and an optimizer step
equal one device's."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import tpkit  # noqa: E402
from tpkit.convert import PlanError, conversion_of, parallelize  # noqa: E402

from tests.models.hf import hf_model  # noqa: E402

IDS = torch.randint(2, 103, (2, 12), generator=torch.Generator().manual_seed(0))  # 12: divides by 2, 3 and 4


def _reference(model):
    ref = copy.deepcopy(model)
    out = ref(input_ids=IDS, labels=IDS)
    out.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    after = {n: p.detach() for n, p in ref.named_parameters()}
    return out.loss.item(), grads, after


@pytest.mark.parametrize("name,world", [("llama", 2), ("llama", 3), ("llama", 4), ("gpt2", 2), ("gpt2", 3)])
def test_training_step_equals_one_device(name, world):
    model = hf_model(name).double()  # fp64: the check is about the algebra, not rounding
    loss, grads, after = _reference(model)
    copies = [copy.deepcopy(model) for _ in range(world)]

    def body(comm):
        m = parallelize(copies[comm.rank], "auto", comm, mode="training", sequence_parallel=True)
        out = m(input_ids=IDS, labels=IDS)
        out.loss.backward()  # the norms' partial gradients are summed in the backward itself
        lay = tpkit.shard_layouts(m)
        g_err = max(((p.grad - lay[n].shard(grads[n])).abs().max()
                     / grads[n].abs().max().clamp_min(1e-30)).item() for n, p in m.named_parameters())
        torch.optim.SGD(m.parameters(), lr=1.0).step()
        w_err = max(((p.detach() - lay[n].shard(after[n])).abs().max()
                     / after[n].abs().max().clamp_min(1e-2)).item() for n, p in m.named_parameters())
        region = conversion_of(m).settled["sequence_parallel"].state
        return out.loss.item(), g_err, w_err, region.entry_block, len(region.norms)
    for got, g_err, w_err, entry, norms in tpkit.comm.run_threads(body, world):
        assert abs(got - loss) < 1e-6 * abs(loss)
        # HF computes the loss in fp32 even for fp64 logits, so gradients agree to ~1e-7 and the AdamW step (which
        # divides each gradient by its own size) to the 1e-4.
        assert g_err < 1e-5 and w_err < 1e-4, (g_err, w_err)
        assert entry in ("model.layers.0", "transformer.h.0") and norms == 5  # 2 per layer + the final norm


def test_hf_style_entry_turns_it_on_and_bad_uses_raise():
    model = hf_model("llama")
    copies = [copy.deepcopy(model) for _ in range(2)]

    def body(comm):
        m = parallelize(copies[comm.rank], {"model.norm": "sequence_parallel"}, comm, mode="training")
        styles = m.tp_plan.entries
        with pytest.raises(ValueError, match="multiple of the world size 2"):
            m(input_ids=IDS[:, :7], labels=IDS[:, :7])
        return styles["model.layers.1.input_layernorm"], m.model.layers[0].self_attn.o_proj.sequence_parallel
    assert tpkit.comm.run_threads(body, 2)[0] == ("sequence_parallel", True)

    bert = hf_model("bert")
    snap = {k: v.clone() for k, v in bert.state_dict().items()}
    copies = [bert, copy.deepcopy(bert)]

    def bad(comm):
        with pytest.raises(PlanError, match="sequence parallelism"):
            parallelize(copies[comm.rank], "auto", comm, sequence_parallel=True)
    tpkit.comm.run_threads(bad, 2)
    assert all(torch.equal(v, snap[k]) for k, v in bert.state_dict().items())


class _MaskedBlock(torch.nn.Module):
    """A pre-norm MLP block called with keywords only, the mask first (as some models call their layers)."""

    def __init__(self, hidden):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up, self.down = torch.nn.Linear(hidden, 2 * hidden), torch.nn.Linear(2 * hidden, hidden)

    def forward(self, attention_mask=None, hidden_states=None):
        return hidden_states + self.down(torch.relu(self.up(self.norm(hidden_states))) * attention_mask[..., None])


class _MaskedNet(torch.nn.Module):
    def __init__(self, hidden=12, out=10, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(out, hidden)
        self.blocks = torch.nn.ModuleList(_MaskedBlock(hidden) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, out)

    def forward(self, ids, mask):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(attention_mask=mask, hidden_states=x)
        return self.head(self.norm(x))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_entry_splits_the_hidden_states_not_the_first_keyword(world):
    """The block takes `attention_mask` before `hidden_states` as keywords: only the hidden states are split
    along the sequence; the mask (batch 4 x sequence 12, so a wrong split would not fail on shape) stays whole."""
    from tpkit.comm import split_range

    torch.manual_seed(0)
    model = _MaskedNet().double()
    x = torch.randint(0, 10, (4, 12))
    mask = (torch.rand(4, 12) > 0.3).double()
    ref = model(x, mask)
    plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise", "head": "vocab_parallel"}
    copies = [copy.deepcopy(model) for _ in range(world)]

    def body(comm):
        m = parallelize(copies[comm.rank], plan, comm, mode="training", sequence_parallel=True,
                        example_inputs=(x, mask))
        start, end = split_range(10, comm.world_size, comm.rank)
        err = ((m(x, mask) - ref[..., start:end]).abs().max() / ref.abs().max()).item()
        region = conversion_of(m).settled["sequence_parallel"].state
        return err, region.entry_block, region.entry_arg
    for err, block, arg in tpkit.comm.run_threads(body, world):
        assert (block, arg) == ("blocks.0", "hidden_states") and err < 1e-12, (block, arg, err)
