"""from_pretrained on the CPU: a tensor whose bytes are one range of the checkpoint file is a view of that file's
private mapping (no copy); writes to it copy the page and never reach the file; TPKIT_MAP_WEIGHTS=0 copies."""
from __future__ import annotations

import glob
import hashlib
import os

import pytest
import torch

import tpkit
from tests.checkpoint.fixtures import hf_logits, logits_of, rel, write_hf


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = write_hf(str(tmp_path_factory.mktemp("mapped")), "llama")
    return path, hf_logits(path)


def _mapped_files() -> list[tuple[int, int, str]]:
    """(start, stop, path) of this process's mappings of .safetensors files."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[-1].endswith(".safetensors"):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b, parts[-1]))
    return out


def _where(t: torch.Tensor, maps) -> str | None:
    ptr = t.data_ptr()
    return next((p for a, b, p in maps if a <= ptr < b), None)


def _load_body(path, ref):
    model = tpkit.from_pretrained(path)
    maps = _mapped_files()
    layouts = tpkit.shard_layouts(model)
    where = {n: _where(p, maps) for n, p in model.named_parameters()}
    styles = {n: layouts[n].dim for n, _ in model.named_parameters()}
    err = rel(logits_of(model), ref)
    with torch.no_grad():  # an optimizer step's worth of writes: each touches private pages only
        for p in model.parameters():
            p.add_(1.0)
    return err, where, styles


def _digests(path: str) -> dict[str, str]:
    return {f: hashlib.sha256(open(f, "rb").read()).hexdigest() for f in glob.glob(os.path.join(path, "*"))}


@pytest.mark.parametrize("world", [2, 3])
def test_row_blocks_and_whole_tensors_are_views_of_the_file_and_writes_stay_private(llama_dir, world):
    path, ref = llama_dir
    before = _digests(path)
    for err, where, styles in tpkit.launch(_load_body, world, backend="threads", args=(path, ref)):
        assert err < 1e-5
        # a column split keeps whole rows of the [out, in] weight: one range of the file
        col = [n for n, d in styles.items() if d == 0 and n.endswith("q_proj.weight")]
        whole = [n for n, d in styles.items() if d is None and n.endswith("norm.weight")]
        row = [n for n, d in styles.items() if d == 1 and n.endswith("o_proj.weight")]
        assert col and whole and row
        assert all(where[n] is not None and where[n].startswith(path) for n in col + whole), where
        assert all(where[n] is None for n in row), {n: where[n] for n in row}  # a column block: copied
    assert _digests(path) == before
    for err, _, _ in tpkit.launch(_load_body, world, backend="threads", args=(path, ref)):
        assert err < 1e-5  # the writes of the first load went to private pages


def test_map_weights_off_copies_every_tensor(llama_dir, monkeypatch):
    path, ref = llama_dir
    monkeypatch.setenv("TPKIT_MAP_WEIGHTS", "0")
    for err, where, _ in tpkit.launch(_load_body, 2, backend="threads", args=(path, ref)):
        assert err < 1e-5
        assert not any(where.values()), where


def test_a_changed_byte_is_caught_in_a_mapped_piece(llama_dir, tmp_path):
    """A tpkit checkpoint at its saved world size: every piece is mapped whole and hashed from the mapping."""
    path, ref = llama_dir

    def save(out):
        model = tpkit.from_pretrained(path)
        tpkit.save_sharded(model, out)

    out = str(tmp_path / "saved")
    tpkit.launch(save, 2, backend="threads", args=(out,))
    f = sorted(glob.glob(os.path.join(out, "*", "rank-00000.safetensors")))[0]
    data = bytearray(open(f, "rb").read())
    data[-3] ^= 0x10
    with open(f, "wb") as fh:
        fh.write(bytes(data))

    def load():
        try:
            tpkit.from_pretrained(out)
        except tpkit.CheckpointError as exc:
            return str(exc)
        return None

    messages = tpkit.launch(load, 2, backend="threads")
    assert all(m is not None and "sha256" in m for m in messages), messages


@pytest.fixture(scope="module")
def other_dirs(tmp_path_factory):
    """GPT-2 (Conv1D weights stored transposed), Qwen2 with tied embeddings, NeoX (packed qkv: a rank's
    columns are several segments of the fused weight)."""
    from tests.models.hf import hf_model

    root = tmp_path_factory.mktemp("mapped2")
    out = {}
    for name in ("gpt2", "qwen2", "neox"):
        model = hf_model(name)
        model.save_pretrained(root / name)
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        out[name] = str(root / name), hf_logits(str(root / name)), model.state_dict(), tied
    return out


def _every_tensor_body(path, full, dtype):
    model = tpkit.from_pretrained(path, dtype=dtype)
    layouts = tpkit.shard_layouts(model)
    differ = [k for k, v in model.state_dict().items()
              if k in full and not torch.equal(v, layouts[k].shard(full[k]).to(v.dtype))]
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return logits_of(model), differ, tied


@pytest.mark.parametrize("name, dtype", [("gpt2", torch.float64), ("qwen2", None), ("neox", torch.float64)])
@pytest.mark.parametrize("world", [2, 3])
def test_row_splits_conversions_and_transposes_are_copied_from_the_mapping(other_dirs, name, dtype, world,
                                                                          monkeypatch):
    """Every tensor equals its shard of transformers' state dict, and none was read by positional reads."""
    from tpkit.checkpoint import reader

    path, ref, full, hf_tied = other_dirs[name]
    reads = []
    monkeypatch.setattr(reader, "pread_scatter", lambda *a: reads.append(a[1]))
    for logits, differ, tied in tpkit.launch(_every_tensor_body, world, backend="threads", args=(path, full, dtype)):
        assert not differ, differ
        assert rel(logits, ref) < 1e-6
        assert tied == hf_tied
    assert not reads, reads
