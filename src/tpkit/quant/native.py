"""tpkit's compiled small-batch products (`gemv.c`): built once per machine, loaded with ctypes, one op for torch.

Decode multiplies one activation row (a few, batched) by every weight: its time is the weight's bytes read from
memory, and torch's CPU paths for a quantized or half-precision weight read them slower than memory allows (bf16
`F.linear` at batch 1 no faster than float32's twice the bytes; `_weight_int8pack_mm` a third of memory speed; no
kernel at all for FP8). `gemv.c` streams each weight row once, decoding it in registers (bf16, fp16, int8, packed
int4 pairs, FP8 e4m3) with float32 sums and per-block scales and zero points.

It is compiled on first use with the C compiler (`CC`, default `cc`; `-O3 -march=native -fopenmp-simd`) into
`$TPKIT_CACHE` (default `~/.cache/tpkit`), keyed by the source, the compiler and the CPU, written atomically; where
no compiler works `available()` is False and callers keep torch's paths (`TPKIT_NATIVE=0` turns it off). `gemv`
calls it directly in eager mode and through the custom op `tpkit::gemv` under `torch.compile` (a fake
implementation gives the shape), so the layers that use it stay traceable.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading

import torch
from torch._subclasses.fake_tensor import is_fake

KINDS = {"bf16": 0, "fp16": 1, "int8": 2, "uint8": 3, "uint4": 4, "fp8": 5}
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemv.c")
_LOCK = threading.Lock()
_LIB: list = []  # [ctypes function or None], once tried


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC", "cc")
    with open(_SOURCE, "rb") as f:
        source = f.read()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256(source + version + _cpu().encode()).hexdigest()[:16]
    root = os.environ.get("TPKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tpkit")
    path = os.path.join(root, f"gemv-{key}.so")
    if not os.path.exists(path):
        os.makedirs(root, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
        os.close(fd)
        try:
            done = subprocess.run([cc, "-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", _SOURCE, "-o", tmp],
                                  capture_output=True, timeout=120)
            if done.returncode != 0:
                return None
            os.replace(tmp, path)  # atomic: a concurrent build by another process writes the same bytes
        except (OSError, subprocess.SubprocessError):
            return None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(path)
    fn = lib.tp_gemv
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr]
    fn.restype = None
    return fn


def _function():
    if not _LIB:
        with _LOCK:
            if not _LIB:
                _LIB.append(None if os.environ.get("TPKIT_NATIVE", "1") == "0" else _build())
    return _LIB[0]


def available() -> bool:
    """Whether the compiled products can run here (a C compiler built them, or a build is cached)."""
    return _function() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _run(x: torch.Tensor, w: torch.Tensor, kind: int, scale: torch.Tensor | None, zero: torch.Tensor | None,
         bh: int, bw: int, n: int) -> torch.Tensor:
    """`x` `[M, K]` float32 (contiguous) times the decoded `w` (`[N, ...]` bytes) -> `[M, N]` float32."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    kb = 0 if scale is None else scale.shape[-1]
    sums = torch.empty(m, max(kb, 1), dtype=torch.float32) if zero is not None else None
    halves = torch.empty(m, k, dtype=torch.float32) if kind == KINDS["uint4"] else None
    _function()(kind, m, n, k, _ptr(x), _ptr(w), _ptr(scale), _ptr(zero), bh, bw, kb, _ptr(y), 0, n, _ptr(sums),
                _ptr(halves))
    return y


@torch.library.custom_op("tpkit::gemv", mutates_args=())
def _op(x: torch.Tensor, w: torch.Tensor, kind: int, scale: torch.Tensor | None, zero: torch.Tensor | None,
        bh: int, bw: int, n: int) -> torch.Tensor:
    return _run(x, w, kind, scale, zero, bh, bw, n)


@_op.register_fake
def _(x, w, kind, scale, zero, bh, bw, n):
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


def gemv(x: torch.Tensor, w: torch.Tensor, kind: str, n: int, scale: torch.Tensor | None = None,
         zero: torch.Tensor | None = None, block: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """`x @ W^T` for `x` `[..., K]` (any floating dtype; the product is float32, returned in `x`'s dtype) and the
    weight `w` of `kind` (`KINDS`) with `n` rows, read as its bytes whatever its dtype (the stored tensor itself:
    int32 words, FP8, int8, bf16); `scale` / `zero` float32 `[ceil(n / block[0]), KB]`, each entry
    covering `block` = (rows, columns) of the weight. Every tensor contiguous on the CPU. Needs `available()`."""
    flat = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    args = (flat, w, KINDS[kind], scale, zero, int(block[0]), int(block[1]), int(n))
    traced = torch.compiler.is_compiling() or is_fake(flat) or is_fake(w)  # no data to read: the op's fake impl
    y = _op(*args) if traced else _run(*args)
    return y.to(x.dtype).view(*x.shape[:-1], n)
