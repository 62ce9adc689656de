"""`tpkit consolidate DIR OUT`: a tpkit checkpoint (any world size) into a Hugging Face directory."""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="tpkit checkpoint directory (follows `latest`) or a version directory")
    parser.add_argument("out", help="output directory: config.json + model.safetensors (or index + shards); must be "
                                    "new or empty unless --overwrite")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="split the output above this size")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty OUT as a whole (written beside it, then swapped in)")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import consolidate

    try:
        out = consolidate(args.directory, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30),
                          overwrite=args.overwrite)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError: one line, no traceback
        print(f"tpkit consolidate: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
