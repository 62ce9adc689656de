"""`tpkit search MODEL --devices N --goal decode|prefill|train`: the best way to run a model on N devices.

Every setup tpkit can build (TP size, DDP / FSDP2 / replicas, sequence parallelism, recompute, each architecture
family's alternatives) is priced on the machine `tpkit estimate` prices (its first line says which: the measured
profile, else this machine's GPU, else this machine measured now; `--hardware` for a datasheet machine), those
over `--memory` per device are dropped, the rest ranked; `--measure K` runs the top K on local ranks, each in
`--launches L` fresh launches taking turns (default 3), saying on stderr which setup runs and what it took, and
picks the best median, calling a tie what the launches cannot separate (Ctrl-C ends the ranks it started);
`--plot out.png` draws predicted time against memory per device.
"""
from __future__ import annotations

import argparse
import json
import sys

from tpkit.tables import WIDE_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="preset name, config.json / model directory, or module:factory")
    parser.add_argument("--devices", type=int, required=True, help="how many devices (ranks) to plan for")
    parser.add_argument("--goal", default="decode", choices=["decode", "prefill", "train"])
    parser.add_argument("--memory", default=None, help="memory per device, e.g. 80GB (binary units)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--measure", type=int, default=0, metavar="K", help="run the top K for real and rank by that")
    parser.add_argument("--steps", type=int, default=5, help="steps per measured setup (default 5)")
    parser.add_argument("--launches", type=int, default=3, metavar="L",
                        help="fresh launches of each measured setup, taking turns (default 3)")
    parser.add_argument("--profile", default=None, metavar="FILE", help="speed profile (default: $TPKIT_PROFILE or "
                        "~/.cache/tpkit/profile.json)")
    parser.add_argument("--hardware", default=None, help="price this datasheet machine (e.g. H100-SXM) instead of "
                        "this one")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per measured setup (default 600)")
    parser.add_argument("--plot", metavar="PNG", help="predicted time against memory per device")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--wide", action="store_true", help=WIDE_HELP)


def run(args: argparse.Namespace) -> int:
    from tpkit.estimate.presets import load_target
    from tpkit.tables import output_width
    from tpkit.setups import search

    def progress(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        model, config = load_target(args.target, device="meta")
        target = config if config is not None and hasattr(config, "model_type") else model
        result = search(target, args.devices, args.goal, args.memory, args.batch_size, args.seq_len, args.profile,
                        args.measure, args.steps, hardware=args.hardware, progress=progress, timeout=args.timeout,
                        launches=args.launches)
    except ValueError as exc:
        print(f"tpkit search: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # tpkit.launch has ended the ranks it started on the way out
        print("tpkit search: interrupted; the ranks it started were ended", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    width = output_width(wide=args.wide)
    from tpkit.tables import wrap_text

    print(wrap_text(result.notes[0], width, "", "  "))
    print(result.summary(width))
    print(result.explain(width))
    if args.plot:
        print(f"plot written to {result.plot(args.plot)}")
    return 0
