"""tpkit's compiled small-batch products (`gemv.c`): built once per machine, called as one op of torch's.

Decode multiplies one activation row (a few, batched) by every weight: its time is the weight's bytes read from
memory, and torch's CPU paths for a quantized or half-precision weight read them slower than memory allows (bf16
`F.linear` at batch 1 no faster than float32's twice the bytes; `_weight_int8pack_mm` a third of memory speed; no
kernel at all for FP8; float32 `F.linear` at one row about 60% of memory speed on a 2-core EPYC). `gemv.c` streams
each weight row once, decoding it in registers (bf16, fp16, int8, packed int4 pairs, FP8 e4m3; float32 as it is)
with float32 sums and per-block scales and zero points, the scales and zero points read
where the checkpoint stored them (float32, bf16 or fp16 scales; int8 or packed int32 zero points; the values'
storage offset a scalar): a layer keeps no table beside its stored tensors. bf16 activations times bf16 or FP8
weights take AVX512-BF16's dot products where the CPU has them (exact products, float32 sums, no decode to float32);
int8 and int4 weights times bf16 activations take AVX512-VNNI's byte products where it has those, and on AVX2 CPUs
(AMD Zen 3) integer products of words: both of x made integers per run of 128 (within 2^-14 of each run's largest
|x|: `paths()`).
Each call's scratch (sums of x, x rearranged) lives in one buffer per thread, reused: a decode step calls this for
every layer, and the allocations had been a quarter of a small layer's call.

It is compiled on first use with the C compiler (`CC`, default `cc`; `-O3 -march=native -fopenmp-simd`) into
`$TPKIT_CACHE` (default `~/.cache/tpkit`), keyed by the source, the compiler and the CPU, written atomically; where
no compiler works `available()` is False and callers keep torch's paths (`TPKIT_NATIVE=0` turns it off;
`TPKIT_NATIVE_ISA` picks the instruction set: `ISA_FLAGS`). `gemv` calls it through the dispatcher's op
`tpkit::gemv` (a fake implementation gives the shape, so the layers that use it stay traceable), whose CPU kernel is
C++ (`gemv_op.cpp`, built the same way with `CXX` against torch's headers) where that builds, else Python through
ctypes (`TPKIT_NATIVE_OP=0` keeps the Python one).
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

KINDS = {"bf16": 0, "fp16": 1, "int8": 2, "uint8": 3, "uint4": 4, "fp8": 5, "fp32": 6}
SCALE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the scale dtypes read in place
ZERO_KINDS = {torch.int8: 1, torch.int32: 2}  # int8 values; int32 words packing 32 / zero_bits rows each
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemv.c")
_LOCK = threading.Lock()
_LIB: list = []  # [ctypes function or None], once tried


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def cache_root() -> str:
    """Where tpkit keeps what it makes once and reuses (compiled code, decided plans): `$TPKIT_CACHE`, default
    `~/.cache/tpkit`."""
    return os.environ.get("TPKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tpkit")


def compile_library(source: str, flags: tuple[str, ...] = (), cxx: bool = False,
                    remember_failure: bool = False) -> ctypes.CDLL | None:
    """The C file `source` compiled (`-O3 -march=native`, then `flags`) into a shared library in the cache and
    loaded, or None where no compiler works. Keyed by the source's bytes, the compiler, the CPU, torch's version and
    the flags, so an edit or another machine builds anew; written atomically, so processes building at once do not
    clash. `cxx`: a C++ file against torch's headers and libraries (`CXX`, default `c++`): its static registrations
    (an op's kernel) run as it loads. `remember_failure`: a compile that fails leaves a mark under the same key, and
    later processes do not try again (for an optional build, as the op's OpenMP one, whose fall-back serves; delete
    the mark, `<key>.failed` in the cache, to retry)."""
    compiler = os.environ.get("CXX", "c++") if cxx else os.environ.get("CC", "cc")
    with open(source, "rb") as f:
        text = f.read()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    command = [compiler, "-O3", "-march=native", *(_torch_flags() if cxx else ("-fopenmp-simd",)), *flags]
    key = hashlib.sha256(text + version + _cpu().encode() + torch.__version__.encode()
                         + " ".join(command).encode()).hexdigest()[:16]
    root = cache_root()
    stem = os.path.splitext(os.path.basename(source))[0]
    path = os.path.join(root, f"{stem}-{key}.so")
    failed = path[:-3] + ".failed"
    if remember_failure and os.path.exists(failed):
        return None
    if not os.path.exists(path):
        try:
            os.makedirs(root, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
            os.close(fd)
        except OSError:  # an unwritable cache: no compiled code, the callers' torch paths
            return None
        try:
            link = _torch_libraries() if cxx else ()
            done = subprocess.run([*command, "-shared", "-fPIC", source, "-o", tmp, *link], capture_output=True,
                                  timeout=300)
            if done.returncode != 0:
                if remember_failure:
                    with open(failed, "w") as mark:  # (empty: its presence is the record)
                        mark.write("")
                return None
            os.replace(tmp, path)  # atomic: a concurrent build by another process writes the same bytes
        except (OSError, subprocess.SubprocessError):
            return None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def _torch_flags() -> tuple[str, ...]:
    """A C++ file's flags against this torch: its headers, its C++ standard and ABI."""
    from torch.utils import cpp_extension

    return ("-std=c++17", "-w", *(f"-I{p}" for p in cpp_extension.include_paths()),
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}")


def _torch_libraries() -> tuple[str, ...]:
    """A C++ file's link against this torch's libraries, found again where they are when it loads."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return (f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}")


def build(flags: tuple[str, ...] = ()):
    """The compiled product (`tp_gemv` as a ctypes function), built with `flags` after the defaults (a test
    builds the portable path with `("-mno-avx512f",)`), or None where no compiler works."""
    lib = compile_library(_SOURCE, flags)
    if lib is None:
        return None
    fn = lib.tp_gemv
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    c_int = ctypes.c_int
    fn.argtypes = [c_int, i64, i64, i64, ptr, ptr, ptr, c_int, ptr, c_int, c_int, ctypes.c_float, i64, i64, i64, ptr,
                   i64, i64, ptr, ptr, ptr, ptr]
    fn.restype = None
    fn.paths = {name for bit, name in ((1, "bf16 dot"), (2, "int16 runs"), (4, "vnni runs")) if lib.tp_paths() & bit}
    fn.call = lib.tp_gemv_call  # the op's kernels call this: float32 or bf16 activations, its scratch laid out in
    # one buffer given
    fn.call.argtypes = [c_int, i64, i64, i64, ptr, ptr, ptr, c_int, ptr, c_int, c_int, ctypes.c_float, i64, i64, i64,
                        ptr, i64, i64, c_int, c_int, ptr, i64]
    fn.call.restype = i64
    fn.rows_per_task = lib.tp_rows_per_task  # the grain the op's C++ kernel splits a product's rows by, over threads
    fn.rows_per_task.argtypes = [c_int, i64]
    fn.rows_per_task.restype = i64
    return fn


# `TPKIT_NATIVE_ISA`: the instruction set the product is built for. "native" (the default): everything this CPU has
# (`-march=native`: the AVX-512 loops where it has AVX-512F and BW, AVX512-BF16's dot products for bf16 activations
# where it has that too, and AVX512-VNNI's byte products for int8 and int4 weights times bf16 activations where it
# has that); "avx512-bf16": the same without VNNI (int4 weights by the bf16 dot products: exact, 1.2x slower);
# "avx512-vnni": without AVX512-BF16 (as Ice Lake: int8 and int4 weights by VNNI, the rest by float32 multiply-adds);
# "avx512": without AVX512-BF16 and VNNI (as Skylake-X: float32 multiply-adds throughout); "avx2":
# the same CPU without AVX-512 (AVX2, FMA and F16C intrinsics: the float32 loops at 8 lanes, and int8 / int4 weights
# by the int16 runs of bf16 activations); "baseline": x86-64's SSE2 only (the portable loops the compiler
# vectorizes). A CPU runs each path it has, so the tests run every one here and compare them with the dequantized
# product.
ISA_FLAGS = {"native": (), "avx512-bf16": ("-mno-avx512vnni",), "avx512-vnni": ("-mno-avx512bf16",),
             "avx512": ("-mno-avx512bf16", "-mno-avx512vnni"), "avx2": ("-mno-avx512f",),
             "baseline": ("-march=x86-64", "-mtune=generic")}


def isa() -> str:
    """The `TPKIT_NATIVE_ISA` path asked for (see `ISA_FLAGS`); an unknown name raises, naming the choices."""
    name = os.environ.get("TPKIT_NATIVE_ISA", "native")
    if name not in ISA_FLAGS:
        raise ValueError(f"TPKIT_NATIVE_ISA={name!r}: choose one of {', '.join(ISA_FLAGS)}")
    return name


def _op_wanted() -> bool:
    """Whether the op's C++ kernel may be built and used (`TPKIT_NATIVE_OP=0` keeps the Python kernel)."""
    return os.environ.get("TPKIT_NATIVE_OP", "1") != "0"


def wanted() -> bool:
    """Whether compiled code may run (`TPKIT_NATIVE=0` keeps every caller on its torch path)."""
    return os.environ.get("TPKIT_NATIVE", "1") != "0"


def _function():
    if not _LIB:
        with _LOCK:
            if not _LIB:
                _LIB.append(build(ISA_FLAGS[isa()]) if wanted() else None)
    return _LIB[0]


def paths() -> set[str]:
    """The products this build takes for bf16 activations besides the float32 loops (`gemv.c`'s `tp_paths`): "bf16
    dot" (AVX512-BF16's dot products: bf16, FP8 weights, and int4 where there are no "vnni runs", exact), "int16
    runs" (AVX2 builds: int8 and int4 weights times x made int16 per run, within 2^-14 of each run's largest |x|),
    "vnni runs" (AVX512-VNNI: int8 and int4 weights times x made 15-bit integers per run of 128, within 2^-14 of each
    run's largest |x|)."""
    return set(_function().paths) if available() else set()


def build_id() -> str:
    """What a calibration's product rates were measured with (`tpkit.estimate`'s profile records it): a digest of
    `gemv.c`, the op's kernel (`gemv_op.cpp`: how a product is split over threads; or the Python kernel, with
    `TPKIT_NATIVE_OP=0`) and the instruction set asked for (`TPKIT_NATIVE_ISA`), or "torch" where no compiled product
    runs (`TPKIT_NATIVE=0`, no compiler). A profile measured with another build prices the products as they ran
    then."""
    if not available():
        return "torch"
    op = _op_wanted()
    digest = hashlib.sha256(isa().encode() + (b"" if op else b" python kernel"))
    for source in (_SOURCE, _OP_SOURCE) if op else (_SOURCE,):
        with open(source, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def available() -> bool:
    """Whether the compiled products can run here (a C compiler built them, or a build is cached)."""
    return _function() is not None


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a fake tensor wrapped as a parameter keeps its own type, FakeTensor


def fake(t: torch.Tensor) -> bool:
    """Whether `t` has no data to read (a fake tensor of a traced step). A plain tensor or parameter that is not a
    functionalization wrapper (which may wrap a fake one) is answered without torch's `is_fake`, which unwraps
    subclasses (~2 us, three times per decode product; the type and wrapper checks ~0.2 us)."""
    if type(t) in _PLAIN and not torch._is_functional_tensor(t):
        return False
    return is_fake(t)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_SCRATCH = threading.local()  # per thread (thread-ranks call at once): one buffer the calls' scratch areas share


def _python_kernel(x: torch.Tensor, w: torch.Tensor, kind: int, scale: torch.Tensor | None, scale_kind: int,
                   zero: torch.Tensor | None, zero_kind: int, zero_bits: int, bh: int, bw: int, kb: int, n: int,
                   offset: float, bf16: bool) -> torch.Tensor:
    """The op's CPU kernel where the C++ one (`gemv_op.cpp`) was not built: the product through ctypes, its scratch
    in this thread's buffer, grown as the product asks (`tp_gemv_call`): decode calls it for every layer and token,
    and one buffer spares each call its allocations."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype)
    args = (kind, m, n, k, x.data_ptr(), w.data_ptr(), _ptr(scale), scale_kind, _ptr(zero), zero_kind, zero_bits,
            offset, bh, bw, kb, y.data_ptr(), 0, n, x.dtype == torch.bfloat16, bf16)
    while True:
        buf = getattr(_SCRATCH, "buf", None)
        room = 0 if buf is None else buf.numel() - 64
        base = 0 if buf is None else -(-buf.data_ptr() // 64) * 64
        need = _function().call(*args, base or None, room)
        if need <= room:
            return y
        _SCRATCH.buf = torch.empty(need + 64, dtype=torch.uint8)


def _op_args(x: torch.Tensor, w: torch.Tensor, kind: int, scale: torch.Tensor | None, zero: torch.Tensor | None,
             bh: int, bw: int, n: int, offset: float, zero_bits: int, bf16: bool) -> tuple:
    """The op's arguments: the stored tensors with their dtypes' codes (`SCALE_KINDS`, `ZERO_KINDS`) and the scale
    blocks per row, computed here once for both kernels."""
    kb = 0 if scale is None else (scale.shape[-1] if scale.dim() > 1 else 1)
    return (x, w, kind, scale, 0 if scale is None else SCALE_KINDS[scale.dtype], zero,
            0 if zero is None else ZERO_KINDS[zero.dtype], zero_bits, bh, bw, kb, n, offset, bf16)


def _run(x: torch.Tensor, w: torch.Tensor, kind: int, scale: torch.Tensor | None, zero: torch.Tensor | None,
         bh: int, bw: int, n: int, offset: float, zero_bits: int, bf16: bool = False) -> torch.Tensor:
    """`x` `[M, K]` float32 or bf16 (contiguous) times the decoded `w` (`[N, ...]` bytes) -> `[M, N]` in x's dtype
    (float32 sums; bf16 rounded to nearest, as torch rounds) by this process's kernel (`_kernel`). `bf16`: x's values
    are bf16 (a bf16 model's activations), so bf16, int4 and FP8 weights may take the bf16 dot products, int8 and
    int4 the int16 runs."""
    return _kernel()(*_op_args(x, w, kind, scale, zero, bh, bw, n, offset, zero_bits, bf16))


# The op a compiled graph calls (and eager code, where its kernel is C++): defined on the dispatcher, not by
# `torch.library.custom_op`, whose wrappers (autograd, functionalization) cost 14 us of each call (9 in a compiled
# graph: 30 us per product instead of 21, ~0.5 ms per token of a TP2 decode's 57 products). Its CPU kernel is
# registered by the first product (`_kernel`): `gemv_op.cpp` where it builds, else `_python_kernel`. It has no
# backward: `gemv` refuses inputs that ask for a gradient (its callers never pass one: `dense_applies`,
# `QuantizedLinear`).
_LIBRARY = torch.library.Library("tpkit", "FRAGMENT")  # (the namespace holds tpkit's other ops too)
_LIBRARY.define("gemv(Tensor x, Tensor w, int kind, Tensor? scale, int scale_kind, Tensor? zero, int zero_kind, "
                "int zero_bits, int bh, int bw, int kb, int n, float offset, bool bf16) -> Tensor")
_OP_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemv_op.cpp")
_KERNEL: dict = {}  # "op": the C++ library or None (registered once), "bound": the product it calls


@torch.library.register_fake("tpkit::gemv", lib=_LIBRARY)
def _(x, w, kind, scale, scale_kind, zero, zero_kind, zero_bits, bh, bw, kb, n, offset, bf16):
    return x.new_empty(x.shape[0], n, dtype=x.dtype if x.dtype == torch.bfloat16 else torch.float32)


_op = torch.ops.tpkit.gemv.default


def _first_call(*args) -> torch.Tensor:
    """The op's kernel until `_kernel` has registered the CPU one (a graph or a caller that reaches the op before
    any `gemv` in this process): registers it, then runs the product. A CPU kernel, once there, is dispatched before
    this one."""
    return _kernel()(*args)


_LIBRARY.impl("gemv", _first_call, "CompositeExplicitAutograd")


def _kernel():
    """What runs a product in this process: the op (its C++ kernel, bound to `_function()`'s build, rebound when
    that changes, as the tests' builds per instruction set do), or `_python_kernel` where the C++ kernel was not
    built (no C++ compiler or torch headers; `TPKIT_NATIVE_OP=0`). Registers the op's CPU kernel on first use."""
    fn = _function()
    if fn is None:
        raise RuntimeError("tpkit's native product is not built here (native.available() is False): use torch's")
    if "op" not in _KERNEL:
        with _LOCK:
            if "op" not in _KERNEL:
                op = None
                if _op_wanted():  # threaded where OpenMP builds, else serial
                    op = ((torch._C.has_openmp and compile_library(_OP_SOURCE, ("-fopenmp",), cxx=True,
                                                                   remember_failure=True))
                          or compile_library(_OP_SOURCE, cxx=True))
                if op is None:
                    _LIBRARY.impl("gemv", _python_kernel, "CPU")
                _KERNEL["op"] = op
    op = _KERNEL["op"]
    if op is None:
        return _python_kernel
    if _KERNEL.get("bound") is not fn:
        op.tp_bind(ctypes.cast(fn.call, ctypes.c_void_p), ctypes.cast(fn.rows_per_task, ctypes.c_void_p))
        _KERNEL["bound"] = fn
    return _op


def gemv(x: torch.Tensor, w: torch.Tensor, kind: str, n: int, scale: torch.Tensor | None = None,
         zero: torch.Tensor | None = None, block: tuple[int, int] = (1, 1), offset: int = 0,
         zero_bits: int = 0) -> torch.Tensor:
    """`x @ W^T` for `x` `[..., K]` (any floating dtype; the product is float32, returned in `x`'s dtype) and the
    weight `w` of `kind` (`KINDS`) with `n` rows, read as its bytes whatever its dtype (the stored tensor itself:
    int32 words, FP8, int8, bf16). `scale`: `[ceil(n / block[0]), KB]` (or `[1]`: one for all) in float32, bf16 or
    fp16, each entry covering `block` = (rows, columns) of the weight; `zero`: the zero points over the same blocks,
    int8 `[ceil(n / block[0]), KB]` or int32 words `[ceil(n / (32 / zero_bits)), KB]` packing `32 / zero_bits` rows
    each (compressed-tensors' layout, values stored plus `2 ** (zero_bits - 1)`); `offset`: the values' storage
    offset, subtracted as a zero point. Every tensor contiguous on the CPU, read in place. Needs `available()`."""
    if scale is not None and scale.dtype not in SCALE_KINDS:
        raise TypeError(f"native.gemv: scales in {scale.dtype} (read in place: {list(SCALE_KINDS)})")
    if zero is not None and (zero.dtype not in ZERO_KINDS or (zero.dtype == torch.int32) != (zero_bits in (4, 8))):
        raise TypeError(f"native.gemv: zero points in {zero.dtype} with zero_bits {zero_bits} (int8 values, or "
                        f"int32 words with zero_bits 4 or 8)")
    if zero is not None and scale is None:
        raise ValueError("native.gemv: zero points cover the scales' blocks: give the scales too")
    if not all(t is None or t.is_contiguous() for t in (w, scale, zero)):
        raise ValueError("native.gemv: the weight, scales and zero points are read in place: each contiguous")
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        raise RuntimeError("native.gemv has no backward: call it without a gradient (torch.no_grad()), or use "
                           "torch's product of the dequantized weight")
    flat = x.reshape(-1, x.shape[-1])  # bf16 read as it is; other dtypes as float32
    flat = (flat if flat.dtype == torch.bfloat16 else flat.to(torch.float32)).contiguous()
    args = _op_args(flat, w, KINDS[kind], scale, zero, int(block[0]), int(block[1]), int(n), float(offset),
                    int(zero_bits), x.dtype == torch.bfloat16)
    traced = torch.compiler.is_compiling() or fake(flat) or fake(w)  # no data to read: the op's fake implementation
    y = _op(*args) if traced else _kernel()(*args)  # (a graph's first call registers the kernel: `_first_call`)
    return (y if y.dtype == x.dtype else y.to(x.dtype)).view(*x.shape[:-1], n)
