"""The JAX-bridge benchmark cases (bench/bench_jax.py and ``python3 -m bench``).

Each case builds, at full size (or ``quick`` small size), zero-argument callables over the same
arrays: ``fastbwd``, ``jax.jit(jax.grad(loss))`` with the operator from :mod:`fastbwd.jax` (or
the model reached by ``fastbwd.jax.reach``), and ``jax``, the same loss on the same forward
differentiated by JAX itself, or the library's model as it is (None for RoIAlign, which JAX
lacks); ``check()`` runs both once and asserts that their gradients agree.

A user's loss uses the forward's value, so every row but the ``b`` ones times forward and
backward: the loss is ``sum(f(x) ** 2)``. The ``b`` rows (J1b-J6b, issue 15's and 39's targets)
keep the linear loss ``sum(f(x) * g)`` with a fixed random ``g``, whose gradient is the
operator's backward applied to ``g``: XLA drops the forward, and the row times the backward
alone. Only imported where jax is installed.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import fastbwd.jax as fj
from fastbwd.jax import _avg_pool, _group_norm_swish, _upsample

from .inputs import roi_boxes


@dataclass
class JaxCase:
    id: str
    label: str
    fastbwd: Callable[[], object]
    jax: Callable[[], object] | None
    check: Callable[[], None]
    target: str
    note: str = ""


def _randn(shape, seed, dtype=np.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _ready(function, *args):
    """``function(*args)`` run to completion (JAX dispatches asynchronously)."""

    def run():
        return jax.block_until_ready(function(*args))

    return run


def _assert_close(actual, expected, rtol, atol, what):
    """Each gradient within ``rtol`` of its own largest value, or ``atol`` of the largest of all."""
    actual = [np.asarray(a, np.float64) for a in jax.tree_util.tree_leaves(actual)]
    expected = [np.asarray(e, np.float64) for e in jax.tree_util.tree_leaves(expected)]
    overall = max(float(np.abs(e).max()) for e in expected)
    for index, (a, e) in enumerate(zip(actual, expected)):
        scale = float(np.abs(e).max())
        error = float(np.abs(a - e).max())
        assert error <= max(rtol * scale, atol * overall), (
            f"{what}: gradient {index} max error {error:.3g} (its scale {scale:.3g}, overall {overall:.3g})"
        )


def _backward_case(id, label, ours, plain, x_shape, target, seed, rtol=2e-5, atol=2e-6, extra=()):
    """Backward only: ``jax.grad`` of ``sum(f(x, *extra) * g)`` for the fastbwd.jax operator
    ``ours`` and the same forward ``plain`` differentiated by JAX, with respect to x and
    ``extra``. Every array is an argument of the jitted function (a captured one would be a
    constant that XLA may fold)."""
    x = _randn(x_shape, seed)
    g = _randn(jax.eval_shape(ours, x, *extra).shape, seed + 1)
    argnums = tuple(range(1 + len(extra)))

    def loss(f):
        return jax.jit(jax.grad(lambda *args: jnp.sum(f(*args[:-1]) * args[-1]), argnums=argnums))

    ours_grad, plain_grad = loss(ours), loss(plain)

    def check():
        _assert_close(ours_grad(x, *extra, g), plain_grad(x, *extra, g), rtol, atol, id)

    return JaxCase(id, label, _ready(ours_grad, x, *extra, g), _ready(plain_grad, x, *extra, g), check, target)


def _grad_case(id, label, ours, plain, args, target, rtol=2e-5, atol=2e-6):
    """Forward + backward: ``jax.grad`` of ``sum(f(*args) ** 2)`` with respect to every argument,
    for ``ours`` (fastbwd.jax) and ``plain`` (JAX or the library alone), on the same ``args``,
    which may hold pytrees (a model's parameters)."""
    argnums = tuple(range(len(args)))

    def step(f):
        return jax.jit(jax.grad(lambda *args: jnp.sum(f(*args) ** 2), argnums=argnums))

    ours_grad, plain_grad = step(ours), step(plain)

    def check():
        _assert_close(ours_grad(*args), plain_grad(*args), rtol, atol, id)

    return JaxCase(id, label, _ready(ours_grad, *args), _ready(plain_grad, *args), check, target)


def _roi_align_case(input_shape, num_boxes, target):
    """J5: forward + backward (``jax.value_and_grad`` of ``sum(roi_align(x) * g)``: the linear
    loss keeps the check exact; the forward is an FFI call XLA must run for the value) of
    fastbwd.jax.roi_align; JAX has no RoIAlign to compare with, so the check is against
    fastbwd's NumPy functions."""
    import fastbwd
    from fastbwd.api.roi_align import roi_align_forward

    spatial_scale, sampling_ratio, aligned, pooled = 0.25, 2, True, 7
    x = _randn(input_shape, 41)
    boxes = jnp.asarray(roi_boxes(num_boxes, input_shape, spatial_scale))
    g = _randn((num_boxes, input_shape[1], pooled, pooled), 42)

    def loss(x, boxes, g):
        return jnp.sum(fj.roi_align(x, boxes, pooled, spatial_scale, sampling_ratio, aligned) * g)

    step = jax.jit(jax.value_and_grad(loss))
    forward = jax.jit(lambda x, boxes: fj.roi_align(x, boxes, pooled, spatial_scale, sampling_ratio, aligned))

    def check():
        np_x, np_boxes, np_g = np.asarray(x), np.asarray(boxes), np.asarray(g)
        expected = fastbwd.roi_align_backward(
            np_g, np_boxes, input_shape, pooled, pooled, spatial_scale, sampling_ratio, aligned
        )
        assert np.array_equal(np.asarray(step(x, boxes, g)[1]), expected), "J5: gradient differs from the NumPy call"
        pooled_out = roi_align_forward(np_x, np_boxes, pooled, pooled, spatial_scale, sampling_ratio, aligned)
        assert np.array_equal(np.asarray(forward(x, boxes)), pooled_out), "J5: forward differs from the NumPy call"

    return JaxCase(
        "J5",
        f"roi_align forward + backward, input {input_shape}, {num_boxes} boxes 7x7 (R1)",
        _ready(step, x, boxes, g),
        None,
        check,
        target,
    )


def _sharded_case(shape, output_size, target):
    """J9 (issue 47): J1's operator, forward + backward (``sum(f(x) ** 2)``), with the batch
    sharded over two CPU devices, against the same program on one device; ``check()`` asserts
    the gradient is bitwise the one-device one, sharded like x, and that the compiled program
    has no collective. None with fewer than two devices (``python3 -m bench`` starts JAX with
    two: ``XLA_FLAGS=--xla_force_host_platform_device_count=2``)."""
    if jax.device_count() < 2:
        return None
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((2,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    x = _randn(shape, 21)
    step = jax.jit(jax.grad(lambda x: jnp.sum(fj.upsample_bilinear2d(x, output_size) ** 2)))
    one = jax.device_put(x, jax.devices()[0])
    split = jax.device_put(x, NamedSharding(mesh, PartitionSpec("batch")))
    text = step.lower(split).compile().as_text()
    gathers = len(re.findall(r" all-gather(?:-start)?\(", text))
    others = len(re.findall(r" (?:all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", text))

    def check():
        expected, actual = step(one), step(split)
        assert np.array_equal(np.asarray(actual), np.asarray(expected)), "J9: the sharded gradient differs"
        assert actual.sharding.is_equivalent_to(split.sharding, x.ndim), f"J9: gradient sharded {actual.sharding}"
        assert gathers == others == 0, f"J9: {gathers} all-gathers and {others} other collectives"

    return JaxCase(
        "J9",
        f"J1 forward + backward, batch {shape} split over 2 CPU devices, against 1 device",
        _ready(step, split),
        _ready(step, one),
        check,
        target,
        note=f"{gathers} all-gathers, {others} other collectives",
    )


def _operator_cases(quick):
    """J1-J6 (forward + backward) and J1b-J6b (backward only: issue 15's table, J1r against JAX's
    own resize, the same map for a x2 upsample without align_corners, and issue 39's tiny J6)."""
    if quick:
        # about a million elements: the kernels, not Python's per-call cost, decide
        up, pool, pad, norm, roi = (
            (4, 16, 64, 64),
            (4, 64, 56, 56),
            (4, 32, 64, 64),
            ((4, 128, 32, 32), 32),
            ((2, 64, 50, 76), 128),
        )
    else:
        up, pool, pad, norm, roi = (
            (8, 64, 64, 64),
            (32, 128, 56, 56),
            (16, 64, 128, 128),
            ((8, 512, 32, 32), 32),
            ((2, 256, 200, 304), 512),
        )
    up_size = (2 * up[2], 2 * up[3])
    norm_shape, groups = norm
    weight, bias = _randn((norm_shape[1],), 32), _randn((norm_shape[1],), 33)
    operators = [
        (
            "J1",
            f"upsample_bilinear2d x2, input {up} (U1)",
            lambda x: fj.upsample_bilinear2d(x, up_size),
            lambda x: _upsample._forward(x, up_size, False, "NCHW"),
            ">= 5x",
            21,
        ),
        (
            "J1r",
            "J1 against jax.image.resize(method='linear') (JAX's own bilinear resize)",
            lambda x: fj.upsample_bilinear2d(x, up_size),
            lambda x: jax.image.resize(x, x.shape[:2] + up_size, "linear"),
            ">= 5x",
            21,
        ),
        (
            "J2",
            f"avg_pool2d k3 s2 p1 count_include_pad=False, input {pool} (A1)",
            lambda x: fj.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
            lambda x: _avg_pool._forward(x, (3, 3), (2, 2), (1, 1), False, False, 0, "NCHW"),
            ">= 5x",
            23,
        ),
        (
            "J3",
            f"replication_pad2d (3, 3, 3, 3), input {pad} (P1)",
            lambda x: fj.replication_pad2d(x, (3, 3, 3, 3)),
            lambda x: jnp.pad(x, ((0, 0), (0, 0), (3, 3), (3, 3)), mode="edge"),
            ">= 5x",
            25,
        ),
    ]
    rows = []
    for id, label, ours, plain, target, seed in operators:
        rows.append(
            _grad_case(id, label + ", fwd+bwd", ours, plain, (_randn(_input(id, up, pool, pad), seed),), "report")
        )
        rows.append(
            _backward_case(id + "b", label + ", backward only", ours, plain, _input(id, up, pool, pad), target, seed)
        )

    def norm_ours(x, w, b):
        return fj.group_norm_swish(x, groups, w, b)

    def norm_plain(x, w, b):
        return _group_norm_swish.reference(x, w, b, groups, 1e-5, 1.0, "NCHW")

    norm_label = f"group_norm_swish (x, weight, bias), x {norm_shape}, {groups} groups (G1)"
    norm_x = _randn(norm_shape, 31)
    rows.append(
        _grad_case("J4", norm_label + ", fwd+bwd", norm_ours, norm_plain, (norm_x, weight, bias), "report", 1e-4, 1e-5)
    )
    rows.append(
        _backward_case(
            "J4b",
            norm_label + ", backward only",
            norm_ours,
            norm_plain,
            norm_shape,
            ">= 3x",
            31,
            rtol=1e-4,
            atol=1e-5,
            extra=(weight, bias),
        )
    )
    rows.append(_roi_align_case(*roi, "report"))
    # J6 (issue 39): a tiny gradient, where the per-call cost is all there is; the same shapes
    # at both sizes
    tiny = (2, 3, 8, 10)
    label = "tiny upsample_bilinear2d, input (2, 3, 8, 10) -> (16, 20), against jax.image.resize's"

    def tiny_ours(x):
        return fj.upsample_bilinear2d(x, (16, 20))

    def tiny_plain(x):
        return jax.image.resize(x, x.shape[:2] + (16, 20), "linear")

    # issue 46's target: the loss uses the forward's value
    rows.append(_grad_case("J6", label + ", fwd+bwd", tiny_ours, tiny_plain, (_randn(tiny, 27),), ">= 1.0x"))
    rows.append(_backward_case("J6b", label + ", backward only", tiny_ours, tiny_plain, tiny, ">= 0.77x", 27))
    return rows


def _input(id, up, pool, pad):
    return {"J1": up, "J1r": up, "J2": pool, "J3": pad}[id]


#: The parts of :func:`cases`: the operators' rows, the models', and the sharded one.
PARTS = ("operators", "models", "sharded")


def cases(quick=False, parts=PARTS):
    """Every JAX row: J1-J6 and their backward-only rows, the libraries' models reached by
    fastbwd.jax.reach (J7 Flax, J8 Equinox, issue 47) with J7's layers one by one (J7a-J7f), the
    channels-last drop-ins against the calls they replace (J10, J11) and, with two devices, J9
    (issue 47: J1 sharded over them); ``quick`` uses small shapes; ``parts`` (of :data:`PARTS`):
    only those, the others not built."""
    from . import jax_model_cases

    up = (4, 16, 64, 64) if quick else (8, 64, 64, 64)
    rows = _operator_cases(quick) if "operators" in parts else []
    rows += jax_model_cases.cases(quick) if "models" in parts else []
    if "sharded" in parts:  # J9: two devices
        rows += [case for case in [_sharded_case(up, (2 * up[2], 2 * up[3]), ">= 1.6x")] if case is not None]
    return rows


def transport_overhead(shape=(1024,), calls=11):
    """``{variant: callable}`` timing the transport alone on a small array: jitted programs of
    one and of ``calls`` chained FFI calls whose handler wraps the buffers and returns. The
    difference divided by ``calls - 1`` is the handler's cost per call (GIL, frame reading,
    array views, config lookup), free of the dispatch every jitted call pays."""
    from fastbwd.jax import _ffi

    def adapter(inputs, outputs, config):
        pass  # the buffers are wrapped as arrays; nothing is computed

    name = _ffi.target("transport_probe", adapter, fold=False)

    def chain(count):
        def program(x):
            for _ in range(count):
                (x,) = _ffi.call(name, [x], [jax.ShapeDtypeStruct(x.shape, x.dtype)], {"probe": 1})
            return x

        return jax.jit(program)

    x = jnp.zeros(shape, jnp.float32)
    return {"1 call": _ready(chain(1), x), f"{calls} calls": _ready(chain(calls), x)}
