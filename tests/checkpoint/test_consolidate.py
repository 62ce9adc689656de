"""consolidate: a non-empty output is refused unless overwrite=True, which replaces it as a whole (never new weights
beside an old index and shards); config.json and generation_config.json come out as transformers wrote them; the
tokenizer files of the model directory the checkpoint records come beside the weights, byte for byte (read alike by
transformers' AutoTokenizer), or another directory's, or none; the CLI reports errors in one line."""
from __future__ import annotations

import os
import pathlib

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


def _write_tokenizer(directory: str) -> None:
    """A byte-level BPE tokenizer with a chat template, as transformers saves it (tokenizer.json,
    tokenizer_config.json, chat_template.jinja)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:40])
    bpe.train_from_iterator(["tensor parallelism is exact, fast and boring"] * 8, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    fast.save_pretrained(directory)


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """An HF directory with a tokenizer; a checkpoint of it saved by 2 thread-ranks, and a checkpoint of a model
    loaded from that checkpoint (the recorded source is followed back to the directory)."""
    root = tmp_path_factory.mktemp("tokenizer")
    hf = str(root / "hf")
    hf_model("llama", num_key_value_heads=2).save_pretrained(hf)
    _write_tokenizer(hf)
    ckpt, again = str(root / "ckpt"), str(root / "again")
    tpkit.launch(lambda: tpkit.save_sharded(tpkit.from_pretrained(hf), ckpt, step=1), 2, backend="threads")
    tpkit.launch(lambda: tpkit.save_sharded(tpkit.from_pretrained(ckpt), again, step=2), 2, backend="threads")
    return hf, ckpt, again


def _same_tokenizer(out: str, hf: str) -> None:
    """`out` holds `hf`'s tokenizer files byte for byte, and transformers' AutoTokenizer reads them alike."""
    import transformers

    from tpkit.checkpoint.tokenizer import tokenizer_files

    names = tokenizer_files(hf)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(names)
    assert tokenizer_files(out) == names
    assert all(pathlib.Path(out, n).read_bytes() == pathlib.Path(hf, n).read_bytes() for n in names)
    ours, theirs = transformers.AutoTokenizer.from_pretrained(out), transformers.AutoTokenizer.from_pretrained(hf)
    text = "parallelism is boring"
    assert ours(text).input_ids == theirs(text).input_ids and len(theirs(text).input_ids) > 2
    chat = [{"role": "user", "content": "fast"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)


def test_cli_copies_the_tokenizer_of_the_directory_the_model_was_loaded_from(with_tokenizer, tmp_path, capsys):
    """`tpkit consolidate` writes the tokenizer files beside the weights, as `examples/finetune.py --consolidate`
    does (issue 49 item 6): by default those of the model directory the checkpoint records, also through a
    checkpoint loaded from a checkpoint; `--tokenizer DIR` names one; `--no-tokenizer` copies none."""
    from tpkit.cli import main

    hf, ckpt, again = with_tokenizer
    for i, source in enumerate((ckpt, again)):
        out = str(tmp_path / f"out{i}")
        assert main(["consolidate", source, out]) == 0
        said = capsys.readouterr().out
        assert f"tokenizer files: tokenizer.json, tokenizer_config.json, chat_template.jinja (from {hf}" in said, said
        _same_tokenizer(out, hf)
        assert rel(hf_logits(out), hf_logits(hf)) < 1e-6
    assert main(["consolidate", ckpt, str(tmp_path / "bare"), "--no-tokenizer"]) == 0
    assert sorted(os.listdir(tmp_path / "bare")) == ["config.json", "generation_config.json", "model.safetensors"]
    assert main(["consolidate", ckpt, str(tmp_path / "named"), "--tokenizer", hf]) == 0
    _same_tokenizer(str(tmp_path / "named"), hf)


def test_a_directory_without_a_tokenizer_is_refused_before_anything_is_written(with_tokenizer, saved, tmp_path,
                                                                               capsys):
    from tpkit.cli import main

    _, ckpt, _ = with_tokenizer
    capsys.readouterr()
    assert main(["consolidate", ckpt, str(tmp_path / "out"), "--tokenizer", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path}: no tokenizer files" in err and "--no-tokenizer" in err, err
    assert os.listdir(tmp_path) == []
    with pytest.raises(tpkit.CheckpointError, match="no tokenizer files"):
        tpkit.consolidate(ckpt, tmp_path / "out", tokenizer=tmp_path)
    assert os.listdir(tmp_path) == []
    # a checkpoint whose model directory has no tokenizer: the weights, and a line saying why there is no tokenizer
    hf, plain = saved
    assert main(["consolidate", plain, str(tmp_path / "plain")]) == 0
    assert f"no tokenizer files copied: no tokenizer files in {hf}, the model directory the checkpoint records" in \
        capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "plain")) == ["config.json", "generation_config.json", "model.safetensors"]
    # a model built in code records no directory
    import copy

    built = hf_model("llama", num_key_value_heads=2)
    tpkit.launch(lambda: tpkit.save_sharded(tpkit.parallelize(copy.deepcopy(built)), str(tmp_path / "c")), 2,
                 backend="threads")
    assert main(["consolidate", str(tmp_path / "c"), str(tmp_path / "code")]) == 0
    assert "no tokenizer files copied: the checkpoint records no model directory" in capsys.readouterr().out


def test_python_consolidate_copies_the_recorded_tokenizer_too(with_tokenizer, tmp_path):
    hf, ckpt, _ = with_tokenizer
    _same_tokenizer(tpkit.consolidate(ckpt, tmp_path / "out"), hf)
    assert sorted(os.listdir(tpkit.consolidate(ckpt, tmp_path / "none", tokenizer=None))) == [
        "config.json", "generation_config.json", "model.safetensors"]
