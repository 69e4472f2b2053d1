"""fastbwd.avg_pool2d_backward (aclnnAvgPool2dBackward, docs/semantics.md §2)."""

# annotations kept as strings: help() shows `ArrayLike`, not numpy's 2,000-character expansion of it
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from .. import _dtypes as d
from .. import _validation as v
from ..kernels import avg_pool2d as kernels
from ..kernels.avg_pool2d import axis_windows  # noqa: F401 - the JAX forward divides by its windows
from . import _contract

FUNC = "avg_pool2d_backward"

#: The documents' limit on the channel count.
MAX_CHANNELS = 65535
#: Kernel, stride and padding are C ``int`` on the device and in PyTorch's CPU kernel.
_INT32_MAX = 2**31 - 1
#: divisor_override is an ``int64_t``.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def avg_pool2d_backward(
    grad_output: ArrayLike,
    input: ArrayLike | Sequence[int],
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = 0,
    cube_math_type: int = 0,
    *,
    layout: str = "NCHW",
    out: np.ndarray | None = None,
) -> np.ndarray:
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
    layout : {"NCHW", "NHWC"}, optional, keyword-only
        The axis order of grad_output, input and the result (checks name the axes of the
        NCHW order). ``"NHWC"``: 4-D only, grad_output ``(N, OH, OW, C)``, input
        ``(N, H, W, C)``; the result is ``(N, H, W, C)``, C-contiguous.
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

    Examples
    --------
    The gradient of a 2x2 average pooling with stride 2 (the default stride is the kernel size)
    of a ``(1, 1, 4, 4)`` input, given as its shape: each cell gets a quarter of its window's.

    >>> import numpy as np, fastbwd
    >>> grad_output = np.ones((1, 1, 2, 2), np.float32)
    >>> fastbwd.avg_pool2d_backward(grad_output, (1, 1, 4, 4), 2)
    array([[[[0.25, 0.25, 0.25, 0.25],
             [0.25, 0.25, 0.25, 0.25],
             [0.25, 0.25, 0.25, 0.25],
             [0.25, 0.25, 0.25, 0.25]]]], dtype=float32)
    """
    grad_output = v.as_array(FUNC, "grad_output", grad_output)
    # ``input`` as an array (a view: NumPy array, torch tensor or other array-like) unless it is a shape
    input_array = None if isinstance(input, (tuple, list)) else v.as_array(FUNC, "input", input)
    call = OPERATION.plan(
        grad_output,
        input if input_array is None else input_array,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
        cube_math_type,
        out,
        layout,
    )
    return call.run(grad_output, input_array, out)


def _plan(
    grad_output,
    input,
    kernel_size,
    stride,
    padding,
    ceil_mode,
    count_include_pad,
    divisor_override,
    cube_math_type,
    out,
    layout="NCHW",
):
    """Validate every argument (errors in the documented order) and decide the kernel path.
    ``input`` is the forward input as an array, or its shape."""
    user_grad_output = grad_output
    nhwc, grad_output, input, out = d.layout_views(FUNC, layout, grad_output, input, out)
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
            v.fail(
                FUNC, f"input.shape[{axis}]", "must be > 0 (only the batch dimension of a 4-D input may be empty)", 0
            )
    out_sizes = []
    for axis, (name, size, k, s, pad) in enumerate(
        (("height", height, kernel[0], stride[0], padding[0]), ("width", width, kernel[1], stride[1], padding[1]))
    ):
        out_size = v.pooling_output_size(size, k, s, pad, ceil_mode)
        setting = f"input {name} {size}, stride {s}, padding {pad}, ceil_mode {ceil_mode}"
        if out_size < 1:
            v.fail(
                FUNC,
                f"kernel_size[{axis}]",
                f"must leave an output {name} >= 1 ({setting})",
                f"{k} (output {name} {out_size})",
            )
        v.check_dim(
            FUNC,
            "grad_output",
            ndim - 2 + axis,
            grad_output.shape[ndim - 2 + axis],
            out_size,
            f"output {name} for {setting}, kernel {k}",
        )
        out_sizes.append(out_size)
    for axis in range(ndim - 2):
        v.check_dim(FUNC, "grad_output", axis, grad_output.shape[axis], input_shape[axis], "as input")
    out_height, out_width = out_sizes

    dtype = grad_output.dtype
    input_array = None if isinstance(input, (tuple, list)) else input
    layout = d.NCHW
    if d.is_channels_last(grad_output) or (
        out_height == out_width == 1 and input_array is not None and d.is_channels_last(input_array)
    ):
        layout = d.NHWC
    layout = d.NHWC if nhwc else layout
    d.check_out(FUNC, out, input_shape, dtype, layout)
    results, source = d.grad_input(nhwc, input_shape, dtype, layout, user_grad_output, grad_output)
    if math.prod(input_shape) == 0:
        return _contract.OneResultPlan(FUNC, _NAMES, 1, results, None, None)
    geometry = kernels.Geometry(
        layout == d.NHWC,
        input_shape[0] if ndim == 4 else 1,
        channels,
        height,
        width,
        out_height,
        out_width,
        kernel,
        stride,
        padding,
        count_include_pad,
        divisor_override,
        dtype,
        d.compute_dtype(dtype),
        d.storage_format(dtype),
    )
    return _contract.OneResultPlan(FUNC, _NAMES, 1, results, source, kernels.plan(geometry))


_NAMES = ("grad_output", "input")
OPERATION = _contract.Operation(
    avg_pool2d_backward,
    _plan,
    (
        "grad_output",
        "input",
        "kernel_size",
        "stride",
        "padding",
        "ceil_mode",
        "count_include_pad",
        "divisor_override",
        "cube_math_type",
        "out",
        "layout",
    ),
    shapes=("input",),
)
#: The validated plan of a call (the bridges'): the public function's arguments in this order,
#: the arrays as NumPy arrays, ``input`` one or a shape (ParamError as the function raises it).
plan = OPERATION.plan
run = _contract.run


def _check_positive(param, values):
    for axis, value in enumerate(values):
        if value <= 0:
            v.fail(FUNC, f"{param}[{axis}]", "must be > 0", value)
        if value > _INT32_MAX:
            v.fail(FUNC, f"{param}[{axis}]", f"must be at most {_INT32_MAX}", value)
