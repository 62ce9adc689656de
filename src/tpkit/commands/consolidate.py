"""`tpkit consolidate DIR OUT`: a tpkit checkpoint (any world size) into a Hugging Face directory, the tokenizer
files of the model directory it was loaded from beside the weights (`--tokenizer DIR` names another,
`--no-tokenizer` copies none)."""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="tpkit checkpoint directory (follows `latest`) or a version directory")
    parser.add_argument("out", help="output directory: config.json + model.safetensors (or index + shards) and the "
                                    "tokenizer files; must be new or empty unless --overwrite")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="split the output above this size")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty OUT as a whole (written beside it, then swapped in)")
    tokenizer = parser.add_mutually_exclusive_group()
    tokenizer.add_argument("--tokenizer", default=None, metavar="DIR",
                           help="copy the tokenizer files of this model directory (default: those of the directory "
                                "the checkpoint's model was loaded from, which the checkpoint records)")
    tokenizer.add_argument("--no-tokenizer", action="store_true", help="copy no tokenizer files")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import consolidate
    from ..checkpoint.load import open_source
    from ..checkpoint.tokenizer import recorded_tokenizer, tokenizer_files

    tokenizer = None if args.no_tokenizer else args.tokenizer or "auto"
    try:
        out = consolidate(args.directory, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30),
                          overwrite=args.overwrite, tokenizer=tokenizer)
        why = (recorded_tokenizer(open_source(args.directory).manifest)[1] if tokenizer == "auto"
               else f"from {tokenizer}")
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError: one line, no traceback
        print(f"tpkit consolidate: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    copied = tokenizer_files(out)
    if copied:
        print(f"tokenizer files: {', '.join(copied)} ({why})")
    elif tokenizer is not None:
        print(f"no tokenizer files copied: {why}; --tokenizer DIR copies a model directory's")
    return 0
