"""The explicit vector and memory intrinsics of fastbwd/kernels/_lanes.py (with _lane_tiles.py and _lane_rows.py) and _memory.py: exact, and
bitwise the scalar loops."""

import ml_dtypes
import numpy as np
import pytest
from numba import njit

from fastbwd import _dtypes as d
from fastbwd.kernels._halfbits import store
from fastbwd.kernels._lane_rows import lanes_shifted_sum
from fastbwd.kernels._lane_tiles import (
    decode_transpose_lanes,
    gather_transpose_lanes,
    lanes_axpy,
    lanes_gather_sum,
    transpose_lanes,
)
from fastbwd.kernels._lanes import LANES
from fastbwd.kernels._memory import (
    LINE_BYTES,
    cells_per_line,
    copy_out,
    copy_out_reading_ahead,
    copy_part_line,
    prefetch,
    prefetch_for_write,
    store_fence,
    stream_line_with_ends,
)


@njit
def _transpose(destination, source, dr, dc, sr, sc, fmt):
    transpose_lanes(destination, dr, dc, source, sr, sc, fmt)


@njit
def _store_each(out, values, fmt):
    """``out[i] = store(values[i])``: the scalar encoding (``out`` holds kernel_view elements)."""
    for i in range(values.size):
        out[i] = store(values[i], fmt)


@njit
def _axpy(destination, row, column, source, source_row, source_column, scale):
    lanes_axpy(destination, row, column, source, source_row, source_column, scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_transpose_moves_exactly_one_tile_and_encodes_like_store(dtype):
    rng = np.random.default_rng(0)
    compute = d.compute_dtype(dtype)
    source = (rng.standard_normal((LANES + 5, LANES + 9)) * 1e3).astype(compute)
    # NaN, infinities, overflow past the half formats, rounding ties and subnormals
    source[3, 4], source[5, 6], source[6, 7], source[7, 8] = np.nan, np.inf, -np.inf, 1e6
    source[8, 9] = 1.0 + 2.0**-8  # a bfloat16 tie: rounds to even
    source[9, 10] = 1e-7
    fmt = d.storage_format(dtype)
    destination = d.kernel_view(np.zeros((LANES + 7, LANES + 4), dtype))
    _transpose(destination, source, 2, 3, 1, 5, fmt)
    tile = np.ascontiguousarray(source[1 : 1 + LANES, 5 : 5 + LANES].T)
    expected = np.empty(LANES * LANES, destination.dtype)
    _store_each(expected, tile.ravel(), fmt)
    expected = expected.reshape(LANES, LANES)
    assert destination[2 : 2 + LANES, 3 : 3 + LANES].tobytes() == expected.tobytes()
    destination[2 : 2 + LANES, 3 : 3 + LANES] = 0
    assert not destination.any(), "wrote outside the tile"


@njit
def _decode_transpose(destination, dr, dc, source, sr, sc, count, fmt):
    decode_transpose_lanes(destination, dr, dc, source, sr, sc, count, fmt)


@pytest.mark.covering(strength=1)  # each case compiles a kernel of its own (no disk cache)
@pytest.mark.parametrize("count", [LANES, 7, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_decode_transpose_moves_count_columns_and_reads_no_further(dtype, count):
    rng = np.random.default_rng(4)
    compute = d.compute_dtype(dtype)
    source = rng.standard_normal((LANES + 3, LANES + 6)).astype(dtype)
    source[4, 5] = np.nan
    # the tile ends at the last element of the array: a read past `count` columns of its last
    # row would leave the array (the masked loads read nothing there)
    sc = source.shape[1] - count
    tile_rows = source[3 : 3 + LANES]
    destination = np.full((LANES + 2, LANES + 5), 7, compute)
    _decode_transpose(destination, 1, 4, d.kernel_view(tile_rows), 0, sc, count, d.storage_format(dtype))
    expected = np.full((LANES + 2, LANES + 5), 7, compute)
    expected[1 : 1 + count, 4 : 4 + LANES] = tile_rows[:, sc : sc + count].astype(compute).T
    assert destination.tobytes() == expected.tobytes()


def test_tile_intrinsics_refuse_non_contiguous_arrays():
    # their addressing assumes 2-D C-contiguous arrays: anything else must not compile
    from numba.core.errors import TypingError

    matrix = np.zeros((LANES, LANES), np.float32)
    with pytest.raises(TypingError):
        _transpose(matrix, matrix.T, 0, 0, 0, 0, d.storage_format(np.float32))
    with pytest.raises(TypingError):
        _decode_transpose(matrix[:, ::2], 0, 0, matrix, 0, 0, 4, d.storage_format(np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_axpy_is_bitwise_the_scalar_loop(dtype):
    rng = np.random.default_rng(1)
    destination = rng.standard_normal((3, LANES + 7)).astype(dtype)
    source = rng.standard_normal((4, LANES + 3)).astype(dtype)
    source[2, 5] = np.inf
    scale = dtype(0.3)
    expected = destination.copy()
    # multiply, then add: no fused multiply-add; nothing outside the 16 lanes changes
    expected[1, 4 : 4 + LANES] = expected[1, 4 : 4 + LANES] + scale * source[2, 2 : 2 + LANES]
    _axpy(destination, 1, 4, source, 2, 2, scale)
    assert destination.tobytes() == expected.tobytes()


@njit
def _gather_sum(destination, row, column, source, index, weights, start, stop, source_column, fmt):
    lanes_gather_sum(destination, row, column, source, index, weights, start, stop, source_column, fmt)


@njit
def _gather_transpose(destination, row, column, source, index, weights, starts, first, count, source_column, fmt):
    gather_transpose_lanes(destination, row, column, source, index, weights, starts, first, count, source_column, fmt)


def _scalar_gathered_sum(source, index, weights, start, stop, source_column):
    """The plain loop the intrinsics replace: from +0.0, multiply then add, in list order."""
    total = np.zeros(LANES, weights.dtype)
    for s in range(start, stop):
        total = total + weights[s] * source[index[s], source_column : source_column + LANES].astype(weights.dtype)
    return total


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_gather_sum_is_bitwise_the_scalar_loop(dtype):
    rng = np.random.default_rng(2)
    compute = d.compute_dtype(dtype)
    source = rng.standard_normal((6, LANES + 5)).astype(dtype)
    source[4, 7] = np.inf
    index = np.array([3, 0, 4, 0, 5], np.int64)  # repeats and any order
    weights = rng.standard_normal(5).astype(compute)
    destination = np.full((3, LANES + 4), 7, compute)
    _gather_sum(destination, 1, 2, d.kernel_view(source), index, weights, 1, 5, 3, d.storage_format(dtype))
    expected = np.full((3, LANES + 4), 7, compute)
    expected[1, 2 : 2 + LANES] = _scalar_gathered_sum(source, index, weights, 1, 5, 3)
    assert destination.tobytes() == expected.tobytes()
    # an empty list stores +0.0
    _gather_sum(destination, 1, 2, d.kernel_view(source), index, weights, 2, 2, 3, d.storage_format(dtype))
    assert destination[1, 2 : 2 + LANES].tobytes() == np.zeros(LANES, compute).tobytes()


@pytest.mark.parametrize("count", [LANES, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16])
def test_gather_transpose_is_the_transposed_scalar_sums(dtype, count):
    rng = np.random.default_rng(3)
    compute = d.compute_dtype(dtype)
    source = rng.standard_normal((9, LANES + 2)).astype(dtype)
    lists = 2 + count  # lists 2 .. 2 + count - 1 are used; reading past them would be a bug
    lengths = rng.integers(0, 4, size=lists)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    index = rng.integers(0, 9, size=starts[-1]).astype(np.int64)
    weights = rng.standard_normal(starts[-1]).astype(compute)
    destination = np.full((LANES + 3, LANES + 2), 7, compute)
    _gather_transpose(
        destination, 1, 2, d.kernel_view(source), index, weights, starts, 2, count, 1, d.storage_format(dtype)
    )
    expected = np.full((LANES + 3, LANES + 2), 7, compute)
    for r in range(LANES):
        if r < count:
            expected[1 : 1 + LANES, 2 + r] = _scalar_gathered_sum(
                source, index, weights, starts[2 + r], starts[3 + r], 1
            )
        else:
            expected[1 : 1 + LANES, 2 + r] = 0
    assert destination.tobytes() == expected.tobytes()


@njit
def _prefetch_all(array):
    flat = array.reshape(array.size)
    for i in range(flat.size):
        prefetch(flat, i)
        prefetch_for_write(flat, i)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16])
def test_prefetch_is_only_a_hint(dtype):
    array = np.arange(1000).astype(dtype).reshape(10, 100)
    before = array.copy()
    _prefetch_all(array)
    assert array.tobytes() == before.tobytes()


@njit
def _shifted_sum(destination, row, column, source, source_row, source_column, count):
    lanes_shifted_sum(destination, row, column, source, source_row, source_column, count)


def _scalar_shifted_sum(row, column, count):
    total = np.zeros(LANES, row.dtype)
    for i in range(count):
        total = total + row[column + i : column + i + LANES]
    return total


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shifted_sum_is_the_scalar_loop(dtype):
    rng = np.random.default_rng(6)
    source = rng.standard_normal((2, 3 * LANES)).astype(dtype)
    source[1, 9] = -0.0  # 0 + (-0.0) is +0.0, as in the scalar loop
    for count in (0, 1, 3):
        destination = np.full((3, LANES + 4), 7, dtype)
        _shifted_sum(destination, 2, 1, source, 1, 5, count)
        expected = np.full((3, LANES + 4), 7, dtype)
        expected[2, 1 : 1 + LANES] = _scalar_shifted_sum(source[1], 5, count)
        assert destination.tobytes() == expected.tobytes()


@njit
def _copy_out_then_fence(destination, first, source, source_first, count, streaming, read_ahead):
    if read_ahead < 0:
        copy_out(destination, first, source, source_first, count, streaming)
    else:
        copy_out_reading_ahead(destination, first, source, source_first, count, streaming, read_ahead)
    store_fence()


@pytest.mark.covering(strength=1)  # each case compiles a kernel of its own (no disk cache)
@pytest.mark.parametrize("read_ahead", [-1, 0, 5, 1 << 40])  # -1: copy_out; far past the end: a hint
@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16, np.complex128])
def test_copy_out_copies_exactly_its_range_at_every_alignment(dtype, streaming, read_ahead):
    # streaming stores need a line-aligned destination: the head up to the first line
    # boundary and the tail are plain stores; a misaligned (odd-byte) destination never streams
    rng = np.random.default_rng(8)
    source = (rng.standard_normal(300) * 100).astype(dtype)
    per_line = LINE_BYTES // np.dtype(dtype).itemsize
    for first in range(per_line + 1):
        for count in (0, 1, per_line - 1, per_line, 2 * per_line + 3, 5 * per_line + 1, 200):
            destination = np.zeros(260, dtype)
            _copy_out_then_fence(destination, first, source, 7, count, streaming, read_ahead)
            expected = np.zeros(260, dtype)
            expected[first : first + count] = source[7 : 7 + count]
            assert destination.tobytes() == expected.tobytes(), (first, count)
    raw = np.zeros(260 * np.dtype(dtype).itemsize + 1, np.uint8)
    odd = raw[1:].view(dtype)  # not aligned to its element size
    _copy_out_then_fence(odd, 3, source, 0, 100, streaming, read_ahead)
    assert odd[3:103].tobytes() == source[:100].tobytes() and not odd[:3].any() and not odd[103:].any()


@njit
def _copy_part_line(destination, first, source, source_first, count):
    copy_part_line(destination, first, source, source_first, count)


@pytest.mark.parametrize("dtype", [np.uint16, np.float32, np.float64, np.complex64, np.complex128])
def test_copy_part_line_copies_exactly_its_range(dtype):
    # every count below a line's bytes, at every byte alignment of both ends
    per_line = LINE_BYTES // np.dtype(dtype).itemsize
    itemsize = np.dtype(dtype).itemsize
    source_bytes = np.arange(1, 3 * LINE_BYTES + 1, dtype=np.uint8)
    for shift in range(itemsize + 1):  # the source and destination misaligned by any bytes
        source = source_bytes[shift : shift + 2 * LINE_BYTES].view(dtype)
        for count in range(per_line):
            for first in (0, 1, per_line - 1):
                raw = np.zeros(3 * LINE_BYTES + 1, np.uint8)
                destination = raw[1 + shift : 1 + shift + 2 * LINE_BYTES].view(dtype)
                _copy_part_line(destination, first, source, 2, count)
                expected = np.zeros_like(raw)
                expected[1 + shift : 1 + shift + 2 * LINE_BYTES].view(dtype)[first : first + count] = source[
                    2 : 2 + count
                ]
                assert raw.tobytes() == expected.tobytes(), (shift, count, first)


@njit
def _stream_line_with_ends(
    destination, first, source, source_index, next_source_index, split, first_lane, first_value, last_lane, last_value
):
    stream_line_with_ends(
        destination,
        first,
        source,
        source_index,
        next_source_index,
        split,
        first_lane,
        first_value,
        last_lane,
        last_value,
    )
    store_fence()


@pytest.mark.parametrize("dtype", [np.uint16, np.float32, np.float64, np.complex64, np.complex128])
def test_stream_line_with_ends_builds_exactly_its_line(dtype):
    # lanes below split from the first run, the rest from the second, two lanes replaced (lanes
    # outside the line replace nothing; the last value wins on a shared lane), one line written
    per_line = LINE_BYTES // np.dtype(dtype).itemsize
    rng = np.random.default_rng(9)
    source = (rng.standard_normal(6 * per_line) * 100 + 1).astype(dtype)
    edges = rng.standard_normal(2) * 1000
    if np.dtype(dtype).kind == "c":  # both halves of a complex value
        edges = edges + 1j * rng.standard_normal(2) * 1000
    first_value, last_value = edges.astype(dtype)
    raw = np.zeros(6 * LINE_BYTES, np.uint8)
    shift = -raw.ctypes.data % LINE_BYTES
    destination = raw[shift : shift + 4 * LINE_BYTES].view(dtype)  # line-aligned
    for split in range(per_line + 1):
        for first_lane, last_lane in ((0, per_line - 1), (split, split - 1), (-3, per_line), (2, 2), (per_line - 1, 0)):
            destination[:] = 0
            _stream_line_with_ends(
                destination,
                per_line,
                source,
                3,
                2 * per_line + 1,
                split,
                first_lane,
                first_value,
                last_lane,
                last_value,
            )
            expected = np.zeros_like(destination)
            line = expected[per_line : 2 * per_line]
            line[:split] = source[3 : 3 + split]
            line[split:] = source[2 * per_line + 1 + split : 3 * per_line + 1]
            if 0 <= first_lane < per_line:
                line[first_lane] = first_value
            if 0 <= last_lane < per_line:
                line[last_lane] = last_value
            assert destination.tobytes() == expected.tobytes(), (split, first_lane, last_lane)


@njit
def _cells_per_line(array):
    return cells_per_line(array)


def test_cells_per_line():
    for dtype in (np.uint16, np.float32, np.float64, np.complex128):
        assert _cells_per_line(np.zeros(1, dtype)) == LINE_BYTES // np.dtype(dtype).itemsize
