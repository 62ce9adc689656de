"""`module_layouts` (what the analyzer counts and the builders cut) against the layers `parallelize` builds, and
the split rule."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tpkit
from tpkit.convert.registry import module_layouts


def local_shapes(m, style, details, world, rank):
    return {n: lay.local_shape for n, lay in module_layouts(m, style, details, world, rank).items()}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("style", ["rowwise", "colwise", "embedding_rowwise", "embedding_colwise"])
def test_embedding_local_shapes_match_the_built_shard(world, style):
    """HF's 'rowwise' / 'colwise' on an embedding mean its vocabulary / its features."""
    emb = nn.Embedding(11, 7)

    def body(comm):
        m = tpkit.parallelize(nn.Sequential(nn.Embedding(11, 7)), {"0": style}, comm,
                              example_inputs=(torch.tensor([[1, 2]]),))
        return tuple(m[0].weight.shape)
    built = tpkit.comm.run_threads(body, world)
    assert [local_shapes(emb, style, None, world, r)["weight"] for r in range(world)] == built


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_conv_and_channelwise_shapes_follow_the_split_rule(world):
    """Column conv -> BatchNorm -> row conv with 7 channels (uneven over 2, 3, 4): every rank's built
    parameters and buffers have `local_shapes`' shapes, which are tpkit.comm.split_sizes' shares."""
    from tpkit.comm import split_sizes

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 7, 1), nn.BatchNorm2d(7), nn.Conv2d(7, 5, 1))
    full = make()
    plan = {"0": "colwise", "1": "channelwise", "2": "rowwise"}
    example = (torch.randn(2, 3, 4, 4),)

    def body(comm):
        m = tpkit.parallelize(make(), plan, comm, example_inputs=example)
        return [{n: tuple(p.shape) for n, p in m[i].named_parameters()} for i in range(3)], \
            tuple(m[1].running_mean.shape)
    for rank, (shapes, running) in enumerate(tpkit.comm.run_threads(body, world)):
        share = split_sizes(7, world)[rank]
        want = [local_shapes(full[i], plan[str(i)], None, world, rank) for i in range(3)]
        assert shapes == [{n: s for n, s in w.items() if n in ("weight", "bias")} for w in want]
        assert want[1]["running_mean"] == running
        assert shapes[1]["weight"] == running == (share,) and shapes[2]["weight"] == (5, share, 1, 1)
