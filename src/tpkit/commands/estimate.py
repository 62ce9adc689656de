"""`tpkit estimate TARGET`: memory per rank and speed per world size, before buying the devices.

TARGET is a preset (`llama-2-70b`), an HF config.json or model directory, or `module:factory`. Transformers
are estimated from their config alone; other modules need `--input-shape` to trace one small step.

`--calibrate` measures this machine (matmul FLOP/s, memory bandwidth, all-reduce latency and bandwidth over
`--backend` on 2 local ranks) and writes a speed profile (`--profile FILE`, default `$TPKIT_PROFILE` or
~/.cache/tpkit/profile.json) that later estimates read; `--plot out.png` draws memory per rank and
throughput against world size.
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
    parser.add_argument("--world-size", type=_sizes, default=[1, 2, 4, 8], help="comma-separated (default 1,2,4,8)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    parser.add_argument("--mode", default="inference", choices=["inference", "training"])
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "none"])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=None, help="default: min(max positions, 4096)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    parser.add_argument("--attention", default=None, choices=["eager", "sdpa", "flash"],
                        help="attention kernel (default: the config's, else fused)")
    parser.add_argument("--hardware", default=None,
                        help=f"one of {', '.join(HARDWARE)} (default: the profile's measured machine, else H100-SXM)")
    parser.add_argument("--interconnect", default=None, choices=["nvlink", "pcie"], help="default nvlink")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="speed profile JSON to read (and, with --calibrate, write); default $TPKIT_PROFILE or "
                             "~/.cache/tpkit/profile.json if present, else the built-in calibrated profile")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine (matmul, memory bandwidth, all-reduce) into the profile")
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
             + (f", recompute {first.recompute}" if first.recompute != "none" else ""))
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
    """`SpeedEstimate.summary()`'s table, fitted to `width` (compute, memory and comm time go first)."""
    from tpkit.tables import Column, render_table, wrap_text

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"

    unit = "token" if speed.mode == "decode" else "step"
    seq = f" x seq {speed.seq_len}" if speed.seq_len else ""
    title = (f"speed: {speed.mode}, {speed.dtype}, batch {speed.batch_size}{seq}, {speed.hardware} over "
             f"{speed.interconnect}")
    columns = [Column("world size"), Column("compute", drop=3), Column("memory", drop=4), Column("comm", drop=2),
               Column(f"time/{unit}"), Column(f"{speed.unit}/s"), Column("speedup"), Column("bound", drop=1)]
    rows = [[str(r.world_size), ms(r.compute_s), ms(r.memory_s), ms(r.communication_s), ms(r.total_s),
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
    from tpkit.estimate.calibrate import calibrate_profile
    from tpkit.tables import format_bytes
    from tpkit.estimate.profile import save_profile

    profile = calibrate_profile(args.backend, (2,), quick=args.quick)
    path = save_profile(profile, args.profile)
    hw = profile.hardware
    link = profile.links[args.backend]
    print(f"calibrated {hw.name}: matmul {hw.peak_flops_fp32 / 1e9:.1f} GFLOP/s fp32, "
          f"{hw.peak_flops_16bit / 1e9:.1f} GFLOP/s bf16; memory {hw.memory_bandwidth / 1e9:.2f} GB/s; "
          f"all-reduce over {args.backend}: {2 * link.hop_latency_s * 1e6:.1f} us latency (2 ranks), "
          f"{hw.interconnect.bandwidth / 1e9:.3f} GB/s bus bandwidth; memory {format_bytes(hw.memory_bytes)}")
    print(f"profile written to {path}")
    return profile


def _run(args: argparse.Namespace) -> int:
    import torch

    from tpkit.estimate import estimate_memory, transformer_shape
    from tpkit.estimate.hardware import get_hardware
    from tpkit.estimate.presets import load_target
    from tpkit.estimate.profile import load_profile
    from tpkit.estimate.speed import estimate_speed

    if args.target is None and not args.calibrate:
        raise ValueError("give a TARGET to estimate (a preset, config.json, model directory or module:factory), "
                         "or --calibrate to measure this machine")
    profile = _calibrate(args) if args.calibrate else load_profile(args.profile)
    if args.target is None:
        return 0
    dtype = getattr(torch, _DTYPES[args.dtype])
    hardware = get_hardware(args.hardware or profile.hardware or "H100-SXM",
                            args.interconnect or (None if args.hardware is None and profile.hardware else "nvlink"))
    model, config = load_target(args.target, build=False)
    subject = model if model is not None else config
    extra = {}
    if args.input_shape:
        extra["input_shape"] = tuple(int(x) for x in args.input_shape.split(","))
    estimates = [estimate_memory(subject, t, dtype=dtype, mode=args.mode, optimizer=args.optimizer,
                                 batch_size=args.batch_size, seq_len=args.seq_len,
                                 sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                                 attention=args.attention, **extra) for t in args.world_size]
    speed = None
    transformer = estimates[0].seq_len is not None  # the shape-modelled path; others were measured
    if transformer or extra:
        decodes = transformer and transformer_shape(config).is_decoder
        speed = estimate_speed(subject if not transformer else config, args.world_size, hardware=hardware,
                               dtype=dtype, mode="training" if args.mode == "training" else
                               "decode" if decodes else "prefill",
                               batch_size=args.batch_size, seq_len=estimates[0].seq_len or 2048,
                               sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                               attention=args.attention, profile=profile, **extra)
    if args.plot:
        from .estimate_plot import plot_estimate

        plot_estimate(estimates, speed, args.plot, f"tpkit estimate {args.target}", hardware.memory_bytes)
        if not args.json:
            print(f"plot written to {args.plot}")
    if args.json:
        out = {"target": args.target, "hardware": hardware.name, "profile": profile.name, "device_memory_bytes": hardware.memory_bytes,
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
