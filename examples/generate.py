"""Greedy generation from a Hugging Face causal LM split over N ranks with tensor parallelism.

    torchrun --nproc-per-node 2 examples/generate.py --model ./my-llama --prompt "Once upon a time" --max-new-tokens 32
    torchrun --nproc-per-node 2 examples/generate.py --model ./my-llama --prompt-ids "1 450 4996" --max-new-tokens 32

Each rank reads only its slices of the checkpoint (`tpkit.from_pretrained`) and the converted model runs
transformers' own `generate()`; rank 0 prints the prompt's and the new token ids, and the text when the model
directory has a tokenizer (`--prompt` needs one). A model fine-tuned with examples/finetune.py and written with
its `--consolidate OUT` is such a directory. `--tp N` (default: the world size) with world > N makes world / N
groups that each generate the same tokens (a server would give each group its own requests).

tpkit's contract: `generate()` on a converted model gives the tokens of the unconverted model. The logits of
a split model differ from one process's by rounding (its sums run in another order): far below the gaps between
logits in float32, where the tokens agree (tests/test_examples.py checks them), but in bf16 / fp16 (`--dtype
auto` on a bf16 checkpoint) greedy decoding can pick another token where the two best logits tie to within that
rounding, and the continuations differ from there on.
Each rank runs one intra-op CPU thread when several share the host (`tpkit.launch.set_threads`;
`TPKIT_THREADS=N` or `OMP_NUM_THREADS=N` to change it).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import transformers as tr

import tpkit
from tpkit.launch import set_threads


def tokenizer_in(directory: str):
    """The directory's tokenizer, or None when it has none."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any(os.path.exists(os.path.join(directory, n)) for n in names):
        return None
    return tr.AutoTokenizer.from_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world size)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, tokenized with --model's tokenizer")
    prompt.add_argument("--prompt-ids", help='token ids, e.g. "1 450 4996"')
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto", help="weights' dtype ('auto': the checkpoint's)")
    args = parser.parse_args()

    set_threads()
    comm = tpkit.init()
    tp, _ = tpkit.comm.split(comm, args.tp or comm.world_size)
    tokenizer = tokenizer_in(args.model)
    if args.prompt is not None and tokenizer is None:
        raise SystemExit(f"--prompt: {args.model} has no tokenizer; give token ids with --prompt-ids")
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids if args.prompt is not None else \
        torch.tensor([[int(t) for t in args.prompt_ids.split()]])
    model = tpkit.from_pretrained(args.model, comm=tp, dtype=args.dtype)  # in eval mode
    ids = ids.to(next(model.parameters()).device)
    generation = model.generation_config
    pad = generation.pad_token_id if generation.pad_token_id is not None else generation.eos_token_id
    begin = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             do_sample=False, pad_token_id=pad)
    seconds = time.perf_counter() - begin
    new = out[0, ids.shape[1]:].tolist()
    if comm.rank == 0:
        print(f"{args.model}: world {comm.world_size}, tp{tp.world_size}, {torch.get_num_threads()} thread(s) per rank",
              flush=True)
        print("prompt ids: " + " ".join(map(str, ids[0].tolist())))
        print("new ids: " + " ".join(map(str, new)))
        if tokenizer is not None:
            print("text: " + tokenizer.decode(out[0], skip_special_tokens=True))
        print(f"{len(new)} tokens in {seconds:.2f} s ({len(new) / seconds:.1f} tokens/s)", flush=True)
    tpkit.shutdown()


if __name__ == "__main__":
    main()
