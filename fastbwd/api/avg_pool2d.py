"""fastbwd.avg_pool2d_backward (aclnnAvgPool2dBackward, docs/semantics.md §2)."""

import functools
import math
from typing import NamedTuple

import numpy as np

from .. import _dtypes as d
from .. import _validation as v
from ..kernels import avg_pool2d as kernels
from ..kernels import _separable, _simd
from . import _plans

FUNC = "avg_pool2d_backward"

#: The documents' limit on the channel count.
MAX_CHANNELS = 65535
#: Kernel, stride and padding are C ``int`` on the device and in PyTorch's CPU kernel.
_INT32_MAX = 2**31 - 1
#: divisor_override is an ``int64_t``.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def avg_pool2d_backward(grad_output, input, kernel_size, stride=None, padding=0, ceil_mode=False,
                        count_include_pad=True, divisor_override=0, cube_math_type=0, *, out=None):
    """Gradient of ``torch.nn.functional.avg_pool2d`` with respect to its input.

    Every output cell ``(oh, ow)`` pools the window ``[oh*sH - pH, oh*sH - pH + kH)`` x
    ``[ow*sW - pW, ow*sW - pW + kW)``, and its gradient is spread evenly over the window's input
    cells (docs/semantics.md §2, PyTorch semantics, modern ``ceil_mode`` rule): ``grad_input[..., h, w]`` is the
    sum over the windows covering ``(h, w)`` of ``grad_output[..., oh, ow] / divisor``.

    Parameters
    ----------
    grad_output : array_like
        ``(N, C, OH, OW)`` or unbatched ``(C, OH, OW)``; float32, float16, bfloat16 or float64.
        ``(OH, OW)`` must be the pooled size of ``input``. Any strides; see Returns for layouts.
    input : array_like or tuple of int
        The forward input (only its shape and dtype are used; its dtype must be grad_output's) or
        its shape, of grad_output's rank. ``C`` must be at most 65535 and ``C, H, W`` must be > 0
        (only the batch dimension may be empty, giving an empty result).
    kernel_size : int or sequence of 1 or 2 int
        ``(kH, kW)``; one value is used for both axes. Each > 0.
    stride : int or sequence of 0, 1 or 2 int, optional
        ``(sH, sW)``; None or an empty sequence means ``kernel_size`` (as in PyTorch). Each > 0.
    padding : int or sequence of 1 or 2 int, default 0
        ``(pH, pW)`` implicit zero padding on both sides; an empty sequence is an error.
        ``0 <= p <= k / 2`` on each axis.
    ceil_mode : bool, default False
        Round the output size up; the last window must still start inside the input or the
        left/top padding (the modern rule, so no window lies entirely in the right padding).
    count_include_pad : bool, default True
        Divide by the window size including padding (but never the part of a ceil-mode window
        overhanging the padding); False divides by the number of input cells in the window.
    divisor_override : int or None, default 0
        0 (or None, PyTorch's spelling) means not set; any other value, negative included, is
        the divisor of every window.
    cube_math_type : int, default 0
        The device's matmul precision mode, one of 0, 1, 2, 3. Validated; it does not change the
        CPU numerics (float32 accumulation always).
    out : numpy.ndarray, optional
        Written completely and returned: exactly the result's shape, dtype and memory layout,
        not overlapping grad_output or input.

    Returns
    -------
    numpy.ndarray
        grad_input, shaped like ``input``, in grad_output's dtype. Layout: C-contiguous, except
        that a 4-D grad_output with channels-last strides gives a channels-last result, read
        without copying. grad_output decides the layout (its memory is what is read); only when
        it is 1 x 1 spatially, where both layouts are the same memory, does a channels-last
        ``input`` array make the result channels-last, as PyTorch would.

        Numerics: the divisor factorises per axis (``1/d`` becomes ``(1/dH) * (1/dW)``, and a
        ``divisor_override`` ``d`` becomes ``1/d`` on the H axis), so each gradient is scaled by
        per-axis reciprocals (float32 for float32/float16/bfloat16, float64 for float64) and
        summed over the output rows first, then the output columns (the separable engine's
        order), accumulating in the compute type; half formats are rounded
        once at the end. PyTorch divides each gradient once by the integer divisor instead: the
        results differ by about 1 ulp of float32. The global case (one window covering the
        whole input) divides by the integer divisor exactly as PyTorch does.

    Raises
    ------
    ParamError
        For every bad argument of docs/semantics.md §2 (status 161001 when a required argument is None):
        ranks, dtypes, sizes, kernel/stride/padding values and lengths, ``2*p > k``, channels
        above 65535, an empty non-batch dimension, an output size below 1, a grad_output shape
        that does not match the pooled input, ``cube_math_type`` not in 0-3, a bad ``out``.
    """
    grad_output = v.as_array(FUNC, "grad_output", grad_output)
    # ``input`` as an array (a view: NumPy array, torch tensor or other array-like) unless it is a shape
    input_array = None if isinstance(input, (tuple, list)) else v.as_array(FUNC, "input", input)
    return run(plan(grad_output, input if input_array is None else input_array, kernel_size, stride,
                    padding, ceil_mode, count_include_pad, divisor_override, cube_math_type, out),
               grad_output, input_array, out)


def plan(grad_output, input, kernel_size, stride, padding, ceil_mode, count_include_pad,
         divisor_override, cube_math_type, out):
    """The validated plan of a call with the public function's arguments, ``grad_output`` a
    NumPy array and ``input`` one or a shape (ParamError as the public function raises it):
    remembered per metadata (:mod:`fastbwd.api._plans`), and what :func:`run` takes."""
    return _PLANS(_plan, grad_output, input, kernel_size, stride, padding, ceil_mode,
                  count_include_pad, divisor_override, cube_math_type, out)


def run(plan, grad_output, input_array, out):
    """The call ``plan`` describes, on NumPy arrays with the metadata the plan was made for
    (``input_array`` None when the input was given as a shape; ``out`` an array or None): the
    per-call checks (``out`` overlapping neither input), then the kernels. Returns the result."""
    result, grad_input = d.output(FUNC, out, plan.input_shape, grad_output.dtype, plan.layout,
                                  inputs=(("grad_output", grad_output), ("input", input_array)),
                                  checked=True)
    if plan.taps is None:
        return result  # empty (N is 0)
    if grad_output.ndim == 3:
        grad_output = grad_output[None]
    grad_output = d.read_only(d.kernel_view(d.physical(grad_output, plan.layout)))
    grad_input = d.kernel_view(grad_input)
    work = grad_output.size + grad_input.size
    if plan.rows is not None:
        rows_kernel, *tables = plan.rows
        rows_kernel(grad_output.reshape(plan.kernel_shapes[0]), grad_input.reshape(plan.kernel_shapes[1]), *tables,
                    result.nbytes >= _simd.STREAM_MIN_BYTES, plan.fmt, work=work)
    elif plan.global_divisor is not None:
        # Global pooling (one window covers the whole input): broadcast g / divisor per plane.
        shapes = plan.kernel_shapes
        pool = (kernels.global_avg_pool2d_bwd_nhwc if plan.layout == d.NHWC
                else kernels.global_avg_pool2d_bwd_nchw)
        pool(grad_output.reshape(shapes[0]), grad_input.reshape(shapes[1]), plan.global_divisor,
             plan.fmt, work=work)
    elif plan.layout == d.NHWC:
        _separable.separable_bwd_nhwc(grad_output, grad_input, *plan.taps, plan.fmt)
    else:
        _separable.separable_bwd_nchw(grad_output.reshape(plan.kernel_shapes[0]),
                                      grad_input.reshape(plan.kernel_shapes[1]), *plan.taps, plan.fmt)
    return result


_PLANS = _plans.Plans()


class _Plan(NamedTuple):
    """What the arguments' metadata decided (see :mod:`fastbwd.api._plans`)."""
    input_shape: tuple
    layout: str  # of grad_output and the result: NHWC for channels-last strides
    taps: tuple  # the H and W tap tables; () for global pooling, None for an empty result
    global_divisor: object  # the compute-type divisor of global pooling, else None
    kernel_shapes: tuple  # the kernel's views of grad_output and the result
    fmt: object
    rows: tuple = None  # the whole-rows NCHW kernel and its tables and layouts, when it runs


def _plan(grad_output, input, kernel_size, stride, padding, ceil_mode, count_include_pad,
          divisor_override, cube_math_type, out):
    """Validate every argument (errors in the documented order) and decide the kernel path.
    ``input`` is the forward input as an array, or its shape."""
    v.check_ndim(FUNC, "grad_output", grad_output, (3, 4))
    v.check_dtype(FUNC, "grad_output", grad_output, d.FLOATING)
    input_shape = v.input_shape_like(FUNC, input, grad_output, (3, 4))
    ndim = len(input_shape)

    kernel = v.int_tuple(FUNC, "kernel_size", kernel_size, (1, 2), scalar_repeats=2)
    _check_positive("kernel_size", kernel)
    # PyTorch: no stride (None or empty) means stride = kernel, non-overlapping windows.
    stride = () if stride is None else v.int_tuple(FUNC, "stride", stride, (0, 1, 2), scalar_repeats=2)
    stride = stride or kernel
    _check_positive("stride", stride)
    padding = v.int_tuple(FUNC, "padding", padding, (1, 2), scalar_repeats=2)
    for axis, (pad, k) in enumerate(zip(padding, kernel)):
        if pad < 0:
            v.fail(FUNC, f"padding[{axis}]", "must be >= 0", pad)
        if 2 * pad > k:
            v.fail(FUNC, f"padding[{axis}]", f"must be at most half of kernel_size[{axis}] = {k}", pad)
    ceil_mode = v.bool_value(FUNC, "ceil_mode", ceil_mode)
    count_include_pad = v.bool_value(FUNC, "count_include_pad", count_include_pad)
    divisor_override = 0 if divisor_override is None else v.int_value(FUNC, "divisor_override", divisor_override)
    if not _INT64_MIN <= divisor_override <= _INT64_MAX:
        v.fail(FUNC, "divisor_override", "must fit in int64", divisor_override)
    cube_math_type = v.int_value(FUNC, "cube_math_type", cube_math_type)
    if cube_math_type not in (0, 1, 2, 3):
        v.fail(FUNC, "cube_math_type", "must be one of 0, 1, 2, 3", cube_math_type)

    channels, height, width = input_shape[-3:]
    channel_axis = ndim - 3
    if channels > MAX_CHANNELS:
        v.fail(FUNC, f"input.shape[{channel_axis}]", f"(channels) must be at most {MAX_CHANNELS}", channels)
    for axis in range(channel_axis, ndim):
        if input_shape[axis] == 0:
            v.fail(FUNC, f"input.shape[{axis}]", "must be > 0 (only the batch dimension of a 4-D input may be empty)", 0)
    out_sizes = []
    for axis, (name, size, k, s, pad) in enumerate(
            (("height", height, kernel[0], stride[0], padding[0]),
             ("width", width, kernel[1], stride[1], padding[1]))):
        out_size = v.pooling_output_size(size, k, s, pad, ceil_mode)
        setting = f"input {name} {size}, stride {s}, padding {pad}, ceil_mode {ceil_mode}"
        if out_size < 1:
            v.fail(FUNC, f"kernel_size[{axis}]", f"must leave an output {name} >= 1 ({setting})",
                   f"{k} (output {name} {out_size})")
        v.check_dim(FUNC, "grad_output", ndim - 2 + axis, grad_output.shape[ndim - 2 + axis], out_size,
                    f"output {name} for {setting}, kernel {k}")
        out_sizes.append(out_size)
    for axis in range(ndim - 2):
        v.check_dim(FUNC, "grad_output", axis, grad_output.shape[axis], input_shape[axis], "as input")
    out_height, out_width = out_sizes

    dtype = grad_output.dtype
    input_array = None if isinstance(input, (tuple, list)) else input
    layout = d.NCHW
    if d.is_channels_last(grad_output) or (
            out_height == out_width == 1 and input_array is not None and d.is_channels_last(input_array)):
        layout = d.NHWC
    d.check_out(FUNC, out, input_shape, dtype, layout)
    fmt = d.storage_format(dtype)
    if math.prod(input_shape) == 0:
        return _Plan(input_shape, layout, None, None, None, fmt)
    compute = d.compute_dtype(dtype)
    planes = math.prod(input_shape[:-2])

    start_h, stop_h, extent_h = _axis_windows(height, kernel[0], stride[0], padding[0], out_height)
    start_w, stop_w, extent_w = _axis_windows(width, kernel[1], stride[1], padding[1], out_width)
    if out_height == out_width == 1 and start_h[0] == start_w[0] == 0 and stop_h[0] == height and stop_w[0] == width:
        if divisor_override != 0:
            divisor = divisor_override
        elif count_include_pad:
            divisor = int(extent_h[0]) * int(extent_w[0])
        else:
            divisor = height * width
        if layout == d.NHWC:
            batch = planes // channels
            shapes = ((batch, channels), (batch, height * width, channels))
        else:
            shapes = ((planes,), (planes, height * width))
        return _Plan(input_shape, layout, (), compute.type(divisor), shapes, fmt)

    # The divisor factorises per axis: 1 / (dH * dW) = (1 / dH) * (1 / dW); a divisor_override d
    # is a constant, applied as 1 / d on the H axis and 1 on the W axis.
    override_h, override_w = (divisor_override, 1) if divisor_override != 0 else (None, None)
    taps_h = _axis_taps(height, kernel[0], stride[0], padding[0], out_height, count_include_pad, override_h, compute)
    shapes = ((planes, out_height, out_width), (planes, height, width))
    if layout == d.NCHW and out_width >= _simd.LANES:
        # whole rows at a time, the width axis as strided windows (same operations, same bits)
        weight_w = _axis_weights(width, kernel[1], stride[1], padding[1], out_width, count_include_pad, override_w,
                                 compute)
        windows = _row_windows(height, kernel[0], stride[0], padding[0], out_height)
        # stride 2 has a kernel of its own (its width pass in registers); each compiles only its pass
        rows_kernel = kernels.avg_pool2d_bwd_rows_s2_nchw if stride[1] == 2 else kernels.avg_pool2d_bwd_rows_nchw
        rows = (rows_kernel, *windows,
                _axis_weights(height, kernel[0], stride[0], padding[0], out_height, count_include_pad, override_h,
                              compute),
                weight_w,
                *_rows_geometry(planes, height, width, out_height, out_width, kernel[0], stride[0], padding[0],
                                kernel[1], stride[1], padding[1], dtype.itemsize))
        return _Plan(input_shape, layout, (), None, shapes, fmt, rows)
    taps_w = _axis_taps(width, kernel[1], stride[1], padding[1], out_width, count_include_pad, override_w, compute)
    return _Plan(input_shape, layout, (*taps_h, *taps_w), None, shapes, fmt)


def _check_positive(param, values):
    for axis, value in enumerate(values):
        if value <= 0:
            v.fail(FUNC, f"{param}[{axis}]", "must be > 0", value)
        if value > _INT32_MAX:
            v.fail(FUNC, f"{param}[{axis}]", f"must be at most {_INT32_MAX}", value)


def _axis_windows(size, kernel, stride, pad, out_size):
    """The docs/semantics.md §2 windows of one axis, per output index: ``(start, stop, pool_extent)``.

    ``[start, stop)`` is the window clipped to the input; ``pool_extent`` is its length
    counting the padding but not the part of a ceil-mode window beyond the padding (so a
    last window overhanging ``size + pad`` is divided by less than ``kernel``).
    """
    start = np.arange(out_size, dtype=np.int64) * stride - pad
    stop = np.minimum(start + kernel, size + pad)
    pool_extent = stop - start
    return np.maximum(start, 0), np.minimum(stop, size), pool_extent


@functools.lru_cache(maxsize=256)
def _axis_weights(size, kernel, stride, pad, out_size, count_include_pad, divisor, compute):
    """Every window's weight on one axis, ``1 / divisor`` in the compute type, the divisor being
    ``divisor`` when given, else the window's extent (counting the padding or not). Memoised: a
    training loop calls with the same geometry every step (the tables are internal and never
    written)."""
    start, stop, extent = _axis_windows(size, kernel, stride, pad, out_size)
    if divisor is not None:
        divisors = np.full(out_size, divisor, np.int64)
    elif count_include_pad:
        divisors = extent
    else:
        divisors = stop - start
    return np.divide(1, divisors.astype(compute), dtype=compute)


@functools.lru_cache(maxsize=256)
def _row_windows(size, kernel, stride, pad, out_size):
    """``(first, stop)``: input row ``h`` of one axis lies in the clipped windows
    ``[first[h], stop[h])`` (ascending, consecutive: the windows' clipped starts and stops both
    increase with the window; empty when no window covers the row). Memoised like
    :func:`_axis_weights`."""
    start, stop, _ = _axis_windows(size, kernel, stride, pad, out_size)
    rows = np.arange(size, dtype=np.int64)
    # the windows that start at or before h, minus those that stop at or before it
    return (np.searchsorted(stop, rows, side="right").astype(np.int64),
            np.searchsorted(start, rows, side="right").astype(np.int64))


@functools.lru_cache(maxsize=256)
def _rows_geometry(planes, height, width, out_height, out_width, kernel_h, stride_h, pad_h, kernel_w, stride_w, pad_w,
                   itemsize):
    """The whole-rows kernels' width tables, layouts and task sources
    (``kernels.avg_pool2d_bwd_rows_nchw``): ``(residue_taps, residue_base, (lead, span,
    residue_width), (rows_per_task, piece_rows, depth), task_sources)``. Memoised like
    :func:`_axis_weights`.

    The cell ``w = stride * j + r`` is covered by the windows ``[m - a, m]``, ``m = j + (r + pad)
    // stride``, ``a = (kernel - 1 - q) // stride``, ``q = (r + pad) % stride``: residue ``r``
    sums ``residue_taps[r] = a + 1`` shifted copies of V, the first at ``residue_base[r] + j``
    in V's zero-padded row (V at ``[lead, lead + OW)``, ``lead`` the most windows covering one
    cell minus one, ``span`` long, so that every class's whole vectors of ``residue_width``
    cells stay inside it). A task is a run of ``rows_per_task`` consecutive rows of the P*H rows
    of grad_input (the last one shorter); ``task_sources[t] = (first, stop)``: task ``t`` reads the
    grad_output rows (of the P*OH) ``[first, stop)``, from its first row's first window to its
    last row's last (every plane it crosses in between whole; empty when no window covers its
    rows); ``depth`` is the most any task reads.
    """
    lead = (kernel_w - 1) // stride_w
    residue = np.arange(stride_w, dtype=np.int64)
    q = (residue + pad_w) % stride_w
    residue_taps = np.maximum(0, (kernel_w - 1 - q) // stride_w + 1)
    residue_base = lead + (residue + pad_w) // stride_w - (kernel_w - 1 - q) // stride_w
    # each residue class is summed in whole vectors, past its end into scratch that is never stored
    residue_width = (width + stride_w - 1) // stride_w
    residue_width = (residue_width + _simd.LANES - 1) // _simd.LANES * _simd.LANES
    # residue r reads V's row at [base, base + taps - 1 + residue_width), 0 <= base <= lead + (stride - 1 + pad)
    # // stride - taps + 1
    span = lead + max(out_width, (stride_w - 1 + pad_w) // stride_w + residue_width)
    rows_per_task = max(1, kernels.TASK_BYTES // (width * itemsize))
    piece_rows = max(1, kernels.PIECE_BYTES // (width * itemsize))
    window_first, window_stop = _row_windows(height, kernel_h, stride_h, pad_h, out_height)
    rows = planes * height
    first = np.arange(0, rows, rows_per_task, dtype=np.int64)
    last = np.minimum(first + rows_per_task, rows) - 1
    # the planes of each task's first and last rows (q above is a residue's phase, not a plane)
    first_plane, last_plane = first // height, last // height
    task_sources = np.stack((first_plane * out_height + window_first[first - first_plane * height],
                             last_plane * out_height + window_stop[last - last_plane * height]), axis=1)
    depth = max(1, int(np.max(task_sources[:, 1] - task_sources[:, 0])))
    return (residue_taps, residue_base, (lead, span, residue_width), (rows_per_task, piece_rows, depth),
            task_sources)


@functools.lru_cache(maxsize=256)
def _axis_taps(size, kernel, stride, pad, out_size, count_include_pad, divisor, compute):
    """The separable engine's tap table of one axis: every window's clipped cells, each with the
    window's weight (:func:`_axis_weights`). Memoised like it."""
    start, stop, _ = _axis_windows(size, kernel, stride, pad, out_size)
    weights = _axis_weights(size, kernel, stride, pad, out_size, count_include_pad, divisor, compute)
    return _window_taps(start, stop, weights, compute)


def _window_taps(start, stop, window_weight, compute):
    """The forward tap table of one axis for the separable engine: output ``o`` reads the cells
    ``[start[o], stop[o])`` of its clipped window, each with the window's weight (unused taps of
    shorter windows are -1)."""
    taps = max(1, int(np.max(stop - start)))
    index = start[:, None] + np.arange(taps)[None, :]
    index = np.where(index < stop[:, None], index, -1)
    weight = np.broadcast_to(window_weight[:, None], index.shape)
    return _separable.tap_table(index, weight, compute)
