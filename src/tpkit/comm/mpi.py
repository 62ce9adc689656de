"""The `mpi` backend: a `Communicator` over an mpi4py communicator, for CPU tensors under `mpirun`.

Why a second route to MPI when torch can be built with one: stock torch wheels are not, and mpi4py works
with whatever MPI the cluster has. Everything goes through non-blocking MPI calls polled against a
deadline, so a peer that never arrives turns into `CommError` (naming the operation and the group) after
`timeout` seconds instead of a hang. An operation abandoned that way keeps its buffers alive: MPI may still
write into them later.

Reductions use MPI's own operators for the dtypes numpy and MPI share (float32/64, integers, complex).
bfloat16, float16 and bool have no MPI type, so their bytes are all-gathered and reduced locally in rank
order, which gives every rank bitwise the same result, as on the `threads` backend. AVG is a SUM followed
by a division (truncating for integers). all_to_all is one `Ialltoallv` of bytes, laid out by `all_to_all.py`.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from .communicator import Communicator, group_name
from .errors import CommError
from .handle import Handle
from .ops import ReduceOp, divide_by_count, reduce_tensors
from . import all_to_all as a2a
from .signatures import SIGNATURE_LENGTH, all_to_all_check, describe_signature, dtype_of_code, sent_shape, signature

DEFAULT_TIMEOUT = 1800.0
# dtypes whose numpy view maps to an MPI datatype that MPI's reduction operators accept
_MPI_REDUCIBLE = {torch.float32, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                  torch.complex64, torch.complex128}
_TAG = 7


def _import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError("the 'mpi' backend needs mpi4py and an MPI library: apt-get install openmpi-bin "
                          "libopenmpi-dev && pip install mpi4py (or pip install 'tpkit[mpi]')") from exc
    return MPI


def _bytes(tensor: torch.Tensor):
    """A writable 1-D uint8 numpy view of a contiguous CPU tensor's memory (any dtype, bfloat16 included)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


class MPICommunicator(Communicator):
    """One rank of an MPI communicator (`MPI.COMM_WORLD` unless `comm` is given); CPU tensors only."""

    backend = "mpi"

    def __init__(self, comm: Any = None, timeout: float | None = None, name: str | None = None,
                 owns_comm: bool = False):
        MPI = _import_mpi()
        comm = MPI.COMM_WORLD if comm is None else comm
        if comm == MPI.COMM_NULL:
            raise ValueError("MPICommunicator: comm is MPI.COMM_NULL, i.e. this process is not a member of that "
                             "group; only members can make a communicator for it")
        world = MPI.COMM_WORLD
        self._global_ranks = [int(r) for r in MPI.Group.Translate_ranks(
            comm.Get_group(), list(range(comm.Get_size())), world.Get_group())]
        super().__init__(comm.Get_rank(), comm.Get_size(), name or group_name(self._global_ranks, world.Get_size()),
                         DEFAULT_TIMEOUT if timeout is None else timeout)
        self._MPI = MPI
        self._comm = comm
        self._abandoned: list[tuple[Any, tuple]] = []
        self._owns_comm = owns_comm  # made by new_group: freed on close (COMM_WORLD and the caller's are not)

    @property
    def mpi_comm(self):
        """The underlying mpi4py communicator."""
        return self._comm

    # -- waiting with a deadline ------------------------------------------------------------------
    def _wait(self, request, op: str, keep: tuple, status=None) -> None:
        """Poll `request` until it completes; after `timeout` seconds raise `CommError` (keeping `keep`,
        the operation's buffers, alive for MPI)."""
        self._reap()
        if request.Test(status):
            return
        deadline = time.monotonic() + self._timeout
        polls = 0
        while not request.Test(status):
            if time.monotonic() > deadline:
                self._abandoned.append((request, keep))
                raise CommError(f"{op} on rank {self._rank} of group {self._name} (world size {self._world_size}) "
                                f"timed out after {self._timeout:g}s: a peer never arrived or died")
            polls += 1
            # Each Test() also drives MPI's progress engine, so poll eagerly at first for low latency, then
            # back off (to 0.5 ms) so peers sharing the cores can run.
            time.sleep(0 if polls < 50 else min(5e-4, 1e-5 * (polls - 50)))

    def _reap(self) -> None:
        """Forget abandoned operations that have completed after all."""
        if self._abandoned:
            self._abandoned = [(r, k) for r, k in self._abandoned if not r.Test()]

    def _handle(self, request, op: str, keep: tuple, finish: Callable[[], torch.Tensor]) -> Handle:
        def wait() -> torch.Tensor:
            self._wait(request, op, keep)
            return finish()
        return Handle(wait, request.Test)

    def _cpu(self, op: str, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(f"{op}: the mpi backend moves CPU tensors, got a tensor on {tensor.device}; "
                             f"use the torch backend (nccl) for GPU tensors or call .cpu() first")

    def _gather_signatures(self, mine: list[int]) -> list[list[int]]:
        sig = torch.tensor(mine, dtype=torch.int64)
        every = torch.empty(self._world_size, sig.numel(), dtype=torch.int64)
        self._wait(self._comm.Iallgather(sig.numpy(), every.numpy()), "signature check", (sig, every))
        return every.tolist()

    def _gather_all(self, tensor: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Start an all-gather of whole tensors into a (world_size, *shape) tensor."""
        every = torch.empty((self._world_size,) + tuple(tensor.shape), dtype=tensor.dtype)
        return self._comm.Iallgather(_bytes(tensor), _bytes(every)), every

    def _mpi_op(self, op: ReduceOp):
        MPI = self._MPI
        return {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD,
                ReduceOp.MAX: MPI.MAX, ReduceOp.MIN: MPI.MIN}[op]

    # -- primitives -------------------------------------------------------------------------------
    def _all_reduce(self, tensor, op, async_op):
        self._cpu("all_reduce", tensor)
        self._check_peers("all_reduce", tensor, reduce_op=op)
        src = tensor.detach()
        if src.dtype in _MPI_REDUCIBLE:
            out = torch.empty_like(src)
            request = self._comm.Iallreduce(src.numpy(), out.numpy(), self._mpi_op(op))
            finish = (lambda: divide_by_count(out, self._world_size)) if op is ReduceOp.AVG else (lambda: out)
            return self._handle(request, "all_reduce", (src, out), finish)
        request, every = self._gather_all(src)
        return self._handle(request, "all_reduce", (src, every), lambda: reduce_tensors(list(every.unbind(0)), op))

    def _all_gather(self, tensor, dim, sizes, async_op):
        self._cpu("all_gather", tensor)
        self._check_peers("all_gather", tensor, dim=dim, sizes=sizes)
        moved = tensor.detach() if dim == 0 else tensor.detach().movedim(dim, 0).contiguous()
        rest = tuple(moved.shape[1:])
        counts = [moved.shape[0]] * self._world_size if sizes is None else list(sizes)
        out = moved.new_empty((sum(counts),) + rest)
        row_bytes = moved[:1].numel() * moved.element_size() if moved.shape[0] else out[:1].numel() * out.element_size()
        if sizes is None:
            request = self._comm.Iallgather(_bytes(moved), _bytes(out))
        else:
            byte_counts = [c * row_bytes for c in counts]
            displs = [sum(byte_counts[:r]) for r in range(self._world_size)]
            request = self._comm.Iallgatherv(_bytes(moved), [_bytes(out), byte_counts, displs, self._MPI.BYTE])
        finish = (lambda: out) if dim == 0 else (lambda: out.movedim(0, dim).contiguous())
        return self._handle(request, "all_gather", (moved, out), finish)

    def _all_to_all(self, tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes, async_op):
        self._cpu("all_to_all", tensor)
        if self._debug:
            all_to_all_check(self._name, self._gather_signatures, tensor, scatter_dim, gather_dim, scatter_sizes,
                             gather_sizes)
        shape, me, itemsize = tensor.shape, self._rank, tensor.element_size()
        packed = a2a.pack(tensor, scatter_dim)
        send = [c * itemsize for c in a2a.send_counts(shape, scatter_dim, scatter_sizes)]
        recv = [c * itemsize for c in a2a.recv_counts(shape, scatter_dim, gather_dim, scatter_sizes, gather_sizes, me)]
        flat = packed.new_empty(sum(recv) // itemsize)  # allocated flat: the pieces arrive in order
        byte = self._MPI.BYTE
        request = self._comm.Ialltoallv([_bytes(packed), send, a2a.offsets(send)[:-1], byte],
                                        [_bytes(flat), recv, a2a.offsets(recv)[:-1], byte])
        return self._handle(request, "all_to_all", (packed, flat), lambda: a2a.unpack(
            flat, shape, scatter_dim, gather_dim, scatter_sizes, gather_sizes, me))

    def _reduce_scatter(self, tensor, op, dim, sizes, async_op):
        self._cpu("reduce_scatter", tensor)
        self._check_peers("reduce_scatter", tensor, dim=dim, reduce_op=op, sizes=sizes)
        moved = tensor.detach() if dim == 0 else tensor.detach().movedim(dim, 0).contiguous()
        mine, start = sizes[self._rank], sum(sizes[:self._rank])

        def place(piece: torch.Tensor) -> torch.Tensor:
            return piece if dim == 0 else piece.movedim(0, dim).contiguous()

        if moved.dtype in _MPI_REDUCIBLE:
            row = moved[:1].numel() if moved.shape[0] else 0
            out = moved.new_empty((mine,) + tuple(moved.shape[1:]))
            request = self._comm.Ireduce_scatter(moved.numpy().reshape(-1), out.numpy().reshape(-1),
                                                 [s * row for s in sizes], self._mpi_op(op))
            if op is ReduceOp.AVG:
                return self._handle(request, "reduce_scatter", (moved, out),
                                    lambda: place(divide_by_count(out, self._world_size)))
            return self._handle(request, "reduce_scatter", (moved, out), lambda: place(out))
        request, every = self._gather_all(moved)
        return self._handle(request, "reduce_scatter", (moved, every),
                            lambda: place(reduce_tensors([t.narrow(0, start, mine) for t in every.unbind(0)], op)))

    def _broadcast(self, tensor, src, async_op):
        self._cpu("broadcast", tensor)
        self._check_peers("broadcast", tensor, src=src)
        out = tensor.detach().clone() if self._rank == src else torch.empty_like(tensor)
        request = self._comm.Ibcast(_bytes(out), root=src)
        return self._handle(request, "broadcast", (out,), lambda: out)

    def _barrier(self):
        self._wait(self._comm.Ibarrier(), "barrier", ())

    def _barrier_async(self):
        return self._handle(self._comm.Ibarrier(), "barrier", (), lambda: None)

    def _send(self, tensor, dst):
        self._cpu("send", tensor)
        data = tensor.detach()
        if self._debug:  # announce shape and dtype so the receiver can check before taking the data
            header = torch.tensor(signature("send", data), dtype=torch.int64)
            self._wait(self._comm.Isend(header.numpy(), dest=dst, tag=_TAG), "send", (header,))
        self._wait(self._comm.Isend(_bytes(data), dest=dst, tag=_TAG), "send", (data,))

    def _recv(self, tensor, src):
        self._cpu("recv", tensor)
        copy_back = not tensor.is_contiguous()
        buf = torch.empty_like(tensor, memory_format=torch.contiguous_format) if copy_back else tensor.detach()
        if self._debug:
            header = torch.empty(SIGNATURE_LENGTH, dtype=torch.int64)
            self._wait(self._comm.Irecv(header.numpy(), source=src, tag=_TAG), "recv", (header,))
            sent, expected = header.tolist(), signature("send", tensor)
            if sent != expected:
                dtype, shape = dtype_of_code(sent[1]), sent_shape(sent)
                if dtype is not None and shape is not None:  # take the message so the sender is not left blocked
                    scratch = torch.empty(shape, dtype=dtype)
                    self._wait(self._comm.Irecv(_bytes(scratch), source=src, tag=_TAG), "recv", (scratch,))
                raise CommError(f"recv: rank {src} of group {self._name} sent {describe_signature(sent, False)} but "
                                f"rank {self._rank} expects {describe_signature(expected, False)}")
        status = self._MPI.Status()
        self._wait(self._comm.Irecv(_bytes(buf), source=src, tag=_TAG), "recv", (buf,), status)
        got, want = status.Get_count(self._MPI.BYTE), buf.numel() * buf.element_size()
        if got != want:
            raise CommError(f"recv: rank {src} of group {self._name} sent {got} bytes but rank {self._rank} expects "
                            f"{want} (shape {tuple(tensor.shape)} {tensor.dtype})")
        if copy_back:
            with torch.no_grad():
                tensor.copy_(buf)
        return tensor

    def _new_group(self, members):
        color = 0 if self._rank in members else self._MPI.UNDEFINED
        sub = self._comm.Split(color, key=self._rank)  # collective and blocking: MPI has no deadline for it
        if sub == self._MPI.COMM_NULL:
            return None
        return MPICommunicator(sub, self._timeout, owns_comm=True)

    def _close(self):
        self._reap()
        if self._owns_comm:
            self._comm.Free()  # collective in MPI: every member closes its communicator
