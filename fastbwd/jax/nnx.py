"""fastbwd.jax.nnx: Flax NNX's ``nnx.GroupNorm`` on fastbwd's kernels, and what
:func:`fastbwd.jax.reach` serves in Flax NNX. Needs Flax.

Inside reach, every call of ``nnx.GroupNorm.__call__`` (a model's ``nnx.GroupNorm``, or a
subclass's through ``super()``) runs as :class:`GroupNorm`, an ``nnx.Sequential``'s swish layer
as fastbwd's swish, and ``nnx.avg_pool`` and ``nnx.swish``/``silu`` as fastbwd's drop-ins: this
module registers their seams with fastbwd/jax/_seams.py when it is imported. No model is
changed.
"""

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import pooling

from .. import _dtypes as d
from . import _avg_pool, _reach, _seams

#: NNX's own calls, whatever reach installs in their place.
_GROUP_NORM_CALL = nnx.GroupNorm.__call__
_SEQUENTIAL_CALL = nnx.Sequential.__call__


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
    if not _reach.group_norm_served(x, "NHWC", module.num_groups):  # NNX's call, before any promotion is traced
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


def group_norm(module, x, mask=None, swish=False, call=_GROUP_NORM_CALL):
    """``nnx.GroupNorm.__call__(module, x, mask=mask)`` (``swish``: followed by Swish) on
    fastbwd, or NNX's own code (``call``) for a call fastbwd cannot serve."""

    def fallback():
        return call(module, x, mask=mask)

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


def _group_norm_call(original, module, *args, **kwargs):
    """``nnx.GroupNorm.__call__`` inside reach: :func:`group_norm`, or ``original`` for a call
    of another form."""
    if len(args) != 1 or kwargs.keys() - {"mask"}:
        return original(module, *args, **kwargs)
    return group_norm(module, args[0], kwargs.get("mask"), call=original)


class _WithLayers:
    """``module`` seen with other ``layers`` (its other attributes its own): what NNX's own
    ``Sequential.__call__`` runs on inside reach, so nothing of the model is changed."""

    def __init__(self, module, layers):
        self._module, self.layers = module, layers

    def __getattr__(self, name):
        return getattr(self._module, name)


def _sequential_call(original, module, *args, **kwargs):
    """``nnx.Sequential.__call__`` inside reach: a layer that is ``jax.nn.silu`` itself (a model
    built before reach installed its wrapper) is fastbwd's swish, fused with a GroupNorm before
    it."""
    layers = list(module.layers)
    if any(layer is _reach.silu for layer in layers):
        module = _WithLayers(module, [_reach.swish if layer is _reach.silu else layer for layer in layers])
    return original(module, *args, **kwargs)


_seams.register(nnx.GroupNorm, ("__call__",), _GROUP_NORM_CALL, _group_norm_call)
_seams.register(nnx.Sequential, ("__call__",), _SEQUENTIAL_CALL, _sequential_call)
_seams.register("flax.nnx", ("avg_pool",), pooling.avg_pool, _avg_pool.avg_pool_or)
_seams.register("flax.nnx", ("swish", "silu"), _reach.silu, _reach.swish_or)
_seams.register("flax.nnx.nn.activations", ("swish", "silu"), _reach.silu, _reach.swish_or)
_reach.register_adapter(_reach.Adapter("Flax NNX", is_model=lambda target: isinstance(target, nnx.Module)))
