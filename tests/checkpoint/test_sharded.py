"""save_sharded / load_sharded: training resumes exactly across world sizes, plain safetensors files load per
rank, a save killed midway leaves the previous checkpoint, and every bad input raises CheckpointError on every
rank with the model unchanged."""
from __future__ import annotations

import os
import struct

import pytest
import torch
import torch.nn.functional as F

import tpkit
from tests.checkpoint.fixtures import killed_save_body, logits_of, rel
from tests.models.hf import hf_model, inputs

LR = 1e-2


def _loss(model) -> torch.Tensor:
    ids = inputs()
    y = model(input_ids=ids).logits
    return F.cross_entropy(y[:, :-1].reshape(-1, y.shape[-1]), ids[:, 1:].reshape(-1))


def _step(model, opt) -> None:
    opt.zero_grad()
    _loss(model).backward()
    opt.step()


def _train_and_save(directory):
    model = tpkit.parallelize(hf_model("llama", num_key_value_heads=2).double())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _step(model, opt)
    _step(model, opt)
    tpkit.save_sharded(model, directory, optimizer=opt, step=2)


def _resume(directory, ref):
    model = tpkit.parallelize(hf_model("llama", num_key_value_heads=2, initializer_range=0.7).double())
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.3)  # overwritten by the checkpoint
    meta = tpkit.load_sharded(model, directory, optimizer=opt)
    _step(model, opt)
    layouts = tpkit.shard_layouts(model)
    worst = 0.0
    for n, p in model.named_parameters():
        want = layouts[n].shard(ref[n])
        worst = max(worst, ((p.detach() - want).abs().max() / want.abs().max().clamp_min(LR)).item())
    return worst, meta["step"]


@pytest.mark.parametrize("world", [3, 1])
def test_adamw_resumes_exactly_at_another_world_size(tmp_path, world):
    ref_model = hf_model("llama", num_key_value_heads=2).double()
    opt = torch.optim.AdamW(ref_model.parameters(), lr=LR)
    for _ in range(3):
        _step(ref_model, opt)
    ref = {n: p.detach() for n, p in ref_model.named_parameters()}
    tpkit.launch(_train_and_save, 2, backend="threads", args=(str(tmp_path),))
    for worst, step in tpkit.launch(_resume, world, backend="threads", args=(str(tmp_path), ref)):
        assert worst < 1e-6 and step == 2, worst


def _load_plain(path, ref):
    model = tpkit.parallelize(hf_model("llama", initializer_range=0.7))
    tpkit.load_sharded(model, path)
    return rel(logits_of(model), ref)


def test_plain_safetensors_file_and_directory_load_per_rank(tmp_path):
    from safetensors.torch import save_file

    model = hf_model("llama")
    ref = logits_of(model)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(tmp_path / "m.safetensors"))
    half = len(sd) // 2
    os.makedirs(tmp_path / "d")
    save_file(dict(list(sd.items())[:half]), str(tmp_path / "d" / "a.safetensors"))
    save_file(dict(list(sd.items())[half:]), str(tmp_path / "d" / "b.safetensors"))
    for path in (tmp_path / "m.safetensors", tmp_path / "d"):
        assert all(e < 1e-5 for e in tpkit.launch(_load_plain, 2, backend="threads", args=(str(path), ref)))


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(tpkit.LaunchError, match="rank"):
        tpkit.launch(killed_save_body, 2, backend="gloo", args=(str(tmp_path),), timeout=60)
    versions = sorted(n for n in os.listdir(tmp_path) if n.startswith("v"))
    assert len(versions) == 2 and (tmp_path / "latest").read_text().strip() == versions[0]
    model = hf_model("llama", initializer_range=0.7)
    assert tpkit.load_sharded(model, str(tmp_path))["step"] == 1
    assert rel(logits_of(model), logits_of(hf_model("llama"))) < 1e-5


# Bad inputs: each case makes a damaged copy of a good checkpoint; every rank must raise, nothing may change.


def _save_good(directory, **over):
    tpkit.save_sharded(tpkit.parallelize(hf_model("llama", **over)), directory)


def _rank_file(root, rank=1):
    version = (root / "latest").read_text().strip()
    return root / version / f"rank-{rank:05d}.safetensors"


def _truncate(root):
    f = _rank_file(root)
    f.write_bytes(f.read_bytes()[:-100])


def _corrupt_header(root):
    f = _rank_file(root)
    data = bytearray(f.read_bytes())
    data[8:20] = b"{not json!!!"
    f.write_bytes(bytes(data))


def _flip_data_byte(root):
    f = _rank_file(root, 0)
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))


def _remove_file(root):
    os.remove(_rank_file(root))


def _load_expect_error(directory, strict=True):
    model = tpkit.parallelize(hf_model("llama"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        tpkit.load_sharded(model, directory, strict=strict)
        message = None
    except tpkit.CheckpointError as exc:
        message = str(exc)
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return message, unchanged


def _check_bad(directory, *needles):
    results = tpkit.launch(_load_expect_error, 2, backend="threads", args=(str(directory),))
    for message, unchanged in results:
        assert message is not None and unchanged, (message, unchanged)
        for needle in needles:
            assert needle in message, (needle, message)
    return results[0][0]


@pytest.mark.parametrize("damage, needle", [(_truncate, "rank-00001"), (_corrupt_header, "rank-00001"),
                                            (_flip_data_byte, "sha256"), (_remove_file, "rank-00001")])
def test_damaged_checkpoint_files(tmp_path, damage, needle):
    tpkit.launch(_save_good, 2, backend="threads", args=(str(tmp_path),))
    damage(tmp_path)
    _check_bad(tmp_path, needle)


def test_wider_mlp_fails_on_shape_before_touching_the_embeddings(tmp_path):
    tpkit.launch(lambda: _save_good(str(tmp_path), intermediate_size=96), 2, backend="threads")
    _check_bad(tmp_path, "mlp", "shape")


def test_dtype_mismatch(tmp_path):
    """Floating tensors are cast into the model's dtype (as torch's load_state_dict does: tests/checkpoint/
    test_dtypes.py); FP8 values, which mean nothing without their scales, are refused."""
    model = hf_model("llama")
    w = model.model.layers[1].mlp.down_proj.weight
    w.data = w.data.to(torch.float8_e4m3fn)
    tpkit.save_sharded(model, str(tmp_path))
    _check_bad(tmp_path, "down_proj.weight", "float8_e4m3fn", "the model's")


def test_another_models_checkpoint(tmp_path):
    tpkit.save_sharded(hf_model("neox"), str(tmp_path))
    _check_bad(tmp_path, "lacks")


def test_fused_gate_up_of_another_width_is_caught_by_full_shape(tmp_path):
    """Phi-3 gate_up at intermediate 80 vs 88: compare full shapes, never local ones."""
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in hf_model("phi3", intermediate_size=88).state_dict().items()}
    save_file(sd, str(tmp_path / "m.safetensors"))

    def body():
        model = tpkit.parallelize(hf_model("phi3"))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(tpkit.CheckpointError, match="gate_up_proj.*shape"):
            tpkit.load_sharded(model, str(tmp_path / "m.safetensors"))
        return all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    assert all(tpkit.launch(body, 2, backend="threads"))


def test_truncated_plain_file_names_file_and_tensor(tmp_path):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in hf_model("llama").state_dict().items()}, str(tmp_path / "m.safetensors"))
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:len(data) - 50])
    message = _check_bad(tmp_path / "m.safetensors", "m.safetensors", "truncated")
    assert "tensor" in message


def test_header_length_beyond_the_file(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", 10 ** 6) + b"{}")
    _check_bad(tmp_path / "m.safetensors", "corrupt")
