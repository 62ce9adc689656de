"""`DistributedModelWrapper`: the seed API's one-line conversion, on top of `parallelize`."""
from __future__ import annotations

from typing import Any

from torch import nn

from ..nn._layer import resolve_comm
from .parallelize import parallelize
from .styles import REPLICATE


class DistributedModelWrapper(nn.Module):
    """Wraps `model` after converting it in place for this rank (`parallelize(model, plan, comm)`).

    `world_size` / `rank`, when given, must agree with the communicator (default: `tpkit.get_communicator()`);
    they are checks, since the communicator decides who is who. Calls and unknown attributes (`generate`,
    `config`, ...) go to the wrapped model.
    """

    def __init__(self, model: nn.Module, world_size: int | None = None, rank: int | None = None, comm=None, *,
                 plan: Any = "auto", mode: str = "inference", example_inputs: Any = None,
                 sequence_parallel: bool = False):
        super().__init__()
        comm = resolve_comm(comm)
        if world_size is not None and world_size != comm.world_size:
            raise ValueError(f"DistributedModelWrapper: world_size={world_size} but the communicator has "
                             f"{comm.world_size} ranks; start {world_size} ranks (tpkit.launch / torchrun) or drop "
                             f"the argument")
        if rank is not None and rank != comm.rank:
            raise ValueError(f"DistributedModelWrapper: rank={rank} but this process is rank {comm.rank} of its "
                             f"communicator")
        self.comm = comm
        self.base_model = parallelize(model, plan, comm, mode=mode, example_inputs=example_inputs,
                                      sequence_parallel=sequence_parallel)

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def tp_plan(self):
        m = self.base_model
        return m._tp_plan if isinstance(getattr(type(m), "tp_plan", None), property) else m.tp_plan

    @property
    def parallelized_layers(self) -> list[str]:
        """Names of the layers that were split (everything else is replicated)."""
        return [n for n, s in self.tp_plan.entries.items() if s != REPLICATE]

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base_model"), name)
