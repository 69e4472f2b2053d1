"""Random arguments, valid and not, for every public function: a call returns a result or raises
ParamError, never anything else (docs/semantics.md §0.4: no IndexError from deep inside, no crash, no garbage).

Each operator runs a few hundred seeded random calls mixing good and bad shapes, sizes, flags,
dtypes and non-finite values; every call that returns a result with finite inputs of ordinary
size is also checked against the float64 reference (a result is not enough: it must be right).
"""

import numpy as np
import pytest

import fastbwd
from fastbwd._validation import pooling_output_size
from fastbwd.testing import reference as ref
from fastbwd.testing.checks import assert_matches_reference

from conftest import BF16, channels_last

CALLS = 150


def _size(rng):
    return int(rng.choice([0, 1, 2, 3, 5, 8, 17]))


def _int(rng):
    return int(rng.choice([-3, -1, 0, 1, 2, 3, 4, 7, 2**31, 2**40]))


def _array(rng, shape, dtypes=(np.float32, np.float64, np.float16, BF16, np.int32, np.complex64)):
    values = rng.standard_normal(shape)
    if values.size and rng.random() < 0.2:
        values.flat[: max(1, values.size // 3)] = rng.choice([np.nan, np.inf, -np.inf, 1e38])
    return values.astype(dtypes[rng.integers(len(dtypes))])


def _ordinary(*arrays):
    """Finite values of ordinary size: the calls whose results are compared with the oracle
    (non-finite or huge inputs only have to give a result or a ParamError)."""
    return all(
        np.all(np.abs(np.asarray(a, np.float64) if np.asarray(a).dtype.kind != "c" else np.abs(a)) < 1e30)
        for a in arrays
    )


def _upsample(rng):
    n, c, h, w = (_size(rng) for _ in range(4))
    oh, ow = (_int(rng) for _ in range(2))
    grad = _array(rng, (n, c, max(oh, 0) % 9, max(ow, 0) % 9), (np.float32, BF16, np.float64))
    output_size = grad.shape[2:] if rng.random() < 0.7 else (oh, ow)
    align_corners, scales_h = bool(rng.random() < 0.5), float(rng.choice([0, 0.5, 1e-30, 3.0, -1]))
    layout = str(rng.choice(["NCHW", "NCHW", "NHWC", "nchw"]))
    result = fastbwd.upsample_bilinear2d_backward(
        grad, output_size, (n, c, h, w), align_corners, scales_h, None, layout=layout
    )

    def expected():
        if not _ordinary(grad):
            return None
        nchw = grad.transpose(0, 3, 1, 2) if layout == "NHWC" else grad
        want = ref.upsample_bilinear2d_backward(nchw, output_size, (n, c, h, w), align_corners, scales_h, 0.0)
        return want.transpose(0, 2, 3, 1) if layout == "NHWC" else want

    return result, expected


def _pad(rng):
    shape = tuple(_size(rng) for _ in range(int(rng.choice([3, 4]))))
    padding = tuple(int(rng.integers(-3, 4)) for _ in range(4))
    grad_shape = shape[:-2] + (max(shape[-2] + padding[2] + padding[3], 0), max(shape[-1] + padding[0] + padding[1], 0))
    grad = _array(rng, grad_shape)
    result = fastbwd.replication_pad2d_backward(grad, shape, padding)
    return result, lambda: ref.replication_pad2d_backward(grad, shape, padding) if _ordinary(grad) else None


def _roi_align(rng):
    k, b, c, h, w = (_size(rng) for _ in range(5))
    boxes = rng.uniform(-50, 80, (k, 5)).astype(np.float32)
    boxes[:, 0] = rng.integers(-1, b + 2, k)
    if k and rng.random() < 0.3:
        boxes[rng.integers(k), rng.integers(5)] = rng.choice([np.nan, np.inf, -np.inf, 1e30])
    ph, pw = int(rng.integers(0, 4)), int(rng.integers(0, 4))
    grad = _array(rng, (k, c, ph, pw), (np.float32,))
    scale = float(rng.choice([0.25, 1.0, 1e-39, 1e30, np.nan]))
    ratio, aligned = int(rng.choice([0, 1, 2, -1])), bool(rng.random() < 0.5)
    result = fastbwd.roi_align_backward(grad, boxes, (b, c, h, w), ph, pw, scale, ratio, aligned)

    def expected():
        # float32 coordinates against the oracle's float64: ordinary boxes and scales only (a
        # huge scaled box puts its samples where float32 cancellation decides), and few
        # samples for the oracle's Python loop
        if not (_ordinary(grad, boxes) and scale in (0.25, 1.0) and (ratio > 0 or scale == 0.25)):
            return None
        if grad.size == 0:  # no bins (PH or PW 0, no boxes or no channels): all zeros
            return np.zeros((b, c, h, w))
        return ref.roi_align_backward(grad, boxes, (b, c, h, w), ph, pw, scale, ratio, aligned)

    return result, expected


def _group_norm_swish(rng):
    n, c = _size(rng), _size(rng)
    groups = int(rng.choice([1, 2, 3, 0, -1]))
    shape = (n, c) + tuple(_size(rng) for _ in range(int(rng.integers(0, 3))))
    stats = (n, max(groups, 1))
    dy, mean = _array(rng, shape, (np.float32,)), _array(rng, stats, (np.float32,))
    rstd, x = np.abs(_array(rng, stats, (np.float32,))), _array(rng, shape, (np.float32,))
    gamma, beta = _array(rng, (c,), (np.float32,)), _array(rng, (c,), (np.float32,))
    data_format = str(rng.choice(["NCHW", "NHWC", "ND", "XYZ"]))
    swish_scale = float(rng.choice([1.0, -2.0, 0.0, 1e30, np.nan]))
    result = fastbwd.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, groups, data_format, swish_scale)

    def expected():
        if not (_ordinary(dy, mean, rstd, x, gamma, beta) and abs(swish_scale) < 1e30):
            return None
        if data_format == "NHWC":  # channels last: the oracle takes them at axis 1
            dx, dgamma, dbeta = ref.group_norm_swish_backward(
                np.moveaxis(dy, -1, 1), mean, rstd, np.moveaxis(x, -1, 1), gamma, beta, groups, swish_scale
            )
            return np.moveaxis(dx, 1, -1), dgamma, dbeta
        return ref.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, groups, swish_scale)

    return result, expected


def _group_norm_swish_forward(rng):
    n, c = _size(rng), _size(rng)
    groups = int(rng.choice([1, 2, 3, 0, -1]))
    shape = (n, c) + tuple(_size(rng) for _ in range(int(rng.integers(0, 3))))
    x = _array(rng, shape, (np.float32,))
    gamma, beta = _array(rng, (c,), (np.float32,)), _array(rng, (c,), (np.float32,))
    data_format = str(rng.choice(["NCHW", "NHWC", "ND", "XYZ"]))
    eps = float(rng.choice([1e-5, 0.0, 1.0, -1e-5, np.nan]))
    swish_scale = float(rng.choice([1.0, -2.0, 0.0, 1e30, np.nan]))
    result = fastbwd.group_norm_swish(x, gamma, beta, groups, data_format, eps, True, swish_scale)

    def expected():
        if not (_ordinary(x, gamma, beta) and abs(swish_scale) < 1e30 and eps > 0):
            return None
        moved = data_format == "NHWC"
        y, mean, rstd = ref.group_norm_swish_forward(
            np.moveaxis(x, -1, 1) if moved else x, gamma, beta, groups, eps, swish_scale
        )
        return (np.moveaxis(y, 1, -1) if moved else y), mean, rstd

    return result, expected


@pytest.mark.parametrize(
    "call", [_upsample, _pad, _roi_align, _group_norm_swish, _group_norm_swish_forward], ids=lambda f: f.__name__[1:]
)
def test_only_results_or_param_errors_and_valid_results_match_the_reference(call):
    rng = np.random.default_rng(20261121)
    results = compared = 0
    for _ in range(CALLS):
        try:
            result, expected = call(rng)
        except fastbwd.ParamError:
            continue
        results += 1
        want = expected()
        if want is None:
            continue
        compared += 1
        for actual, wanted in zip(
            result if isinstance(result, tuple) else (result,), want if isinstance(want, tuple) else (want,)
        ):
            assert actual.shape == wanted.shape
            if actual.size:
                assert_matches_reference(actual, wanted, **({"rtol": 1e-4, "atol": 1e-5} if call is _roi_align else {}))
    assert results >= CALLS // 20, "the random arguments hardly ever reached a kernel"
    assert compared >= 2, f"only {compared} of {results} results were compared with the reference"


# ---- valid random arguments only: every result against the reference ---------------------------

HALVES = (np.float16, BF16)
FLOATS = (np.float32, np.float64, np.float16, BF16)


def _valid_upsample(rng):
    dtype = FLOATS[rng.integers(4)]
    input_size = (int(rng.integers(0, 3)), int(rng.integers(0, 5)), int(rng.integers(1, 12)), int(rng.integers(1, 12)))
    output_size = (int(rng.integers(1, 20)), int(rng.integers(1, 20)))
    align_corners = bool(rng.random() < 0.5)
    scales = [float(rng.choice([0.0, -1.0, 0.7, 2.5, np.nan])) for _ in range(2)]
    grad = rng.standard_normal(input_size[:2] + output_size).astype(dtype)
    want = ref.upsample_bilinear2d_backward(grad, output_size, input_size, align_corners, *scales)
    if rng.random() < 0.5:
        result = fastbwd.upsample_bilinear2d_backward(
            np.ascontiguousarray(grad.transpose(0, 2, 3, 1)),
            output_size,
            input_size,
            align_corners,
            *scales,
            layout="NHWC",
        )
        return result.transpose(0, 3, 1, 2), want
    return fastbwd.upsample_bilinear2d_backward(grad, output_size, input_size, align_corners, *scales), want


def _valid_pad(rng):
    dtype = (np.float32, np.float64, np.float16, BF16, np.complex64, np.complex128)[rng.integers(6)]
    shape = tuple(int(rng.integers(1, 4)) for _ in range(int(rng.integers(1, 3)))) + (
        int(rng.integers(1, 9)),
        int(rng.integers(1, 9)),
    )
    height, width = shape[-2:]
    while True:
        padding = (
            int(rng.integers(-width + 1, width)),
            int(rng.integers(-width + 1, width)),
            int(rng.integers(-height + 1, height)),
            int(rng.integers(-height + 1, height)),
        )
        if width + padding[0] + padding[1] >= 1 and height + padding[2] + padding[3] >= 1:
            break
    grad_shape = shape[:-2] + (height + padding[2] + padding[3], width + padding[0] + padding[1])
    grad = rng.standard_normal(grad_shape)
    grad = (grad + 1j * rng.standard_normal(grad_shape) if np.dtype(dtype).kind == "c" else grad).astype(dtype)
    want = ref.replication_pad2d_backward(grad, shape, padding)
    if len(shape) == 4 and rng.random() < 0.5:  # channels-last strides
        grad = channels_last(grad)
    return fastbwd.replication_pad2d_backward(grad, shape, padding), want


def _valid_roi_align(rng):
    dtype = FLOATS[rng.integers(4)]
    batch, channels, height, width = (
        int(rng.integers(1, 3)),
        int(rng.integers(1, 20)),
        int(rng.integers(1, 12)),
        int(rng.integers(1, 12)),
    )
    count = int(rng.integers(0, 6))
    scale = float(rng.choice([0.25, 0.5, 1.0]))
    boxes = np.zeros((count, 5))
    boxes[:, 0] = rng.integers(-1, batch + 1, count) + rng.uniform(0, 0.9, count)
    corner = rng.uniform(-3, max(height, width) + 2, (count, 2)) / scale
    boxes[:, 1:3] = corner
    boxes[:, 3:5] = corner + rng.uniform(-1, 6, (count, 2)) / scale
    boxes = boxes.astype(dtype)
    pooled = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    ratio, aligned = int(rng.choice([0, 1, 2])), bool(rng.random() < 0.5)
    grad = rng.standard_normal((count, channels) + pooled).astype(dtype)
    result = fastbwd.roi_align_backward(grad, boxes, (batch, channels, height, width), *pooled, scale, ratio, aligned)
    return result, ref.roi_align_backward(grad, boxes, (batch, channels, height, width), *pooled, scale, ratio, aligned)


def _valid_group_norm_swish(rng):
    dtype = FLOATS[rng.integers(4)]
    groups = int(rng.integers(1, 4))
    channels = groups * int(rng.integers(1, 4))
    batch = int(rng.integers(1, 3))
    spatial = tuple(int(rng.integers(1, 6)) for _ in range(int(rng.integers(0, 3))))
    x = rng.standard_normal((batch, channels) + spatial).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    # statistics that are not those of x (the kernel must use them as given)
    mean = (rng.standard_normal((batch, groups)) * 0.3).astype(dtype)
    rstd = rng.uniform(0.5, 2.0, (batch, groups)).astype(dtype)
    param = (dtype, np.float32)[rng.integers(2)]
    gamma, beta = rng.uniform(-1.5, 1.5, channels).astype(param), rng.standard_normal(channels).astype(param)
    swish_scale = float(rng.choice([1.0, -2.0, 0.0, 0.5, 3.0]))
    want = ref.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, groups, swish_scale)
    if len(spatial) == 2 and rng.random() < 0.5:
        dx, dgamma, dbeta = fastbwd.group_norm_swish_backward(
            np.ascontiguousarray(np.moveaxis(dy, 1, -1)),
            mean,
            rstd,
            np.ascontiguousarray(np.moveaxis(x, 1, -1)),
            gamma,
            beta,
            groups,
            "NHWC",
            swish_scale,
        )
        return (np.moveaxis(dx, -1, 1), dgamma, dbeta), want
    return fastbwd.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, groups, "NCHW", swish_scale), want


@pytest.mark.parametrize(
    "call", [_valid_upsample, _valid_pad, _valid_roi_align, _valid_group_norm_swish], ids=lambda f: f.__name__[7:]
)
def test_valid_random_arguments_match_the_reference(call):
    rng = np.random.default_rng(20261123)
    for _ in range(CALLS // 3):
        result, want = call(rng)
        for actual, wanted in zip(
            result if isinstance(result, tuple) else (result,), want if isinstance(want, tuple) else (want,)
        ):
            assert actual.shape == wanted.shape
            if actual.size:
                # half-format GroupNorm+Swish: dx is a difference of float32 terms, rounded once:
                # within 1 ulp of the exact value except near cancellation (atol_scale)
                assert_matches_reference(
                    actual,
                    wanted,
                    atol_scale=1e-3 if call is _valid_group_norm_swish else 1e-6,
                    **({"rtol": 1e-4, "atol": 1e-5} if call is _valid_roi_align and actual.dtype == np.float32 else {}),
                )


def test_avg_pool_random_geometries_match_the_reference():
    rng = np.random.default_rng(7)
    results = 0
    for _ in range(CALLS):
        kernel = (int(rng.integers(1, 5)), int(rng.integers(1, 5)))
        stride = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        padding = (int(rng.integers(0, kernel[0] // 2 + 1)), int(rng.integers(0, kernel[1] // 2 + 1)))
        if rng.random() < 0.1:
            padding = (int(rng.integers(0, 4)), padding[1])  # sometimes more than k/2: an error
        height, width = int(rng.integers(1, 12)), int(rng.integers(1, 12))
        shape = ((int(rng.integers(0, 3)),) if rng.random() < 0.5 else ()) + (int(rng.integers(1, 4)), height, width)
        ceil_mode, count_include_pad = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
        divisor_override = int(rng.choice([0, 0, 3, -2]))
        out_h = pooling_output_size(height, kernel[0], stride[0], padding[0], ceil_mode)
        out_w = pooling_output_size(width, kernel[1], stride[1], padding[1], ceil_mode)
        dtype = (np.float32, np.float64, np.float16, BF16)[rng.integers(4)]
        grad = rng.standard_normal(shape[:-2] + (max(out_h, 0), max(out_w, 0))).astype(dtype)
        args = (shape, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
        try:
            result = fastbwd.avg_pool2d_backward(grad, *args)
        except fastbwd.ParamError:
            continue
        results += 1
        assert_matches_reference(result, ref.avg_pool2d_backward(grad, *args))
        assert np.isfinite(result.astype(np.float64)).all()
    assert results >= CALLS // 2
