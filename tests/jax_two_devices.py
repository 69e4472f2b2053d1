"""fastbwd.jax on two CPU devices (docs/semantics.md §8, sharding). Run by
tests/test_jax_sharding.py in a process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (pytest collects this file only when
named; by hand: ``XLA_FLAGS=... python -m pytest tests/jax_two_devices.py``).

Every operator under ``jax.jit(jax.grad(sum(f(x) ** 2)))`` on inputs sharded over the two
devices equals the same program on one device (bitwise where each device runs the same kernel
on its own rows), its gradients are sharded like its inputs, and the compiled program has no
all-gather: no collective at all where the rows are independent, only the sums the operator
implies (GroupNorm's weight and bias gradients over the batch, RoIAlign's rows over the
images). Shardings no rule can split stay right; ``shard_map`` and ``vmap`` work.
"""

import re
from dataclasses import dataclass

import numpy as np
import pytest

jax = pytest.importorskip("jax")
if jax.device_count() < 2:
    pytest.skip("needs two devices: tests/test_jax_sharding.py runs this file with them", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fastbwd.jax as fj  # noqa: E402
from fastbwd.jax import _ffi, _sharding  # noqa: E402
from fastbwd.testing.checks import bitwise_equal  # noqa: E402

from conftest import random  # noqa: E402

MESH = jax.make_mesh((2,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
ONE = jax.devices()[0]
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter", "collective-broadcast")


def collectives(jitted, *args):
    """``(op, array type)`` of each array a collective of the compiled program moves (XLA
    may combine several arrays into one collective)."""
    moved = []
    for line in jitted.lower(*args).compile().as_text().splitlines():
        op = re.search(r" = (.*?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(", line)
        if op:
            moved += [(op.group(2), array) for array in re.findall(r"\w+\[[\d,]*\]", op.group(1))]
    return moved


def ffi_calls(jitted, *args):
    """``(first result type, target)`` of each fastbwd FFI call in the compiled program."""
    calls = []
    for line in jitted.lower(*args).compile().as_text().splitlines():
        target = re.search(r'custom_call_target="(fastbwd_\w+)"', line)
        if target:
            result = line.split(" = ", 1)[1].split(" custom-call(", 1)[0].lstrip("(")
            calls.append((result.split("{")[0], target.group(1)))
    return calls


def put(array, spec):
    return jax.device_put(array, NamedSharding(MESH, spec))


def same_sharding(actual, spec, ndim):
    return actual.sharding.is_equivalent_to(NamedSharding(MESH, spec), ndim)


# ---- the operators ----------------------------------------------------------------------------

BOXES = np.array(
    [
        [0, 1.0, 1.0, 9.0, 9.0],
        [3, 2.0, 2.0, 12.0, 10.0],
        [1, 0.0, 0.0, 15.0, 15.0],
        [2.5, 3.0, 4.0, 8.0, 14.0],  # floor(2.5) = 2: the second device's first image
        [1.75, 6.0, 1.0, 13.0, 7.0],
        [4, 1.0, 1.0, 3.0, 3.0],  # no such image: zeros
        [-0.5, 1.0, 1.0, 3.0, 3.0],  # floor(-0.5) = -1: zeros
        [np.nan, 1.0, 1.0, 2.0, 2.0],
        [0, 1.0, np.inf, 2.0, 2.0],
        [3, 0.0, 0.0, 5.0, 5.0],
    ],
    np.float32,
)


@dataclass
class Op:
    """``f(*args)``, its arguments (the first, x, sharded on the batch), which arguments are
    differentiated, and which gradients are bitwise equal to one device's (the others sum
    over devices: within ``rtol``)."""

    f: object
    args: tuple
    argnums: tuple = (0,)
    bitwise: tuple = (True,)
    batch_collectives: tuple = ()  # collectives the operator implies when split on the batch
    channel_axis: int | None = 1  # splits without collectives; None: it does not
    rtol: float = 2e-6


def _ops():
    x = random((4, 6, 8, 8), np.float32, 1)
    x_nhwc = random((4, 8, 8, 6), np.float32, 2)
    weight, bias = random((6,), np.float32, 3), random((6,), np.float32, 4)
    image = random((4, 6, 16, 16), np.float32, 5)
    image[1] = -0.0  # rows of -0.0 survive the sum over devices
    return {
        "upsample": Op(lambda x: fj.upsample_bilinear2d(x, (16, 12)), (x,)),
        "upsample_nhwc": Op(
            lambda x: fj.upsample_bilinear2d(x, (13, 16), True, layout="NHWC"), (x_nhwc,), channel_axis=3
        ),
        "avg_pool": Op(lambda x: fj.avg_pool2d(x, 3, 2, 1, True, False), (x,)),
        "pad": Op(lambda x: fj.replication_pad2d(x, (1, 2, -1, 3)), (x,)),
        "group_norm_swish": Op(
            lambda x, w, b: fj.group_norm_swish(x, 3, w, b),
            (x, weight, bias),
            (0, 1, 2),
            (True, False, False),
            (("all-reduce", "f32[6]"),) * 2,
            None,
            rtol=1e-5,
        ),
        "group_norm_swish_nhwc": Op(
            lambda x, w, b: fj.group_norm_swish(x, 2, w, b, layout="NHWC"),
            (x_nhwc, weight, bias),
            (0, 1, 2),
            (True, False, False),
            (("all-reduce", "f32[6]"),) * 2,
            None,
            rtol=1e-5,
        ),
        "roi_align": Op(
            lambda x: fj.roi_align(x, BOXES, (3, 4), 1.0, 2, True),
            (image,),
            batch_collectives=(("all-reduce", "f32[10,6,3,4]"),),
        ),
        "roi_align_nhwc": Op(
            lambda x: fj.roi_align(x, BOXES, 3, 0.5, 0, False, layout="NHWC"),
            (np.ascontiguousarray(np.moveaxis(image, 1, -1)),),
            batch_collectives=(("all-reduce", "f32[10,3,3,6]"),),
            channel_axis=3,
        ),
    }


OPS = _ops()


def gradient(op):
    return jax.jit(jax.grad(lambda *args: jnp.sum(op.f(*args) ** 2), argnums=op.argnums))


def unsharded(op, args=None):
    args = op.args if args is None else args
    return gradient(op)(*[jax.device_put(a, ONE) for a in args])


def assert_equal_gradients(op, actual, expected, bitwise=None):
    for index, (a, e) in enumerate(zip(actual, expected)):
        if (op.bitwise if bitwise is None else bitwise)[index]:
            assert bitwise_equal(np.asarray(a), np.asarray(e)), f"gradient {index} differs"
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=op.rtol, atol=op.rtol * np.abs(e).max())


def split_args(op, spec):
    return [put(a, spec if i == 0 else P()) for i, a in enumerate(op.args)]


# ---- split on the batch -------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPS)
def test_batch_split_runs_each_half_on_its_device(name):
    op = OPS[name]
    args = split_args(op, P("b"))
    grad = gradient(op)
    result = grad(*args)
    assert_equal_gradients(op, result, unsharded(op))
    ndim = op.args[0].ndim
    assert same_sharding(result[0], P("b"), ndim), result[0].sharding
    assert sorted(collectives(grad, *args)) == sorted(op.batch_collectives)
    # each device's FFI calls see its half of the batch
    calls = ffi_calls(grad, *args)
    assert calls, "no fastbwd call in the program"
    for shape, target in calls:
        if target != "fastbwd_roi_align_forward":  # whose rows are boxes
            assert shape.startswith(f"f32[{op.args[0].shape[0] // 2},"), (target, shape)


@pytest.mark.parametrize("name", OPS)
def test_forward_output_keeps_the_batch_split(name):
    op = OPS[name]
    args = split_args(op, P("b"))
    forward = jax.jit(op.f)
    out = forward(*args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(op.f)(*op.args)))
    if "roi_align" in name:  # rows are boxes, summed over the devices: whole on each
        assert same_sharding(out, P(), out.ndim)
    else:
        assert same_sharding(out, P("b"), out.ndim)


@pytest.mark.parametrize("name", [name for name, op in OPS.items() if op.channel_axis is not None])
def test_channel_split_needs_no_collective(name):
    op = OPS[name]
    spec = P(*[None] * op.channel_axis, "b")
    args = split_args(op, spec)
    grad = gradient(op)
    result = grad(*args)
    assert_equal_gradients(op, result, unsharded(op))
    assert same_sharding(result[0], spec, op.args[0].ndim)
    assert collectives(grad, *args) == []


@pytest.mark.parametrize("name", OPS)
def test_a_sharding_no_rule_splits_is_still_right(name):
    """Sharded on a spatial axis (the kernels need whole planes), or a batch that does not
    split evenly: XLA gathers what the call needs; the result is the same."""
    op = OPS[name]
    spatial = 1 if name.endswith("nhwc") else 2
    # GroupNorm's forward statistics are XLA's reductions: split on a spatial axis they sum
    # in another order (within rounding)
    bitwise = op.bitwise if "group_norm" not in name else (False,) * len(op.argnums)
    args = split_args(op, P(*[None] * spatial, "b"))
    assert_equal_gradients(op, gradient(op)(*args), unsharded(op), bitwise)
    # three samples over two devices (jax.device_put refuses such a sharding; inside a
    # program XLA pads the last slice)
    uneven = NamedSharding(MESH, P("b"))
    constrained = jax.jit(
        jax.grad(
            lambda x, *rest: jnp.sum(op.f(jax.lax.with_sharding_constraint(x, uneven), *rest) ** 2),
            argnums=op.argnums,
        )
    )
    args = [a[:3] if i == 0 else a for i, a in enumerate(op.args)]
    assert_equal_gradients(op, constrained(*args), unsharded(op, args))


# ---- RoIAlign: boxes and images on different devices ------------------------------------------


def test_roi_align_boxes_name_images_on_either_device():
    """Each device handles the boxes of its own images, wherever they sit in the list: the
    forward is bitwise one call's, -0.0 rows and rows of no image included, and the backward
    scatters into each device's own images with no collective."""
    image = OPS["roi_align"].args[0]
    boxes = BOXES[::-1].copy()
    f = jax.jit(lambda x, b: fj.roi_align(x, b, 3, 1.0, 2, True))
    expected = f(jax.device_put(image, ONE), jax.device_put(boxes, ONE))
    assert np.signbit(np.asarray(expected)).any() and (np.asarray(expected) == 0).any()
    for box_spec in (P(), P("b")):
        args = put(image, P("b")), put(boxes, box_spec)
        assert bitwise_equal(np.asarray(f(*args)), np.asarray(expected))
        assert all(op != "all-gather" or shape == "f32[10,5]" for op, shape in collectives(f, *args))


def test_roi_align_boxes_split_when_the_images_are_whole():
    """Images on every device, boxes split: each device computes its own boxes' rows (no
    collective), bitwise one call's."""
    image = OPS["roi_align"].args[0]
    f = jax.jit(lambda x, b: fj.roi_align(x, b, 3, 1.0, 2, True))
    args = put(image, P()), put(BOXES, P("b"))
    out = f(*args)
    assert bitwise_equal(np.asarray(out), np.asarray(f(jax.device_put(image, ONE), jax.device_put(BOXES, ONE))))
    assert same_sharding(out, P("b"), out.ndim)
    assert collectives(f, *args) == []


def test_roi_align_vmapped_with_the_images_split_on_their_batch():
    """``jax.vmap`` over a whole axis of 2 while each element's 8 images split over the devices
    (4 each): a device's images are counted on N, not on the vmapped axis, so it owns the boxes
    of all four; every element is bitwise one call's, and so is its gradient."""
    image = OPS["roi_align"].args[0]
    x = np.stack([np.concatenate([image, -image[::-1]]), np.concatenate([image[::-1], image])])
    boxes = BOXES.copy()
    boxes[:, 0] += 2  # images 1.5 to 6: past the vmapped axis's size on both devices
    sharded = put(x, P(None, "b"))

    def f(x):
        return fj.roi_align(x, boxes, (3, 4), 1.0, 2, True)

    out = jax.jit(jax.vmap(f))(sharded)
    dx = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(f(x) ** 2))))(sharded)
    assert same_sharding(dx, P(None, "b"), x.ndim)
    for element in range(2):
        one = jax.device_put(x[element], ONE)
        assert bitwise_equal(np.asarray(out[element]), np.asarray(jax.jit(f)(one))), element
        expected = jax.jit(jax.grad(lambda x: jnp.sum(f(x) ** 2)))(one)
        assert bitwise_equal(np.asarray(dx[element]), np.asarray(expected)), element


# ---- shard_map and vmap -----------------------------------------------------------------------


@pytest.mark.parametrize("name", OPS)
def test_shard_map_runs_the_call_per_device(name):
    """Inside ``shard_map`` each device's program is its own: the FFI call runs on the local
    arrays (RoIAlign's boxes then name local images), equal to one device's call on them; the
    gradient of a weight the same on every device is the sum of the devices' (as JAX makes it)."""
    op = OPS[name]
    local_boxes = BOXES.copy()
    local_boxes[:, 0] = np.where(np.isfinite(BOXES[:, 0]), BOXES[:, 0] % 2, BOXES[:, 0])
    f = op.f
    if "roi_align" in name:
        layout = "NHWC" if name.endswith("nhwc") else "NCHW"

        def f(x):
            return fj.roi_align(x, local_boxes, 3, 1.0, 2, True, layout=layout)

    def per_device(*args):
        return jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=op.argnums)(*args)

    in_specs = tuple(P("b") if i == 0 else P() for i in range(len(op.args)))
    out_specs = tuple(P("b") if i == 0 else P() for i in op.argnums)
    mapped = jax.jit(jax.shard_map(per_device, mesh=MESH, in_specs=in_specs, out_specs=out_specs))
    result = mapped(*split_args(op, P("b")))
    half = op.args[0].shape[0] // 2
    per_half = [
        jax.jit(per_device)(
            *[jax.device_put(a[d * half : (d + 1) * half] if i == 0 else a, ONE) for i, a in enumerate(op.args)]
        )
        for d in range(2)
    ]
    expected = [np.concatenate([np.asarray(p[0]) for p in per_half])]
    expected += [np.asarray(per_half[0][i]) + np.asarray(per_half[1][i]) for i in range(1, len(op.argnums))]
    assert_equal_gradients(op, result, expected)


def test_vmap_inside_shard_map():
    """``vmap`` in each device's program: the folding and the looping targets, a weight the
    same on every device (its gradient summed over them)."""
    x = random((2, 4, 6, 8, 8), np.float32, 9)
    weight = random((6,), np.float32, 10)

    def per_device(x, weight):
        def loss(x, weight):
            y = fj.group_norm_swish(x, 3, weight, weight)
            return jnp.sum(fj.roi_align(y, BOXES[:3] % 2, 2) ** 2) + jnp.sum(fj.upsample_bilinear2d(y, (9, 9)) ** 2)

        return jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))(x, weight)

    mapped = jax.jit(jax.shard_map(per_device, mesh=MESH, in_specs=(P(None, "b"), P()), out_specs=(P(None, "b"), P())))
    dx, dweight = mapped(put(x, P(None, "b")), weight)
    halves = [jax.jit(per_device)(jax.device_put(x[:, 2 * d : 2 * d + 2], ONE), weight) for d in range(2)]
    assert bitwise_equal(np.asarray(dx), np.concatenate([np.asarray(h[0]) for h in halves], axis=1))
    expected = np.asarray(halves[0][1]) + np.asarray(halves[1][1])
    np.testing.assert_allclose(np.asarray(dweight), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("name", ["upsample", "avg_pool", "group_norm_swish", "roi_align"])
def test_vmap_over_a_sharded_axis_stays_split(name):
    """``vmap`` of the gradient over a leading axis split over the devices: the folding
    targets and the looping ones (GroupNorm, RoIAlign) each run their half, no collective."""
    op = OPS[name]
    x = np.stack([op.args[0], op.args[0][::-1].copy()])
    rest = op.args[1:]
    grad = jax.jit(
        jax.vmap(jax.grad(lambda *a: jnp.sum(op.f(*a) ** 2), argnums=op.argnums), (0,) + (None,) * len(rest))
    )
    args = [put(x, P("b"))] + [put(a, P()) for a in rest]
    result = grad(*args)
    assert same_sharding(result[0], P("b"), x.ndim)
    assert collectives(grad, *args) == []
    for element in range(2):
        expected = unsharded(op, (x[element],) + rest)
        assert_equal_gradients(op, [r[element] for r in result], expected)


# ---- forward mode and second derivatives --------------------------------------------------------

LINEAR = {
    "pool_kernel_forward": lambda x: fj.avg_pool2d(x, 3, 1, 1),  # its forward: fastbwd's FFI call
    "roi_align": lambda x: fj.roi_align(x, jnp.asarray(BOXES[:4] % 4), 2),  # the same
    "pad": lambda x: fj.replication_pad2d(x, (1, 2, 0, 1)),
}


@pytest.mark.parametrize("name", LINEAR)
def test_forward_mode_and_second_derivatives_stay_split(name):
    """A program whose only FFI calls sit in the tangent (jax.jvp's tangent alone: the
    pooling's and RoIAlign's forward kernels evaluate it) and a Hessian-vector product
    (jax.jvp of jax.grad: the backward's transpose is the forward) run sharded, with no
    all-gather, equal to one device's."""
    f = LINEAR[name]
    x = random((4, 6, 8, 8), np.float32, 13)
    t = random((4, 6, 8, 8), np.float32, 14)
    tangent = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,))[1])
    hvp = jax.jit(lambda x, t: jax.jvp(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)))), (x,), (t,))[1])
    for program in tangent, hvp:
        args = put(x, P("b")), put(t, P("b"))
        result = program(*args)
        expected = program(jax.device_put(x, ONE), jax.device_put(t, ONE))
        np.testing.assert_allclose(np.asarray(result), np.asarray(expected), rtol=1e-6, atol=1e-6)
        assert "all-gather" not in [op for op, _ in collectives(program, *args)]
    assert same_sharding(result, P("b"), 4)


# ---- the other partitioner and the other ways to shard -------------------------------------------


@pytest.mark.parametrize("name", ["upsample", "group_norm_swish", "roi_align"])
def test_gspmd_partitioner(name):
    """With Shardy off (``jax_use_shardy_partitioner=False``), the GSPMD partitioner's
    propagation gets the same split."""
    op = OPS[name]
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        grad = gradient(op)
        args = split_args(op, P("b"))
        result = grad(*args)
        assert_equal_gradients(op, result, unsharded(op))
        assert same_sharding(result[0], P("b"), op.args[0].ndim)
        assert sorted(collectives(grad, *args)) == sorted(op.batch_collectives)
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)


def test_explicit_axes_and_jit_shardings():
    """A mesh of explicit axes (``jax.make_mesh``'s default) under ``jax.set_mesh``, and
    shardings given to ``jax.jit``, split the same way."""
    op = OPS["upsample"]
    expected = unsharded(op)
    mesh = jax.make_mesh((2,), ("b",))
    x = jax.device_put(op.args[0], NamedSharding(mesh, P("b")))
    with jax.set_mesh(mesh):
        result = gradient(op)(x)
    assert_equal_gradients(op, result, expected)
    assert result[0].sharding.is_equivalent_to(NamedSharding(mesh, P("b")), 4)
    sharding = NamedSharding(MESH, P("b"))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(op.f(x) ** 2)), in_shardings=(sharding,), out_shardings=sharding)
    assert bitwise_equal(np.asarray(grad(op.args[0])), np.asarray(expected[0]))
    assert collectives(grad, op.args[0]) == []


@pytest.mark.parametrize("name", ["group_norm_swish", "group_norm_swish_nhwc"])
def test_group_norm_on_explicit_axes(name):
    """GroupNorm on a batch split over explicit axes (``jax.make_mesh``'s default): the
    gradient (its tangent's jax.numpy reshapes keep the batch's sharding) and forward mode,
    equal to one device's, x's gradient split like x."""
    op = OPS[name]
    mesh = jax.make_mesh((2,), ("b",))
    args = [jax.device_put(a, NamedSharding(mesh, P("b") if i == 0 else P())) for i, a in enumerate(op.args)]
    result = gradient(op)(*args)
    assert_equal_gradients(op, result, unsharded(op))
    assert result[0].sharding.is_equivalent_to(NamedSharding(mesh, P("b")), op.args[0].ndim)
    tangent = jax.jit(lambda *a: jax.jvp(op.f, a, a)[1])
    expected = tangent(*[jax.device_put(a, ONE) for a in op.args])
    np.testing.assert_allclose(np.asarray(tangent(*args)), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_gradient_like_types_a_weight_gradient_as_its_weight():
    """A weight split over explicit axes (a fully sharded data-parallel program): the weight
    gradient the kernel gives whole comes back typed as the weight. (GroupNorm itself cannot
    run there yet: its jax.numpy forward's reshape of a split batch needs an out_sharding.)"""
    mesh = jax.make_mesh((2,), ("b",))
    weight = jax.device_put(random((6,), np.float32, 11), NamedSharding(mesh, P("b")))
    gradient_ = jax.device_put(random((6,), np.float32, 12), NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        result = jax.jit(_sharding.gradient_like)(gradient_, weight)
        assert jax.typeof(result).sharding.spec == P("b")
    assert bitwise_equal(np.asarray(result), np.asarray(gradient_))


# ---- the mechanism's three vmap behaviours, on a probe target ---------------------------------


def _scale_adapter(inputs, outputs, config):
    """``x * weight`` per channel, for operands with any leading (vmap) axes."""
    x, weight = inputs
    outputs[0][...] = x * weight.reshape(weight.shape[:-1] + (1, weight.shape[-1], 1, 1))


PROBE = _ffi.target("sharding_probe_scale", _scale_adapter, fold=False)


def probe_scale(x, weight, method):
    split = _sharding.batch_parallel([("n", "c", None, None), ("c",)], [("n", "c", None, None)])
    result = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return _sharding.call(PROBE, "{}", method, split, [x, weight], [result])[0]


@pytest.mark.parametrize("method", ["broadcast_all", "expand_dims", "sequential"])
@pytest.mark.parametrize("batched", ["x", "weight", "both"])
def test_vmap_methods_keep_a_sharded_axis_split(method, batched):
    x = random((2, 4, 6, 3, 3), np.float32, 7)
    weight = random((2, 6), np.float32, 8)
    in_axes = (0 if batched != "weight" else None, 0 if batched != "x" else None)
    args = [x if in_axes[0] == 0 else x[0], weight if in_axes[1] == 0 else weight[0]]
    f = jax.jit(jax.vmap(lambda x, w: probe_scale(x, w, method), in_axes=in_axes))
    expected = np.asarray(args[0]) * np.asarray(args[1]).reshape(args[1].shape[:-1] + (1, 6, 1, 1))
    expected = np.broadcast_to(expected, (2, 4, 6, 3, 3))
    sharded = [put(a, P("b") if axis == 0 else P()) for a, axis in zip(args, in_axes)]
    out = f(*sharded)
    assert bitwise_equal(np.asarray(out), np.ascontiguousarray(expected))
    assert same_sharding(out, P("b"), 5)
    assert collectives(f, *sharded) == []


def test_bench_row_j9():
    """``python3 -m bench``'s J9 (J1 split over the two devices): its check passes (bitwise the
    one-device gradient, sharded like x, no collective) and both of its ways run."""
    from bench.jax_cases import cases

    (case,) = [case for case in cases(quick=True) if case.id == "J9"]
    case.check()
    case.fastbwd()
    case.jax()
    assert case.note == "0 all-gathers, 0 other collectives"


def test_each_device_call_runs_on_its_share_of_the_threads(monkeypatch):
    """The two devices' calls run at once on the same cores: each kernel gets half of Numba's
    threads (one device's call gets them all), under jit and in shard_map."""
    import numba

    from fastbwd import api
    from fastbwd.kernels import _jit

    seen = []
    run = _jit.Plan.run  # the upsample kernels' plan (the handler's prepared call ends in it)

    def recording(*args, **kwargs):
        seen.append(api.get_num_threads())
        return run(*args, **kwargs)

    monkeypatch.setattr(_jit.Plan, "run", recording)
    op = OPS["upsample"]
    pool = numba.config.NUMBA_NUM_THREADS
    jax.block_until_ready(unsharded(op))
    assert seen == [pool]
    seen.clear()
    jax.block_until_ready(gradient(op)(*split_args(op, P("b"))))
    assert seen == [max(1, pool // 2)] * 2
    seen.clear()
    grad = jax.grad(lambda x: jnp.sum(op.f(x) ** 2))
    jax.block_until_ready(
        jax.jit(jax.shard_map(grad, mesh=MESH, in_specs=P("b"), out_specs=P("b")))(*split_args(op, P("b")))
    )
    assert seen == [max(1, pool // 2)] * 2


# ---- the decision (policy "auto") on sharded programs ----------------------------------------


def test_the_decision_counts_each_devices_part_where_the_trace_knows_it():
    """Inside ``shard_map`` (local shapes) and on explicit axes (x's shard) a call decides on one
    device's part and on the devices' share of the threads (the one-thread thresholds when the
    two devices split the pool); where XLA's propagation places the shards (Auto axes), on the
    whole array and the process's threads. Below the threshold the sharded program holds no
    fastbwd call, and its gradient equals fastbwd's within float tolerance."""
    import numba

    from fastbwd import _dispatch
    from fastbwd.jax import _decide

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two Numba threads (each device gets one)")
    op = OPS["upsample"]
    x = op.args[0]
    half = x.size // 2
    grad = jax.grad(lambda x: jnp.sum(op.f(x) ** 2))
    name = "jax/traced/upsample_bilinear2d"
    # a device's half decides on the one-thread threshold, the whole array on the two-thread one
    table = {f"{name}/1": half + 1, f"{name}/2": x.size}

    def mapped():  # jitted afresh: JAX's caches do not see the thresholds _dispatch.using sets
        return jax.jit(jax.shard_map(lambda x: grad(x), mesh=MESH, in_specs=P("b"), out_specs=P("b")))

    def fresh():
        return jax.jit(lambda x: grad(x))

    mesh = jax.make_mesh((2,), ("b",), axis_types=(jax.sharding.AxisType.Explicit,))  # explicit axes
    explicit = jax.device_put(x, NamedSharding(mesh, P("b")))
    with _decide.policy_block("auto"), _dispatch.using(table):
        assert ffi_calls(mapped(), put(x, P("b"))) == []
        plain = [mapped()(put(x, P("b")))]
        with jax.set_mesh(mesh):
            assert ffi_calls(fresh(), explicit) == []
            plain.append(fresh()(explicit))
        assert ffi_calls(fresh(), put(x, P("b")))  # Auto: the whole array, two threads
    with _decide.policy_block("auto"), _dispatch.using({f"{name}/1": half, f"{name}/2": NEVER}):
        assert ffi_calls(mapped(), put(x, P("b")))
        with jax.set_mesh(mesh):
            assert ffi_calls(fresh(), explicit)
        assert ffi_calls(fresh(), put(x, P("b"))) == []
    expected = np.asarray(unsharded(op)[0])
    for result in plain:
        assert result.sharding.is_equivalent_to(NamedSharding(result.sharding.mesh, P("b")), x.ndim)
        np.testing.assert_allclose(np.asarray(result), expected, rtol=1e-5, atol=1e-6)


NEVER = 1 << 62
