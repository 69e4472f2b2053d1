"""Input builders the benchmark cases and the tests share (not installed): channels-last copies,
detection-head-like boxes, GroupNorm+Swish arguments."""

import numpy as np

from fastbwd import _dtypes as d


def channels_last(array):
    """The same NCHW values with channels-last strides (a copy; what PyTorch calls channels_last)."""
    return d.logical(d.physical(array, d.NHWC), d.NHWC)


def roi_boxes(num_boxes, input_shape, spatial_scale, seed=0, dtype=np.float32):
    """Detection-head-like boxes ``(K, 5)`` spread over the batch, in input-image coordinates."""
    rng = np.random.default_rng(seed)
    batch, _, height, width = input_shape
    image_h, image_w = height / spatial_scale, width / spatial_scale
    x1 = rng.uniform(0, image_w * 0.8, num_boxes)
    y1 = rng.uniform(0, image_h * 0.8, num_boxes)
    bw = rng.uniform(min(16, image_w * 0.1), image_w * 0.5, num_boxes)
    bh = rng.uniform(min(16, image_h * 0.1), image_h * 0.5, num_boxes)
    b = np.arange(num_boxes) % batch
    boxes = np.stack([b, x1, y1, np.minimum(x1 + bw, image_w), np.minimum(y1 + bh, image_h)], axis=1)
    return boxes.astype(dtype)


def group_norm_swish_inputs(shape, num_groups, dtype, seed=0, eps=1e-5, param_dtype=None):
    """dy, mean, rstd, x, gamma, beta for an NCHW-family ``shape``; mean/rstd from x in float64."""
    rng = np.random.default_rng(seed)
    param_dtype = dtype if param_dtype is None else param_dtype
    x64 = rng.standard_normal(shape) * 2.0 + 0.5
    x = x64.astype(dtype)
    n, c = shape[0], shape[1]
    grouped = x.astype(np.float64).reshape(n, num_groups, -1)
    mean = grouped.mean(axis=2)
    rstd = 1.0 / np.sqrt(grouped.var(axis=2) + eps)
    gamma = rng.uniform(0.5, 1.5, c).astype(param_dtype)
    beta = rng.uniform(-0.5, 0.5, c).astype(param_dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    return dy, mean.astype(param_dtype), rstd.astype(param_dtype), x, gamma, beta
