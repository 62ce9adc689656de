"""LoRA fine-tune of a Hugging Face causal LM at tensor parallelism N, saved as a stock PEFT adapter.

2 ranks, r=8 on the attention and MLP projections, the adapter written where PEFT on one process writes it:

    torchrun --nproc-per-node 2 examples/lora.py --model ./my-llama --data train.txt --steps 100 --out run/adapter

The adapter loads with `peft.PeftModel.from_pretrained(model, "run/adapter")` on one process, or onto a TP model
(each rank keeps its slices). Each rank reads only its slices of the checkpoint (`tpkit.from_pretrained(...,
mode="training")`: the LM head keeps its logits split over the vocabulary and the loss is computed on them);
`peft.get_peft_model` then adds the adapter, split with its base layers (tpkit/nn/lora.py); only the adapter
trains. `--data FILE` is whitespace-separated integer token ids (or text through the directory's tokenizer, as
examples/finetune.py reads it); without it, random tokens (the mechanics, not a recipe). The batch of step s is
drawn from a generator seeded by s alone, the same on every rank.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import peft
import torch

import tpkit
from tpkit.launch import set_threads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune import batch, load_tokens, tokenizer_in  # noqa: E402 - the same data rules as finetune.py

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="where the adapter is written (adapter_config.json + "
                                                     "adapter_model.safetensors)")
    parser.add_argument("--data", default=None, help="training token ids or text (default: random tokens)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--r", type=int, default=8, help="LoRA rank")
    parser.add_argument("--alpha", type=float, default=16, help="LoRA alpha (scaling = alpha / r)")
    parser.add_argument("--targets", default=TARGETS, help="comma-separated module names the adapter wraps")
    parser.add_argument("--dtype", default="float32", help="weights' dtype ('auto': the checkpoint's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batches and of the adapter's init")
    args = parser.parse_args()

    set_threads()
    comm = tpkit.init()
    model = tpkit.from_pretrained(args.model, comm=comm, mode="training", dtype=args.dtype).train()
    torch.manual_seed(args.seed)  # every rank draws the adapter one process would draw, then keeps its slice
    config = peft.LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=0.0,
                             target_modules=args.targets.split(","))
    model = peft.get_peft_model(model, config)
    vocab, device = model.config.vocab_size, next(model.parameters()).device
    tokenizer = tokenizer_in(args.model)
    tokens = load_tokens(args.data, tokenizer, vocab) if args.data else None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    if comm.rank == 0:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"{args.model}: tp{comm.world_size}, LoRA r={args.r} on {args.targets} "
              f"({trainable} adapter parameters on rank 0)", flush=True)
    for step in range(args.steps):
        begin = time.perf_counter()
        ids = batch(step, tokens, vocab, args).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if comm.rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}  {(time.perf_counter() - begin) * 1e3:.0f} ms", flush=True)
    model.save_pretrained(args.out)  # every rank: the slices are gathered, rank 0 writes
    if comm.rank == 0:
        print(f"wrote {args.out} (a PEFT adapter)", flush=True)
    tpkit.shutdown()


if __name__ == "__main__":
    main()
