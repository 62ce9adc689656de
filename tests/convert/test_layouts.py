"""`shard_layouts` of converted Hugging Face models: one layout per state_dict key; each layout cuts the full
tensor into exactly the rank's local tensor, the ranks' locals unshard into the original, and the byte
ranges it names, read from a safetensors file of the full model, give the local tensor too. Llama with fewer
KV heads than ranks, GPT-2 (Conv1D, fused c_attn), Phi-3 (fused qkv and gate_up), GPT-NeoX (per-head qkv),
BERT; the vocabulary (103) never divides by the world size."""
from __future__ import annotations

import json
import struct

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import tpkit  # noqa: E402

from tests.models.hf import hf_model  # noqa: E402

CASES = [("llama", {"num_key_value_heads": 2}), ("gpt2", {}), ("phi3", {}), ("neox", {}), ("bert", {})]
DTYPES = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64}


def read_local(path: str, key: str, layout: tpkit.ShardLayout) -> torch.Tensor:
    """The local tensor of `key`, read from a safetensors file through the layout's byte ranges only."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(n))[key]
        dtype = DTYPES[entry["dtype"]]
        base = 8 + n + entry["data_offsets"][0]
        chunks = []
        for start, stop in layout.byte_ranges(dtype.itemsize):
            f.seek(base + start)
            chunks.append(f.read(stop - start))
    flat = torch.frombuffer(bytearray(b"".join(chunks)), dtype=dtype) if chunks else torch.empty(0, dtype=dtype)
    local = flat.reshape(layout.stored_local_shape)
    return local.t() if layout.transposed else local


def rank_layouts(name: str, over: dict, path: str) -> dict:
    """On one rank: convert, then check every key's layout against the local tensor and the file."""
    from safetensors import safe_open

    comm = tpkit.get_communicator()
    full = {k: v.clone() for k, v in hf_model(name, **over).state_dict().items()}
    model = tpkit.parallelize(hf_model(name, **over), comm=comm)
    layouts = tpkit.shard_layouts(model)
    local = model.state_dict()
    with safe_open(path, "pt") as f:
        saved = set(f.keys())
    return {
        "same_keys": list(layouts) == list(local),
        "shard_mismatch": [k for k in local if not torch.equal(layouts[k].shard(full[k]), local[k])],
        "file_mismatch": [k for k in local if k in saved and not torch.equal(read_local(path, k, layouts[k]), local[k])],
        "split": sorted(k for k, lay in layouts.items() if not lay.is_replicated),
        "layouts": layouts,
        "local": local,
    }


def _save_full(name: str, over: dict, tmp_path) -> tuple[str, dict]:
    from safetensors.torch import save_file

    model = hf_model(name, **over)
    full = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    path = str(tmp_path / f"{name}.safetensors")
    # safetensors refuses tensors that share memory (tied weights): one copy each is what a checkpoint holds
    save_file({k: v.clone() for k, v in full.items()}, path)
    return path, full


def _check(results: list[dict], full: dict, world: int) -> None:
    for rank, r in enumerate(results):
        assert r["same_keys"], f"rank {rank}: shard_layouts keys differ from state_dict keys"
        assert not r["shard_mismatch"], f"rank {rank}: layout.shard differs from the local tensor: {r['shard_mismatch']}"
        assert not r["file_mismatch"], f"rank {rank}: byte ranges differ from the local tensor: {r['file_mismatch']}"
        assert all(lay.rank == rank and lay.world_size == world for lay in r["layouts"].values())
    assert results[0]["split"], "nothing was split"
    for key, tensor in full.items():
        lay = results[0]["layouts"][key]
        back = lay.unshard([r["local"][key] for r in results])
        assert torch.equal(back, tensor), f"unshard of {key} differs from the original"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name,over", CASES, ids=[c[0] for c in CASES])
def test_layouts_threads(name, over, world, tmp_path):
    path, full = _save_full(name, over, tmp_path)
    results = tpkit.launch(rank_layouts, world, backend="threads", args=(name, over, path))
    _check(results, full, world)


def rank_layouts_many(cases: list, paths: list) -> list[dict]:
    return [rank_layouts(name, over, path) for (name, over), path in zip(cases, paths)]


@pytest.mark.slow
def test_layouts_gloo(tmp_path):
    """Two gloo processes (one start-up for both models: each process imports transformers)."""
    cases = [CASES[0], CASES[1]]
    saved = [_save_full(name, over, tmp_path) for name, over in cases]
    results = tpkit.launch(rank_layouts_many, 2, backend="gloo", args=(cases, [p for p, _ in saved]), timeout=240)
    for i, (_, full) in enumerate(saved):
        _check([r[i] for r in results], full, 2)


def test_gpt2_conv1d_weight_is_transposed_in_the_layout():
    """GPT-2's c_attn weight is stored (in, out) = (48, 144) and held (out_local, in) by the converted layer."""
    def body(comm):
        model = tpkit.parallelize(hf_model("gpt2"), comm=comm)
        return tpkit.shard_layouts(model)["transformer.h.0.attn.c_attn.weight"]
    lay0, lay1 = tpkit.run_threads(body, 2)
    assert lay0.transposed and lay0.full_shape == (48, 144) and lay0.dim == 1
    assert lay0.local_shape == (72, 48) and len(lay0.pieces) == 3
    assert [p.size for p in lay0.pieces] == [48, 48, 48] and lay1.segments() == [(24, 48), (72, 96), (120, 144)]


def test_llama_kv_heads_fewer_than_ranks_are_partly_replicated():
    def body(comm):
        model = tpkit.parallelize(hf_model("llama", num_key_value_heads=2), comm=comm)
        return tpkit.shard_layouts(model)["model.layers.0.self_attn.k_proj.weight"]
    lays = tpkit.run_threads(body, 4)
    # 2 KV heads of 8 features over 4 ranks: ranks 0, 1 hold head 0, ranks 2, 3 head 1
    assert [lay.segments() for lay in lays] == [[(0, 8)], [(0, 8)], [(8, 16)], [(8, 16)]]
    assert all(lay.replicas() == (2,) * 8 for lay in lays) and not lays[0].is_replicated


def test_unconverted_model_is_whole_at_world_size_one():
    model = hf_model("gpt2")
    layouts = tpkit.shard_layouts(model)
    assert list(layouts) == list(model.state_dict())
    assert all(lay.is_replicated and lay.world_size == 1 for lay in layouts.values())
