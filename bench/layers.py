"""Benchmark of tpkit.nn layers (issue 3). Prints a markdown table for BENCHMARKS.md.

(a) world size 1, CPU: ColumnParallelLinear / RowParallelLinear forward+backward against nn.Linear
    (1024 -> 4096, 64 tokens). At world size 1 tpkit layers are a plain F.linear; target ratio <= 1.03.
(b) world size 2, gloo processes: Column -> GELU -> Row MLP forward+backward against PyTorch's own
    parallelize_module with ColwiseParallel / RowwiseParallel (DTensor) on the same weights and inputs.
    Targets: ratio <= 0.75 at hidden 256 / 8 tokens, <= 1.0 at hidden 2048 / 32 tokens.
(c) CUDA, bf16, NCCL group of one (tpkit.init on a one-GPU machine): Column/Row against nn.Linear, TFLOP/s of
    both; target ratio >= 0.97. Skipped (and said so) when CUDA is not available.

Every comparison alternates ours and the peer run by run and reports medians: the ratio of the median times and
the median of the ratios of adjacent (tpkit, peer) runs, the headline figure because it cancels slow drifts in the
load of a shared machine. Lower is better for times; (c) reports throughput, higher is better.

    python bench/layers.py                 # all parts
    python bench/layers.py --part b --repeats 300
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from torch import nn

import tpkit
from tpkit.nn import ColumnParallelLinear, RowParallelLinear

MLP_SIZES = [(256, 8), (512, 16), (1024, 16), (2048, 32)]  # (hidden, tokens); FFN = 4 * hidden


def alternate(ours, peer, repeats: int, inner: int = 1, sync=lambda: None,
              clock=time.perf_counter) -> tuple[float, float, float]:
    """Median seconds per call of `ours` and `peer`, timed alternately (ours, peer, peer, ours, ...) after a
    warm-up, and the median of the ratios of adjacent pairs (robust to the load drifting on a shared machine)."""
    for _ in range(3):
        ours(), peer()
    times: dict[str, list[float]] = {"ours": [], "peer": []}
    for i in range(repeats):
        order = (("ours", ours), ("peer", peer)) if i % 2 == 0 else (("peer", peer), ("ours", ours))
        for name, fn in order:
            sync()
            start = clock()
            for _ in range(inner):
                fn()
            sync()
            times[name].append((clock() - start) / inner)
    pair_ratio = statistics.median(o / p for o, p in zip(times["ours"], times["peer"]))
    return statistics.median(times["ours"]), statistics.median(times["peer"]), pair_ratio


def fwd_bwd(module: nn.Module, x: torch.Tensor):
    def step():
        module(x).sum().backward()
    return step


# -- (a) world size 1 ----------------------------------------------------------------------------------------
def part_a(repeats: int) -> list[str]:
    # The box is shared with other jobs: with one torch thread all the work (forward and the CPU autograd engine)
    # runs on this thread, so its CPU time measures our work and not the neighbours' (wall time is reported too).
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ref = nn.Linear(1024, 4096)
    x = torch.randn(64, 1024, requires_grad=True)
    rows = []
    for cls in (ColumnParallelLinear, RowParallelLinear):
        ours = cls.from_module(copy.deepcopy(ref))
        for clock_name, clock in (("thread CPU time", time.thread_time), ("wall time", time.perf_counter)):
            t_ours, t_peer, ratio = alternate(fwd_bwd(ours, x), fwd_bwd(ref, x), repeats, inner=5, clock=clock)
            rows.append(f"| (a) world 1, CPU fp32, 1 thread, {clock_name} | {cls.__name__} 1024->4096, 64 tokens, "
                        f"fwd+bwd | nn.Linear | {t_ours * 1e3:.3f} ms | {t_peer * 1e3:.3f} ms | "
                        f"{t_ours / t_peer:.3f} | **{ratio:.3f}** | <= 1.03 |")
    return rows


# -- (b) world size 2, gloo ---------------------------------------------------------------------------------
def _mlp_worker(repeats: int) -> list[tuple]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    comm = tpkit.get_communicator()
    mesh = init_device_mesh("cpu", (comm.world_size,))
    results = []
    for hidden, tokens in MLP_SIZES:
        torch.manual_seed(hidden)
        full = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        ours = nn.Sequential(ColumnParallelLinear.from_module(full[0]), nn.GELU(),
                             RowParallelLinear.from_module(full[2]))
        peer = parallelize_module(copy.deepcopy(full), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
        same = torch.allclose(ours(x), peer(x), rtol=1e-5, atol=1e-6)
        t_ours, t_peer, ratio = alternate(fwd_bwd(ours, x), fwd_bwd(peer, x), repeats, sync=comm.barrier)
        results.append((hidden, tokens, t_ours, t_peer, ratio, same))
    return results


def part_b(repeats: int) -> list[str]:
    per_rank = tpkit.launch(_mlp_worker, 2, backend="gloo", args=(repeats,))
    rows = []
    targets = {(256, 8): "<= 0.75", (2048, 32): "<= 1.0"}
    for (hidden, tokens, t_ours, t_peer, ratio, same), other in zip(per_rank[0], per_rank[1]):
        assert same and other[-1], "tpkit and DTensor MLP outputs differ"
        rows.append(f"| (b) world 2, gloo processes, CPU fp32 | MLP {hidden}->{4 * hidden}->{hidden}, {tokens} "
                    f"tokens, fwd+bwd | DTensor parallelize_module | {t_ours * 1e3:.3f} ms | {t_peer * 1e3:.3f} ms | "
                    f"{t_ours / t_peer:.3f} | **{ratio:.3f}** | {targets.get((hidden, tokens), '-')} |")
    return rows


# -- (c) CUDA, bf16, NCCL group of one ----------------------------------------------------------------------
def part_c(repeats: int) -> list[str]:
    if not torch.cuda.is_available():
        return ["| (c) CUDA bf16, NCCL world 1 | not run: no CUDA device here | nn.Linear | | | | | >= 0.97 |"]
    comm = tpkit.init("nccl")  # no launcher environment: a one-rank NCCL group on an in-memory store
    tokens, k, n = 8192, 4096, 16384
    torch.manual_seed(0)
    ref = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flops = 3 * 2 * tokens * k * n  # forward, grad input, grad weight
    rows = []
    for cls in (ColumnParallelLinear, RowParallelLinear):
        ours = cls.from_module(ref, comm=comm)
        t_ours, t_peer, ratio = alternate(fwd_bwd(ours, x), fwd_bwd(ref, x), repeats, inner=5,
                                          sync=torch.cuda.synchronize)
        tf_ours, tf_peer = flops / t_ours / 1e12, flops / t_peer / 1e12
        rows.append(f"| (c) CUDA bf16, NCCL world 1 ({torch.cuda.get_device_name()}) | {cls.__name__} {k}->{n}, "
                    f"{tokens} tokens, fwd+bwd | nn.Linear | {tf_ours:.1f} TFLOP/s | {tf_peer:.1f} TFLOP/s | "
                    f"{tf_ours / tf_peer:.3f} | **{1 / ratio:.3f}** (throughput) | >= 0.97 |")
    tpkit.shutdown()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["a", "b", "c", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=200, help="timed runs of each side (alternating)")
    args = parser.parse_args(argv)
    rows = ["| part | what | peer | tpkit (median) | peer (median) | ratio of medians | median pair ratio | target |",
            "|---|---|---|---|---|---|---|---|"]
    for part, fn in (("a", part_a), ("b", part_b), ("c", part_c)):
        if args.part in (part, "all"):
            rows += fn(args.repeats)
            print("\n".join(rows[-1:]), file=sys.stderr, flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
