"""`local_shapes` (the analyzer's bytes per rank) against the layers `parallelize` builds, and the split rule."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tpkit
from tpkit.convert.shard import local_shapes


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
    assert [local_shapes(emb, style, {}, world, r)["weight"] for r in range(world)] == built
