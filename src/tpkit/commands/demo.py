"""`tpkit demo`: a short communication demo on local gloo ranks (the TP demo replaces it later)."""
from __future__ import annotations

import argparse
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="number of local ranks (default 2)")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "threads"])


def _demo_body():
    import torch

    import tpkit
    from tpkit.comm import ReduceOp

    comm = tpkit.get_communicator()
    x = torch.full((4,), float(comm.rank + 1))
    lines = [f"rank {comm.rank}: input {x.tolist()}"]
    for op in ReduceOp:
        lines.append(f"rank {comm.rank}: all_reduce {op.name:<7} -> {comm.all_reduce(x, op=op).tolist()}")
    lines.append(f"rank {comm.rank}: all_gather       -> {comm.all_gather(x[:2]).tolist()}")
    lines.append(f"rank {comm.rank}: reduce_scatter   -> {comm.reduce_scatter(x).tolist()}")
    lines.append(f"rank {comm.rank}: broadcast(src=0) -> {comm.broadcast(x).tolist()}")
    big = torch.randn(1 << 18)
    comm.barrier()
    start = time.perf_counter()
    for _ in range(5):
        comm.all_reduce(big)
    per_op = (time.perf_counter() - start) / 5
    lines.append(f"rank {comm.rank}: all_reduce of 1 MiB takes {per_op * 1e3:.2f} ms "
                 f"({big.numel() * 4 / per_op / 1e9:.2f} GB/s algbw)")
    return lines


def run(args: argparse.Namespace) -> int:
    import tpkit

    print(f"tpkit {tpkit.__version__}: communication demo on {args.world_size} {args.backend} ranks")
    for rank_lines in tpkit.launch(_demo_body, args.world_size, backend=args.backend, timeout=60):
        print("\n".join(rank_lines))
    return 0
