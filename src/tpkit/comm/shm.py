"""Shared-memory transport for small collectives between processes of one host.

A torch (gloo) collective of a few KiB costs a millisecond here: sockets, gloo's worker thread, wake-ups. For
the all-reduces of decoding (one token's activations) that is the whole step time. Ranks on one host can
instead meet in one `/dev/shm` segment per communicator:

    flags   one 64-byte line per rank: `arrived` (the call number whose data this rank has written) and
            `done` (the call number this rank has finished reading)
    slots   two banks (even / odd call numbers) of one `SLOT_BYTES` slot per rank

Call `k`: a rank waits until every rank is done with call `k - 2` (the last user of this bank), copies its
tensor into its slot, publishes `arrived = k`, spin-waits until every rank has arrived, reduces all slots in
rank order (so every rank gets bitwise the same result) into its output, and publishes `done = k`. x86 keeps
stores in order, so data written before the flag is visible once the flag is.

`connect(group, ...)` sets it up (collective over the torch group: one all-gather of hostnames, then the
segment is created by rank 0, mapped by all, and unlinked right after every rank has attached, so a crash
leaves nothing behind; `atexit` unlinks too if setup dies half-way). `TorchCommunicator` uses it for
synchronous CPU all_reduce / all_gather of at most `SLOT_BYTES` when every rank of its group is on this host,
and for synchronous CPU all_to_all (whose slots carry a header: the ranks' sizes differ, so the header also
says whether every rank's data fit, and all ranks fall back to gloo together when one did not);
`TPKIT_SHM=0` turns it off; its barrier goes through the segment too. A rank that never arrives raises
`CommError` after the communicator's timeout, and a peer process that died raises it within a second.

A SUM of float32, float64 or bf16, and the barrier, run the whole call in C (`shm_reduce.c`, compiled like tpkit's
products by `quant.native`; `TPKIT_NATIVE=0` keeps them in Python): the same steps, without the ~1 us of torch
calls and bytecode between them (a 4 KiB all-reduce between two processes: 5.0 -> 4.1 us, BENCHMARKS.md). Its sums
are torch's bit for bit but for a NaN's bits (a bf16 NaN is 0x7FC0 here, as torch's scalar conversion writes it;
torch's vector loop writes 0xFFFF): every rank running the same steps gets the same bits either way.
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import mmap
import os
import secrets
import socket
import threading
import time

import torch
from torch.autograd.graph import increment_version

from ..quant import native
from .errors import CommError
from .ops import ReduceOp, reduce_tensors

SLOT_BYTES = 1 << 20
# A waiting rank gives its core away (sched_yield) every 4 spins (~0.4 us of Python). When the scheduler puts
# two ranks on one core, which a busy machine does, the rank that waits must let the other one run before
# anything can happen: yielding every 256 spins cost ~20 us per wait there (a 4 KiB all-reduce took ~46 us
# instead of ~7). With a core each, a yield with nothing else to run returns at once, so frequent yields
# cost nothing measurable there (bench/shm_allreduce.py --placement split / shared, BENCHMARKS.md).
_YIELD_MASK = 3
_LINE = 64                      # bytes of flags per rank (one cache line)
_FLAGS_BYTES = 64 * _LINE       # room for 64 ranks
_Q = _LINE // 8                 # int64 words per line
_DIR = "/dev/shm"
_CREATED: set[str] = set()      # paths this process created and has not unlinked yet
# The compiled all-reduce: its source, the dtypes it sums (its codes), and the spins a wait takes in C before
# handing the wait to Python's loop, which yields more often and knows the timeout (~0.3 ms).
_REDUCE_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shm_reduce.c")
_REDUCE_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}
_REDUCE_SPINS = 4096
_REDUCE: list = []              # [ctypes function or None], once tried
_REDUCE_LOCK = threading.Lock()


def enabled() -> bool:
    return os.environ.get("TPKIT_SHM", "1").strip().lower() not in ("0", "false", "no", "off")


def _cleanup() -> None:
    for path in list(_CREATED):
        try:
            os.unlink(path)
        except OSError:
            pass
        _CREATED.discard(path)


atexit.register(_cleanup)


def _compiled_reduce():
    """`tp_shm_all_reduce` from `shm_reduce.c`, or None where nothing compiles (or `TPKIT_NATIVE=0`)."""
    if not _REDUCE:
        with _REDUCE_LOCK:
            if not _REDUCE:
                try:
                    lib = native.compile_library(_REDUCE_SOURCE, native.ISA_FLAGS[native.isa()]) \
                        if native.wanted() else None
                    fn = None if lib is None else lib.tp_shm_all_reduce
                except Exception:  # noqa: BLE001 - no compiled sum (a bad TPKIT_NATIVE_ISA, ...): Python's steps
                    fn = None
                if fn is not None:
                    i64, ptr = ctypes.c_int64, ctypes.c_void_p
                    fn.argtypes = [ptr, i64, ptr, ptr, i64, ctypes.c_int, ctypes.c_int]
                    fn.restype = ctypes.c_int
                _REDUCE.append(fn)
    return _REDUCE[0]


def _host_key() -> int:
    digest = hashlib.sha1(socket.gethostname().encode()).digest()
    return int.from_bytes(digest[:7], "little")


def connect(group, rank: int, world_size: int, timeout: float, name: str) -> "SharedMemoryChannel | None":
    """Collective over the torch process group `group`: a channel when all its ranks share this host (and
    /dev/shm exists), else None on every rank."""
    import torch.distributed as dist

    ok = os.path.isdir(_DIR) and world_size <= 64
    _compiled_reduce()  # compiled (or found wanting) before the ranks meet: a slow first compile delays no peer
    mine = torch.tensor([_host_key(), secrets.randbits(62), os.getpid(), int(ok)], dtype=torch.int64)
    every = torch.empty(world_size * 4, dtype=torch.int64)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(every, mine, group=group)
    rows = every.view(world_size, 4).tolist()
    if len({r[0] for r in rows}) != 1 or not all(r[3] for r in rows):
        return None
    path = os.path.join(_DIR, f"tpkit-{rows[0][1]:x}")
    size = _FLAGS_BYTES + 2 * world_size * SLOT_BYTES
    status = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            _CREATED.add(path)
            os.ftruncate(fd, size)
            os.close(fd)
        except OSError:
            status += 1
    dist.all_reduce(status, group=group)                     # created (or not) before anyone opens
    channel = None
    if not int(status):
        try:
            channel = SharedMemoryChannel(path, size, rank, world_size, timeout, [r[2] for r in rows], name)
        except OSError:
            status += 1
    dist.all_reduce(status, group=group)                     # every rank attached (or someone failed)
    if rank == 0 and path in _CREATED:
        try:
            os.unlink(path)                                  # nothing left on disk from here on
        except OSError:
            pass
        _CREATED.discard(path)
    if int(status):
        if channel is not None:
            channel.close()
        return None
    return channel


class SharedMemoryChannel:
    """One rank's view of the segment; `all_reduce` / `all_gather` / `all_to_all` of tensors up to `SLOT_BYTES`."""

    def __init__(self, path: str, size: int, rank: int, world_size: int, timeout: float, pids: list[int],
                 name: str):
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.rank, self.world_size, self.timeout, self.name = rank, world_size, float(timeout), name
        self._pids = pids
        self._flags = memoryview(self._map).cast("q")
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._seq = 0
        self._views: dict = {}  # (dtype, shape) -> [bank][rank] views of the slots
        self._reduce = _compiled_reduce()
        # what the compiled all-reduce reads of this segment (`shm_reduce.c`)
        self._context = (ctypes.c_int64 * 6)(self._bytes.data_ptr(), rank, world_size, SLOT_BYTES, _FLAGS_BYTES,
                                             _REDUCE_SPINS)
        self._context_at = ctypes.addressof(self._context)

    def close(self) -> None:
        """Unmap the segment (the file was unlinked at setup). Peers keep their own mappings."""
        self._views.clear()
        self._reduce = None  # the compiled call reads the segment's address: never after it is unmapped
        self._bytes = None
        try:
            self._flags.release()
            self._map.close()
        except (BufferError, ValueError):
            pass  # tensors still view it; the mapping goes with the process

    @property
    def closed(self) -> bool:
        return self._map.closed

    # -- protocol ---------------------------------------------------------------------------------
    def _slots(self, tensor: torch.Tensor) -> list[list[torch.Tensor]]:
        """Views of every rank's slot in both banks shaped like `tensor` (made once per dtype and shape)."""
        key = (tensor.dtype, tensor.shape)
        views = self._views.get(key)
        if views is None:
            nbytes = tensor.numel() * tensor.element_size()
            starts = [[_FLAGS_BYTES + (bank * self.world_size + r) * SLOT_BYTES for r in range(self.world_size)]
                      for bank in (0, 1)]
            views = [[self._bytes[s:s + nbytes].view(tensor.dtype).view(tensor.shape) for s in bank]
                     for bank in starts]
            if len(self._views) > 256:
                self._views.clear()
            self._views[key] = views
        return views

    def _wait(self, word: int, seq: int, op: str) -> None:
        """Spin until every rank's flag `word` (0 arrived, 1 done) reaches `seq`."""
        flags, n = self._flags, self.world_size
        for p in range(n):
            index = p * _Q + word
            if flags[index] >= seq:
                continue
            spins, deadline = 0, None
            while flags[index] < seq:
                spins += 1
                if spins & _YIELD_MASK == 0:
                    os.sched_yield()
                    if spins & 255 == 0:  # every 64 yields: a yield can take a time slice on a busy machine
                        now = time.monotonic()
                        if deadline is None:
                            deadline = now + self.timeout
                        self._check_peer(p, op, now >= deadline)

    def _check_peer(self, peer: int, op: str, timed_out: bool) -> None:
        try:
            os.kill(self._pids[peer], 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except OSError:
            alive = True
        if not alive:
            raise CommError(f"{op} (shared memory) on rank {self.rank} of group {self.name}: rank {peer} "
                            f"(pid {self._pids[peer]}) died")
        if timed_out:
            raise CommError(f"{op} (shared memory) on rank {self.rank} of group {self.name} timed out after "
                            f"{self.timeout:g}s: rank {peer} never arrived")

    def _publish(self, tensor: torch.Tensor, op: str) -> tuple[int, list[torch.Tensor]]:
        """Write `tensor` into this rank's slot and wait for every rank's; (call number, every rank's slot)."""
        if tensor.requires_grad:  # copying it into the slot must not enter autograd
            tensor = tensor.detach()
        seq = self._seq = self._seq + 1
        parts = self._slots(tensor)[seq & 1]
        if seq > 2:
            self._wait(1, seq - 2, op)
        parts[self.rank].copy_(tensor)
        self._flags[self.rank * _Q] = seq
        self._wait(0, seq, op)
        return seq, parts

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, out: torch.Tensor | None = None) -> torch.Tensor:
        """The reduction of every rank's `tensor` (contiguous CPU, at most SLOT_BYTES) into `out` or a new tensor."""
        code = _REDUCE_DTYPES.get(tensor.dtype)
        if code is not None and op is ReduceOp.SUM and self._reduce is not None:
            return self._compiled_sum(tensor, code, out)
        seq, parts = self._publish(tensor, "all_reduce")
        if out is not None and out.requires_grad:
            out = out.detach()
        if op is ReduceOp.SUM:
            result = torch.add(parts[0], parts[1], out=out) if out is not None else torch.add(parts[0], parts[1])
            for part in parts[2:]:
                result.add_(part)
        else:
            result = reduce_tensors(parts, op)
            if out is not None:
                result = out.copy_(result)
        self._flags[self.rank * _Q + 1] = seq
        return result

    def _compiled_sum(self, tensor: torch.Tensor, code: int, out: torch.Tensor | None) -> torch.Tensor:
        """`all_reduce`'s SUM in one C call; a wait longer than its spins continues in `_wait` (timeout, a dead
        peer), then C resumes at the step it stopped before."""
        if out is None:
            out = torch.empty_like(tensor)  # never requires grad
        else:
            increment_version(out)  # written through its pointer: autograd must see the change, as torch's ops show it
        seq = self._seq = self._seq + 1
        src, dst, count = tensor.data_ptr(), out.data_ptr(), tensor.numel()
        step = self._reduce(self._context_at, seq, src, dst, count, code, 0)
        while step:
            self._wait(1, seq - 2, "all_reduce") if step == 1 else self._wait(0, seq, "all_reduce")
            step = self._reduce(self._context_at, seq, src, dst, count, code, step)
        return out

    def barrier(self) -> None:
        """Return once every rank has reached its barrier: a call without data in the same numbering (in C, the
        compiled all-reduce of nothing; Python's steps where it is off, or finishing a wait it handed back)."""
        seq = self._seq = self._seq + 1
        step = 1 if self._reduce is None else self._reduce(self._context_at, seq, None, None, 0, 0, 0)
        if step == 1 and seq > 2:
            self._wait(1, seq - 2, "barrier")
        if step:
            self._flags[self.rank * _Q] = seq
            self._wait(0, seq, "barrier")
            self._flags[self.rank * _Q + 1] = seq

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all) concatenated along `dim`."""
        seq, parts = self._publish(tensor, "all_gather")
        result = torch.cat(parts, dim)
        self._flags[self.rank * _Q + 1] = seq
        return result

    def all_to_all(self, packed: torch.Tensor, starts: list[int], recv_counts: list[int]) -> torch.Tensor | None:
        """Every rank's piece for this rank, concatenated in rank order (a new flat tensor); None on every rank
        when some rank's data does not fit its slot (the caller then takes gloo).

        `packed` is this rank's flat data, piece j at elements `starts[j]:starts[j + 1]`; `recv_counts[i]` the
        elements this rank expects from rank i. A slot holds a header (whether the data fits, then `starts`) and
        the data: sizes differ between ranks, so each rank reads where its piece lies in every peer's header."""
        n, itemsize = self.world_size, packed.element_size()
        header = torch.tensor([0] + list(starts), dtype=torch.int64)
        head_bytes = -(-header.numel() * 8 // _LINE) * _LINE
        fits = head_bytes + packed.numel() * itemsize <= SLOT_BYTES
        header[0] = int(fits)
        seq = self._seq = self._seq + 1
        bases = [_FLAGS_BYTES + ((seq & 1) * n + r) * SLOT_BYTES for r in range(n)]
        if seq > 2:
            self._wait(1, seq - 2, "all_to_all")
        mine = self._bytes[bases[self.rank]:bases[self.rank] + SLOT_BYTES]
        mine[:header.numel() * 8].copy_(header.view(torch.uint8))
        if fits:
            mine[head_bytes:head_bytes + packed.numel() * itemsize].copy_(packed.view(torch.uint8))
        self._flags[self.rank * _Q] = seq
        self._wait(0, seq, "all_to_all")
        try:
            headers = [self._bytes[b:b + header.numel() * 8].view(torch.int64).tolist() for b in bases]
            if not all(h[0] for h in headers):
                return None
            out = packed.new_empty(sum(recv_counts))
            at = 0
            for peer, (base, h) in enumerate(zip(bases, headers)):
                lo, hi = h[1 + self.rank], h[2 + self.rank]
                if hi - lo != recv_counts[peer]:
                    raise CommError(f"all_to_all (shared memory) on rank {self.rank} of group {self.name}: rank "
                                    f"{peer} sent {hi - lo} elements but this rank expects {recv_counts[peer]}")
                start = base + head_bytes + lo * itemsize
                out[at:at + hi - lo].copy_(self._bytes[start:start + (hi - lo) * itemsize].view(packed.dtype))
                at += hi - lo
            return out
        finally:
            self._flags[self.rank * _Q + 1] = seq
