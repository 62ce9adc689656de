"""Beyond one machine: the recommendation `analyze` adds when its suggested world size needs more devices than
one node holds (tensor parallelism inside each node, data parallelism across nodes, and the launch)."""
from __future__ import annotations

import torch

from ...tables import format_bytes as human


def local_device_count() -> int | None:
    """The GPUs of this machine (None without one: a CPU host's process count is the user's choice)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else None


def multi_node_advice(suggested: int | None, memory: dict, dev: int | None, node: int | None,
                      max_world_size: int) -> str | None:
    """The multi-node recommendation when the suggested world size (or, when nothing up to `max_world_size`
    fits, the need) exceeds the `node` devices of one machine, else None.

    Tensor parallelism stays inside a node: its all-reduce per block wants the node's fast links (NVLink), and
    across nodes it would run on the network. Beyond one node the model is data parallel: FSDP2 shards what
    one node's tensor parallel ranks still hold over the nodes, which is how the memory need is met."""
    if not node or dev is None or (suggested is not None and suggested <= node):
        return None
    if suggested is None and (node not in memory or memory[node] <= dev):
        return None
    if suggested is not None:
        nodes = -(-suggested // node)
        need = f"the suggested world size {suggested} exceeds the {_count(node, 'device')} of one machine"
    else:
        nodes = max(2, -(-memory[node] // dev))
        need = (f"nothing up to {max_world_size} ranks fits, and at {_count(node, 'rank')} (one machine) each holds "
                f"{human(memory[node])} against {human(dev)}")
    launch = (f"launch on every node `torchrun --nnodes {nodes} --nproc-per-node {node} --node-rank <i> "
              f"--rdzv-backend c10d --rdzv-endpoint <first node>:29500 train.py`")
    if node == 1:
        # tp=1 is no tensor parallelism: with one device per machine, only data parallelism stays off the network
        # per block (a tensor parallel group would span machines).
        return (f"{need}: run on {nodes} nodes, data parallel across them (dp={nodes}; with one device per machine "
                f"there is no tensor parallel group to keep inside a node; tpkit.data_parallel(model, dp_comm, "
                f"mode='fsdp') shards the weights and optimizer states {nodes} ways); {launch}; tensor parallelism "
                f"across machines would put its all-reduce per block on the network")
    return (f"{need}: run on {nodes} nodes with tensor parallelism inside each node (tp={node}) and data parallel "
            f"across them (dp={nodes}; tpkit.data_parallel(model, dp_comm, mode='fsdp') shards each rank's "
            f"weights and optimizer states {nodes} ways); {launch}; a tensor parallel group spanning nodes would "
            f"put its all-reduce per block on the network")


def _count(n: int, noun: str) -> str:
    """`1 device`, `2 devices`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
