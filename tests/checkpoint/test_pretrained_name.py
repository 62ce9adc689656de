"""`from_pretrained` records where it loaded from as transformers' `from_pretrained` does (issue 49 item 5): the
model's `name_or_path` and its config's `_name_or_path` are the path as given, so PEFT's `save_pretrained` writes
it as the adapter's `base_model_name_or_path` (it was `null`). Against transformers' own load and stock PEFT, on
gloo processes at 2 ranks and thread-ranks at 3."""
from __future__ import annotations

import json
import pathlib

import pytest

import tpkit
from tests.checkpoint.fixtures import write_hf

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return write_hf(str(tmp_path_factory.mktemp("hf")), "llama")


def _names(path) -> tuple[str, str]:
    model = tpkit.from_pretrained(path)
    return model.name_or_path, model.config._name_or_path


@pytest.mark.parametrize("backend, world", [("gloo", 2), ("threads", 3)])
def test_name_or_path_is_what_transformers_records(llama_dir, backend, world):
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    want = (reference.name_or_path, reference.config._name_or_path)
    assert want == (llama_dir, llama_dir)  # transformers: the path as given
    assert tpkit.launch(_names, world, backend=backend, args=(llama_dir,), timeout=120) == [want] * world
    as_path = pathlib.Path(llama_dir)  # a PathLike, as transformers takes it: recorded as its str
    from_path = transformers.AutoModelForCausalLM.from_pretrained(as_path)
    assert tpkit.launch(_names, 2, backend="threads", args=(as_path,)) == [
        (from_path.name_or_path, from_path.config._name_or_path)] * 2


def test_a_saved_adapter_names_its_base_model_as_stock_peft_writes_it(llama_dir, tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    stock = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(llama_dir), config)
    stock.save_pretrained(str(tmp_path / "stock"))

    def rank():
        model = peft.get_peft_model(tpkit.from_pretrained(llama_dir), config)
        model.save_pretrained(str(tmp_path / "tp"))

    tpkit.launch(rank, 3, backend="threads")
    written = json.loads((tmp_path / "tp" / "adapter_config.json").read_text())
    expected = json.loads((tmp_path / "stock" / "adapter_config.json").read_text())
    assert expected["base_model_name_or_path"] == llama_dir
    assert written == expected
