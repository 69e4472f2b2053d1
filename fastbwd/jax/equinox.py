"""fastbwd.jax.equinox: Equinox's ``eqx.nn.GroupNorm`` and ``eqx.nn.AvgPool2d`` on fastbwd's
kernels, and what :func:`fastbwd.jax.reach` serves in Equinox. Needs Equinox.

Inside reach, every call of ``eqx.nn.GroupNorm.__call__`` and ``eqx.nn.AvgPool2d.__call__`` (a
model's modules, or a subclass's through ``super()``) runs as :class:`GroupNorm` and
:class:`AvgPool2d`, and an ``eqx.nn.Lambda(jax.nn.silu)`` as fastbwd's swish: this module
registers their seams with fastbwd/jax/_seams.py when it is imported. No model is changed.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import _dtypes as d
from . import _avg_pool, _decide, _reach, _seams

_NO_STATE = object()

#: Equinox's own calls, whatever reach installs in their place.
_GROUP_NORM_CALL = eqx.nn.GroupNorm.__call__
_AVG_POOL_CALL = eqx.nn.AvgPool2d.__call__
_LAMBDA_CALL = eqx.nn.Lambda.__call__


def group_norm(module, x, swish=False, call=_GROUP_NORM_CALL):
    """``eqx.nn.GroupNorm.__call__(module, x)`` (``swish``: followed by Swish) on fastbwd, or
    Equinox's own code (``call``) for a call fastbwd cannot serve.

    Equinox normalises one example ``(channels, *spatial)`` (a batch comes from ``jax.vmap``)
    in ``result_type(x.dtype, float32)`` and returns x's dtype: fastbwd's kernels on
    ``x[None]``, channels first, compute in that type too and round once."""

    def fallback():
        return call(module, x)

    if not isinstance(x, jax.Array | np.ndarray) or x.ndim < 1 or np.dtype(x.dtype) not in d.FLOATING:
        return _reach.swish(fallback()) if swish else fallback()
    if not _reach.group_norm_served(x, "NCHW", module.groups, batched=False):
        return _reach.swish(fallback()) if swish else fallback()
    channels = x.shape[0]
    if module.channelwise_affine:
        weight, bias = module.weight, module.bias
    else:
        weight, bias = jnp.ones((channels,), jnp.float32), jnp.zeros((channels,), jnp.float32)
    return _reach.group_norm(
        jnp.asarray(x)[None],
        module.groups,
        module.eps,
        "NCHW",
        x.dtype,
        x.shape,
        lambda _: (weight, bias),
        fallback,
        with_swish=swish,
    )


class GroupNorm(eqx.nn.GroupNorm):
    """``equinox.nn.GroupNorm`` on fastbwd's kernels, optionally followed by Swish.

    The same arguments, defaults (``eps=1e-5``), fields (``weight``, ``bias``) and result: one
    example ``(channels, *spatial)``, channels first, batched by ``jax.vmap`` (which runs the
    forward once on the whole batch for an unbatched weight and bias); ``swish=True`` applies
    ``jax.nn.swish`` to the result, fused into one kernel. Calls fastbwd cannot serve (integer
    inputs, groups of more than 4000 channels, more than 7 axes) run Equinox's own code.
    """

    swish: bool = eqx.field(static=True, default=False)

    def __init__(self, groups, channels=None, eps=1e-5, channelwise_affine=True, dtype=None, *, swish=False):
        super().__init__(groups, channels, eps, channelwise_affine, dtype)
        self.swish = swish

    def __call__(self, x, state=_NO_STATE, *, key=None):
        out = group_norm(self, x, self.swish)
        return out if state is _NO_STATE else (out, state)


def avg_pool(module, x, call=_AVG_POOL_CALL):
    """``eqx.nn.AvgPool2d.__call__(module, x)`` on fastbwd, or Equinox's own code (``call``) for
    a call fastbwd cannot serve."""
    if not isinstance(x, jax.Array | np.ndarray) or x.ndim != 3:
        return call(module, x)
    padding = module._update_padding_for_ceil(x.shape) if module.use_ceil else module.padding
    module._check_is_padding_valid(padding)
    plan = _avg_pool.window_plan(x.shape[1:], x.shape[0], x.dtype, module.kernel_size, module.stride, padding)
    if plan is None or not _decide.serves("dropin", _avg_pool.FUNC, x, "NCHW"):
        return call(module, x)
    return _avg_pool.window_sums_mean(jnp.asarray(x)[None], plan, True, "NCHW")[0]


class AvgPool2d(eqx.nn.AvgPool2d):
    """``equinox.nn.AvgPool2d`` on fastbwd's kernels: the same fields and result (one example
    ``(channels, height, width)``, window sums over the window's size), its gradient
    ``fastbwd.avg_pool2d_backward`` (and its forward too for a stride-1 window of ``2 * pad + 1``).
    Sums are taken in float32 and rounded once (Equinox sums in the input's dtype). Calls
    fastbwd cannot serve (integer inputs, a pad beyond half the window, more than 65535
    channels) and Equinox's errors are Equinox's own."""

    def __call__(self, x, *, key=None):
        return avg_pool(self, x)


def _group_norm_call(original, module, *args, **kwargs):
    """``eqx.nn.GroupNorm.__call__(x, state=..., *, key=None)`` inside reach: :func:`group_norm`,
    or ``original`` for a call of another form (its errors are Equinox's)."""
    if not 1 <= len(args) <= 2 or kwargs.keys() - {"state", "key"} or (len(args) == 2 and "state" in kwargs):
        return original(module, *args, **kwargs)
    state = args[1] if len(args) == 2 else kwargs.get("state", _NO_STATE)
    out = group_norm(module, args[0], call=original)
    return out if state is _NO_STATE else (out, state)


def _avg_pool_call(original, module, *args, **kwargs):
    """``eqx.nn.AvgPool2d.__call__(x, *, key=None)`` inside reach: :func:`avg_pool`, or
    ``original`` for a call of another form."""
    if len(args) != 1 or kwargs.keys() - {"key"}:
        return original(module, *args, **kwargs)
    return avg_pool(module, args[0], call=original)


def _lambda_call(original, module, *args, **kwargs):
    """``eqx.nn.Lambda.__call__`` inside reach: ``eqx.nn.Lambda(jax.nn.silu)`` holding
    ``jax.nn.silu`` itself (built before reach installed its wrapper) is fastbwd's swish, fused
    with a GroupNorm before it."""
    if module.fn is _reach.silu and len(args) == 1 and not (kwargs.keys() - {"key"}):
        return _reach.swish(args[0])
    return original(module, *args, **kwargs)


def _is_model(target):
    """An Equinox module that is not a function: Equinox's transformations (``eqx.filter_jit``,
    ...) wrap functions in modules with ``__wrapped__``, and ``eqx.Partial`` is a function."""
    return isinstance(target, eqx.Module) and not isinstance(target, eqx.Partial) and not hasattr(target, "__wrapped__")


_seams.register(eqx.nn.GroupNorm, ("__call__",), _GROUP_NORM_CALL, _group_norm_call)
_seams.register(eqx.nn.AvgPool2d, ("__call__",), _AVG_POOL_CALL, _avg_pool_call)
_seams.register(eqx.nn.Lambda, ("__call__",), _LAMBDA_CALL, _lambda_call)
_reach.register_adapter(_reach.Adapter("Equinox", is_model=_is_model))
