"""Expert parallelism on this box: an MoE training step at ep2 and ep4 (over dp, tp1) against the experts
replicated over dp4 (FSDP2) and against tensor parallelism's split of every expert (tp4, the default plan's
`experts_tp`), 4 gloo processes.

The model: a Qwen3-MoE (every layer MoE, 8 experts, top-2, float32) whose hidden size, expert width, depth, batch
and sequence length are drawn from --seed. One `tpkit.launch` of 4 processes builds every setup side by side from
the same model (deep copies), each with its own AdamW:
- dp4-fsdp: the model as it is under `tpkit.data_parallel(model, groups.dp_cp, mode="fsdp")`, experts included;
- tp4: `tpkit.parallelize(model, comm=world, mode="training")` (the default plan: `experts_tp`), whole batch;
- ep2 / ep4: `tpkit.expert_parallel(model, tpkit.comm.groups(world, tp=1, ep=E))`, then FSDP2 over dp x cp for
  the rest, as `examples/finetune.py --ep E` does (the experts sharded over their expert-data group: edp 2 at ep2,
  none at ep4).
A step: forward + backward of this rank's share of the batch, `tpkit.clip_grad_norm_`, AdamW. The first step of
each setup is a check (same model, same batch: the dp-mean loss and the gradient norm must agree), then the
setups run in turn, the order rotating every round, a barrier before and after each step; the figure is rank 0's
wall time between the barriers, median over --rounds, and the median of the per-round ratios to dp4-fsdp.

Bytes moved by the all-to-alls: the expert group's `all_to_all` wrapped for one step, each call counting what this
rank sends to the other ranks (the rows: 2 in the forward, dispatch and return, 2 in the backward; the counts
exchange, one per layer, apart), the largest rank's; next to the formula: per MoE layer and all-to-all a rank sends
rows x top_k x H x 4 bytes x (ep - 1) / ep (uniform routing), 4 all-to-alls per layer. Expert parameter bytes per
rank: the local part of every experts weight at rest (FSDP2: its shard; it gathers the whole during the forward
and backward), over the whole model's experts. The experts' other traffic (weights gathered, outputs or gradients
all-reduced) is given by formula only (`other_traffic`).

    PYTHONPATH=src python bench/experts.py [--seed 0] [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time

import torch

import tpkit

SETUPS = ("dp4-fsdp", "tp4", "ep2", "ep4")
EXPERTS, TOP_K, HEADS, KV_HEADS = 8, 2, 8, 4


def draw(seed: int) -> dict:
    rng = random.Random(seed)
    return {"hidden": rng.randrange(256, 513, 64), "moe_intermediate": rng.randrange(256, 513, 64),
            "layers": rng.randint(2, 4), "batch": rng.choice((4, 8)), "seq": rng.randrange(64, 129, 16)}


def build(shape: dict, vocab: int) -> torch.nn.Module:
    import transformers as tr

    config = tr.Qwen3MoeConfig(vocab_size=vocab, hidden_size=shape["hidden"], intermediate_size=shape["hidden"] * 2,
                               moe_intermediate_size=shape["moe_intermediate"], num_hidden_layers=shape["layers"],
                               num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                               head_dim=shape["hidden"] // HEADS, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                               decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=shape["seq"],
                               norm_topk_prob=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tr.AutoModelForCausalLM.from_config(config).float()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def expert_bytes(model: torch.nn.Module) -> int:
    return sum(_local(p).numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


def setup(name: str, model0: torch.nn.Module, world):
    """`(model, optimizer, dp communicator or None, expert group or None)` of one setup on this rank."""
    model = copy.deepcopy(model0)
    if name == "tp4":
        model, dp, ep = tpkit.parallelize(model, comm=world, mode="training"), None, None
    else:
        size = int(name[2]) if name.startswith("ep") else 1
        groups = tpkit.comm.groups(world, tp=1, ep=size)
        if size > 1:
            tpkit.expert_parallel(model, groups)
        model, dp, ep = tpkit.data_parallel(model, groups.dp_cp, mode="fsdp"), groups.dp, groups.ep
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), dp, ep


def step(model, opt, dp, ids) -> tuple[torch.Tensor, torch.Tensor]:
    mine = ids.chunk(dp.world_size)[dp.rank] if dp is not None else ids
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    norm = tpkit.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    loss = loss.detach()
    return (dp.all_reduce(loss) / dp.world_size if dp is not None else loss), norm


class Counting:
    """Wraps a communicator's `all_to_all`: bytes this rank sends to the other ranks, rows and counts apart."""

    def __init__(self, comm):
        self.comm, self.original = comm, comm.all_to_all
        self.rows = self.counts = self.calls = 0

    def __call__(self, tensor, scatter_dim, gather_dim, scatter_sizes=None, gather_sizes=None, async_op=False):
        n, me = self.comm.world_size, self.comm.rank
        sizes = list(scatter_sizes) if scatter_sizes is not None else [tensor.shape[scatter_dim] // n] * n
        per = tensor.numel() // max(tensor.shape[scatter_dim], 1) * tensor.element_size()
        sent = sum(s for j, s in enumerate(sizes) if j != me) * per
        if tensor.is_floating_point():
            self.rows, self.calls = self.rows + sent, self.calls + 1
        else:
            self.counts += sent
        return self.original(tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes, async_op=async_op)


def other_traffic(name: str, shape: dict, full: int, world: int = 4) -> float:
    """Bytes a rank sends per step for the experts besides the all-to-alls, by formula (a ring all-reduce sends
    2 (n - 1) / n of the tensor, an all-gather or reduce-scatter (n - 1) / n): dp4-fsdp gathers the experts in the
    forward and again in the backward and reduce-scatters their gradients; tp4 all-reduces each MoE layer's output
    (forward) and its input's gradient (backward), whole batch; epE with an expert-data group (edp = 4 / E > 1):
    FSDP2 over edp, its experts gathered in the forward and the backward and their gradients reduce-scattered."""
    if name == "dp4-fsdp":
        return 3 * (world - 1) / world * full
    if name == "tp4":
        return shape["layers"] * 2 * 2 * (world - 1) / world * shape["batch"] * shape["seq"] * shape["hidden"] * 4
    ep = int(name[2])
    edp = world // ep
    return 3 * (edp - 1) / edp * full / ep


def body(args, shape: dict) -> dict:
    world = tpkit.get_communicator()
    model0 = build(shape, args.vocab)
    full_experts = expert_bytes(model0)
    runs = {name: setup(name, model0, world) for name in SETUPS}
    ids = torch.randint(0, args.vocab, (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0))
    out: dict = {"full_expert_bytes": full_experts, "experts_impl": getattr(model0.config, "_experts_implementation",
                                                                            None)}
    for name, (model, opt, dp, ep) in runs.items():
        counter = None
        if ep is not None:
            counter = Counting(ep)
            ep.all_to_all = counter
        loss, norm = step(model, opt, dp, ids)  # the first step: the check, and the one whose bytes are counted
        if counter is not None:
            del ep.all_to_all
        out[name] = {"loss": loss.item(), "norm": norm.item(), "expert_bytes": expert_bytes(model),
                     "rows_bytes": counter.rows if counter else 0, "count_bytes": counter.counts if counter else 0,
                     "calls": counter.calls if counter else 0}
        for _ in range(args.warmup):
            step(model, opt, dp, ids)
    times: dict[str, list[float]] = {name: [] for name in SETUPS}
    for r in range(args.rounds):
        for name in SETUPS[r % len(SETUPS):] + SETUPS[:r % len(SETUPS)]:
            model, opt, dp, _ = runs[name]
            world.barrier()
            start = time.perf_counter()
            step(model, opt, dp, ids)
            world.barrier()
            times[name].append(time.perf_counter() - start)
    out["times"] = times
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="draws the model's sizes, batch and sequence length")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    shape = draw(args.seed)
    per_rank = tpkit.launch(body, 4, backend="gloo", args=(args, shape), timeout=900, threads=1)
    first = per_rank[0]
    full, times = first["full_expert_bytes"], first["times"]
    rows = shape["batch"] // 4 * shape["seq"]  # each rank's rows at tp1 over dp4
    print(f"Qwen3-MoE hidden {shape['hidden']}, {EXPERTS} experts x {shape['moe_intermediate']}, top-{TOP_K}, "
          f"{shape['layers']} layers, float32; batch {shape['batch']} x seq {shape['seq']} (seed {args.seed}); "
          f"4 gloo ranks, 1 thread each; transformers' experts: {first['experts_impl']}")
    print("| setup | step (ms) | x dp4-fsdp | all-to-all MiB / rank / step, largest (mean) | formula | "
          "other expert traffic / rank (formula, MiB) | expert params / rank (MiB) | x whole |")
    print("|---|---|---|---|---|---|---|---|")
    out = {"shape": shape, "args": vars(args), "setups": {}}
    for name in SETUPS:
        ratios = [t / b for t, b in zip(times[name], times["dp4-fsdp"])]
        sent = [r[name]["rows_bytes"] for r in per_rank]
        ep = int(name[2]) if name.startswith("ep") else 1
        formula = shape["layers"] * 4 * rows * TOP_K * shape["hidden"] * 4 * (ep - 1) / ep
        held = max(r[name]["expert_bytes"] for r in per_rank)
        row = {"step_ms": statistics.median(times[name]) * 1e3, "ratio": statistics.median(ratios),
               "a2a_bytes_max": max(sent), "a2a_bytes_mean": statistics.mean(sent), "a2a_formula": formula,
               "a2a_calls": first[name]["calls"], "count_bytes": max(r[name]["count_bytes"] for r in per_rank),
               "other_formula": other_traffic(name, shape, full), "expert_bytes": held,
               "loss": first[name]["loss"], "norm": first[name]["norm"]}
        out["setups"][name] = row
        a2a = f"{max(sent) / 2**20:.2f} ({statistics.mean(sent) / 2**20:.2f}), {row['a2a_calls']} calls" \
            if ep > 1 else "-"
        want = f"{formula / 2**20:.2f}" if ep > 1 else "-"
        print(f"| {name} | {row['step_ms']:.0f} | {row['ratio']:.2f} | {a2a} | {want} | "
              f"{row['other_formula'] / 2**20:.2f} | {held / 2**20:.2f} | {held / full:.3f} |")
    losses = [out["setups"][n]["loss"] for n in SETUPS]
    norms = [out["setups"][n]["norm"] for n in SETUPS]
    print(f"whole experts: {full / 2**20:.2f} MiB; first step (same model, same batch) over the setups: loss "
          f"{min(losses):.5f}, spread {max(losses) - min(losses):.1e}; grad norm {min(norms):.5f}, spread "
          f"{max(norms) - min(norms):.1e}; counts exchanged per step: "
          + ", ".join(f"{n} {out['setups'][n]['count_bytes']} B" for n in SETUPS if n.startswith("ep")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
