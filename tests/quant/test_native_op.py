"""The op `tpkit::gemv`'s two CPU kernels (`tpkit.quant.native`): the C++ one (`gemv_op.cpp`, the dispatcher calling
the product with no Python between) against the Python one (`_python_kernel`, through ctypes), bit for bit, over
drawn kinds, shapes, rows, dtypes, scales and zero points; the C++ kernel calling the build in use (the tests'
builds per instruction set); a product split over threads; a fresh thread's scratch; and a machine without a C++
compiler keeping the Python kernel, eager and compiled."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit.quant import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler built tpkit's native product here")

KINDS = ["bf16", "fp16", "int8", "uint8", "uint4", "fp8", "fp32"]


def _case(kind: str, rows: int, n: int, k: int, bf16: bool, scale_dtype: torch.dtype, zero: bool, seed: int) -> tuple:
    """The op's arguments for one drawn product (`native._op_args`): a stored weight of `kind`, per-row-block scales
    of 32 columns, int8 zero points for the integer kinds when `zero`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x = x.bfloat16() if bf16 else x
    stored = {"bf16": lambda: torch.randn(n, k, generator=g).bfloat16(),
              "fp16": lambda: torch.randn(n, k, generator=g).half(),
              "int8": lambda: torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g),
              "uint8": lambda: torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g),
              "uint4": lambda: torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
              "fp8": lambda: (torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn),
              "fp32": lambda: torch.randn(n, k, generator=g)}[kind]()
    dense = kind in ("bf16", "fp16", "fp32")
    scale = None if dense else (torch.rand(n, k // 32, generator=g) + 0.1).to(scale_dtype)
    zeros = torch.randint(-8, 8, (n, k // 32), dtype=torch.int8, generator=g) if zero and kind in (
        "int8", "uint8", "uint4") else None
    offset = {"uint4": 8.0, "uint8": 128.0}.get(kind, 0.0)
    return native._op_args(x, stored, native.KINDS[kind], scale, zeros, 1, 1 if dense else 32, n, offset, 0, bf16)


def _cpp_kernel() -> None:
    native._kernel()
    if native._KERNEL["op"] is None:
        assert os.environ.get("TPKIT_NATIVE_OP") == "0" or shutil.which(os.environ.get("CXX", "c++")) is None, \
            "a C++ compiler is here, yet no kernel was built"
        pytest.skip("no C++ compiler here: the Python kernel is the op's")


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(KINDS), rows=st.integers(1, 8), n=st.integers(1, 70), k=st.sampled_from([32, 64, 128, 256,
       384]), bf16=st.booleans(), scale_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       zero=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_the_cpp_kernel_equals_the_python_kernel(kind, rows, n, k, bf16, scale_dtype, zero, seed):
    _cpp_kernel()
    args = _case(kind, rows, n, k, bf16, scale_dtype, zero, seed)
    got, want = torch.ops.tpkit.gemv.default(*args), native._python_kernel(*args)
    assert got.dtype == want.dtype == args[0].dtype and got.shape == (rows, n)
    assert torch.equal(got.view(torch.int16) if bf16 else got, want.view(torch.int16) if bf16 else want)


def test_the_cpp_kernel_calls_the_build_in_use(build):
    """On every instruction-set build (`conftest.build`, which swaps the product `_function()` gives), the op's
    result is that build's: the C++ kernel is bound again to it. int4 times bf16 activations differ between the
    builds (the int16 runs against the float32 loops), so a kernel left on the machine's own build would differ."""
    _cpp_kernel()
    for kind in ("uint4", "int8", "fp8"):
        args = _case(kind, 3, 48, 256, True, torch.bfloat16, True, 7)
        assert torch.equal(native.gemv(args[0], args[1], kind, 48, args[3], args[5], (1, 32), int(args[12])),
                           native._python_kernel(*args))
        assert torch.equal(torch.ops.tpkit.gemv.default(*args), native._python_kernel(*args))


@pytest.mark.parametrize("kind", ["int8", "uint4", "fp8", "bf16"])
@pytest.mark.parametrize("rows,bf16", [(1, True), (1, False), (5, True)])
def test_a_product_split_over_threads_equals_the_serial_one_bit_for_bit(kind, rows, bf16):
    """A product with more rows than `tp_rows_per_task` is split by rows over torch's threads (`gemv_op.cpp`); at
    2 and 3 threads (n not a multiple of either) it equals the Python kernel's single call over all rows, whose
    result the other tests compare with torch. The build is threaded where torch's backend is OpenMP."""
    _cpp_kernel()
    op = native._KERNEL["op"]
    if not op.tp_threaded():
        assert not (torch._C.has_openmp and native.compile_library(native._OP_SOURCE, ("-fopenmp",), cxx=True)), \
            "an OpenMP build of the op works here, yet the op in use is serial"
        pytest.skip("no OpenMP build of the op here (torch without OpenMP, or no OpenMP runtime to link)")
    grain = native._function().rows_per_task(native.KINDS[kind], 256)
    n = 3 * grain + grain // 3  # 3 tasks at 3 threads, 2 at 2
    args = _case(kind, rows, n, 256, bf16, torch.bfloat16, kind != "fp8", n + rows)
    want = native._python_kernel(*args)
    before = torch.get_num_threads()
    try:
        for threads in (2, 3):
            torch.set_num_threads(threads)
            got = torch.ops.tpkit.gemv.default(*args)
            assert op.tp_last_tasks() == threads  # split, one task per thread
            assert got.shape == (rows, n) and torch.equal(got.view(torch.int16) if bf16 else got,
                                                          want.view(torch.int16) if bf16 else want), threads
    finally:
        torch.set_num_threads(before)


def test_a_fresh_thread_grows_its_own_scratch():
    """Thread-ranks call at once, each with its own scratch (`thread_local` in C++, `threading.local` in Python),
    empty in a new thread and grown by the first call there."""
    _cpp_kernel()
    small, large = _case("uint4", 1, 16, 64, True, torch.bfloat16, False, 1), _case("fp8", 8, 64, 384, False,
                                                                                   torch.float32, False, 2)
    want = [native._python_kernel(*a) for a in (small, large, small)]
    got = []
    thread = threading.Thread(target=lambda: got.extend(torch.ops.tpkit.gemv.default(*a)
                                                        for a in (small, large, small)))
    thread.start()
    thread.join()
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))


_WITHOUT_CXX = """
import torch
from tpkit.quant import native
g = torch.Generator().manual_seed(0)
w = torch.randn(40, 128, generator=g).bfloat16()
x = torch.randn(2, 128, generator=g).bfloat16()
eager = native.gemv(x, w, "bf16", 40)
compiled = torch.compile(lambda t: native.gemv(t, w, "bf16", 40), fullgraph=True, backend="eager")(x)
assert native._KERNEL["op"] is None and native._kernel() is native._python_kernel, native._KERNEL
want = x.float() @ w.float().t()
assert torch.equal(eager, compiled) and (eager.float() - want).abs().max() / want.abs().max() < 1e-2
print("python kernel")
"""


def test_without_a_cpp_compiler_the_python_kernel_serves(tmp_path):
    """A machine whose C++ compiler is missing (or `TPKIT_NATIVE_OP=0`) builds the C product only and registers the
    Python kernel: eager and compiled products alike run, equal."""
    for env in ({"CXX": str(tmp_path / "no-such-compiler"), "TPKIT_CACHE": str(tmp_path / "cache")},
                {"TPKIT_NATIVE_OP": "0"}):
        done = subprocess.run([sys.executable, "-c", _WITHOUT_CXX], capture_output=True, text=True, timeout=300,
                              env={**os.environ, **env})
        assert done.returncode == 0 and "python kernel" in done.stdout, (env, done.stderr[-2000:])


_OP_FIRST = """
import torch
from tpkit.quant import native
g = torch.Generator().manual_seed(0)
w = torch.randint(0, 256, (24, 64), dtype=torch.uint8, generator=g)
s = torch.rand(24, 1, generator=g).bfloat16()
args = native._op_args(torch.randn(2, 128, generator=g), w, native.KINDS["uint4"], s, None, 1, 128, 24, 8.0, 0, False)
assert not native._KERNEL  # nothing registered yet
first = torch.ops.tpkit.gemv.default(*args)
assert native._KERNEL and torch.equal(first, native._python_kernel(*args))
print("op first")
"""


def test_the_op_called_before_any_product_registers_its_kernel():
    """A graph or caller that reaches `tpkit::gemv` before any `native.gemv` in the process (a fresh process):
    the op's first call registers the CPU kernel and runs the product."""
    done = subprocess.run([sys.executable, "-c", _OP_FIRST], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "op first" in done.stdout, done.stderr[-2000:]
