"""Integer weights times bf16 activations as integer runs: each run of x made an integer by a power of two and
rounded, then exact integer products. Two paths: int16 runs (`gemv.c`'s X16, AVX2 builds: int8 and int4 weights, runs
of 32 to 128) and 15-bit runs split into bytes (VNNI_RUNS, AVX512-VNNI: int8 and int4 weights; runs of 128). Checked against the float64 product of the same rounded activations (the path is what
it says, exactly), against the float64 product of x itself within the documented bound (half a step per value,
the step 2^(e - 15) or 2^(e - 14) for a run whose largest |x| is below 2^e), and falling back to the other loops
where the runs do not fit the blocks or x holds inf or NaN. On every instruction-set path: a build without the runs
must equal the float64 product of x."""
from __future__ import annotations

import pytest
import torch

from tpkit.quant import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler built tpkit's native product here")

UNIT_MAX = 128  # gemv.c's longest int16 run; the VNNI runs are all this long


def runs_of(k: int, size: int, kind: str) -> tuple[int, int]:
    """(run length, bits) of the integer runs the build in use takes for `kind` weights, `k` inputs, scale blocks
    `size` wide (`x16_unit`, `i8_fits`), or (0, 0) where it keeps other loops."""
    paths = native.paths()
    if "vnni runs" in paths:
        return (UNIT_MAX, 15) if k % UNIT_MAX == 0 and size % UNIT_MAX == 0 else (0, 0)
    if "int16 runs" in paths:
        unit = min(size, UNIT_MAX)
        return (unit, 16) if unit % 32 == 0 and size % unit == 0 and k % unit == 0 else (0, 0)
    return 0, 0


def int_runs(x: torch.Tensor, unit: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as its runs of `bits`-bit integers stand for it, each value's step 2^(e - bits + 1)), float64: each run
    scaled by the power of two that puts its largest |x| below 2^(bits - 1), rounded half to even, saturated."""
    m, k = x.shape
    runs = x.double().view(m, k // unit, unit)
    e = torch.frexp(runs.abs().amax(-1, keepdim=True).float()).exponent
    step = torch.ldexp(torch.ones_like(runs[..., :1]), (e - bits + 1).double())
    q = torch.round(runs / step).clamp(-2 ** (bits - 1), 2 ** (bits - 1) - 1)
    return (q * step).view(m, k), step.expand_as(runs).reshape(m, k)


def takes_runs(x: torch.Tensor, unit: int) -> bool:
    """Whether `x` goes by the runs: every |x| below 2^100 (no inf or NaN), every run's largest |x| 0 or at least
    2^-100 (its scales stay within float32)."""
    top = x.double().abs().view(x.shape[0], -1, unit).amax(-1)
    return bool((top < 2.0 ** 100).all() and ((top == 0) | (top >= 2.0 ** -100)).all())


def _blocks(t: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    return t.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


def _weights(kind: str, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(stored weight, its integer values as float64, storage offset) of `kind`"""
    if kind == "uint4":
        u4 = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        return (u4[:, 0::2] | (u4[:, 1::2] << 4)).contiguous(), u4.double(), 8.0
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    if kind == "uint8":
        return q8.view(torch.uint8), q8.view(torch.uint8).double(), 128.0
    return q8, q8.double(), 0.0


def _check(x: torch.Tensor, kind: str, n: int, block: tuple[int, int], zeros: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    k = x.shape[1]
    stored, values, offset = _weights(kind, n, k, g)
    nb, kb = -(-n // block[0]), -(-k // block[1])
    s = (torch.rand(nb, kb, generator=g) + 0.1).bfloat16()
    zero = torch.randint(-8, 8, (nb, kb), dtype=torch.int8, generator=g) if zeros else None
    z = 0.0 if zero is None else _blocks(zero, block, (n, k)).double()
    dense = (values - z - offset) * _blocks(s.double(), block, (n, k))
    got = native._run(x.float(), stored, native.KINDS[kind], s, zero, *block, n, offset, 0, True).double()
    exact = x.double() @ dense.t()
    unit, bits = runs_of(k, block[1], kind)
    if unit and takes_runs(x, unit):
        rounded, step = int_runs(x, unit, bits)
        scale = exact.abs().max() + (rounded.abs() @ dense.abs().t()).max()
        assert float((got - rounded @ dense.t()).abs().max() / scale) < 1e-6, (kind, block)
        bound = step @ dense.abs().t()  # per output: each value off by at most its step
        assert bool(((got - exact).abs() <= bound + 1e-6 * exact.abs().max()).all()), (kind, block)
        assert not torch.equal(rounded, x.double())  # the check above measured the runs' rounding
    else:  # the float32 loops (as test_native.py holds them: offsets of 128 cancel in float32 sums)
        finite = exact.isfinite()
        assert torch.equal(got.isfinite(), finite), (kind, block)  # inf and NaN where the float64 product has them
        top = float(exact[finite].abs().max()) if finite.any() else 0.0
        assert torch.allclose(got[finite], exact[finite], rtol=1e-5, atol=1e-5 * top), (kind, block)


@pytest.mark.parametrize("kind", ["int8", "uint8", "uint4"])
@pytest.mark.parametrize("n,k,block", [(64, 256, (1, 128)), (37, 384, (4, 64)), (5, 1024, (2, 256)),
                                         (16, 512, (1, 512)), (9, 320, (1, 32)), (7, 200, (1, 100)),
                                         (6, 96, (1, 96))])
@pytest.mark.parametrize("rows", [1, 5])
def test_integer_weights_by_bf16_inputs_equal_the_product_of_the_integer_runs(kind, n, k, block, rows, build):
    """Blocks of 32 to 512 (int16 runs of 32 to 128, several per block; a 96-wide block: runs of 96; VNNI runs of 128
    only), per-channel, with and without zero points, activations from 1e-3 to 1e2 in each run; blocks 100 wide keep
    the float32 loops."""
    g = torch.Generator().manual_seed(n * k + rows)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 2, k)[torch.randperm(k, generator=g)]
    for zeros in (False, True):
        _check(x.bfloat16(), kind, n, block, zeros, n + k + rows)


def test_runs_of_zeros_small_and_large_values_inf_and_nan_fall_where_they_should(build):
    """A run of zeros (its step 2^-15), runs of values near 2^-95 and 2^90 (scaled without leaving float32's range);
    a run near 2^-120, a value of 2^100, an inf or a NaN send the call to the float32 loops (inf and NaN come out as
    the float64 product has them)."""
    g = torch.Generator().manual_seed(11)
    k = 256
    x = torch.randn(3, k, generator=g)
    x[0, :128] = 0.0
    x[1, :128] *= 2.0 ** -96
    x[2] *= 2.0 ** 88
    assert takes_runs(x.bfloat16(), 128)
    _check(x.bfloat16(), "uint4", 8, (1, 128), False, 1)
    for bad in (2.0 ** -120, 2.0 ** 100, float("inf"), float("nan")):
        y = x.clone()
        y[1, 130:140] = bad
        if bad < 1:
            y[1, 128:] *= 2.0 ** -120
        assert not takes_runs(y.bfloat16(), 128)
        _check(y.bfloat16(), "int8", 8, (1, 128), True, 2)
        _check(y.bfloat16(), "uint4", 8, (1, 128), True, 3)


def test_each_build_reports_the_runs_its_instruction_set_has(build):
    """The paths a build reports (`native.paths()`): the int16 runs on AVX2 builds only, the VNNI runs on builds with
    AVX512-VNNI (native, where the CPU has it, and "avx512-vnni"), AVX512-BF16's dot products on builds with it
    (native, where the CPU has it, and "avx512-bf16"); none on the "avx512" build (as Skylake-X) and on x86-64's
    baseline."""
    flags = set(native._cpu().split())
    avx512 = {"avx512f", "avx512bw"} <= flags
    expected = {"baseline": set(), "avx2": {"int16 runs"}, "avx512": set(), "avx512-vnni": {"vnni runs"},
                "avx512-bf16": {"bf16 dot"},
                "native": ({"bf16 dot"} if avx512 and "avx512_bf16" in flags else set())
                | ({"vnni runs"} if avx512 and "avx512_vnni" in flags else set())
                | ({"int16 runs"} if not avx512 and "avx2" in flags else set())}
    assert native.paths() == expected[build]
