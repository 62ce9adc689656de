"""Shared fixtures of the whole-model tests: single-device references, computed once per session.

A reference (logits, weights after one optimizer step, greedy tokens) costs a model build, a forward, a backward
and a step; several tests (threads at 2, 3, 4 ranks, gloo) compare with the same one.
"""
from __future__ import annotations

from typing import Callable

import pytest


def _memo(make: Callable[..., dict]) -> Callable[..., dict]:
    cache: dict[tuple, dict] = {}

    def get(name: str, **over) -> dict:
        key = (name, tuple(sorted(over.items())))
        if key not in cache:
            cache[key] = make(name, **over)
        return cache[key]
    return get


@pytest.fixture(scope="session")
def hf_reference() -> Callable[..., dict]:
    """`hf_reference(name, **config_overrides)`: `tests.models.hf.reference`, once per session."""
    from .hf import reference

    return _memo(reference)


@pytest.fixture(scope="session")
def moe_reference() -> Callable[..., dict]:
    """`moe_reference(name, **config_overrides)`: `tests.models.moe.reference`, once per session."""
    from .moe import reference

    return _memo(reference)
