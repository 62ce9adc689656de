"""Tensor parallel x data parallel: a converted model under torch's own FSDP2 or DDP on a 2-D layout.

Tensor parallelism stops scaling at one node's fast interconnect; beyond it, the model is replicated (DDP) or
sharded (FSDP) over a second, data-parallel dimension. `tpkit.comm.split(comm, tp_size)` lays out the ranks
(tp groups of consecutive ranks, dp groups across them); `parallelize(model, comm=tp_comm)` converts the model
on the tp group; `data_parallel(model, dp_comm)` then hands each rank's TP-local parameters to torch's engine
over the dp group: FSDP2 (`fully_shard`, once per transformer block, then the root) shards them on their first
dimension, DDP averages their gradients. torch does the data-parallel work; tpkit only keeps what torch does
not know about:

- the TP layout of every parameter, by name (`fully_shard` replaces Parameters, so marks tpkit sets on them,
  the partition dim or "replicated across TP", are gone), for `tpkit.clip_grad_norm_` and the checkpoints;
- the global gradient norm over both dimensions: TP-split parameters summed over every rank, TP-replicated ones
  once per TP group, dp shards (FSDP) summed over dp and dp replicas (DDP) counted once;
- per-dimension RNG seeds (`data_parallel_manual_seed`): dropout differs across dp ranks and follows the TP
  rules across tp ranks;
- gradient accumulation (`no_sync`): DDP's `no_sync` or FSDP2's `set_requires_gradient_sync(False)`, whichever
  engine the model is under, so one loop accumulates micro-batches on either.

Parameters replicated across TP ranks (norms, a row layer's bias) already get the same gradient on every TP rank
under plain TP (their activations are replicated and the column layers' backward all-reduces the input
gradient); averaging over dp keeps them equal, so no extra synchronisation is needed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from .comm.communicator import Communicator
from .comm.rank_groups import split
from .comm.ops import ReduceOp
from .convert.conversion import conversions_in
from .convert.layouts import shard_layouts
from .nn import model_parallel_manual_seed
from .nn.grad_clip import power_sum
from .nn.record import Holder, ModelRecord, attach_record, communicator_of, find_record
from .nn.sentinel import allowing_ddp
from .layout import ShardLayout

MODES = ("fsdp", "ddp")
# Seeds of dp rank d are `seed + d * DP_SEED_OFFSET`: far enough apart that the per-TP-rank streams
# (`seed + 2718 + tp_rank`) of different dp ranks never meet.
DP_SEED_OFFSET = 1_000_003


@dataclasses.dataclass(eq=False)
class DataParallel:
    """What `data_parallel` did, kept in the model's record (`record.data_parallel`; the checkpoint code,
    `clip_grad_norm_` and the replica sentinel read it): the engine, the model whose state_dict keys are the
    original's (DDP's inner module), and the data-parallel communicator. The TP communicator and layouts are the
    record's own."""

    mode: str
    _module: Any = dataclasses.field(repr=False)  # weakrefs: the model holds its record, which holds this
    dp_comm: Communicator
    _record: Any = dataclasses.field(repr=False)
    _roots: tuple = dataclasses.field(default=(), repr=False)  # engines' roots outside `module` (a pipeline's stage
    #                                                          modules), resharded with it

    @classmethod
    def of(cls, mode: str, module: nn.Module, dp_comm: Communicator, record: ModelRecord,
           roots: tuple[nn.Module, ...] = ()) -> "DataParallel":
        return cls(mode, weakref.ref(module), dp_comm, weakref.ref(record), tuple(weakref.ref(r) for r in roots))

    @property
    def roots(self) -> tuple[nn.Module, ...]:
        return tuple(r for r in (w() for w in self._roots) if r is not None)

    @property
    def module(self) -> nn.Module:
        return self._module()

    @property
    def record(self) -> ModelRecord:
        return self._record()

    def __getstate__(self) -> dict:  # copies and pickles refer to the copied model and record
        return {**self.__dict__, "_module": self.module, "_record": self.record, "_roots": self.roots}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _module=weakref.ref(state["_module"]), _record=weakref.ref(state["_record"]),
                             _roots=tuple(weakref.ref(r) for r in state.get("_roots", ())))

    @property
    def tp_comm(self) -> Communicator | None:
        comm = self.record.comm
        return comm if comm is not None and comm.world_size > 1 else None

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_comm is None else self.tp_comm.world_size

    @property
    def dp_size(self) -> int:
        return self.dp_comm.world_size

    @property
    def layouts(self) -> dict[str, ShardLayout]:
        """The TP layout of every state-dict key of `module` (FSDP2 replaced the Parameters; the names stay)."""
        return shard_layouts(self.module)

    def reshard(self) -> None:
        """Put FSDP2 back in its sharded state (a forward under `no_grad` leaves the root unsharded); anything
        that reads parameters by name (save, load, byte counts, the norm) calls this first."""
        from torch.distributed.fsdp import FSDPModule

        for root in (self.module, *self.roots):
            for m in root.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def global_norm(self, params: list[torch.Tensor], held: dict[int, Holder], norm_type: float, root: bool = True):
        """The norm source of `tpkit.clip_grad_norm_` for a model under data parallelism: over both dimensions
        (`root=False`: the sum of |g|^p before the root, for a pipeline to add its stages' sums)."""
        return _record_norm(self, params, held, norm_type, root)


def data_parallel_of(model: nn.Module) -> DataParallel | None:
    """What `data_parallel` keeps for `model` (the wrapper it returned, or the model inside), or None."""
    found = find_record(model, "data_parallel")
    return found[1].data_parallel if found is not None else None


def device_mesh(comm: Communicator, tp_size: int):
    """A 2-D `torch.distributed.DeviceMesh` with dims ("dp", "tp") built on the very process groups that
    `tpkit.comm.split(comm, tp_size)` makes (ranks 0..3, tp 2: tp {0,1} {2,3}, dp {0,2} {1,3}), for torch APIs
    that want a mesh. Collective over `comm` (a torch-backend world communicator)."""
    from torch.distributed.device_mesh import DeviceMesh

    _process_group(comm, "device_mesh", "comm")
    tp_comm, dp_comm = split(comm, tp_size)
    layout = torch.arange(comm.world_size).reshape(comm.world_size // tp_size, tp_size)
    return DeviceMesh.from_group([dp_comm.process_group, tp_comm.process_group], device_type(comm), mesh=layout,
                                 mesh_dim_names=("dp", "tp"))


def data_parallel(model: nn.Module, dp_comm: Communicator, mode: str = "fsdp", *,
                  blocks: Iterable[nn.Module] | None = None, **torch_kwargs: Any) -> nn.Module:
    """Put a (converted) `model` under torch's FSDP2 (`mode="fsdp"`) or DDP (`mode="ddp"`) over `dp_comm`.

    Call after `parallelize(model, comm=tp_comm)` (an unconverted model is plain data parallelism). FSDP2 wraps
    each of `blocks` (default: the model's repeated blocks, HF's `_no_split_modules`) then the root, and
    returns `model` itself; DDP returns the `DistributedDataParallel` wrapper. `torch_kwargs` go to
    `fully_shard` / `DistributedDataParallel`. Gradients are averaged over dp: give each dp rank its share of
    the global batch. Clip with `tpkit.clip_grad_norm_(model.parameters(), ...)` (the global norm over both
    dimensions); save and load with `save_sharded` / `load_sharded` and the world communicator.
    """
    conversion = _check(model, dp_comm, mode)
    found = find_record(model, "data_parallel")
    record = found[1] if found is not None else attach_record(model, ModelRecord(communicator_of(model), {}))
    experts = expert_params(model, record)  # reduced by their own groups
    if mode == "fsdp":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(dp_comm.process_group, device_type(dp_comm))
        if experts and shard_experts(record, torch_kwargs):
            experts = {}
        if experts:  # each held by one rank (no expert-data group): left to their own gradient rule
            torch_kwargs = {**torch_kwargs, "ignored_params": set(experts.values())}
        for block in list(blocks) if blocks is not None else repeated_blocks(model):
            fully_shard(block, mesh=mesh, **torch_kwargs)
        wrapped = fully_shard(model, mesh=mesh, **torch_kwargs)
    else:
        from torch.nn.parallel import DistributedDataParallel

        if experts:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(experts))
        with allowing_ddp():  # over the dp group: a converted model refuses DDP built anywhere else
            wrapped = DistributedDataParallel(model, process_group=dp_comm.process_group, **torch_kwargs)
    record.data_parallel = DataParallel.of(mode, model, dp_comm, record)
    return wrapped


def shard_experts(record: ModelRecord, torch_kwargs: dict[str, Any]) -> bool:
    """FSDP2 over the expert-data group for each experts module of an expert-parallel model (before the blocks
    around them, which then leave their weights alone), its gradients summed over that group and divided by the
    dp size (the expert rule, `tpkit.expert_parallel`: `ExpertParallel.hand_to_fsdp`); False when each expert is
    held by one rank only."""
    experts = record.experts
    if experts is None or experts.edp is None or record.owner is None:
        return False
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(_process_group(experts.edp, "data_parallel", "the expert-data group"),
                                 device_type(experts.edp))
    for module in experts.hand_to_fsdp(record.owner):
        fully_shard(module, mesh=mesh, **torch_kwargs)
    return True


def expert_params(module: nn.Module, record: ModelRecord) -> dict[str, nn.Parameter]:
    """`{name in module: parameter}` of the expert weights of an expert-parallel model (`tpkit.expert_parallel`):
    their gradients are reduced over their own expert-data group, so the engines leave them alone."""
    if record.experts is None:
        return {}
    owner = record.owner
    ids = {id(p) for k, p in owner.named_parameters() if k in record.experts.keys} if owner is not None else set()
    return {k: p for k, p in module.named_parameters() if id(p) in ids}


def data_parallel_manual_seed(seed: int, tp_comm: Communicator, dp_comm: Communicator):
    """Seed every random stream per dimension: torch's default generator `seed + dp_rank * DP_SEED_OFFSET` (the
    same on the TP ranks of a dp rank, so replicated-activation dropout agrees; different across dp ranks, whose
    samples differ) and the TP tracker on top of that (`tpkit.nn.model_parallel_manual_seed`: sharded-activation
    dropout differs on every rank). Returns the tracker of `tp_comm`."""
    return model_parallel_manual_seed(int(seed) + dp_comm.rank * DP_SEED_OFFSET, tp_comm)


@contextlib.contextmanager
def no_sync(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Gradient accumulation over micro-batches: inside, `backward` accumulates this rank's gradients without the
    data-parallel reduction (DDP's `no_sync`; FSDP2's `set_requires_gradient_sync(False)`: unsharded gradients
    accumulate, reduce-scattered by the first backward outside); the last micro-batch runs outside, and its
    backward reduces the sum. TP collectives are part of each backward's math and always run. A model not under
    `data_parallel` needs nothing. `enabled=False` is a no-op, for loops:
    `with tpkit.no_sync(model, enabled=i < n - 1): (loss(mb) / n).backward()`."""
    record = data_parallel_of(model)
    if not enabled or record is None:
        yield
    elif record.mode == "ddp":
        with model.no_sync():
            yield
    else:
        from torch.distributed.fsdp import FSDPModule

        roots = [m for m in (model, record.module) if isinstance(m, FSDPModule)][:1]
        for m in roots:
            m.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for m in roots:
                m.set_requires_gradient_sync(True)


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of parameters (and optimizer state) this rank holds: FSDP2 shards counted by their local part,
    after resharding (a forward under `no_grad` leaves the root's parameters whole)."""
    record = data_parallel_of(model)
    if record is not None:
        record.reshard()
    tensors = list(model.parameters())
    if optimizer is not None:
        tensors += [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(_local(t).numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------------------------------------
# Checks and defaults.

def _process_group(comm: Any, where: str, what: str):
    group = getattr(comm, "process_group", None)
    if group is None:
        raise TypeError(f"{where}: {what} must be a torch-backend communicator (it wraps a torch.distributed process "
                        f"group, as tpkit.init() and tpkit.comm.split of it give); got {type(comm).__name__}. "
                        f"torch's FSDP2 and DDP run on process groups, not on the threads or mpi backends")
    return group


def device_type(comm: Communicator) -> str:
    """The device type of `comm`'s tensors: "cuda" under nccl, else "cpu"."""
    return "cuda" if getattr(comm, "torch_backend", "gloo") == "nccl" else "cpu"


def _check(model: nn.Module, dp_comm: Communicator, mode: str):
    if mode not in MODES:
        raise ValueError(f"data_parallel: mode {mode!r} is not one of {MODES}")
    _process_group(dp_comm, "data_parallel", "dp_comm")
    if data_parallel_of(model) is not None:
        raise ValueError("data_parallel: the model is already under data parallelism; wrap the converted model once")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("data_parallel: the model is a DistributedDataParallel wrapper already; pass the model")
    found = conversions_in(model)
    return found[0][1] if found else None


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, the units FSDP2 gathers one at a time (and `recompute` checkpoints): the
    modules of HF's `_no_split_modules` classes, else the children of the model's longest ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


# ---------------------------------------------------------------------------------------------------------
# The global gradient norm over both dimensions (a norm source of tpkit.nn.clip_grad_norm_).

def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _dp_start(p: torch.Tensor, dim: int, local: torch.Tensor) -> int:
    """Where this rank's FSDP2 shard starts along `dim` of the TP-local tensor (torch.chunk's rule), or 0."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor) or not any(isinstance(pl, Shard) and pl.dim == dim for pl in p.placements):
        return 0
    n, parts = p.shape[dim], p.device_mesh.size()
    step = math.ceil(n / parts)
    start = min(p.device_mesh.get_local_rank() * step, n)
    assert local.shape[dim] == max(0, min(step, n - start)), "FSDP2 shard is not torch.chunk's"
    return start


def _replicas(lay: ShardLayout | None, p: torch.Tensor, local: torch.Tensor) -> tuple[tuple[int, ...] | None, int]:
    """`(ranks holding each entry of local along the split dim, that dim)` when some TP slice is held by several
    ranks (KV heads replicated); `(None, 0)` when every entry is held once."""
    if lay is None or lay.dim is None or lay.is_replicated:
        return None, 0
    reps = lay.replicas()
    if max(reps, default=1) == 1:
        return None, 0
    dim = (1 - lay.dim) if lay.transposed else lay.dim
    start = _dp_start(p, dim, local)
    return reps[start:start + local.shape[dim]], dim


@torch.no_grad()
def _record_norm(record: DataParallel, params: list[torch.Tensor], held: dict[int, Holder], norm_type: float,
                 root: bool = True):
    grads = [(p, _local(p.grad)) for p in params if p.grad is not None]
    dtype = torch.float64 if any(g.dtype == torch.float64 for _, g in grads) else torch.float32
    split_items, replicated = [], []
    for p, g in grads:
        h = held.get(id(p))
        lay = h.layout(p) if h is not None else None
        if lay is None and h is not None and h.dim is not None:  # a layer built by hand, split along `dim`
            split_items.append((g, None, h.dim))
            continue
        held_once = lay is None or lay.dim is None or lay.is_replicated
        (replicated if held_once else split_items).append((g, *_replicas(lay, p, g)))
    op = ReduceOp.MAX if norm_type == math.inf else ReduceOp.SUM
    cpu = torch.device("cpu")
    total = power_sum(split_items, norm_type, dtype, cpu)
    if record.tp_comm is not None:
        total = record.tp_comm.all_reduce(total, op)
    mine = power_sum(replicated, norm_type, dtype, cpu)
    total = torch.maximum(total, mine) if op is ReduceOp.MAX else total + mine
    if record.mode == "fsdp":  # dp shards hold disjoint parts; under DDP every dp rank holds the same gradients
        total = record.dp_comm.all_reduce(total, op)
    if op is not ReduceOp.MAX and root:
        total = total.pow(1.0 / norm_type)
    device = grads[0][1].device if grads else torch.device("cpu")
    return total.to(device), [g for _, g in grads]
