"""The one seam to PEFT (`tpkit.convert.peft.seam`): the same behaviour whatever was imported first, nothing changed
for models without tpkit layers, and a clear error on a PEFT release it was not tested with."""
from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

import tpkit
from tpkit.convert.peft import seam as peft_seam

peft = pytest.importorskip("peft")

_SCRIPT = textwrap.dedent("""
    import sys, copy, threading, torch
    {first}
    lock = threading.Lock()  # thread-ranks share torch's RNG: PEFT's draws are serialised and seeded
    import transformers
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).double()
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))

    def rank(comm):
        model = tpkit.parallelize(copy.deepcopy(base), comm=comm)
        loaded_before = "peft" in sys.modules
        comm.barrier()  # every rank has looked before any imports it
        import peft
        with lock:
            torch.manual_seed(3)
            wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "o_proj"],
                                                                 init_lora_weights=False))
        kinds = sorted({{type(m).__name__ for m in wrapped.modules() if "Lora" in type(m).__name__}})
        return loaded_before, kinds, wrapped(input_ids=ids).logits

    got = tpkit.run_threads(rank, 2)
    import peft
    torch.manual_seed(3)
    ref = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=2, target_modules=["q_proj", "o_proj"],
                                                                   init_lora_weights=False))
    want = ref(input_ids=ids).logits
    print(got[0][0], got[0][1], max(float((g[2] - want).abs().max()) for g in got))
""")


@pytest.mark.slow
@pytest.mark.parametrize("first", ["import tpkit", "import peft; import tpkit"], ids=["tpkit first", "peft first"])
def test_the_order_of_imports_changes_nothing(first):
    """tpkit converts a model before PEFT is imported (it never imports PEFT itself), then a stock LoraConfig on
    the converted model builds tpkit's LoRA layers and gives one process's logits; the same with PEFT imported
    first."""
    out = subprocess.run([sys.executable, "-c", _SCRIPT.format(first=first)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("False" if first == "import tpkit" else "True"), line
    assert "ColumnParallelLoraLinear" in line and "RowParallelLoraLinear" in line, line
    assert float(line.rsplit(" ", 1)[1]) < 1e-12, line


def _llama():
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_an_untested_peft_release_is_refused_on_a_tpkit_model_only(monkeypatch):
    base = _llama()
    config = dict(r=2, target_modules=["q_proj"])
    monkeypatch.setattr(peft, "__version__", "0.99.0")
    plain = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**config))  # no tpkit layer: PEFT's own
    assert type(plain.base_model.model.model.layers[0].self_attn.q_proj).__name__ == "Linear"

    def body(comm):
        model = tpkit.parallelize(copy.deepcopy(base), comm=comm)
        with pytest.raises(peft_seam.PeftVersionError, match=r"tested with PEFT 0\.21\.x; this process has PEFT "
                                                             r"0\.99\.0.*TPKIT_PEFT_UNTESTED=1"):
            peft.get_peft_model(model, peft.LoraConfig(**config))
        return True

    assert all(tpkit.run_threads(body, 2))
    monkeypatch.setenv("TPKIT_PEFT_UNTESTED", "1")

    def allowed(comm):
        model = tpkit.parallelize(copy.deepcopy(base), comm=comm)
        return type(peft.get_peft_model(model, peft.LoraConfig(**config)).base_model.model.model.layers[0]
                    .self_attn.q_proj).__name__

    assert tpkit.run_threads(allowed, 2) == ["ColumnParallelLoraLinear"] * 2


def test_peft_is_wrapped_once_and_only_where_it_says():
    """The seam's wraps: PEFT's dispatch, save and load, each once however often tpkit installs it."""
    from peft.peft_model import PeftModel, set_peft_model_state_dict
    from peft.tuners.lora.model import LoraModel

    for _ in range(3):
        peft_seam.install()
    wrapped = [LoraModel._create_new_module, PeftModel.save_pretrained, sys.modules["peft.peft_model"]
               .set_peft_model_state_dict]
    assert all(hasattr(f, "tpkit_original") and not hasattr(f.tpkit_original, "tpkit_original") for f in wrapped)
    assert set_peft_model_state_dict is wrapped[2] or hasattr(wrapped[2], "tpkit_original")
