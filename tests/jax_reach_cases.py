"""Programs written as JAX, Flax and Equinox users write them, with no fastbwd in them, for
tests/test_jax_reach.py: it traces them inside fastbwd.jax.reach (fastbwd's kernels), outside
it while another thread is inside (the libraries' own programs), and in a process that never
imported fastbwd.jax, where :func:`fingerprints` must be the same, bit for bit (run as
``python tests/jax_reach_cases.py`` or :func:`main`, it prints them as JSON). Cases of a library that is not
installed are left out. The libraries are imported here, before any reach, as a program
imports them at its top."""

import hashlib
import importlib.util
import json
import re
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

FLAX = importlib.util.find_spec("flax") is not None
EQUINOX = importlib.util.find_spec("equinox") is not None
if FLAX:
    import flax.linen as nn
    from flax import nnx
if EQUINOX:
    import equinox as eqx

EDGE = ((0, 0), (1, 1), (1, 1), (0, 0))


def _randn(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _up(h):
    """Bilinear x2 of the two axes after the batch (NHWC)."""
    n, height, width, channels = h.shape
    return jax.image.resize(h, (n, 2 * height, 2 * width, channels), "bilinear")


# ---- Flax linen -----------------------------------------------------------------------------------

if FLAX:

    def norm_act(norm, h):  # a helper modules share, as libraries write them
        return nn.swish(norm(h))

    class LinenBlock(nn.Module):
        channels: int

        @nn.compact
        def __call__(self, x, *args, train=False, **kwargs):
            h = nn.Conv(self.channels, (3, 3))(norm_act(nn.GroupNorm(num_groups=4), x))
            if h.shape[1] < 16:  # a branch on shapes
                h = _up(h)
            h = jnp.pad(nn.avg_pool(h, (3, 3), (1, 1), "SAME"), EDGE, mode="edge")
            h = nn.Conv(self.channels, (3, 3), padding="VALID")(h)
            h = nn.GroupNorm(num_groups=2)(h)  # alone
            return nn.Sequential([nn.GroupNorm(num_groups=4), nn.swish])(h)

    class GroupNorm32(nnx.GroupNorm):  # as diffusion code subclasses it: float32 statistics
        def __call__(self, x, *args, **kwargs):
            return super().__call__(x.astype(jnp.float32), *args, **kwargs).astype(x.dtype)

    class NNXBlock(nnx.Module):
        def __init__(self, channels, rngs):
            self.norm = GroupNorm32(channels, num_groups=4, rngs=rngs)
            self.conv = nnx.Conv(channels, channels, (3, 3), rngs=rngs)
            self.tail = nnx.Sequential(nnx.GroupNorm(channels, num_groups=2, rngs=rngs), nnx.swish)

        def __call__(self, x, *args, **kwargs):
            h = self.conv(nnx.silu(self.norm(x)))
            if h.shape[1] < 16:
                h = _up(h)
            h = nnx.avg_pool(h, (3, 3), (1, 1), "SAME")
            return self.tail(jnp.pad(h, EDGE, mode="edge"))


def linen_case():
    model = LinenBlock(8)
    x = _randn((2, 6, 6, 8), 1)
    params = model.init(jax.random.key(0), x)

    def loss(params, x):
        return jnp.sum(model.apply(params, x, train=True) ** 2)

    return loss, (params, x)


def nnx_model():
    return NNXBlock(8, nnx.Rngs(0))


def nnx_case():
    graph, state = nnx.split(nnx_model())

    def loss(state, x):
        return jnp.sum(nnx.merge(graph, state)(x) ** 2)

    return loss, (state, _randn((2, 6, 6, 8), 2))


# ---- Equinox --------------------------------------------------------------------------------------


def swish(x):  # a module-level activation: jax.nn.silu itself does not pickle (a jitted function)
    return jax.nn.silu(x)


if EQUINOX:

    class EquinoxBlock(eqx.Module):  # one example, channels first, batched by vmap
        norm: eqx.nn.GroupNorm
        conv: eqx.nn.Conv2d
        pool: eqx.nn.AvgPool2d
        tail: eqx.nn.Sequential

        def __init__(self, channels, key):
            self.norm = eqx.nn.GroupNorm(4, channels)
            self.conv = eqx.nn.Conv2d(channels, channels, 3, padding=1, key=key)
            self.pool = eqx.nn.AvgPool2d(3, 1, 1)
            self.tail = eqx.nn.Sequential([eqx.nn.GroupNorm(2, channels), eqx.nn.Lambda(swish)])

        def __call__(self, x, *, key=None):
            h = self.conv(jax.nn.silu(self.norm(x)))
            if h.shape[-1] < 16:
                h = jax.image.resize(h, (h.shape[0], 2 * h.shape[1], 2 * h.shape[2]), "linear")
            h = jnp.pad(self.pool(h), ((0, 0), (1, 1), (1, 1)), mode="edge")
            return self.tail(h)


def equinox_model():
    return EquinoxBlock(8, jax.random.key(0))


def equinox_loss(model, x):
    return jnp.sum(jax.vmap(model)(x) ** 2)


def equinox_case():
    params, static = eqx.partition(equinox_model(), eqx.is_array)

    def loss(params, x):
        return equinox_loss(eqx.combine(params, static), x)

    return loss, (params, _randn((3, 8, 5, 5), 3))


# ---- the library functions alone ------------------------------------------------------------------


def function_cases():
    x = _randn((2, 5, 6, 4), 4)
    cases = {
        "jnp.pad": (lambda x: jnp.sum(jnp.pad(x, EDGE, mode="edge") ** 2), (x,)),
        "jax.image.resize": (lambda x: jnp.sum(_up(x) ** 2), (x,)),
        "jax.nn.silu": (lambda x: jnp.sum(jax.nn.silu(x) ** 2), (x,)),
    }
    if FLAX:
        cases["nn.avg_pool"] = (lambda x: jnp.sum(nn.avg_pool(x, (3, 3), (1, 1), "SAME") ** 2), (x,))
        cases["nnx.avg_pool"] = (lambda x: jnp.sum(nnx.avg_pool(x, (2, 2), (2, 2)) ** 2), (x,))
    return cases


#: Every case's name, whichever libraries are installed (:func:`case` skips one whose library is not);
#: the models first (a quick set's cover of the libraries takes the first case of each).
NAMES = ["linen", "nnx", "equinox", "jnp.pad", "jax.image.resize", "jax.nn.silu", "nn.avg_pool", "nnx.avg_pool"]


def case(name):
    """``(loss, args)`` of one case of :data:`NAMES`; skips (pytest) when its library is not installed."""
    functions = function_cases()  # the library functions this process has
    if name in functions:
        return functions[name]
    made = {"linen": (FLAX, linen_case), "nnx": (FLAX, nnx_case), "equinox": (EQUINOX, equinox_case)}
    if name in made and made[name][0]:
        return made[name][1]()
    import pytest

    pytest.skip(f"{name}: its library (Flax or Equinox) is not installed")


def cases():
    """``{name: (loss, args)}``: a scalar loss and its arguments; its gradient is the program."""
    found = function_cases()
    if FLAX:
        found["linen"] = linen_case()
        found["nnx"] = nnx_case()
    if EQUINOX:
        found["equinox"] = equinox_case()
    return found


def _digest(text):
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:16]


def program(loss, args):
    """``(jaxpr, lowered text with source locations, compiled text, gradient's bytes, fastbwd
    targets)`` of ``jax.jit(jax.grad(loss))(*args)``."""
    gradient = jax.grad(loss)
    lowered = jax.jit(gradient).lower(*args)
    compiled = lowered.compile()
    result = compiled(*args)
    text = compiled.as_text()
    values = b"".join(np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(result))
    targets = re.findall(r'custom_call_target="fastbwd_(\w+)"', text)
    return str(jax.make_jaxpr(gradient)(*args)), lowered.as_text(debug_info=True), text, values, targets


def fingerprints():
    """``{case: {part: digest}}`` of every case's program, and the fastbwd targets in it."""
    found = {}
    for name, (loss, args) in cases().items():
        jaxpr, lowered, compiled, values, targets = program(loss, args)
        found[name] = dict(
            jaxpr=_digest(jaxpr), lowered=_digest(lowered), compiled=_digest(compiled), values=_digest(values)
        )
        found[name]["targets"] = targets
    return found


def in_a_thread(function):
    """``function()`` run in a new thread: its programs' source locations (the user's frames JAX
    records) are then this file's lines, whoever calls this."""
    result = []
    thread = threading.Thread(target=lambda: result.append(function()))
    thread.start()
    thread.join()
    return result[0]


def main():
    """Print this process's fingerprints (computed in a new thread) as JSON, and whether
    fastbwd.jax was imported."""
    result = in_a_thread(fingerprints)
    print(json.dumps(dict(fingerprints=result, fastbwd_imported="fastbwd.jax" in sys.modules)))


if __name__ == "__main__":
    main()
