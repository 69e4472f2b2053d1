"""The explicit vector intrinsics of fastbwd/kernels/_simd.py: exact, and bitwise the scalar loops."""

import numpy as np
import pytest
from numba import njit

from fastbwd.kernels._simd import LANES, lanes_axpy, transpose_lanes


@njit
def _transpose(destination, source, dr, dc, sr, sc):
    transpose_lanes(destination, dr, dc, source, sr, sc)


@njit
def _axpy(destination, row, column, source, source_row, source_column, scale):
    lanes_axpy(destination, row, column, source, source_row, source_column, scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_transpose_moves_exactly_one_tile(dtype):
    rng = np.random.default_rng(0)
    source = rng.standard_normal((LANES + 5, LANES + 9)).astype(dtype)
    source[3, 4] = np.nan
    destination = np.zeros((LANES + 7, LANES + 4), dtype)
    _transpose(destination, source, 2, 3, 1, 5)
    tile = source[1:1 + LANES, 5:5 + LANES].T
    assert np.array_equal(destination[2:2 + LANES, 3:3 + LANES], tile, equal_nan=True)
    destination[2:2 + LANES, 3:3 + LANES] = 0
    assert not destination.any(), "wrote outside the tile"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_axpy_is_bitwise_the_scalar_loop(dtype):
    rng = np.random.default_rng(1)
    destination = rng.standard_normal((3, LANES + 7)).astype(dtype)
    source = rng.standard_normal((4, LANES + 3)).astype(dtype)
    source[2, 5] = np.inf
    scale = dtype(0.3)
    expected = destination.copy()
    # multiply, then add: no fused multiply-add; nothing outside the 16 lanes changes
    expected[1, 4:4 + LANES] = expected[1, 4:4 + LANES] + scale * source[2, 2:2 + LANES]
    _axpy(destination, 1, 4, source, 2, 2, scale)
    assert destination.tobytes() == expected.tobytes()
