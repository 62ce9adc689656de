"""`tpkit verify TARGET`: run the plan on N thread-ranks in this process and compare with the original.

The model is built for real (random weights, CPU), so a preset is cut to `--layers` layers; the plan and
the layer shapes are the full model's, so a plan for 64 GPUs is checked on a laptop.
"""
from __future__ import annotations

import argparse
import json
import sys

from tpkit.tables import WIDE_HELP

MAX_PARAMS = 400_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="preset name, config.json / model directory, or module:factory")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--plan", default="auto", help="'auto' or a plan JSON file (from `tpkit analyze --plan-out`)")
    parser.add_argument("--mode", default="inference", choices=["inference", "training"])
    parser.add_argument("--layers", type=int, default=1, help="transformer layers to build (default 1)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8)
    parser.add_argument("--backward", action="store_true", help="compare gradients too")
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--force", action="store_true", help=f"build even above {MAX_PARAMS:,} parameters")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--wide", action="store_true", help=WIDE_HELP)


def _build(args):
    import torch

    from tpkit.estimate.presets import build_model, load_target

    model, config = load_target(args.target, build=False)
    if model is not None:
        return model
    if config is None or not hasattr(config, "model_type"):
        raise ValueError(f"{args.target!r} gave no model")
    for attr in ("num_hidden_layers", "n_layer"):
        if hasattr(config, attr):
            setattr(config, attr, min(getattr(config, attr), args.layers))
    config._attn_implementation = "eager"
    shape = build_model(config, device="meta")
    n = sum(p.numel() for p in shape.parameters())
    if n > MAX_PARAMS and not args.force:
        raise ValueError(f"{args.target} with {args.layers} layer(s) has {n:,} parameters; each of the "
                         f"{args.world_size} ranks plus the reference holds a copy on this CPU. Pass --force, or a "
                         f"smaller config")
    torch.manual_seed(0)
    return build_model(config, device="cpu", dtype=torch.float32)


def _inputs(model, args):
    import torch

    from tpkit.convert.trace import default_inputs

    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(model, "main_input_name", None) == "input_ids":
        g = torch.Generator().manual_seed(0)
        return {"input_ids": torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=g)}
    for candidate in default_inputs(model):
        try:
            with torch.no_grad():
                model(**candidate) if isinstance(candidate, dict) else model(*candidate)
            return candidate
        except Exception:  # noqa: BLE001 - try the next shape
            continue
    raise ValueError("cannot guess an input for this model; use tpkit.convert.verify() with example_inputs")


def run(args: argparse.Namespace) -> int:
    from tpkit.convert import verify

    try:
        model = _build(args)
        inputs = _inputs(model, args)
        report = verify(model, inputs, world_size=args.world_size, plan=args.plan, backward=args.backward,
                        rtol=args.rtol, mode=args.mode)
    except ValueError as exc:
        print(f"tpkit verify: {exc}", file=sys.stderr)
        return 2
    if args.json:
        import dataclasses

        print(json.dumps(dataclasses.asdict(report), indent=2, default=str))
    else:
        from tpkit.tables import output_width

        print(report.summary(output_width(wide=args.wide)))
    return 0 if report.ok else 1
