"""Assertions shared by every operator's tests: one tolerance table, one ulp rule, one
thread-count determinism check, one error matcher."""

import contextlib
import re

import ml_dtypes
import numba
import numpy as np

from .._errors import ACLNN_ERR_PARAM_INVALID, ParamError
from ..api._plans import launching

_BF16 = np.dtype(ml_dtypes.bfloat16)

#: (rtol, atol relative to max|expected|) for results compared with the float64 reference.
TOLERANCE = {
    np.dtype(np.float64): (1e-11, 1e-12),
    np.dtype(np.float32): (2e-5, 2e-6),
    np.dtype(np.complex128): (1e-11, 1e-12),
    np.dtype(np.complex64): (2e-5, 2e-6),
}


def _as_float64(array):
    array = np.asarray(array)
    if array.dtype.kind == "c":
        return array.astype(np.complex128)
    return array.astype(np.float64)


def _ordered_bits(values, dtype):
    """Half-format values as integers whose order and differences count ulps."""
    bits = np.asarray(values, dtype).view(np.uint16).astype(np.int64)
    return np.where(bits & 0x8000, 0x8000 - bits, bits)


def ulp_distance(actual, expected, dtype):
    """|actual - expected| in ulps of the half format ``dtype`` (both given in that dtype)."""
    return np.abs(_ordered_bits(actual, dtype) - _ordered_bits(expected, dtype))


def assert_matches_reference(actual, expected, *, rtol=None, atol=None, ulps=1, atol_scale=1e-6):
    """``actual`` (any supported dtype) against the float64 ``expected``.

    float32/float64/complex: ``|a - e| <= atol * max|e| + rtol * |e|`` from :data:`TOLERANCE`.
    float16/bfloat16: within ``ulps`` ulps of the reference rounded once to the same format
    (values whose magnitude is below ``atol_scale * max|e|`` may instead differ by that much:
    float32 accumulation can land anywhere near zero after cancellation).
    NaN must match NaN and infinities must match exactly.
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    a64, e64 = _as_float64(actual), _as_float64(expected)
    nan_a, nan_e = np.isnan(a64), np.isnan(e64)
    assert np.array_equal(nan_a, nan_e), f"NaN positions differ: {np.argwhere(nan_a != nan_e)[:5]}"
    finite = np.isfinite(e64)
    assert np.array_equal(a64[~finite & ~nan_e], e64[~finite & ~nan_e]), "infinities differ"
    a64, e64 = a64[finite], e64[finite]
    if e64.size == 0:
        return
    scale = float(np.max(np.abs(e64)))
    if actual.dtype in (np.dtype(np.float16), _BF16):
        rounded = e64.astype(actual.dtype)
        distance = ulp_distance(actual[finite], rounded, actual.dtype)
        small = np.abs(a64 - e64) <= atol_scale * scale
        bad = (distance > ulps) & ~small
        assert not bad.any(), (
            f"{int(bad.sum())} of {bad.size} values beyond {ulps} ulp: first actual "
            f"{a64[bad][:5]}, expected {e64[bad][:5]}, ulps {distance[bad][:5]}"
        )
        return
    default_rtol, default_atol = TOLERANCE[actual.dtype]
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    error = np.abs(a64 - e64)
    bound = atol * scale + rtol * np.abs(e64)
    bad = error > bound
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} values off: max error {error.max():.3g} "
        f"(scale {scale:.3g}); first actual {a64[bad][:5]}, expected {e64[bad][:5]}"
    )


def bitwise_equal(a, b):
    """Same shape, dtype and bytes (NaN payloads and signed zeros included)."""
    a, b = np.asarray(a), np.asarray(b)
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def thread_counts():
    """The thread counts to compare: 1, 2, 3 (an odd count: uneven shares of the tasks) and the
    most this process may use (``NUMBA_NUM_THREADS``), as far as they are available.

    With ``NUMBA_NUM_THREADS=2`` (a 2-core machine) that is only 1 and 2: tests/test_runtime.py
    therefore also runs every operator in a subprocess with ``NUMBA_NUM_THREADS=4``, more
    threads than cores, comparing 1, 2, 3 and 4."""
    maximum = numba.config.NUMBA_NUM_THREADS
    return sorted({1, 2, 3, maximum} & set(range(1, maximum + 1)))


def assert_thread_invariant(call):
    """``call()`` gives bitwise identical results for every thread count (tuples allowed).

    Small calls normally run the serial twins on the calling thread; here every call runs the
    parallel kernels on the thread count being checked, however small its input."""
    previous = numba.get_num_threads()
    results = {}
    try:
        with launching("parallel"):
            for count in thread_counts():
                numba.set_num_threads(count)
                result = call()
                results[count] = result if isinstance(result, tuple) else (result,)
    finally:
        numba.set_num_threads(previous)
    first_count, first = next(iter(results.items()))
    for count, result in results.items():
        for index, (x, y) in enumerate(zip(first, result)):
            if x is None and y is None:
                continue
            assert bitwise_equal(x, y), f"result {index} differs between {first_count} and {count} threads"


@contextlib.contextmanager
def raises_param_error(match, *, status=ACLNN_ERR_PARAM_INVALID, param=None):
    """Expect a ParamError whose message matches ``match`` (a regex), with the given status/param."""
    try:
        yield
    except ParamError as error:
        message = str(error)
        assert re.search(match, message), f"message {message!r} does not match {match!r}"
        assert error.status == status, f"status {error.status} != {status} ({message})"
        if param is not None:
            assert error.param == param, f"param {error.param!r} != {param!r} ({message})"
        assert isinstance(error, ValueError) and isinstance(error, TypeError)
    else:
        raise AssertionError(f"no ParamError raised (expected one matching {match!r})")
