"""Weights are replicated over the cp group, and each cp rank's gradient covers its own tokens: summed over cp.

Every floating parameter of the model enters its module's forward through `copy_to_region(p, cp)` (identity
forward, all-reduce of its gradient over cp backward): the same rewrite mechanism as the TP gradient sums
(`tpkit.nn.rewrites`), so it survives `load_state_dict(assign=True)`, `deepcopy`, FSDP2 and pickling, and is right
whatever engine runs the data parallelism afterwards (DDP averaging over dp, FSDP2 over dp or dp x cp: every cp
rank then holds the same, whole gradient). A parameter already summed over its TP group (`grad_sums.Summed`)
keeps that sum inside this one. A parameter read twice in a forward (tied embeddings) is summed at each read.
Weights stored quantized (frozen) are left as they are.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..nn.grad_sums import Summed
from ..nn.mappings import copy_to_region
from ..nn.rewrites import Rewrite, rewrite, rewrites_of


class OverContext(Rewrite):
    """The parameter's gradient summed over the cp group (after its TP sum `inner`, if it has one)."""

    def __init__(self, comm: Communicator, inner: Summed | None = None):
        self.comm, self.inner = comm, inner

    def read(self, module: nn.Module, name: str, stored: torch.Tensor | None) -> torch.Tensor:
        seen = self.inner.read(module, name, stored) if self.inner is not None else stored
        return copy_to_region(seen, self.comm)


def sum_over_context(model: nn.Module, comm: Communicator) -> list[str]:
    """Sum every floating parameter's gradient over `comm`; returns the state-dict keys summed."""
    if comm.world_size == 1:
        return []
    keys = []
    for prefix, module in model.named_modules():
        present = rewrites_of(module)
        for name, p in module.named_parameters(recurse=False):
            how = present.get(name)
            if not p.is_floating_point() or not (how is None or isinstance(how, Summed)):
                continue  # an integer buffer-like parameter, a weight stored quantized, or summed over cp already
            rewrite(module, name, OverContext(comm, how))
            keys.append(f"{prefix}.{name}" if prefix else name)
    return keys
