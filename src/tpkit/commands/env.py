"""`tpkit env`: devices, interconnect, GPUDirect RDMA and NCCL settings of this machine, with advice
(`tpkit.comm.topology`). `--sys-root` / `--proc-root` read a recorded copy of /sys and /proc instead."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-nvidia-smi", action="store_true", help="do not run `nvidia-smi topo -m`")
    parser.add_argument("--sys-root", default="/sys", help="where sysfs is (a recorded copy, for checking)")
    parser.add_argument("--proc-root", default="/proc", help="where procfs is (a recorded copy, for checking)")


def run(args: argparse.Namespace) -> int:
    import torch

    import tpkit
    from tpkit.comm import topology

    sys_root, proc_root = Path(args.sys_root), Path(args.proc_root)
    topo = topology(infiniband_root=sys_root / "class" / "infiniband", run_nvidia_smi=not args.no_nvidia_smi,
                    pci_root=sys_root / "bus" / "pci" / "devices", proc_modules=proc_root / "modules")
    if args.json:
        print(json.dumps(topo.to_dict(), indent=1))
        return 0
    print(f"tpkit {tpkit.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else 'n/a'}")
    print(topo.summary())
    if topo.gpudirect.get("nccl_env"):
        print("NCCL settings for GPUDirect RDMA (before launch):")
        print("  export " + " ".join(f"{k}={v}" for k, v in topo.gpudirect["nccl_env"].items()))
    return 0
