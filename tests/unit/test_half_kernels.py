"""The data path's float16/bfloat16 conversions, both the vector code (F16C,
AVX2) and the portable scalar code, against numpy's and ml_dtypes' (round to
nearest even), bit for bit. These conversions run inside the MPI reduction of
16-bit floats and in every 16-bit scale (Average, pre/postscale)."""

import platform

import ml_dtypes
import numpy as np
import pytest

from kerasdist._core import capi as _capi

FLOAT16, BFLOAT16 = 0, 1
KINDS = {FLOAT16: np.dtype(np.float16), BFLOAT16: np.dtype(ml_dtypes.bfloat16)}
PATHS = [pytest.param(1, id="simd"), pytest.param(0, id="scalar")]


def _convert(dtype, to_float, simd, values):
    values = np.ascontiguousarray(values)
    out = np.empty(values.shape, np.float32 if to_float else np.uint16)
    rc = _capi.lib().kerasdist_convert16(
        dtype, 1 if to_float else 0, simd, values.ctypes.data,
        out.ctypes.data, values.size)
    assert rc == 0, _capi.lib().kerasdist_last_error()
    return out


def _same_bits_or_both_nan(got_bits, want, kind):
    got = got_bits.view(kind).astype(np.float32)
    want32 = want.astype(np.float32)
    nan = np.isnan(want32)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got_bits[~nan], want.view(np.uint16)[~nan])


def _awkward_floats(rng):
    """Float32 values that stress rounding: ties, subnormal results,
    overflow edges, infinities, NaNs, signed zeros, plus random ones."""
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0,
                         65504.0, 65519.99, 65520.0, 65536.0, 1e-8, -1e-8,
                         5.96e-8, 2.98e-8, 6.1e-5, 3.4e38, -3.4e38,
                         1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11,
                         1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], np.float32)
    every_exponent = ((rng.random(20000, np.float32) + 0.5)
                      * np.float32(2.0)
                      ** rng.integers(-30, 20, 20000).astype(np.float32))
    bits = rng.integers(0, 2 ** 32, 50000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([specials, every_exponent.astype(np.float32),
                           -every_exponent.astype(np.float32),
                           bits.view(np.float32)])


@pytest.mark.parametrize("simd", PATHS)
@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=["f16", "bf16"])
def test_widen_every_16_bit_pattern(dtype, simd):
    # All 65,536 patterns, odd length so the scalar tail runs as well.
    patterns = np.arange(2 ** 16, dtype=np.uint16)[:-3]
    got = _convert(dtype, True, simd, patterns)
    want = patterns.view(KINDS[dtype]).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan],
                                  want.view(np.uint32)[~nan])


@pytest.mark.parametrize("simd", PATHS)
@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=["f16", "bf16"])
def test_narrow_rounds_like_numpy(dtype, simd):
    values = _awkward_floats(np.random.default_rng(dtype))
    got = _convert(dtype, False, simd, values)
    with np.errstate(over="ignore", invalid="ignore"):
        want = values.astype(KINDS[dtype])
    _same_bits_or_both_nan(got, want, KINDS[dtype])


def _cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def test_simd_reported_as_the_cpu_allows_and_bad_dtype_is_refused():
    # The vector code needs x86-64 with AVX2 and F16C (as the kernel, which
    # also checks the OS saves the AVX registers, reports them).
    want = (platform.machine() == "x86_64"
            and {"avx2", "f16c"} <= _cpu_flags())
    assert _capi.lib().kerasdist_simd16() == int(want)
    x = np.zeros(4, np.float32)
    y = np.zeros(4, np.uint16)
    assert _capi.lib().kerasdist_convert16(2, 0, 1, x.ctypes.data,
                                           y.ctypes.data, 4) == -1
    assert b"float16 (0) or bfloat16 (1)" in _capi.lib().kerasdist_last_error()
