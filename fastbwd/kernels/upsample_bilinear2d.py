"""upsample_bilinear2d_backward: per-axis index/weight tables (docs/semantics.md §1) for the separable engine.

The backward is ``grad_input[plane] = A_h^T . grad_output[plane] . A_w``, computed by the shared
separable engine (``kernels._separable``) from one forward tap table per axis; :func:`plan` makes
the engine's plan of a call's :class:`Geometry`.
Each axis's table comes from PyTorch's index helpers, kept here under their ATen names
(``aten/src/ATen/native/UpSample.h``) and evaluated with NumPy in the *opmath* type: float32
for float32/float16/bfloat16 data, float64 for float64, so indices and lambdas are bit for bit
PyTorch's. Every table entry of the scatter formula is kept, zero lambdas and the repeated index
at the last row included, so NaN and Inf propagate exactly as the formula says.
"""

from typing import NamedTuple

import numpy as np

from . import _separable
from ._halfbits import StorageFormat

__all__ = [
    "area_pixel_compute_scale",
    "area_pixel_compute_source_index",
    "compute_source_index_and_lambda",
    "backward_table",
    "Geometry",
    "plan",
]


class Geometry(NamedTuple):
    """A validated upsample_bilinear2d_backward call, as its kernels see it."""

    nhwc: bool  # the kernels' memory layout is (N, H, W, C); else (N*C, H, W) planes
    batch: int
    channels: int
    height: int
    width: int
    out_height: int
    out_width: int
    align_corners: bool
    scales_h: float  # 0.0: unset
    scales_w: float
    compute: np.dtype  # the opmath type: float32, or float64 for float64 data
    fmt: StorageFormat


def plan(geometry):
    """The plan of a non-empty call: the separable engine's, on kernel views of grad_output and
    grad_input in the geometry's layout (NCHW: any shape with (N*C) * OH * OW elements; NHWC:
    ``(N, OH, OW, C)``)."""
    g = geometry
    if g.nhwc:
        grad_shape = (g.batch, g.out_height, g.out_width, g.channels)
        result_shape = (g.batch, g.height, g.width, g.channels)
    else:
        grad_shape = (g.batch * g.channels, g.out_height, g.out_width)
        result_shape = (g.batch * g.channels, g.height, g.width)
    return _separable.plan(
        g.nhwc,
        grad_shape,
        result_shape,
        *backward_table(g.height, g.out_height, g.align_corners, g.scales_h, g.compute),
        *backward_table(g.width, g.out_width, g.align_corners, g.scales_w, g.compute),
        g.fmt,
    )


def area_pixel_compute_scale(input_size, output_size, align_corners, scale, opmath):
    """Source step per output index (ATen ``area_pixel_compute_scale``), as an ``opmath`` scalar.

    ``scale`` is the user's ``scales_h``/``scales_w`` (0.0 = unset). Traps, as in ATen:
    ``1 / scale`` is divided in double and only then rounded to ``opmath``; ``(in - 1) / (out - 1)``
    and ``in / out`` are ``opmath`` divisions of the converted sizes.
    """
    if align_corners:
        if output_size > 1:
            return opmath.type(input_size - 1) / opmath.type(output_size - 1)
        return opmath.type(0)
    if scale > 0:
        return opmath.type(1.0 / scale)
    return opmath.type(input_size) / opmath.type(output_size)


def area_pixel_compute_source_index(scale, output_index, align_corners):
    """Real source position of each output index (ATen ``area_pixel_compute_source_index``).

    ``output_index`` is an ``opmath`` array of output indices; ``scale`` an ``opmath`` scalar.
    """
    opmath = output_index.dtype.type
    if align_corners:
        return scale * output_index
    source = scale * (output_index + opmath(0.5)) - opmath(0.5)
    # Linear (not cubic) interpolation clamps negative positions to 0.
    return np.where(source < 0, opmath(0), source)


def compute_source_index_and_lambda(input_size, output_size, align_corners, scale, opmath):
    """``(index0, index1, lambda0, lambda1)`` arrays over the output indices of one axis.

    ATen ``compute_source_index_and_lambda`` with ``guard_index_and_lambda``. When the sizes
    are equal, PyTorch's identity shortcut applies whatever ``scale`` says.
    """
    opmath = np.dtype(opmath)
    output_index = np.arange(output_size, dtype=np.int64)
    if output_size == input_size:
        return output_index, output_index.copy(), np.ones(output_size, opmath), np.zeros(output_size, opmath)
    ratio = area_pixel_compute_scale(input_size, output_size, align_corners, scale, opmath)
    real_index = area_pixel_compute_source_index(ratio, output_index.astype(opmath), align_corners)
    # Memory safety: a tiny user scale makes real_index huge or +inf, whose integer conversion
    # is undefined (ATen's too). Clamping before the conversion gives ATen's index for every
    # position where it is defined (min(floor(x), in - 1) == floor(min(x, in - 1)) for x >= 0).
    index0 = np.floor(np.minimum(real_index, opmath.type(input_size - 1))).astype(np.int64)
    lambda1 = np.minimum(np.maximum(real_index - index0.astype(opmath), opmath.type(0)), opmath.type(1))
    lambda0 = opmath.type(1) - lambda1
    index1 = index0 + (index0 < input_size - 1)
    return index0, index1, lambda0, lambda1


def backward_table(input_size, output_size, align_corners, scale, opmath):
    """The forward tap table ``(index, weight)`` of one axis for the separable engine.

    Output index ``o`` reads ``index0`` with ``lambda0`` and ``index1`` with ``lambda1``: both
    taps are kept even when ``lambda1 == 0`` or ``index1 == index0`` (docs/semantics.md §1 scatter formula),
    so a NaN or Inf gradient spreads exactly as in PyTorch.
    """
    index0, index1, lambda0, lambda1 = compute_source_index_and_lambda(
        input_size, output_size, align_corners, scale, opmath
    )
    return _separable.tap_table(np.stack([index0, index1], axis=1), np.stack([lambda0, lambda1], axis=1), opmath)
