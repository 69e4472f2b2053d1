"""fastbwd.upsample_bilinear2d_backward (aclnnUpsampleBilinear2dBackwardV2, docs/semantics.md §1)."""

# annotations kept as strings: help() shows `ArrayLike`, not numpy's 2,000-character expansion of it
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from .. import _dtypes as d
from .. import _validation as v
from ..kernels import upsample_bilinear2d as kernels
from ..kernels.upsample_bilinear2d import compute_source_index_and_lambda  # noqa: F401 - the JAX forward's
from . import _contract

FUNC = "upsample_bilinear2d_backward"


def upsample_bilinear2d_backward(
    grad_output: ArrayLike,
    output_size: Sequence[int],
    input_size: Sequence[int],
    align_corners: bool = False,
    scales_h: float | None = 0.0,
    scales_w: float | None = 0.0,
    *,
    layout: str = "NCHW",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Gradient of ``torch.nn.functional.interpolate(input, output_size, mode="bilinear")``.

    Every grad_output cell ``(oh, ow)`` is spread over the (up to) four input cells it was
    interpolated from, with PyTorch's index and lambda rules (docs/semantics.md §1): computed here as the
    separable map ``A_h^T . grad_output . A_w`` per plane, without atomics.

    Parameters
    ----------
    grad_output : array_like
        ``(N, C, OH, OW)``, or ``(N, OH, OW, C)`` with ``layout="NHWC"``. float32, float16,
        bfloat16 or float64. Any strides; an NCHW-shaped array with channels-last strides is read
        without a copy and gives a channels-last result.
    output_size : sequence of 2 int
        ``(OH, OW)``, each > 0, equal to grad_output's spatial dims.
    input_size : sequence of 4 int
        ``(N, C, H, W)`` in this order whatever the layout; ``H, W > 0``; ``N`` and ``C`` equal
        grad_output's (either may be 0: the result is then empty).
    align_corners : bool
        PyTorch's ``align_corners``.
    scales_h, scales_w : float or None
        The forward's scale factors. A value > 0 sets the source step ``1 / scale`` (when
        ``align_corners`` is False); 0, a negative value or ``None`` means unset (step ``in/out``).
        Not checked against the sizes, like the device and PyTorch. When an axis keeps its size
        (``OH == H``) PyTorch's identity rule applies whatever the scale.
    layout : {"NCHW", "NHWC"}
        Memory layout of grad_output and of the result.
    out : numpy.ndarray, optional
        Written completely and returned: exactly the result's shape, dtype and memory layout.

    Returns
    -------
    numpy.ndarray
        grad_input in grad_output's dtype: ``(N, C, H, W)`` (channels-last strides when
        grad_output had them), or ``(N, H, W, C)`` for ``layout="NHWC"``. Index and lambda
        arithmetic is PyTorch's (float32 for float32/float16/bfloat16, float64 for float64); sums
        accumulate in float32 (float64 for float64), row direction first, and are rounded once.
        Results are bitwise identical for every thread count and between layouts.

    Raises
    ------
    ParamError
        grad_output not 4-D or of an unsupported dtype; ``output_size`` not 2 integers or
        ``input_size`` not 4; OH, OW, H or W <= 0; a dimension of grad_output or of the result
        above 2**20; grad_output's shape not the expected one; a bad ``layout``, flag or scale;
        a bad ``out``. Status 161001 when grad_output, output_size or input_size is None.

    Examples
    --------
    The gradient of ``F.interpolate(x, size=(4, 4), mode="bilinear")`` for an ``x`` of shape
    ``(1, 1, 2, 2)``: by symmetry each input cell collects a quarter of the 16 ones.

    >>> import numpy as np, fastbwd
    >>> grad_output = np.ones((1, 1, 4, 4), np.float32)
    >>> fastbwd.upsample_bilinear2d_backward(grad_output, (4, 4), (1, 1, 2, 2))
    array([[[[4., 4.],
             [4., 4.]]]], dtype=float32)
    """
    grad_output = v.as_array(FUNC, "grad_output", grad_output)
    call = OPERATION.plan(grad_output, output_size, input_size, align_corners, scales_h, scales_w, layout, out)
    return call.run(grad_output, out)


def _plan(grad_output, output_size, input_size, align_corners, scales_h, scales_w, layout, out):
    """Validate every argument (errors in the documented order) and decide the kernel path."""
    layout = v.layout(FUNC, layout)
    output_height, output_width = v.int_tuple(FUNC, "output_size", output_size, (2,))
    batch, channels, height, width = v.int_tuple(FUNC, "input_size", input_size, (4,))
    align_corners = v.bool_value(FUNC, "align_corners", align_corners)
    scales_h = v.float_value(FUNC, "scales_h", scales_h, none_is=0.0)
    scales_w = v.float_value(FUNC, "scales_w", scales_w, none_is=0.0)
    v.check_ndim(FUNC, "grad_output", grad_output, (4,))
    v.check_dtype(FUNC, "grad_output", grad_output, d.FLOATING)
    for index, size in enumerate((output_height, output_width)):
        if size <= 0:
            v.fail(FUNC, f"output_size[{index}]", "must be > 0", size)
    for index, size in ((2, height), (3, width)):
        if size <= 0:
            v.fail(FUNC, f"input_size[{index}]", "must be > 0", size)
    for index, size in ((0, batch), (1, channels)):
        if size < 0:
            v.fail(FUNC, f"input_size[{index}]", "must be >= 0", size)
    v.check_dims_at_most(FUNC, "grad_output", grad_output.shape)
    v.check_dims_at_most(FUNC, "input_size", (batch, channels, height, width))
    if layout == d.NHWC:
        expected = (batch, output_height, output_width, channels)
        result_shape = (batch, height, width, channels)
    else:
        expected = (batch, channels, output_height, output_width)
        result_shape = (batch, channels, height, width)
    v.check_shape(
        FUNC,
        "grad_output",
        grad_output.shape,
        expected,
        f"input_size {(batch, channels, height, width)} and output_size "
        f"{(output_height, output_width)} in layout {layout}",
    )

    dtype = grad_output.dtype
    if layout == d.NHWC:
        physical_layout, result_layout = d.NHWC, d.NCHW  # result_shape is already (N, H, W, C)
    else:
        physical_layout = result_layout = d.NHWC if d.is_channels_last(grad_output) else d.NCHW
    d.check_out(FUNC, out, result_shape, dtype, result_layout)
    # the physical layout the kernel runs on: the user's NHWC, or an NCHW array whose strides
    # are channels-last (read as its NHWC view without a copy; the result keeps that format)
    source = d.operand(grad_output) if layout == d.NHWC else d.operand(grad_output, physical_layout)
    geometry = kernels.Geometry(
        physical_layout == d.NHWC,
        batch,
        channels,
        height,
        width,
        output_height,
        output_width,
        align_corners,
        scales_h,
        scales_w,
        d.compute_dtype(dtype),
        d.storage_format(dtype),
    )
    plan = None if batch * channels == 0 else kernels.plan(geometry)
    return _contract.OneResultPlan(
        FUNC, ("grad_output",), 1, (d.result(result_shape, dtype, result_layout),), source, plan
    )


OPERATION = _contract.Operation(
    upsample_bilinear2d_backward,
    _plan,
    ("grad_output", "output_size", "input_size", "align_corners", "scales_h", "scales_w", "layout", "out"),
)
#: The validated plan of a call (the bridges'): the public function's arguments in this order,
#: ``grad_output`` a NumPy array (ParamError as the function raises it).
plan = OPERATION.plan
run = _contract.run
