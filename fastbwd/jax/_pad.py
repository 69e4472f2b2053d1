"""Replication (edge) padding for JAX: PyTorch's ``F.pad(mode="replicate")`` and
``jnp.pad(mode="edge")``, channels first or last: a gather forward, fastbwd's backward."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import _dtypes as d
from .. import _validation as v
from ..api import replication_pad2d as api
from . import _common as c
from . import _ffi, _linear, _sharding

FUNC = "replication_pad2d"
#: The backward's arguments in the user's words: its grad_output is the result (x's dtype), its
#: input x.
_SUBJECTS = {"grad_output": "x", "input": "x"}
LAYOUTS = ("NCHW", "NHWC")
#: jnp.pad itself, whatever later replaces the module's attribute (fastbwd.jax.reach installs its wrapper).
_jnp_pad = jnp.pad


def _nchw(array, layout):
    """A channels-last array ``(N, H, W, C)`` or ``(H, W, C)`` as the 4-D NCHW view the api reads
    in place (channels-last strides); a channels-first one as it is."""
    if layout == "NHWC":
        return (array if array.ndim == 4 else array[None]).transpose(0, 3, 1, 2)
    return array


def _backward_adapter(inputs, outputs, config):
    layout = config["layout"]
    grad_output, grad_input = _nchw(inputs[0], layout), _nchw(outputs[0], layout)
    if d.is_channels_last(grad_input) and not d.is_channels_last(grad_output):
        # a 1 x 1 grad_output reads the same in both layouts, and the api takes it as NCHW
        result = api.run(api.plan(grad_output, grad_input.shape, config["padding"], None), grad_output, None, None)
        np.copyto(grad_input, result)
        return
    api.run(api.plan(grad_output, grad_input.shape, config["padding"], grad_input), grad_output, None, grad_input)


_TARGET = _ffi.target("replication_pad2d_backward", _backward_adapter, fold=True, split=_sharding.planes)


def _forward(x, padding, layout):
    """Output row ``i`` reads input row ``clamp(i - top, 0, H - 1)``, and columns alike (negative
    pads crop, as in PyTorch): two gathers by constant tables, which XLA runs as fast as a copy
    (its ``jnp.pad(mode="edge")``, a concatenation per axis, takes about twice that)."""
    left, right, top, bottom = padding
    h_axis, w_axis = (x.ndim - 3, x.ndim - 2) if layout == "NHWC" else (x.ndim - 2, x.ndim - 1)
    for axis, low, high in ((h_axis, top, bottom), (w_axis, left, right)):
        size = x.shape[axis]
        if low or high:
            rows = np.clip(np.arange(size + low + high) - low, 0, size - 1)
            x = jnp.take(x, rows, axis=axis, mode="clip", indices_are_sorted=True)
    return x


def _backward(grad_output, padding, input_shape, layout):
    result = jax.ShapeDtypeStruct(input_shape, grad_output.dtype)
    return _ffi.call(_TARGET, [grad_output], [result], dict(padding=list(padding), layout=layout))[0]


def _static_forward(x, padding, input_shape, layout):
    return _forward(x, padding, layout)


# static: (padding, input_shape, layout); input_shape, x's shape, is what the backward needs
_pad = _linear.linear_function(FUNC, _static_forward, _backward)


def replication_pad2d(x: jax.Array, padding: Sequence[int], *, layout: str = "NCHW") -> jax.Array:
    """``F.pad(x, padding, mode="replicate")``: edge padding of the two spatial axes.

    Parameters
    ----------
    x : jax.Array
        ``(N, C, H, W)`` or ``(C, H, W)``; with ``layout="NHWC"``, ``(N, H, W, C)`` or
        ``(H, W, C)``: float32, float64, float16, bfloat16, complex64 or complex128.
    padding : (int, int, int, int)
        ``(left, right, top, bottom)``, PyTorch's order; each pad must be less than the size it
        pads, and a negative pad crops (the padded size must stay >= 1).
    layout : {"NCHW", "NHWC"}
        Where the channels are (the result has x's layout).

    Returns
    -------
    jax.Array
        ``H + top + bottom`` by ``W + left + right`` in x's dtype (``jnp.pad(mode="edge")``
        after the crops, exactly). Its gradient is ``fastbwd.replication_pad2d_backward`` (complex
        gradients unconjugated, as JAX's VJP convention wants). Under ``jax.vmap`` the batch
        axes fold into N (one kernel call).

    Raises
    ------
    ParamError
        At trace time (the checks of ``fastbwd.replication_pad2d_backward``, said of this
        function's arguments).
    """
    x = jnp.asarray(x)
    if layout not in LAYOUTS:
        v.fail(FUNC, "layout", "must be one of 'NCHW', 'NHWC'", v.describe(layout))
    v.check_ndim(FUNC, "x", x, (3, 4))
    padding = c.static_ints(padding)
    nchw_shape = x.shape if layout == "NCHW" else _nchw(np.empty(x.shape, np.uint8), layout).shape

    def grad_output_shape():
        left, right, top, bottom = padding
        return nchw_shape[:-2] + (nchw_shape[-2] + top + bottom, nchw_shape[-1] + left + right)

    shape = c.shape_or(nchw_shape, grad_output_shape)
    if min(shape) < 0:
        shape = nchw_shape  # an impossible padding: its validation below says which
    subjects = _SUBJECTS if layout == "NCHW" else dict(_SUBJECTS, **c.channels_last_subjects(x.ndim))
    with v.called_as(FUNC, subjects):
        api.plan(c.placeholder(shape, x.dtype), nchw_shape, padding, None)
    return _pad(x, (c.ints(padding), x.shape, layout))


# ---- jnp.pad(mode="edge") ----------------------------------------------------------------------

#: The dtypes the backward takes (jnp.pad's others, integers and bool, run jnp.pad).
_DTYPES = tuple(np.dtype(t) for t in d.FLOATING_AND_COMPLEX)


def _edge_plan(array, pad_width):
    """How fastbwd serves ``jnp.pad(array, pad_width, mode="edge")``: ``(shape, padding)`` of the
    channels-last 4-D view ``(B, H, W, R)`` (the padded axes H and W, a size-1 H when one axis is
    padded) and its ``(left, right, top, bottom)``; None when it cannot (jnp.pad then runs)."""
    if not isinstance(array, jax.Array | np.ndarray) or np.dtype(array.dtype) not in _DTYPES or array.ndim < 1:
        return None
    try:
        widths = np.asarray(pad_width)
        if widths.dtype.kind not in "iu":
            return None
        pairs = _pairs(widths, array.ndim)
    except (ValueError, TypeError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
    padded = [axis for axis, pair in enumerate(pairs) if pair != [0, 0]]
    if not padded or min(min(pair) for pair in pairs) < 0 or min(array.shape) < 1:
        return None
    if len(padded) == 1:
        (axis,) = padded
        shape = (int(np.prod(array.shape[:axis])), 1, array.shape[axis], int(np.prod(array.shape[axis + 1 :])))
        (left, right), (top, bottom) = pairs[axis], (0, 0)
    elif len(padded) == 2 and padded[1] == padded[0] + 1:
        axis = padded[0]
        rest = array.shape[axis + 2 :]
        shape = (int(np.prod(array.shape[:axis])),) + array.shape[axis : axis + 2] + (int(np.prod(rest)),)
        (top, bottom), (left, right) = pairs[axis], pairs[axis + 1]
    else:
        return None
    if max(top, bottom) >= shape[1] or max(left, right) >= shape[2]:
        return None  # PyTorch's limit (jnp.pad repeats the edge any number of times)
    return shape, (int(left), int(right), int(top), int(bottom))


def pad(array: jax.Array, pad_width, mode="constant", **kwargs) -> jax.Array:
    """``jnp.pad``: the same arguments and result; ``mode="edge"`` on fastbwd's backward.

    An edge padding of one axis or of two adjacent axes (any others are batch or channel axes),
    each pad less than the size it pads, in float32, float64, float16, bfloat16, complex64 or
    complex128, runs a gather (the same values as ``jnp.pad``, copied) forward and
    ``fastbwd.replication_pad2d_backward`` as its gradient (the same values: a gradient is a sum of copies). Every other call, any
    other mode, and its errors, are ``jnp.pad``'s own.
    """
    return pad_or(_jnp_pad, array, pad_width, mode, **kwargs)


def pad_or(fallback, array, pad_width, mode="constant", **kwargs):
    """:func:`pad`, or ``fallback`` (``jnp.pad``) with the same arguments for a call fastbwd
    cannot serve."""
    plan = _edge_plan(array, pad_width) if isinstance(mode, str) and mode == "edge" and not kwargs else None
    if plan is None:
        return fallback(array, pad_width, mode, **kwargs)
    shape, padding = plan
    images = _pad(jnp.asarray(array).reshape(shape), (padding, shape, "NHWC"))
    return images.reshape(tuple(s + lo + hi for s, (lo, hi) in zip(array.shape, _pairs(pad_width, array.ndim))))


def _pairs(pad_width, ndim):
    return np.broadcast_to(np.asarray(pad_width), (ndim, 2)).tolist()
