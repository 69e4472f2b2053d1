"""roi_align_backward (docs/semantics.md §4) against the float64 reference, its forward's adjoint, bad and
huge boxes, every dtype, threads, out=, strides, and every error of docs/semantics.md."""

import numpy as np
import pytest

import fastbwd
from fastbwd import roi_align_backward as roi_bwd
from fastbwd.api import roi_align as api
from fastbwd.kernels import roi_align as kernels
from fastbwd.testing import reference as ref
from fastbwd.testing.checks import assert_matches_reference, bitwise_equal

from _covering import float32_quick
from conftest import BF16, DTYPES, assert_thread_invariant, channels_last, raises_param_error


def random_boxes(rng, num_boxes, batch, height, width, spatial_scale, outside=0.3):
    """Boxes in image coordinates over the (H, W) feature map, some partly outside it."""
    image_h, image_w = height / spatial_scale, width / spatial_scale
    x1 = rng.uniform(-outside * image_w, image_w, num_boxes)
    y1 = rng.uniform(-outside * image_h, image_h, num_boxes)
    x2 = x1 + rng.uniform(0, 0.8 * image_w, num_boxes)
    y2 = y1 + rng.uniform(0, 0.8 * image_h, num_boxes)
    b = rng.integers(0, batch, num_boxes)
    return np.stack([b, x1, y1, x2, y2], axis=1)


def random_case(rng, dtype):
    """A random valid call: non-square shapes and pooled sizes, every parameter varied."""
    batch, channels = int(rng.integers(1, 4)), int(rng.integers(1, 6))
    height, width = (int(s) for s in rng.integers(1, 14, size=2))
    pooled_height, pooled_width = (int(s) for s in rng.integers(1, 5, size=2))
    spatial_scale = float(rng.choice([0.25, 0.5, 1.0, 1.7]))
    num_boxes = int(rng.integers(1, 7))
    boxes = random_boxes(rng, num_boxes, batch, height, width, spatial_scale).astype(dtype)
    grad_output = rng.standard_normal((num_boxes, channels, pooled_height, pooled_width)).astype(dtype)
    return (
        grad_output,
        boxes,
        (batch, channels, height, width),
        pooled_height,
        pooled_width,
        spatial_scale,
        int(rng.integers(0, 4)),
        bool(rng.integers(0, 2)),
    )


def check_against_reference(args):
    result = roi_bwd(*args)
    expected = ref.roi_align_backward(*args)
    assert result.dtype == np.asarray(args[0]).dtype and result.shape == tuple(args[2])
    assert result.flags.c_contiguous
    assert_matches_reference(result, expected)
    return result


# --------------------------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", float32_quick(DTYPES), ids=str)
def test_matches_reference_random_cases(dtype):
    rng = np.random.default_rng(5)
    for _ in range(30):
        check_against_reference(random_case(rng, dtype))


@pytest.mark.parametrize("sampling_ratio", [0, 1, 2])
@pytest.mark.parametrize("aligned", [False, True])
def test_every_sampling_ratio_and_alignment(sampling_ratio, aligned):
    rng = np.random.default_rng(sampling_ratio + 10 * aligned)
    boxes = random_boxes(rng, 8, 2, 11, 13, 0.5)
    grad_output = rng.standard_normal((8, 3, 3, 2)).astype(np.float32)
    check_against_reference((grad_output, boxes.astype(np.float32), (2, 3, 11, 13), 3, 2, 0.5, sampling_ratio, aligned))


def test_adjoint_of_the_forward():
    rng = np.random.default_rng(11)
    for _ in range(12):
        args = random_case(rng, np.float64)
        grad_output, boxes, input_shape, ph, pw, scale, ratio, aligned = args
        x = rng.standard_normal(input_shape)
        forward = ref.roi_align_forward(x, boxes, ph, pw, scale, ratio, aligned)
        lhs = np.sum(forward * grad_output)  # <f(x), g>
        rhs = np.sum(x * roi_bwd(*args))  # <x, f^T(g)>
        assert np.isclose(lhs, rhs, rtol=1e-12, atol=1e-12), args


def test_single_box_by_hand():
    # aligned=False, scale 1, box (0, 0, 2, 2) -> 1 x 1 bin of size 2, sampling 1: one sample at
    # (1, 1), exactly on pixel (1, 1): weight 1 there, 0 on its three other neighbours.
    grad_output = np.array([[[[3.0]]]])
    result = roi_bwd(grad_output, np.array([[0, 0, 0, 2, 2.0]]), (1, 1, 3, 3), 1, 1, 1.0, 1, False)
    expected = np.zeros((1, 1, 3, 3))
    expected[0, 0, 1, 1] = 3.0
    assert np.array_equal(result, expected)


def test_boxes_partly_and_wholly_outside_the_image():
    grad_output = np.random.default_rng(1).standard_normal((5, 2, 2, 3))
    boxes = np.array(
        [
            [0, -6.0, -5.0, 3.0, 2.0],  # partly outside, top-left
            [1, 5.0, 4.0, 15.0, 12.0],  # partly outside, bottom-right
            [0, -30.0, -30.0, -10.0, -8],  # wholly outside: every sample skipped
            [1, 20.0, 1.0, 30.0, 5.0],  # wholly outside on the right
            [0, -2.0, -1.5, 9.0, 8.5],  # covers the image with a margin
        ]
    )
    for aligned in (False, True):
        for ratio in (0, 2):
            result = check_against_reference((grad_output, boxes, (2, 2, 7, 9), 2, 3, 1.0, ratio, aligned))
            outside_only = roi_bwd(grad_output[2:4], boxes[2:4], (2, 2, 7, 9), 2, 3, 1.0, ratio, aligned)
            assert not outside_only.any()
            assert result.any()


@pytest.mark.parametrize("aligned", [False, True])
def test_degenerate_boxes(aligned):
    grad_output = np.random.default_rng(2).standard_normal((4, 2, 2, 2))
    boxes = np.array(
        [
            [0, 3.0, 2.0, 3.0, 2.0],  # a point
            [0, 1.0, 1.0, 5.0, 1.0],  # a horizontal segment
            [0, 4.0, 3.0, 2.0, 1.0],  # inverted (x2 < x1, y2 < y1)
            [0, 2.5, 2.5, 2.5, 6.0],  # a vertical segment
        ]
    )
    for ratio in (0, 1, 2):
        result = check_against_reference((grad_output, boxes, (1, 2, 6, 7), 2, 2, 1.0, ratio, aligned))
        if aligned and ratio == 0:
            # Each box has a size <= 0 along some axis: an empty adaptive grid, no samples.
            assert not result.any()


@pytest.mark.parametrize("input_shape", [(2, 3, 1, 6), (2, 3, 5, 1), (1, 2, 1, 1)])
def test_height_or_width_one(input_shape):
    rng = np.random.default_rng(3)
    boxes = random_boxes(rng, 6, input_shape[0], input_shape[2], input_shape[3], 1.0)
    grad_output = rng.standard_normal((6, input_shape[1], 3, 2)).astype(np.float32)
    for aligned in (False, True):
        for ratio in (0, 2):
            check_against_reference((grad_output, boxes.astype(np.float32), input_shape, 3, 2, 1.0, ratio, aligned))


def test_empty_cases():
    # K == 0: zero-filled result (written into out too)
    out = np.full((2, 3, 4, 5), np.nan, np.float32)
    result = roi_bwd(
        np.zeros((0, 3, 2, 2), np.float32), np.zeros((0, 5), np.float32), (2, 3, 4, 5), 2, 2, 1.0, 0, True, out=out
    )
    assert result is out and not result.any()
    # C == 0, B == 0, H == 0, pooled size 0
    assert roi_bwd(np.zeros((3, 0, 2, 2)), np.zeros((3, 5)), (2, 0, 4, 5), 2, 2, 1.0, 0, True).shape == (2, 0, 4, 5)
    assert roi_bwd(np.zeros((3, 2, 2, 2)), np.zeros((3, 5)), (0, 2, 4, 5), 2, 2, 1.0, 0, True).shape == (0, 2, 4, 5)
    assert roi_bwd(np.zeros((3, 2, 2, 2)), np.zeros((3, 5)), (1, 2, 0, 5), 2, 2, 1.0, 0, True).shape == (1, 2, 0, 5)
    result = roi_bwd(np.zeros((3, 2, 0, 2), BF16), np.zeros((3, 5), BF16), (1, 2, 4, 5), 0, 2, 1.0, 0, True)
    assert result.shape == (1, 2, 4, 5) and result.dtype == BF16 and not result.astype(np.float32).any()


# --------------------------------------------------------------------------------------------
# bad boxes and huge boxes
# --------------------------------------------------------------------------------------------

GOOD_BOX = [1, 1.0, 2.0, 9.0, 7.0]


@pytest.mark.parametrize(
    "batch_index, image",
    [
        (-1, None),
        (2, None),
        (0.5, 0),
        (1.9, 1),
        (-0.5, None),
        (np.nan, None),
        (np.inf, None),
        (-np.inf, None),
    ],
)
def test_batch_index(batch_index, image):
    # docs/semantics.md: b = floor(boxes[k, 0]); outside [0, B) or not finite -> the box contributes nothing.
    boxes = np.array([GOOD_BOX, [batch_index] + GOOD_BOX[1:]], np.float32)
    grad_output = np.ones((2, 2, 2, 3), np.float32)
    result = roi_bwd(grad_output, boxes, (2, 2, 8, 11), 2, 3, 1.0, 2, False)
    lone = roi_bwd(grad_output[:1], boxes[:1], (2, 2, 8, 11), 2, 3, 1.0, 2, False)
    if image is None:
        assert bitwise_equal(result, lone)
    else:
        check_against_reference((grad_output, boxes, (2, 2, 8, 11), 2, 3, 1.0, 2, False))
        assert result[image].any()


@pytest.mark.parametrize("column", [1, 2, 3, 4])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_in_a_coordinate(column, value):
    boxes = np.array([GOOD_BOX, GOOD_BOX, GOOD_BOX], np.float32)
    boxes[1, column] = value
    grad_output = np.random.default_rng(column).standard_normal((3, 2, 2, 3)).astype(np.float32)
    result = roi_bwd(grad_output, boxes, (2, 2, 8, 11), 2, 3, 0.5, 0, True)
    keep = [0, 2]
    assert bitwise_equal(result, roi_bwd(grad_output[keep], boxes[keep], (2, 2, 8, 11), 2, 3, 0.5, 0, True))


def test_nan_and_inf_gradients_propagate():
    # Samples clamped to the last row/column still add g * 0 to their "high" pixel: inf * 0 is NaN
    # there, as in the loop of docs/semantics.md §4 (and torchvision).
    grad_output = np.array([[[[np.inf, 1.0], [np.nan, -np.inf]]]], np.float32)
    boxes = np.array([[0, -1.0, 0.0, 6.0, 6.0]], np.float32)
    with np.errstate(invalid="ignore"):  # the reference computes inf * 0 too
        result = check_against_reference((grad_output, boxes, (1, 1, 5, 6), 2, 2, 1.0, 2, True))
    assert np.isnan(result).any() and np.isinf(result).any()


@pytest.mark.parametrize("dtype", float32_quick([np.float32, np.float64]))
@pytest.mark.parametrize(
    "box, pooled",
    [
        ([0, -40000.0, -60.0, 60000.0, 40.0], (2, 1)),  # 1e5 x 100 = 1e7 pixels, wide
        ([0, -3.0, -90000.0, 5.0, 10000.0], (1, 3)),  # 8 x 1e5 plus, tall
    ],
)
def test_huge_adaptive_box_matches_reference(dtype, box, pooled):
    # Adaptive grids of 1e5 samples per bin along one axis: only the samples that can land in the
    # image are visited, while the divisor stays the full grid count.
    boxes = np.array([box, [0, 1.0, 1.0, 4.0, 3.0]], dtype)
    grad_output = np.random.default_rng(4).standard_normal((2, 3) + pooled).astype(dtype)
    for aligned in (False, True):
        check_against_reference((grad_output, boxes, (1, 3, 9, 12), *pooled, 1.0, 0, aligned))


def test_huge_square_box_matches_reference():
    # ~1e7 pixels with adaptive sampling (452 x 452 samples per bin): each pixel's weight is summed
    # once, against the oracle (which visits every sample). float32 coordinates near -1600 carry
    # rounding errors of 6e-5 pixel (half an ulp), hence the wider tolerance there.
    box = np.array([[0, -1500.0, -1600.0, 1662.0, 1562.0]])
    grad_output = np.random.default_rng(6).standard_normal((1, 2, 7, 7))
    for aligned in (False, True):
        args = (grad_output, box, (1, 2, 10, 14), 7, 7, 1.0, 0, aligned)
        expected = ref.roi_align_backward(*args)
        assert_matches_reference(roi_bwd(*args), expected)
        narrow = roi_bwd(grad_output.astype(np.float32), box.astype(np.float32), *args[2:])
        assert_matches_reference(narrow, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", float32_quick([np.float32, np.float64]))
def test_absurd_boxes_return_and_add_next_to_nothing(dtype):
    # Adaptive grids of ~1e29 and ~1e38 samples per bin: they return promptly, and since a pixel
    # is worth about 1 / (box area) of a bin, their gradient is ~1e-60 (the oracle's exact
    # rational sums), or 0 once the box overflows. Rounding of the coordinates in the compute
    # type (spacing ~1e14 or more near the image) may cluster samples, but a bin's weight per
    # axis stays a fraction of its samples: far below 1e-9.
    boxes = np.array([[0, -1e30, -1e30, 1e30, 1e30], [0, -3e38, -3e38, 3e38, 3e38], [0, 0.0, 0.0, 3e38, 3e38]], dtype)
    grad_output = np.random.default_rng(6).standard_normal((3, 2, 7, 7)).astype(dtype)
    expected = ref.roi_align_backward(grad_output, boxes, (1, 2, 10, 14), 7, 7, 1.0, 0, True)
    assert np.abs(expected).max() < 1e-50
    for aligned in (False, True):
        for scale in (1.0, 8.0):
            result = roi_bwd(grad_output, boxes, (1, 2, 10, 14), 7, 7, scale, 0, aligned)
            assert np.isfinite(result).all() and np.abs(result).max() < 1e-9
            if dtype == np.float32 and scale == 8.0:
                assert not result.any()  # 3e38 * 8 overflows float32: every box is skipped


# --------------------------------------------------------------------------------------------
# large sampling ratios (issue 12): per-pixel weights, bounded work, no lost digits
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling_ratio", [1000, 10000, 100000, 300000, 2**31 - 1])
def test_huge_sampling_ratio_keeps_every_digit(sampling_ratio):
    # A box inside an 8 x 8 map, 2 x 2 bins: every sample is valid, so the gradient's total is
    # exactly the sum of grad_output (a float32 running sum of the tiny per-sample weights lost
    # 18% of it at 10000; 100000 did not return).
    grad_output = np.ones((1, 1, 2, 2), np.float32)
    boxes = np.array([[0, 1.0, 1.0, 5.0, 5.0]], np.float32)
    result = roi_bwd(grad_output, boxes, (1, 1, 8, 8), 2, 2, 1.0, sampling_ratio, False)
    assert abs(result.sum(dtype=np.float64) - 4.0) < 4e-6


def hat_integral(a, b, q):
    """The integral over [a, b] of the hat function max(0, 1 - |p - q|) (pixel q's bilinear
    weight at p), in closed form: the sampling limit of a bin's weight on pixel q."""

    def antiderivative(p):  # of the hat around 0, clipped to [-1, 1]
        p = min(max(p, -1.0), 1.0)
        return p + p * abs(p) / -2.0 + 0.5

    return antiderivative(b - q) - antiderivative(a - q)


@pytest.mark.parametrize("aligned", [False, True])
def test_max_sampling_ratio_matches_the_integral(aligned):
    # With 2^31 - 1 samples per axis, a bin's weights are its mean bilinear weights: the integral
    # of each pixel's hat function over the bin, divided by the bin size (to ~1/ratio), for bins
    # inside the image (the samples clamped at the border are checked against the oracle).
    grad_output = np.array([[[[1.0, 0.0, 0.0], [0.0, 0.0, 0.5]]]], np.float32)
    box = np.array([[0, 1.3, 0.7, 7.9, 6.1]], np.float32)
    result = roi_bwd(grad_output, box, (1, 1, 9, 11), 2, 3, 1.0, 2**31 - 1, aligned)
    offset = 0.5 if aligned else 0.0
    x1, y1, x2, y2 = (float(v) - offset for v in box[0, 1:])
    bin_h, bin_w = (y2 - y1) / 2, (x2 - x1) / 3
    expected = np.zeros((9, 11))
    for (ph, pw), g in (((0, 0), 1.0), ((1, 2), 0.5)):
        ya, xa = y1 + ph * bin_h, x1 + pw * bin_w
        wy = [hat_integral(ya, ya + bin_h, q) / bin_h for q in range(9)]
        wx = [hat_integral(xa, xa + bin_w, q) / bin_w for q in range(11)]
        expected += g * np.outer(wy, wx)
    assert_matches_reference(result[0, 0], expected, rtol=0, atol=2e-5)


def huge_ratio_case(rng, dtype, sampling_ratio, aligned):
    """A random 3-channel case with boxes partly outside the image (clamped and skipped
    samples at every border), non-square shapes."""
    boxes = random_boxes(rng, 5, 2, 7, 9, 1.0).astype(dtype)
    grad_output = rng.uniform(0.1, 1.1, (5, 3, 3, 2)).astype(dtype)
    return grad_output, boxes, (2, 3, 7, 9), 3, 2, 1.0, sampling_ratio, aligned


@pytest.mark.parametrize("sampling_ratio", [2, 1000, 300000])
@pytest.mark.parametrize("aligned", [False, True])
def test_large_sampling_ratios_match_reference(sampling_ratio, aligned):
    # float32 within 2e-5 of the float64 evaluation (relative to the max); the issue measured
    # 1.6e-2 at 1000 for per-sample float32 sums. float64 much closer; half formats within 1 ulp.
    rng = np.random.default_rng(sampling_ratio + aligned)
    args = huge_ratio_case(rng, np.float64, sampling_ratio, aligned)
    expected = ref.roi_align_backward(*args)
    assert np.abs(expected).max() > 0.1
    x = rng.standard_normal(args[2])
    expected_forward = ref.roi_align_forward(x, *args[1:2], *args[3:])
    for dtype in DTYPES:
        grad_output, boxes = args[0].astype(dtype), args[1].astype(dtype)
        result = roi_bwd(grad_output, boxes, *args[2:])
        forward = api.roi_align_forward(x.astype(dtype), boxes, *args[3:])
        if dtype == np.float64:
            # Coordinates of the same float64 boxes: only the sums' rounding differs.
            assert_matches_reference(result, expected, rtol=0, atol=1e-10)
            assert_matches_reference(forward, expected_forward, rtol=0, atol=1e-10)
        elif dtype == np.float32:
            assert_matches_reference(result, ref.roi_align_backward(grad_output, boxes, *args[2:]), rtol=0, atol=2e-5)
            assert_matches_reference(
                forward, ref.roi_align_forward(x.astype(dtype), boxes, *args[3:]), rtol=0, atol=2e-5
            )
        else:
            assert_matches_reference(result, ref.roi_align_backward(grad_output, boxes, *args[2:]))
            assert_matches_reference(forward, ref.roi_align_forward(x.astype(dtype), boxes, *args[3:]))


def brute_force_backward(grad_output, boxes, input_shape, pooled, spatial_scale, sampling_ratio, aligned):
    """The docs/semantics.md §4 loop in float64 with every (iy, ix) sample scattering its four corners
    (np.add.at over all gh * gw samples of a bin; vectorised, not collapsed per pixel). Boxes
    are valid and have a fixed sampling_ratio."""
    batch, channels, height, width = input_shape
    result = np.zeros(input_shape)
    offset = 0.5 if aligned else 0.0
    n = sampling_ratio

    def corners(start, step, size):
        p = start + (np.arange(n) + 0.5) * step
        valid = (p >= -1) & (p <= size)
        p = np.maximum(p[valid], 0.0)
        low = p.astype(np.int64)
        clamped = low >= size - 1
        low[clamped] = size - 1
        p[clamped] = size - 1
        high = np.where(clamped, low, low + 1)
        lam = p - low
        return low, high, 1.0 - lam, lam

    for k, (b, *coords) in enumerate(np.asarray(boxes, np.float64)):
        x1, y1, x2, y2 = (c * spatial_scale - offset for c in coords)
        roi_w, roi_h = x2 - x1, y2 - y1
        if not aligned:
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        bin_h, bin_w = roi_h / pooled[0], roi_w / pooled[1]
        for ph in range(pooled[0]):
            yl, yh, hy, ly = corners(y1 + ph * bin_h, bin_h / n, height)
            for pw in range(pooled[1]):
                xl, xh, hx, lx = corners(x1 + pw * bin_w, bin_w / n, width)
                plane = np.zeros((height, width))
                for rows, wy in ((yl, hy), (yh, ly)):
                    for cols, wx in ((xl, hx), (xh, lx)):
                        np.add.at(plane, (rows[:, None], cols[None, :]), wy[:, None] * wx[None, :])
                result[int(b)] += grad_output[k, :, ph, pw, None, None] * plane / (n * n)
    return result


def test_large_sampling_ratio_against_brute_force():
    # ratio 1000 against a per-sample float64 evaluation (every one of the 10^6 samples of each
    # bin scattering its four corners), independent of the oracle's per-axis sums.
    rng = np.random.default_rng(12)
    boxes = np.array([[0, -1.5, 0.5, 4.0, 3.5], [0, 2.25, -0.75, 6.5, 5.5]])
    grad_output = rng.standard_normal((2, 3, 1, 2))
    for aligned in (False, True):
        expected = brute_force_backward(grad_output, boxes, (1, 3, 5, 6), (1, 2), 1.0, 1000, aligned)
        assert_matches_reference(
            ref.roi_align_backward(grad_output, boxes, (1, 3, 5, 6), 1, 2, 1.0, 1000, aligned),
            expected,
            rtol=0,
            atol=1e-12,
        )
        result = roi_bwd(
            grad_output.astype(np.float32), boxes.astype(np.float32), (1, 3, 5, 6), 1, 2, 1.0, 1000, aligned
        )
        assert_matches_reference(result, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", float32_quick(DTYPES), ids=str)
def test_large_sampling_ratio_thread_count_does_not_change_bits(dtype):
    args = huge_ratio_case(np.random.default_rng(3), dtype, 300000, True)
    assert_thread_invariant(lambda: roi_bwd(*args))


# --------------------------------------------------------------------------------------------
# layouts, strides, out=, threads
# --------------------------------------------------------------------------------------------


def _backward_case(seed, input_shape, num_boxes, pooled_height, pooled_width, dtype):
    """A backward call's arguments: random boxes over the input (scale 0.5, some partly outside
    it) and a random gradient, adaptive sampling, aligned."""
    rng = np.random.default_rng(seed)
    batch, channels, height, width = input_shape
    boxes = random_boxes(rng, num_boxes, batch, height, width, 0.5).astype(dtype)
    grad_output = rng.standard_normal((num_boxes, channels, pooled_height, pooled_width)).astype(dtype)
    return grad_output, boxes, input_shape, pooled_height, pooled_width, 0.5, 0, True


def big_case(dtype=np.float32):
    """Several images, channel blocks and row bands of the scatter kernel."""
    return _backward_case(8, (3, 37, 45, 61), 40, 5, 4, dtype)


def small_case(dtype=np.float32):
    """A call small enough for the serial twin (the kernel the contract's small cases compile)."""
    return _backward_case(9, (2, 5, 9, 11), 6, 3, 2, dtype)


def test_task_partition_does_not_change_bits(monkeypatch, replan):
    args = big_case()
    expected = check_against_reference(args)
    for block, scratch in ((1, 1), (5, 4000), (64, 1 << 30)):
        monkeypatch.setattr(kernels, "CHANNEL_BLOCK", block)
        monkeypatch.setattr(kernels, "SCRATCH_BYTES", scratch)
        replan()
        assert bitwise_equal(roi_bwd(*args), expected)


@pytest.mark.parametrize("dtype", float32_quick(DTYPES), ids=str)
def test_register_tiles_and_their_edges_every_dtype(dtype, monkeypatch, replan):
    # 37 channels: two 16-channel register tiles and 5 leftover channels; PW 18: a full and a
    # 2-column bin-row tile; bands of one 3-pixel row (under a tile) and of many rows.
    check_against_reference(big_case(dtype))
    rng = np.random.default_rng(9)
    boxes = random_boxes(rng, 9, 2, 9, 3, 1.0).astype(dtype)
    grad_output = rng.standard_normal((9, 37, 2, 18)).astype(dtype)
    args = (grad_output, boxes, (2, 37, 9, 3), 2, 18, 1.0, 2, False)
    expected = check_against_reference(args)
    monkeypatch.setattr(kernels, "SCRATCH_BYTES", 1)
    replan()
    assert bitwise_equal(roi_bwd(*args), expected)


@pytest.mark.parametrize("dtype", float32_quick([np.float32, np.float64]))
def test_serial_twin_equals_parallel(monkeypatch, dtype):
    from fastbwd.kernels import _jit

    args = big_case(dtype)
    parallel = roi_bwd(*args)
    monkeypatch.setattr(_jit, "_serial_only", True)
    assert bitwise_equal(roi_bwd(*args), parallel)


def test_strided_and_negative_stride_inputs():
    grad_output, boxes, *rest = big_case()
    grad_strided = channels_last(grad_output)[::-1]
    boxes_strided = np.asfortranarray(boxes)[::-1]
    expected = roi_bwd(np.ascontiguousarray(grad_strided), np.ascontiguousarray(boxes_strided), *rest)
    assert bitwise_equal(roi_bwd(grad_strided, boxes_strided, *rest), expected)


def test_inputs_are_not_mutated_and_out_is_overwritten():
    args = big_case()
    snapshot = (args[0].copy(), args[1].copy())
    out = np.full(args[2], np.nan, np.float32)
    assert roi_bwd(*args, out=out) is out
    assert bitwise_equal(out, roi_bwd(*args))
    assert bitwise_equal(args[0], snapshot[0]) and bitwise_equal(args[1], snapshot[1])


# --------------------------------------------------------------------------------------------
# argument forms, torch
# --------------------------------------------------------------------------------------------


def test_lists_and_numpy_scalars_are_accepted():
    grad_output = [[[[1.0, 2.0]]]]
    boxes = [[0, 0.0, 0.0, 4.0, 2.0]]
    by_list = roi_bwd(grad_output, boxes, [1, 1, 3, 5], 1, 2, 1.0, 1, True)
    by_numpy = roi_bwd(
        np.array(grad_output),
        np.array(boxes),
        (np.int64(1), 1, 3, 5),
        np.int32(1),
        np.int64(2),
        np.float32(1.0),
        np.int8(1),
        np.bool_(True),
    )
    assert by_list.dtype == np.float64 and bitwise_equal(by_list, by_numpy)


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    grad, boxes, *rest = small_case()
    result = roi_bwd(torch.from_numpy(grad).to(torch.bfloat16), torch.from_numpy(boxes).to(torch.bfloat16), *rest)
    assert result.dtype == BF16
    expected = ref.roi_align_backward(grad.astype(BF16), boxes.astype(BF16), *rest)
    assert_matches_reference(result, expected)


@pytest.mark.parametrize("sampling_ratio, aligned", [(2, True), (0, False)])
def test_matches_the_baselines(sampling_ratio, aligned):
    # The pure-PyTorch formulation (autograd) and the serial torchvision-style loop.
    pytest.importorskip("torch")
    from bench.roi_baselines import baselines

    grad_output, boxes, input_shape, ph, pw, scale, _, _ = big_case()
    boxes[:, 0] = np.abs(boxes[:, 0])  # torchvision truncates the batch index: keep it valid
    args = (grad_output, boxes, input_shape, ph, pw, scale, sampling_ratio, aligned)
    result = roi_bwd(*args)
    runs = baselines(*args)
    assert set(runs) == {"torch (pure PyTorch)", "serial loop"}
    for run in runs.values():
        expected = np.asarray(run())
        assert_matches_reference(result, expected.astype(np.float64))


# --------------------------------------------------------------------------------------------
# errors (docs/semantics.md §4)
# --------------------------------------------------------------------------------------------

GOOD = dict(
    grad_output=np.zeros((2, 3, 2, 2), np.float32),
    boxes=np.zeros((2, 5), np.float32),
    input_shape=(2, 3, 4, 5),
    pooled_height=2,
    pooled_width=2,
    spatial_scale=0.5,
    sampling_ratio=0,
    aligned=True,
)


def call(**changes):
    return roi_bwd(**dict(GOOD, **changes))


@pytest.mark.parametrize(
    "changes, message, param",
    [
        (dict(grad_output=np.zeros((2, 3, 2), np.float32)), r"grad_output must be 4-D, but got 3-D", "grad_output"),
        (dict(boxes=np.zeros((2, 4), np.float32)), r"boxes must have shape \(K, 5\), but got shape \(2, 4\)", "boxes"),
        (dict(boxes=np.zeros(10, np.float32)), r"boxes must have shape \(K, 5\), but got shape \(10,\)", "boxes"),
        (
            dict(boxes=np.zeros((3, 5), np.float32)),
            r"boxes\.shape\[0\] must be 2 \(K of grad_output\), but got 3",
            "boxes",
        ),
        (dict(input_shape=(2, 3, 4)), r"input_shape must have length 4, but got length 3", "input_shape"),
        (dict(input_shape=(2, 3, 4, 5, 1)), r"input_shape must have length 4, but got length 5", "input_shape"),
        (dict(input_shape=(2, 3, -4, 5)), r"input_shape\[2\] must be >= 0, but got -4", "input_shape"),
        (
            dict(input_shape=(2, 3, 4.0, 5)),
            r"input_shape\[2\] must be an integer, but got 4.0 \(a float\)",
            "input_shape",
        ),
        (dict(input_shape=(2, 4, 4, 5)), r"input_shape\[1\] must be 3 \(C of grad_output\), but got 4", "input_shape"),
        (dict(pooled_height=3), r"grad_output\.shape\[2\] must be 3 \(pooled_height\), but got 2", "grad_output"),
        (dict(pooled_width=1), r"grad_output\.shape\[3\] must be 1 \(pooled_width\), but got 2", "grad_output"),
        (dict(pooled_height=2.0), r"pooled_height must be an integer, but got 2.0 \(a float\)", "pooled_height"),
        (
            dict(spatial_scale=0.0),
            r"spatial_scale must be greater than FLT_MIN \(1.17549435e-38\), but got 0.0",
            "spatial_scale",
        ),
        (dict(spatial_scale=1e-38), r"spatial_scale must be greater than FLT_MIN .*, but got 1e-38", "spatial_scale"),
        (dict(spatial_scale=-1.0), r"spatial_scale must be greater than FLT_MIN .*, but got -1.0", "spatial_scale"),
        (
            dict(spatial_scale=float("nan")),
            r"spatial_scale must be greater than FLT_MIN .*, but got nan",
            "spatial_scale",
        ),
        (dict(spatial_scale="1"), r"spatial_scale must be a real number, but got '1'", "spatial_scale"),
        (dict(sampling_ratio=-1), r"sampling_ratio must be >= 0 \(0 means adaptive\), but got -1", "sampling_ratio"),
        (dict(sampling_ratio=2.0), r"sampling_ratio must be an integer, but got 2.0 \(a float\)", "sampling_ratio"),
        (dict(sampling_ratio=True), r"sampling_ratio must be an integer, but got True \(a bool\)", "sampling_ratio"),
        (dict(aligned=1), r"aligned must be a bool, but got 1", "aligned"),
        (
            dict(grad_output=np.zeros((2, 3, 2, 2), np.int32)),
            r"grad_output\.dtype must be one of float32, float16, bfloat16, float64, but got int32",
            "grad_output",
        ),
        (
            dict(boxes=np.zeros((2, 5), np.float64)),
            r"boxes\.dtype must equal grad_output\.dtype \(float32\), but got float64",
            "boxes",
        ),
        (dict(grad_output=np.array(["a"])), r"grad_output must be a numeric array", "grad_output"),
        (dict(boxes=object()), r"boxes must be a numeric array", "boxes"),
    ],
)
def test_errors(changes, message, param):
    with raises_param_error(message, param=param):
        call(**changes)


@pytest.mark.parametrize(
    "name",
    [
        "grad_output",
        "boxes",
        "input_shape",
        "pooled_height",
        "pooled_width",
        "spatial_scale",
        "sampling_ratio",
        "aligned",
    ],
)
def test_none_is_nullptr(name):
    with raises_param_error(rf"{name} is required, but got None", status=161001, param=name):
        call(**{name: None})


def test_param_error_is_value_and_type_error():
    assert issubclass(fastbwd.ParamError, ValueError) and issubclass(fastbwd.ParamError, TypeError)
    with pytest.raises(ValueError):
        call(sampling_ratio=-3)


# --------------------------------------------------------------------------------------------
# the forward (roi_align_forward, for fastbwd.torch): the adjoint of the backward
# --------------------------------------------------------------------------------------------

roi_fwd = api.roi_align_forward


def assert_forward_matches(result, expected):
    """A forward result against the float64 oracle: a bin sums up to hundreds of products in the
    compute type, with cancellation (random signs), so float32 gets 2e-5 of the largest value
    rather than the backward's per-element rtol; half formats within 1 ulp, or that 2e-5 where a
    value cancelled to near zero."""
    if result.dtype == np.float32:
        assert_matches_reference(result, expected, rtol=0, atol=2e-5)
    else:
        assert_matches_reference(result, expected, atol_scale=2e-5)


def forward_case(rng, dtype):
    """A random valid forward call (the parameters of :func:`random_case`) with bad boxes mixed in."""
    grad_output, boxes, input_shape, ph, pw, scale, ratio, aligned = random_case(rng, dtype)
    bad = np.array([[0, np.nan, 1, 3, 3], [0, 1, 1, np.inf, 3], [-1, 1, 1, 3, 3], [input_shape[0], 1, 1, 3, 3]])
    boxes = np.concatenate([boxes, bad.astype(dtype)])
    x = rng.standard_normal(input_shape).astype(dtype)
    return x, boxes, ph, pw, scale, ratio, aligned


@pytest.mark.parametrize("dtype", float32_quick(DTYPES), ids=str)
def test_forward_matches_reference_random_cases(dtype):
    rng = np.random.default_rng(21)
    for _ in range(30):
        args = forward_case(rng, dtype)
        result = roi_fwd(*args)
        assert result.dtype == dtype and result.flags.c_contiguous
        assert result.shape == (args[1].shape[0], args[0].shape[1], args[2], args[3])
        assert_forward_matches(result, ref.roi_align_forward(*args))
        assert not result[-4:].astype(np.float64).any()  # NaN, Inf and out-of-range boxes give zeros


@pytest.mark.parametrize("sampling_ratio", [0, 1, 2, 1000])
@pytest.mark.parametrize("aligned", [False, True])
def test_forward_is_the_adjoint_of_the_backward(sampling_ratio, aligned):
    # <forward(x), g> == <x, backward(g)> in float64: the forward and the backward read the same
    # weights (the key test that they agree), whatever the boxes.
    rng = np.random.default_rng(31 + sampling_ratio + aligned)
    for _ in range(8):
        x, boxes, ph, pw, scale, _, _ = forward_case(rng, np.float64)
        g = rng.standard_normal((boxes.shape[0], x.shape[1], ph, pw))
        lhs = np.sum(roi_fwd(x, boxes, ph, pw, scale, sampling_ratio, aligned) * g)
        rhs = np.sum(x * roi_bwd(g, boxes, x.shape, ph, pw, scale, sampling_ratio, aligned))
        assert np.isclose(lhs, rhs, rtol=1e-13, atol=1e-13), (lhs, rhs)


def test_forward_by_hand():
    # aligned=False, scale 1, box (0, 0, 2, 2): one sample at (1, 1), exactly on pixel (1, 1);
    # aligned, box (0.5, 0.5, 1.5, 1.5) + 0.25: one sample at (0.75, 0.75) -> bilinear value.
    x = np.arange(12.0).reshape(1, 1, 3, 4)
    assert roi_fwd(x, [[0, 0, 0, 2, 2.0]], 1, 1, 1.0, 1, False)[0, 0, 0, 0] == 5.0
    value = roi_fwd(x, [[0, 0.75, 0.75, 1.75, 1.75]], 1, 1, 1.0, 1, True)[0, 0, 0, 0]
    assert value == 0.75 * 0.75 * 5 + 0.25 * 0.75 * 4 + 0.75 * 0.25 * 1 + 0.25 * 0.25 * 0


def forward_big_case(dtype=np.float32):
    """Several images and channel blocks (70 channels), some boxes skipped."""
    rng = np.random.default_rng(18)
    boxes = random_boxes(rng, 30, 3, 45, 61, 0.5)
    boxes[[3, 17], 0] = [-1, 3]
    x = rng.standard_normal((3, 70, 45, 61)).astype(dtype)
    return x, boxes.astype(dtype), 5, 4, 0.5, 0, True


@pytest.mark.parametrize("dtype", float32_quick(DTYPES), ids=str)
def test_forward_layout_and_channel_blocks_do_not_change_bits(dtype, monkeypatch, replan):
    x, *rest = forward_big_case(dtype)
    expected = roi_fwd(x, *rest)
    assert_forward_matches(expected, ref.roi_align_forward(x, *rest))
    x_cl = channels_last(x)
    assert bitwise_equal(roi_fwd(x_cl, *rest), expected)
    for block in (1, 16, 128):
        monkeypatch.setattr(kernels, "FORWARD_CHANNEL_BLOCK", block)
        monkeypatch.setattr(kernels, "CHANNELS_LAST_BLOCK", block)
        replan()
        assert bitwise_equal(roi_fwd(x, *rest), expected)
        assert bitwise_equal(roi_fwd(x_cl, *rest), expected)


@pytest.mark.parametrize("dtype", float32_quick([np.float32, np.float64]))
def test_forward_serial_twin_strides_out_and_inputs(dtype):
    from fastbwd.kernels import _jit

    x, boxes, *rest = forward_big_case(dtype)
    snapshot = (x.copy(), boxes.copy())
    expected = roi_fwd(x, boxes, *rest)
    strided = np.asfortranarray(x)[:, ::-1][:, ::-1]
    assert bitwise_equal(roi_fwd(strided, np.asfortranarray(boxes), *rest), expected)
    out = np.full(expected.shape, np.nan, dtype)
    assert roi_fwd(x, boxes, *rest, out=out) is out and bitwise_equal(out, expected)
    assert bitwise_equal(x, snapshot[0]) and bitwise_equal(boxes, snapshot[1])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_jit, "_serial_only", True)
        assert bitwise_equal(roi_fwd(x, boxes, *rest), expected)


def test_forward_empty_cases():
    boxes = np.array([[0, 1.0, 1.0, 3.0, 3.0], [1, 0.0, 0.0, 2.0, 2.0]], np.float32)
    # K == 0, C == 0
    no_boxes = np.zeros((0, 5), np.float32)
    assert roi_fwd(np.ones((2, 3, 4, 5), np.float32), no_boxes, 2, 2, 1.0, 0, True).shape == (0, 3, 2, 2)
    assert roi_fwd(np.ones((2, 0, 4, 5), np.float32), boxes, 2, 3, 1.0, 0, True).shape == (2, 0, 2, 3)
    # B == 0 (every box skipped), H == 0, W == 0: zeros, written into out too
    for shape in ((0, 3, 4, 5), (2, 3, 0, 5), (2, 3, 4, 0)):
        out = np.full((2, 3, 2, 2), np.nan, np.float32)
        result = roi_fwd(np.ones(shape, np.float32), boxes, 2, 2, 1.0, 0, True, out=out)
        assert result is out and not result.any()
    result = roi_fwd(np.ones((1, 2, 4, 5), BF16), boxes.astype(BF16), 2, 2, 1.0, 2, False)
    assert result.dtype == BF16 and result[0].astype(np.float32).all() and not result[1].astype(np.float32).any()


def test_forward_matches_the_pure_pytorch_formulation():
    # An independent formulation (torch gathers and index_add, roi_baselines) as a cross-check.
    pytest.importorskip("torch")
    from bench.roi_baselines import torch_forward

    x, boxes, ph, pw, scale, _, aligned = forward_big_case()
    boxes[:, 0] = np.clip(boxes[:, 0], 0, 2)  # torchvision truncates the batch index: keep it valid
    for ratio in (0, 2):
        expected = torch_forward(x, boxes, ph, pw, scale, ratio, aligned)
        assert_matches_reference(
            roi_fwd(x, boxes, ph, pw, scale, ratio, aligned), expected.astype(np.float64), rtol=1e-5, atol=1e-5
        )


FORWARD_GOOD = dict(
    input=np.zeros((2, 3, 4, 5), np.float32),
    boxes=np.zeros((2, 5), np.float32),
    pooled_height=2,
    pooled_width=2,
    spatial_scale=0.5,
    sampling_ratio=0,
    aligned=True,
)


@pytest.mark.parametrize(
    "changes, message, param",
    [
        (dict(input=np.zeros((3, 4, 5), np.float32)), r"input must be 4-D, but got 3-D", "input"),
        (
            dict(input=np.zeros((2, 3, 4, 5), np.int64)),
            r"input\.dtype must be one of float32, float16, bfloat16, float64, but got int64",
            "input",
        ),
        (dict(boxes=np.zeros((2, 4), np.float32)), r"boxes must have shape \(K, 5\), but got shape \(2, 4\)", "boxes"),
        (
            dict(boxes=np.zeros((2, 5), np.float64)),
            r"boxes\.dtype must equal input\.dtype \(float32\), but got float64",
            "boxes",
        ),
        (dict(pooled_height=0), r"pooled_height must be > 0, but got 0", "pooled_height"),
        (dict(pooled_width=-2), r"pooled_width must be > 0, but got -2", "pooled_width"),
        (dict(pooled_width=2.0), r"pooled_width must be an integer, but got 2.0 \(a float\)", "pooled_width"),
        (
            dict(spatial_scale=0.0),
            r"spatial_scale must be greater than FLT_MIN \(1.17549435e-38\), but got 0.0",
            "spatial_scale",
        ),
        (dict(sampling_ratio=-1), r"sampling_ratio must be >= 0 \(0 means adaptive\), but got -1", "sampling_ratio"),
        (dict(aligned=0), r"aligned must be a bool, but got 0", "aligned"),
        (
            dict(out=np.zeros((2, 3, 2, 3), np.float32)),
            r"out\.shape must be \(2, 3, 2, 2\), but got \(2, 3, 2, 3\)",
            "out",
        ),
        (dict(out=np.zeros((2, 3, 2, 2), np.float64)), r"out\.dtype must be float32, but got float64", "out"),
    ],
)
def test_forward_errors(changes, message, param):
    with raises_param_error(r"^roi_align_forward: " + message, param=param):
        roi_fwd(**dict(FORWARD_GOOD, **changes))


@pytest.mark.parametrize(
    "name", ["input", "boxes", "pooled_height", "pooled_width", "spatial_scale", "sampling_ratio", "aligned"]
)
def test_forward_none_is_nullptr(name):
    with raises_param_error(rf"^roi_align_forward: {name} is required, but got None", status=161001, param=name):
        roi_fwd(**dict(FORWARD_GOOD, **{name: None}))


def test_forward_docstring_matches_signature():
    import inspect
    import re

    doc = inspect.getdoc(roi_fwd)
    for section in ("Parameters", "Returns", "Raises"):
        assert re.search(rf"^{section}\n-+$", doc, re.M), section
    parameters = re.search(r"^Parameters\n-+\n(.*?)^Returns\n", doc, re.S | re.M).group(1)
    documented = [
        name
        for line in parameters.splitlines()
        for match in [re.match(r"^(\w+(?:, \w+)*) :", line)]
        if match
        for name in match.group(1).split(", ")
    ]
    assert documented == list(inspect.signature(roi_fwd).parameters)
    assert "roi_align_forward" not in fastbwd.__all__ and not hasattr(fastbwd, "roi_align_forward")


# --------------------------------------------------------------------------------------------
# the channels-last layout (layout="NHWC", issue 40): the NCHW results transposed, bitwise
# --------------------------------------------------------------------------------------------


def nhwc(array):
    """An NCHW-shaped array's values as a C-contiguous (N, H, W, C) array."""
    return np.ascontiguousarray(np.asarray(array).transpose(0, 2, 3, 1))


def nchw(array):
    """The (N, C, H, W) view of an (N, H, W, C) array."""
    return array.transpose(0, 3, 1, 2)


def assert_nhwc_backward_is_nchw(args):
    """The backward in both layouts on the same values: NHWC shaped (B, H, W, C), C-contiguous,
    bitwise the NCHW result; returns the NCHW result."""
    grad_output, boxes, input_shape, *rest = args
    expected = roi_bwd(*args)
    result = roi_bwd(nhwc(grad_output), boxes, input_shape, *rest, layout="NHWC")
    batch, channels, height, width = input_shape
    assert result.shape == (batch, height, width, channels) and result.flags.c_contiguous
    assert bitwise_equal(nchw(result), expected)
    return expected


def assert_nhwc_forward_is_nchw(x, *rest):
    expected = roi_fwd(x, *rest)
    result = roi_fwd(nhwc(x), *rest, layout="NHWC")
    assert result.shape == (expected.shape[0],) + expected.shape[2:] + (expected.shape[1],)
    assert result.flags.c_contiguous and bitwise_equal(nchw(result), expected)
    return expected


@pytest.mark.parametrize("dtype", float32_quick(DTYPES), ids=str)
def test_nhwc_equals_nchw_bitwise_and_the_reference(dtype):
    rng = np.random.default_rng(40)
    for _ in range(25):
        args = random_case(rng, dtype)
        assert_matches_reference(assert_nhwc_backward_is_nchw(args), ref.roi_align_backward(*args))
        x, *rest = forward_case(rng, dtype)
        assert_forward_matches(assert_nhwc_forward_is_nchw(x, *rest), ref.roi_align_forward(x, *rest))


@pytest.mark.parametrize("sampling_ratio", [0, 1, 2, 1000])
@pytest.mark.parametrize("aligned", [False, True])
def test_nhwc_every_sampling_and_alignment(sampling_ratio, aligned):
    # 37 channels (two 16-lane groups and 5 leftover), boxes partly outside, bad boxes mixed in
    args = big_case()
    args = args[:6] + (sampling_ratio, aligned)
    assert_nhwc_backward_is_nchw(args)
    x, boxes, *rest = forward_big_case()
    assert_nhwc_forward_is_nchw(x, boxes, *rest[:3], sampling_ratio, aligned)


def test_nhwc_forward_is_the_adjoint_of_the_backward():
    # <forward(x), g> == <x, backward(g)> in float64, both in the NHWC layout
    rng = np.random.default_rng(41)
    for ratio, aligned in ((0, False), (2, True), (5, False)):
        x, boxes, ph, pw, scale, _, _ = forward_case(rng, np.float64)
        pooled = roi_fwd(nhwc(x), boxes, ph, pw, scale, ratio, aligned, layout="NHWC")
        g = rng.standard_normal(pooled.shape)
        grad_input = roi_bwd(g, boxes, x.shape, ph, pw, scale, ratio, aligned, layout="NHWC")
        left, right = float(np.sum(pooled * g)), float(np.sum(nhwc(x) * grad_input))
        assert abs(left - right) <= 1e-10 * max(1.0, abs(left))


def test_nhwc_on_the_registrys_cases():
    # every dtype of every kernel path of the registry: its NHWC path's result is its NCHW
    # path's, transposed, bitwise
    from fastbwd._dtypes import BY_NAME
    from fastbwd._registry import OPERATORS

    for name in ("roi_align_backward", "roi_align_forward"):
        by_layout = {path.layout: path for path in OPERATORS[name].paths}
        assert set(by_layout) == {"NCHW", "NHWC"}
        for dtype in by_layout["NHWC"].dtypes:
            expected = by_layout["NCHW"].call(BY_NAME[dtype])
            assert bitwise_equal(nchw(by_layout["NHWC"].call(BY_NAME[dtype])), expected)


@pytest.mark.parametrize("dtype", float32_quick(DTYPES), ids=str)
def test_nhwc_thread_count_and_partition_do_not_change_bits(dtype, monkeypatch, replan):
    grad_output, boxes, input_shape, *rest = big_case(dtype)
    expected = nhwc(roi_bwd(grad_output, boxes, input_shape, *rest))
    g = nhwc(grad_output)
    assert_thread_invariant(lambda: roi_bwd(g, boxes, input_shape, *rest, layout="NHWC"))
    x, *forward_rest = forward_big_case(dtype)
    forward_expected = nhwc(roi_fwd(x, *forward_rest))
    x_nhwc = nhwc(x)
    assert_thread_invariant(lambda: roi_fwd(x_nhwc, *forward_rest, layout="NHWC"))
    for block, scratch in ((1, 1), (16, 4000), (20, 1 << 30)):
        monkeypatch.setattr(kernels, "CHANNELS_LAST_BLOCK", block)
        monkeypatch.setattr(kernels, "SCRATCH_BYTES", scratch)
        replan()
        assert bitwise_equal(roi_bwd(g, boxes, input_shape, *rest, layout="NHWC"), expected)
        assert bitwise_equal(roi_fwd(x_nhwc, *forward_rest, layout="NHWC"), forward_expected)


@pytest.mark.parametrize("dtype", float32_quick([np.float32, np.float64]))
def test_nhwc_serial_twin_strides_inputs_and_out(dtype):
    from fastbwd.kernels import _jit

    grad_output, boxes, input_shape, *rest = big_case(dtype)
    g = nhwc(grad_output)
    expected = roi_bwd(g, boxes, input_shape, *rest, layout="NHWC")
    x, _, *forward_rest = forward_big_case(dtype)
    x_nhwc = nhwc(x)
    forward_expected = roi_fwd(x_nhwc, boxes, *forward_rest, layout="NHWC")
    snapshot = (g.copy(), x_nhwc.copy(), boxes.copy())
    # any strides: a non-contiguous NHWC array is read through a copy
    for strided in (np.asfortranarray(g), g[:, ::-1][:, ::-1]):
        assert bitwise_equal(roi_bwd(strided, boxes, input_shape, *rest, layout="NHWC"), expected)
    strided = np.asfortranarray(x_nhwc)
    assert bitwise_equal(roi_fwd(strided, boxes, *forward_rest, layout="NHWC"), forward_expected)
    # out=: overwritten and returned
    out = np.full(expected.shape, np.nan, dtype)
    assert roi_bwd(g, boxes, input_shape, *rest, layout="NHWC", out=out) is out and bitwise_equal(out, expected)
    out = np.full(forward_expected.shape, np.nan, dtype)
    assert roi_fwd(x_nhwc, boxes, *forward_rest, layout="NHWC", out=out) is out
    assert bitwise_equal(out, forward_expected)
    for array, kept in zip((g, x_nhwc, boxes), snapshot):
        assert bitwise_equal(array, kept)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_jit, "_serial_only", True)
        assert bitwise_equal(roi_bwd(g, boxes, input_shape, *rest, layout="NHWC"), expected)
        assert bitwise_equal(roi_fwd(x_nhwc, boxes, *forward_rest, layout="NHWC"), forward_expected)


def test_nhwc_empty_cases():
    boxes = np.array([[0, 1.0, 1.0, 3.0, 3.0], [1, 0.0, 0.0, 2.0, 2.0]], np.float32)
    g = np.ones((2, 2, 2, 3), np.float32)  # (K, PH, PW, C)
    for input_shape in ((0, 3, 4, 5), (2, 3, 0, 5), (2, 3, 4, 0)):
        result = roi_bwd(g, boxes, input_shape, 2, 2, 1.0, 0, True, layout="NHWC")
        b, c, h, w = input_shape
        assert result.shape == (b, h, w, c) and not result.any()
    assert not roi_bwd(g[:0], boxes[:0], (2, 3, 4, 5), 2, 2, 1.0, 0, True, layout="NHWC").any()
    assert roi_fwd(np.ones((2, 4, 5, 3), np.float32), boxes[:0], 2, 2, 1.0, 0, True, layout="NHWC").shape == (
        0,
        2,
        2,
        3,
    )
    out = np.full((2, 2, 2, 3), np.nan, np.float32)
    result = roi_fwd(np.ones((2, 0, 5, 3), np.float32), boxes, 2, 2, 1.0, 0, True, layout="NHWC", out=out)
    assert result is out and not result.any()


NHWC_GOOD = dict(GOOD, grad_output=nhwc(GOOD["grad_output"]), layout="NHWC")


@pytest.mark.parametrize(
    "changes, message, param",
    [
        (dict(layout="nhwc"), r"layout must be one of 'NCHW', 'NHWC', but got 'nhwc'", "layout"),
        (dict(pooled_height=3), r"grad_output\.shape\[1\] must be 3 \(pooled_height\), but got 2", "grad_output"),
        (dict(pooled_width=1), r"grad_output\.shape\[2\] must be 1 \(pooled_width\), but got 2", "grad_output"),
        (dict(input_shape=(2, 4, 4, 5)), r"input_shape\[1\] must be 3 \(C of grad_output\), but got 4", "input_shape"),
        (
            dict(out=np.zeros(GOOD["input_shape"], np.float32)),
            r"out\.shape must be \(2, 4, 5, 3\), but got \(2, 3, 4, 5\)",
            "out",
        ),
        (
            dict(out=np.zeros((2, 3, 4, 5), np.float32).transpose(0, 2, 3, 1)),
            r"out must be C-contiguous like the result",
            "out",
        ),
    ],
)
def test_nhwc_errors(changes, message, param):
    with raises_param_error(r"^roi_align_backward: " + message, param=param):
        roi_bwd(**dict(NHWC_GOOD, **changes))


def test_nhwc_layout_none_is_nullptr():
    with raises_param_error(r"^roi_align_backward: layout is required, but got None", status=161001, param="layout"):
        roi_bwd(**dict(NHWC_GOOD, layout=None))


@pytest.mark.parametrize(
    "changes, message, param",
    [
        (dict(layout="CHWN"), r"layout must be one of 'NCHW', 'NHWC', but got 'CHWN'", "layout"),
        (
            dict(out=np.zeros((2, 5, 2, 2), np.float32)),
            r"out\.shape must be \(2, 2, 2, 5\), but got \(2, 5, 2, 2\)",
            "out",
        ),
    ],
)
def test_nhwc_forward_errors(changes, message, param):
    # FORWARD_GOOD's (2, 3, 4, 5) input read as NHWC: H 3, W 4, C 5
    with raises_param_error(r"^roi_align_forward: " + message, param=param):
        roi_fwd(**dict(FORWARD_GOOD, **dict(dict(layout="NHWC"), **changes)))


def test_nhwc_out_overlapping_an_input():
    grad_output = nhwc(GOOD["grad_output"])
    memory = np.zeros(400, np.float32)
    out = memory[: 2 * 4 * 5 * 3].reshape(2, 4, 5, 3)
    grad = memory[100 : 100 + grad_output.size].reshape(grad_output.shape)
    with raises_param_error(r"roi_align_backward: out must not overlap grad_output, but got overlapping memory"):
        roi_bwd(**dict(NHWC_GOOD, grad_output=grad, out=out))
