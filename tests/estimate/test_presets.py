"""Model presets and TARGET resolution: preset names, config.json files, model directories, module:factory."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from tpkit.estimate import parameter_counts, transformer_shape
from tpkit.estimate.presets import PRESETS, PUBLISHED_PARAMETERS, build_model, load_target, preset_config

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_on_meta_with_the_counted_parameters(name):
    model, config = load_target(name)
    numel = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    assert numel == sum(parameter_counts(transformer_shape(config)).values())
    if name in PUBLISHED_PARAMETERS:
        assert numel == PUBLISHED_PARAMETERS[name]


def test_published_shapes():
    c = preset_config("llama-3-70b")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (8192, 80, 64, 8, 28672, 128256)
    c = preset_config("GPT2-XL")  # names are case-insensitive
    assert (c.n_embd, c.n_layer, c.n_head) == (1600, 48, 25)


def test_config_file_and_directory(tmp_path):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=100)
    cfg.save_pretrained(tmp_path)
    for target in (str(tmp_path), str(tmp_path / "config.json")):
        model, config = load_target(target)
        assert config.num_key_value_heads == 2 and type(model).__name__ == "LlamaForCausalLM"
    model, config = load_target(str(tmp_path), build=False)
    assert model is None and config.hidden_size == 64


def test_module_factory(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(textwrap.dedent("""
        import torch
        def mlp():
            return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        def config():
            from transformers import GPT2Config
            return GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=50, n_positions=16)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_models", raising=False)
    model, config = load_target("my_models:mlp")
    assert isinstance(model, torch.nn.Sequential) and config is None
    model, config = load_target("my_models:config")
    assert config.n_embd == 32 and type(model).__name__ == "GPT2LMHeadModel"


def test_module_factory_in_the_working_directory(tmp_path, monkeypatch):
    """The `tpkit` console script does not put the working directory on sys.path; `here_models:mlp` run from
    the directory holding here_models.py must still import."""
    (tmp_path / "here_models.py").write_text("import torch\ndef mlp():\n    return torch.nn.Linear(4, 6)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "here_models", raising=False)
    model, config = load_target("here_models:mlp")
    assert isinstance(model, torch.nn.Linear) and model.out_features == 6 and config is None


def test_build_model_on_cpu_in_a_dtype():
    from transformers import BertConfig

    cfg = BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1,
                     vocab_size=50, max_position_embeddings=16)
    model = build_model(cfg, device="cpu", dtype=torch.bfloat16)
    assert type(model).__name__ == "BertForMaskedLM"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


def test_builds_on_several_threads_each_get_their_dtype_and_leave_the_default_alone():
    """torch's default dtype is process-wide and a build sets it (transformers does too): thread-ranks building at
    once used to restore each other's value, giving parameters of the other build's dtype and leaving the
    default switched after both had finished."""
    import threading

    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    wrong = []

    def builds(dtype):
        for _ in range(10):
            got = {p.dtype for p in build_model(cfg, device="meta", dtype=dtype).parameters()}
            if got != {dtype}:
                wrong.append((dtype, got))

    threads = [threading.Thread(target=builds, args=(dtype,)) for dtype in (torch.float64, torch.bfloat16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not wrong and torch.get_default_dtype() == torch.float32, (wrong[:3], torch.get_default_dtype())
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("target,match", [
    ("llama-9-9b", "not a preset"), ("no_such_module_xyz:f", "cannot import"), ("os:no_such_attr", "cannot import"),
])
def test_bad_targets(target, match):
    with pytest.raises(ValueError, match=match):
        load_target(target)


def test_bad_config_files(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"hidden_size": 3}))
    with pytest.raises(ValueError, match="model_type"):
        load_target(str(tmp_path / "c.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_target(str(tmp_path / "empty"))
