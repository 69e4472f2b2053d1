"""Bilinear upsampling for JAX: PyTorch's forward in jax.numpy, fastbwd's backward."""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .. import _dtypes as d
from .. import _validation as v
from ..api import upsample_bilinear2d as api
from . import _common as c
from . import _ffi, _sharding

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


def _forward(x, output_size, align_corners, layout):
    h_axis, w_axis = _axes(layout)
    compute = x.astype(d.compute_dtype(x.dtype))
    rows = _interpolate(compute, h_axis, output_size[0], align_corners)
    return _interpolate(rows, w_axis, output_size[1], align_corners).astype(x.dtype)


# The static arguments (input_shape: x's shape, which the backward needs) are not differentiated.
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _upsample(x, output_size, align_corners, layout, input_shape):
    return _forward(x, output_size, align_corners, layout)


def _upsample_fwd(x, output_size, align_corners, layout, input_shape):
    return _forward(x, output_size, align_corners, layout), None


def _upsample_bwd(output_size, align_corners, layout, input_shape, _, grad_output):
    config = dict(output_size=list(output_size), align_corners=align_corners, layout=layout)
    result = jax.ShapeDtypeStruct(input_shape, grad_output.dtype)
    return tuple(_ffi.call(_TARGET, [grad_output], [result], config))


_upsample.defvjp(_upsample_fwd, _upsample_bwd)


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
    return _upsample(x, c.ints(output_size), bool(align_corners), layout, x.shape)
