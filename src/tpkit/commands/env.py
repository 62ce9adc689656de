"""`tpkit env`: devices, interconnect and NCCL settings of this machine, with advice (`tpkit.comm.topology`)."""
from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-nvidia-smi", action="store_true", help="do not run `nvidia-smi topo -m`")


def run(args: argparse.Namespace) -> int:
    import torch

    import tpkit
    from tpkit.comm import topology

    topo = topology(run_nvidia_smi=not args.no_nvidia_smi)
    if args.json:
        print(json.dumps(topo.to_dict(), indent=1))
        return 0
    print(f"tpkit {tpkit.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else 'n/a'}")
    print(topo.summary())
    return 0
