"""fastbwd.jax.reach: models written for Flax (linen, NNX) and Equinox reach fastbwd's kernels
without a change to their code (docs/jax.md).

While a program is traced under :func:`reach`:

* the library functions fastbwd serves are fastbwd's drop-ins, which equal them and run the
  library's own code for any call they cannot serve: ``jax.image.resize``, ``jnp.pad``,
  ``flax.linen.avg_pool`` (also ``flax.nnx.avg_pool``), and the swish/SiLU functions
  (``jax.nn.silu``/``swish`` and their Flax aliases), by setting the modules' attributes for
  the duration (so a model that calls ``jnp.pad(...)`` or ``nn.avg_pool(...)`` reaches them;
  a name imported before, ``from jax.numpy import pad``, is not reached);
* a Flax linen ``nn.GroupNorm`` runs on fastbwd (``nn.intercept_methods``), and so does an
  ``nn.Sequential``'s swish;
* a swish applied to the output of a GroupNorm fastbwd computed becomes one fused GroupNorm +
  Swish (the GroupNorm's own result, then unused, is dropped by XLA).

An NNX or Equinox model given to :func:`reach` has its GroupNorm modules (Equinox: and its
``AvgPool2d`` modules; and an ``nnx.Sequential``'s or ``eqx.nn.Sequential``'s swish) replaced by
fastbwd's, and its own ``__call__`` runs under :func:`reach`.
"""

import contextlib
import functools
import sys
import threading
import types
import weakref

import jax

from . import _avg_pool, _pad, _upsample
from . import _group_norm_swish as gns

# ---- a swish of a GroupNorm's output: the fused pair --------------------------------------------

_pairs = threading.local()  # .table: {id(output): (weakref to output, fused)}


def remember_group_norm(output, fused):
    """``output``, a GroupNorm result fastbwd computed, with ``fused()``, the same GroupNorm
    followed by Swish as one call: :func:`swish` of ``output`` returns ``fused()``."""
    table = getattr(_pairs, "table", None)
    if table is None:
        table = _pairs.table = {}
    key = id(output)
    try:
        reference = weakref.ref(output, lambda _: table.pop(key, None))
    except TypeError:  # pragma: no cover - every JAX array and tracer takes weak references
        return output
    table[key] = (reference, fused)
    return output


def _fused(x):
    entry = getattr(_pairs, "table", {}).get(id(x))
    if entry is not None and entry[0]() is x:
        return entry[1]
    return None


silu = jax.nn.silu  # the original, whatever reach later sets as jax.nn.silu


@functools.wraps(silu)
def swish(x):
    """``jax.nn.silu`` (``swish``): ``x * sigmoid(x)``; of the output of a GroupNorm fastbwd
    computed, the fused GroupNorm + Swish."""
    fused = _fused(x)
    return silu(x) if fused is None else fused()


def group_norm(x, groups, eps, layout, result_dtype, shape, parameters, fallback, with_swish=False):
    """A library's GroupNorm (``with_swish``: followed by Swish) on fastbwd, or its own code.

    ``x``: the input as fastbwd's kernels take it (the library's promotions applied, a batch
    axis added where the library has none); ``shape``: the library's result shape;
    ``parameters(create)``: ``(weight, bias)``, ``create`` telling a Flax linen module to
    create them (``False``: they exist, ``fallback`` made them); ``fallback()``: the library's
    own call. A GroupNorm alone is remembered with its fused pair, for :func:`swish`."""
    fused = gns.servable(x, groups, eps, layout, True)

    def run(weight_and_bias, activate_swish):
        out = gns.library_call(x, *weight_and_bias, groups, eps, layout, activate_swish, result_dtype)
        return out.reshape(shape)

    if with_swish:
        return run(parameters(True), True) if fused else swish(fallback())
    out = run(parameters(True), False) if gns.servable(x, groups, eps, layout, False) else fallback()
    if fused:
        weight_and_bias = parameters(False)
        remember_group_norm(out, lambda: run(weight_and_bias, True))
    return out


# ---- what reach sets while a program is traced ---------------------------------------------------


def _substitutes():
    """``{original function: fastbwd's}`` for every function reach swaps in."""
    table = {
        jax.image.resize: _upsample.resize,
        _pad._jnp_pad: _pad.pad,
        silu: swish,
        jax.nn.swish: swish,
    }
    pooling = sys.modules.get("flax.linen.pooling")
    if pooling is not None:
        table[pooling.avg_pool] = functools.partial(_avg_pool.avg_pool_or, pooling.avg_pool)
    return table


#: The modules whose attributes reach sets (those imported; a library not imported is not used).
_MODULES = (
    "jax.image",
    "jax.numpy",
    "jax.nn",
    "flax.linen",
    "flax.linen.pooling",
    "flax.linen.activation",
    "flax.nnx",
    "flax.nnx.nn.activations",
)

_lock = threading.Lock()
_depth = 0
_swapped = []  # (module, name, original) while _depth > 0


def _install():
    substitutes = _substitutes()
    for module_name in _MODULES:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name, value in list(vars(module).items()):
            substitute = substitutes.get(value) if callable(value) else None
            if substitute is not None:
                _swapped.append((module, name, value))
                setattr(module, name, substitute)


def _uninstall():
    while _swapped:
        module, name, original = _swapped.pop()
        setattr(module, name, original)


@contextlib.contextmanager
def _reaching():
    global _depth
    with _lock:
        if _depth == 0:
            _install()
        _depth += 1
    try:
        with contextlib.ExitStack() as stack:
            linen = sys.modules.get("flax.linen")
            if linen is not None:
                from . import linen as fastbwd_linen

                stack.enter_context(linen.intercept_methods(fastbwd_linen.interceptor))
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _uninstall()


def reach(target=None):
    """Run Flax and Equinox models' GroupNorm, pooling, padding and resizing on fastbwd.

    * ``with fastbwd.jax.reach(): ...``: programs traced inside (``jax.jit``, ``jax.grad``,
      eager calls) reach fastbwd; a ``jax.jit`` function traced before keeps its program.
    * ``fastbwd.jax.reach(function)``: ``function`` (a linen ``model.apply``, a loss, a training
      step) running under ``reach()`` whenever it runs, so whenever JAX traces it.
    * ``fastbwd.jax.reach(model)`` for an NNX module: the same module, its GroupNorm modules
      replaced by fastbwd's and its ``__call__`` run under ``reach()``.
    * ``fastbwd.jax.reach(model)`` for an Equinox module: a new model with the same fields, its
      GroupNorm and AvgPool2d modules replaced by fastbwd's (``eqx.tree_at``) and its
      ``__call__`` run under ``reach()``.

    Everything reached computes what the library computes (docs/jax.md says where it differs
    within float tolerance); a call fastbwd cannot serve runs the library's own code.
    """
    if target is None:
        return _reaching()
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(target, nnx.Module):
        from . import nnx as fastbwd_nnx

        return fastbwd_nnx.reach_model(target)
    equinox = sys.modules.get("equinox")
    if equinox is not None and isinstance(target, equinox.Module):
        from . import equinox as fastbwd_equinox

        return fastbwd_equinox.reach_model(target)
    linen = sys.modules.get("flax.linen")
    if linen is not None and isinstance(target, linen.Module):
        raise TypeError(
            "fastbwd.jax.reach: give a Flax linen model's apply (fastbwd.jax.reach(model.apply)), "
            "or trace it under `with fastbwd.jax.reach():`"
        )
    if not callable(target):
        raise TypeError(f"fastbwd.jax.reach: expected a function, an NNX or an Equinox model, got {target!r}")

    @functools.wraps(target)
    def reached(*args, **kwargs):
        with _reaching():
            return target(*args, **kwargs)

    return reached


@functools.cache
def reached_class(cls):
    """``cls`` with its ``__call__`` run under :func:`reach` (same name and fields): what an NNX or
    Equinox model given to ``reach`` becomes."""

    def __call__(self, *args, **kwargs):
        with reach():
            return cls.__call__(self, *args, **kwargs)

    def body(namespace):
        namespace.update(
            __call__=__call__, __module__=cls.__module__, __qualname__=cls.__qualname__, _fastbwd_reached=True
        )

    return types.new_class(cls.__name__, (cls,), {}, body)
