"""fastbwd.jax as JAX, Flax and Equinox users call it (docs/jax.md, docs/semantics.md §8): the
drop-ins equal the calls they replace (jax.image.resize, flax.linen.avg_pool, jnp.pad, the
libraries' GroupNorm), forward and gradient, served or falling back; fastbwd.jax.reach brings
models written for Flax linen, Flax NNX and Equinox to fastbwd's kernels (counted in the compiled
program) with the same gradients; forward-mode derivatives work. Tests of a library skip
cleanly without it; everything skips without jax."""

import itertools
import re
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fastbwd.jax as fj  # noqa: E402
from fastbwd.api import group_norm_swish as gns_api  # noqa: E402
from fastbwd.jax import _avg_pool, _pad, _upsample  # noqa: E402

from conftest import BF16, random  # noqa: E402

FLOATS = [np.dtype(np.float32), np.dtype(np.float16), BF16]


def _targets(function, *args):
    """The fastbwd FFI targets in ``jax.jit(function)``'s compiled program, in order."""
    text = jax.jit(function).lower(*args).compile().as_text()
    return re.findall(r'custom_call_target="fastbwd_(\w+)"', text)


def _tolerance(dtype):
    return {np.dtype(np.float16): 4e-3, BF16: 2e-2}.get(np.dtype(dtype), 2e-5)


def _assert_close(actual, expected, dtype, what=""):
    """Each leaf within the dtype's tolerance of its own largest value (or 1), with the same
    shape, dtype and NaNs."""
    actual, expected = jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, (what, a.shape, e.shape, a.dtype, e.dtype)
        e_dtype = e.dtype
        a, e = np.asarray(a).astype(np.complex128), np.asarray(e).astype(np.complex128)
        nan = np.isnan(e)
        assert (np.isnan(a) == nan).all(), what  # NaN where the library has NaN (0 / 0), only there
        a, e = a[~nan], e[~nan]
        scale = max(float(np.abs(e).max(initial=0)), 1.0)
        tolerance = max(_tolerance(dtype), _tolerance(e_dtype))
        assert float(np.abs(a - e).max(initial=0)) <= tolerance * scale, what


def _value_and_gradient(function, x):
    """``function(x)`` and the gradient of ``sum(function(x) * g)`` for a fixed ``g``, jitted."""
    out = jax.eval_shape(function, x)
    g = jnp.asarray(random(out.shape, np.float32, 99)).astype(out.dtype)
    return jax.jit(lambda x: (function(x), jax.vjp(function, x)[1](g)[0]))(x)


def _same_call(ours, theirs, x, dtype=np.float32, what="", library_bug=False):
    """``ours`` equals ``theirs`` on ``x`` (value, gradient and dtypes), or both raise alike
    (``library_bug``: the library raises where it should not, and ours may answer)."""
    try:
        expected = _value_and_gradient(theirs, x) if jnp.issubdtype(x.dtype, jnp.inexact) else (theirs(x),)
    except Exception as error:  # noqa: BLE001 - the library's own error must be ours too
        if library_bug:
            return
        with pytest.raises(type(error)):
            ours(x)
        return
    actual = _value_and_gradient(ours, x) if jnp.issubdtype(x.dtype, jnp.inexact) else (ours(x),)
    _assert_close(actual, expected, dtype, what)


# ---- jax.image.resize ---------------------------------------------------------------------------

RESIZES = [
    # (shape, new shape, method, antialias, served)
    ((2, 5, 7, 3), (2, 10, 14, 3), "bilinear", True, True),  # NHWC x2
    ((2, 3, 5, 7), (2, 3, 11, 9), "linear", True, True),  # NCHW, any growth
    ((5, 7, 3), (8, 7, 3), "linear", True, True),  # HWC, one axis
    ((2, 5, 7, 3), (2, 5, 7, 6), "linear", True, True),  # the channel axis alone
    ((2, 6, 8, 3), (2, 3, 4, 3), "linear", False, True),  # shrink without antialias
    ((2, 6, 8, 3), (2, 12, 4, 3), "triangle", False, True),
    ((2, 6, 8, 3), (2, 3, 4, 3), "linear", True, False),  # antialias: a wider filter
    ((2, 6, 8, 3), (2, 12, 4, 3), "linear", True, False),
    ((2, 5, 7, 3), (4, 10, 14, 3), "linear", True, False),  # three axes
    ((2, 5, 7, 3), (2, 10, 7, 6), "linear", True, False),  # two axes apart
    ((2, 5, 7, 3), (2, 10, 14, 3), "cubic", True, False),
    ((2, 5, 7, 3), (2, 10, 14, 3), "nearest", True, False),
    ((2, 5, 7, 3), (2, 10, 14), "linear", True, False),  # jax.image.resize's error
    ((2, 5, 7, 3), (2, 10, 14, 3), "sideways", True, False),  # jax.image.resize's error
]


@pytest.mark.covering("antialias", "served")
@pytest.mark.parametrize("shape, new, method, antialias, served", RESIZES, ids=[str(r[:4]) for r in RESIZES])
def test_resize_equals_jax_image_resize(shape, new, method, antialias, served):
    x = jnp.asarray(random(shape, np.float32, 1))
    assert (_upsample._resize_plan(x, new, method, antialias) is not None) == served

    def ours(x):
        return fj.resize(x, new, method, antialias)

    def theirs(x):
        return jax.image.resize(x, new, method, antialias)

    _same_call(ours, theirs, x, what=method)
    if served:
        assert _targets(lambda x: jax.grad(lambda x: jnp.sum(ours(x) ** 2))(x), x) == ["upsample_bilinear2d_backward"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", FLOATS + [np.dtype(np.int32)], ids=str)
def test_resize_dtypes(dtype):
    x = jnp.asarray((random((2, 5, 7, 3), np.float32, 2) * 4).astype(dtype))
    new = (2, 9, 13, 3)
    _same_call(lambda x: fj.resize(x, new, "linear"), lambda x: jax.image.resize(x, new, "linear"), x, dtype)


@pytest.mark.slow
def test_resize_float64():
    with jax.enable_x64(True):
        x = jnp.asarray(random((2, 5, 7, 3), np.float64, 3))
        _same_call(
            lambda x: fj.resize(x, (2, 10, 14, 3), "linear"), lambda x: jax.image.resize(x, (2, 10, 14, 3), "linear"), x
        )


# ---- jnp.pad ------------------------------------------------------------------------------------

PADS = [
    # (shape, pad_width, mode, served)
    ((2, 5, 6, 3), ((0, 0), (1, 1), (1, 1), (0, 0)), "edge", True),
    ((2, 3, 5, 6), ((0, 0), (0, 0), (2, 0), (1, 3)), "edge", True),
    ((5, 6), ((1, 2), (3, 1)), "edge", True),
    ((5, 6), (1, 2), "edge", True),
    ((5, 6), 1, "edge", True),
    ((7,), ((2, 3),), "edge", True),
    ((2, 5, 6, 3), ((0, 0), (4, 0), (0, 0), (0, 0)), "edge", True),
    ((2, 5, 6, 3), ((0, 0), (5, 0), (0, 0), (0, 0)), "edge", False),  # a pad as large as the axis
    ((2, 5, 6, 3), ((1, 1), (1, 1), (0, 0), (0, 0)), "edge", True),
    ((2, 5, 6, 3), ((1, 1), (0, 0), (1, 1), (0, 0)), "edge", False),  # axes apart
    ((2, 5, 6, 3), ((1, 1), (1, 1), (1, 1), (0, 0)), "edge", False),  # three axes
    ((2, 5, 6, 3), ((0, 0), (1, 1), (1, 1), (0, 0)), "reflect", False),
    ((2, 5, 6, 3), ((0, 0), (1, 1), (1, 1), (0, 0)), "constant", False),
    ((2, 5, 6, 3), 0, "edge", False),
    ((2, 5, 6, 3), ((0, 0), (-1, 1), (1, 1), (0, 0)), "edge", False),  # jnp.pad's error
    ((2, 5, 6, 3), ((0, 0), (1, 1)), "edge", False),  # jnp.pad's error
]


@pytest.mark.covering("mode", "served", strength=1)
@pytest.mark.parametrize("shape, pad_width, mode, served", PADS, ids=[str(p[:3]) for p in PADS])
def test_pad_equals_jnp_pad(shape, pad_width, mode, served):
    x = jnp.asarray(random(shape, np.float32, 4))
    assert (mode == "edge" and _pad._edge_plan(x, pad_width) is not None) == served
    _same_call(lambda x: fj.pad(x, pad_width, mode), lambda x: jnp.pad(x, pad_width, mode), x, what=mode)
    if served:
        function = lambda x: jax.grad(lambda x: jnp.sum(fj.pad(x, pad_width, mode) ** 2))(x)  # noqa: E731
        assert _targets(function, x) == ["replication_pad2d_backward"]


@pytest.mark.slow
def test_pad_keywords_and_dtypes():
    x = jnp.asarray(random((2, 5, 6, 3), np.float32, 5))
    widths = ((0, 0), (1, 2), (2, 1), (0, 0))
    _same_call(
        lambda x: fj.pad(x, widths, "constant", constant_values=3.0),
        lambda x: jnp.pad(x, widths, "constant", constant_values=3.0),
        x,
    )
    with pytest.raises(ValueError):  # jnp.pad takes no keywords for mode="edge"
        fj.pad(x, widths, "edge", constant_values=3.0)
    for dtype in FLOATS + [np.dtype(np.complex64), np.dtype(np.int32), np.dtype(bool)]:
        values = jnp.asarray((random(x.shape, np.float32, 6) * 3).astype(dtype))
        assert (np.asarray(fj.pad(values, widths, mode="edge")) == np.asarray(jnp.pad(values, widths, "edge"))).all()
        if jnp.issubdtype(values.dtype, jnp.inexact):
            _same_call(lambda x: fj.pad(x, widths, "edge"), lambda x: jnp.pad(x, widths, "edge"), values, dtype)


# ---- flax.linen.avg_pool ------------------------------------------------------------------------


def _flax_pool_cases():
    shapes = [(2, 9, 10, 3), (9, 10, 3), (2, 2, 7, 8, 3), (2, 11, 4)]
    windows = [(3, 3), (2, 2), (1, 3), (3,), (2,), (4, 3)]
    strides = [None, (1, 1), (2, 2), (2, 1), (1,), (2,)]
    paddings = ["SAME", "VALID", "SAME_LOWER", ((1, 1), (0, 2)), ((0, 1), (1, 1)), ((1, 0),), ((2, 2), (1, 1))]
    for shape, window, stride, padding in itertools.product(shapes, windows, strides, paddings):
        if stride is not None and len(stride) != len(window):
            continue
        if not isinstance(padding, str) and len(padding) != len(window):
            continue
        if len(shape) >= len(window) + 1:
            yield shape, window, stride, padding


FLAX_POOLS = list(_flax_pool_cases())


@pytest.mark.slow
@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("shape, window, strides, padding", FLAX_POOLS, ids=[str(c) for c in FLAX_POOLS])
def test_avg_pool_equals_flax_avg_pool_everywhere(shape, window, strides, padding, count_include_pad):
    nn = pytest.importorskip("flax.linen")
    x = jnp.asarray(random(shape, np.float32, 7))
    # Flax 0.12 pads one batch axis only when given explicit pads: with more it raises
    library_bug = not isinstance(padding, str) and len(shape) - len(window) - 1 > 1
    _same_call(
        lambda x: fj.avg_pool(x, window, strides, padding, count_include_pad),
        lambda x: nn.avg_pool(x, window, strides, padding, count_include_pad),
        x,
        library_bug=library_bug,
    )


POOLS = [
    # (shape, window, strides, padding, served)
    ((2, 9, 10, 3), (3, 3), (1, 1), "SAME", True),  # the self-adjoint kernel forward
    ((2, 9, 10, 3), (3, 3), (2, 2), "SAME", True),  # (0, 1) padding: ceil_mode
    ((2, 9, 10, 3), (2, 2), (1, 1), "SAME", True),  # (0, 1) padding, stride 1: cut
    ((2, 9, 10, 3), (2, 2), None, "VALID", True),
    ((2, 11, 4), (3,), (2,), "SAME", True),  # 1-D
    ((9, 10, 3), (3, 3), (1, 1), ((1, 1), (1, 0)), True),  # unbatched
    ((9, 10, 3), (3, 3), (1, 1), ((1, 1), (0, 2)), False),  # a window of 2 pads: beyond PyTorch's
    ((2, 9, 10, 3), (3, 3), (1, 1), ((2, 2), (1, 1)), False),  # a pad beyond half the window
    ((2, 4, 5, 6, 3), (2, 2, 2), None, "VALID", False),  # 3-D windows
    ((2, 9, 10, 3), (3, 3), (1, 1), "WHATEVER", False),  # Flax's error
]


@pytest.mark.covering("served", "count_include_pad")
@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("shape, window, strides, padding, served", POOLS, ids=[str(p[:4]) for p in POOLS])
def test_avg_pool_equals_flax_avg_pool(shape, window, strides, padding, served, count_include_pad):
    nn = pytest.importorskip("flax.linen")
    x = jnp.asarray(random(shape, np.float32, 8))
    assert (_avg_pool._flax_plan(x, window, strides, padding) is not None) == served

    def ours(x):
        return fj.avg_pool(x, window, strides, padding, count_include_pad)

    _same_call(ours, lambda x: nn.avg_pool(x, window, strides, padding, count_include_pad), x)
    if served:
        targets = _targets(lambda x: jax.grad(lambda x: jnp.sum(ours(x) ** 2))(x), x)
        assert "avg_pool2d_backward" in targets


@pytest.mark.slow
@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_avg_pool_dtypes_as_flax(dtype, count_include_pad):
    """Flax's dtype too: count_include_pad=False divides by a float32 count (float32 results)."""
    nn = pytest.importorskip("flax.linen")
    x = jnp.asarray(random((2, 9, 10, 3), np.float32, 9).astype(dtype))
    _same_call(
        lambda x: fj.avg_pool(x, (3, 3), (1, 1), "SAME", count_include_pad),
        lambda x: nn.avg_pool(x, (3, 3), (1, 1), "SAME", count_include_pad),
        x,
        dtype,
    )


def test_avg_pool_without_flax_is_flax_formula():
    """The fallback of fastbwd.jax.avg_pool, Flax's formula (no Flax needed), equals Flax."""
    nn = pytest.importorskip("flax.linen")
    x = jnp.asarray(random((2, 4, 5, 6, 3), np.float32, 10))
    for include in (True, False):
        assert bool(
            (
                _avg_pool._flax_formula(x, (2, 2, 2), None, "SAME", include)
                == nn.avg_pool(x, (2, 2, 2), None, "SAME", include)
            ).all()
        )


# ---- the libraries' GroupNorm -------------------------------------------------------------------


def _linen_pair(x, swish, **fields):
    """Flax's ``nn.GroupNorm(**fields)`` (with ``nn.swish``) and fastbwd's, their parameters."""
    nn = pytest.importorskip("flax.linen")
    pytest.importorskip("fastbwd.jax.linen")
    theirs = nn.GroupNorm(**fields)
    params = theirs.init(jax.random.key(0), x)
    params = jax.tree_util.tree_map(lambda p: p + jnp.asarray(random(p.shape, np.float32, 11)).astype(p.dtype), params)

    def plain(params, x):
        out = theirs.apply(params, x)
        return nn.swish(out) if swish else out

    ours = fj.linen.GroupNorm(swish=swish, **fields)
    assert jax.tree_util.tree_structure(ours.init(jax.random.key(0), x)) == jax.tree_util.tree_structure(params)
    return plain, lambda params, x: ours.apply(params, x), params


LINEN = [
    # (x shape, x dtype, fields)
    ((2, 5, 6, 8), np.float32, dict(num_groups=4)),
    ((2, 5, 6, 8), np.float32, dict(num_groups=None, group_size=2, epsilon=1e-3)),
    ((2, 5, 6, 8), np.float32, dict(num_groups=2, use_scale=False, use_bias=False)),
    ((2, 5, 6, 8), np.float32, dict(num_groups=4, use_fast_variance=False)),
    ((2, 5, 6, 8), BF16, dict(num_groups=4)),  # float32 parameters: a float32 result
    ((2, 5, 6, 8), BF16, dict(num_groups=4, param_dtype=BF16)),
    ((2, 5, 6, 8), np.float32, dict(num_groups=4, dtype=BF16)),
    ((2, 5, 6, 8), np.float16, dict(num_groups=4, dtype=np.float16, param_dtype=np.float16)),
    ((3, 8), np.float32, dict(num_groups=2)),
    ((2, 3, 4, 5, 8), np.float32, dict(num_groups=4)),
    ((2, 5, 6, 8), np.float32, dict(num_groups=4, reduction_axes=(1, 2, 3))),
    ((2, 5, 6, 8), np.float32, dict(num_groups=4, reduction_axes=(2, 3))),  # Flax's own code
    ((1, 2, 2, 4002), np.float32, dict(num_groups=1)),  # 4002-channel groups: Flax's own code
    ((2, 5, 6, 8), np.float32, dict(num_groups=4, force_float32_reductions=False)),
    ((2, 5, 6, 8), BF16, dict(num_groups=4, param_dtype=BF16, force_float32_reductions=False)),  # Flax's
]


@pytest.mark.covering("dtype", "swish", strength=1)
@pytest.mark.parametrize("swish", [False, True])
@pytest.mark.parametrize("shape, dtype, fields", LINEN, ids=[f"{s}-{np.dtype(d)}-{f}" for s, d, f in LINEN])
def test_linen_group_norm_equals_flax(shape, dtype, fields, swish):
    x = jnp.asarray(random(shape, np.float32, 12).astype(dtype))
    plain, ours, params = _linen_pair(x, swish, **fields)
    dtype = fields.get("dtype") or dtype  # Flax's swish runs in its result dtype
    step = jax.jit(
        jax.grad(lambda p, x, f: jnp.sum(f(p, x).astype(jnp.float32) ** 2), argnums=(0, 1)), static_argnums=2
    )
    _assert_close(jax.jit(ours)(params, x), jax.jit(plain)(params, x), dtype)
    _assert_close(step(params, x, ours), step(params, x, plain), dtype)


def test_linen_group_norm_mask_and_errors_are_flax_own():
    nn = pytest.importorskip("flax.linen")
    pytest.importorskip("fastbwd.jax.linen")
    x = jnp.asarray(random((2, 5, 6, 8), np.float32, 13))
    mask = jnp.asarray(random((2, 5, 6, 8), np.float32, 14) > 0)
    params = nn.GroupNorm(4).init(jax.random.key(0), x)
    expected = nn.GroupNorm(4).apply(params, x, mask=mask)
    assert bool((fj.linen.GroupNorm(4).apply(params, x, mask=mask) == expected).all())
    for fields in (dict(num_groups=3), dict(num_groups=4, group_size=2)):
        with pytest.raises(ValueError):
            nn.GroupNorm(**fields).init(jax.random.key(0), x)
        with pytest.raises(ValueError):
            fj.linen.GroupNorm(**fields).init(jax.random.key(0), x)


NNX = [
    ((2, 5, 6, 8), np.float32, dict(num_groups=4)),
    ((2, 5, 6, 8), np.float32, dict(num_groups=None, group_size=4, epsilon=1e-2, use_bias=False)),
    ((2, 5, 6, 8), BF16, dict(num_groups=4)),
    ((2, 5, 6, 8), BF16, dict(num_groups=4, param_dtype=BF16, dtype=BF16)),
    ((3, 8), np.float32, dict(num_groups=2)),
    ((2, 5, 6, 8), np.float32, dict(num_groups=4, reduction_axes=(2, 3))),  # NNX's own code
    ((1, 2, 2, 4002), np.float32, dict(num_groups=1)),  # 4002-channel groups: NNX's own code
]


@pytest.mark.covering("swish", strength=1)
@pytest.mark.parametrize("swish", [False, True])
@pytest.mark.parametrize("shape, dtype, fields", NNX, ids=[f"{s}-{np.dtype(d)}-{f}" for s, d, f in NNX])
def test_nnx_group_norm_equals_flax(shape, dtype, fields, swish):
    nnx = pytest.importorskip("flax.nnx")
    pytest.importorskip("fastbwd.jax.nnx")
    x = jnp.asarray(random(shape, np.float32, 15).astype(dtype))
    theirs = nnx.GroupNorm(shape[-1], rngs=nnx.Rngs(0), **fields)
    ours = fj.nnx.GroupNorm(shape[-1], rngs=nnx.Rngs(0), swish=swish, **fields)
    for module in (theirs, ours):
        for name in ("scale", "bias"):
            if getattr(module, name):
                getattr(module, name)[...] += jnp.asarray(random((shape[-1],), np.float32, 16)).astype(
                    getattr(module, name)[...].dtype
                )

    def plain(module, x):
        out = nnx.GroupNorm.__call__(module, x)
        return nnx.swish(out) if swish else out

    def loss(function):
        return nnx.jit(nnx.grad(lambda m, x: jnp.sum(function(m, x).astype(jnp.float32) ** 2), argnums=(0, 1)))

    _assert_close(ours(x), plain(theirs, x), dtype)
    _assert_close(
        jax.tree_util.tree_leaves(loss(lambda m, x: m(x))(ours, x)),
        jax.tree_util.tree_leaves(loss(plain)(theirs, x)),
        dtype,
    )


EQUINOX = [
    ((8, 5, 6), np.float32, dict(groups=4)),
    ((8, 5, 6), np.float32, dict(groups=2, eps=1e-3, channelwise_affine=False)),
    ((8, 30), np.float32, dict(groups=8)),
    ((8,), np.float32, dict(groups=4)),
    ((8, 5, 6), BF16, dict(groups=4)),
    ((8, 5, 6), np.float16, dict(groups=4, dtype=np.float16)),
    ((8, 5, 6), np.int32, dict(groups=4)),  # Equinox's own code
    ((4002, 2), np.float32, dict(groups=1)),  # 4002-channel groups: Equinox's own code
]


@pytest.mark.covering("swish", strength=1)
@pytest.mark.parametrize("swish", [False, True])
@pytest.mark.parametrize("shape, dtype, fields", EQUINOX, ids=[f"{s}-{np.dtype(d)}-{f}" for s, d, f in EQUINOX])
def test_equinox_group_norm_equals_equinox_under_vmap(shape, dtype, fields, swish):
    eqx = pytest.importorskip("equinox")
    pytest.importorskip("fastbwd.jax.equinox")
    channels = shape[0]
    theirs = eqx.nn.GroupNorm(channels=channels, **fields)
    if theirs.weight is not None:
        theirs = eqx.tree_at(
            lambda m: (m.weight, m.bias),
            theirs,
            (
                theirs.weight + jnp.asarray(random((channels,), np.float32, 17)).astype(theirs.weight.dtype),
                theirs.bias + 1,
            ),
        )
    ours = fj.equinox.GroupNorm(channels=channels, swish=swish, **fields)
    ours = eqx.tree_at(lambda m: (m.weight, m.bias), ours, (theirs.weight, theirs.bias), is_leaf=lambda n: n is None)
    x = jnp.asarray((random((3,) + shape, np.float32, 18) * 3).astype(dtype))

    def plain(module, x):
        out = eqx.nn.GroupNorm.__call__(module, x)
        return jax.nn.silu(out) if swish else out

    if not jnp.issubdtype(x.dtype, jnp.inexact):  # an integer result: jax.nn.silu refuses it
        if not swish:
            assert bool((jax.vmap(ours)(x) == jax.vmap(lambda x: plain(theirs, x))(x)).all())
        return
    _assert_close(jax.vmap(ours)(x), jax.vmap(lambda x: plain(theirs, x))(x), dtype)

    def loss(module, x, function):
        return jnp.sum(jax.vmap(lambda x: function(module, x))(x).astype(jnp.float32) ** 2)

    grads = eqx.filter_jit(eqx.filter_grad(loss))
    _assert_close(
        jax.tree_util.tree_leaves(grads(ours, x, lambda m, x: m(x))),
        jax.tree_util.tree_leaves(grads(theirs, x, plain)),
        dtype,
    )
    state = object()
    assert jax.vmap(lambda x: ours(x, state)[0])(x).shape == x.shape and ours(x[0], state)[1] is state


def test_equinox_vmap_runs_the_forward_once_and_the_backward_per_element(monkeypatch):
    """An unbatched weight and bias: one forward call on the whole batch; each element's
    weight and bias gradients: one backward call each."""
    eqx = pytest.importorskip("equinox")
    pytest.importorskip("fastbwd.jax.equinox")
    forwards, backwards = [], []
    forward, backward = gns_api.run_forward, gns_api.run

    def spy_forward(plan, x, *args):
        forwards.append(x.shape)
        return forward(plan, x, *args)

    def spy_backward(plan, dy, *args):
        backwards.append(dy.shape)
        return backward(plan, dy, *args)

    monkeypatch.setattr(gns_api, "run_forward", spy_forward)
    monkeypatch.setattr(gns_api, "run", spy_backward)
    module = fj.equinox.GroupNorm(4, 8, swish=True)
    x = jnp.asarray(random((5, 8, 3, 4), np.float32, 19))
    jax.block_until_ready(eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2)))(module, x))
    assert forwards == [(5, 8, 3, 4)]
    assert backwards == [(1, 8, 3, 4)] * 5


# ---- fastbwd.jax.reach ----------------------------------------------------------------------------


def _linen_decoder():
    nn = pytest.importorskip("flax.linen")

    class Decoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.swish(nn.GroupNorm(num_groups=4)(x))
            h = nn.Conv(8, (3, 3))(h)
            n, height, width, channels = h.shape
            h = jax.image.resize(h, (n, 2 * height, 2 * width, channels), "bilinear")
            h = nn.avg_pool(h, (3, 3), (1, 1), "SAME")
            h = jnp.pad(h, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
            h = nn.Conv(8, (3, 3), padding="VALID")(h)
            h = nn.GroupNorm(num_groups=2)(h)  # alone
            return nn.Sequential([nn.GroupNorm(num_groups=4), nn.swish])(h)

    return Decoder()


REACHED_DECODER = [
    "group_norm_swish_forward",
    "upsample_bilinear2d_backward",
    "avg_pool2d_backward",
    "group_norm_swish_forward",
    "group_norm_swish_forward",
    "group_norm_swish_backward",
    "group_norm_swish_backward",
    "replication_pad2d_backward",
    "avg_pool2d_backward",
    "group_norm_swish_backward",
]


@pytest.mark.slow
def test_reach_linen_model():
    model = _linen_decoder()
    x = jnp.asarray(random((2, 6, 6, 8), np.float32, 20))
    params = model.init(jax.random.key(0), x)

    def loss(params, x):
        return jnp.sum(model.apply(params, x) ** 2)

    plain = jax.jit(jax.grad(loss, argnums=(0, 1)))
    reached = fj.reach(loss)
    _assert_close(jax.jit(jax.grad(reached, argnums=(0, 1)))(params, x), plain(params, x), np.float32)
    assert sorted(_targets(jax.grad(reached, argnums=(0, 1)), params, x)) == sorted(REACHED_DECODER)
    assert _targets(jax.grad(loss, argnums=(0, 1)), params, x) == []
    with fj.reach():  # the context form, and the same parameters from a reached init
        assert jax.tree_util.tree_structure(model.init(jax.random.key(0), x)) == jax.tree_util.tree_structure(params)
        _assert_close(jax.grad(loss, argnums=(0, 1))(params, x), plain(params, x), np.float32)


def test_reach_arguments():
    """A function (Equinox's transformations of one too) is reached; a model is refused, in each
    library (reach never changes a model: give it the function that calls the model)."""
    nn = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    with pytest.raises(TypeError, match=r"Flax linen model \(Dense\).*model\.apply"):
        fj.reach(nn.Dense(3))
    with pytest.raises(TypeError, match=r"Flax NNX model \(Linear\)"):
        fj.reach(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"Equinox model \(GroupNorm\)"):
        fj.reach(eqx.nn.GroupNorm(2, 4))
    with pytest.raises(TypeError, match="expected a function"):
        fj.reach(3)
    x = jnp.asarray(random((2, 5, 6), np.float32, 40))

    def function(x):
        return jnp.pad(x, ((1, 1), (1, 1), (0, 0)), mode="edge")

    for wrapped in (eqx.filter_jit(function), eqx.Partial(function), nnx.jit(function)):
        reached = fj.reach(wrapped)
        assert bool((reached(x) == function(x)).all())
        assert _targets(jax.grad(lambda x, f=reached: jnp.sum(f(x) ** 2)), x) == ["replication_pad2d_backward"]


def test_reach_nnx_model():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.GroupNorm(8, num_groups=4, rngs=rngs)
            self.conv = nnx.Conv(8, 8, (3, 3), rngs=rngs)
            self.tail = nnx.Sequential(nnx.GroupNorm(8, num_groups=2, rngs=rngs), nnx.swish)

        def __call__(self, x):
            h = self.conv(nnx.swish(self.norm(x)))
            h = jax.image.resize(h, (h.shape[0], 2 * h.shape[1], 2 * h.shape[2], h.shape[3]), "bilinear")
            h = nnx.avg_pool(h, (3, 3), (1, 1), "SAME")
            return self.tail(jnp.pad(h, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge"))

    x = jnp.asarray(random((2, 6, 6, 8), np.float32, 21))
    model = Block(nnx.Rngs(0))
    classes = [type(node) for _, node in nnx.iter_graph(model)]
    layers = list(model.tail.layers)

    def loss(model, x):
        return jnp.sum(model(x) ** 2)

    expected = nnx.jit(nnx.grad(loss))(model, x)
    reached = nnx.jit(nnx.grad(fj.reach(loss)))(model, x)
    _assert_close(
        jax.tree_util.tree_leaves(nnx.state(reached)), jax.tree_util.tree_leaves(nnx.state(expected)), np.float32
    )
    assert [type(node) for _, node in nnx.iter_graph(model)] == classes  # nothing of the model changed
    assert type(model) is Block and all(a is b for a, b in zip(model.tail.layers, layers, strict=True))
    graph, state = nnx.split(model)
    targets = _targets(lambda s, x: jax.grad(lambda s: fj.reach(loss)(nnx.merge(graph, s), x))(s), state, x)
    assert sorted(set(targets)) == [
        "avg_pool2d_backward",
        "group_norm_swish_backward",
        "group_norm_swish_forward",
        "replication_pad2d_backward",
        "upsample_bilinear2d_backward",
    ]
    assert targets.count("group_norm_swish_forward") == 2  # each pair fused, nothing unfused left
    assert _targets(lambda s, x: jax.grad(lambda s: loss(nnx.merge(graph, s), x))(s), state, x) == []


@pytest.mark.slow
def test_reach_equinox_model():
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        norm: eqx.nn.GroupNorm
        conv: eqx.nn.Conv2d
        tail: eqx.nn.Sequential
        pool: eqx.nn.AvgPool2d

        def __init__(self, key):
            self.norm = eqx.nn.GroupNorm(4, 8)
            self.conv = eqx.nn.Conv2d(8, 8, 3, padding=1, key=key)
            self.tail = eqx.nn.Sequential([eqx.nn.GroupNorm(2, 8), eqx.nn.Lambda(jax.nn.silu)])
            self.pool = eqx.nn.AvgPool2d(3, 1, 1)

        def __call__(self, x):
            h = self.conv(jax.nn.silu(self.norm(x)))
            h = jax.image.resize(h, (h.shape[0], 2 * h.shape[1], 2 * h.shape[2]), "linear")
            h = jnp.pad(self.pool(h), ((0, 0), (1, 1), (1, 1)), mode="edge")
            return self.tail(h)

    model = Block(jax.random.key(0))
    x = jnp.asarray(random((3, 8, 5, 5), np.float32, 22))

    def loss(model, x):
        return jnp.sum(jax.vmap(model)(x) ** 2)

    structure = jax.tree_util.tree_structure(model)
    reached = eqx.filter_jit(eqx.filter_grad(fj.reach(loss)))(model, x)
    expected = eqx.filter_jit(eqx.filter_grad(loss))(model, x)
    _assert_close(jax.tree_util.tree_leaves(reached), jax.tree_util.tree_leaves(expected), np.float32)
    assert jax.tree_util.tree_structure(reached) == jax.tree_util.tree_structure(expected)
    assert jax.tree_util.tree_structure(model) == structure
    assert type(model.norm) is eqx.nn.GroupNorm and type(model.pool) is eqx.nn.AvgPool2d  # unchanged
    params, static = eqx.partition(model, eqx.is_array)
    targets = _targets(lambda p, x: jax.grad(lambda p: fj.reach(loss)(eqx.combine(p, static), x))(p), params, x)
    assert sorted(set(targets)) == [
        "avg_pool2d_backward",
        "group_norm_swish_backward",
        "group_norm_swish_forward",
        "replication_pad2d_backward",
        "upsample_bilinear2d_backward",
    ]
    assert targets.count("group_norm_swish_forward") == 2


EQUINOX_POOLS = [
    # (kernel, stride, padding, use_ceil, served)
    (3, 1, 1, False, True),
    (3, 2, 1, True, True),
    (2, 2, 0, True, True),
    ((3, 2), (2, 1), ((1, 0), (0, 1)), False, True),
    (3, 1, ((2, 1), (1, 1)), False, False),  # a pad beyond half the window: Equinox's own code
    (2, 1, 3, False, False),  # Equinox's error
]


@pytest.mark.covering("served", "dtype", strength=1)
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
@pytest.mark.parametrize(
    "kernel, stride, padding, use_ceil, served", EQUINOX_POOLS, ids=[str(p) for p in EQUINOX_POOLS]
)
def test_equinox_avg_pool_equals_equinox(kernel, stride, padding, use_ceil, served, dtype):
    eqx = pytest.importorskip("equinox")
    pytest.importorskip("fastbwd.jax.equinox")  # a submodule: imported here, not by another test
    theirs = eqx.nn.AvgPool2d(kernel, stride, padding, use_ceil)
    ours = fj.equinox.AvgPool2d(kernel, stride, padding, use_ceil)
    x = jnp.asarray(random((3, 4, 9, 8), np.float32, 30).astype(dtype))

    def run(module):
        return lambda x: jax.vmap(module)(x)

    for reached in (run(ours), fj.reach(run(theirs))):  # fastbwd's module; Equinox's in reach
        _same_call(reached, run(theirs), x, dtype)
        if served:
            assert "avg_pool2d_backward" in _targets(jax.grad(lambda x, f=reached: jnp.sum(f(x) ** 2)), x)


@pytest.mark.slow
def test_reached_calls_fastbwd_cannot_serve_run_the_library():
    """Integer images, a 3-D pooling, an antialiased shrink, a GroupNorm of 5000-channel groups:
    the library's own code, no error."""
    nn = pytest.importorskip("flax.linen")

    class Odd(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.GroupNorm(num_groups=1)(x)
            h = nn.swish(h)
            h = jax.image.resize(h, (h.shape[0], 3, 3, h.shape[3]), "linear")
            h = nn.avg_pool(h[..., None], (2, 2, 2), padding="SAME")[..., 0]
            return jnp.pad(h, 1, mode="edge")

    x = jnp.asarray(random((2, 6, 6, 5000), np.float32, 23))
    model = Odd()
    params = model.init(jax.random.key(0), x)

    def loss(params, x):
        return jnp.sum(model.apply(params, x) ** 2)

    expected = jax.jit(jax.grad(loss))(params, x)
    _assert_close(jax.jit(jax.grad(fj.reach(loss)))(params, x), expected, np.float32)
    assert _targets(jax.grad(fj.reach(loss)), params, x) == []


# ---- forward mode ---------------------------------------------------------------------------------

X = random((2, 4, 6, 6), np.float32, 24)
W, B = random((4,), np.float32, 25), random((4,), np.float32, 26)
FORWARD_MODE = {
    "upsample_bilinear2d": (
        lambda x: fj.upsample_bilinear2d(x, (11, 12)),
        lambda x: jax.image.resize(x, (2, 4, 11, 12), "linear"),
    ),
    "avg_pool2d-same": (lambda x: fj.avg_pool2d(x, 3, 1, 1), None),
    "avg_pool2d-nhwc": (lambda x: fj.avg_pool2d(x, 3, 2, 1, layout="NHWC"), None),
    "replication_pad2d": (
        lambda x: fj.replication_pad2d(x, (1, 2, 0, 1)),
        lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 1), (1, 2)), mode="edge"),
    ),
    "roi_align": (lambda x: fj.roi_align(x, jnp.asarray([[0, 0.5, 0.5, 4.0, 5.0], [1, 1.0, 0.0, 5.5, 3.0]]), 3), None),
    "group_norm_swish": (lambda x: fj.group_norm_swish(x, 2, W, B), None),
    "group_norm": (lambda x: fj.group_norm_swish(x, 2, W, B, activate_swish=False), None),
}


@pytest.mark.parametrize(
    "name",
    [name if name == "replication_pad2d" else pytest.param(name, marks=pytest.mark.slow) for name in FORWARD_MODE],
)
def test_forward_mode(name):
    """jax.jvp (eager and jitted) agrees with the reverse-mode gradient (<jvp(t), g> equals
    <t, vjp(g)>) and with JAX's own derivative where JAX has the operator; jacfwd runs."""
    function, theirs = FORWARD_MODE[name]
    x = jnp.asarray(X)
    t = jnp.asarray(random(X.shape, np.float32, 27))
    y, ty = jax.jvp(function, (x,), (t,))
    _assert_close(jax.jit(lambda x, t: jax.jvp(function, (x,), (t,)))(x, t), (y, ty), np.float32)
    g = jnp.asarray(random(y.shape, np.float32, 28))
    (gx,) = jax.vjp(function, x)[1](g)
    assert abs(float(jnp.vdot(ty, g)) - float(jnp.vdot(t, gx))) <= 1e-4 * float(jnp.abs(ty).sum() * jnp.abs(g).max())
    if theirs is not None:
        _assert_close(ty, jax.jvp(theirs, (x,), (t,))[1], np.float32)
    assert jax.jacfwd(lambda x: jnp.sum(function(x) ** 2))(x).shape == x.shape
    if name != "roi_align":  # its boxes name images of the batch
        vmapped = jax.vmap(lambda x, t: jax.jvp(function, (x,), (t,))[1])(x[:, None], t[:, None])
        _assert_close(vmapped[:, 0], ty, np.float32)


LINEAR = ["upsample_bilinear2d", "avg_pool2d-same", "avg_pool2d-nhwc", "replication_pad2d", "roi_align"]


@pytest.mark.parametrize(
    "name", [name if name == "roi_align" else pytest.param(name, marks=pytest.mark.slow) for name in LINEAR]
)
def test_second_derivatives_of_linear_operators(name):
    """jax.jvp of jax.grad (a Hessian-vector product), jitted and vmapped, and jax.grad of
    jax.grad through a linear operator f: for sum(sin(f(x))) the product is
    f^T(-sin(f(x)) * f(t)), built here from f's own first derivatives (each tested against
    the library above), and JAX's own Hessian product where JAX has the operator."""
    function, theirs = FORWARD_MODE[name]
    x, t = jnp.asarray(X), jnp.asarray(random(X.shape, np.float32, 29))

    def loss(f):
        return lambda x: jnp.sum(jnp.sin(f(x)))

    def hvp(f, x, t):
        return jax.jvp(jax.grad(loss(function)), (x,), (t,))[1]

    y, transpose = jax.vjp(function, x)
    expected = transpose(-jnp.sin(y) * jax.jvp(function, (x,), (t,))[1])[0]
    _assert_close(jax.jit(hvp, static_argnums=0)(function, x, t), expected, np.float32)
    if theirs is not None:
        _assert_close(jax.jvp(jax.grad(loss(theirs)), (x,), (t,))[1], expected, np.float32)
    batched = jax.jit(jax.vmap(lambda t: hvp(function, x, t)))(jnp.stack([t, 2 * t]))
    _assert_close(batched, jnp.stack([expected, 2 * expected]), np.float32)
    # reverse over reverse: the gradient of <grad(x), t> is the same product (the Hessian is symmetric)
    reverse = jax.jit(jax.grad(lambda x: jnp.vdot(jax.grad(loss(function))(x), t)))(x)
    _assert_close(reverse, expected, np.float32)


@pytest.mark.parametrize("name", ["group_norm_swish", "group_norm"])
def test_second_derivatives_of_group_norm_name_the_function(name):
    """GroupNorm is not linear: its gradient's own derivative would differentiate fastbwd's
    kernels, and the error names the function (JAX's would name an FFI target)."""
    function = FORWARD_MODE[name][0]
    x = jnp.asarray(X)
    message = r"^fastbwd.jax.group_norm_swish: fastbwd's kernels are not differentiable"
    with pytest.raises(TypeError, match=message):
        jax.jvp(jax.grad(lambda x: jnp.sum(jnp.sin(function(x)))), (x,), (x,))
    with pytest.raises(TypeError, match=message):
        jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(function(x))))(x))))(x)


def test_fastbwd_import_does_not_import_the_libraries():
    code = "import fastbwd.jax, sys; print('flax' in sys.modules, 'equinox' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == ["False", "False"], result.stderr
