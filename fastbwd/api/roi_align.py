"""fastbwd.roi_align_backward (aclnnRoiAlignV2Backward, docs/semantics.md §4) and the RoIAlign
forward ``roi_align_forward`` (for fastbwd.torch; not exported by fastbwd)."""

# annotations kept as strings: help() shows `ArrayLike`, not numpy's 2,000-character expansion of it
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from .. import _dtypes as d
from .. import _validation as v
from ..kernels import roi_align as kernels
from . import _contract

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
    layout: str = "NCHW",
    out: np.ndarray | None = None,
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
        ``(K, C, pooled_height, pooled_width)``, or ``(K, pooled_height, pooled_width, C)`` with
        ``layout="NHWC"``: float32, float64, float16 or bfloat16. Any strides (a non-contiguous
        array is read through a contiguous copy).
    boxes : array_like
        ``(K, 5)`` rows ``(batch_index, x1, y1, x2, y2)`` in input-image coordinates, the same
        dtype as ``grad_output``; any strides. A box with NaN or +-Inf in any of its five
        values, or whose ``floor(batch_index)`` is outside ``[0, B)`` (so -0.5 is skipped, as
        is ``B``; 0.5 means image 0), contributes nothing; such boxes never fail the call.
    input_shape : sequence of 4 int
        ``(B, C, H, W)`` of the forward input in this order whatever the layout, each >= 0;
        ``C`` must equal grad_output's.
    pooled_height, pooled_width : int
        Must equal grad_output's pooled dimensions (``shape[2]`` and ``shape[3]``, or
        ``shape[1]`` and ``shape[2]`` with ``layout="NHWC"``).
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
    layout : {"NCHW", "NHWC"}
        Memory layout of grad_output and of the result: ``"NHWC"`` (channels-last) takes
        grad_output as ``(K, PH, PW, C)`` and returns ``(B, H, W, C)``; every result element is
        bitwise the NCHW one.
    out : numpy.ndarray, optional
        A writeable C-contiguous array of the result's shape and grad_output's dtype, not
        overlapping the inputs. Fully overwritten and returned.

    Returns
    -------
    numpy.ndarray
        grad_input ``(B, C, H, W)`` (``(B, H, W, C)`` with ``layout="NHWC"``) in grad_output's
        dtype, always C-contiguous, like torchvision's result. Zero-filled when K == 0 or C == 0 or no box contributes.
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
        sampling_ratio is negative or not an integer, aligned is not a bool, ``layout`` is not
        "NCHW" or "NHWC", a dtype is unsupported or differs between grad_output and boxes, or
        ``out`` is unusable.

    Examples
    --------
    One box inside an ``(1, 3, 8, 8)`` feature map, 2x2 bins of 2x2 samples each: every sample's
    bilinear weights sum to 1, so the gradient keeps grad_output's total (4 per channel).

    >>> import numpy as np, fastbwd
    >>> grad_output = np.ones((1, 3, 2, 2), np.float32)
    >>> boxes = np.array([[0, 1.0, 1.0, 5.0, 5.0]], np.float32)  # (batch index, x1, y1, x2, y2)
    >>> grad_input = fastbwd.roi_align_backward(grad_output, boxes, (1, 3, 8, 8), 2, 2, 1.0, 2, True)
    >>> grad_input.shape, float(grad_input.sum())
    ((1, 3, 8, 8), 12.0)
    """
    grad_output = v.as_array(FUNC, "grad_output", grad_output)
    boxes = v.as_array(FUNC, "boxes", boxes)
    call = OPERATION.plan(
        grad_output,
        boxes,
        input_shape,
        pooled_height,
        pooled_width,
        spatial_scale,
        sampling_ratio,
        aligned,
        layout,
        out,
    )
    return call.run(grad_output, boxes, out)


def _plan(
    grad_output, boxes, input_shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned, layout, out
):
    """Validate every argument (errors in the documented order); the arrays' values are not read."""
    layout = v.layout(FUNC, layout)
    nhwc = layout == d.NHWC
    input_shape = v.int_tuple(FUNC, "input_shape", input_shape, (4,))
    pooled_height = v.int_value(FUNC, "pooled_height", pooled_height)
    pooled_width = v.int_value(FUNC, "pooled_width", pooled_width)
    scalars = _scalars(FUNC, spatial_scale, sampling_ratio, aligned)

    v.check_ndim(FUNC, "grad_output", grad_output, (4,))
    v.check_dtype(FUNC, "grad_output", grad_output, d.FLOATING)
    num_boxes, channels = grad_output.shape[0], grad_output.shape[3 if nhwc else 1]
    _check_boxes(FUNC, boxes, num_boxes, "K of grad_output", "grad_output", grad_output.dtype)
    for axis, size in enumerate(input_shape):
        if size < 0:
            v.fail(FUNC, f"input_shape[{axis}]", "must be >= 0", size)
    if input_shape[1] != channels:
        v.fail(FUNC, "input_shape[1]", f"must be {channels} (C of grad_output)", input_shape[1])
    first = 1 if nhwc else 2  # grad_output's pooled dimensions
    v.check_dim(FUNC, "grad_output", first, grad_output.shape[first], pooled_height, "pooled_height")
    v.check_dim(FUNC, "grad_output", first + 1, grad_output.shape[first + 1], pooled_width, "pooled_width")
    _check_ranges(FUNC, *scalars[:2])
    dtype = grad_output.dtype
    batch, _, height, width = input_shape
    result_shape = (batch, height, width, channels) if nhwc else input_shape
    d.check_out(FUNC, out, result_shape, dtype, d.NCHW)  # C-contiguous in either layout
    results = (d.result(result_shape, dtype),)
    if 0 in input_shape:
        return _contract.OneResultPlan(FUNC, _NAMES, 2, results, None, None)
    geometry = kernels.Geometry(
        num_boxes,
        *input_shape,
        pooled_height,
        pooled_width,
        nhwc,
        *scalars,
        d.compute_dtype(dtype),
        d.storage_format(dtype),
    )
    return _contract.OneResultPlan(FUNC, _NAMES, 2, results, d.operand(grad_output), kernels.plan(geometry))


_NAMES = ("grad_output", "boxes")
_FORWARD_NAMES = ("input", "boxes")


def roi_align_forward(
    input: ArrayLike,
    boxes: ArrayLike,
    pooled_height: int,
    pooled_width: int,
    spatial_scale: float,
    sampling_ratio: int,
    aligned: bool,
    *,
    layout: str = "NCHW",
    out: np.ndarray | None = None,
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
        ``(B, C, H, W)``, or ``(B, H, W, C)`` with ``layout="NHWC"``: float32, float64, float16
        or bfloat16. Any strides; channels-last memory (a C-contiguous NHWC array, or its
        ``transpose(0, 3, 1, 2)`` in the NCHW layout) is read in place, other non-contiguous
        arrays through a contiguous copy.
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
    layout : {"NCHW", "NHWC"}
        Memory layout of input and of the result: ``"NHWC"`` (channels-last) takes input as
        ``(B, H, W, C)`` and returns ``(K, PH, PW, C)``; every result element is bitwise the
        NCHW one.
    out : numpy.ndarray, optional
        A writeable C-contiguous array of the result's shape and input's dtype, not overlapping
        the inputs. Fully overwritten and returned.

    Returns
    -------
    numpy.ndarray
        ``(K, C, pooled_height, pooled_width)`` (``(K, pooled_height, pooled_width, C)`` with
        ``layout="NHWC"``) in input's dtype, C-contiguous. Zero for skipped
        boxes, boxes without samples, and when B, H or W is 0. Weights and sums are computed in
        float32 for float32, float16 and bfloat16 (the half formats rounded once, to nearest
        even), in float64 for float64, in a fixed order (for each bin: the rows it touches, then
        the columns), so the result is bitwise identical for any number of threads.

    Raises
    ------
    ParamError
        status 161001 when an argument is None; 161002 when input is not 4-D, boxes is not
        ``(K, 5)``, a pooled size is not an integer > 0, spatial_scale <= FLT_MIN (or NaN),
        sampling_ratio is negative or not an integer, aligned is not a bool, ``layout`` is not
        "NCHW" or "NHWC", a dtype is unsupported or differs between input and boxes, or ``out``
        is unusable.
    """
    input = v.as_array(FORWARD, "input", input)
    boxes = v.as_array(FORWARD, "boxes", boxes)
    call = FORWARD_OPERATION.plan(
        input, boxes, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned, layout, out
    )
    return call.run(input, boxes, out)


def _forward_plan(input, boxes, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned, layout, out):
    """Validate the forward's arguments (errors in the documented order); the arrays' values are not read."""
    layout = v.layout(FORWARD, layout)
    nhwc = layout == d.NHWC
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
    if nhwc:
        batch, height, width, channels = input.shape
        shape = (boxes.shape[0], pooled_height, pooled_width, channels)
        channels_last = True  # read in place when C-contiguous, else through a C-contiguous copy
    else:
        batch, channels, height, width = input.shape
        shape = (boxes.shape[0], channels, pooled_height, pooled_width)
        # A channels-last input (its NHWC transpose C-contiguous) is read in place, in that
        # memory order; any other layout through a C-contiguous copy.
        channels_last = not input.flags.c_contiguous and input.transpose(0, 2, 3, 1).flags.c_contiguous
    d.check_out(FORWARD, out, shape, dtype, d.NCHW)  # C-contiguous in either layout
    results = (d.result(shape, dtype),)
    if 0 in shape:
        return _contract.OneResultPlan(FORWARD, _FORWARD_NAMES, 2, results, None, None)
    geometry = kernels.ForwardGeometry(
        shape[0],
        batch,
        channels,
        height,
        width,
        pooled_height,
        pooled_width,
        channels_last,
        nhwc,
        *scalars,
        d.compute_dtype(dtype),
        d.storage_format(dtype),
    )
    # the kernel reads (B, C, H*W), or (B, H*W, C) in place for channels-last memory (the NHWC
    # layout's array or an NCHW array's channels-last strides); anything else through a copy
    pixels = height * width
    if nhwc:
        source = d.operand(input, shape=(batch, pixels, channels))
    elif channels_last:
        source = d.operand(input, d.NHWC, shape=(batch, pixels, channels))
    else:
        source = d.operand(input, shape=(batch, channels, pixels))
    return _contract.OneResultPlan(FORWARD, _FORWARD_NAMES, 2, results, source, kernels.plan(geometry))


_SCALARS = ("pooled_height", "pooled_width", "spatial_scale", "sampling_ratio", "aligned")
OPERATION = _contract.Operation(
    roi_align_backward, _plan, ("grad_output", "boxes", "input_shape", *_SCALARS, "layout", "out")
)
FORWARD_OPERATION = _contract.Operation(
    roi_align_forward, _forward_plan, ("input", "boxes", *_SCALARS, "layout", "out")
)
#: The validated plans of a call and of a forward call (the bridges'): the function's arguments
#: in this order, the arrays as NumPy arrays (ParamError as the function raises it).
plan = OPERATION.plan
forward_plan = FORWARD_OPERATION.plan
run = run_forward = _contract.run


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
