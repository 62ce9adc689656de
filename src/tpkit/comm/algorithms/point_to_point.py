"""`PointToPoint`: the paired send/recv every algorithm is written over."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..communicator import Communicator


class PointToPoint:
    """Paired send/recv that cannot deadlock.

    On torch process groups both directions are posted at once (`irecv` + `isend`, then wait), since a
    blocking gloo `send` may wait for its receiver. Other backends' `send` is buffered (threads), so a
    send followed by a recv is safe there.
    """

    def __init__(self, comm: Communicator):
        base = getattr(comm, "base", comm)
        self.comm = base
        self.rank = base.rank
        self.world_size = base.world_size
        self._group = getattr(base, "process_group", None)
        if self._group is not None:
            import torch.distributed as dist

            self._dist = dist
            self._global = dist.get_process_group_ranks(self._group)

    def exchange(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int) -> None:
        """Send `send` to `dst` and receive into `recv` from `src` (either may be None or empty)."""
        send = send if send is not None and send.numel() else None
        recv = recv if recv is not None and recv.numel() else None
        if self._group is not None:
            works = []
            if recv is not None:
                works.append(self._dist.irecv(recv, self._global[src], group=self._group))
            if send is not None:
                works.append(self._dist.isend(send, self._global[dst], group=self._group))
            for work in works:
                work.wait()
            return
        if send is not None:
            self.comm.send(send, dst)
        if recv is not None:
            self.comm.recv(recv, src)

    def start(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int) -> Callable[[], None]:
        """`exchange`, posted now and finished by the function returned: on torch process groups both directions
        run while the caller computes (a ring's next K/V block arrives during this block's attention). Elsewhere it
        is done before returning (a threads send is buffered, so every rank may send first)."""
        send = send if send is not None and send.numel() else None
        recv = recv if recv is not None and recv.numel() else None
        if self._group is None:
            self.exchange(send, dst, recv, src)
            return lambda: None
        works = []
        if recv is not None:
            works.append(self._dist.irecv(recv, self._global[src], group=self._group))
        if send is not None:
            works.append(self._dist.isend(send, self._global[dst], group=self._group))

        def wait() -> None:
            for work in works:
                work.wait()
        return wait

    def exchange_all(self, sends: Sequence[tuple[torch.Tensor, int]],
                     recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
        """Post every receive and send at once, then wait for all: one round of latency, not one per peer."""
        sends = [(t, d) for t, d in sends if t.numel()]
        recvs = [(t, s) for t, s in recvs if t.numel()]
        if self._group is not None:
            works = [self._dist.irecv(t, self._global[s], group=self._group) for t, s in recvs]
            works += [self._dist.isend(t, self._global[d], group=self._group) for t, d in sends]
            for work in works:
                work.wait()
            return
        for t, d in sends:
            self.comm.send(t, d)
        for t, s in recvs:
            self.comm.recv(t, s)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.exchange(tensor, dst, None, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self.exchange(None, src, tensor, src)
