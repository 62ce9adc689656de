"""The compiled product on each instruction-set path (`build`), for the tests that compare it with torch."""
from __future__ import annotations

import pytest

from tpkit.quant import native

_BUILDS: dict = {}


def _avx512() -> bool:
    return "avx512f" in native._cpu().split() and "avx512bw" in native._cpu().split()


def _bf16_dot() -> bool:
    return _avx512() and "avx512_bf16" in native._cpu().split()


def _vnni() -> bool:
    return _avx512() and "avx512_vnni" in native._cpu().split()


@pytest.fixture(params=list(native.ISA_FLAGS))
def build(request, monkeypatch):
    """The product built for each instruction-set path `TPKIT_NATIVE_ISA` offers (`native.ISA_FLAGS`): all this CPU
    has (the AVX-512 loops where it has them, with AVX512-BF16's dot products for bf16 inputs and AVX512-VNNI's
    byte products for int8 and int4 weights where it has those), the same without VNNI (int4 by the bf16 dot
    products), without AVX512-BF16 (VNNI for int8 and int4), the AVX-512 loops without either, the same CPU without AVX-512 (the AVX2 loops, with the int16 runs for integer
    weights), and x86-64's baseline (the portable loops); each is what some CPU runs."""
    if request.param == "native":
        return request.param
    if request.param == "avx2" and not _avx512():
        pytest.skip("this machine's build is the AVX2 path already")
    if request.param == "avx512" and not (_bf16_dot() or _vnni()):
        pytest.skip("this machine's build has no AVX512-BF16 or VNNI path: native is the AVX-512 path already")
    if request.param in ("avx512-vnni", "avx512-bf16") and not (_bf16_dot() and _vnni()):
        pytest.skip("this machine's native build has one of AVX512-BF16 and VNNI at most: it is that path already")
    if request.param not in _BUILDS:
        _BUILDS[request.param] = native.build(native.ISA_FLAGS[request.param])
    if _BUILDS[request.param] is None:
        pytest.skip(f"the compiler did not build the {request.param} path")
    monkeypatch.setattr(native, "_LIB", [_BUILDS[request.param]])
    return request.param
