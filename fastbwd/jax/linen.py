"""fastbwd.jax.linen: Flax linen's ``nn.GroupNorm`` on fastbwd's kernels, and what
:func:`fastbwd.jax.reach` serves in Flax linen. Needs Flax.

:class:`GroupNorm` is ``nn.GroupNorm`` (the same fields, parameters ``scale`` and ``bias``,
defaults and result dtype) with an optional fused Swish. Inside reach every ``nn.GroupNorm``
of a model runs this way (through ``nn.intercept_methods``, :func:`interceptor`, entered by the
thread's outermost reach), and so do ``nn.avg_pool`` and ``nn.swish``/``silu`` (this module
registers their seams with fastbwd/jax/_seams.py when it is imported).
"""

from collections.abc import Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import pooling

from .. import _dtypes as d
from . import _avg_pool, _reach, _seams


def _groups(module, channels):
    """The group count of ``module`` for ``channels`` features, or None where Flax raises."""
    num_groups, group_size = module.num_groups, module.group_size
    if (num_groups is None) == (group_size is None):
        return None
    if group_size is not None:
        if not isinstance(group_size, int) or group_size <= 0 or channels % group_size:
            return None
        return channels // group_size
    if not isinstance(num_groups, int) or num_groups <= 0 or channels % num_groups:
        return None
    return num_groups


def _parameter_dtype(module, name):
    if module.has_variable("params", name):
        return jnp.result_type(module.get_variable("params", name))
    return jnp.dtype(module.param_dtype)


def _plan(module, x):
    """``(groups, kernel dtype, result dtype)`` of ``module(x)`` on fastbwd, or None.

    Flax computes the statistics in ``promote(dtype or x.dtype, float32)`` (without the
    promotion when ``force_float32_reductions`` is False) and returns
    ``canonicalize_dtype(x, scale, bias, dtype=dtype)``: fastbwd runs on x promoted with that
    result dtype when its compute type is the statistics' type, and casts its result."""
    if not isinstance(x, jax.Array | np.ndarray) or x.ndim < 1 or module.axis_name is not None:
        return None
    if module.reduction_axes is not None:
        axes = module.reduction_axes if isinstance(module.reduction_axes, Iterable) else (module.reduction_axes,)
        if {axis % x.ndim for axis in axes} != set(range(1, x.ndim)) | {x.ndim - 1}:
            return None
    groups = _groups(module, x.shape[-1])
    if groups is None or np.dtype(x.dtype) not in d.FLOATING:
        return None
    used = [name for name, use in (("scale", module.use_scale), ("bias", module.use_bias)) if use]
    result = module.dtype
    if result is None:
        result = jnp.result_type(x.dtype, *(_parameter_dtype(module, name) for name in used))
        if not jnp.issubdtype(result, jnp.inexact):
            result = jnp.promote_types(jnp.float32, result)
    result = jnp.dtype(result)
    statistics = jnp.dtype(module.dtype or x.dtype)
    if module.force_float32_reductions:
        statistics = jnp.promote_types(statistics, jnp.float32)
    kernel = jnp.promote_types(x.dtype, result)
    if kernel not in d.FLOATING or d.compute_dtype(kernel) != statistics:
        return None
    return groups, kernel, result


def _parameters(module, channels, create):
    """``(scale, bias)`` as ``nn.GroupNorm`` uses them (ones and zeros for unused ones); created
    (``module.param``) or read (after Flax's own call created them)."""
    values = []
    for name, use, init, fill in (
        ("scale", module.use_scale, module.scale_init, jnp.ones),
        ("bias", module.use_bias, module.bias_init, jnp.zeros),
    ):
        if not use:
            values.append(fill((channels,), jnp.float32))
            continue
        value = (
            module.param(name, init, [channels], module.param_dtype) if create else module.get_variable("params", name)
        )
        values.append(value if module.force_float32_reductions else jnp.asarray(value, module.param_dtype))
    return values


def group_norm(module, x, fallback, swish=False):
    """``module(x)`` for an ``nn.GroupNorm`` (called inside its own method) on fastbwd, or
    ``fallback()`` (Flax's own call) for a call fastbwd cannot serve; ``swish``: followed by
    Swish. A GroupNorm alone is remembered with its fused pair (fastbwd.jax.reach's swish)."""
    plan = _plan(module, x)
    if plan is None or not _reach.group_norm_served(x, "NHWC", plan[0]):
        return _reach.swish(fallback()) if swish else fallback()
    groups, kernel, result = plan
    images = jnp.asarray(x).astype(kernel)
    images = images[None] if images.ndim == 1 else images

    def parameters(create):
        return _parameters(module, images.shape[-1], create)

    return _reach.group_norm(
        images, groups, module.epsilon, "NHWC", result, x.shape, parameters, fallback, with_swish=swish
    )


def _sequential(module, args, kwargs):
    """``nn.Sequential.__call__``, with fastbwd's swish for each ``nn.swish`` layer."""
    layers = [_reach.swish if layer is _reach.silu else layer for layer in module.layers]
    outputs = layers[0](*args, **kwargs)
    for layer in layers[1:]:
        if isinstance(outputs, tuple):
            outputs = layer(*outputs)
        elif isinstance(outputs, dict):
            outputs = layer(**outputs)
        else:
            outputs = layer(outputs)
    return outputs


def interceptor(next_fun, args, kwargs, context):
    """The ``nn.intercept_methods`` interceptor of fastbwd.jax.reach: ``nn.GroupNorm`` and
    ``nn.Sequential`` calls (of these classes' own ``__call__``) on fastbwd; every other
    method call unchanged."""
    module = context.module
    if context.method_name == "__call__":
        kind = type(module).__call__
        if kind is nn.GroupNorm.__call__ and len(args) == 1 and not (kwargs.keys() - {"mask"}):
            if kwargs.get("mask") is None:
                return group_norm(module, args[0], lambda: next_fun(*args, **kwargs))
        if kind is nn.Sequential.__call__ and module.layers and any(layer is _reach.silu for layer in module.layers):
            return _sequential(module, args, kwargs)
    return next_fun(*args, **kwargs)


class GroupNorm(nn.GroupNorm):
    """``flax.linen.GroupNorm`` on fastbwd's kernels, optionally followed by Swish.

    The same fields, defaults (``num_groups=32``, ``epsilon=1e-6``), parameters (``scale``,
    ``bias``) and result dtype; ``swish=True`` applies ``nn.swish`` to the result, fused into
    one kernel. The variance is the centred one (Flax's default ``use_fast_variance=True``
    takes ``E[x^2] - E[x]^2``, which loses digits when the mean is large against the spread):
    the results agree to float tolerance. Calls fastbwd cannot serve (a ``mask``, an
    ``axis_name``, other ``reduction_axes``, integer or complex inputs, groups of more than 4000
    channels) run Flax's own code.
    """

    swish: bool = False

    @nn.compact
    def __call__(self, x, *, mask=None):
        def fallback():
            return super(GroupNorm, self).__call__(x, mask=mask)

        if mask is not None:
            out = fallback()
            return _reach.swish(out) if self.swish else out
        return group_norm(self, x, fallback, swish=self.swish)


_seams.register("flax.linen", ("swish", "silu"), _reach.silu, _reach.swish_or)
_seams.register("flax.linen.activation", ("swish", "silu"), _reach.silu, _reach.swish_or)
# not in flax.linen.pooling, avg_pool's own module: its original still pickles by that name
_seams.register("flax.linen", ("avg_pool",), pooling.avg_pool, _avg_pool.avg_pool_or)
_reach.register_adapter(
    _reach.Adapter(
        "Flax linen",
        enter=lambda: nn.intercept_methods(interceptor),
        is_model=lambda target: isinstance(target, nn.Module),
    )
)
