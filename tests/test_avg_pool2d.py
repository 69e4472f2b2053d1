"""avg_pool2d_backward (docs/semantics.md §2) against the float64 reference, its forward's adjoint, the
canonical cases of other frameworks' bug reports, every dtype and layout, threads, out=, strides,
and every error of docs/semantics.md."""

import itertools

import numpy as np
import pytest

import fastbwd
from fastbwd import avg_pool2d_backward as pool_bwd
from fastbwd.testing import reference as ref
from fastbwd.testing.checks import assert_matches_reference, bitwise_equal

import kernel_twins
from _covering import float32_quick
from conftest import (
    BF16,
    DTYPES,
    channels_last,
    nan_cells_are_the_positive_nan,
    raises_param_error,
    random,
    to_nhwc,
    with_signed_nan,
)


def pair(value):
    return tuple(value) * (2 // len(value)) if isinstance(value, (tuple, list)) else (value, value)


def pooled_shape(input_shape, kernel, stride, padding, ceil_mode):
    (kh, kw), (sh, sw), (ph, pw) = pair(kernel), pair(stride), pair(padding)
    height, width = input_shape[-2:]
    return (
        *input_shape[:-2],
        ref.avg_pool2d_output_size(height, kh, sh, ph, ceil_mode),
        ref.avg_pool2d_output_size(width, kw, sw, pw, ceil_mode),
    )


def reference(grad_output, input_shape, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override=0):
    return ref.avg_pool2d_backward(
        grad_output,
        input_shape,
        pair(kernel),
        pair(stride),
        pair(padding),
        ceil_mode,
        count_include_pad,
        divisor_override,
    )


def random_case(rng, ndim=None):
    """A random valid case: non-square, 3-D or 4-D, every parameter differing per axis."""
    ndim = ndim or int(rng.integers(3, 5))
    while True:
        height, width = (int(s) for s in rng.integers(1, 12, size=2))
        kernel = tuple(int(k) for k in rng.integers(1, 6, size=2))
        stride = tuple(int(s) for s in rng.integers(1, 5, size=2))
        padding = tuple(int(rng.integers(0, k // 2 + 1)) for k in kernel)
        ceil_mode = bool(rng.integers(2))
        input_shape = tuple(int(s) for s in rng.integers(1, 4, size=ndim - 2)) + (height, width)
        if min(pooled_shape(input_shape, kernel, stride, padding, ceil_mode)[-2:]) >= 1:
            count_include_pad = bool(rng.integers(2))
            divisor_override = int(rng.choice([0, 0, 0, 3, -2, 7]))
            return input_shape, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override


# --------------------------------------------------------------------------------------------
# canonical cases from other frameworks' bug reports
# --------------------------------------------------------------------------------------------


def test_ceil_mode_window_overhanging_the_input_1x5():
    # Windows [0,2), [2,4), [4,6): the last one holds one input cell and no padding, so its
    # divisor is 1, not the kernel's 2.
    grad_output = np.ones((1, 1, 1, 3), np.float32)
    result = pool_bwd(grad_output, (1, 1, 1, 5), (1, 2), (1, 2), 0, True)
    assert np.array_equal(result, [[[[0.5, 0.5, 0.5, 0.5, 1.0]]]])


@pytest.mark.parametrize("count_include_pad", [True, False])
def test_6x6_k3_s2_p1_ceil_mode(count_include_pad):
    # Along each axis the windows are [-1,2), [1,4), [3,6), [5,8): the last overhangs the
    # padding (size + pad = 7), so it counts 2 cells with padding, 1 without.
    grad_output = np.ones((1, 1, 4, 4))
    result = pool_bwd(grad_output, (1, 1, 6, 6), 3, 2, 1, True, count_include_pad)
    if count_include_pad:
        axis = np.array([1 / 3, 1 / 3 + 1 / 3, 1 / 3, 1 / 3 + 1 / 3, 1 / 3, 1 / 3 + 1 / 2])
    else:
        axis = np.array([1 / 2, 1 / 2 + 1 / 3, 1 / 3, 1 / 3 + 1 / 3, 1 / 3, 1 / 3 + 1])
    np.testing.assert_allclose(result[0, 0], np.outer(axis, axis), rtol=1e-14)
    assert_matches_reference(result, reference(grad_output, (1, 1, 6, 6), 3, 2, 1, True, count_include_pad))


def test_7x7_k2_s3_ceil_mode():
    # Windows [0,2), [3,5), [6,8) -> [6,7): cells 2 and 5 are in no window.
    result = pool_bwd(np.ones((1, 1, 3, 3)), (1, 1, 7, 7), 2, 3, 0, True)
    axis = np.array([0.5, 0.5, 0.0, 0.5, 0.5, 0.0, 1.0])
    assert np.array_equal(result[0, 0], np.outer(axis, axis))


def test_stride_larger_than_kernel_leaves_zeros():
    grad_output = random((2, 3, 3, 2), np.float32, 1) + 5  # no cell sums to zero by accident
    result = pool_bwd(grad_output, (2, 3, 11, 10), (2, 3), (4, 6), 0)
    covered_h = np.zeros(11, bool)  # windows [0,2), [4,6), [8,10)
    covered_h[[0, 1, 4, 5, 8, 9]] = True
    covered_w = np.zeros(10, bool)  # windows [0,3), [6,9)
    covered_w[[0, 1, 2, 6, 7, 8]] = True
    covered = np.outer(covered_h, covered_w)
    assert np.all(result[..., ~covered] == 0) and np.all(result[..., covered] != 0)
    assert_matches_reference(result, reference(grad_output, (2, 3, 11, 10), (2, 3), (4, 6), 0, False, True))


@pytest.mark.parametrize(
    "ceil_mode, count_include_pad, divisor_override", list(itertools.product([False, True], [False, True], [0, 5, -3]))
)
def test_divisor_override_x_count_include_pad_x_ceil_mode(ceil_mode, count_include_pad, divisor_override):
    input_shape, kernel, stride, padding = (2, 3, 8, 11), (3, 4), (2, 3), (1, 2)
    grad_output = random(pooled_shape(input_shape, kernel, stride, padding, ceil_mode), np.float32, 4)
    result = pool_bwd(grad_output, input_shape, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    assert_matches_reference(
        result,
        reference(grad_output, input_shape, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override),
    )
    if divisor_override:  # count_include_pad no longer matters
        other = pool_bwd(
            grad_output, input_shape, kernel, stride, padding, ceil_mode, not count_include_pad, divisor_override
        )
        assert bitwise_equal(result, other)


@pytest.mark.slow
def test_output_shape_agreement_grid():
    """Every (size, k, s, p, ceil_mode): accepted exactly when the pooled size is >= 1 and
    grad_output has it (PyTorch's shape when torch is installed, else the reference's formula)."""
    try:
        import torch
    except ImportError:
        torch = None
    for size, k, s, ceil_mode in itertools.product(range(1, 10), range(1, 6), range(1, 5), (False, True)):
        for p in range(k // 2 + 1):
            expected = ref.avg_pool2d_output_size(size, k, s, p, ceil_mode)
            if torch is not None:
                try:
                    expected = torch.nn.functional.avg_pool2d(
                        torch.zeros(1, 1, size, 2), (k, 1), (s, 1), (p, 0), ceil_mode
                    ).shape[2]
                except RuntimeError:  # torch: output size too small
                    assert expected < 1, (size, k, s, p, ceil_mode)
            if expected < 1:
                with raises_param_error(r"kernel_size\[0\] must leave an output height >= 1", param="kernel_size"):
                    pool_bwd(np.zeros((1, 1, 1, 2)), (1, 1, size, 2), (k, 1), (s, 1), (p, 0), ceil_mode)
                continue
            grad_output = np.arange(1.0, expected + 1).reshape(1, 1, expected, 1) * np.ones(2)
            result = pool_bwd(grad_output, (1, 1, size, 2), (k, 1), (s, 1), (p, 0), ceil_mode, False)
            assert_matches_reference(
                result, reference(grad_output, (1, 1, size, 2), (k, 1), (s, 1), (p, 0), ceil_mode, False)
            )
            with raises_param_error(
                rf"grad_output\.shape\[2\] must be {expected} \(output height", param="grad_output"
            ):
                pool_bwd(np.zeros((1, 1, expected + 1, 2)), (1, 1, size, 2), (k, 1), (s, 1), (p, 0), ceil_mode)


# --------------------------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", float32_quick(DTYPES), ids=str)
def test_matches_reference_random_cases(dtype):
    rng = np.random.default_rng(7)
    for case in range(30):
        input_shape, kernel, stride, padding, ceil_mode, include_pad, override = random_case(rng)
        grad_output = random(pooled_shape(input_shape, kernel, stride, padding, ceil_mode), dtype, case)
        result = pool_bwd(grad_output, input_shape, kernel, stride, padding, ceil_mode, include_pad, override)
        assert result.dtype == dtype and result.shape == input_shape
        expected = reference(grad_output, input_shape, kernel, stride, padding, ceil_mode, include_pad, override)
        assert_matches_reference(result, expected)


def test_adjoint_of_the_forward():
    rng = np.random.default_rng(11)
    for case in range(40):
        input_shape, kernel, stride, padding, ceil_mode, include_pad, override = random_case(rng)
        x = random(input_shape, np.float64, 100 + case)
        g = random(pooled_shape(input_shape, kernel, stride, padding, ceil_mode), np.float64, 200 + case)
        forward = ref.avg_pool2d_forward(x, pair(kernel), pair(stride), pair(padding), ceil_mode, include_pad, override)
        backward = pool_bwd(g, input_shape, kernel, stride, padding, ceil_mode, include_pad, override)
        lhs, rhs = np.sum(g * forward), np.sum(backward * x)
        assert np.isclose(lhs, rhs, rtol=1e-12, atol=1e-12 * np.sum(np.abs(g))), case


def test_full_jacobian_tiny():
    input_shape, kernel, stride, padding = (1, 4, 5), (3, 2), (2, 3), (1, 1)
    out_shape = pooled_shape(input_shape, kernel, stride, padding, True)
    size_in, size_out = int(np.prod(input_shape)), int(np.prod(out_shape))
    jacobian = np.zeros((size_out, size_in))
    for k in range(size_in):
        e = np.zeros(size_in)
        e[k] = 1
        jacobian[:, k] = ref.avg_pool2d_forward(e.reshape(input_shape), kernel, stride, padding, True, False).ravel()
    for k in range(size_out):
        e = np.zeros(size_out)
        e[k] = 1
        result = pool_bwd(e.reshape(out_shape), input_shape, kernel, stride, padding, True, False)
        np.testing.assert_allclose(result.ravel(), jacobian[k], rtol=1e-15, atol=0)


def test_never_nan_or_inf_for_valid_arguments():
    rng = np.random.default_rng(5)
    for case in range(60):
        input_shape, kernel, stride, padding, ceil_mode, include_pad, override = random_case(rng, ndim=4)
        grad_output = random(pooled_shape(input_shape, kernel, stride, padding, ceil_mode), np.float32, case)
        result = pool_bwd(grad_output, input_shape, kernel, stride, padding, ceil_mode, include_pad, override)
        assert np.all(np.isfinite(result)), (input_shape, kernel, stride, padding, ceil_mode, include_pad)
    # extreme but valid: a window of one cell inside a huge padded kernel, the largest divisors
    result = pool_bwd(np.ones((1, 1, 2, 2), np.float32), (1, 1, 1, 1), 2**30, 1, 2**29, False, True)
    assert np.isfinite(result).all() and result[0, 0, 0, 0] > 0
    result = pool_bwd(np.ones((1, 1, 2, 2), np.float32), (1, 1, 4, 4), 2, 2, 0, False, True, -(2**63))
    assert np.isfinite(result).all() and np.all(result < 0)


def test_global_pooling_divides_like_pytorch():
    # One window covering the whole input: g / divisor, exactly as PyTorch rounds it.
    grad_output = random((3, 4, 1, 1), np.float32, 6)
    result = pool_bwd(grad_output, (3, 4, 5, 6), (7, 8), 1, (1, 1), False, True)
    assert bitwise_equal(result, np.broadcast_to(grad_output / np.float32(56), (3, 4, 5, 6)).copy())
    result = pool_bwd(grad_output, (3, 4, 5, 6), (7, 8), 1, (1, 1), False, False)
    assert bitwise_equal(result, np.broadcast_to(grad_output / np.float32(30), (3, 4, 5, 6)).copy())
    result = pool_bwd(grad_output, (3, 4, 5, 6), (5, 6), 3, 0, True, True, -7)
    assert bitwise_equal(result, np.broadcast_to(grad_output / np.float32(-7), (3, 4, 5, 6)).copy())


@pytest.mark.parametrize("dtype", float32_quick(DTYPES), ids=str)
def test_global_pooling_divides_exactly_in_both_layouts(dtype):
    # The global kernels (NCHW and NHWC) divide each gradient by the integer divisor, rounded
    # once, exactly as PyTorch does: bit for bit g / d, never g * (1 / d) (1 ulp apart for many g).
    grad_output = random((3, 37, 1, 1), dtype, 23)
    compute = np.float64 if dtype == np.float64 else np.float32
    for kernel, padding, include_pad, override, divisor in [
        ((7, 8), (1, 1), True, 0, 56),
        ((5, 6), 0, True, 0, 30),
        ((7, 8), (1, 1), False, 0, 30),
        ((5, 6), 0, True, -7, -7),
    ]:
        want = (grad_output.astype(compute) / compute(divisor)).astype(dtype)
        want = np.broadcast_to(want, (3, 37, 5, 6))
        for x in (np.zeros((3, 37, 5, 6), dtype), channels_last(np.zeros((3, 37, 5, 6), dtype))):
            result = pool_bwd(grad_output, x, kernel, 9, padding, False, include_pad, override)
            assert bitwise_equal(np.ascontiguousarray(result), np.ascontiguousarray(want)), (kernel, x.strides)


@pytest.mark.parametrize("dtype", float32_quick(DTYPES), ids=str)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_global_pooling_every_dtype_and_layout(dtype, layout):
    grad_output = random((2, 5, 1, 1), dtype, 8)
    x = np.zeros((2, 5, 7, 7), dtype)
    if layout == "NHWC":
        x = channels_last(x)
    result = pool_bwd(grad_output, x, 7, 1, 0, False, True)
    assert result.dtype == dtype
    assert (layout == "NHWC") == (result.transpose(0, 2, 3, 1).flags.c_contiguous and not result.flags.c_contiguous)
    assert_matches_reference(result, reference(grad_output, x.shape, 7, 1, 0, False, True))


# 1x1 outputs whose single window misses rows or columns (or both): not global pooling. The
# uncovered cells get no gradient. (input (H, W), kernel, stride, padding, ceil_mode)
PARTIAL_1X1 = [
    ((5, 3), (3, 3), (3, 3), (0, 0), False),  # misses rows 3-4
    ((3, 5), (3, 3), (3, 3), (0, 0), False),  # misses columns 3-4
    ((4, 4), (3, 3), (5, 5), (1, 1), False),  # padded window [-1, 2): misses rows and columns 2-3
    ((3, 6), (4, 2), (9, 9), (1, 1), True),  # rows covered with padding, columns 1-5 missed
    ((6, 3), (2, 4), (9, 9), (1, 1), True),  # columns covered with padding, rows 1-5 missed
]


@pytest.mark.parametrize("size, kernel, stride, padding, ceil_mode", PARTIAL_1X1)
@pytest.mark.parametrize("count_include_pad, divisor_override", [(True, 0), (False, 0), (True, -3)])
@pytest.mark.parametrize("dtype", float32_quick([np.float32, BF16]), ids=str)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_1x1_output_with_partial_coverage_is_not_global(
    size, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, dtype, layout
):
    input_shape = (2, 3) + size
    assert pooled_shape(input_shape, kernel, stride, padding, ceil_mode)[-2:] == (1, 1)
    grad_output = random((2, 3, 1, 1), dtype, 21)
    x = np.zeros(input_shape, dtype)
    if layout == "NHWC":
        x = channels_last(x)  # a 1x1 grad_output takes the input's layout
    args = (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    result = pool_bwd(grad_output, x, *args)
    expected = reference(grad_output, input_shape, *args)
    assert_matches_reference(result, expected)
    uncovered = expected == 0
    assert uncovered.any() and np.all(np.asarray(result, np.float64)[uncovered] == 0)


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_global_pooling_with_padding_divisor(count_include_pad, layout):
    # A 4 x 7 kernel padded by (1, 2) on a 3 x 5 input: one window covers everything; its
    # divisor counts the padding (4 * 7 = 28) or not (3 * 5 = 15).
    grad_output = random((2, 4, 1, 1), np.float32, 22)
    x = np.zeros((2, 4, 3, 5), np.float32)
    if layout == "NHWC":
        x = channels_last(x)
    result = pool_bwd(grad_output, x, (4, 7), 9, (1, 2), False, count_include_pad)
    divisor = np.float32(28 if count_include_pad else 15)
    assert bitwise_equal(np.ascontiguousarray(result), np.broadcast_to(grad_output / divisor, (2, 4, 3, 5)).copy())


@pytest.mark.parametrize("dtype, half_ulp", [(np.float16, 2.0**-11), (BF16, 2.0**-8)], ids=str)
def test_half_formats_round_once(dtype, half_ulp):
    # Input cell 2 sums 1 + half_ulp + half_ulp (divisor override 1, stride 1, kernel 1x3):
    # rounding after every addition would give 1; float32 and rounding once give 1 + ulp.
    grad_output = np.array([[[1.0, half_ulp, half_ulp]]], dtype)
    result = pool_bwd(grad_output, (1, 1, 5), (1, 3), 1, 0, False, True, 1)
    assert result[0, 0, 2] == np.array(1.0 + 2 * half_ulp, dtype)


def test_nan_and_inf_propagate():
    # Windows along each axis: [-1,2), [1,4), [3,6), [5,8).
    grad_output = np.zeros((1, 1, 4, 4), np.float32)
    grad_output[0, 0, 0, 0] = np.nan
    grad_output[0, 0, 3, 3] = np.inf
    grad_output[0, 0, 3, 1] = -np.inf
    result = pool_bwd(grad_output, (1, 1, 6, 6), 3, 2, 1, True)
    assert np.isnan(result[0, 0, 0, 0]) and np.isnan(result[0, 0, 1, 1])
    assert result[0, 0, 5, 5] == np.inf and result[0, 0, 5, 3] == -np.inf
    assert result[0, 0, 3, 0] == 0 and np.isnan(result).sum() == 4


# --------------------------------------------------------------------------------------------
# layouts, strides, out=, threads
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", float32_quick(DTYPES), ids=str)
def test_channels_last_is_kept_and_equal(dtype):
    input_shape, kernel, stride, padding = (2, 5, 9, 8), (3, 2), (2, 1), (1, 1)
    grad_output = random(pooled_shape(input_shape, kernel, stride, padding, True), dtype, 3)
    result_nchw = pool_bwd(grad_output, input_shape, kernel, stride, padding, True, False)
    result_nhwc = pool_bwd(channels_last(grad_output), input_shape, kernel, stride, padding, True, False)
    assert result_nchw.flags.c_contiguous and result_nhwc.transpose(0, 2, 3, 1).flags.c_contiguous
    assert bitwise_equal(np.ascontiguousarray(result_nhwc), result_nchw)
    assert_matches_reference(result_nchw, reference(grad_output, input_shape, kernel, stride, padding, True, False))


@pytest.mark.parametrize(
    "kernel, stride, padding, ceil_mode",
    [
        (3, 1, 1, False),
        ((2, 3), 2, (1, 1), True),
        ((3, 4), (2, 3), (1, 2), True),
        (5, 4, 2, False),
        (2, 5, 0, True),
    ],
)
def test_nchw_and_nhwc_engines_agree_bitwise(kernel, stride, padding, ceil_mode):
    # The separable engine's NCHW and NHWC loop nests: same sums, same order, same bits.
    input_shape = (2, 3, 23, 45)
    grad_output = random(pooled_shape(input_shape, kernel, stride, padding, ceil_mode), np.float32, 12)
    args = (input_shape, kernel, stride, padding, ceil_mode, False)
    result = pool_bwd(grad_output, *args)
    assert bitwise_equal(result, np.ascontiguousarray(pool_bwd(channels_last(grad_output), *args)))
    assert_matches_reference(result, reference(grad_output, *args))


def wide_random_case(rng):
    """A random valid 4-D case with grad_output rows of at least LANES (16) cells: NCHW runs on
    the whole-rows kernel, NHWC on the separable engine."""
    while True:
        kernel = tuple(int(k) for k in rng.integers(1, 7, size=2))
        stride = tuple(int(s) for s in rng.integers(1, 5, size=2))
        padding = tuple(int(rng.integers(0, k // 2 + 1)) for k in kernel)
        ceil_mode = bool(rng.integers(2))
        height, width = int(rng.integers(1, 14)), int(rng.integers(16 * stride[1], 16 * stride[1] + 40))
        input_shape = (int(rng.integers(1, 3)), int(rng.integers(1, 4)), height, width)
        out_height, out_width = pooled_shape(input_shape, kernel, stride, padding, ceil_mode)[-2:]
        if out_height >= 1 and out_width >= 16:
            count_include_pad = bool(rng.integers(2))
            divisor_override = int(rng.choice([0, 0, 0, 3, -2, 7]))
            return input_shape, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override


@pytest.mark.parametrize("dtype", float32_quick(DTYPES), ids=str)
def test_whole_rows_kernel_equals_the_engine_bitwise(dtype):
    # NCHW grad rows of >= 16 cells run whole rows at a time, the width axis as strided windows
    # (residue classes, stride 2 interleaved in registers); NHWC runs on the separable engine.
    # Same sums in the same order: the same bits, and the reference's values.
    rng = np.random.default_rng(21)
    for case in range(25):
        input_shape, kernel, stride, padding, ceil_mode, include_pad, override = wide_random_case(rng)
        grad_output = random(pooled_shape(input_shape, kernel, stride, padding, ceil_mode), dtype, case)
        args = (input_shape, kernel, stride, padding, ceil_mode, include_pad, override)
        result = pool_bwd(grad_output, *args)
        assert bitwise_equal(result, np.ascontiguousarray(pool_bwd(channels_last(grad_output), *args))), args
        assert_matches_reference(result, reference(grad_output, *args))


def test_whole_rows_tasks_that_start_past_the_last_window():
    # Kernel 4, stride 4, padding 1 over 4 rows: one window, rows 0-2; row 3 lies in none. With
    # float64 rows of 105 cells a task holds 19 rows, so the second task starts at such a row
    # (plane 4, row 3) and its first grad row is window 0 of the next plane (weight of window 0).
    input_shape, kernel, stride, padding = (2, 3, 4, 105), (4, 2), (4, 5), (1, 0)
    grad_output = random(pooled_shape(input_shape, kernel, stride, padding, False), np.float64, 5)
    for include_pad, override in ((False, 0), (True, 0), (False, -2)):
        args = (input_shape, kernel, stride, padding, False, include_pad, override)
        result = pool_bwd(grad_output, *args)
        assert bitwise_equal(result, np.ascontiguousarray(pool_bwd(channels_last(grad_output), *args))), args
        assert_matches_reference(result, reference(grad_output, *args))


def test_whole_rows_task_sources_are_the_grad_rows_each_task_reads():
    # backward_loops hands the whole-rows kernels, per task of rows_per_task consecutive grad_input rows
    # (of the P*H), the grad_output rows [first, stop) (of the P*OH) it reads: from the lowest
    # window covering one of its rows to the highest, every plane crossed in between whole; and
    # `depth`, the kernels' products scratch, the most any task reads. Checked against the
    # windows' definition (docs/semantics.md §2), row by row.
    from fastbwd.kernels import avg_pool2d as kernels

    seen = set()
    for kernel, stride, ceil_mode, height in itertools.product(range(1, 6), range(1, 4), (False, True), (5, 7, 12)):
        for pad in range(kernel // 2 + 1):
            out_height = ref.avg_pool2d_output_size(height, kernel, stride, pad, ceil_mode)
            if out_height < 1:
                continue
            starts = [oh * stride - pad for oh in range(out_height)]
            windows = [(max(start, 0), min(start + kernel, height + pad, height)) for start in starts]
            # rows per task: 20, 11, 4 and 1 (wider rows than a task's bytes)
            for planes, width, itemsize in ((3, 100, 8), (5, 700, 2), (2, 1000, 4), (4, 5000, 4)):
                *_, (rows_per_task, _, depth), task_sources = kernels._rows_geometry(
                    planes, height, width, out_height, 20, kernel, stride, pad, 3, 2, 1, itemsize
                )
                rows = planes * height
                case = (planes, height, width, kernel, stride, pad, ceil_mode, itemsize)
                assert task_sources.dtype == np.int64 and task_sources.shape == (-(-rows // rows_per_task), 2), case
                most = 1
                for task, (first, stop) in enumerate(task_sources.tolist()):
                    task_rows = range(task * rows_per_task, min((task + 1) * rows_per_task, rows))
                    reads = [
                        r // height * out_height + oh
                        for r in task_rows
                        for oh, (low, high) in enumerate(windows)
                        if low <= r % height < high
                    ]
                    if reads:
                        assert (first, stop) == (min(reads), max(reads) + 1), (case, task)
                    else:
                        assert 0 <= first == stop <= planes * out_height, (case, task)
                        seen.add("no reads")
                    most = max(most, stop - first)
                    seen.add("partial" if len(task_rows) < rows_per_task else "whole")
                    if task_rows[0] // height != task_rows[-1] // height:
                        seen.add("crossing planes")
                assert depth == most, case
    assert seen == {"no reads", "partial", "whole", "crossing planes"}


@pytest.mark.parametrize("dtype", float32_quick(DTYPES), ids=str)
def test_streaming_stores_change_no_bit(dtype, monkeypatch, replan):
    # Large results are copied out with streaming stores; every alignment of out gives the bits
    # of plain stores (the partial cache lines at both ends of each task are stored normally).
    from fastbwd.kernels import _memory

    # width stride 2 and 3: the two whole-rows kernels
    for input_shape, args in (
        ((2, 3, 37, 70), ((3, 3), (2, 2), (1, 1), False, False)),
        ((2, 3, 37, 100), ((3, 4), (2, 3), (1, 2), True, False)),
    ):
        grad_output = random(pooled_shape(input_shape, *args[:4]), dtype, 9)
        monkeypatch.setattr(_memory, "STREAM_MIN_BYTES", 16 << 20)
        replan()
        expected = pool_bwd(grad_output, input_shape, *args)
        monkeypatch.setattr(_memory, "STREAM_MIN_BYTES", 0)
        replan()
        size = int(np.prod(input_shape))
        for offset in range(_memory.LINE_BYTES // np.dtype(dtype).itemsize + 1):
            buffer = np.full(size + offset + 1, np.nan, dtype)
            out = buffer[offset : offset + size].reshape(input_shape)
            assert pool_bwd(grad_output, input_shape, *args, out=out) is out
            assert bitwise_equal(out, expected), (input_shape, offset)
            assert np.isnan(buffer[:offset].astype(np.float32)).all() and np.isnan(float(buffer[-1]))


def test_channels_last_input_decides_only_for_1x1_grad_output():
    x = channels_last(np.zeros((2, 3, 6, 6), np.float32))
    grad_output = random((2, 3, 3, 3), np.float32, 1)
    assert pool_bwd(grad_output, x, 2).flags.c_contiguous  # grad_output's layout decides
    grad_1x1 = random((2, 3, 1, 1), np.float32, 1)
    result = pool_bwd(grad_1x1, x, 6)  # 1 x 1 grad_output: both layouts alike, input decides
    assert result.transpose(0, 2, 3, 1).flags.c_contiguous and not result.flags.c_contiguous
    assert bitwise_equal(np.ascontiguousarray(result), pool_bwd(grad_1x1, x.shape, 6))


def test_strided_and_negative_stride_inputs():
    base = random((2, 6, 10, 7), np.float32, 5)
    grad_output = base[:, ::2, ::-2, :]  # (2, 3, 5, 7), non-contiguous, negative stride along H
    args = ((2, 3, 9, 13), 3, 2, 1, True, False)
    assert bitwise_equal(pool_bwd(grad_output, *args), pool_bwd(np.ascontiguousarray(grad_output), *args))


def test_inputs_are_not_mutated_and_out_is_overwritten():
    grad_output = random((2, 3, 3, 4), np.float32, 9)
    x = random((2, 3, 6, 8), np.float32, 10)
    snapshot = (grad_output.copy(), x.copy())
    out = np.full(x.shape, np.nan, np.float32)
    returned = pool_bwd(grad_output, x, 3, 2, 1, False, False, out=out)
    assert returned is out
    assert bitwise_equal(out, pool_bwd(grad_output, x.shape, 3, 2, 1, False, False))
    assert bitwise_equal(grad_output, snapshot[0]) and bitwise_equal(x, snapshot[1])
    global_out = np.full((2, 3, 3, 4), np.nan, np.float32)
    assert pool_bwd(np.ones((2, 3, 1, 1), np.float32), (2, 3, 3, 4), (3, 4), out=global_out) is global_out
    assert np.all(global_out == np.float32(1 / 12))


def test_out_channels_last():
    grad_output = random((2, 3, 3, 4), np.float32, 1)
    out = np.empty((2, 6, 8, 3), np.float32).transpose(0, 3, 1, 2)
    assert pool_bwd(channels_last(grad_output), (2, 3, 6, 8), 2, out=out) is out
    assert bitwise_equal(np.ascontiguousarray(out), pool_bwd(grad_output, (2, 3, 6, 8), 2))
    with raises_param_error(r"out must be C-contiguous like the result", param="out"):
        pool_bwd(grad_output, (2, 3, 6, 8), 2, out=out)


def test_serial_twin_equals_parallel():
    from fastbwd.kernels import avg_pool2d as kernels
    from fastbwd.kernels._halfbits import NATIVE

    grad_output = random((40,), np.float32, 8)
    parallel, serial = np.empty((40, 30), np.float32), np.empty((40, 30), np.float32)
    parallel_kernel, serial_twin = kernel_twins.twins(kernels.global_avg_pool2d_bwd_nchw)
    parallel_kernel(grad_output, parallel, np.float32(30), NATIVE)
    serial_twin(grad_output, serial, np.float32(30), NATIVE)
    assert bitwise_equal(parallel, serial)


# --------------------------------------------------------------------------------------------
# argument forms
# --------------------------------------------------------------------------------------------


def test_argument_forms_are_equivalent():
    grad_output = random((2, 3, 4, 3), np.float64, 1)
    expected = pool_bwd(grad_output, (2, 3, 8, 6), (2, 2), (2, 2), (0, 0), False, True, 0, 0)
    for kernel, stride, padding in [
        (2, None, 0),
        ([2], [], [0]),
        (np.int64(2), (), (0,)),
        (np.array([2, 2]), 2, np.array([0])),
    ]:
        assert bitwise_equal(pool_bwd(grad_output, (2, 3, 8, 6), kernel, stride, padding), expected)
    assert bitwise_equal(pool_bwd(grad_output, np.zeros((2, 3, 8, 6)), 2, divisor_override=None), expected)
    assert bitwise_equal(pool_bwd(grad_output, (2, 3, 8, 6), 2, cube_math_type=3), expected)
    assert bitwise_equal(pool_bwd(grad_output.tolist(), [2, 3, 8, 6], 2), expected)


def test_unbatched_3d():
    grad_output = random((3, 4, 4), np.float32, 2)
    result = pool_bwd(grad_output, (3, 8, 7), (2, 3), 2, (0, 1))
    assert result.shape == (3, 8, 7)
    assert bitwise_equal(result, pool_bwd(grad_output[None], (1, 3, 8, 7), (2, 3), 2, (0, 1))[0])
    assert_matches_reference(result, reference(grad_output, (3, 8, 7), (2, 3), 2, (0, 1), False, True))


def test_empty_batch():
    result = pool_bwd(np.zeros((0, 3, 4, 4), BF16), (0, 3, 8, 8), 2)
    assert result.shape == (0, 3, 8, 8) and result.dtype == BF16


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    grad = torch.randn(2, 3, 4, 4, dtype=torch.bfloat16, requires_grad=True)
    x = torch.empty(2, 3, 8, 8, dtype=torch.bfloat16)
    result = pool_bwd(grad, x, 2)
    assert result.dtype == BF16
    assert_matches_reference(result, reference(grad.detach().double().numpy(), (2, 3, 8, 8), 2, 2, 0, False, True))


@pytest.mark.parametrize("dtype", float32_quick(["float32", "float64", "bfloat16"]))
def test_matches_torch(dtype):
    torch = pytest.importorskip("torch")
    torch_dtype = getattr(torch, dtype)
    rng = np.random.default_rng(3)
    for case in range(12):
        input_shape, kernel, stride, padding, ceil_mode, include_pad, override = random_case(rng, ndim=4)
        grad = torch.randn(
            pooled_shape(input_shape, kernel, stride, padding, ceil_mode),
            dtype=torch.float64,
            generator=torch.Generator().manual_seed(case),
        ).to(torch_dtype)
        x = torch.empty(input_shape, dtype=torch_dtype)
        expected = torch.ops.aten.avg_pool2d_backward(
            grad,
            x,
            list(pair(kernel)),
            list(pair(stride)),
            list(pair(padding)),
            ceil_mode,
            include_pad,
            override or None,
        )
        result = pool_bwd(grad, x, kernel, stride, padding, ceil_mode, include_pad, override)
        if dtype == "bfloat16":
            # torch's CPU kernel accumulates bfloat16 in bfloat16 (rounding at every addition), so
            # it may stray a little further from the exact value than fastbwd's single rounding.
            assert_matches_reference(
                result,
                reference(
                    grad.double().numpy(), input_shape, kernel, stride, padding, ceil_mode, include_pad, override
                ),
            )
            expected = expected.float().numpy()
            assert np.allclose(result.astype(np.float32), expected, rtol=2**-6, atol=2**-6 * np.abs(expected).max())
        else:
            assert_matches_reference(result, expected.double().numpy())


# --------------------------------------------------------------------------------------------
# errors (docs/semantics.md §2)
# --------------------------------------------------------------------------------------------

GOOD = dict(grad_output=np.zeros((2, 3, 4, 3), np.float32), input=(2, 3, 8, 6), kernel_size=2)


def call(**changes):
    return pool_bwd(**dict(GOOD, **changes))


@pytest.mark.parametrize(
    "changes, message, param",
    [
        (dict(grad_output=np.zeros((4, 3), np.float32)), r"grad_output must be 3-D or 4-D, but got 2-D", "grad_output"),
        (dict(input=(8, 6)), r"input must have length 3 or 4, but got length 2", "input"),
        (dict(input=np.zeros((1, 2, 3, 5, 4))), r"input must be 3-D or 4-D, but got 5-D", "input"),
        (
            dict(grad_output=np.zeros((3, 4, 3), np.float32)),
            r"grad_output must be 4-D like input, but got 3-D",
            "grad_output",
        ),
        (
            dict(grad_output=np.zeros((2, 3, 4, 3), np.int32)),
            r"grad_output\.dtype must be one of float32, float16, bfloat16, float64, but got int32",
            "grad_output",
        ),
        (
            dict(grad_output=np.zeros((2, 3, 4, 3), np.complex64)),
            r"grad_output\.dtype must be one of .*, but got complex64",
            "grad_output",
        ),
        (
            dict(input=np.zeros((2, 3, 8, 6), np.float64)),
            r"input\.dtype must equal grad_output\.dtype \(float32\), but got float64",
            "input",
        ),
        (dict(grad_output=np.array(["a"])), r"grad_output must be a numeric array", "grad_output"),
        (dict(kernel_size=()), r"kernel_size must have length 1 or 2, but got length 0", "kernel_size"),
        (dict(kernel_size=(2, 2, 2)), r"kernel_size must have length 1 or 2, but got length 3", "kernel_size"),
        (dict(kernel_size=(2, 0)), r"kernel_size\[1\] must be > 0, but got 0", "kernel_size"),
        (dict(kernel_size=-2), r"kernel_size\[0\] must be > 0, but got -2", "kernel_size"),
        (dict(kernel_size=2.0), r"kernel_size must be a sequence of integers, but got 2.0 \(a float\)", "kernel_size"),
        (dict(kernel_size=(2, True)), r"kernel_size\[1\] must be an integer, but got True \(a bool\)", "kernel_size"),
        (dict(kernel_size=2**31), r"kernel_size\[0\] must be at most 2147483647, but got 2147483648", "kernel_size"),
        (dict(stride=(1, 2, 3)), r"stride must have length 0 or 1 or 2, but got length 3", "stride"),
        (dict(stride=(2, 0)), r"stride\[1\] must be > 0, but got 0", "stride"),
        (dict(stride=-1), r"stride\[0\] must be > 0, but got -1", "stride"),
        (dict(stride=(1.5,)), r"stride\[0\] must be an integer, but got 1.5 \(a float\)", "stride"),
        (dict(padding=()), r"padding must have length 1 or 2, but got length 0", "padding"),
        (dict(padding=(0, 0, 0)), r"padding must have length 1 or 2, but got length 3", "padding"),
        (dict(padding=-1), r"padding\[0\] must be >= 0, but got -1", "padding"),
        (dict(padding=(0, 2)), r"padding\[1\] must be at most half of kernel_size\[1\] = 2, but got 2", "padding"),
        (
            dict(kernel_size=(3, 2), padding=(2, 1)),
            r"padding\[0\] must be at most half of kernel_size\[0\] = 3, but got 2",
            "padding",
        ),
        (dict(ceil_mode=1), r"ceil_mode must be a bool, but got 1", "ceil_mode"),
        (dict(count_include_pad="yes"), r"count_include_pad must be a bool, but got 'yes'", "count_include_pad"),
        (
            dict(divisor_override=2.0),
            r"divisor_override must be an integer, but got 2.0 \(a float\)",
            "divisor_override",
        ),
        (
            dict(divisor_override=True),
            r"divisor_override must be an integer, but got True \(a bool\)",
            "divisor_override",
        ),
        (
            dict(divisor_override=2**63),
            r"divisor_override must fit in int64, but got 9223372036854775808",
            "divisor_override",
        ),
        (dict(cube_math_type=4), r"cube_math_type must be one of 0, 1, 2, 3, but got 4", "cube_math_type"),
        (dict(cube_math_type=-1), r"cube_math_type must be one of 0, 1, 2, 3, but got -1", "cube_math_type"),
        (dict(cube_math_type=1.0), r"cube_math_type must be an integer, but got 1.0 \(a float\)", "cube_math_type"),
        (
            dict(input=(2, 65536, 8, 6), grad_output=np.zeros((2, 65536, 4, 3), np.float32)),
            r"input\.shape\[1\] \(channels\) must be at most 65535, but got 65536",
            "input",
        ),
        (
            dict(input=(2, 0, 8, 6), grad_output=np.zeros((2, 0, 4, 3), np.float32)),
            r"input\.shape\[1\] must be > 0 \(only the batch dimension of a 4-D input may be empty\), but got 0",
            "input",
        ),
        (
            dict(
                input=(2, 3, 0, 6), kernel_size=(2, 2), padding=(1, 0), grad_output=np.zeros((2, 3, 1, 3), np.float32)
            ),
            r"input\.shape\[2\] must be > 0",
            "input",
        ),
        (dict(input=(0, 8, 6), grad_output=np.zeros((0, 4, 3), np.float32)), r"input\.shape\[0\] must be > 0", "input"),
        (dict(input=(2, 3, -8, 6)), r"input\[2\] must be >= 0, but got -8", "input"),
        (
            dict(input=(2, 3, 1, 6)),
            r"kernel_size\[0\] must leave an output height >= 1 \(input height 1, stride 2, padding 0, ceil_mode False\), "
            r"but got 2 \(output height 0\)",
            "kernel_size",
        ),
        (
            dict(input=(2, 3, 8, 6), kernel_size=(2, 9), stride=2),
            r"kernel_size\[1\] must leave an output width >= 1 \(input width 6, stride 2, padding 0, ceil_mode False\), "
            r"but got 9 \(output width -1\)",
            "kernel_size",
        ),
        (
            dict(grad_output=np.zeros((3, 3, 4, 3), np.float32)),
            r"grad_output\.shape\[0\] must be 2 \(as input\), but got 3",
            "grad_output",
        ),
        (
            dict(grad_output=np.zeros((2, 4, 4, 3), np.float32)),
            r"grad_output\.shape\[1\] must be 3 \(as input\), but got 4",
            "grad_output",
        ),
        (
            dict(grad_output=np.zeros((2, 3, 5, 3), np.float32)),
            r"grad_output\.shape\[2\] must be 4 \(output height for input height 8, stride 2, padding 0, ceil_mode False, "
            r"kernel 2\), but got 5",
            "grad_output",
        ),
        (
            dict(grad_output=np.zeros((2, 3, 4, 2), np.float32)),
            r"grad_output\.shape\[3\] must be 3 \(output width for input width 6, stride 2, padding 0, ceil_mode False, "
            r"kernel 2\), but got 2",
            "grad_output",
        ),
    ],
)
def test_errors(changes, message, param):
    with raises_param_error(message, param=param):
        call(**changes)


@pytest.mark.parametrize(
    "name", ["grad_output", "input", "kernel_size", "padding", "ceil_mode", "count_include_pad", "cube_math_type"]
)
def test_none_is_nullptr(name):
    with raises_param_error(rf"{name} is required, but got None", status=161001, param=name):
        call(**{name: None})


def test_param_error_is_value_and_type_error():
    assert issubclass(fastbwd.ParamError, ValueError) and issubclass(fastbwd.ParamError, TypeError)
    with pytest.raises(ValueError):
        call(padding=5)
    with pytest.raises(TypeError):
        call(padding=5)


class _ArrayLike:
    """Not an ndarray: NumPy reads it through ``__array__`` (strides kept)."""

    def __init__(self, array):
        self._array = array

    def __array__(self, dtype=None, copy=None):
        return self._array


def _channels_last_global_case():
    """A channels-last forward input whose pooled output is 1 x 1 (where grad_output's own strides
    cannot tell the layout): the result follows the input's memory format."""
    x = np.zeros((2, 4, 3, 3), np.float32).transpose(0, 2, 3, 1).copy().transpose(0, 3, 1, 2)
    g = np.arange(8, dtype=np.float32).reshape(2, 4, 1, 1) + 1
    return x, g


def test_array_like_input_follows_the_memory_format_rule_of_arrays():
    x, g = _channels_last_global_case()
    from_array = fastbwd.avg_pool2d_backward(g, x, 3)
    from_array_like = fastbwd.avg_pool2d_backward(g, _ArrayLike(x), 3)
    assert not from_array.flags.c_contiguous and from_array.transpose(0, 2, 3, 1).flags.c_contiguous
    assert from_array_like.strides == from_array.strides
    np.testing.assert_array_equal(from_array_like, from_array)
    # a shape carries no memory format: C-contiguous
    assert fastbwd.avg_pool2d_backward(g, x.shape, 3).flags.c_contiguous


def test_channels_last_torch_input_gives_a_channels_last_result():
    torch = pytest.importorskip("torch")
    x, g = _channels_last_global_case()
    tensor = torch.zeros(2, 4, 3, 3).to(memory_format=torch.channels_last)
    expected = fastbwd.avg_pool2d_backward(g, x, 3)
    result = fastbwd.avg_pool2d_backward(g, tensor, 3)
    assert result.strides == expected.strides
    np.testing.assert_array_equal(result, expected)
    reference = torch.ops.aten.avg_pool2d_backward(
        torch.from_numpy(g), tensor, [3, 3], [3, 3], [0, 0], False, True, None
    )
    assert reference.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize(
    "shape, kernel, stride, padding",
    [
        ((2, 6, 19, 70), 3, 2, 1),  # rows of at least LANES cells: the whole-rows kernel, stride 2
        ((2, 6, 19, 40), 3, 1, 0),  # the whole-rows kernel, stride 1
        ((2, 5, 9, 11), 3, 2, 1),  # narrow rows: the shared engine
        ((4, 40, 9, 11), 3, 2, 1),  # NCHW: many small planes, LANES of them at a time
        ((3, 40, 6, 6), 6, 6, 0),  # one window over the whole input
    ],
)
def test_nan_sums_are_the_positive_nan(dtype, layout, shape, kernel, stride, padding):
    """Every NaN of grad_input is the positive quiet NaN, whichever NaN (of either sign) its
    windows' sum met (docs/semantics.md §0.2)."""
    out_h = (shape[2] + 2 * padding - kernel) // stride + 1
    out_w = (shape[3] + 2 * padding - kernel) // stride + 1
    go = with_signed_nan(random((shape[0], shape[1], out_h, out_w), dtype, 43), 44)
    if layout == "NHWC":
        go = to_nhwc(go)
    grad = pool_bwd(
        go,
        shape if layout == "NCHW" else (shape[0], shape[2], shape[3], shape[1]),
        kernel,
        stride,
        padding,
        layout=layout,
    )
    assert nan_cells_are_the_positive_nan(grad)
