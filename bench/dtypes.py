"""Checkpoints at any `dtype=` (issue 47 item 1): tpkit's logits against transformers' load of the same directory
in the same dtype, at 2 and 3 thread-ranks.

    python bench/dtypes.py            # a markdown table: checkpoint x dtype x world size -> max rel error

Plain checkpoints written by `save_pretrained` (a tied Llama in bf16, a tied Qwen2 with q/k/v biases in fp16, a tied
Llama in float32) at their default dtype and two others; every quantized format tests/quant make
(`tests/quant/checkpoints.py`) of a bf16 model (bf16 scales) and of a float32 one at the default, float32 and
bfloat16. The error is the worst rank's max abs difference over the reference's max abs logit. For a half-precision
load the last column is the reference's own error against its float64 load of the same directory: the scale of
rounding a TP run in that dtype is to be judged against.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HALF = (torch.bfloat16, torch.float16)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def reference(path: str, dtype, quantized: bool):
    import transformers as tr

    kw = {} if dtype is None else {"dtype": dtype}
    if quantized:
        with open(os.path.join(path, "config.json")) as f:
            method = json.load(f)["quantization_config"]["quant_method"]
        kw["quantization_config"] = tr.FineGrainedFP8Config(dequantize=True) if method == "fp8" else \
            tr.CompressedTensorsConfig(dequantize=True)
    return tr.AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def row(label: str, directory: str, ref_dir: str, dtype, ids: torch.Tensor, quantized: bool) -> str:
    import tpkit
    from tpkit.comm import run_threads

    ref = reference(ref_dir, dtype, quantized)
    with torch.no_grad():
        want = ref(ids).logits
        own = rel(want, reference(ref_dir, torch.float64, quantized)(ids).logits) if ref.dtype in HALF else None
    errs = []
    for world in (2, 3):
        def body(comm):
            model = tpkit.from_pretrained(directory, comm=comm, dtype=dtype, progress=False)
            with torch.no_grad():
                return rel(model(ids).logits, want)

        errs.append(max(run_threads(body, world)))
    asked = "default" if dtype is None else str(dtype).removeprefix("torch.")
    return (f"| {label} | {asked} ({str(ref.dtype).removeprefix('torch.')}) | {errs[0]:.1e} | {errs[1]:.1e} | "
            f"{'-' if own is None else f'{own:.1e}'} |")


def main() -> None:
    import transformers as tr

    from tests.models.hf import hf_model, inputs
    from tests.quant import checkpoints as C

    warnings.filterwarnings("ignore")
    tr.logging.set_verbosity_error()
    print("| checkpoint | dtype (loaded as) | TP2 | TP3 | the reference's own error vs its float64 load |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        plain = [("Llama bf16", "llama", torch.bfloat16, (None, torch.float32, torch.float16)),
                 ("Qwen2 fp16", "qwen2", torch.float16, (None, torch.float32, torch.bfloat16)),
                 ("Llama float32", "llama", torch.float32, (None, torch.float64, torch.bfloat16))]
        for label, family, stored, dtypes in plain:
            path = os.path.join(root, label.replace(" ", "-"))
            hf_model(family, tie_word_embeddings=True, num_key_value_heads=2, initializer_range=0.1).to(
                stored).save_pretrained(path)
            for dtype in dtypes:
                print(row(f"plain {label}", path, path, dtype, inputs(), False), flush=True)
        for base in HALF[:1] + (torch.float32,):
            bases = {"llama": C.llama().to(base), "qwen2": C.qwen2().to(base), "phi3": C.phi3().to(base)}
            made: dict = {}

            def directory(name: str, base=base, bases=bases, made=made) -> str:
                if name not in made:
                    model, maker = C.FORMATS[name]
                    made[name] = maker(os.path.join(root, str(base), name), bases[model], directory)
                return made[name][0]

            for name in sorted(C.FORMATS):
                d = directory(name)
                label = f"{name} of a {str(base).removeprefix('torch.')} {C.FORMATS[name][0]}"
                for dtype in (None, torch.float32, torch.bfloat16):
                    print(row(label, d, made[name][1] or d, dtype, C.IDS, True), flush=True)


if __name__ == "__main__":
    main()
