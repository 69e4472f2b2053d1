"""GroupNorm + Swish for JAX: the forward in jax.numpy, fastbwd's fused backward."""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import _dtypes as d
from .. import _validation as v
from ..api import group_norm_swish as api
from . import _common as c
from . import _ffi, _sharding

FUNC = "group_norm_swish"
#: The backward's arguments in the user's words (its dy, mean and rstd are shaped from x).
_SUBJECTS = {"gamma": "weight", "beta": "bias", "data_format": "layout", "dy": "x"}


def _backward_adapter(inputs, outputs, config):
    outputs = tuple(outputs)
    plan = api.plan(*inputs, config["num_groups"], config["layout"], True, True, outputs)
    api.run(plan, *inputs, config["swish_scale"], outputs)


_TARGET = _ffi.target("group_norm_swish_backward", _backward_adapter, fold=False, split=_sharding.samples)


def _statistics(x, num_groups, eps, layout):
    """``(mean, rstd)`` of each (sample, group), shape ``(N, G)``, in the compute type (biased
    variance, ``rstd = 1 / sqrt(var + eps)``), and x in the compute type."""
    compute = x.astype(d.compute_dtype(x.dtype))
    batch = x.shape[0]
    if layout == "NHWC":
        grouped = compute.reshape(batch, -1, num_groups, x.shape[-1] // num_groups)
        axes = (1, 3)
    else:
        grouped = compute.reshape(batch, num_groups, -1)
        axes = (2,)
    mean = jnp.mean(grouped, axis=axes)
    centered = grouped - jnp.expand_dims(mean, axes)
    variance = jnp.mean(centered * centered, axis=axes)
    return mean, lax.rsqrt(variance + jnp.asarray(eps, compute.dtype)), compute


def _forward(x, weight, bias, num_groups, eps, swish_scale, layout):
    mean, rstd, compute = _statistics(x, num_groups, eps, layout)
    batch, channels = x.shape[0], (x.shape[-1] if layout == "NHWC" else x.shape[1])
    group_size = channels // num_groups
    if layout == "NHWC":
        stats_shape = (batch,) + (1,) * (x.ndim - 2) + (channels,)
        channel_shape = (1,) * (x.ndim - 1) + (channels,)
    else:
        stats_shape = (batch, channels) + (1,) * (x.ndim - 2)
        channel_shape = (1, channels) + (1,) * (x.ndim - 2)

    def per_channel(stat):  # (N, G) -> broadcastable against x, one value per channel
        return jnp.repeat(stat, group_size, axis=1).reshape(stats_shape)

    gamma = weight.astype(compute.dtype).reshape(channel_shape)
    beta = bias.astype(compute.dtype).reshape(channel_shape)
    y = (compute - per_channel(mean)) * per_channel(rstd) * gamma + beta
    scale = jnp.asarray(swish_scale, compute.dtype)
    return (y * jax.nn.sigmoid(scale * y)).astype(x.dtype), (mean, rstd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _group_norm_swish(x, weight, bias, num_groups, eps, swish_scale, layout):
    return _forward(x, weight, bias, num_groups, eps, swish_scale, layout)[0]


def _group_norm_swish_fwd(x, weight, bias, num_groups, eps, swish_scale, layout):
    out, (mean, rstd) = _forward(x, weight, bias, num_groups, eps, swish_scale, layout)
    return out, (x, weight, bias, mean, rstd)


def _group_norm_swish_bwd(num_groups, eps, swish_scale, layout, residuals, grad_output):
    x, weight, bias, mean, rstd = residuals
    results = [
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(weight.shape, weight.dtype),
        jax.ShapeDtypeStruct(bias.shape, weight.dtype),
    ]
    config = dict(num_groups=num_groups, swish_scale=swish_scale, layout=layout)
    dx, dweight, dbias = _ffi.call(_TARGET, [grad_output, mean, rstd, x, weight, bias], results, config)
    return dx, _sharding.gradient_like(dweight, weight), _sharding.gradient_like(dbias.astype(bias.dtype), bias)


_group_norm_swish.defvjp(_group_norm_swish_fwd, _group_norm_swish_bwd)


def group_norm_swish(
    x: jax.Array,
    num_groups: int,
    weight: jax.Array | None,
    bias: jax.Array | None,
    eps: float = 1e-5,
    swish_scale: float = 1.0,
    *,
    layout: str = "NCHW",
) -> jax.Array:
    """GroupNorm (``F.group_norm(x, num_groups, weight, bias, eps)``) followed by Swish,
    ``y * sigmoid(swish_scale * y)`` (SiLU for ``swish_scale=1``).

    Parameters
    ----------
    x : jax.Array
        ``(N, C, *spatial)`` (rank 2 to 8), or channels last ``(N, *spatial, C)`` with
        ``layout="NHWC"``: float32, float64, float16 or bfloat16.
    num_groups : int
        Divides C.
    weight, bias : jax.Array
        ``(C,)``, in x's dtype or float32 (mixed precision).
    eps : float
        Added to the variance.
    swish_scale : float
        Any value; used in the compute type (float32 unless x is float64).
    layout : {"NCHW", "NHWC"}

    Returns
    -------
    jax.Array
        x's shape and dtype; statistics and activation computed in float32 (float64 for
        float64) and rounded once. Its gradients (x, weight, bias) are
        ``fastbwd.group_norm_swish_backward`` on the saved mean and rstd; the weight and bias
        gradients come in weight's dtype (bias's, if it differs). Under ``jax.vmap`` the kernel
        runs once per batch element (a loop: weight and bias may be batched too, and each
        element needs its own weight and bias gradients).

    Raises
    ------
    ParamError
        At trace time (the checks of ``fastbwd.group_norm_swish_backward``, said of this
        function's arguments, and a bad ``eps``).
    """
    x, weight, bias = jnp.asarray(x), jnp.asarray(weight), jnp.asarray(bias)
    eps = v.float_value(FUNC, "eps", eps)
    if layout not in ("NCHW", "NHWC"):
        v.fail(FUNC, "layout", "must be one of 'NCHW', 'NHWC'", v.describe(layout))
    swish_scale = v.float_value(FUNC, "swish_scale", swish_scale)
    stats_dtype = d.compute_dtype(x.dtype)

    def stats_shape():
        return (x.shape[0], int(num_groups))

    stats = c.placeholder(c.shape_or((x.shape[0], 1), stats_shape), stats_dtype)
    with v.called_as(FUNC, _SUBJECTS):
        api.plan(
            c.placeholder(x.shape, x.dtype),
            stats,
            stats,
            c.placeholder(x.shape, x.dtype),
            c.placeholder(weight.shape, weight.dtype),
            c.placeholder(bias.shape, bias.dtype),
            num_groups,
            layout,
            True,
            True,
            None,
        )
    return _group_norm_swish(x, weight, bias, int(num_groups), eps, float(swish_scale), layout)
