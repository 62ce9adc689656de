"""The `torch` backend: a `Communicator` over a `torch.distributed` process group (nccl, gloo or mpi).

It adds nothing on the hot path but what the contract needs: a copy of the input for all_reduce (so the
input is never modified), a `movedim` for `dim != 0`, and padding for uneven shards; all_to_all is one
`all_to_all_single` of flat pieces laid out by `all_to_all.py`. Operations a
backend lacks are composed: gloo has no AVG on integers, so it sums and divides. Under `TP_DEBUG=1` every
collective, send and recv first compares the ranks' shapes, dtypes and arguments and raises `CommError` on
a mismatch instead of corrupting memory or hanging.
"""
from __future__ import annotations

import datetime
from typing import Callable

import torch
import torch.distributed as dist

from .communicator import Communicator, group_name
from .errors import CommError
from .handle import Handle
from .ops import ReduceOp, divide_by_count
from . import all_to_all as a2a, shm
from .signatures import SIGNATURE_LENGTH, all_to_all_check, describe_signature, dtype_of_code, sent_shape, signature

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}
# The non-deprecated names where torch has them (no FutureWarning on every call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# all_reduce must not modify its input, so it reduces a copy. On CPU that copy is a pass over memory as
# costly as a good part of the reduction itself; for big tensors it is made piece by piece, each piece
# reduced (async) while the next is copied, which hides the copy behind the communication.
PIPELINE_MIN_BYTES = 8 << 20
PIPELINE_PIECE_BYTES = 4 << 20
# Subgroups made by members only (use_local_synchronization) are named by their ranks in torch; asking for
# the same ranks twice must reuse the group rather than collide. Each entry counts the open communicators on
# it, and the last one to close destroys it.
_LOCAL_GROUPS: dict[tuple[int, ...], list] = {}  # global ranks -> [group, open communicators]


class TorchCommunicator(Communicator):
    """One rank of a `torch.distributed` process group (the default world group unless `group` is given)."""

    backend = "torch"

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: float | None = None, name: str | None = None,
                 owns_group: bool = False):
        if not dist.is_initialized():
            raise CommError("torch.distributed is not initialised; call tpkit.init() (or "
                            "torch.distributed.init_process_group) first")
        self._group = group if group is not None else dist.group.WORLD
        self._global_ranks = dist.get_process_group_ranks(self._group)
        rank = dist.get_rank(self._group)
        if rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the process group "
                             f"of ranks {self._global_ranks}; only members can make a communicator for it")
        self._pg_backend = dist.get_backend(self._group)
        super().__init__(rank, len(self._global_ranks),
                         name or group_name(self._global_ranks, dist.get_world_size()),
                         timeout if timeout is not None else 1800.0)
        self._native_avg = self._pg_backend == "nccl"
        # Small synchronous CPU collectives between processes of one host go through shared memory (shm.py);
        # set up lazily by the first one (a collective, so every rank gets there together). None: not yet
        # known; False: not possible. Compiled graphs use functional collectives only when it cannot be on.
        self._shm = None if (shm.enabled() and self._pg_backend == "gloo" and self._world_size > 1) else False
        self.__dict__["_functional_group"] = self._group.group_name if self._shm is False else None
        # Groups made by new_group belong to their communicators (destroyed on close); the world and groups
        # the caller passed in belong to whoever made them.
        self._owns_group = owns_group and self._group is not dist.group.WORLD

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The underlying torch process group, for code that calls torch.distributed directly."""
        return self._group

    @property
    def torch_backend(self) -> str:
        """`nccl`, `gloo` or `mpi`."""
        return self._pg_backend

    def _scratch_device(self) -> torch.device:
        if self._pg_backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- helpers ----------------------------------------------------------------------------------
    @staticmethod
    def _handle(work, finish: Callable[[], torch.Tensor]) -> Handle:
        """`work` is None when the call was synchronous (no hand-off to gloo's worker thread): done already."""
        if work is None:
            return Handle.completed(finish())

        def wait() -> torch.Tensor:
            work.wait()
            return finish()
        return Handle(wait, work.is_completed)

    @staticmethod
    def _handle_all(works: list, finish: Callable[[], torch.Tensor]) -> Handle:
        def wait() -> torch.Tensor:
            for work in works:
                work.wait()
            return finish()
        return Handle(wait, lambda: all(work.is_completed() for work in works))

    def _copy_and_reduce_in_pieces(self, src: torch.Tensor, torch_op) -> tuple[torch.Tensor, list]:
        """`src` copied into a new tensor that is all-reduced in pieces, each started as soon as it is copied."""
        out = torch.empty_like(src, memory_format=torch.contiguous_format)
        flat_src, flat_out = src.reshape(-1), out.view(-1)
        step = max(1, PIPELINE_PIECE_BYTES // src.element_size())
        works = []
        for start in range(0, flat_src.numel(), step):
            piece = flat_out[start:start + step]
            piece.copy_(flat_src[start:start + step])
            works.append(dist.all_reduce(piece, torch_op, group=self._group, async_op=True))
        return out, works

    def _gather_signatures(self, mine: list[int]) -> list[list[int]]:
        sig = torch.tensor(mine, dtype=torch.int64, device=self._scratch_device())
        every = torch.empty(self._world_size * sig.numel(), dtype=torch.int64, device=sig.device)
        _all_gather_single(every, sig, group=self._group)
        return every.view(self._world_size, -1).tolist()

    def _channel(self):
        """The shared-memory channel, connected by the first call that may use it (a collective, so every rank
        gets there together); None when it cannot be on."""
        if self._shm is None:
            self._shm = shm.connect(self._group, self._rank, self._world_size, self._timeout, self._name) or False
        return self._shm or None

    def _shm_channel(self, tensor: torch.Tensor, async_op: bool):
        """The shared-memory channel when this call may use it (small, synchronous, CPU, not TP_DEBUG)."""
        if self._shm is False or async_op or self._debug or not tensor.is_cpu or tensor.nbytes > shm.SLOT_BYTES:
            return None
        return self._channel()

    @property
    def shared_memory(self) -> bool:
        """Whether small collectives of this group go through shared memory (known after the first one)."""
        return bool(self._shm)

    # -- primitives -------------------------------------------------------------------------------
    def _all_reduce_(self, tensor, op):
        if self._debug:
            self._check_peers("all_reduce", tensor, reduce_op=op)
        channel = self._shm_channel(tensor, False)
        if channel is not None and tensor.is_contiguous():
            return channel.all_reduce(tensor, op, out=tensor)
        native = op is not ReduceOp.AVG or (self._native_avg and tensor.is_floating_point())
        if not tensor.is_contiguous() or not native:
            return super()._all_reduce_(tensor, op)
        torch_op = dist.ReduceOp.AVG if op is ReduceOp.AVG else _TORCH_OPS[op]
        dist.all_reduce(tensor.detach(), torch_op, group=self._group)
        return tensor

    def _all_reduce_now(self, tensor, op):
        # The small synchronous all-reduce of decoding: straight to shared memory once it is connected.
        channel = self._shm
        if channel and not self._debug and tensor.is_cpu and tensor.nbytes <= shm.SLOT_BYTES:
            return channel.all_reduce(tensor, op)
        return self._all_reduce(tensor, op, False).wait()

    def _all_reduce(self, tensor, op, async_op):
        if self._debug:
            self._check_peers("all_reduce", tensor, reduce_op=op)
        channel = self._shm_channel(tensor, async_op)
        if channel is not None:
            return Handle.completed(channel.all_reduce(tensor, op))
        src = tensor.detach()
        native = op is not ReduceOp.AVG or (self._native_avg and src.is_floating_point())
        torch_op = dist.ReduceOp.AVG if op is ReduceOp.AVG and native else _TORCH_OPS.get(op, dist.ReduceOp.SUM)
        finish = (lambda: out) if native else (lambda: divide_by_count(out, self._world_size))
        if src.device.type == "cpu" and src.numel() * src.element_size() >= PIPELINE_MIN_BYTES:
            out, works = self._copy_and_reduce_in_pieces(src, torch_op)
            return self._handle_all(works, finish)
        out = src.clone()
        return self._handle(dist.all_reduce(out, torch_op, group=self._group, async_op=async_op), finish)

    def _all_gather(self, tensor, dim, sizes, async_op):
        if self._debug:
            self._check_peers("all_gather", tensor, dim=dim, sizes=sizes)
        if sizes is None or len(set(sizes)) == 1:
            channel = self._shm_channel(tensor, async_op)
            if channel is not None:
                return Handle.completed(channel.all_gather(tensor.detach(), dim))
        moved = tensor.detach() if dim == 0 else tensor.detach().movedim(dim, 0).contiguous()
        n = self._world_size
        longest = moved.shape[0] if sizes is None else max(sizes)
        if moved.shape[0] < longest:
            padded = moved.new_zeros((longest,) + tuple(moved.shape[1:]))
            padded[: moved.shape[0]] = moved
            moved = padded
        out = moved.new_empty((n * longest,) + tuple(moved.shape[1:]))
        work = _all_gather_single(out, moved, group=self._group, async_op=async_op)

        def finish() -> torch.Tensor:
            full = out
            if sizes is not None and any(s != longest for s in sizes):
                full = torch.cat([out.narrow(0, r * longest, s) for r, s in enumerate(sizes)], dim=0)
            return full if dim == 0 else full.movedim(0, dim).contiguous()
        return self._handle(work, finish)

    def _all_to_all(self, tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes, async_op):
        if self._debug:
            all_to_all_check(self._name, self._gather_signatures, tensor, scatter_dim, gather_dim, scatter_sizes,
                             gather_sizes)
        shape, me = tensor.shape, self._rank
        packed = a2a.pack(tensor, scatter_dim)
        send = a2a.send_counts(shape, scatter_dim, scatter_sizes)
        recv = a2a.recv_counts(shape, scatter_dim, gather_dim, scatter_sizes, gather_sizes, me)
        # Shared memory whatever the size (the ranks' sizes differ, so only the channel can tell every rank
        # alike whether all of them fit); None from it on every rank when some rank's does not.
        channel = None if self._shm is False or async_op or self._debug or not tensor.is_cpu else self._channel()
        flat = None
        if channel is not None:
            flat = channel.all_to_all(packed, a2a.offsets(send), recv)
        if flat is not None:
            return Handle.completed(a2a.unpack(flat, shape, scatter_dim, gather_dim, scatter_sizes, gather_sizes, me))
        flat = packed.new_empty(sum(recv))  # allocated flat: the pieces arrive in order
        work = dist.all_to_all_single(flat, packed, recv, send, group=self._group, async_op=async_op)
        return self._handle(work, lambda: a2a.unpack(flat, shape, scatter_dim, gather_dim, scatter_sizes,
                                                     gather_sizes, me))

    def _reduce_scatter(self, tensor, op, dim, sizes, async_op):
        if self._debug:
            self._check_peers("reduce_scatter", tensor, dim=dim, reduce_op=op, sizes=sizes)
        moved = tensor.detach() if dim == 0 else tensor.detach().movedim(dim, 0).contiguous()
        n = self._world_size
        longest = max(sizes)
        if any(s != longest for s in sizes):
            padded = moved.new_zeros((n * longest,) + tuple(moved.shape[1:]))
            start = 0
            for r, s in enumerate(sizes):
                padded[r * longest: r * longest + s] = moved[start: start + s]
                start += s
            moved = padded
        out = moved.new_empty((longest,) + tuple(moved.shape[1:]))
        native = op is not ReduceOp.AVG or (self._native_avg and out.is_floating_point())
        torch_op = dist.ReduceOp.AVG if op is ReduceOp.AVG and native else _TORCH_OPS.get(op, dist.ReduceOp.SUM)
        work = _reduce_scatter_single(out, moved, op=torch_op, group=self._group, async_op=async_op)
        mine = sizes[self._rank]

        def finish() -> torch.Tensor:
            piece = out if mine == longest else out.narrow(0, 0, mine)
            if not native:
                piece = divide_by_count(piece, n)
            return piece if dim == 0 else piece.movedim(0, dim).contiguous()
        return self._handle(work, finish)

    def _broadcast(self, tensor, src, async_op):
        if self._debug:
            self._check_peers("broadcast", tensor, src=src)
        out = tensor.detach().clone() if self._rank == src else torch.empty_like(tensor)
        work = dist.broadcast(out, self._global_ranks[src], group=self._group, async_op=async_op)
        return self._handle(work, lambda: out)

    def _barrier(self):
        channel = None if self._shm is False or self._debug else self._channel()
        if channel is not None:  # microseconds instead of a gloo round trip
            channel.barrier()
            return
        token = torch.zeros(1, dtype=torch.float32, device=self._scratch_device())
        dist.all_reduce(token, group=self._group)

    def _barrier_async(self):
        token = torch.zeros(1, dtype=torch.float32, device=self._scratch_device())
        return self._handle(dist.all_reduce(token, group=self._group, async_op=True), lambda: None)

    def _send(self, tensor, dst):
        peer = self._global_ranks[dst]
        if self._debug:  # announce shape and dtype so the receiver can check before taking the data
            header = torch.tensor(signature("send", tensor), dtype=torch.int64, device=self._scratch_device())
            dist.send(header, peer, group=self._group)
        dist.send(tensor.detach(), peer, group=self._group)

    def _recv(self, tensor, src):
        peer = self._global_ranks[src]
        buf = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        if self._debug:
            header = torch.empty(SIGNATURE_LENGTH, dtype=torch.int64, device=self._scratch_device())
            dist.recv(header, peer, group=self._group)
            sent, expected = header.tolist(), signature("send", tensor)
            if sent != expected:
                self._drain_mismatched(sent, peer)
                raise CommError(f"recv: rank {src} of group {self._name} sent {describe_signature(sent, False)} but rank "
                                f"{self._rank} expects {describe_signature(expected, False)}")
        dist.recv(buf.detach(), peer, group=self._group)
        if buf is not tensor:
            with torch.no_grad():
                tensor.copy_(buf)
        return tensor

    def _drain_mismatched(self, sent: list[int], peer: int) -> None:
        """Take the mismatched message anyway, so the sender is not left blocked and the channel stays usable."""
        dtype, shape = dtype_of_code(sent[1]), sent_shape(sent)
        if dtype is not None and shape is not None:
            dist.recv(torch.empty(shape, dtype=dtype, device=self._scratch_device()), peer, group=self._group)

    def _new_group(self, members):
        global_members = [self._global_ranks[m] for m in members]
        timeout = datetime.timedelta(seconds=self._timeout)
        if self._group is dist.group.WORLD:
            # Every process of the world calls this, in the same order: torch's ordinary collective creation.
            group = dist.new_group(global_members, timeout=timeout, backend=self._pg_backend)
            if self._rank not in members:
                return None
            return TorchCommunicator(group, self._timeout, owns_group=True)
        # Only this subgroup's processes call this; the rest of the world must not be waited for.
        if self._rank not in members:
            return None
        key = tuple(global_members)
        entry = _LOCAL_GROUPS.get(key)
        if entry is None:
            entry = _LOCAL_GROUPS[key] = [dist.new_group(global_members, timeout=timeout, backend=self._pg_backend,
                                                         use_local_synchronization=True), 0]
        comm = TorchCommunicator(entry[0], self._timeout)
        comm._local_key = key
        entry[1] += 1
        return comm

    def _close(self):
        if self._shm:
            self._shm.close()
        self._shm = False
        key = self.__dict__.pop("_local_key", None)
        if key is not None:  # a shared member-made subgroup: the last communicator on it destroys it
            entry = _LOCAL_GROUPS[key]
            entry[1] -= 1
            if entry[1] == 0:
                del _LOCAL_GROUPS[key]
                dist.destroy_process_group(entry[0])
        elif self._owns_group:
            dist.destroy_process_group(self._group)
