"""2-D average pooling for JAX: PyTorch's ``avg_pool2d`` and Flax's ``avg_pool``, channels first or
last, with fastbwd's backward.

The forward is ``lax.reduce_window``, except where the pooling is its own adjoint: stride 1 and
a kernel of ``2 * pad + 1`` on each axis (``"SAME"`` pooling with an odd window), whose window
sums are exactly what the backward kernel computes. There fastbwd's kernel is the forward too
(XLA's reduce_window is several times slower on the CPU).
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _dtypes as d
from .. import _validation as v
from ..api import avg_pool2d as api
from . import _common as c
from . import _decide, _ffi, _linear, _sharding

FUNC = "avg_pool2d"
#: The backward's arguments in the user's words: its grad_output is the result (x's dtype), its
#: input x.
_SUBJECTS = {"grad_output": "x", "input": "x"}
LAYOUTS = ("NCHW", "NHWC")


def _nchw(array, layout):
    """A channels-last array ``(N, H, W, C)`` or ``(H, W, C)`` as the 4-D NCHW view the api reads
    in place (channels-last strides); a channels-first one as it is."""
    if layout == "NHWC":
        return (array if array.ndim == 4 else array[None]).transpose(0, 3, 1, 2)
    return array


def _backward_adapter(inputs, outputs, config):
    layout = config["layout"]
    grad_output, grad_input = _nchw(inputs[0], layout), _nchw(outputs[0], layout)
    arguments = [config[name] for name in ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")]
    arguments += [config["divisor_override"], 0]
    if d.is_channels_last(grad_input) and not d.is_channels_last(grad_output):
        # a 1 x 1 grad_output reads the same in both layouts, and the api takes it as NCHW
        result = api.run(api.plan(grad_output, grad_input.shape, *arguments, None), grad_output, None, None)
        np.copyto(grad_input, result)
        return
    api.run(api.plan(grad_output, grad_input.shape, *arguments, grad_input), grad_output, None, grad_input)


_TARGET = _ffi.target("avg_pool2d_backward", _backward_adapter, fold=True, split=_sharding.planes)


def _spatial_axes(ndim, layout):
    return (ndim - 3, ndim - 2) if layout == "NHWC" else (ndim - 2, ndim - 1)


def _output_sizes(shape, kernel, stride, padding, ceil_mode, layout):
    axes = _spatial_axes(len(shape), layout)
    return tuple(
        v.pooling_output_size(shape[axis], k, s, p, ceil_mode) for axis, k, s, p in zip(axes, kernel, stride, padding)
    )


def _output_shape(shape, sizes, layout):
    axes = _spatial_axes(len(shape), layout)
    shape = list(shape)
    for axis, size in zip(axes, sizes):
        shape[axis] = size
    return tuple(shape)


def _kernel_call(x, config, result_shape):
    """The backward kernel on ``x`` (the same call computes the self-adjoint forward)."""
    return _ffi.call(_TARGET, [x], [jax.ShapeDtypeStruct(result_shape, x.dtype)], config)[0]


def _config(kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, layout):
    return dict(
        kernel_size=list(kernel),
        stride=list(stride),
        padding=list(padding),
        ceil_mode=ceil_mode,
        count_include_pad=count_include_pad,
        divisor_override=divisor_override,
        layout=layout,
    )


def _divisors(size, kernel, stride, pad, out_size, count_include_pad):
    """Per output index of one axis: the window's extent within the padded input (PyTorch's
    ``pool_size`` factor) or within the input (``count_include_pad=False``), from the windows
    the backward uses."""
    start, stop, padded = api.axis_windows(size, kernel, stride, pad, out_size)
    return padded if count_include_pad else stop - start


def _forward(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, layout, kernels=True):
    """The pooling; ``kernels=False``: in plain JAX alone (``lax.reduce_window``, no FFI call)."""
    axes = _spatial_axes(x.ndim, layout)
    sizes = [x.shape[axis] for axis in axes]
    out_sizes = _output_sizes(x.shape, kernel, stride, padding, ceil_mode, layout)
    self_adjoint = kernels and stride == (1, 1) and all(k == 2 * p + 1 for k, p in zip(kernel, padding))
    compute = d.compute_dtype(x.dtype)
    if self_adjoint and (count_include_pad or divisor_override):
        # every window lies inside the padded input: one divisor for all, as the backward's
        config = _config(kernel, stride, padding, False, count_include_pad, divisor_override, layout)
        return _kernel_call(x, config, x.shape)
    if self_adjoint and compute == x.dtype:
        config = _config(kernel, stride, padding, False, True, 1, layout)
        sums = _kernel_call(x, config, x.shape)
    else:
        # The last window may overhang the bottom/right padding (ceil_mode): pad enough zeros for it.
        pads = [
            (p, max(p, (o - 1) * s + k - size - p))
            for size, k, s, p, o in zip(sizes, kernel, stride, padding, out_sizes)
        ]
        window, strides, all_pads = [1] * x.ndim, [1] * x.ndim, [(0, 0)] * x.ndim
        for axis, k, s, pad in zip(axes, kernel, stride, pads):
            window[axis], strides[axis], all_pads[axis] = k, s, pad
        sums = lax.reduce_window(x.astype(compute), np.array(0, compute), lax.add, window, strides, all_pads)
        sums = lax.slice(sums, (0,) * x.ndim, _output_shape(sums.shape, out_sizes, layout))
    if divisor_override:
        divisor = np.full(out_sizes, divisor_override)
    else:
        rows, cols = (
            _divisors(size, k, s, p, o, count_include_pad)
            for size, k, s, p, o in zip(sizes, kernel, stride, padding, out_sizes)
        )
        divisor = rows[:, None] * cols[None, :]
    if layout == "NHWC":
        divisor = divisor[:, :, None]
    return (sums.astype(compute) / divisor.astype(compute)).astype(x.dtype)


def _static_forward(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, layout, input_shape):
    return _forward(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, layout)


def _backward(grad_output, *static):
    *arguments, input_shape = static
    return _kernel_call(grad_output, _config(*arguments), input_shape)


# static: (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, layout,
# input_shape); input_shape, x's shape, is what the backward needs
_avg_pool = _linear.linear_function(FUNC, _static_forward, _backward)


def _plan_at_trace_time(func, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, layout):
    """The backward's checks on placeholders, in the words of ``func``'s arguments; returns the
    validated ``(kernel, stride, padding)`` as int pairs."""
    kernel_size, stride, padding = (c.static_ints(a) for a in (kernel_size, stride, padding))
    nchw_shape = x.shape if layout == "NCHW" else _nchw(np.empty(x.shape, np.uint8), layout).shape

    def grad_output_shape():
        kernel = c.ints(kernel_size, 2)
        steps = c.ints(stride, 2) if stride not in (None, ()) else kernel
        sizes = _output_sizes(nchw_shape, kernel, steps, c.ints(padding, 2), bool(ceil_mode), "NCHW")
        # an empty axis keeps size 1: its kernel check, before the shape's, says what is wrong
        return _output_shape(nchw_shape, tuple(max(size, 1) for size in sizes), "NCHW")

    subjects = _SUBJECTS if layout == "NCHW" else dict(_SUBJECTS, **c.channels_last_subjects(x.ndim))
    with v.called_as(func, subjects):
        api.plan(
            c.placeholder(c.shape_or(nchw_shape, grad_output_shape), x.dtype),
            nchw_shape,
            kernel_size,
            stride,
            padding,
            ceil_mode,
            count_include_pad,
            divisor_override,
            0,
            None,
        )
    kernel = c.ints(kernel_size, 2)
    return kernel, (c.ints(stride, 2) if stride not in (None, ()) else kernel), c.ints(padding, 2)


def avg_pool2d(
    x: jax.Array,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int = 0,
    *,
    layout: str = "NCHW",
) -> jax.Array:
    """``F.avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
    divisor_override or None)``.

    Parameters
    ----------
    x : jax.Array
        ``(N, C, H, W)`` or ``(C, H, W)``; with ``layout="NHWC"``, ``(N, H, W, C)`` or
        ``(H, W, C)``: float32, float64, float16 or bfloat16.
    kernel_size, stride, padding : int or (int, int)
        As in PyTorch; ``stride=None`` means ``kernel_size``; each pad at most half the kernel.
    ceil_mode, count_include_pad : bool
    divisor_override : int
        0 means unset; any other value divides every window sum.
    layout : {"NCHW", "NHWC"}
        Where the channels are (the result has x's layout).

    Returns
    -------
    jax.Array
        The pooled array in x's dtype (windows summed in float32 for the half formats, float64
        for float64, then divided and rounded once). Its gradient is
        ``fastbwd.avg_pool2d_backward``. Under ``jax.vmap`` the batch axes fold into N.

    Raises
    ------
    ParamError
        At trace time (the checks of ``fastbwd.avg_pool2d_backward``, said of this function's
        arguments).
    """
    x = jnp.asarray(x)
    if layout not in LAYOUTS:
        v.fail(FUNC, "layout", "must be one of 'NCHW', 'NHWC'", v.describe(layout))
    v.check_ndim(FUNC, "x", x, (3, 4))
    kernel, stride, padding = _plan_at_trace_time(
        FUNC, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, layout
    )
    static = (kernel, stride, padding, bool(ceil_mode), bool(count_include_pad), int(divisor_override or 0), layout)
    if not _decide.serves("traced", FUNC, x, layout):  # plain JAX: reduce_window, JAX's gradient
        return _forward(x, *static, kernels=False)
    return _avg_pool(x, static + (x.shape,))


# ---- flax.linen.avg_pool ------------------------------------------------------------------------

FLAX_FUNC = "avg_pool"


def _flax_formula(inputs, window_shape, strides=None, padding="VALID", count_include_pad=True):
    """``flax.linen.avg_pool`` as Flax 0.12 computes it (``lax.reduce_window`` in the input's
    dtype, then a division): what :func:`avg_pool` runs for the calls fastbwd cannot serve."""
    dims = len(window_shape)
    batch_dims = inputs.ndim - (dims + 1)
    strides = tuple(strides or (1,) * dims)
    if not isinstance(padding, str):
        padding = ((0, 0),) * max(batch_dims, 1) + tuple(map(tuple, padding)) + ((0, 0),)
    window = (1,) * max(batch_dims, 1) + tuple(window_shape) + (1,)
    steps = (1,) * max(batch_dims, 1) + strides + (1,)

    def pool(array):
        single = batch_dims == 0
        array = array[None] if single else array
        out = lax.reduce_window(array, 0.0, lax.add, window, steps, padding)
        return jnp.squeeze(out, axis=0) if single else out

    y = pool(inputs)
    if count_include_pad:
        return y / np.prod(window_shape)
    div_shape = inputs.shape[:-1] + (1,)
    if len(div_shape) - 2 == dims:
        div_shape = (1,) + div_shape[1:]
    return y / pool(jnp.ones(div_shape))


def _torch_axis(size, kernel, stride, low, high, ceil_mode):
    """PyTorch's ``(padding, output size)`` and the first pooled index of one axis whose windows
    include Flax's ``(low, high)``-padded ones (zero padding; cells beyond the padding count as
    zeros too), or None: the smallest symmetric padding at most half the kernel whose windows
    start where Flax's do."""
    wanted = (size + low + high - kernel) // stride + 1
    for pad in range(low, max(low, high) + 1):
        if (pad - low) % stride or 2 * pad > kernel:
            continue
        first = (pad - low) // stride
        if v.pooling_output_size(size, kernel, stride, pad, ceil_mode) >= first + wanted:
            return pad, first, wanted
    return None


def _flax_plan(inputs, window_shape, strides, padding):
    """How fastbwd serves ``flax.linen.avg_pool(inputs, window_shape, strides, padding)``:
    :func:`window_plan` of its channels-last input; None when fastbwd cannot (the call then
    runs Flax's own formula)."""
    if not isinstance(inputs, jax.Array | np.ndarray):
        return None
    try:
        rank = len(window_shape)
    except TypeError:
        return None
    if inputs.ndim < rank + 1:
        return None
    return window_plan(inputs.shape[-1 - rank : -1], inputs.shape[-1], inputs.dtype, window_shape, strides, padding)


def window_plan(spatial, channels, dtype, window_shape, strides, padding):
    """How fastbwd serves a pooling of ``lax.reduce_window``'s kind (Flax's, Equinox's):
    ``(rank, kernel, stride, padding, ceil_mode, firsts, sizes)``: the window's rank and the
    PyTorch pooling (height 1 for a 1-D window) whose output, cut at ``firsts`` to ``sizes``,
    is the reduce_window's window sums; None when fastbwd cannot."""
    if np.dtype(dtype) not in d.FLOATING:
        return None
    try:
        window = tuple(int(k) for k in window_shape)
        steps = tuple(int(s) for s in strides) if strides else (1,) * len(window)
    except TypeError:
        return None
    if len(window) not in (1, 2) or len(steps) != len(window) or len(spatial) != len(window):
        return None
    try:
        if isinstance(padding, str):
            pads = tuple(tuple(p) for p in lax.padtype_to_pads(spatial, window, steps, padding))
        else:
            pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    except (TypeError, ValueError, RuntimeError):
        return None
    if len(pads) != len(window) or min(window + steps) < 1 or min(min(p) for p in pads) < 0:
        return None
    if min(spatial) < 1 or not 1 <= channels <= api.MAX_CHANNELS:
        return None
    rank = len(window)
    if rank == 1:  # a 1-D pooling is a 2-D one of height 1
        window, steps, pads, spatial = (1,) + window, (1,) + steps, ((0, 0),) + pads, (1,) + tuple(spatial)
    for ceil_mode in (False, True):  # one ceil_mode for both axes, as in PyTorch
        axes = [
            _torch_axis(size, k, s, lo, hi, ceil_mode) for size, k, s, (lo, hi) in zip(spatial, window, steps, pads)
        ]
        if None not in axes:
            torch_pads, firsts, sizes = zip(*axes)
            if min(sizes) < 1:
                return None
            return rank, window, steps, torch_pads, ceil_mode, firsts, sizes
    return None


def window_sums_mean(images, plan, count_include_pad, layout):
    """The average pooling of ``images`` (4-D, in ``layout``) :func:`window_plan` planned:
    window sums over the window's size (``count_include_pad``) or over its input cells."""
    _, kernel, stride, padding, ceil_mode, firsts, sizes = plan
    divisor = kernel[0] * kernel[1] if count_include_pad else 0
    static = (kernel, stride, padding, ceil_mode, count_include_pad, divisor, layout, images.shape)
    pooled = _avg_pool(images, static)
    h_axis = 1 if layout == "NHWC" else 2
    if pooled.shape[h_axis : h_axis + 2] != sizes:
        starts, ends = [0] * 4, list(pooled.shape)
        for axis, first, size in zip((h_axis, h_axis + 1), firsts, sizes):
            starts[axis], ends[axis] = first, first + size
        pooled = lax.slice(pooled, starts, ends)
    return pooled


def avg_pool(
    inputs: jax.Array,
    window_shape: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: str | Sequence[tuple[int, int]] = "VALID",
    count_include_pad: bool = True,
) -> jax.Array:
    """``flax.linen.avg_pool``: the same arguments, result and dtype, on fastbwd's kernels.

    Parameters
    ----------
    inputs : jax.Array
        ``(*batch, *window_axes, features)``, channels last (Flax's layout), any number of
        batch axes (none for a single example).
    window_shape, strides : sequence of int
        Of one or two window axes (``strides`` None means 1 on each).
    padding : "SAME", "VALID", "SAME_LOWER" or a sequence of ``(low, high)`` pairs
        Zero padding, as ``lax.reduce_window`` takes it.
    count_include_pad : bool
        True divides every window sum by the window's size; False by the number of input cells
        in the window.

    Returns
    -------
    jax.Array
        Flax's result: in the inputs' dtype, or for ``count_include_pad=False`` promoted with
        the default float type (float32) as Flax's division does. Window sums are taken in
        float32 (float64 for float64) and rounded once, where Flax sums in the inputs' own
        dtype: the half formats come out closer to the exact average, float32 within a few
        units in the last place. The gradient is ``fastbwd.avg_pool2d_backward``.

    Calls fastbwd cannot serve run Flax's own formula (``lax.reduce_window``, and its errors):
    3-D windows, integer or complex inputs, more than 65535 features, a pad beyond half the
    window or a window start fastbwd's symmetric padding cannot reach (``"SAME"`` with an even
    window and stride 1 is served; see docs/jax.md).
    """
    return avg_pool_or(_flax_formula, inputs, window_shape, strides, padding, count_include_pad)


def avg_pool_or(fallback, inputs, window_shape, strides=None, padding="VALID", count_include_pad=True):
    """:func:`avg_pool`, or ``fallback`` (``flax.linen.avg_pool`` or its formula) with the same
    arguments for a call fastbwd cannot serve."""
    plan = _flax_plan(inputs, window_shape, strides, padding)
    if plan is None or not _decide.serves("dropin", FUNC, inputs, "NHWC"):
        return fallback(inputs, window_shape, strides, padding, count_include_pad)
    return _flax_pool(jnp.asarray(inputs), plan, bool(count_include_pad))


def _flax_pool(x, plan, count_include_pad):
    rank, *_, sizes = plan
    dtype = x.dtype if count_include_pad else jnp.result_type(x.dtype, jnp.ones(()).dtype)
    batch_shape, spatial, features = x.shape[: x.ndim - 1 - rank], x.shape[x.ndim - 1 - rank : -1], x.shape[-1]
    images = x.astype(dtype).reshape((-1,) + (1,) * (2 - rank) + spatial + (features,))
    pooled = window_sums_mean(images, plan, count_include_pad, "NHWC")
    return pooled.reshape(batch_shape + sizes[2 - rank :] + (features,))
