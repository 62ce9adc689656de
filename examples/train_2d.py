"""Train a small Llama with tensor parallelism inside a node and data parallelism across, on torch's FSDP2 or DDP.

One machine, 4 ranks as tp2 x dp2 (CPU/gloo here; nccl with one GPU per rank when CUDA is there):

    torchrun --nproc-per-node 4 examples/train_2d.py --tp 2 --mode fsdp --steps 20

Several machines, the same script: TP inside each node, data parallelism across nodes (run on each node):

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr node0 --master-port 29500 \
             examples/train_2d.py --tp 8 --mode fsdp

Every rank builds the same model from the same seed, converts it on its tp group, hands it to FSDP2 / DDP over
its dp group, and trains on its share of each global batch (random tokens: this shows the mechanics, not a
recipe). `--save DIR` writes a 2-D checkpoint that loads at any other layout (tp4, tp2 alone, ...).
"""
from __future__ import annotations

import argparse
import time

import torch
import transformers as tr

import tpkit


def build(vocab: int) -> torch.nn.Module:
    config = tr.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=256)
    torch.manual_seed(0)  # the same full model on every rank; each keeps its shards
    return tr.LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (ranks per tp group)")
    parser.add_argument("--mode", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step over all dp ranks")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--save", default=None, help="checkpoint directory written after the last step")
    args = parser.parse_args()

    comm = tpkit.init()
    tp, dp = tpkit.comm.split(comm, args.tp)
    if args.global_batch % dp.world_size:
        raise SystemExit(f"--global-batch {args.global_batch} must divide by the dp size {dp.world_size}")
    model = tpkit.parallelize(build(args.vocab), comm=tp, mode="training")
    model = tpkit.data_parallel(model, dp, mode=args.mode)
    tpkit.data_parallel_manual_seed(1234, tp, dp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(0)  # the same global batches on every rank; each dp rank takes its share
    if comm.rank == 0:
        print(f"world {comm.world_size} = tp{tp.world_size} x dp{dp.world_size}, {args.mode}")
    for step in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.global_batch, args.seq), generator=data)
        mine = ids.chunk(dp.world_size)[dp.rank]
        start = time.perf_counter()
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        norm = tpkit.clip_grad_norm_(model.parameters(), args.max_norm)  # the norm over both dimensions
        opt.step()
        opt.zero_grad()
        loss = dp.all_reduce(loss.detach()) / dp.world_size
        if comm.rank == 0:
            print(f"step {step}: loss {loss.item():.4f}  grad norm {norm.item():.4f}  "
                  f"{(time.perf_counter() - start) * 1e3:.0f} ms")
    if args.save:
        tpkit.save_sharded(model, args.save, optimizer=opt, step=args.steps, comm=comm)
        if comm.rank == 0:
            print(f"saved {args.save}")
    tpkit.shutdown()


if __name__ == "__main__":
    main()
