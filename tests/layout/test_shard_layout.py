"""`ShardLayout` on its own: shard / unshard round trips, byte ranges, replicas, JSON, and bad input."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit import ShardLayout
from tpkit.comm import split_sizes
from tpkit.layout import Piece


def _read(full: torch.Tensor, lay: ShardLayout) -> torch.Tensor:
    """What a file reader gets: the layout's byte ranges of the row-major full tensor, concatenated."""
    raw = full.contiguous().view(-1).view(torch.uint8)
    parts = [raw[a:b] for a, b in lay.byte_ranges(full.element_size())]
    flat = torch.cat(parts).view(full.dtype) if parts else full.new_empty(0)
    local = flat.reshape(lay.stored_local_shape)
    return local.t() if lay.transposed else local


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=3), world=st.integers(1, 5), data=st.data())
def test_split_round_trips_and_byte_ranges(shape, world, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    if shape[dim] < world:
        shape[dim] = world
    n_pieces = data.draw(st.integers(1, 3))
    pieces = [shape[dim] // n_pieces] * n_pieces
    pieces[-1] += shape[dim] - sum(pieces)
    if min(pieces) < 1:
        pieces = [shape[dim]]
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    lays = [ShardLayout.split(shape, dim, world, r, pieces) for r in range(world)]
    locals_ = [lay.shard(full) for lay in lays]
    for lay, local in zip(lays, locals_):
        assert tuple(local.shape) == lay.local_shape
        assert torch.equal(_read(full, lay), local)
        assert list(lay.index()) == [i for a, b in lay.segments() for i in range(a, b)]
    assert torch.equal(lays[0].unshard(locals_), full)
    assert list(lays[0].sizes()) == [sum(ps) for ps in zip(*(split_sizes(p, world) for p in pieces))]


def test_plain_split_matches_the_split_rule_and_transposed_conv1d():
    full = torch.arange(6 * 10).reshape(6, 10).float()  # a Conv1D weight stored (in=6, out=10)
    lays = [ShardLayout.split((6, 10), 1, 3, r, transposed=True) for r in range(3)]
    assert [lay.local_shape for lay in lays] == [(4, 6), (3, 6), (3, 6)]
    assert torch.equal(lays[1].shard(full), full[:, 4:7].t())
    assert torch.equal(lays[0].unshard([lay.shard(full) for lay in lays]), full)
    assert lays[0].is_plain_split() and not lays[0].is_replicated
    assert torch.equal(_read(full, lays[2]), full[:, 7:].t())


def test_partly_replicated_piece_counts_replicas_and_unshards():
    # q: 4 heads of 2 over 4 ranks; k: 2 heads of 2, each held by two ranks (GQA, fewer KV heads than ranks)
    q = Piece(0, 8, ((0, 2), (2, 4), (4, 6), (6, 8)))
    k = Piece(8, 4, ((0, 2), (0, 2), (2, 4), (2, 4)))
    lays = [ShardLayout((12, 3), 4, r, 0, (q, k)) for r in range(4)]
    full = torch.randn(12, 3, dtype=torch.float64)
    assert lays[1].segments() == [(2, 4), (8, 10)] and lays[1].replicas() == (1, 1, 2, 2)
    assert torch.equal(lays[1].shard(full), torch.cat([full[2:4], full[8:10]]))
    assert torch.equal(lays[0].unshard([lay.shard(full) for lay in lays]), full)
    assert lays[1].byte_ranges(8) == [(2 * 24, 4 * 24), (8 * 24, 10 * 24)]
    assert ShardLayout.from_dict(lays[1].to_dict()) == lays[1]


def test_replicated_layout():
    lay = ShardLayout.replicated((3, 4), 2, 1)
    full = torch.randn(3, 4)
    assert lay.is_replicated and lay.local_shape == (3, 4) and lay.shard(full) is full
    assert lay.byte_ranges(4) == [(0, 48)] and lay.for_rank(0).rank == 0
    assert torch.equal(lay.unshard([full, full]), full)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="rank 2 outside world size 2"):
        ShardLayout.replicated((3,), 2, 2)
    with pytest.raises(ValueError, match="pieces cover 5 of dim 0, the tensor has 6"):
        ShardLayout((6,), 1, 0, 0, (Piece(0, 5, ((0, 5),)),))
    lay = ShardLayout.split((6, 2), 0, 2, 0)
    with pytest.raises(ValueError, match=r"full tensor has shape \(5, 2\), the layout expects \(6, 2\)"):
        lay.shard(torch.zeros(5, 2))
    with pytest.raises(ValueError, match="rank 1's tensor has shape"):
        lay.unshard([torch.zeros(3, 2), torch.zeros(2, 2)])
    with pytest.raises(ValueError, match="held by no rank"):
        ShardLayout((4,), 2, 0, 0, (Piece(0, 4, ((0, 1), (2, 4))),)).unshard([torch.zeros(1), torch.zeros(2)])
