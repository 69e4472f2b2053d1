"""fastbwd.roi_align_backward (aclnnRoiAlignV2Backward, SPEC §4)."""

import numpy as np

from .. import _dtypes as d
from .. import _validation as v
from ..kernels import roi_align as kernels

FUNC = "roi_align_backward"

#: The smallest normal float32 (SPEC §4: spatial_scale must exceed it).
FLT_MIN = float(np.finfo(np.float32).tiny)

#: Channels per task of the scatter kernel, at most (see ``_channel_block``): each sample's
#: offsets and weights are shared by this many channels (16 -> 64 made R2 1.6x faster).
_CHANNEL_BLOCK = 64
#: Bytes of each scatter task's scratch, about (see ``_band_rows``).
_SCRATCH_BYTES = 1 << 20


def roi_align_backward(grad_output, boxes, input_shape, pooled_height, pooled_width,
                       spatial_scale, sampling_ratio, aligned, *, out=None):
    """Gradient of torchvision's ``roi_align`` with respect to its input (SPEC §4).

    For every box ``k`` with batch index ``b = floor(boxes[k, 0])``, every channel and every
    bin ``(ph, pw)``, each sample of the bin's ``gh x gw`` grid scatters
    ``grad_output[k, c, ph, pw] * (bilinear weight) / (gh * gw)`` to the four pixels around it,
    exactly as torchvision's CPU backward loop.

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
        Must be >= 0. The work grows as its square: it is the caller's budget.
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
        Each element sums its contributions in a fixed order (boxes in their given order, bins,
        samples, corners), so the result is bitwise identical for any number of threads.

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
    input_shape = v.int_tuple(FUNC, "input_shape", input_shape, (4,))
    pooled_height = v.int_value(FUNC, "pooled_height", pooled_height)
    pooled_width = v.int_value(FUNC, "pooled_width", pooled_width)
    spatial_scale = v.float_value(FUNC, "spatial_scale", spatial_scale)
    sampling_ratio = v.int_value(FUNC, "sampling_ratio", sampling_ratio)
    aligned = v.bool_value(FUNC, "aligned", aligned)

    v.check_ndim(FUNC, "grad_output", grad_output, (4,))
    v.check_dtype(FUNC, "grad_output", grad_output, d.FLOATING)
    num_boxes, channels = grad_output.shape[:2]
    if boxes.ndim != 2 or boxes.shape[1] != 5:
        v.fail(FUNC, "boxes", "must have shape (K, 5)", f"shape {tuple(boxes.shape)}")
    v.check_dim(FUNC, "boxes", 0, boxes.shape[0], num_boxes, "K of grad_output")
    v.check_same_dtype(FUNC, "boxes", boxes.dtype, "grad_output", grad_output.dtype)
    for axis, size in enumerate(input_shape):
        if size < 0:
            v.fail(FUNC, f"input_shape[{axis}]", "must be >= 0", size)
    batch, _, height, width = input_shape
    if input_shape[1] != channels:
        v.fail(FUNC, "input_shape[1]", f"must be {channels} (C of grad_output)", input_shape[1])
    v.check_dim(FUNC, "grad_output", 2, grad_output.shape[2], pooled_height, "pooled_height")
    v.check_dim(FUNC, "grad_output", 3, grad_output.shape[3], pooled_width, "pooled_width")
    if not spatial_scale > FLT_MIN:  # NaN fails too
        v.fail(FUNC, "spatial_scale", f"must be greater than FLT_MIN ({FLT_MIN:.9g})", spatial_scale)
    if sampling_ratio < 0:
        v.fail(FUNC, "sampling_ratio", "must be >= 0 (0 means adaptive)", sampling_ratio)

    dtype = grad_output.dtype
    result, grad_input = d.output(FUNC, out, input_shape, dtype,
                                  inputs=(("grad_output", grad_output), ("boxes", boxes)))
    if result.size == 0:
        return result
    compute = d.compute_dtype(dtype)
    # Half-format boxes become float32 (exact); the kernels compute in this dtype.
    boxes = np.ascontiguousarray(boxes, dtype=compute)
    box_order, image_start = _boxes_by_image(boxes, batch)
    if grad_output.size == 0 or box_order.size == 0:
        grad_input.fill(0)
        return result

    with np.errstate(over="ignore"):
        # Rounded to the compute type like torchvision; a huge scale becomes inf and then every
        # box is skipped by the kernels' finiteness test.
        scale = compute.type(spatial_scale)
    # sampling_ratio travels as a float: any Python int is accepted, none overflows.
    ratio = float(sampling_ratio)
    y_slots = np.zeros((box_order.size, pooled_height), np.int64)
    x_slots = np.zeros((box_order.size, pooled_width), np.int64)
    kernels.roi_align_sample_counts(boxes, box_order, pooled_height, pooled_width, scale, ratio,
                                    aligned, height, width, y_slots, x_slots)
    y_table, x_table = _sample_table(y_slots, compute), _sample_table(x_slots, compute)
    box_rows = np.empty((box_order.size, 2), np.int64)
    kernels.roi_align_sample_tables(boxes, box_order, pooled_height, pooled_width, scale, ratio,
                                    aligned, height, width, box_rows, *y_table, *x_table)

    fmt = d.storage_format(dtype)
    block = _channel_block(channels)
    kernels.roi_align_bwd(d.kernel_view(np.ascontiguousarray(grad_output)), box_order, image_start,
                          box_rows, d.kernel_view(grad_input).reshape(batch, channels, height * width),
                          width, block, _band_rows(width, block, compute), fmt, *y_table, *x_table)
    return result


def _boxes_by_image(boxes, batch):
    """The boxes that contribute, grouped by image: ``(box_order, image_start)``.

    A box contributes when its five values are finite and ``floor(batch_index)`` is in
    ``[0, batch)`` (SPEC: floor, where torchvision truncates). ``box_order`` lists them sorted by
    image with a stable sort, so within an image they keep their given order;
    image ``b`` owns ``box_order[image_start[b]:image_start[b + 1]]``.
    """
    image = np.floor(boxes[:, 0])
    valid = np.isfinite(boxes).all(axis=1) & (image >= 0) & (image < batch)
    image = image[valid].astype(np.int64)
    box_order = np.flatnonzero(valid)[np.argsort(image, kind="stable")]
    image_start = np.zeros(batch + 1, np.int64)
    np.cumsum(np.bincount(image, minlength=batch), out=image_start[1:])
    return box_order.astype(np.int64), image_start


def _sample_table(slots, compute):
    """One axis's sample table for the slot counts per (box, bin):
    ``(start, used, low, step, low_weight, high_weight)`` (see kernels.roi_align)."""
    start = np.zeros(slots.size, np.int64)
    np.cumsum(slots.ravel()[:-1], out=start[1:])
    total = int(slots.sum())
    return (start, np.zeros(slots.size, np.int64), np.empty(total, np.int64), np.empty(total, np.int64),
            np.empty(total, compute), np.empty(total, compute))


def _channel_block(channels):
    """Channels per task: sample offsets and weights are shared across them, and one pixel's
    block is one contiguous (vectorised) run of the channels-last scratch."""
    return min(channels, _CHANNEL_BLOCK)


def _band_rows(width, channel_block, compute):
    """Rows per task: the task's channels-last scratch stays within ``_SCRATCH_BYTES`` (cache).
    Fixed by the problem size; any banding gives the same bits (each element's order is fixed)."""
    row_bytes = width * channel_block * compute.itemsize
    return max(1, _SCRATCH_BYTES // row_bytes)
