"""`ShardLayout`: which part of one full tensor a rank holds, as one exact, immutable value.

Everything that needs "which slice of which tensor does rank r hold" reads it from here: the converter builds
the shards with it, `verify` slices reference gradients with it, the analyzer counts bytes with it, and the
checkpoint code reads byte ranges of a file and writes layout-independent pieces with it.

The model: the full tensor (as the *original* model stores it) is cut along one dimension `dim`. That
dimension is made of `pieces`, consecutive blocks each split on its own: a plain weight is one piece; a fused
qkv projection is three (q, k, v), a fused gate_up two. Within a piece every rank holds one contiguous span
(whole heads for attention). Spans of different ranks may overlap: KV heads held by several ranks when there
are fewer KV heads than ranks (a partly replicated piece), or a whole piece every rank holds. A rank's local
tensor is its spans, piece after piece, concatenated along `dim`. `transposed` says the converted layer holds
the tensor the other way round from the original (GPT-2's `Conv1D` stores `(in, out)`; the `tpkit.nn` layer
that replaces it holds `(out, in)` under the same state_dict key). A replicated tensor has `dim=None`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch

from .split import split_sizes


@dataclasses.dataclass(frozen=True)
class Piece:
    """A block `[offset, offset + size)` of the split dimension, with each rank's span `(start, stop)` inside it
    (relative to `offset`)."""

    offset: int
    size: int
    spans: tuple[tuple[int, int], ...]

    @classmethod
    def split(cls, offset: int, size: int, world_size: int, unit: int = 1) -> "Piece":
        """A piece cut by the split rule (`tpkit.comm.split_sizes`) into whole units of `unit`."""
        starts, spans = 0, []
        for n in split_sizes(size // unit, world_size):
            spans.append((starts, starts + n * unit))
            starts += n * unit
        return cls(offset, size, tuple(spans))

    @classmethod
    def whole(cls, offset: int, size: int, world_size: int) -> "Piece":
        """A piece every rank holds all of."""
        return cls(offset, size, ((0, size),) * world_size)


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Rank `rank`'s part of a tensor of `full_shape` (see the module docstring)."""

    full_shape: tuple[int, ...]
    world_size: int
    rank: int
    dim: int | None = None
    pieces: tuple[Piece, ...] = ()
    transposed: bool = False

    def __post_init__(self):
        object.__setattr__(self, "full_shape", tuple(int(s) for s in self.full_shape))
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"ShardLayout: rank {self.rank} outside world size {self.world_size}")
        if self.dim is None:
            return
        if not 0 <= self.dim < len(self.full_shape):
            raise ValueError(f"ShardLayout: dim {self.dim} outside a tensor of shape {self.full_shape}")
        edge = 0
        for p in self.pieces:
            if p.offset != edge or len(p.spans) != self.world_size or any(
                    not 0 <= a <= b <= p.size for a, b in p.spans):
                raise ValueError(f"ShardLayout: piece {p} does not continue at {edge} with one span per rank inside it")
            edge += p.size
        if edge != self.full_shape[self.dim]:
            raise ValueError(f"ShardLayout: pieces cover {edge} of dim {self.dim}, the tensor has "
                             f"{self.full_shape[self.dim]}")

    # Construction.
    @classmethod
    def replicated(cls, full_shape: Sequence[int], world_size: int, rank: int) -> "ShardLayout":
        return cls(tuple(full_shape), world_size, rank)

    @classmethod
    def split(cls, full_shape: Sequence[int], dim: int, world_size: int, rank: int,
              pieces: Sequence[int] | None = None, transposed: bool = False) -> "ShardLayout":
        """`dim` cut by the split rule, piece by piece (`pieces`: sizes of consecutive blocks; default one)."""
        offsets, out = 0, []
        for size in pieces or [full_shape[dim]]:
            out.append(Piece.split(offsets, size, world_size))
            offsets += size
        return cls(tuple(full_shape), world_size, rank, dim, tuple(out), transposed)

    def for_rank(self, rank: int) -> "ShardLayout":
        return dataclasses.replace(self, rank=rank)

    # What the rank holds.
    @property
    def is_replicated(self) -> bool:
        """Every rank holds the whole tensor."""
        return self.dim is None or all(s == (0, p.size) for p in self.pieces for s in p.spans)

    def segments(self, rank: int | None = None) -> list[tuple[int, int]]:
        """`(start, stop)` ranges of the full `dim` that `rank` holds, in local order."""
        r = self.rank if rank is None else rank
        return [(p.offset + p.spans[r][0], p.offset + p.spans[r][1]) for p in self.pieces
                if p.spans[r][1] > p.spans[r][0]]

    def sizes(self) -> tuple[int, ...]:
        """Every rank's length along `dim` (the layers' `partition_sizes`; empty when replicated)."""
        if self.dim is None:
            return ()
        return tuple(sum(b - a for p in self.pieces for a, b in [p.spans[r]]) for r in range(self.world_size))

    def index(self) -> tuple[int, ...]:
        """Positions along the full `dim` of this rank's entries, in local order."""
        return tuple(i for a, b in self.segments() for i in range(a, b))

    def is_plain_split(self) -> bool:
        """One piece cut contiguously by the split rule: what a layer's plain `from_module` builds."""
        return self.dim is not None and len(self.pieces) == 1 and self.pieces[0] == Piece.split(
            0, self.full_shape[self.dim], self.world_size)

    def shares_entries(self) -> bool:
        """Whether some entry along `dim` is held by several ranks (but not all: then it is replicated), so each
        holder's gradient of it covers only its own work and the gradient is a sum over the holders."""
        return not self.is_replicated and any(max(self.for_rank(r).replicas(), default=1) > 1
                                              for r in range(self.world_size))

    def replicas(self) -> tuple[int, ...]:
        """For each of this rank's entries along `dim`, how many ranks hold it (1 unless replicated)."""
        out = []
        for p in self.pieces:
            a, b = p.spans[self.rank]
            for i in range(a, b):
                out.append(sum(1 for s, e in p.spans if s <= i < e))
        return tuple(out)

    @property
    def stored_local_shape(self) -> tuple[int, ...]:
        """The local tensor's shape in the original orientation (before any transpose)."""
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = sum(b - a for a, b in self.segments())
        return tuple(shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the tensor this rank holds (as the converted model holds it)."""
        shape = self.stored_local_shape
        return shape[::-1] if self.transposed else shape

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    # Tensors.
    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """Exactly this rank's local tensor from the full one (a copy unless the layout is whole)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"ShardLayout.shard: the full tensor has shape {tuple(full.shape)}, the layout expects "
                             f"{self.full_shape}")
        if self.dim is None:
            local = full
        else:
            parts = [full.narrow(self.dim, a, b - a) for a, b in self.segments()] or [full.narrow(self.dim, 0, 0)]
            local = parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)
        return local.t() if self.transposed else local

    def unshard(self, locals_in_rank_order: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's local tensor (replicated entries are taken from the first holder)."""
        if len(locals_in_rank_order) != self.world_size:
            raise ValueError(f"ShardLayout.unshard: got {len(locals_in_rank_order)} tensors for {self.world_size} ranks")
        for r, t in enumerate(locals_in_rank_order):
            want = self.for_rank(r).local_shape
            if tuple(t.shape) != want:
                raise ValueError(f"ShardLayout.unshard: rank {r}'s tensor has shape {tuple(t.shape)}, expected {want}")
        stored = [t.t() if self.transposed else t for t in locals_in_rank_order]
        if self.dim is None:
            return stored[0].clone()
        full = stored[0].new_empty(self.full_shape)
        filled = [False] * self.full_shape[self.dim]
        for r, t in enumerate(stored):
            at = 0
            for a, b in self.segments(r):
                if not all(filled[a:b]):
                    full.narrow(self.dim, a, b - a).copy_(t.narrow(self.dim, at, b - a))
                    filled[a:b] = [True] * (b - a)
                at += b - a
        if not all(filled):
            raise ValueError(f"ShardLayout.unshard: positions {filled.index(False)}.. of dim {self.dim} are held by no "
                             f"rank")
        return full

    def byte_ranges(self, itemsize: int) -> list[tuple[int, int]]:
        """Byte ranges `[start, stop)` of the row-major full tensor (as stored) this rank must read, in order:
        their bytes concatenated are the local tensor in `stored_local_shape`. A dim-0 split is one range per
        segment; a split of a later dim is one range per segment per index of the dims before it. Adjacent
        ranges are merged."""
        inner = math.prod(self.full_shape[self.dim + 1:]) if self.dim is not None else 1
        if self.dim is None:
            return [(0, math.prod(self.full_shape) * itemsize)] if math.prod(self.full_shape) else []
        row = self.full_shape[self.dim] * inner
        out: list[tuple[int, int]] = []
        segments = self.segments()
        for outer in range(math.prod(self.full_shape[:self.dim])):
            for a, b in segments:
                start, stop = (outer * row + a * inner) * itemsize, (outer * row + b * inner) * itemsize
                if out and out[-1][1] == start:
                    out[-1] = (out[-1][0], stop)
                else:
                    out.append((start, stop))
        return out

    # Data in / out (checkpoint manifests).
    def to_dict(self) -> dict[str, Any]:
        return {"full_shape": list(self.full_shape), "world_size": self.world_size, "rank": self.rank,
                "dim": self.dim, "transposed": self.transposed,
                "pieces": [{"offset": p.offset, "size": p.size, "spans": [list(s) for s in p.spans]}
                           for p in self.pieces]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ShardLayout":
        pieces = tuple(Piece(int(p["offset"]), int(p["size"]), tuple((int(a), int(b)) for a, b in p["spans"]))
                       for p in data.get("pieces", ()))
        return cls(tuple(data["full_shape"]), int(data["world_size"]), int(data["rank"]), data.get("dim"), pieces,
                   bool(data.get("transposed", False)))

    def __repr__(self) -> str:
        if self.dim is None:
            return f"ShardLayout(replicated {list(self.full_shape)}, rank {self.rank}/{self.world_size})"
        t = ", transposed" if self.transposed else ""
        return (f"ShardLayout({list(self.full_shape)} dim {self.dim} -> {list(self.local_shape)}, rank "
                f"{self.rank}/{self.world_size}, segments {self.segments()}{t})")

