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


def _embedding_llama(hidden: int = 64):
    import transformers

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


_RNG = __import__("threading").Lock()  # thread-ranks share torch's RNG: PEFT's draws serialised and seeded


def _with_adapter(model, targets=("embed_tokens", "lm_head", "q_proj")):
    with _RNG:
        torch.manual_seed(3)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=list(targets), init_lora_weights=False))


@pytest.mark.parametrize("world", [2, 3])
def test_an_adapter_on_the_embeddings_saves_the_file_stock_peft_writes(world, tmp_path):
    """LoRA on embed_tokens and lm_head: PEFT also saves their base weights (`save_embedding_layers="auto"`); the
    file every rank writes together holds exactly the tensors one process of PEFT writes, and loads back."""
    from safetensors.torch import load_file

    base = _embedding_llama()
    stock = _with_adapter(copy.deepcopy(base))
    stock.save_pretrained(str(tmp_path / "stock"))
    want = load_file(str(tmp_path / "stock" / "adapter_model.safetensors"))
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    logits = stock(input_ids=ids).logits

    def body(comm):
        model = _with_adapter(tpkit.parallelize(copy.deepcopy(base), comm=comm))
        model.save_pretrained(str(tmp_path / "tp"))
        again = peft.PeftModel.from_pretrained(tpkit.parallelize(copy.deepcopy(base), comm=comm), str(tmp_path / "tp"))
        return float((again(input_ids=ids).logits - logits).abs().max())

    errors = tpkit.run_threads(body, world)
    got = load_file(str(tmp_path / "tp" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and "base_model.model.lm_head.base_layer.weight" in got
    assert all(torch.equal(got[k], want[k]) for k in want)  # gathered, not computed: bit for bit
    assert max(errors) < 1e-12


def test_an_adapter_made_for_another_model_is_refused_with_full_shapes(tmp_path):
    """A rank's slice of this model's tensor may have the shape of another model's whole one (q_proj's B at 2 ranks
    of a 128-wide model is [64, 4], a 64-wide model's full B): refused before anything loads, with full shapes."""
    small = _with_adapter(_embedding_llama(64), targets=("q_proj",))
    small.save_pretrained(str(tmp_path / "small"))
    big = _embedding_llama(128)

    def body(comm):
        model = tpkit.parallelize(copy.deepcopy(big), comm=comm)
        with pytest.raises(ValueError, match=r"q_proj.lora_B.default.weight: the file holds \[64, 4\], this model "
                                             r"\[128, 4\]"):
            peft.PeftModel.from_pretrained(model, str(tmp_path / "small"))
        return True

    assert all(tpkit.run_threads(body, 2))
