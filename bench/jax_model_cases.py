"""The JAX rows of issue 47 (bench/jax_cases.py): models written as Flax and Equinox users write
them (bench/models/), reached by one call of ``fastbwd.jax.reach``, and the channels-last drop-ins
against the calls they replace. Every row times ``jax.jit(jax.grad(sum(f(...) ** 2)))``, forward
and backward.

* J7: a Flax linen decoder block (GroupNorm -> swish -> conv -> bilinear x2 -> avg-pool 3x3 ->
  edge pad -> conv, NHWC), ``reach(loss)`` against the plain model; J7a-J7f: each of its layers
  alone on its own input, so the time per layer shows what the convolutions leave to gain (the
  conv rows run the same XLA convolution on both sides).
* J8: an Equinox ResNet block (GroupNorm -> swish -> conv, twice, and the residual) under
  ``jax.vmap``, ``reach(apply)`` against the plain model (the same model and parameters).
* J10: Flax's ``nn.GroupNorm(32)`` + ``nn.swish``, NHWC, reached against Flax's.
* J11: ``fastbwd.jax.avg_pool`` (3x3, stride 1, "SAME") against ``flax.linen.avg_pool`` and
  ``fastbwd.jax.pad`` (edge, 1) against ``jnp.pad``, NHWC.

Rows whose library is not installed are left out.
"""

import importlib.util

import jax
import jax.numpy as jnp

import fastbwd.jax as fj

from .jax_cases import _grad_case, _randn


def _flax_cases(quick):
    import flax.linen as nn

    from .models.flax_decoder import Decoder

    shape = (2, 16, 16, 32) if quick else (8, 64, 64, 64)
    n, height, width, channels = shape
    x = _randn(shape, 71)
    model = Decoder(channels)
    params = model.init(jax.random.key(0), x)
    rows = [
        _grad_case(
            "J7",
            f"Flax decoder block (GroupNorm, swish, conv, bilinear x2, avg-pool 3x3, edge pad, conv), NHWC {shape}",
            fj.reach(model.apply),
            model.apply,
            (params, x),
            ">= 1.3x",
            1e-4,
            1e-5,
        )
    ]

    def conv_case(id, label, input_shape, padding, seed):
        conv = nn.Conv(channels, (3, 3), padding=padding)
        inputs = _randn(input_shape, seed)
        conv_params = conv.init(jax.random.key(1), inputs)
        return _grad_case(id, label, fj.reach(conv.apply), conv.apply, (conv_params, inputs), "report", 1e-4, 1e-5)

    norm = nn.GroupNorm(num_groups=32)
    norm_params = norm.init(jax.random.key(2), x)

    def norm_swish(params, x):
        return nn.swish(norm.apply(params, x))

    up = (n, 2 * height, 2 * width, channels)
    rows += [
        _grad_case(
            "J7a",
            f"J7's GroupNorm + swish alone, {shape}",
            fj.reach(norm_swish),
            norm_swish,
            (norm_params, x),
            "report",
            1e-4,
            1e-5,
        ),
        conv_case("J7b", f"J7's first conv 3x3 alone (XLA's on both sides), {shape}", shape, "SAME", 72),
        _grad_case(
            "J7c",
            f"J7's bilinear x2 alone (jax.image.resize), {shape}",
            lambda x: fj.resize(x, up, "bilinear"),
            lambda x: jax.image.resize(x, up, "bilinear"),
            (_randn(shape, 73),),
            "report",
        ),
        _grad_case(
            "J7d",
            f"J7's avg-pool 3x3 SAME alone (flax.linen.avg_pool), {up}",
            lambda x: fj.avg_pool(x, (3, 3), (1, 1), "SAME"),
            lambda x: nn.avg_pool(x, (3, 3), (1, 1), "SAME"),
            (_randn(up, 74),),
            "report",
        ),
        _grad_case(
            "J7e",
            f"J7's edge pad 1 alone (jnp.pad), {up}",
            lambda x: fj.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge"),
            lambda x: jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge"),
            (_randn(up, 75),),
            "report",
        ),
        conv_case(
            "J7f",
            f"J7's last conv 3x3 VALID alone (XLA's on both sides), {(n, up[1] + 2, up[2] + 2, channels)}",
            (n, up[1] + 2, up[2] + 2, channels),
            "VALID",
            76,
        ),
    ]
    norm_shapes = [(2, 16, 16, 64), (2, 8, 8, 64)] if quick else [(8, 128, 128, 64), (8, 64, 64, 64)]
    for suffix, norm_shape in zip("ab", norm_shapes):
        inputs = _randn(norm_shape, 77)
        rows.append(
            _grad_case(
                "J10" + suffix,
                f"Flax GroupNorm(32) + swish, NHWC {norm_shape}, reached",
                fj.reach(norm_swish),
                norm_swish,
                (norm.init(jax.random.key(3), inputs), inputs),
                ">= 1.5x",
                1e-4,
                1e-5,
            )
        )
    big = (2, 16, 16, 64) if quick else (8, 128, 128, 64)
    edge = ((0, 0), (1, 1), (1, 1), (0, 0))
    rows += [
        _grad_case(
            "J11a",
            f"avg_pool 3x3 stride 1 SAME against flax.linen.avg_pool, NHWC {big}",
            lambda x: fj.avg_pool(x, (3, 3), (1, 1), "SAME"),
            lambda x: nn.avg_pool(x, (3, 3), (1, 1), "SAME"),
            (_randn(big, 78),),
            ">= 2x",
        ),
        _grad_case(
            "J11b",
            f"pad(mode='edge') 1 against jnp.pad, NHWC {big}",
            lambda x: fj.pad(x, edge, mode="edge"),
            lambda x: jnp.pad(x, edge, mode="edge"),
            (_randn(big, 79),),
            ">= 2x",
        ),
    ]
    return rows


def _equinox_cases(quick):
    import equinox as eqx

    from .models.equinox_resnet import ResBlock

    shape = (2, 32, 16, 16) if quick else (8, 64, 64, 64)
    params, static = eqx.partition(ResBlock(shape[1], jax.random.key(4)), eqx.is_array)

    def apply(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    case = _grad_case(
        "J8",
        f"Equinox ResNet block (GroupNorm, swish, conv, twice) under vmap, {shape}",
        fj.reach(apply),
        apply,
        (params, _randn(shape, 81)),
        ">= 1.2x",
        1e-4,
        1e-5,
    )
    return [case]


def cases(quick=False):
    rows = []
    if importlib.util.find_spec("flax") is not None:
        rows += _flax_cases(quick)
    if importlib.util.find_spec("equinox") is not None:
        rows += _equinox_cases(quick)
    return rows
