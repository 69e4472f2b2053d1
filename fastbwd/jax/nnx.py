"""fastbwd.jax.nnx: Flax NNX's ``nnx.GroupNorm`` on fastbwd's kernels, and the module surgery of
:func:`fastbwd.jax.reach` for NNX models. Needs Flax."""

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import _dtypes as d
from . import _reach


def _plan(module, x, mask):
    """``(x, weight, bias, kernel dtype, result dtype)`` of ``module(x)`` on fastbwd (NNX's
    promotions applied), or None. NNX promotes x, scale and bias to one dtype
    (``module.promote_dtype``), computes the statistics in ``promote(dtype or x.dtype,
    float32)`` and returns ``canonicalize_dtype(x, scale, bias, dtype=dtype)``."""
    if mask is not None or module.axis_name is not None or not isinstance(x, jax.Array | np.ndarray) or x.ndim < 1:
        return None
    if module.reduction_axes is not None:
        axes = module.reduction_axes if isinstance(module.reduction_axes, Iterable) else (module.reduction_axes,)
        if {axis % x.ndim for axis in axes} != set(range(1, x.ndim)) | {x.ndim - 1}:
            return None
    if np.dtype(x.dtype) not in d.FLOATING or x.shape[-1] != module.num_groups * module.group_size:
        return None
    scale = module.scale[...] if module.scale else None
    bias = module.bias[...] if module.bias else None
    x, scale, bias = module.promote_dtype((x, scale, bias), dtype=module.dtype)
    present = [a for a in (x, scale, bias) if a is not None]
    result = module.dtype
    if result is None:
        result = jnp.result_type(*present)
        if not jnp.issubdtype(result, jnp.inexact):
            result = jnp.promote_types(jnp.float32, result)
    result = jnp.dtype(result)
    statistics = jnp.promote_types(module.dtype or x.dtype, jnp.float32)
    kernel = jnp.promote_types(x.dtype, result)
    if kernel not in d.FLOATING or d.compute_dtype(kernel) != statistics:
        return None
    channels = x.shape[-1]
    weight = scale if scale is not None else jnp.ones((channels,), jnp.float32)
    bias = bias if bias is not None else jnp.zeros((channels,), jnp.float32)
    return x, weight, bias, kernel, result


def group_norm(module, x, mask=None, swish=False):
    """``nnx.GroupNorm.__call__(module, x, mask=mask)`` (``swish``: followed by Swish) on
    fastbwd, or NNX's own code for a call fastbwd cannot serve."""

    def fallback():
        return nnx.GroupNorm.__call__(module, x, mask=mask)

    plan = _plan(module, x, mask)
    if plan is None:
        return _reach.swish(fallback()) if swish else fallback()
    promoted, weight, bias, kernel, result = plan
    images = promoted.astype(kernel)
    images = images[None] if images.ndim == 1 else images
    return _reach.group_norm(
        images,
        module.num_groups,
        module.epsilon,
        "NHWC",
        result,
        x.shape,
        lambda _: (weight, bias),
        fallback,
        with_swish=swish,
    )


class GroupNorm(nnx.GroupNorm):
    """``flax.nnx.GroupNorm`` on fastbwd's kernels, optionally followed by Swish.

    The same arguments, defaults (``num_groups=32``, ``epsilon=1e-6``), parameters (``scale``,
    ``bias``) and result dtype; ``swish=True`` applies ``nnx.swish`` to the result, fused into
    one kernel. The variance is the centred one (NNX's default ``use_fast_variance=True`` takes
    ``E[x^2] - E[x]^2``): the results agree to float tolerance. Calls fastbwd cannot serve (a
    ``mask``, an ``axis_name``, other ``reduction_axes``, integer or complex inputs, groups of
    more than 4000 channels) run NNX's own code.
    """

    def __init__(self, num_features, num_groups=32, group_size=None, *, swish=False, **kwargs):
        super().__init__(num_features, num_groups, group_size, **kwargs)
        self.swish = swish

    def __call__(self, x, *, mask=None):
        return group_norm(self, x, mask, swish=getattr(self, "swish", False))


def reach_model(model):
    """fastbwd.jax.reach for an NNX model, in place: each ``nnx.GroupNorm`` becomes a
    :class:`GroupNorm` (the same object and parameters, its class changed), each swish of an
    ``nnx.Sequential`` fastbwd's, and the model's ``__call__`` runs under ``reach()``."""
    for _, node in nnx.iter_graph(model):
        if type(node) is nnx.GroupNorm:
            object.__setattr__(node, "__class__", GroupNorm)
        elif type(node) is nnx.Sequential:
            for index, layer in enumerate(node.layers):
                if layer is _reach.silu:
                    node.layers[index] = _reach.swish
    if not getattr(type(model), "_fastbwd_reached", False):
        object.__setattr__(model, "__class__", _reach.reached_class(type(model)))
    return model
