"""fastbwd.roi_align_backward (aclnnRoiAlignV2Backward, docs/semantics.md §4) and the RoIAlign
forward ``roi_align_forward`` (for fastbwd.torch; not exported by fastbwd)."""

# annotations kept as strings: help() shows `ArrayLike`, not numpy's 2,000-character expansion of it
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np
from numpy.typing import ArrayLike

from .. import _dtypes as d
from .. import _validation as v
from ..kernels import roi_align as kernels
from . import _plans

FUNC = "roi_align_backward"
FORWARD = "roi_align_forward"

#: The smallest normal float32 (docs/semantics.md §4: spatial_scale must exceed it).
FLT_MIN = float(np.finfo(np.float32).tiny)


def roi_align_backward(
    grad_output: ArrayLike,
    boxes: ArrayLike,
    input_shape: Sequence[int],
    pooled_height: int,
    pooled_width: int,
    spatial_scale: float,
    sampling_ratio: int,
    aligned: bool,
    *,
    out: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Gradient of torchvision's ``roi_align`` with respect to its input (docs/semantics.md §4).

    For every box ``k`` with batch index ``b = floor(boxes[k, 0])``, every channel and every
    bin ``(ph, pw)``, each sample of the bin's ``gh x gw`` grid scatters
    ``grad_output[k, c, ph, pw] * (bilinear weight) / (gh * gw)`` to the four pixels around it,
    as torchvision's CPU backward loop; the weights of the samples on each pixel are summed first
    (exactly, per axis: ``wy[ph, row] * wx[pw, col] / count``), so the work per bin is bounded
    by the pixels it touches, not by its samples.

    Parameters
    ----------
    grad_output : array_like
        ``(K, C, pooled_height, pooled_width)``: float32, float64, float16 or bfloat16. Any
        strides (a non-contiguous array is read through a contiguous copy).
    boxes : array_like
        ``(K, 5)`` rows ``(batch_index, x1, y1, x2, y2)`` in input-image coordinates, the same
        dtype as ``grad_output``; any strides. A box with NaN or +-Inf in any of its five
        values, or whose ``floor(batch_index)`` is outside ``[0, B)`` (so -0.5 is skipped, as
        is ``B``; 0.5 means image 0), contributes nothing; such boxes never fail the call.
    input_shape : sequence of 4 int
        ``(B, C, H, W)`` of the forward input, each >= 0; ``C`` must equal grad_output's.
    pooled_height, pooled_width : int
        Must equal ``grad_output.shape[2]`` and ``grad_output.shape[3]``.
    spatial_scale : float
        Multiplies the box coordinates; must be greater than FLT_MIN (1.17549435e-38). It is
        rounded to the compute type (float32 unless the data is float64), as torchvision does.
    sampling_ratio : int
        Samples per bin along each axis; 0 means adaptive (``ceil(roi_size / pooled_size)``).
        Must be >= 0; any size works (up to 2^31 - 1 it costs about log2(sampling_ratio) per
        pixel and bin in the tables, nothing more in the scatter).
    aligned : bool
        ``True`` shifts the box by -0.5 pixel (pixel-center alignment); ``False`` keeps
        torchvision's legacy behaviour of forcing each box to at least 1 x 1.
    out : numpy.ndarray, optional
        A writeable C-contiguous ``(B, C, H, W)`` array of grad_output's dtype, not overlapping
        the inputs. Fully overwritten and returned.

    Returns
    -------
    numpy.ndarray
        grad_input ``(B, C, H, W)`` in grad_output's dtype, always C-contiguous (NCHW), like
        torchvision's result. Zero-filled when K == 0 or C == 0 or no box contributes.
        Coordinates, weights and sums are computed in float32 for float32, float16 and bfloat16
        (the half formats are rounded once, at the end, to nearest even), in float64 for float64.
        Each element sums its contributions in a fixed order (boxes in their given order, then
        bins), so the result is bitwise identical for any number of threads.

    Raises
    ------
    ParamError
        status 161001 when an argument is None; 161002 when grad_output is not 4-D, boxes is not
        ``(K, 5)`` with grad_output's K, input_shape is not 4 integers >= 0 with grad_output's C,
        a pooled size differs from grad_output's, spatial_scale <= FLT_MIN (or NaN),
        sampling_ratio is negative or not an integer, aligned is not a bool, a dtype is
        unsupported or differs between grad_output and boxes, or ``out`` is unusable.
    """
    grad_output = v.as_array(FUNC, "grad_output", grad_output)
    boxes = v.as_array(FUNC, "boxes", boxes)
    return run(
        plan(grad_output, boxes, input_shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned, out),
        grad_output,
        boxes,
        out,
    )


def plan(grad_output, boxes, input_shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned, out):
    """The validated plan of a call with the public function's arguments, ``grad_output`` and
    ``boxes`` NumPy arrays (ParamError as the public function raises it): remembered per
    metadata (:mod:`fastbwd.api._plans`; the boxes' values are not part of it), and what
    :func:`run` takes."""
    return _PLANS(
        _plan, grad_output, boxes, input_shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned, out
    )


def run(plan, grad_output, boxes, out):
    """The call ``plan`` describes, on NumPy arrays with the metadata the plan was made for
    (``out`` an array or None): the per-call checks (``out`` overlapping neither input), then
    the boxes' tables and the kernels. Returns the result."""
    result, grad_input = d.output(
        FUNC,
        out,
        plan.input_shape,
        grad_output.dtype,
        inputs=(("grad_output", grad_output), ("boxes", boxes)),
        checked=True,
    )
    if plan.kernels is not None:  # None: an empty result
        plan.kernels.run(d.kernel_view(np.ascontiguousarray(grad_output)), boxes, d.kernel_view(grad_input))
    return result


_PLANS = _plans.Plans()


class _Plan(NamedTuple):
    """What the arguments' metadata decided (see :mod:`fastbwd.api._plans`)."""

    input_shape: tuple
    kernels: object  # the kernels' plan (kernels.plan); None for an empty result


def _plan(grad_output, boxes, input_shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned, out):
    """Validate every argument (errors in the documented order); the arrays' values are not read."""
    input_shape = v.int_tuple(FUNC, "input_shape", input_shape, (4,))
    pooled_height = v.int_value(FUNC, "pooled_height", pooled_height)
    pooled_width = v.int_value(FUNC, "pooled_width", pooled_width)
    scalars = _scalars(FUNC, spatial_scale, sampling_ratio, aligned)

    v.check_ndim(FUNC, "grad_output", grad_output, (4,))
    v.check_dtype(FUNC, "grad_output", grad_output, d.FLOATING)
    num_boxes, channels = grad_output.shape[:2]
    _check_boxes(FUNC, boxes, num_boxes, "K of grad_output", "grad_output", grad_output.dtype)
    for axis, size in enumerate(input_shape):
        if size < 0:
            v.fail(FUNC, f"input_shape[{axis}]", "must be >= 0", size)
    if input_shape[1] != channels:
        v.fail(FUNC, "input_shape[1]", f"must be {channels} (C of grad_output)", input_shape[1])
    v.check_dim(FUNC, "grad_output", 2, grad_output.shape[2], pooled_height, "pooled_height")
    v.check_dim(FUNC, "grad_output", 3, grad_output.shape[3], pooled_width, "pooled_width")
    _check_ranges(FUNC, *scalars[:2])
    dtype = grad_output.dtype
    d.check_out(FUNC, out, input_shape, dtype, d.NCHW)
    if 0 in input_shape:
        return _Plan(input_shape, None)
    geometry = kernels.BackwardGeometry(
        num_boxes, *input_shape, pooled_height, pooled_width, *scalars, d.compute_dtype(dtype), d.storage_format(dtype)
    )
    return _Plan(input_shape, kernels.plan(geometry))


def roi_align_forward(
    input: ArrayLike,
    boxes: ArrayLike,
    pooled_height: int,
    pooled_width: int,
    spatial_scale: float,
    sampling_ratio: int,
    aligned: bool,
    *,
    out: Optional[np.ndarray] = None,
) -> np.ndarray:
    """torchvision's ``roi_align`` forward (docs/semantics.md §4, "Forward"): the adjoint of
    :func:`roi_align_backward`.

    For every box ``k`` with batch index ``b = floor(boxes[k, 0])``, every channel ``c`` and
    every bin ``(ph, pw)``: ``out[k, c, ph, pw] = sum over (row, col) of input[b, c, row, col] *
    wy[ph, row] * wx[pw, col] / count``, the mean of the bilinear interpolations at the bin's
    ``gh x gw`` samples, with the per-pixel weights of the backward. Not part of the public API
    (``fastbwd.torch.roi_align`` uses it).

    Parameters
    ----------
    input : array_like
        ``(B, C, H, W)``: float32, float64, float16 or bfloat16. Any strides; channels-last
        strides (``x_nhwc.transpose(0, 3, 1, 2)`` of a C-contiguous ``x_nhwc``) are read in
        place, other non-contiguous arrays through a contiguous copy.
    boxes : array_like
        ``(K, 5)`` rows ``(batch_index, x1, y1, x2, y2)`` in input-image coordinates, the same
        dtype as ``input``; any strides. A box with NaN or +-Inf in any of its five values, or
        whose ``floor(batch_index)`` is outside ``[0, B)``, gives a zero result; such boxes never
        fail the call.
    pooled_height, pooled_width : int
        The output size of each box, > 0.
    spatial_scale : float
        Multiplies the box coordinates; must be greater than FLT_MIN (1.17549435e-38). It is
        rounded to the compute type (float32 unless the data is float64), as torchvision does.
    sampling_ratio : int
        Samples per bin along each axis; 0 means adaptive (``ceil(roi_size / pooled_size)``).
        Must be >= 0; any size works (the samples are summed per pixel in closed form).
    aligned : bool
        ``True`` shifts the box by -0.5 pixel (pixel-center alignment); ``False`` keeps
        torchvision's legacy behaviour of forcing each box to at least 1 x 1.
    out : numpy.ndarray, optional
        A writeable C-contiguous ``(K, C, pooled_height, pooled_width)`` array of input's dtype,
        not overlapping the inputs. Fully overwritten and returned.

    Returns
    -------
    numpy.ndarray
        ``(K, C, pooled_height, pooled_width)`` in input's dtype, C-contiguous. Zero for skipped
        boxes, boxes without samples, and when B, H or W is 0. Weights and sums are computed in
        float32 for float32, float16 and bfloat16 (the half formats rounded once, to nearest
        even), in float64 for float64, in a fixed order (for each bin: the rows it touches, then
        the columns), so the result is bitwise identical for any number of threads.

    Raises
    ------
    ParamError
        status 161001 when an argument is None; 161002 when input is not 4-D, boxes is not
        ``(K, 5)``, a pooled size is not an integer > 0, spatial_scale <= FLT_MIN (or NaN),
        sampling_ratio is negative or not an integer, aligned is not a bool, a dtype is
        unsupported or differs between input and boxes, or ``out`` is unusable.
    """
    input = v.as_array(FORWARD, "input", input)
    boxes = v.as_array(FORWARD, "boxes", boxes)
    return run_forward(
        forward_plan(input, boxes, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned, out),
        input,
        boxes,
        out,
    )


def forward_plan(input, boxes, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned, out):
    """The validated plan of a forward call with :func:`roi_align_forward`'s arguments, ``input``
    and ``boxes`` NumPy arrays (ParamError as that function raises it): remembered per metadata
    (the boxes' values are not part of it), and what :func:`run_forward` takes."""
    return _FORWARD_PLANS(
        _forward_plan, input, boxes, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned, out
    )


_FORWARD_PLANS = _plans.Plans()


class _ForwardPlan(NamedTuple):
    """What the forward's arguments' metadata decided (see :mod:`fastbwd.api._plans`)."""

    shape: tuple  # of the result
    channels_last: bool  # the input's memory is read in place as (B, H * W, C)
    kernels: object  # the kernels' plan (kernels.plan); None for an empty result


def _forward_plan(input, boxes, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned, out):
    """Validate the forward's arguments (errors in the documented order); the arrays' values are not read."""
    pooled_height = v.int_value(FORWARD, "pooled_height", pooled_height)
    pooled_width = v.int_value(FORWARD, "pooled_width", pooled_width)
    scalars = _scalars(FORWARD, spatial_scale, sampling_ratio, aligned)

    v.check_ndim(FORWARD, "input", input, (4,))
    v.check_dtype(FORWARD, "input", input, d.FLOATING)
    _check_boxes(FORWARD, boxes, None, None, "input", input.dtype)
    for name, size in (("pooled_height", pooled_height), ("pooled_width", pooled_width)):
        if size <= 0:
            v.fail(FORWARD, name, "must be > 0", size)
    _check_ranges(FORWARD, *scalars[:2])
    dtype = input.dtype
    shape = (boxes.shape[0], input.shape[1], pooled_height, pooled_width)
    d.check_out(FORWARD, out, shape, dtype, d.NCHW)
    # A channels-last input (its NHWC transpose C-contiguous) is read in place, in that memory
    # order; any other layout through a C-contiguous copy.
    channels_last = not input.flags.c_contiguous and input.transpose(0, 2, 3, 1).flags.c_contiguous
    if 0 in shape:
        return _ForwardPlan(shape, channels_last, None)
    geometry = kernels.ForwardGeometry(
        shape[0],
        *input.shape,
        pooled_height,
        pooled_width,
        channels_last,
        *scalars,
        d.compute_dtype(dtype),
        d.storage_format(dtype),
    )
    return _ForwardPlan(shape, channels_last, kernels.plan(geometry))


def run_forward(plan, input, boxes, out):
    """The forward call ``plan`` describes, on NumPy arrays with the metadata the plan was made
    for (``out`` an array or None): the per-call checks (``out`` overlapping neither input), then
    the boxes' tables and the kernels. Returns the result."""
    result, pooled = d.output(
        FORWARD, out, plan.shape, input.dtype, inputs=(("input", input), ("boxes", boxes)), checked=True
    )
    if plan.kernels is not None:  # None: an empty result
        batch, channels, height, width = input.shape
        if plan.channels_last:
            source = input.transpose(0, 2, 3, 1).reshape(batch, height * width, channels)
        else:
            source = np.ascontiguousarray(input).reshape(batch, channels, height * width)
        plan.kernels.run(d.kernel_view(source), boxes, d.kernel_view(pooled))
    return result


# --------------------------------------------------------------------------------------------
# shared by the backward and the forward
# --------------------------------------------------------------------------------------------


def _scalars(func, spatial_scale, sampling_ratio, aligned):
    """The scalar arguments' types: ``(spatial_scale, sampling_ratio, aligned)``."""
    return (
        v.float_value(func, "spatial_scale", spatial_scale),
        v.int_value(func, "sampling_ratio", sampling_ratio),
        v.bool_value(func, "aligned", aligned),
    )


def _check_boxes(func, boxes, num_boxes, why, data_param, data_dtype):
    """boxes is ``(K, 5)`` of the data's dtype, with ``K == num_boxes`` (``why`` says where that
    comes from) unless ``num_boxes`` is None."""
    if boxes.ndim != 2 or boxes.shape[1] != 5:
        v.fail(func, "boxes", "must have shape (K, 5)", f"shape {tuple(boxes.shape)}")
    if num_boxes is not None:
        v.check_dim(func, "boxes", 0, boxes.shape[0], num_boxes, why)
    v.check_same_dtype(func, "boxes", boxes.dtype, data_param, data_dtype)


def _check_ranges(func, spatial_scale, sampling_ratio):
    if not spatial_scale > FLT_MIN:  # NaN fails too
        v.fail(func, "spatial_scale", f"must be greater than FLT_MIN ({FLT_MIN:.9g})", spatial_scale)
    if sampling_ratio < 0:
        v.fail(func, "sampling_ratio", "must be >= 0 (0 means adaptive)", sampling_ratio)
