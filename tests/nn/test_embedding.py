"""VocabParallelEmbedding / ParallelEmbedding against one nn.Embedding: outputs, weight gradients (incl.
padding_idx and ids on every rank's boundary), construction from sizes, from_module and error cases."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tpkit
from tpkit.comm import create_communicators
from tpkit.nn import ParallelEmbedding, VocabParallelEmbedding

from .helpers import (FP64_TOL, THREAD_SIZES, assert_small, local_slice, randn, rel_err, run,
                      seeded_embedding)


def embedding_checks(dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    r = tpkit.get_communicator().rank
    errors = {}
    for num, dim, pad in ((11, 6, None), (10, 5, 3), (7, 4, -1)):
        full = seeded_embedding(num, dim, num, pad, dtype)
        ids = torch.arange(num).repeat(2).reshape(2, num)  # every id, so every rank's boundaries are hit
        ids[1] = torch.randint(0, num, (num,), generator=torch.Generator().manual_seed(num))
        gy = randn((2, num, dim), num + 1, dtype)
        y_ref = full(ids)
        (y_ref * gy).sum().backward()
        for cls in (VocabParallelEmbedding, ParallelEmbedding):
            layer = cls.from_module(full)
            y = layer(ids)
            (y * gy).sum().backward()
            split_dim = cls.PARTITION_DIMS["weight"]
            tag = f"{cls.__name__}({num},{dim},pad={pad})"
            errors[f"{tag} out"] = rel_err(y, y_ref)
            errors[f"{tag} dW"] = rel_err(layer.weight.grad,
                                          local_slice(full.weight.grad, split_dim, layer.partition_sizes, r))
        no_gather = ParallelEmbedding.from_module(full, gather_output=False)
        errors[f"ParallelEmbedding no gather {num}"] = rel_err(
            no_gather(ids), local_slice(y_ref, -1, no_gather.partition_sizes, r))
    return errors


@pytest.mark.parametrize("world_size", THREAD_SIZES)
def test_embeddings_match_single_device_threads(world_size):
    assert_small(run(embedding_checks, world_size, "threads", "float64"), FP64_TOL)


@pytest.mark.parametrize("cls", [VocabParallelEmbedding, ParallelEmbedding])
def test_construction_slices_single_device_init(cls):
    torch.manual_seed(3)
    ref = nn.Embedding(10, 7, padding_idx=4)
    for comm in create_communicators(3):
        torch.manual_seed(3)
        layer = cls(10, 7, padding_idx=4, comm=comm)
        dim = cls.PARTITION_DIMS["weight"]
        assert torch.equal(layer.weight, local_slice(ref.weight, dim, layer.partition_sizes, comm.rank))
        assert layer.split_dims() == {"weight": dim} and not vars(layer.weight)
    meta = cls.from_module(nn.Embedding(10, 7, device="meta"), comm=create_communicators(4)[3])
    assert meta.weight.is_meta and meta.weight.shape == ((2, 7) if cls is VocabParallelEmbedding else (10, 1))


def _id_errors() -> str:
    layer = VocabParallelEmbedding(10, 4)
    # A device-side assertion (no host sync); TP_DEBUG=1 says which ids (tests/nn/test_compile.py).
    with pytest.raises(RuntimeError, match=r"VocabParallelEmbedding: ids must be in 0\.\.9 "):
        layer(torch.tensor([0, 10]))
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        ParallelEmbedding(10, 4)(torch.tensor([0.0]))
    return "ok"


def test_errors():
    assert run(_id_errors, 2, "threads") == ["ok", "ok"]
    comms = create_communicators(4)
    with pytest.raises(ValueError, match=r"VocabParallelEmbedding: num_embeddings 3 has only 3 rows/columns, fewer "
                                         r"than world size 4.*valid world sizes: 1\.\.3"):
        VocabParallelEmbedding(3, 8, comm=comms[0])
    with pytest.raises(ValueError, match=r"ParallelEmbedding: padding_idx 12 must be within num_embeddings \(10\)"):
        ParallelEmbedding(10, 8, padding_idx=12, comm=comms[0])
    with pytest.raises(ValueError, match=r"VocabParallelEmbedding.from_module: max_norm=1.0 is not supported"):
        VocabParallelEmbedding.from_module(nn.Embedding(10, 4, max_norm=1.0), comm=comms[0])
    with pytest.raises(ValueError, match=r"ParallelEmbedding.from_module: sparse=True is not supported"):
        ParallelEmbedding.from_module(nn.Embedding(10, 4, sparse=True), comm=comms[0])
    with pytest.raises(TypeError, match=r"VocabParallelEmbedding.from_module: expected a torch.nn.Embedding"):
        VocabParallelEmbedding.from_module(nn.Linear(3, 3), comm=comms[0])
