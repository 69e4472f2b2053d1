"""fastbwd.replication_pad2d_backward (aclnnReplicationPad2dBackward, docs/semantics.md §3)."""

# annotations kept as strings: help() shows `ArrayLike`, not numpy's 2,000-character expansion of it
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from .. import _dtypes as d
from .. import _validation as v
from ..kernels import replication_pad2d as kernels
from . import _contract

FUNC = "replication_pad2d_backward"


def replication_pad2d_backward(
    grad_output: ArrayLike,
    input: ArrayLike | Sequence[int],
    padding: Sequence[int],
    *,
    layout: str = "NCHW",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Gradient of ``torch.nn.functional.pad(input, padding, mode="replicate")`` for 2-D padding.

    Every grad_input cell receives the sum of the grad_output cells that replicate it: interior
    cells copy, edge cells sum their strip, corners sum their rectangle (docs/semantics.md §3).

    Parameters
    ----------
    grad_output : array_like
        ``(N, C, H + top + bottom, W + left + right)`` or unbatched ``(C, ...)``. float16,
        bfloat16, float32, float64, complex64 or complex128, or ``(N, OH, OW, C)`` with
        ``layout="NHWC"``. Any strides; a 4-D array with channels-last strides gives a
        channels-last result without copying.
    input : array_like or tuple of int
        The forward input (only its shape and dtype are used) or its shape, 3-D or 4-D
        (``(N, H, W, C)`` with ``layout="NHWC"``).
    padding : sequence of 4 int
        ``(left, right, top, bottom)``. Each must be smaller than the dimension it pads
        (``left, right < W``; ``top, bottom < H``); negative pads crop as in PyTorch, as long as
        the padded sizes stay >= 1.
    layout : {"NCHW", "NHWC"}, optional, keyword-only
        The axis order of grad_output, input and the result (checks name the axes of the
        NCHW order). ``"NHWC"``: 4-D only; the result is ``(N, H, W, C)``, C-contiguous.
    out : numpy.ndarray, optional
        Written completely and returned: exactly the result's shape, dtype and memory layout.

    Returns
    -------
    numpy.ndarray
        grad_input, shaped like ``input``, in grad_output's dtype. Sums are accumulated in
        float32 for float16/bfloat16/float32 (rounded once), in float64 or complex precision
        otherwise. A cell with a single source is an exact copy.

    Raises
    ------
    ParamError
        For every bad argument listed in docs/semantics.md §3 (status 161001 for a missing argument).

    Examples
    --------
    The Ascend documents' example: a width-5 row padded by 1 on each side; the edge cells also
    collect the padding's gradient.

    >>> import numpy as np, fastbwd
    >>> grad_output = np.ones((1, 1, 7), np.float32)
    >>> fastbwd.replication_pad2d_backward(grad_output, (1, 1, 5), (1, 1, 0, 0))
    array([[[2., 1., 1., 1., 2.]]], dtype=float32)
    """
    grad_output = v.as_array(FUNC, "grad_output", grad_output)
    # ``input`` as an array (a view: NumPy array, torch tensor or other array-like) unless it is a shape
    input_array = None if isinstance(input, (tuple, list)) else v.as_array(FUNC, "input", input)
    call = OPERATION.plan(grad_output, input if input_array is None else input_array, padding, out, layout)
    return call.run(grad_output, input_array, out)


def _plan(grad_output, input, padding, out, layout="NCHW"):
    """Validate every argument (errors in the documented order) and decide the kernel path.
    ``input`` is the forward input as an array, or its shape."""
    user_grad_output = grad_output
    nhwc, grad_output, input, out = d.layout_views(FUNC, layout, grad_output, input, out)
    v.check_dtype(FUNC, "grad_output", grad_output, d.FLOATING_AND_COMPLEX)
    input_shape = v.input_shape_like(FUNC, input, grad_output, (3, 4))
    left, right, top, bottom = v.int_tuple(FUNC, "padding", padding, (4,))
    ndim = len(input_shape)
    for axis, size in enumerate(input_shape):
        if size == 0 and not (ndim == 4 and axis == 0):
            v.fail(
                FUNC, f"input.shape[{axis}]", "must be > 0 (only the batch dimension of a 4-D input may be empty)", 0
            )
    height, width = input_shape[-2:]
    for index, (name, pad, size, what) in enumerate(
        (
            ("left", left, width, "width"),
            ("right", right, width, "width"),
            ("top", top, height, "height"),
            ("bottom", bottom, height, "height"),
        )
    ):
        if pad >= size:
            v.fail(FUNC, f"padding[{index}]", f"({name}) must be less than the input {what} {size}", pad)
    out_height, out_width = height + top + bottom, width + left + right
    if out_height < 1 or out_width < 1:
        v.fail(
            FUNC,
            "padding",
            f"must leave a padded size of at least 1 x 1 for input {height} x {width}",
            f"{(left, right, top, bottom)}, giving {out_height} x {out_width}",
        )
    for axis in range(ndim - 2):
        v.check_dim(FUNC, "grad_output", axis, grad_output.shape[axis], input_shape[axis], "as input")
    v.check_dim(
        FUNC,
        "grad_output",
        ndim - 2,
        grad_output.shape[-2],
        out_height,
        f"input height {height} + top {top} + bottom {bottom}",
    )
    v.check_dim(
        FUNC,
        "grad_output",
        ndim - 1,
        grad_output.shape[-1],
        out_width,
        f"input width {width} + left {left} + right {right}",
    )

    dtype = grad_output.dtype
    layout = d.NHWC if nhwc or d.is_channels_last(grad_output) else d.NCHW
    d.check_out(FUNC, out, input_shape, dtype, layout)
    results, source = d.grad_input(nhwc, input_shape, dtype, layout, user_grad_output, grad_output)
    if math.prod(input_shape) == 0:
        return _contract.OneResultPlan(FUNC, _NAMES, 1, results, None, None)
    geometry = kernels.Geometry(
        layout == d.NHWC,
        input_shape[0] if ndim == 4 else 1,
        input_shape[-3],
        height,
        width,
        out_height,
        out_width,
        top,
        left,
        dtype.itemsize,
        d.storage_format(dtype),
    )
    return _contract.OneResultPlan(FUNC, _NAMES, 1, results, source, kernels.plan(geometry))


_NAMES = ("grad_output", "input")
OPERATION = _contract.Operation(
    replication_pad2d_backward, _plan, ("grad_output", "input", "padding", "out", "layout"), shapes=("input",)
)
#: The validated plan of a call (the bridges'): the public function's arguments in this order,
#: the arrays as NumPy arrays, ``input`` one or a shape (ParamError as the function raises it).
plan = OPERATION.plan
run = _contract.run
