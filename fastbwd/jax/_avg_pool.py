"""2-D average pooling for JAX: PyTorch's forward in lax, fastbwd's backward."""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _dtypes as d
from .. import _validation as v
from ..api import avg_pool2d as api
from . import _common as c
from . import _ffi, _sharding

FUNC = "avg_pool2d"
#: The backward's arguments in the user's words: its grad_output is the result (x's dtype), its
#: input x.
_SUBJECTS = {"grad_output": "x", "input": "x"}


def _backward_adapter(inputs, outputs, config):
    (grad_output,), (grad_input,) = inputs, outputs
    plan = api.plan(
        grad_output,
        grad_input.shape,
        config["kernel_size"],
        config["stride"],
        config["padding"],
        config["ceil_mode"],
        config["count_include_pad"],
        config["divisor_override"],
        0,
        grad_input,
    )
    api.run(plan, grad_output, None, grad_input)


_TARGET = _ffi.target("avg_pool2d_backward", _backward_adapter, fold=True, split=_sharding.planes)


def _divisors(size, kernel, stride, pad, out_size, count_include_pad):
    """Per output index of one axis: the window's extent within the padded input (PyTorch's
    ``pool_size`` factor) or within the input (``count_include_pad=False``), from the windows
    the backward uses."""
    start, stop, padded = api.axis_windows(size, kernel, stride, pad, out_size)
    return padded if count_include_pad else stop - start


def _forward(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """Window sums by ``lax.reduce_window`` over the zero-padded input, then PyTorch's divisors."""
    compute = x.astype(d.compute_dtype(x.dtype))
    height, width = x.shape[-2:]
    out_sizes = [
        v.pooling_output_size(size, k, s, p, ceil_mode)
        for size, k, s, p in zip((height, width), kernel, stride, padding)
    ]
    # The last window may overhang the bottom/right padding (ceil_mode): pad enough zeros for it.
    pads = [
        (p, max(p, (o - 1) * s + k - size - p))
        for size, k, s, p, o in zip((height, width), kernel, stride, padding, out_sizes)
    ]
    lead = x.ndim - 2
    sums = lax.reduce_window(
        compute,
        np.array(0, compute.dtype),
        lax.add,
        (1,) * lead + tuple(kernel),
        (1,) * lead + tuple(stride),
        [(0, 0)] * lead + pads,
    )
    sums = sums[..., : out_sizes[0], : out_sizes[1]]
    if divisor_override:
        divisor = np.full(out_sizes, divisor_override)
    else:
        rows, cols = (
            _divisors(size, k, s, p, o, count_include_pad)
            for size, k, s, p, o in zip((height, width), kernel, stride, padding, out_sizes)
        )
        divisor = rows[:, None] * cols[None, :]
    return (sums / divisor.astype(compute.dtype)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6, 7))
def _avg_pool(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, input_shape):
    return _forward(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)


def _avg_pool_fwd(x, *static):
    return _forward(x, *static[:-1]), None


def _avg_pool_bwd(kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, input_shape, _, grad_output):
    config = dict(
        kernel_size=list(kernel),
        stride=list(stride),
        padding=list(padding),
        ceil_mode=ceil_mode,
        count_include_pad=count_include_pad,
        divisor_override=divisor_override,
    )
    result = jax.ShapeDtypeStruct(input_shape, grad_output.dtype)
    return tuple(_ffi.call(_TARGET, [grad_output], [result], config))


_avg_pool.defvjp(_avg_pool_fwd, _avg_pool_bwd)


def avg_pool2d(
    x: jax.Array,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int = 0,
) -> jax.Array:
    """``F.avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
    divisor_override or None)``.

    Parameters
    ----------
    x : jax.Array
        ``(N, C, H, W)`` or ``(C, H, W)``: float32, float64, float16 or bfloat16.
    kernel_size, stride, padding : int or (int, int)
        As in PyTorch; ``stride=None`` means ``kernel_size``; each pad at most half the kernel.
    ceil_mode, count_include_pad : bool
    divisor_override : int
        0 means unset; any other value divides every window sum.

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
    v.check_ndim(FUNC, "x", x, (3, 4))
    kernel_size, stride, padding = (c.static_ints(a) for a in (kernel_size, stride, padding))

    def grad_output_shape():
        kernel = c.ints(kernel_size, 2)
        steps = c.ints(stride, 2) if stride not in (None, ()) else kernel
        pads = c.ints(padding, 2)
        sizes = tuple(
            v.pooling_output_size(size, k, s, p, bool(ceil_mode))
            for size, k, s, p in zip(x.shape[-2:], kernel, steps, pads)
        )
        if min(sizes) < 1:
            raise ValueError(sizes)
        return x.shape[:-2] + sizes

    with v.called_as(FUNC, _SUBJECTS):
        api.plan(
            c.placeholder(c.shape_or(x.shape, grad_output_shape), x.dtype),
            x.shape,
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
    stride = c.ints(stride, 2) if stride not in (None, ()) else kernel
    return _avg_pool(
        x,
        kernel,
        stride,
        c.ints(padding, 2),
        bool(ceil_mode),
        bool(count_include_pad),
        int(divisor_override or 0),
        x.shape,
    )
