"""`tpkit estimate TARGET`: memory per rank and speed per world size, before buying the devices.

TARGET is a preset (`llama-2-70b`), an HF config.json or model directory, or `module:factory`. Transformers
are estimated from their config alone; other modules need `--input-shape` to trace one small step.

Which machine the figures are for is decided once (`tpkit.estimate.pricing`) and said in the first line: the
measured profile when there is one (each world size priced op by op, as `tpkit search` prices it), else a GPU of a
known kind, else this machine measured now (a quick calibration, written for the next command); `--hardware`
prices a datasheet machine instead. `--cp C` prices training with C context-parallel ranks sharing each sequence
beside every world size's TP ranks (memory: the rank's share of the tokens; speed: the attention split, its
all-to-alls or ring sends and the gradients summed over cp). `--ep E` spreads a mixture-of-experts model's experts
over E ranks (`tpkit.expert_parallel`): each world size dividing E runs with the data-parallel replicas that make up
the expert group (memory: ceil(experts / E) whole experts per rank; speed: each MoE layer's all-to-alls, the expert
work as uniform routing times `--ep-imbalance` sends it, the experts' gradients summed over their own group). `--calibrate` measures this machine (matmul rates,
streaming bandwidth alone and shared, the framework's per-module time, collectives over `--backend` on 2 local
ranks), writes the speed profile (`--profile FILE`, default `$TPKIT_PROFILE` or ~/.cache/tpkit/profile.json) and prints each term read back
from that file; `--plot out.png` draws memory per rank and throughput against world size.
"""
from __future__ import annotations

import argparse
import json

from tpkit.tables import WIDE_HELP

_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
           "fp32": "float32", "float32": "float32", "float": "float32"}


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints like 1,2,4,8, got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be positive, got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tpkit.estimate.hardware import HARDWARE
    from tpkit.estimate.presets import PRESETS

    parser.add_argument("target", nargs="?", default=None,
                        help=f"a preset ({', '.join(PRESETS)}), an HF config.json or model directory, "
                             "or package.module:factory (optional with --calibrate)")
    parser.add_argument("--world-size", type=_sizes, default=None,
                        help="comma-separated (default: 1, 2, 4, ... up to this machine's devices (GPUs, else cores) "
                             "when it is what is priced, else 1,2,4,8)")
    parser.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                        help="default: a quantized checkpoint's own (as tpkit.from_pretrained loads it); else fp32 on "
                             "a measured CPU machine, else bf16")
    parser.add_argument("--mode", default="inference", choices=["inference", "training"])
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "none"])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=None, help="default: min(max positions, 4096)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--cp", type=int, default=1, metavar="C", help="training: C context-parallel ranks share each "
                        "sequence beside every world size's TP ranks (world size x C devices; default 1)")
    parser.add_argument("--cp-method", default="auto", choices=["auto", "all_to_all", "ring"],
                        help="context-parallel attention (default auto: all-to-all where the local heads divide by C, "
                             "else the ring)")
    parser.add_argument("--ep", type=int, default=1, metavar="E", help="a mixture-of-experts model's experts spread "
                        "over E ranks, a multiple of each world size (others are left out), with the data-parallel "
                        "replicas that make up the expert group (default 1)")
    parser.add_argument("--ep-imbalance", type=float, default=1.0, metavar="F",
                        help="with --ep: the busiest expert rank's load over uniform routing's (default 1.0)")
    parser.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    parser.add_argument("--attention", default=None, choices=["eager", "sdpa", "flash"],
                        help="attention kernel (default: the config's, else fused)")
    parser.add_argument("--hardware", default=None,
                        help=f"price this datasheet machine instead of this one: {', '.join(HARDWARE)} (default: the "
                             f"measured profile, else this machine's GPU, else this machine measured now)")
    parser.add_argument("--interconnect", default=None, choices=["nvlink", "pcie"], help="default nvlink")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="speed profile JSON to read (and, with --calibrate, write); default $TPKIT_PROFILE or "
                             "~/.cache/tpkit/profile.json")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine into the profile and print each term written")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "threads"], help="for --calibrate")
    parser.add_argument("--quick", action="store_true", help="--calibrate with small sizes and few repeats")
    parser.add_argument("--plot", metavar="PNG", help="memory per rank and throughput against world size")
    parser.add_argument("--input-shape", default=None,
                        help="for modules without a transformer config: input shape, batch first, e.g. 8,3,32,32")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--wide", action="store_true", help=WIDE_HELP)


def _memory_table(target: str, estimates, device_bytes: int, device_name: str, width: int | None) -> str:
    """Memory per rank, one row per world size. At a narrow width all-zero parts go first, then the parts that
    matter least to whether a model fits; world size, total and `fits` always stay."""
    from tpkit.tables import format_bytes
    from tpkit.tables import Column, render_table, wrap_text

    first = estimates[0]
    title = (f"{target}: memory per rank, {first.mode}, {first.dtype}, batch {first.batch_size}"
             + (f" x seq {first.seq_len}" if first.seq_len else "") + (" + SP" if first.sequence_parallel else "")
             + (f", recompute {first.recompute}" if first.recompute != "none" else "")
             + (f", each world size x cp {first.cp} ({first.cp_method})" if first.cp > 1 else "")
             + (f", ep {first.ep}" if first.ep > 1 else ""))
    parts = [("params", "parameters", 1), ("grads", "gradients", 5), ("optimizer", "optimizer_states", 3),
             ("activations", "activations", 4), ("kv cache", "kv_cache", 2), ("comm buf", "communication_buffers", 7)]
    columns = [Column("world size")]
    for header, field, drop in parts:
        zero = all(getattr(e.per_rank, field) == 0 for e in estimates)
        columns.append(Column(header, drop=drop + 10 * zero))
    columns += [Column("total"), Column("saves", drop=6), Column(f"fits {device_name}")]
    rows = [[str(e.world_size), *(format_bytes(getattr(e.per_rank, field)) for _, field, _ in parts),
             format_bytes(e.per_rank.total), f"{e.savings_percent:.0f}%", "yes" if e.per_rank.total <= device_bytes
             else "no"] for e in estimates]
    notes = [wrap_text(note, width, "note: ", "      ") for note in estimates[-1].notes]
    return "\n".join([render_table(title, columns, rows, width), *notes])


def _speed_table(speed, width: int | None) -> str:
    """`SpeedEstimate.summary()`'s table, fitted to `width` (the time's parts go first, comm last of them)."""
    from tpkit.tables import Column, render_table, wrap_text

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"

    unit = "token" if speed.mode == "decode" else "step"
    seq = f" x seq {speed.seq_len}" if speed.seq_len else ""
    seq += f", each world size x cp {speed.cp}" if speed.cp > 1 else ""
    title = (f"speed: {speed.mode}, {speed.dtype}, batch {speed.batch_size}{seq}, {speed.hardware} over "
             f"{speed.interconnect}")
    drops = {"compute": 3, "memory": 4, "framework": 5, "comm": 2}
    columns = [Column("world size"), *(Column(part, drop=drops[part]) for part in speed.parts),
               Column(f"time/{unit}"), Column(f"{speed.unit}/s"), Column("speedup"), Column("bound", drop=1)]
    rows = [[str(r.world_size), *(ms(s) for s in r.parts_s()), ms(r.total_s),
             f"{r.tokens_per_s:,.0f}", f"{r.speedup:.2f}x", r.bound] for r in speed.rows]
    notes = [wrap_text(note, width, "note: ", "      ") for note in speed.notes]
    return "\n".join([render_table(title, columns, rows, width), *notes])


def run(args: argparse.Namespace) -> int:
    import sys

    try:
        return _run(args)
    except (ValueError, TypeError) as exc:  # bad target or options: one clear line, no traceback
        print(f"tpkit estimate: error: {exc}", file=sys.stderr)
        return 2


def _calibrate(args: argparse.Namespace):
    """Measure, write, and print every term as read back from the written file (printed is written)."""
    from tpkit.estimate.calibrate import calibrate_profile
    from tpkit.estimate.profile import load_profile, save_profile
    from tpkit.estimate.terms import profile_terms

    from tpkit.setups import DP_WRAPPERS

    path = save_profile(calibrate_profile(args.backend, (2,), quick=args.quick, dp_wrappers=DP_WRAPPERS), args.profile)
    profile = load_profile(path)
    print(f"calibrated {profile.name}, written to {path}:")
    for line in profile_terms(profile):
        print(f"  {line}")
    print(f"profile written to {path}")
    return path


def _world_sizes(args: argparse.Namespace, pricing) -> list[int]:
    if args.world_size is not None:
        return args.world_size
    if not pricing.this_machine:
        return [1, 2, 4, 8]
    sizes = [1]
    while sizes[-1] * 2 <= pricing.devices:
        sizes.append(sizes[-1] * 2)
    return sizes + ([pricing.devices] if pricing.devices not in sizes else [])


def _with_ep(sizes: list[int], ep: int) -> list[int]:
    """The world sizes an expert group of `ep` holds whole (all of them at ep 1)."""
    kept = [t for t in sizes if ep % t == 0] if ep > 1 else sizes
    if not kept:
        raise ValueError(f"--ep {ep} is not a multiple of any world size asked ({sizes}): an expert group holds whole "
                         f"TP groups; pass --world-size with sizes dividing {ep}")
    return kept


def _experts(args: argparse.Namespace, t: int) -> dict:
    """estimate_memory's expert parallelism at world size `t`: the data-parallel replicas the expert group needs."""
    if args.ep == 1:
        return {}
    from tpkit.estimate.experts import replicas_for

    dp = replicas_for(args.ep, t * args.cp)
    return {"ep": args.ep, **({"dp_size": dp, "dp_mode": "ddp"} if dp > 1 else {})}


def _run(args: argparse.Namespace) -> int:
    import torch

    from tpkit.estimate import estimate_memory, transformer_shape
    from tpkit.estimate.presets import load_target
    from tpkit.estimate.pricing import machine_pricing
    from tpkit.estimate.quantized import loaded_dtype
    from tpkit.estimate.speed import estimate_speed

    if args.target is None and not args.calibrate:
        raise ValueError("give a TARGET to estimate (a preset, config.json, model directory or module:factory), "
                         "or --calibrate to measure this machine")
    written = _calibrate(args) if args.calibrate else None
    if args.target is None:
        return 0
    from tpkit.setups import DP_WRAPPERS

    pricing = machine_pricing(written or args.profile, args.hardware, args.interconnect, backend=args.backend,
                              dp_wrappers=DP_WRAPPERS)
    if not args.json:
        from tpkit.tables import output_width, wrap_text

        print(wrap_text(pricing.origin, output_width(wide=args.wide), "", "  "))
    hardware = pricing.hardware or pricing.profile.hardware
    sizes = _world_sizes(args, pricing)
    model, config = load_target(args.target, build=False)
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else \
        loaded_dtype(config, torch.float32 if pricing.measured else torch.bfloat16)  # quantized: the checkpoint's
    subject = model if model is not None else config
    extra = {}
    context = {"cp": args.cp, "cp_method": args.cp_method} if args.cp != 1 else {}  # estimate_* check it
    if args.input_shape:
        extra["input_shape"] = tuple(int(x) for x in args.input_shape.split(","))
    estimates = [estimate_memory(subject, t, dtype=dtype, mode=args.mode, optimizer=args.optimizer,
                                 batch_size=args.batch_size, seq_len=args.seq_len,
                                 sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                                 attention=args.attention, **extra, **context, **_experts(args, t))
                 for t in _with_ep(sizes, args.ep)]
    speed = None
    transformer = estimates[0].seq_len is not None  # the shape-modelled path; others were measured
    if transformer or extra:
        decodes = transformer and transformer_shape(config).is_decoder
        mode = "training" if args.mode == "training" else "decode" if decodes else "prefill"
        seq = estimates[0].seq_len or 2048
        speed = estimate_speed(subject if not transformer else config, sizes, hardware=pricing.hardware,
                               dtype=dtype, mode=mode, batch_size=args.batch_size, seq_len=seq,
                               sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                               attention=args.attention, profile=pricing.profile, **extra, **context,
                               **({"ep": args.ep, "ep_imbalance": args.ep_imbalance} if args.ep != 1 else {}))
    if args.plot:
        from .estimate_plot import plot_estimate

        plot_estimate(estimates, speed, args.plot, f"tpkit estimate {args.target}", hardware.memory_bytes)
        if not args.json:
            print(f"plot written to {args.plot}")
    if args.json:
        out = {"target": args.target, "hardware": hardware.name, "profile": pricing.profile.name,
               "pricing": pricing.origin, "device_memory_bytes": hardware.memory_bytes,
               "memory": [e.to_dict() for e in estimates], "speed": speed.to_dict() if speed else None}
        print(json.dumps(out, indent=2))
        return 0
    from tpkit.tables import output_width

    width = output_width(wide=args.wide)
    print(_memory_table(args.target, estimates, hardware.memory_bytes, hardware.name, width))
    if speed is not None:
        print(_speed_table(speed, width))
    else:
        print("speed: not estimated; pass --input-shape to measure this module's step")
    return 0
