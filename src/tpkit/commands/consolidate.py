"""`tpkit consolidate DIR OUT`: a tpkit checkpoint (any world size) into a Hugging Face directory."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="tpkit checkpoint directory (follows `latest`) or a version directory")
    parser.add_argument("out", help="output directory: config.json + model.safetensors (or index + shards)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="split the output above this size")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import consolidate

    out = consolidate(args.directory, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30))
    print(f"wrote {out}")
    return 0
