"""GroupNorm (+ Swish) for JAX: fastbwd's forward and fused backward kernels, both through the
FFI transport (XLA's own GroupNorm forward is several times slower on the CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _dtypes as d
from .. import _validation as v
from .._errors import ParamError
from ..api import group_norm_swish as api
from . import _common as c
from . import _decide, _ffi, _linear, _sharding

FUNC = "group_norm_swish"
#: The api's arguments in the user's words (the backward's dy, mean and rstd are shaped from x).
_SUBJECTS = {"gamma": "weight", "beta": "bias", "data_format": "layout", "dy": "x"}
#: Operand positions of the forward's weight and bias: shared by a vmapped batch when not batched.
_PARAMETERS = (1, 2)


def _forward_adapter(inputs, outputs, config):
    def run(inputs, outputs):
        x, weight, bias = inputs
        plan = api.forward_plan(
            x, weight, bias, config["num_groups"], config["layout"], config["activate_swish"], outputs
        )
        api.run_forward(plan, x, weight, bias, config["eps"], config["swish_scale"], outputs)

    c.run_batched(run, inputs, outputs, config["ranks"], shared=_PARAMETERS)


def _backward_adapter(inputs, outputs, config):
    # Each vmapped element has its own weight and bias gradients: one call per element.
    def run(inputs, outputs):
        outputs = tuple(outputs)
        plan = api.plan(*inputs, config["num_groups"], config["layout"], True, True, outputs, config["activate_swish"])
        api.run(plan, *inputs, config["swish_scale"], outputs)

    c.run_batched(run, inputs, outputs, config["ranks"])


_FORWARD = _ffi.target("group_norm_swish_forward", _forward_adapter, fold="expand", split=_sharding.samples)
_BACKWARD = _ffi.target("group_norm_swish_backward", _backward_adapter, fold="expand", split=_sharding.samples)


def _kernel_forward(x, weight, bias, num_groups, eps, swish_scale, layout, activate_swish):
    """``(out, mean, rstd)`` by fastbwd's forward kernel; weight and bias in the compute type."""
    stats = jax.ShapeDtypeStruct((x.shape[0], num_groups), weight.dtype)
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype), stats, stats]
    config = dict(num_groups=num_groups, eps=eps, swish_scale=swish_scale, layout=layout, activate_swish=activate_swish)
    out, mean, rstd = _ffi.call(_FORWARD, [x, weight, bias], results, config)
    return out, (mean, rstd)


def reference(x, weight, bias, num_groups, eps, swish_scale, layout, activate_swish=True):
    """The same function in jax.numpy (statistics in the compute type, biased variance, centred
    sums, rounded once): what the tests compare with."""
    compute = x.astype(d.compute_dtype(x.dtype))
    batch = x.shape[0]
    channels = x.shape[-1] if layout == "NHWC" else x.shape[1]
    if layout == "NHWC":
        grouped = _batch_reshape(compute, (batch, -1, num_groups, channels // num_groups))
        axes = (1, 3)
    else:
        grouped = _batch_reshape(compute, (batch, num_groups, -1))
        axes = (2,)
    mean = jnp.mean(grouped, axis=axes, keepdims=True)
    centered = grouped - mean
    rstd = lax.rsqrt(jnp.mean(centered * centered, axis=axes, keepdims=True) + jnp.asarray(eps, compute.dtype))
    channel_shape = (1,) * (x.ndim - 1) + (channels,) if layout == "NHWC" else (1, channels) + (1,) * (x.ndim - 2)
    y = _batch_reshape(centered * rstd, x.shape) * weight.astype(compute.dtype).reshape(channel_shape)
    y = y + bias.astype(compute.dtype).reshape(channel_shape)
    if activate_swish:
        y = y * jax.nn.sigmoid(jnp.asarray(swish_scale, compute.dtype) * y)
    return y.astype(x.dtype)


def _batch_reshape(array, shape):
    """``array.reshape(shape)``, the leading (batch) axis kept: split over a mesh's explicit axes
    (JAX's default mesh), JAX asks for the result's sharding, the batch's own (the reference is
    the tangent of sharded programs' forward mode)."""
    sharding = jax.typeof(array).sharding
    spec = tuple(sharding.spec) + (None,) * array.ndim
    explicit = _sharding._explicit_axes(sharding.mesh)
    if not explicit or any(spec[1 : array.ndim]) or not spec[0]:
        return array.reshape(shape)
    return jnp.reshape(array, shape, out_sharding=NamedSharding(sharding.mesh, P(spec[0], *[None] * (len(shape) - 1))))


def _backward(grad_output, mean, rstd, x, weight, bias, num_groups, swish_scale, layout, activate_swish):
    results = [
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(weight.shape, weight.dtype),
        jax.ShapeDtypeStruct(bias.shape, weight.dtype),
    ]
    config = dict(num_groups=num_groups, swish_scale=swish_scale, layout=layout, activate_swish=activate_swish)
    dx, dweight, dbias = _ffi.call(_BACKWARD, [grad_output, mean, rstd, x, weight, bias], results, config)
    return [dx, _sharding.gradient_like(dweight, weight), _sharding.gradient_like(dbias, bias)]


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5, 6, 7))
def _group_norm_swish(x, weight, bias, num_groups, eps, swish_scale, layout, activate_swish):
    return _kernel_forward(x, weight, bias, num_groups, eps, swish_scale, layout, activate_swish)[0]


@_group_norm_swish.defjvp
def _group_norm_swish_jvp(num_groups, eps, swish_scale, layout, activate_swish, primals, tangents):
    # The tangent: forward mode evaluates the JVP of the jax.numpy reference; reverse mode
    # transposes it by fastbwd's backward on the forward's mean and rstd.
    def kernel_forward(x, weight, bias):
        return _kernel_forward(x, weight, bias, num_groups, eps, swish_scale, layout, activate_swish)

    out, (mean, rstd) = _linear.without_derivative(kernel_forward, FUNC)(*primals)

    def apply(residuals, linear):
        def function(x, weight, bias):
            return reference(x, weight, bias, num_groups, eps, swish_scale, layout, activate_swish)

        return [jax.jvp(function, tuple(residuals[:3]), tuple(linear))[1]]

    def transpose(residuals, cotangents):
        return _backward(cotangents[0], *residuals[3:], *residuals[:3], num_groups, swish_scale, layout, activate_swish)

    return out, _linear.call(FUNC, apply, transpose, [*primals, mean, rstd], list(tangents))[0]


def group_norm_swish(
    x: jax.Array,
    num_groups: int,
    weight: jax.Array | None,
    bias: jax.Array | None,
    eps: float = 1e-5,
    swish_scale: float = 1.0,
    *,
    layout: str = "NCHW",
    activate_swish: bool = True,
) -> jax.Array:
    """GroupNorm (``F.group_norm(x, num_groups, weight, bias, eps)``) followed by Swish,
    ``y * sigmoid(swish_scale * y)`` (SiLU for ``swish_scale=1``), or GroupNorm alone
    (``activate_swish=False``).

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
        Added to the variance, >= 0.
    swish_scale : float
        Any value; used in the compute type (float32 unless x is float64).
    layout : {"NCHW", "NHWC"}
    activate_swish : bool
        False: GroupNorm alone (``swish_scale`` is checked but not used).

    Returns
    -------
    jax.Array
        x's shape and dtype: ``fastbwd.group_norm_swish`` (statistics and activation computed in
        float32, float64 for float64, centred variance, rounded once). Its gradients (x,
        weight, bias) are ``fastbwd.group_norm_swish_backward`` on the forward's mean and rstd;
        the weight and bias gradients come in their own dtypes. Under ``jax.vmap`` an unbatched
        weight and bias let the forward run once on the whole batch; the backward runs once per
        batch element (each element has its own weight and bias gradients).

    Raises
    ------
    ParamError
        At trace time (the checks of ``fastbwd.group_norm_swish`` and its backward, said of this
        function's arguments).
    """
    x, weight, bias = jnp.asarray(x), jnp.asarray(weight), jnp.asarray(bias)
    if layout not in ("NCHW", "NHWC"):
        v.fail(FUNC, "layout", "must be one of 'NCHW', 'NHWC'", v.describe(layout))
    with v.called_as(FUNC, _SUBJECTS):
        eps, swish_scale = api.forward_scalars(eps, swish_scale)
        activate_swish = v.bool_value(FUNC, "activate_swish", activate_swish)
    _plan_at_trace_time(x, weight, bias, num_groups, layout, activate_swish)
    compute = d.compute_dtype(x.dtype)
    # The kernels take the parameters in the compute type, and so give the statistics in it.
    weight, bias = weight.astype(compute), bias.astype(compute)
    if not _decide.serves("traced", FUNC, x, layout, int(num_groups)):  # plain JAX: the reference, JAX's gradient
        return reference(x, weight, bias, int(num_groups), eps, swish_scale, layout, activate_swish)
    return _group_norm_swish(x, weight, bias, int(num_groups), eps, swish_scale, layout, activate_swish)


def _plan_at_trace_time(x, weight, bias, num_groups, layout, activate_swish):
    """Both directions' checks, on placeholders (ParamError in the user's words)."""
    stats_dtype = d.compute_dtype(x.dtype)

    def stats_shape():
        return (x.shape[0], int(num_groups))

    stats = c.placeholder(c.shape_or((x.shape[0], 1), stats_shape), stats_dtype)
    x_placeholder = c.placeholder(x.shape, x.dtype)
    weight_placeholder = c.placeholder(weight.shape, weight.dtype)
    bias_placeholder = c.placeholder(bias.shape, bias.dtype)
    with v.called_as(FUNC, _SUBJECTS):
        api.forward_plan(x_placeholder, weight_placeholder, bias_placeholder, num_groups, layout, activate_swish, None)
        api.plan(
            x_placeholder,
            stats,
            stats,
            x_placeholder,
            weight_placeholder,
            bias_placeholder,
            num_groups,
            layout,
            True,
            True,
            None,
            activate_swish,
        )


def servable(x, num_groups, eps, layout, activate_swish):
    """Whether :func:`library_call` computes a library's GroupNorm (``activate_swish``: followed
    by Swish) of ``x``: a floating ``x`` (channels first or last, as ``layout`` says) and a
    group count, group size and eps fastbwd's kernels take. When it does not, the library runs
    its own code."""
    if not isinstance(x, jax.Array | np.ndarray) or np.dtype(x.dtype) not in d.FLOATING:
        return False
    if not isinstance(num_groups, int | np.integer) or isinstance(num_groups, bool):
        return False
    channels = x.shape[1] if layout == "NCHW" else x.shape[-1]
    parameter = np.empty((channels,), d.compute_dtype(x.dtype))
    try:
        api.forward_scalars(eps, 1.0)
        _plan_at_trace_time(x, parameter, parameter, num_groups, layout, activate_swish)
    except ParamError:
        return False
    return True


def library_call(x, weight, bias, num_groups, eps, layout, activate_swish, out_dtype):
    """``group_norm_swish`` (``activate_swish=False``: GroupNorm alone) of a :func:`servable`
    library GroupNorm call, cast to ``out_dtype``."""
    compute = d.compute_dtype(x.dtype)
    eps, swish_scale = api.forward_scalars(eps, 1.0)
    out = _group_norm_swish(
        jnp.asarray(x),
        weight.astype(compute),
        bias.astype(compute),
        int(num_groups),
        eps,
        swish_scale,
        layout,
        bool(activate_swish),
    )
    return out.astype(out_dtype)
