"""fastbwd.jax.equinox: Equinox's ``eqx.nn.GroupNorm`` and ``eqx.nn.AvgPool2d`` on fastbwd's
kernels, and the tree surgery of :func:`fastbwd.jax.reach` for Equinox models. Needs Equinox."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import _dtypes as d
from . import _avg_pool, _reach

_NO_STATE = object()


def group_norm(module, x, swish=False):
    """``eqx.nn.GroupNorm.__call__(module, x)`` (``swish``: followed by Swish) on fastbwd, or
    Equinox's own code for a call fastbwd cannot serve.

    Equinox normalises one example ``(channels, *spatial)`` (a batch comes from ``jax.vmap``)
    in ``result_type(x.dtype, float32)`` and returns x's dtype: fastbwd's kernels on
    ``x[None]``, channels first, compute in that type too and round once."""

    def fallback():
        return eqx.nn.GroupNorm.__call__(module, x)

    if not isinstance(x, jax.Array | np.ndarray) or x.ndim < 1 or np.dtype(x.dtype) not in d.FLOATING:
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


class AvgPool2d(eqx.nn.AvgPool2d):
    """``equinox.nn.AvgPool2d`` on fastbwd's kernels: the same fields and result (one example
    ``(channels, height, width)``, window sums over the window's size), its gradient
    ``fastbwd.avg_pool2d_backward`` (and its forward too for a stride-1 window of ``2 * pad + 1``).
    Sums are taken in float32 and rounded once (Equinox sums in the input's dtype). Calls
    fastbwd cannot serve (integer inputs, a pad beyond half the window, more than 65535
    channels) and Equinox's errors are Equinox's own."""

    def __call__(self, x, *, key=None):
        if not isinstance(x, jax.Array | np.ndarray) or x.ndim != 3:
            return super().__call__(x)
        padding = self._update_padding_for_ceil(x.shape) if self.use_ceil else self.padding
        self._check_is_padding_valid(padding)
        plan = _avg_pool.window_plan(x.shape[1:], x.shape[0], x.dtype, self.kernel_size, self.stride, padding)
        if plan is None:
            return super().__call__(x)
        return _avg_pool.window_sums_mean(jnp.asarray(x)[None], plan, True, "NCHW")[0]


def _rebuilt(cls, module, **extra):
    """An instance of ``cls`` holding ``module``'s fields (and ``extra`` ones), as Equinox's own
    unflattening builds modules (no ``__init__``)."""
    new = object.__new__(cls)
    for field in dataclasses.fields(module):
        object.__setattr__(new, field.name, getattr(module, field.name))
    for name, value in extra.items():
        object.__setattr__(new, name, value)
    return new


def _replacement(node):
    if type(node) is eqx.nn.GroupNorm:
        return _rebuilt(GroupNorm, node, swish=False)
    if type(node) is eqx.nn.AvgPool2d:
        return _rebuilt(AvgPool2d, node)
    if type(node) is eqx.nn.Lambda and node.fn is _reach.silu:
        return eqx.nn.Lambda(_reach.swish)
    return None


def reach_model(model):
    """fastbwd.jax.reach for an Equinox model: a new model whose ``eqx.nn.GroupNorm`` and
    ``eqx.nn.AvgPool2d`` modules are :class:`GroupNorm` and :class:`AvgPool2d` (the same
    fields), whose ``eqx.nn.Lambda(jax.nn.silu)`` layers use fastbwd's swish (``eqx.tree_at``),
    and whose ``__call__`` runs under ``reach()``."""

    def is_leaf(node):
        return _replacement(node) is not None

    leaves = jax.tree_util.tree_leaves_with_path(model, is_leaf=is_leaf)
    paths = [path for path, node in leaves if path and is_leaf(node)]
    if paths:

        def where(tree):
            return [_at(tree, path) for path in paths]

        model = eqx.tree_at(where, model, [_replacement(_at(model, path)) for path in paths], is_leaf=is_leaf)
    if _replacement(model) is not None:
        model = _replacement(model)
    if getattr(type(model), "_fastbwd_reached", False):
        return model
    return _rebuilt(_reach.reached_class(type(model)), model)


def _at(tree, path):
    """The node of ``tree`` at a ``jax.tree_util`` key path."""
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            tree = getattr(tree, key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            tree = tree[key.idx]
        elif isinstance(key, jax.tree_util.DictKey):
            tree = tree[key.key]
        else:
            raise TypeError(f"fastbwd.jax.reach: cannot follow the tree path entry {key!r}")
    return tree
