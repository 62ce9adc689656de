"""`agree`: ranks agree before anything changes. Its flag has its own dtype: torch's default dtype is process-wide,
and a thread-rank building a model (transformers sets the default while it builds) must not make the others
pass a flag of another dtype (the ranks then failed with a CommError instead of agreeing)."""
from __future__ import annotations

import threading

import pytest
import torch

from tpkit.checkpoint.agree import agree
from tpkit.checkpoint.errors import CheckpointError
from tpkit.comm import run_threads


class _Recording:
    """A rank's communicator that records the dtype of what it all-reduces and runs `before` first."""

    def __init__(self, inner, dtypes: list, before=lambda: None):
        self.inner, self.dtypes, self.before = inner, dtypes, before

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def all_reduce(self, tensor, *args, **kwargs):
        self.dtypes.append(tensor.dtype)
        self.before()
        return self.inner.all_reduce(tensor, *args, **kwargs)


@pytest.mark.parametrize("error_on", [None, 1])
def test_agree_with_float64_the_default_on_one_rank_and_float32_on_the_other(error_on):
    """Rank 0 makes its flag while float64 is the default, rank 1 after float32 is back: deterministic."""
    dtypes: list = [[], []]
    back = threading.Event()

    def float32_again():
        torch.set_default_dtype(torch.float32)
        back.set()

    def body(comm):
        error = ValueError(f"bad tensor on rank {comm.rank}") if comm.rank == error_on else None
        if comm.rank == 0:
            torch.set_default_dtype(torch.float64)
            mine = _Recording(comm, dtypes[0], float32_again)
        else:
            assert back.wait(30), "rank 0 never reached its all-reduce"
            mine = _Recording(comm, dtypes[1])
        try:
            agree(mine, error)
            return None
        except CheckpointError as exc:
            return str(exc)

    try:
        results = run_threads(body, 2)
    finally:
        torch.set_default_dtype(torch.float32)
    assert dtypes[0][:1] == dtypes[1][:1] == [torch.float32]
    if error_on is None:
        assert results == [None, None]
    else:
        assert all("bad tensor on rank 1" in r for r in results), results
