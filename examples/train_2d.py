"""Train a small Llama with tensor parallelism inside a node and data parallelism across, on torch's FSDP2 or DDP.

One machine, 4 ranks as tp2 x dp2 (CPU/gloo here; nccl with one GPU per rank when CUDA is there):

    torchrun --nproc-per-node 4 examples/train_2d.py --tp 2 --mode fsdp --steps 20

Training that survives a dead rank: a checkpoint every N steps, and torchrun restarts the job from the last one:

    torchrun --standalone --nproc-per-node 4 --max-restarts 3 examples/train_2d.py --steps 200 \\
             --save run/ckpt --every 10 --keep 2 --resume

Several machines, the same script: TP inside each node, data parallelism across nodes (run on each node):

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr node0 --master-port 29500 \\
             examples/train_2d.py --tp 8 --mode fsdp

Every rank builds the same model from the same seed, converts it on its tp group, hands it to FSDP2 / DDP over
its dp group, and trains on its share of each global batch (random tokens: this shows the mechanics, not a
recipe). The batch of step s is drawn from a generator seeded by s alone, so a resumed run sees the batches the
uninterrupted one would have. `--save DIR` writes a 2-D checkpoint (every `--every` steps with `--resume`'s
Checkpointer, and after the last step) that loads at any other layout (tp4, tp2 alone, ...); `--resume`
continues from the newest complete one. `--recompute`, `--accumulate` and `--autocast` are the training tools.
`TPKIT_FAULTS` (see tpkit/faults.py) kills a rank at a chosen step for the tests of all this. Each rank runs one
intra-op CPU thread when several share the host (`tpkit.launch.set_threads`; `TPKIT_THREADS=N` or
`OMP_NUM_THREADS=N` to change it).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import transformers as tr

import tpkit
from tpkit import faults
from tpkit.launch import set_threads


def build(vocab: int, dropout: float = 0.0) -> torch.nn.Module:
    config = tr.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=256, use_cache=False,
                            attention_dropout=dropout)
    torch.manual_seed(0)  # the same full model on every rank; each keeps its shards
    return tr.LlamaForCausalLM(config)


def batch(step: int, args) -> torch.Tensor:
    """The global batch of `step`: a function of the step alone (the same on every rank, and after a restart)."""
    g = torch.Generator().manual_seed(args.data_seed * 1_000_003 + step)
    return torch.randint(0, args.vocab, (args.global_batch, args.seq), generator=g)


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
    parser.add_argument("--dropout", type=float, default=0.0, help="attention dropout")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="checkpoint directory (written after the last step, and "
                                                     "every --every steps)")
    parser.add_argument("--every", type=int, default=0, help="save every N steps (0: only after the last)")
    parser.add_argument("--keep", type=int, default=2, help="complete versions kept under --save (0: all)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete version in --save")
    parser.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                        help="recompute activations in the backward: the attention core, or whole blocks")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (per dp rank)")
    parser.add_argument("--autocast", action="store_true", help="run forward and loss under bf16 torch.autocast")
    parser.add_argument("--timeout", type=float, default=None, help="seconds a collective waits for a peer")
    parser.add_argument("--check-replicas", type=int, default=50, metavar="N",
                        help="check every N steps that tensors several ranks hold are identical (0: off; every step "
                             "under TP_DEBUG=1)")
    parser.add_argument("--history", default=None, help="rank 0 appends {step, loss, grad_norm, generation} JSON lines")
    args = parser.parse_args()
    if args.resume and not args.save:
        raise SystemExit("--resume needs --save DIR (where the checkpoints are)")

    set_threads()
    comm = tpkit.init(timeout=args.timeout)
    tp, dp = tpkit.comm.split(comm, args.tp)
    if args.global_batch % (dp.world_size * args.accumulate):
        raise SystemExit(f"--global-batch {args.global_batch} must divide by the dp size {dp.world_size} x "
                         f"--accumulate {args.accumulate}")
    model = tpkit.parallelize(build(args.vocab, args.dropout), comm=tp, mode="training")
    tpkit.recompute(model, args.recompute)
    at = {"step": 0}
    if os.environ.get(faults.VARIABLE):  # a rank may be told to die inside the forward, its peers in a collective
        middle = model.model.layers[len(model.model.layers) // 2]
        middle.register_forward_pre_hook(lambda m, a: faults.at("forward", comm.rank, at["step"]))
    model = tpkit.data_parallel(model, dp, mode=args.mode)
    tpkit.data_parallel_manual_seed(1234, tp, dp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ckpt = tpkit.Checkpointer(args.save, every=args.every or max(args.steps, 1), keep=args.keep or None, comm=comm,
                              check_replicas_every=None) if args.save else None
    if args.check_replicas:  # a silent divergence of replicas raises ReplicaError from opt.step()
        tpkit.watch_replicas(model, opt, every=args.check_replicas)
    start = ckpt.resume(model, opt) if args.resume else 0
    generation = tpkit.distributed.restart_count()
    if comm.rank == 0:
        print(f"world {comm.world_size} = tp{tp.world_size} x dp{dp.world_size}, {args.mode}; generation "
              f"{generation}, starting at step {start}", flush=True)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    for step in range(start, args.steps):
        at["step"] = step
        faults.at("step", comm.rank, step)
        mine = batch(step, args).chunk(dp.world_size)[dp.rank]
        begin = time.perf_counter()
        total = torch.zeros(())
        for i, micro in enumerate(mine.chunk(args.accumulate)):
            with tpkit.no_sync(model, enabled=i < args.accumulate - 1), \
                    (torch.autocast(device_type, dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()):
                loss = model(input_ids=micro, labels=micro).loss / args.accumulate
                loss.backward()
            total += loss.detach().float().cpu()
        norm = tpkit.clip_grad_norm_(model.parameters(), args.max_norm)  # the norm over both dimensions
        opt.step()
        opt.zero_grad()
        total = dp.all_reduce(total) / dp.world_size
        if comm.rank == 0:
            print(f"step {step}: loss {total.item():.4f}  grad norm {norm.item():.4f}  "
                  f"{(time.perf_counter() - begin) * 1e3:.0f} ms", flush=True)
            if args.history:
                with open(args.history, "a") as f:
                    f.write(json.dumps({"step": step + 1, "loss": total.item(), "grad_norm": norm.item(),
                                        "generation": generation}) + "\n")
        if ckpt is not None:
            ckpt.maybe_save(step + 1, model, opt)
    if ckpt is not None and start < args.steps and args.steps % ckpt.every:  # the last step, unless just saved
        ckpt.save(args.steps, model, opt)
    if ckpt is not None and comm.rank == 0:
        print(f"saved {args.save}", flush=True)
    tpkit.shutdown()


if __name__ == "__main__":
    main()
