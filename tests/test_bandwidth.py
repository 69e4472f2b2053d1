"""The main job's yardstick kernels (bench/bandwidth.py)."""

import numpy as np
import pytest

from bench import bandwidth


def _expected_fill(size, pattern):
    shares = bandwidth.FILL_GROUPS
    expected = np.empty(size, pattern.dtype)
    for group in range(shares):
        first, stop = group * size // shares, (group + 1) * size // shares
        expected[first:stop] = np.resize(pattern, stop - first)
    return expected


@pytest.mark.parametrize("size", [0, 1, 63, 64 * 17 + 5, 100_003])
@pytest.mark.parametrize("shift", [0, 1, 3, 15])
@pytest.mark.parametrize("kernel", ["parallel", "serial"])
def test_stream_fill_values_and_bounds(size, shift, kernel):
    pattern = np.random.default_rng(size).standard_normal(37).astype(np.float32)
    raw = np.full(size + 32, np.nan, np.float32)
    destination = raw[shift : shift + size]  # several element offsets inside a cache line
    getattr(bandwidth.parallel_stream_fill, kernel)(destination, pattern)
    np.testing.assert_array_equal(destination, _expected_fill(size, pattern))
    assert np.isnan(raw[:shift]).all() and np.isnan(raw[shift + size :]).all()  # nothing outside


def test_stream_fill_misaligned_elements():
    # a destination not aligned to its element size takes plain stores throughout
    pattern = np.arange(1, 20, dtype=np.float32)
    raw = np.zeros(4 * 2000 + 8, np.uint8)
    destination = raw[1 : 1 + 4 * 2000].view(np.float32)
    bandwidth.parallel_stream_fill(destination, pattern)
    np.testing.assert_array_equal(destination, _expected_fill(2000, pattern))
    assert raw[0] == 0 and (raw[1 + 4 * 2000 :] == 0).all()


def test_copy():
    source = np.random.default_rng(0).standard_normal(10_001).astype(np.float32)
    destination = np.empty_like(source)
    bandwidth.parallel_copy(source, destination)
    np.testing.assert_array_equal(destination, source)
