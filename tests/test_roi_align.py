"""roi_align_backward (SPEC §4) against the float64 reference, its forward's adjoint, bad and
huge boxes, every dtype, threads, out=, strides, and every error of the SPEC."""

import ml_dtypes
import numpy as np
import pytest

import fastbwd
from fastbwd import roi_align_backward as roi_bwd
from fastbwd.api import roi_align as api
from fastbwd.testing import reference as ref
from fastbwd.testing.checks import (
    assert_matches_reference,
    assert_thread_invariant,
    bitwise_equal,
    raises_param_error,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16]


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
    return (grad_output, boxes, (batch, channels, height, width), pooled_height, pooled_width,
            spatial_scale, int(rng.integers(0, 4)), bool(rng.integers(0, 2)))


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

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
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
    check_against_reference((grad_output, boxes.astype(np.float32), (2, 3, 11, 13), 3, 2, 0.5,
                             sampling_ratio, aligned))


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
    boxes = np.array([
        [0, -6.0, -5.0, 3.0, 2.0],     # partly outside, top-left
        [1, 5.0, 4.0, 15.0, 12.0],     # partly outside, bottom-right
        [0, -30.0, -30.0, -10.0, -8],  # wholly outside: every sample skipped
        [1, 20.0, 1.0, 30.0, 5.0],     # wholly outside on the right
        [0, -2.0, -1.5, 9.0, 8.5],     # covers the image with a margin
    ])
    for aligned in (False, True):
        for ratio in (0, 2):
            result = check_against_reference((grad_output, boxes, (2, 2, 7, 9), 2, 3, 1.0, ratio, aligned))
            outside_only = roi_bwd(grad_output[2:4], boxes[2:4], (2, 2, 7, 9), 2, 3, 1.0, ratio, aligned)
            assert not outside_only.any()
            assert result.any()


@pytest.mark.parametrize("aligned", [False, True])
def test_degenerate_boxes(aligned):
    grad_output = np.random.default_rng(2).standard_normal((4, 2, 2, 2))
    boxes = np.array([
        [0, 3.0, 2.0, 3.0, 2.0],  # a point
        [0, 1.0, 1.0, 5.0, 1.0],  # a horizontal segment
        [0, 4.0, 3.0, 2.0, 1.0],  # inverted (x2 < x1, y2 < y1)
        [0, 2.5, 2.5, 2.5, 6.0],  # a vertical segment
    ])
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
    result = roi_bwd(np.zeros((0, 3, 2, 2), np.float32), np.zeros((0, 5), np.float32), (2, 3, 4, 5),
                     2, 2, 1.0, 0, True, out=out)
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


@pytest.mark.parametrize("batch_index, image", [
    (-1, None), (2, None), (0.5, 0), (1.9, 1), (-0.5, None), (np.nan, None), (np.inf, None), (-np.inf, None),
])
def test_batch_index(batch_index, image):
    # SPEC: b = floor(boxes[k, 0]); outside [0, B) or not finite -> the box contributes nothing.
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
    # there, as in the SPEC loop (and torchvision).
    grad_output = np.array([[[[np.inf, 1.0], [np.nan, -np.inf]]]], np.float32)
    boxes = np.array([[0, -1.0, 0.0, 6.0, 6.0]], np.float32)
    with np.errstate(invalid="ignore"):  # the reference computes inf * 0 too
        result = check_against_reference((grad_output, boxes, (1, 1, 5, 6), 2, 2, 1.0, 2, True))
    assert np.isnan(result).any() and np.isinf(result).any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("box, pooled", [
    ([0, -40000.0, -60.0, 60000.0, 40.0], (2, 1)),  # 1e5 x 100 = 1e7 pixels, wide
    ([0, -3.0, -90000.0, 5.0, 10000.0], (1, 3)),    # 8 x 1e5 plus, tall
])
def test_huge_adaptive_box_matches_reference(dtype, box, pooled):
    # Adaptive grids of 1e5 samples per bin along one axis: only the samples that can land in the
    # image are visited, while the divisor stays the full grid count.
    boxes = np.array([box, [0, 1.0, 1.0, 4.0, 3.0]], dtype)
    grad_output = np.random.default_rng(4).standard_normal((2, 3) + pooled).astype(dtype)
    for aligned in (False, True):
        check_against_reference((grad_output, boxes, (1, 3, 9, 12), *pooled, 1.0, 0, aligned))


def test_huge_square_box_returns():
    # ~1e7 pixels with adaptive sampling (452 x 452 samples per bin): visited are only those in
    # the image. float32 and float64 agree; 1e30 and float32-overflowing boxes return too.
    boxes = np.array([[0, -1500.0, -1600.0, 1662.0, 1562.0],
                      [0, -1e30, -1e30, 1e30, 1e30],
                      [0, -3e38, -3e38, 3e38, 3e38],
                      [0, 0.0, 0.0, 3e38, 3e38]])
    grad_output = np.random.default_rng(6).standard_normal((4, 2, 7, 7))
    for aligned in (False, True):
        wide = roi_bwd(grad_output, boxes, (1, 2, 10, 14), 7, 7, 1.0, 0, aligned)
        narrow = roi_bwd(grad_output.astype(np.float32), boxes.astype(np.float32), (1, 2, 10, 14), 7, 7, 1.0, 0, aligned)
        assert np.isfinite(wide).all() and np.isfinite(narrow).all()
        assert_matches_reference(narrow, wide, rtol=1e-4, atol=1e-5)
        scaled = roi_bwd(grad_output, boxes, (1, 2, 10, 14), 7, 7, 8.0, 0, aligned)
        assert np.isfinite(scaled).all()


# --------------------------------------------------------------------------------------------
# layouts, strides, out=, threads
# --------------------------------------------------------------------------------------------

def big_case(dtype=np.float32):
    """Several images, channel blocks and row bands of the scatter kernel."""
    rng = np.random.default_rng(8)
    input_shape = (3, 37, 45, 61)
    boxes = random_boxes(rng, 40, 3, 45, 61, 0.5).astype(dtype)
    grad_output = rng.standard_normal((40, 37, 5, 4)).astype(dtype)
    return grad_output, boxes, input_shape, 5, 4, 0.5, 0, True


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thread_count_does_not_change_bits(dtype):
    args = big_case(dtype)
    assert_thread_invariant(lambda: roi_bwd(*args))


def test_task_partition_does_not_change_bits(monkeypatch):
    args = big_case()
    expected = check_against_reference(args)
    for block, scratch in ((1, 1), (5, 4000), (64, 1 << 30)):
        monkeypatch.setattr(api, "_CHANNEL_BLOCK", block)
        monkeypatch.setattr(api, "_SCRATCH_BYTES", scratch)
        assert bitwise_equal(roi_bwd(*args), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_register_tiles_and_their_edges_every_dtype(dtype, monkeypatch):
    # 37 channels: two 16-channel register tiles and 5 leftover channels; PW 18: a full and a
    # 2-column bin-row tile; bands of one 3-pixel row (under a tile) and of many rows.
    check_against_reference(big_case(dtype))
    rng = np.random.default_rng(9)
    boxes = random_boxes(rng, 9, 2, 9, 3, 1.0).astype(dtype)
    grad_output = rng.standard_normal((9, 37, 2, 18)).astype(dtype)
    args = (grad_output, boxes, (2, 37, 9, 3), 2, 18, 1.0, 2, False)
    expected = check_against_reference(args)
    monkeypatch.setattr(api, "_SCRATCH_BYTES", 1)
    assert bitwise_equal(roi_bwd(*args), expected)


def test_serial_twin_equals_parallel(monkeypatch):
    from fastbwd.kernels import _jit

    args = big_case(np.float64)
    parallel = roi_bwd(*args)
    monkeypatch.setattr(_jit, "_serial_only", True)
    assert bitwise_equal(roi_bwd(*args), parallel)


def test_strided_and_negative_stride_inputs():
    grad_output, boxes, *rest = big_case()
    grad_strided = np.ascontiguousarray(grad_output.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)[::-1]
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


@pytest.mark.parametrize("bad_out, message", [
    (np.empty((2, 3, 4, 6), np.float32), r"out\.shape must be \(2, 3, 4, 5\), but got \(2, 3, 4, 6\)"),
    (np.empty((2, 3, 4, 5), np.float64), r"out\.dtype must be float32, but got float64"),
    ([0.0], r"out must be a numpy.ndarray, but got \[0.0\]"),
    (np.empty((2, 3, 4, 10), np.float32)[..., ::2], r"out must be C-contiguous like the result"),
])
def test_bad_out_is_rejected_and_untouched(bad_out, message):
    snapshot = np.array(bad_out, copy=True)
    with raises_param_error(message, param="out"):
        call(out=bad_out)
    assert bitwise_equal(np.asarray(bad_out), snapshot)


def test_out_read_only_and_overlapping():
    read_only = np.zeros((2, 3, 4, 5), np.float32)
    read_only.flags.writeable = False
    with raises_param_error(r"out must be writeable, but got a read-only array"):
        call(out=read_only)
    memory = np.zeros(1000, np.float32)
    grad_output, out = memory[:24].reshape(2, 3, 2, 2), memory[10:130].reshape(2, 3, 4, 5)
    with raises_param_error(r"out must not overlap grad_output, but got overlapping memory"):
        call(grad_output=grad_output, out=out)


# --------------------------------------------------------------------------------------------
# argument forms, torch
# --------------------------------------------------------------------------------------------

def test_lists_and_numpy_scalars_are_accepted():
    grad_output = [[[[1.0, 2.0]]]]
    boxes = [[0, 0.0, 0.0, 4.0, 2.0]]
    by_list = roi_bwd(grad_output, boxes, [1, 1, 3, 5], 1, 2, 1.0, 1, True)
    by_numpy = roi_bwd(np.array(grad_output), np.array(boxes), (np.int64(1), 1, 3, 5), np.int32(1),
                       np.int64(2), np.float32(1.0), np.int8(1), np.bool_(True))
    assert by_list.dtype == np.float64 and bitwise_equal(by_list, by_numpy)


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    grad, boxes, *rest = big_case()
    result = roi_bwd(torch.from_numpy(grad).to(torch.bfloat16), torch.from_numpy(boxes).to(torch.bfloat16), *rest)
    assert result.dtype == BF16
    expected = ref.roi_align_backward(grad.astype(BF16), boxes.astype(BF16), *rest)
    assert_matches_reference(result, expected)


@pytest.mark.parametrize("sampling_ratio, aligned", [(2, True), (0, False)])
def test_matches_the_baselines(sampling_ratio, aligned):
    # The pure-PyTorch formulation (autograd) and the serial torchvision-style loop.
    pytest.importorskip("torch")
    from fastbwd.testing.roi_baselines import baselines

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
# errors (SPEC §4)
# --------------------------------------------------------------------------------------------

GOOD = dict(grad_output=np.zeros((2, 3, 2, 2), np.float32), boxes=np.zeros((2, 5), np.float32),
            input_shape=(2, 3, 4, 5), pooled_height=2, pooled_width=2, spatial_scale=0.5,
            sampling_ratio=0, aligned=True)


def call(**changes):
    return roi_bwd(**dict(GOOD, **changes))


@pytest.mark.parametrize("changes, message, param", [
    (dict(grad_output=np.zeros((2, 3, 2), np.float32)), r"grad_output must be 4-D, but got 3-D", "grad_output"),
    (dict(boxes=np.zeros((2, 4), np.float32)), r"boxes must have shape \(K, 5\), but got shape \(2, 4\)", "boxes"),
    (dict(boxes=np.zeros(10, np.float32)), r"boxes must have shape \(K, 5\), but got shape \(10,\)", "boxes"),
    (dict(boxes=np.zeros((3, 5), np.float32)), r"boxes\.shape\[0\] must be 2 \(K of grad_output\), but got 3",
     "boxes"),
    (dict(input_shape=(2, 3, 4)), r"input_shape must have length 4, but got length 3", "input_shape"),
    (dict(input_shape=(2, 3, 4, 5, 1)), r"input_shape must have length 4, but got length 5", "input_shape"),
    (dict(input_shape=(2, 3, -4, 5)), r"input_shape\[2\] must be >= 0, but got -4", "input_shape"),
    (dict(input_shape=(2, 3, 4.0, 5)), r"input_shape\[2\] must be an integer, but got 4.0 \(a float\)",
     "input_shape"),
    (dict(input_shape=(2, 4, 4, 5)), r"input_shape\[1\] must be 3 \(C of grad_output\), but got 4", "input_shape"),
    (dict(pooled_height=3), r"grad_output\.shape\[2\] must be 3 \(pooled_height\), but got 2", "grad_output"),
    (dict(pooled_width=1), r"grad_output\.shape\[3\] must be 1 \(pooled_width\), but got 2", "grad_output"),
    (dict(pooled_height=2.0), r"pooled_height must be an integer, but got 2.0 \(a float\)", "pooled_height"),
    (dict(spatial_scale=0.0), r"spatial_scale must be greater than FLT_MIN \(1.17549435e-38\), but got 0.0",
     "spatial_scale"),
    (dict(spatial_scale=1e-38), r"spatial_scale must be greater than FLT_MIN .*, but got 1e-38", "spatial_scale"),
    (dict(spatial_scale=-1.0), r"spatial_scale must be greater than FLT_MIN .*, but got -1.0", "spatial_scale"),
    (dict(spatial_scale=float("nan")), r"spatial_scale must be greater than FLT_MIN .*, but got nan", "spatial_scale"),
    (dict(spatial_scale="1"), r"spatial_scale must be a real number, but got '1'", "spatial_scale"),
    (dict(sampling_ratio=-1), r"sampling_ratio must be >= 0 \(0 means adaptive\), but got -1", "sampling_ratio"),
    (dict(sampling_ratio=2.0), r"sampling_ratio must be an integer, but got 2.0 \(a float\)", "sampling_ratio"),
    (dict(sampling_ratio=True), r"sampling_ratio must be an integer, but got True \(a bool\)", "sampling_ratio"),
    (dict(aligned=1), r"aligned must be a bool, but got 1", "aligned"),
    (dict(grad_output=np.zeros((2, 3, 2, 2), np.int32)),
     r"grad_output\.dtype must be one of float32, float16, bfloat16, float64, but got int32", "grad_output"),
    (dict(boxes=np.zeros((2, 5), np.float64)), r"boxes\.dtype must equal grad_output\.dtype \(float32\), but got float64",
     "boxes"),
    (dict(grad_output=np.array(["a"])), r"grad_output must be a numeric array", "grad_output"),
    (dict(boxes=object()), r"boxes must be a numeric array", "boxes"),
])
def test_errors(changes, message, param):
    with raises_param_error(message, param=param):
        call(**changes)


@pytest.mark.parametrize("name", ["grad_output", "boxes", "input_shape", "pooled_height", "pooled_width",
                                  "spatial_scale", "sampling_ratio", "aligned"])
def test_none_is_nullptr(name):
    with raises_param_error(rf"{name} is required, but got None", status=161001, param=name):
        call(**{name: None})


def test_param_error_is_value_and_type_error():
    assert issubclass(fastbwd.ParamError, ValueError) and issubclass(fastbwd.ParamError, TypeError)
    with pytest.raises(ValueError):
        call(sampling_ratio=-3)
