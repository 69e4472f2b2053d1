"""Unit tests of the shared separable engine (fastbwd.kernels._separable) on its own."""

import ml_dtypes
import numpy as np
import pytest

from fastbwd import _dtypes as d
from fastbwd.kernels import _separable as S
from fastbwd.testing.checks import assert_matches_reference, bitwise_equal

import kernel_twins
from _covering import float32_quick
from conftest import assert_thread_invariant


def random_band(rng, input_size, output_size, slots, dtype):
    """Random taps (some unused, some inputs never read) and weights, and the dense A."""
    targets = rng.integers(-2, input_size, size=(output_size, slots))
    targets[:, 0] = np.minimum(targets[:, 0], input_size - 2)  # leave the last input often empty
    weights = rng.uniform(-1, 1, size=(output_size, slots)).astype(dtype)
    dense = np.zeros((output_size, input_size))
    for o in range(output_size):
        for k in range(slots):
            if targets[o, k] >= 0:
                dense[o, targets[o, k]] += weights[o, k]
    return targets, weights, dense


def taps(height, th, wh, width, tw, ww, dtype=np.float32):
    return (*S.tap_table(th, wh, dtype), *S.tap_table(tw, ww, dtype)), (height, width)


def run(grad_nchw, tables, layout, dtype):
    """The engine on an NCHW-valued float array, in ``layout``; returns the NCHW-valued result."""
    n, c, oh, ow = grad_nchw.shape
    tables, (height, width) = tables
    grad = grad_nchw.astype(dtype)
    fmt = d.storage_format(dtype)
    if layout == "NHWC":
        result = np.empty((n, height, width, c), dtype)
        plan = S.plan(True, (n, oh, ow, c), result.shape, *tables, fmt)
        plan.run(d.kernel_view(np.ascontiguousarray(grad.transpose(0, 2, 3, 1))), d.kernel_view(result))
        return result.transpose(0, 3, 1, 2)
    result = np.empty((n, c, height, width), dtype)
    S.plan(False, (n * c, oh, ow), (n * c, height, width), *tables, fmt).run(d.kernel_view(grad), d.kernel_view(result))
    return result


# (H, W, OH, OW, C): widths below, at and between multiples of the 16 lanes (tiles that
# overlap their neighbour, scratch wider than the plane), partial row blocks, NHWC rows and
# channel counts shorter than 16, and grad rows long enough for the row-block kernel to
# prefetch the next task's rows (S.PREFETCH_MIN_ROW_BYTES).
ENGINE_SHAPES = [
    (9, 13, 7, 11, 3),
    (37, 21, 50, 45, 19),
    (33, 16, 16, 48, 16),
    (5, 3, 2, 7, 1),
    (20, 33, 17, 16, 35),
    (40, 70, 45, 130, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("shape", ENGINE_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("dtype", float32_quick([np.float32, np.float64, ml_dtypes.bfloat16, np.float16]))
def test_engine_matches_dense(dtype, shape):
    rng = np.random.default_rng(1)
    height, width, out_height, out_width, channels = shape
    weight_dtype = d.compute_dtype(dtype)
    th, wh, dense_h = random_band(rng, height, out_height, 3, weight_dtype)
    tw, ww, dense_w = random_band(rng, width, out_width, 2, weight_dtype)
    tables = taps(height, th, wh, width, tw, ww, weight_dtype)
    grad = rng.standard_normal((2, channels, out_height, out_width)).astype(dtype)
    expected = np.einsum("oh,ncop,pw->nchw", dense_h, grad.astype(np.float64), dense_w)
    nchw = run(grad, tables, "NCHW", dtype)
    assert_matches_reference(nchw, expected)
    assert bitwise_equal(nchw, np.ascontiguousarray(run(grad, tables, "NHWC", dtype)))


def test_inputs_without_sources_are_zero_and_nan_propagates():
    height, width = 4, 5
    # H: input 1 and 3 receive nothing; W: only input 0 and 4 receive.
    th = np.array([[0, -1], [2, 0]])
    wh = np.ones((2, 2), np.float32)
    tw = np.array([[0, 4], [4, -1], [0, 0]])
    ww = np.array([[1, 0], [2, 0], [0.5, 0.25]], np.float32)
    tables = taps(height, th, wh, width, tw, ww)
    grad = np.ones((1, 1, 2, 3), np.float32)
    result = run(grad, tables, "NCHW", np.float32)
    expected = np.zeros((1, 1, height, width))
    expected[0, 0, [0, 2]] = [1.75, 0, 0, 0, 2]
    expected[0, 0, 0] *= 2
    assert np.array_equal(result, expected)
    # A zero weight times Inf is NaN, exactly as the scatter formula says.
    grad[0, 0, 1, 0] = np.inf
    result = run(grad, tables, "NCHW", np.float32)[0, 0]
    assert np.isnan(result[[0, 2], 4]).all() and (result[[0, 2], 0] == np.inf).all()
    assert np.array_equal(result[[1, 3]], np.zeros((2, width))) and np.isfinite(result[:, 1:4]).all()
    assert bitwise_equal(result, np.ascontiguousarray(run(grad, tables, "NHWC", np.float32))[0, 0])


def test_tap_table_shapes():
    index, weight = S.tap_table([1, 2, 0], [0.5, 1, 2], np.float64)
    assert index.shape == weight.shape == (3, 1) and index.dtype == np.int64 and weight.dtype == np.float64
    index, weight = S.tap_table([[0, 1], [1, 1]], [[1, 0], [0.5, 0.5]], np.float32)
    assert index.flags.c_contiguous and weight.dtype == np.float32


def test_gather_table_order_and_repeats():
    index = np.array([[2, 2], [0, 2], [-1, 0]])
    weight = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    start, source, gathered = S.gather_table(index, weight, 4)
    assert start.tolist() == [0, 2, 2, 5, 5]  # input 3 has no source
    assert source.tolist() == [1, 2, 0, 0, 1]  # ascending output, then tap order
    assert gathered.tolist() == [3, 6, 1, 2, 4]


def test_thread_invariant_with_few_planes():
    # Few planes: the NCHW engine splits planes into row blocks; neither the split nor the
    # thread count nor the layout may change a bit.
    rng = np.random.default_rng(2)
    height, width, out_height, out_width = 61, 17, 130, 40
    th, wh, _ = random_band(rng, height, out_height, 2, np.float32)
    tw, ww, _ = random_band(rng, width, out_width, 2, np.float32)
    tables = taps(height, th, wh, width, tw, ww)
    grad = rng.standard_normal((1, 2, out_height, out_width)).astype(np.float32)
    assert_thread_invariant(lambda: run(grad, tables, "NCHW", np.float32))
    assert_thread_invariant(lambda: np.ascontiguousarray(run(grad, tables, "NHWC", np.float32)))
    whole = run(grad, tables, "NCHW", np.float32)
    whole_nhwc = np.ascontiguousarray(run(grad, tables, "NHWC", np.float32))
    assert bitwise_equal(whole, whole_nhwc)


@pytest.mark.parametrize("dtype", float32_quick([np.float32, ml_dtypes.bfloat16]))
def test_plane_lanes_and_row_blocks_agree(dtype):
    # Small planes run LANES planes at a time, large ones LANES rows at a time: same bits.
    rng = np.random.default_rng(3)
    height, width, out_height, out_width = 11, 7, 6, 13
    weight_dtype = d.compute_dtype(dtype)
    th, wh, dense_h = random_band(rng, height, out_height, 3, weight_dtype)
    tw, ww, dense_w = random_band(rng, width, out_width, 2, weight_dtype)
    (tables, _) = taps(height, th, wh, width, tw, ww, weight_dtype)
    planes = S.PLANE_LANES_MIN_PLANES + 5  # a partial last group of planes
    grad = rng.standard_normal((planes, out_height, out_width)).astype(dtype)
    fmt = d.storage_format(dtype)
    by_planes = np.empty((planes, height, width), dtype)
    by_rows = np.empty((planes, height, width), dtype)
    by_planes_kernel = kernel_twins.parallel(S._separable_bwd_planes)
    by_planes_kernel(d.kernel_view(grad), d.kernel_view(by_planes), *tables, fmt)
    kernel_twins.parallel(S._separable_bwd_nchw)(
        d.kernel_view(grad),
        d.kernel_view(by_rows),
        *S.gather_table(*tables[:2], height),
        *S.gather_table(*tables[2:], width),
        fmt,
    )
    assert bitwise_equal(by_planes, by_rows)
    expected = np.einsum("oh,nop,pw->nhw", dense_h, grad.astype(np.float64), dense_w)
    assert_matches_reference(by_planes, expected)
    public = np.empty_like(by_planes)
    S.plan(False, grad.shape, public.shape, *tables, fmt).run(d.kernel_view(grad), d.kernel_view(public))
    assert bitwise_equal(public, by_planes)
    assert_thread_invariant(
        lambda: by_planes_kernel(d.kernel_view(grad), d.kernel_view(by_planes), *tables, fmt) or by_planes.copy()
    )
