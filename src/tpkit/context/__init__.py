"""`tpkit.context`: context parallelism, the sequence split over ranks (see `apply.py`)."""
from __future__ import annotations

from .apply import ContextParallel, context_off, context_of, context_parallel, gather_sequence
from .batch import ContextBatch
from .sequence import SequenceSplit

__all__ = ["ContextBatch", "ContextParallel", "SequenceSplit", "context_off", "context_of", "context_parallel",
           "gather_sequence"]
