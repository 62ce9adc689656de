"""`tpkit analyze TARGET`: which layers split and how, what stays replicated and why, memory per rank, and
the world size to run: the fastest the setup search predicts on this machine (`--profile`, as `estimate` and
`search` price it) among those that fit the memory budget, which the suggestion names.

TARGET is a preset (`llama-2-7b`, built with no weights on the meta device), an HF config.json or model
directory, or `module:factory`.
"""
from __future__ import annotations

import argparse
import json
import sys

from tpkit.tables import WIDE_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="preset name, config.json / model directory, or module:factory")
    parser.add_argument("--world-size", type=int, default=None, help="world size of the plan shown (default: "
                        "the suggested one, else 2)")
    parser.add_argument("--max-world-size", type=int, default=8, help="per-rank memory up to this size (default 8)")
    parser.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GB (default: the "
                        "detected GPU's); units are binary as GPU memory is sold: GB and GiB both mean 2**30 bytes "
                        "(likewise MB/MiB, TB/TiB); a plain number is bytes")
    parser.add_argument("--devices-per-node", type=int, default=None, help="devices of one machine (default: "
                        "this machine's GPU count); a suggestion beyond it is advised as a multi-node setup")
    parser.add_argument("--profile", default=None, metavar="FILE", help="speed profile the suggested world size is "
                        "priced by (default: $TPKIT_PROFILE or ~/.cache/tpkit/profile.json; with none there and no "
                        "GPU, this machine is measured first: `tpkit estimate --calibrate`)")
    parser.add_argument("--mode", default="inference", choices=["inference", "training"])
    parser.add_argument("--pp", type=int, default=None, metavar="P", help="also show where P pipeline stages cut the "
                        "model (`tpkit.split_stages`) and what each stage holds per rank")
    parser.add_argument("--plan-out", default=None, help="also write the plan as JSON to this file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--wide", action="store_true", help=WIDE_HELP)


def run(args: argparse.Namespace) -> int:
    from tpkit.setups import analyze
    from tpkit.estimate.presets import load_target

    try:
        model, config = load_target(args.target, device="meta")
    except ValueError as exc:
        print(f"tpkit analyze: {exc}", file=sys.stderr)
        return 2
    if model is None:
        print(f"tpkit analyze: {args.target!r} gave a config without a model type ({type(config).__name__}); "
              f"pass an HF config or a factory returning an nn.Module", file=sys.stderr)
        return 2
    try:  # a --pp the model cannot take is refused before the (slower) analysis and search run
        stages = pipeline_stages(model, args.pp, args.world_size or 1, args.mode) if args.pp else None
    except ValueError as exc:
        print(f"tpkit analyze: {exc}", file=sys.stderr)
        return 2
    try:
        report = analyze(model, world_size=args.world_size, max_world_size=args.max_world_size,
                         device_memory=args.device_memory, mode=args.mode, profile=args.profile,
                         devices_per_node=args.devices_per_node)
    except ValueError as exc:
        print(f"tpkit analyze: {exc}", file=sys.stderr)
        return 2
    if args.plan_out:
        report.plan.save(args.plan_out)
    if args.json:
        print(json.dumps({**report.to_dict(), **({"pipeline": stages[0]} if stages else {})}, indent=2))
    else:
        from tpkit.tables import output_width

        print(report.summary(width=output_width(wide=args.wide)), end="")
        if stages:
            print(stages[1])
        if args.plan_out:
            print(f"plan written to {args.plan_out}")
    return 0


def pipeline_stages(model, pp: int, tp: int, mode: str) -> tuple[dict, str]:
    """`(the split as a dict with each stage's bytes per rank, its text)` of `pp` stages at `tp`: weights, and in
    training their gradients and AdamW's two float32 states."""
    from tpkit import split_stages

    split = split_stages(model, pp)
    item = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    factor = (2 + 8 / item) if mode == "training" else 1
    per_rank = [b * factor / tp for b in split.stage_bytes]
    what = "weights, gradients and AdamW states" if mode == "training" else "weights"
    lines = [f"pipeline: {pp} stages at tp {tp} ({what} per rank)"]
    lines += [f"  {line}; {b / 2**30:.2f} GiB per rank" for line, b in zip(split.describe().splitlines(), per_rank)]
    return {**split.to_dict(), "bytes_per_rank": per_rank, "tp": tp}, "\n".join(lines)
