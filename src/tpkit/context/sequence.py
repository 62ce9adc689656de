"""Where each token of a sequence lives under context parallelism: the zigzag split, and its inverse.

A causal sequence cut into cp contiguous pieces leaves the last rank the most work (its queries see every key)
and the first almost none. Cut it instead into 2 x cp equal chunks and give rank r chunks r and 2cp-1-r
(Megatron's and TransformerEngine's load balancing): every rank then holds one early and one late chunk and
computes the same number of causal score entries. A sequence whose length does not divide by 2 x cp is padded
at its end to the next multiple; under a causal mask no real token ever sees a pad key, and the pads' labels are
ignored, so the result is exactly the unpadded one (`SequenceSplit.pad`).

`SequenceSplit(length, cp)` is the one description both directions read: `indices(rank)` (the global positions
a rank holds, in its local order), `order()` (all ranks' positions concatenated in rank order: the order of a
sequence gathered over cp, e.g. after the all-to-all of Ulysses), `split(t, dim, rank)` and `gather(t, comm, dim)`.
"""
from __future__ import annotations

import dataclasses

import torch

from ..comm.communicator import Communicator
from ..nn.mappings import gather_from_region


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """The zigzag split of a sequence of `length` tokens over `cp` ranks (padded to `padded` tokens)."""

    length: int
    cp: int

    def __post_init__(self):
        if self.length < 1 or self.cp < 1:
            raise ValueError(f"SequenceSplit: length {self.length} and cp {self.cp} must be positive")

    @property
    def chunks(self) -> int:
        return 2 * self.cp

    @property
    def padded(self) -> int:
        """The length actually split: the next multiple of 2 x cp."""
        return -(-self.length // self.chunks) * self.chunks

    @property
    def pad(self) -> int:
        return self.padded - self.length

    @property
    def chunk(self) -> int:
        return self.padded // self.chunks

    @property
    def local(self) -> int:
        """Tokens each rank holds."""
        return 2 * self.chunk

    def chunk_ids(self, rank: int) -> tuple[int, int]:
        """The two chunks rank `rank` holds, in its local order."""
        return rank, self.chunks - 1 - rank

    def indices(self, rank: int, device=None) -> torch.Tensor:
        """Global positions held by `rank`, in its local order."""
        c = self.chunk
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunk_ids(rank)])

    def order(self, device=None) -> torch.Tensor:
        """Global positions of the sequence gathered over cp in rank order (rank 0's tokens, then rank 1's...)."""
        return torch.cat([self.indices(r, device) for r in range(self.cp)])

    def natural(self, device=None) -> torch.Tensor:
        """The permutation that puts a rank-order gathered sequence back in natural order: `x[natural()]`."""
        return torch.argsort(self.order(device))

    def padded_tensor(self, t: torch.Tensor, dim: int, value) -> torch.Tensor:
        """`t` (whose `dim` has `length` entries) padded at the end of `dim` with `value` to `padded`."""
        if t.shape[dim] != self.length:
            raise ValueError(f"SequenceSplit: a tensor of shape {tuple(t.shape)} has {t.shape[dim]} entries along dim "
                             f"{dim}, the sequence has {self.length}")
        if not self.pad:
            return t
        shape = list(t.shape)
        shape[dim] = self.pad
        return torch.cat([t, t.new_full(shape, value)], dim=dim)

    def split(self, t: torch.Tensor, dim: int, rank: int, value=0) -> torch.Tensor:
        """`rank`'s tokens of `t` (the whole sequence along `dim`, padded with `value` first), contiguous."""
        return self.take(self.padded_tensor(t, dim, value), dim, rank)

    def take(self, t: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """`rank`'s tokens of `t`, already padded to `padded` along `dim`."""
        return t.index_select(dim, self.indices(rank, t.device))

    def gather(self, t: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        """The whole sequence (natural order, padding cut) from every rank's `local` tokens along `dim`.
        Collective over `comm` (the cp group); differentiable: every rank computing the same thing from the whole
        sequence (a metric, a loss on gathered logits), the backward keeps each rank its own tokens' gradient."""
        dim %= t.dim()
        if t.shape[dim] != self.local:
            raise ValueError(f"gather: this rank holds {t.shape[dim]} tokens along dim {dim} (shape {tuple(t.shape)}); "
                             f"the split of {self.length} tokens over cp {self.cp} gives each rank {self.local}")
        whole = gather_from_region(t, comm, dim)
        whole = whole.index_select(dim, self.natural(t.device))
        return whole.narrow(dim, 0, self.length)
