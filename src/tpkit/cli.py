"""The `tpkit` command: `tpkit demo | analyze | estimate | search | verify | bench | env | consolidate`.

Each subcommand lives in its own module under `tpkit.commands` with two functions, `add_arguments(parser)`
and `run(args) -> int`; this file only wires them up, so a subcommand is found by its name.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "demo": "run a short tensor-parallel demo on 2 local ranks",
    "analyze": "which layers of a model split and how, memory per rank, suggested world size",
    "estimate": "memory and speed estimates per world size",
    "search": "the best setup (TP, DP, sequence parallel, recompute, ...) for N devices and a goal",
    "verify": "run a plan on N thread-ranks and compare with the original model",
    "bench": "collective benchmarks in the style of nccl-tests",
    "env": "devices, interconnect and NCCL settings, with advice",
    "consolidate": "a tpkit checkpoint into a Hugging Face directory",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpkit", description="tensor parallelism for PyTorch models")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(f"tpkit.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"tpkit.commands.{name}":
                raise
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
