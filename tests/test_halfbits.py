"""The half-format codecs of fastbwd/kernels/_halfbits.py, bit for bit.

Decoding is checked on all 65,536 patterns of each format; encoding against NumPy (float16) and
ml_dtypes (bfloat16) on 10^6 random floats of every magnitude plus the special values.
"""

import numpy as np
import pytest
from numba import njit, prange

from fastbwd.kernels._halfbits import BFLOAT16, FLOAT16, NATIVE, accumulator, load, store

from conftest import BF16

FORMATS = {np.dtype(np.float16): FLOAT16, BF16: BFLOAT16}


@njit(parallel=True)
def _decode(bits, fmt, out):
    for i in prange(bits.shape[0]):
        out[i] = load(bits[i], fmt)


@njit(parallel=True)
def _encode(values, fmt, out):
    for i in prange(values.shape[0]):
        out[i] = store(values[i], fmt)


@njit
def _sum(array, fmt):
    acc = accumulator(array, fmt)
    for i in range(array.shape[0]):
        acc += load(array[i], fmt)
    return acc


def _special_floats():
    f32 = np.finfo(np.float32)
    specials = [
        0.0,
        -0.0,
        np.inf,
        -np.inf,
        np.nan,
        -np.nan,
        f32.max,
        -f32.max,
        f32.tiny,
        -f32.tiny,
        f32.smallest_subnormal,
        -f32.smallest_subnormal,
        65504.0,
        65519.99,
        65520.0,
        -65520.0,
        1.0,
        -1.0,
        0.5,
        3.0e38,
    ]
    # float16 subnormals and the boundary to zero
    specials += [2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-14, 2.0**-15 * 1.5]
    # exact ties between adjacent half values (round to even both ways) and their neighbours
    for dtype in FORMATS:
        halves = np.arange(0, 0x7C00 if dtype == np.float16 else 0x7F80, 37, dtype=np.uint16).view(dtype)
        lo = halves.astype(np.float64)
        hi = (halves.view(np.uint16) + 1).view(dtype).astype(np.float64)
        ties = ((lo + hi) / 2).astype(np.float32)
        specials += list(ties) + list(-ties)
        specials += list(np.nextafter(ties, np.float32(np.inf))) + list(np.nextafter(ties, np.float32(0)))
    return np.array(specials, np.float32)


def _random_floats(count=1_000_000, seed=1):
    """Random float32 bit patterns: every exponent, both signs, NaN payloads included."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**32, size=count, dtype=np.uint64).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_decode_all_patterns(dtype):
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = np.empty(65536, np.float32)
    _decode(bits, FORMATS[dtype], out)
    expected = bits.view(dtype).astype(np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(out), nan)
    # every non-NaN decodes exactly, signed zeros and infinities included
    assert np.array_equal(out[~nan].view(np.uint32), expected[~nan].view(np.uint32))
    # NaN keeps its sign
    assert np.array_equal(np.signbit(out[nan]), np.signbit(expected[nan]))


@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_encode_matches_numpy_and_ml_dtypes(dtype):
    values = np.concatenate([_special_floats(), _random_floats()])
    out = np.empty(values.shape, np.uint16)
    _encode(values, FORMATS[dtype], out)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(dtype).view(np.uint16)
    nan = np.isnan(values)
    assert np.array_equal(out[~nan], expected[~nan]), (
        f"first mismatch at {values[~nan][out[~nan] != expected[~nan]][:5]}"
    )
    decoded = out[nan].view(dtype).astype(np.float32)
    assert np.isnan(decoded).all(), "NaN must encode to a NaN"
    assert np.array_equal(np.signbit(decoded), np.signbit(values[nan])), "NaN keeps its sign"


@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_round_trip_is_identity_on_every_pattern(dtype):
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    decoded = np.empty(65536, np.float32)
    _decode(bits, FORMATS[dtype], decoded)
    again = np.empty(65536, np.uint16)
    _encode(decoded, FORMATS[dtype], again)
    nan = np.isnan(bits.view(dtype).astype(np.float32))
    assert np.array_equal(again[~nan], bits[~nan])


def test_encode_rounds_to_nearest_even_at_ties():
    # 1 + 2^-8 lies halfway between bfloat16 1.0 and 1.0078125: even mantissa (1.0) wins
    tie_down = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8], np.float32)
    out = np.empty(2, np.uint16)
    _encode(tie_down, BFLOAT16, out)
    assert list(out.view(BF16).astype(np.float32)) == [1.0, 1.015625]
    # float16: 1 + 2^-11 is halfway between 1.0 and 1 + 2^-10
    _encode(np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11], np.float32), FLOAT16, out)
    assert list(out.view(np.float16).astype(np.float32)) == [1.0, 1 + 2.0**-9]


@pytest.mark.parametrize(
    "dtype, tiny, exact",
    [
        (np.float32, 2.0**-30, False),
        (np.float64, 2.0**-30, True),
        (np.complex64, 2.0**-30, False),
        (np.complex128, 2.0**-30, True),
    ],
)
def test_native_accumulator_precision(dtype, tiny, exact):
    # 1 + tiny survives only in a float64 / complex128 accumulator
    total = _sum(np.array([1.0, tiny], dtype), NATIVE)
    assert (total == 1.0 + tiny) == exact and abs(total - 1.0) <= tiny


@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_half_formats_accumulate_in_float32(dtype):
    # 1 + 2^-24 rounds to 1 in float32 (it would not in float64); 2^-24 is exact in both halves
    bits = np.array([1.0, 2.0**-24], dtype).view(np.uint16)
    assert _sum(bits, FORMATS[dtype]) == 1.0
    assert _sum(bits[1:], FORMATS[dtype]) == 2.0**-24
