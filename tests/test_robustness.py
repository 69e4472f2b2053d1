"""Random arguments, valid and not, for every public function: a call returns a result or raises
ParamError, never anything else (SPEC §0.4: no IndexError from deep inside, no crash, no garbage).

Each operator runs a few hundred seeded random calls mixing good and bad shapes, sizes, flags,
dtypes and non-finite values; avg_pool2d_backward's valid calls are also checked against the
reference.
"""

import ml_dtypes
import numpy as np
import pytest

import fastbwd
from fastbwd._validation import pooling_output_size
from fastbwd.testing import reference as ref
from fastbwd.testing.checks import assert_matches_reference

CALLS = 150
BF16 = ml_dtypes.bfloat16


def _size(rng):
    return int(rng.choice([0, 1, 2, 3, 5, 8, 17]))


def _int(rng):
    return int(rng.choice([-3, -1, 0, 1, 2, 3, 4, 7, 2**31, 2**40]))


def _array(rng, shape, dtypes=(np.float32, np.float64, np.float16, BF16, np.int32, np.complex64)):
    values = rng.standard_normal(shape)
    if values.size and rng.random() < 0.2:
        values.flat[: max(1, values.size // 3)] = rng.choice([np.nan, np.inf, -np.inf, 1e38])
    return values.astype(dtypes[rng.integers(len(dtypes))])


def _upsample(rng):
    n, c, h, w = (_size(rng) for _ in range(4))
    oh, ow = (_int(rng) for _ in range(2))
    grad = _array(rng, (n, c, max(oh, 0) % 9, max(ow, 0) % 9), (np.float32, BF16, np.float64))
    output_size = grad.shape[2:] if rng.random() < 0.7 else (oh, ow)
    return fastbwd.upsample_bilinear2d_backward(
        grad, output_size, (n, c, h, w), bool(rng.random() < 0.5), float(rng.choice([0, 0.5, 1e-30, 3.0, -1])),
        None, layout=str(rng.choice(["NCHW", "NCHW", "NHWC", "nchw"])))


def _pad(rng):
    shape = tuple(_size(rng) for _ in range(int(rng.choice([3, 4]))))
    padding = tuple(int(rng.integers(-3, 4)) for _ in range(4))
    grad_shape = shape[:-2] + (max(shape[-2] + padding[2] + padding[3], 0),
                               max(shape[-1] + padding[0] + padding[1], 0))
    return fastbwd.replication_pad2d_backward(_array(rng, grad_shape), shape, padding)


def _roi_align(rng):
    k, b, c, h, w = (_size(rng) for _ in range(5))
    boxes = rng.uniform(-50, 80, (k, 5)).astype(np.float32)
    boxes[:, 0] = rng.integers(-1, b + 2, k)
    if k and rng.random() < 0.3:
        boxes[rng.integers(k), rng.integers(5)] = rng.choice([np.nan, np.inf, -np.inf, 1e30])
    ph, pw = int(rng.integers(0, 4)), int(rng.integers(0, 4))
    return fastbwd.roi_align_backward(
        _array(rng, (k, c, ph, pw), (np.float32,)), boxes, (b, c, h, w), ph, pw,
        float(rng.choice([0.25, 1.0, 1e-39, 1e30, np.nan])), int(rng.choice([0, 1, 2, -1])), bool(rng.random() < 0.5))


def _group_norm_swish(rng):
    n, c = _size(rng), _size(rng)
    groups = int(rng.choice([1, 2, 3, 0, -1]))
    shape = (n, c) + tuple(_size(rng) for _ in range(int(rng.integers(0, 3))))
    stats = (n, max(groups, 1))
    return fastbwd.group_norm_swish_backward(
        _array(rng, shape, (np.float32,)), _array(rng, stats, (np.float32,)),
        np.abs(_array(rng, stats, (np.float32,))), _array(rng, shape, (np.float32,)),
        _array(rng, (c,), (np.float32,)), _array(rng, (c,), (np.float32,)), groups,
        str(rng.choice(["NCHW", "NHWC", "ND", "XYZ"])), float(rng.choice([1.0, -2.0, 0.0, 1e30, np.nan])))


@pytest.mark.parametrize("call", [_upsample, _pad, _roi_align, _group_norm_swish], ids=lambda f: f.__name__[1:])
def test_only_results_or_param_errors(call):
    rng = np.random.default_rng(20261121)
    results = 0
    for _ in range(CALLS):
        try:
            call(rng)
            results += 1
        except fastbwd.ParamError:
            pass
    assert results >= CALLS // 20, "the random arguments hardly ever reached a kernel"


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
