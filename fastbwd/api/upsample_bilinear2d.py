"""fastbwd.upsample_bilinear2d_backward (aclnnUpsampleBilinear2dBackwardV2, docs/semantics.md §1)."""

# annotations kept as strings: help() shows `ArrayLike`, not numpy's 2,000-character expansion of it
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from .. import _dtypes as d
from .. import _validation as v
from ..kernels import upsample_bilinear2d as kernels
from ..kernels.upsample_bilinear2d import compute_source_index_and_lambda  # noqa: F401 - the JAX forward's
from . import _plans

FUNC = "upsample_bilinear2d_backward"
LAYOUTS = (d.NCHW, d.NHWC)


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
    return run(
        plan(grad_output, output_size, input_size, align_corners, scales_h, scales_w, layout, out), grad_output, out
    )


def plan(grad_output, output_size, input_size, align_corners, scales_h, scales_w, layout, out):
    """The validated plan of a call with the public function's arguments, ``grad_output`` a
    NumPy array (ParamError as the public function raises it): remembered per metadata
    (:mod:`fastbwd.api._plans`), and what :func:`run` takes."""
    return _PLANS(_plan, grad_output, output_size, input_size, align_corners, scales_h, scales_w, layout, out)


def run(plan, grad_output, out):
    """The call ``plan`` describes, on a NumPy ``grad_output`` and ``out`` (an array or None)
    with the metadata the plan was made for: the per-call checks (``out`` not overlapping
    grad_output), then the kernel. Returns the result."""
    result, grad_input = d.output(
        FUNC,
        out,
        plan.result_shape,
        grad_output.dtype,
        plan.result_layout,
        inputs=(("grad_output", grad_output),),
        checked=True,
    )
    if plan.kernels is not None:  # None: empty (N or C is 0), nothing to compute
        # the physical layout the kernel runs on: the user's NHWC, or an NCHW array whose
        # strides are channels-last (read as its NHWC view without a copy; the result keeps
        # that memory format)
        source = np.ascontiguousarray(grad_output) if plan.user_nhwc else d.physical(grad_output, plan.layout)
        plan.kernels.run(d.kernel_view(source), d.kernel_view(grad_input))
    return result


_PLANS = _plans.Plans()


class _Plan(NamedTuple):
    """What the arguments' metadata decided (see :mod:`fastbwd.api._plans`)."""

    result_shape: tuple
    user_nhwc: bool  # layout="NHWC"
    layout: str  # the physical layout the kernel runs on
    result_layout: str
    kernels: object  # the kernels' plan (kernels.plan); None when the result is empty


def _plan(grad_output, output_size, input_size, align_corners, scales_h, scales_w, layout, out):
    """Validate every argument (errors in the documented order) and decide the kernel path."""
    layout = v.choice(FUNC, "layout", layout, LAYOUTS)
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
    return _Plan(result_shape, layout == d.NHWC, physical_layout, result_layout, plan)
