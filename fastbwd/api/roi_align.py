"""fastbwd.roi_align_backward (aclnnRoiAlignV2Backward, docs/semantics.md §4) and the RoIAlign
forward ``roi_align_forward`` (for fastbwd.torch; not exported by fastbwd)."""

import numpy as np

from .. import _dtypes as d
from .. import _validation as v
from ..kernels import roi_align as kernels

FUNC = "roi_align_backward"

#: The smallest normal float32 (docs/semantics.md §4: spatial_scale must exceed it).
FLT_MIN = float(np.finfo(np.float32).tiny)

#: Channels per task of the scatter kernel, at most (see ``_channel_block``): each sample's
#: offsets and weights are shared by this many channels (16 -> 64 made R2 1.6x faster).
_CHANNEL_BLOCK = 64
#: Channels per task of the forward gather, at most.
_FORWARD_CHANNEL_BLOCK = 64
#: Bytes of each scatter task's scratch, about (see ``_band_rows``).
_SCRATCH_BYTES = 1 << 20


def roi_align_backward(grad_output, boxes, input_shape, pooled_height, pooled_width,
                       spatial_scale, sampling_ratio, aligned, *, out=None):
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
    input_shape = v.int_tuple(FUNC, "input_shape", input_shape, (4,))
    pooled_height = v.int_value(FUNC, "pooled_height", pooled_height)
    pooled_width = v.int_value(FUNC, "pooled_width", pooled_width)
    spatial_scale, sampling_ratio, aligned = _scalars(FUNC, spatial_scale, sampling_ratio, aligned)

    v.check_ndim(FUNC, "grad_output", grad_output, (4,))
    v.check_dtype(FUNC, "grad_output", grad_output, d.FLOATING)
    num_boxes, channels = grad_output.shape[:2]
    _check_boxes(FUNC, boxes, num_boxes, "K of grad_output", "grad_output", grad_output.dtype)
    for axis, size in enumerate(input_shape):
        if size < 0:
            v.fail(FUNC, f"input_shape[{axis}]", "must be >= 0", size)
    batch, _, height, width = input_shape
    if input_shape[1] != channels:
        v.fail(FUNC, "input_shape[1]", f"must be {channels} (C of grad_output)", input_shape[1])
    v.check_dim(FUNC, "grad_output", 2, grad_output.shape[2], pooled_height, "pooled_height")
    v.check_dim(FUNC, "grad_output", 3, grad_output.shape[3], pooled_width, "pooled_width")
    _check_ranges(FUNC, spatial_scale, sampling_ratio)

    dtype = grad_output.dtype
    result, grad_input = d.output(FUNC, out, input_shape, dtype,
                                  inputs=(("grad_output", grad_output), ("boxes", boxes)))
    if result.size == 0:
        return result
    if grad_output.size == 0:
        grad_input.fill(0)
        return result
    tables = _weight_tables(boxes, dtype, batch, height, width, pooled_height, pooled_width,
                            spatial_scale, sampling_ratio, aligned)
    if tables is None:
        grad_input.fill(0)
        return result
    box_order, image_start, box_rows, y_table, x_table = tables
    compute = d.compute_dtype(dtype)
    block = _channel_block(channels)
    kernels.roi_align_bwd(d.kernel_view(np.ascontiguousarray(grad_output)), box_order, image_start,
                          box_rows, d.kernel_view(grad_input).reshape(batch, channels, height * width),
                          width, block, _band_rows(width, block, compute), d.storage_format(dtype),
                          *y_table, *x_table, work=grad_input.size + grad_output.size)
    return result


def roi_align_forward(input, boxes, pooled_height, pooled_width, spatial_scale, sampling_ratio,
                      aligned, *, out=None):
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
    func = "roi_align_forward"
    input = v.as_array(func, "input", input)
    boxes = v.as_array(func, "boxes", boxes)
    pooled_height = v.int_value(func, "pooled_height", pooled_height)
    pooled_width = v.int_value(func, "pooled_width", pooled_width)
    spatial_scale, sampling_ratio, aligned = _scalars(func, spatial_scale, sampling_ratio, aligned)

    v.check_ndim(func, "input", input, (4,))
    v.check_dtype(func, "input", input, d.FLOATING)
    _check_boxes(func, boxes, None, None, "input", input.dtype)
    for name, size in (("pooled_height", pooled_height), ("pooled_width", pooled_width)):
        if size <= 0:
            v.fail(func, name, "must be > 0", size)
    _check_ranges(func, spatial_scale, sampling_ratio)

    batch, channels, height, width = input.shape
    dtype = input.dtype
    shape = (boxes.shape[0], channels, pooled_height, pooled_width)
    result, pooled = d.output(func, out, shape, dtype, inputs=(("input", input), ("boxes", boxes)))
    if result.size == 0:
        return result
    tables = _weight_tables(boxes, dtype, batch, height, width, pooled_height, pooled_width,
                            spatial_scale, sampling_ratio, aligned)
    if tables is None or input.size == 0:
        pooled.fill(0)
        return result
    box_order, image_start, box_rows, y_table, x_table = tables
    skipped = np.setdiff1d(np.arange(boxes.shape[0]), box_order).astype(np.int64)
    target = d.kernel_view(pooled).reshape(shape[0], channels, pooled_height * pooled_width)
    # A channels-last input (its NHWC transpose C-contiguous) is read in place, in that memory
    # order; any other layout through a C-contiguous copy.
    channels_last = not input.flags.c_contiguous and input.transpose(0, 2, 3, 1).flags.c_contiguous
    if channels_last:
        source = input.transpose(0, 2, 3, 1).reshape(batch, height * width, channels)
    else:
        source = np.ascontiguousarray(input).reshape(batch, channels, height * width)
    kernels.roi_align_fwd(d.kernel_view(source), channels_last, height, width, box_order, image_start,
                          box_rows, skipped, target, pooled_height, pooled_width, _forward_channel_block(channels),
                          d.storage_format(dtype), *y_table, *x_table, work=input.size + result.size)
    return result


# --------------------------------------------------------------------------------------------
# shared by the backward and the forward
# --------------------------------------------------------------------------------------------

def _scalars(func, spatial_scale, sampling_ratio, aligned):
    """The scalar arguments' types: ``(spatial_scale, sampling_ratio, aligned)``."""
    return (v.float_value(func, "spatial_scale", spatial_scale),
            v.int_value(func, "sampling_ratio", sampling_ratio),
            v.bool_value(func, "aligned", aligned))


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


def _weight_tables(boxes, dtype, batch, height, width, pooled_height, pooled_width, spatial_scale,
                   sampling_ratio, aligned):
    """The boxes that contribute and their per-axis weight tables (kernels.roi_align):
    ``(box_order, image_start, box_rows, y_table, x_table)``, or None when no box contributes."""
    compute = d.compute_dtype(dtype)
    # Half-format boxes become float32 (exact); the kernels compute in this dtype.
    boxes = np.ascontiguousarray(boxes, dtype=compute)
    box_order, image_start = _boxes_by_image(boxes, batch)
    if box_order.size == 0 or height == 0 or width == 0:
        return None
    with np.errstate(over="ignore"):
        # Rounded to the compute type like torchvision; a huge scale becomes inf and then every
        # box is skipped by the kernels' finiteness test.
        scale = compute.type(spatial_scale)
    # sampling_ratio travels as a float: any Python int is accepted, none overflows.
    ratio = float(sampling_ratio)
    y_slots = np.zeros((box_order.size, pooled_height), np.int64)
    x_slots = np.zeros((box_order.size, pooled_width), np.int64)
    # the serial twin: a few operations per (box, bin), 6-8 us for R1's 512 boxes either way,
    # and the first call compiles about 3 s of CPU less than with the parallel one
    kernels.roi_align_sample_counts.serial(boxes, box_order, pooled_height, pooled_width, scale, ratio,
                                    aligned, height, width, y_slots, x_slots)
    y_table, x_table = _weight_table(y_slots, compute), _weight_table(x_slots, compute)
    box_rows = np.empty((box_order.size, 2), np.int64)
    kernels.roi_align_sample_tables(boxes, box_order, pooled_height, pooled_width, scale, ratio,
                                    aligned, height, width, box_rows, *y_table, *x_table,
                                    work=y_table[3].size + x_table[3].size)
    return box_order, image_start, box_rows, _entries(y_table), _entries(x_table)


def _boxes_by_image(boxes, batch):
    """The boxes that contribute, grouped by image: ``(box_order, image_start)``.

    A box contributes when its five values are finite and ``floor(batch_index)`` is in
    ``[0, batch)`` (docs/semantics.md §4: floor, where torchvision truncates). ``box_order`` lists them sorted by
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


def _weight_table(slots, compute):
    """One axis's weight table for the slot counts per (box, bin):
    ``(start, slots, used, pixel, weight)`` (see kernels.roi_align)."""
    start = np.zeros(slots.size, np.int64)
    np.cumsum(slots.ravel()[:-1], out=start[1:])
    total = int(slots.sum())
    return (start, slots.ravel(), np.zeros(slots.size, np.int64), np.empty(total, np.int64),
            np.empty(total, compute))


def _entries(table):
    """What the scatter and gather read of a table: ``(start, used, pixel, weight)``."""
    start, _, used, pixel, weight = table
    return start, used, pixel, weight


def _channel_block(channels):
    """Channels per task: sample offsets and weights are shared across them, and one pixel's
    block is one contiguous (vectorised) run of the channels-last scratch."""
    return min(channels, _CHANNEL_BLOCK)


def _band_rows(width, channel_block, compute):
    """Rows per task: the task's channels-last scratch stays within ``_SCRATCH_BYTES`` (cache).
    Fixed by the problem size; any banding gives the same bits (each element's order is fixed)."""
    row_bytes = width * channel_block * compute.itemsize
    return max(1, _SCRATCH_BYTES // row_bytes)


def _forward_channel_block(channels):
    """Channels per forward task: its channels-last scratch holds that many values per pixel."""
    return min(channels, _FORWARD_CHANNEL_BLOCK)
