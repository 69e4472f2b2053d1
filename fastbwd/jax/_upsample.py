"""Bilinear upsampling for JAX: PyTorch's ``F.interpolate(mode="bilinear")`` and
``jax.image.resize(method="linear")``, forward in jax.numpy, fastbwd's backward."""

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _dtypes as d
from .. import _validation as v
from ..api import upsample_bilinear2d as api
from . import _common as c
from . import _ffi, _linear, _sharding

FUNC = "upsample_bilinear2d"


def _backward_adapter(inputs, outputs, config):
    """The backward on the buffers, prepared (the handler keeps it for their metadata)."""
    (grad_output,), (grad_input,) = inputs, outputs
    layout = config["layout"]
    if layout == "NHWC":
        n, h, w, ch = grad_input.shape
    else:
        n, ch, h, w = grad_input.shape
    output_size, align_corners = config["output_size"], config["align_corners"]
    backward = api.upsample_bilinear2d_backward.prepare(
        grad_output, output_size, (n, ch, h, w), align_corners, None, None, layout=layout, out=grad_input
    )

    def prepared(inputs, outputs):
        backward(inputs[0], out=outputs[0])

    prepared(inputs, outputs)
    return prepared


_TARGET = _ffi.target("upsample_bilinear2d_backward", _backward_adapter, fold=True, split=_sharding.planes)


def _axes(layout):
    return (1, 2) if layout == "NHWC" else (2, 3)


def _interpolate(x, axis, output_size, align_corners):
    """One axis of the separable forward: ``x[index0] * lambda0 + x[index1] * lambda1`` with
    PyTorch's indices and weights (the tables fastbwd's backward uses), in x's dtype."""
    index0, index1, lambda0, lambda1 = api.compute_source_index_and_lambda(
        x.shape[axis], output_size, align_corners, 0.0, x.dtype
    )
    shape = [1] * x.ndim
    shape[axis] = output_size
    return jnp.take(x, index0, axis=axis) * lambda0.reshape(shape) + jnp.take(x, index1, axis=axis) * lambda1.reshape(
        shape
    )


def _forward(x, output_size, align_corners, layout, keep_unchanged=False):
    """PyTorch's forward; ``keep_unchanged``: an axis whose size does not change is left as it is
    (jax.image.resize's rule; PyTorch interpolates it with weights 1 and 0, the same values but
    where x is infinite or NaN)."""
    h_axis, w_axis = _axes(layout)
    compute = x.astype(d.compute_dtype(x.dtype))
    for axis, size in zip((h_axis, w_axis), output_size):
        if size != x.shape[axis] or not keep_unchanged:
            compute = _interpolate(compute, axis, size, align_corners)
    return compute.astype(x.dtype)


def _backward(grad_output, output_size, align_corners, layout, input_shape, keep_unchanged=False):
    config = dict(output_size=list(output_size), align_corners=align_corners, layout=layout)
    result = jax.ShapeDtypeStruct(input_shape, grad_output.dtype)
    return _ffi.call(_TARGET, [grad_output], [result], config)[0]


# static: (output_size, align_corners, layout, input_shape, keep_unchanged); input_shape, x's
# shape, is what the backward needs
def _static_forward(x, output_size, align_corners, layout, input_shape, keep_unchanged=False):
    return _forward(x, output_size, align_corners, layout, keep_unchanged)


_upsample = _linear.linear_function(FUNC, _static_forward, _backward)


def upsample_bilinear2d(
    x: jax.Array, output_size: Sequence[int], align_corners: bool = False, *, layout: str = "NCHW"
) -> jax.Array:
    """``F.interpolate(x, size=output_size, mode="bilinear", align_corners=align_corners)``.

    Parameters
    ----------
    x : jax.Array
        ``(N, C, H, W)``, or ``(N, H, W, C)`` with ``layout="NHWC"``: float32, float64, float16
        or bfloat16.
    output_size : (int, int)
        ``(OH, OW)``, each > 0.
    align_corners : bool
        PyTorch's ``align_corners``.
    layout : {"NCHW", "NHWC"}
        Memory layout of ``x`` and of the result.

    Returns
    -------
    jax.Array
        ``(N, C, OH, OW)`` (or ``(N, OH, OW, C)``) in x's dtype: PyTorch's indices and weights
        (docs/semantics.md §1), computed in float32 (float64 for float64 data) and rounded once.
        Its gradient is ``fastbwd.upsample_bilinear2d_backward``. Under ``jax.vmap`` the batch
        axes fold into N (one kernel call).

    Raises
    ------
    ParamError
        At trace time, for a bad size, flag, layout or dtype, or when x is not 4-D (the checks
        of ``fastbwd.upsample_bilinear2d_backward``, said of this function's arguments).
    """
    x = jnp.asarray(x)
    v.check_ndim(FUNC, "x", x, (4,))
    output_size = c.static_ints(output_size)
    nhwc = layout == "NHWC"

    def grad_output_shape():
        oh, ow = output_size
        return (x.shape[0], oh, ow, x.shape[3]) if nhwc else x.shape[:2] + (oh, ow)

    # the backward's arguments in the user's words: its grad_output is the result, shaped from
    # x's batch and channels and output_size; input_size is x's shape, in NCHW order
    axes = (0, 3, 1, 2) if nhwc else (0, 1, 2, 3)
    subjects = {f"input_size[{i}]": f"x.shape[{axis}]" for i, axis in enumerate(axes)}
    sources = (
        ("x.shape[0]", "output_size[0]", "output_size[1]", "x.shape[3]")
        if nhwc
        else ("x.shape[0]", "x.shape[1]", "output_size[0]", "output_size[1]")
    )
    subjects.update({f"grad_output.shape[{i}]": source for i, source in enumerate(sources)}, grad_output="x")
    with v.called_as(FUNC, subjects):
        api.plan(
            c.placeholder(c.shape_or(x.shape, grad_output_shape), x.dtype),
            output_size,
            tuple(x.shape[axis] for axis in axes),
            align_corners,
            None,
            None,
            layout,
            None,
        )
    return _upsample(x, (c.ints(output_size), bool(align_corners), layout, x.shape, False))


# ---- jax.image.resize ---------------------------------------------------------------------------

#: jax.image.resize itself, whatever later replaces the attribute (fastbwd.jax.reach installs its wrapper).
_jax_resize = jax.image.resize
_LINEAR = jax.image.ResizeMethod.LINEAR


def _resize_plan(image, shape, method, antialias):
    """How fastbwd serves ``jax.image.resize(image, shape, method, antialias)``: the shape of the
    channels-last 4-D view ``(B, H, W, R)`` (the resized axes H and W, a size-1 H when one
    axis is resized) and its output size ``(OH, OW)``; None when it cannot (jax.image.resize
    then runs)."""
    if not isinstance(image, jax.Array | np.ndarray) or np.dtype(image.dtype) not in d.FLOATING:
        return None
    try:
        if (jax.image.ResizeMethod.from_string(method) if isinstance(method, str) else method) != _LINEAR:
            return None
        shape = tuple(int(size) for size in shape)
    except (TypeError, ValueError):
        return None
    if len(shape) != image.ndim or min(shape, default=0) < 1 or min(image.shape, default=0) < 1:
        return None
    resized = [axis for axis in range(image.ndim) if shape[axis] != image.shape[axis]]
    if not resized or len(resized) > 2 or resized[-1] - resized[0] > 1:
        return None
    if antialias and any(shape[axis] < image.shape[axis] for axis in resized):
        return None  # a shrink with antialias=True is a wider triangle filter, not bilinear
    first, last = resized[0], resized[-1]
    batch, rest = math.prod(image.shape[:first]), math.prod(image.shape[last + 1 :])
    if first == last:
        return (batch, 1, image.shape[first], rest), (1, shape[first])
    return (batch,) + image.shape[first : last + 1] + (rest,), shape[first : last + 1]


def resize(image, shape, method, antialias=True, precision=lax.Precision.HIGHEST):
    """``jax.image.resize``: the same arguments and result; linear resizes on fastbwd's backward.

    A ``"linear"`` (``"bilinear"``, ``ResizeMethod.LINEAR``, ...) resize of one axis or of two
    adjacent axes (any others are batch or channel axes: NHWC, NCHW, HWC, ... alike), growing
    them, or shrinking them with ``antialias=False``, in float32, float64, float16 or bfloat16,
    is PyTorch's bilinear interpolation with ``align_corners=False``, which is the same map
    (half-pixel centres, edge samples clamped): its gradient is
    ``fastbwd.upsample_bilinear2d_backward``. The values agree with jax.image.resize's within a
    few units in the last place (weights computed in float32, float64 for float64, where JAX
    uses the image's dtype; ``precision`` does not change CPU arithmetic). Every other call
    (other methods, a shrink with ``antialias=True``, which filters, three resized axes, other
    dtypes) and its errors are ``jax.image.resize``'s own.
    """
    return resize_or(_jax_resize, image, shape, method, antialias, precision)


def resize_or(fallback, image, shape, method, antialias=True, precision=lax.Precision.HIGHEST):
    """:func:`resize`, or ``fallback`` (``jax.image.resize``) with the same arguments for a call
    fastbwd cannot serve."""
    plan = _resize_plan(image, shape, method, antialias)
    if plan is None:
        return fallback(image, shape, method, antialias, precision)
    view, output_size = plan
    images = jnp.asarray(image).reshape(view)
    resized = _upsample(images, (output_size, False, "NHWC", view, True))
    return resized.reshape(tuple(int(size) for size in shape))
