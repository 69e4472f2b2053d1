"""Replication (edge) padding for JAX: ``jnp.pad(mode="edge")`` forward, fastbwd's backward."""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .. import _validation as v
from ..api import replication_pad2d as api
from . import _common as c
from . import _ffi, _sharding

FUNC = "replication_pad2d"
#: The backward's arguments in the user's words: its grad_output is the result (x's dtype), its
#: input x.
_SUBJECTS = {"grad_output": "x", "input": "x"}


def _backward_adapter(inputs, outputs, config):
    (grad_output,), (grad_input,) = inputs, outputs
    api.run(api.plan(grad_output, grad_input.shape, config["padding"], grad_input), grad_output, None, grad_input)


_TARGET = _ffi.target("replication_pad2d_backward", _backward_adapter, fold=True, split=_sharding.planes)


def _forward(x, padding):
    left, right, top, bottom = padding
    height, width = x.shape[-2:]
    # Negative pads crop (PyTorch): output row i reads input row clamp(i - top, 0, H - 1).
    x = x[..., max(-top, 0) : height - max(-bottom, 0), max(-left, 0) : width - max(-right, 0)]
    pads = [(0, 0)] * (x.ndim - 2) + [(max(top, 0), max(bottom, 0)), (max(left, 0), max(right, 0))]
    return jnp.pad(x, pads, mode="edge")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _pad(x, padding, input_shape):
    return _forward(x, padding)


def _pad_fwd(x, padding, input_shape):
    return _forward(x, padding), None


def _pad_bwd(padding, input_shape, _, grad_output):
    result = jax.ShapeDtypeStruct(input_shape, grad_output.dtype)
    return tuple(_ffi.call(_TARGET, [grad_output], [result], dict(padding=list(padding))))


_pad.defvjp(_pad_fwd, _pad_bwd)


def replication_pad2d(x: jax.Array, padding: Sequence[int]) -> jax.Array:
    """``F.pad(x, padding, mode="replicate")``: edge padding of the last two axes.

    Parameters
    ----------
    x : jax.Array
        ``(N, C, H, W)`` or ``(C, H, W)``: float32, float64, float16, bfloat16, complex64 or
        complex128.
    padding : (int, int, int, int)
        ``(left, right, top, bottom)``, PyTorch's order; each pad must be less than the size it
        pads, and a negative pad crops (the padded size must stay >= 1).

    Returns
    -------
    jax.Array
        ``(..., H + top + bottom, W + left + right)`` in x's dtype (``jnp.pad(mode="edge")``
        after the crops). Its gradient is ``fastbwd.replication_pad2d_backward`` (complex
        gradients unconjugated, as JAX's VJP convention wants). Under ``jax.vmap`` the batch
        axes fold into N (one kernel call).

    Raises
    ------
    ParamError
        At trace time (the checks of ``fastbwd.replication_pad2d_backward``, said of this
        function's arguments).
    """
    x = jnp.asarray(x)
    v.check_ndim(FUNC, "x", x, (3, 4))
    padding = c.static_ints(padding)

    def grad_output_shape():
        left, right, top, bottom = padding
        return x.shape[:-2] + (x.shape[-2] + top + bottom, x.shape[-1] + left + right)

    shape = c.shape_or(x.shape, grad_output_shape)
    if min(shape) < 0:
        shape = x.shape  # an impossible padding: its validation below says which
    with v.called_as(FUNC, _SUBJECTS):
        api.plan(c.placeholder(shape, x.dtype), x.shape, padding, None)
    return _pad(x, c.ints(padding), x.shape)
