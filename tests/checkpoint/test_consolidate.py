"""consolidate: a non-empty output is refused unless overwrite=True, which replaces it as a whole (never new weights
beside an old index and shards); config.json and generation_config.json come out as transformers wrote them; the
CLI reports errors in one line."""
from __future__ import annotations

import os

import pytest
import torch

import tpkit
from tests.checkpoint.fixtures import hf_logits, rel
from tests.models.hf import hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An HF directory with a non-default generation config, loaded by tpkit on 2 thread-ranks and saved."""
    root = tmp_path_factory.mktemp("consolidate")
    model = hf_model("llama", num_key_value_heads=2)
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.7
    hf = str(root / "hf")
    model.save_pretrained(hf)
    ckpt = str(root / "ckpt")
    tpkit.launch(lambda: tpkit.save_sharded(tpkit.from_pretrained(hf), ckpt, step=3), 2, backend="threads")
    return hf, ckpt


def _old_sharded_model(path: str) -> None:
    """Another model (other weights) saved as index + shards: what a non-empty output directory may hold."""
    hf_model("llama", num_key_value_heads=2, initializer_range=0.5).save_pretrained(path, max_shard_size="50KB")


def test_config_and_generation_config_are_kept_as_saved(saved, tmp_path):
    hf, ckpt = saved
    out = tpkit.consolidate(ckpt, tmp_path / "out")
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(hf, name)) as a, open(os.path.join(out, name)) as b:
            assert a.read() == b.read(), name


def test_a_non_empty_out_dir_is_refused_and_left_alone(saved, tmp_path):
    _, ckpt = saved
    out = tmp_path / "out"
    _old_sharded_model(str(out))
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    with pytest.raises(tpkit.CheckpointError, match=r"out: not empty \(9 entries: config.json.*overwrite=True"):
        tpkit.consolidate(ckpt, out)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_overwrite_replaces_the_directory_as_a_whole(saved, tmp_path):
    """No stale index or shards stay beside the new model.safetensors: transformers and tpkit read the same
    (new) weights."""
    hf, ckpt = saved
    out = tmp_path / "out"
    _old_sharded_model(str(out))
    tpkit.consolidate(ckpt, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary sibling left
    ref = hf_logits(hf)
    assert rel(hf_logits(str(out)), ref) < 1e-6
    with torch.no_grad():
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        ours = tpkit.from_pretrained(str(out))(input_ids=ids).logits
        import transformers

        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf)(input_ids=ids).logits
    assert rel(ours, theirs) < 1e-6


def test_a_failed_overwrite_leaves_the_old_directory(saved, tmp_path, monkeypatch):
    import importlib

    module = importlib.import_module("tpkit.checkpoint.consolidate")  # the package exports the function by this name

    _, ckpt = saved
    out = tmp_path / "out"
    _old_sharded_model(str(out))
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "write_stream", full_disk)
    with pytest.raises(OSError, match="No space"):
        tpkit.consolidate(ckpt, out, overwrite=True)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_the_checkpoint_itself_is_never_the_output(saved):
    _, ckpt = saved
    with pytest.raises(tpkit.CheckpointError, match="holds the checkpoint"):
        tpkit.consolidate(ckpt, ckpt, overwrite=True)


def test_cli_error_is_one_line(saved, tmp_path, capsys):
    from tpkit.cli import main

    _, ckpt = saved
    out = tmp_path / "out"
    _old_sharded_model(str(out))
    capsys.readouterr()
    assert main(["consolidate", ckpt, str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tpkit consolidate: ") and "--overwrite" in err, err
    assert main(["consolidate", ckpt, str(out), "--overwrite"]) == 0
    assert main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "o2")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
