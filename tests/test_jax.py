"""fastbwd.jax (docs/semantics.md §8): JAX's forward, fastbwd's backward through XLA's FFI.

Gradients under jax.jit/jax.vjp equal the direct NumPy call bitwise; they match jax.vjp of an
independent pure-JAX forward written here (dense interpolation/pooling matrices, gathers) to the
the semantics' tolerances, and finite differences (check_grads) in float64; jax.vmap folds or loops;
bad arguments raise ParamError at trace time. Everything here skips cleanly without jax.
"""

import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import fastbwd  # noqa: E402
import fastbwd.jax as fj  # noqa: E402
from bench.inputs import roi_boxes  # noqa: E402
from fastbwd.api import avg_pool2d as avg_pool_api  # noqa: E402
from fastbwd.api import group_norm_swish as gns_api  # noqa: E402
from fastbwd.api.roi_align import roi_align_forward  # noqa: E402
from fastbwd.jax import _ffi  # noqa: E402
from fastbwd.testing import reference as ref  # noqa: E402
from fastbwd.testing.checks import assert_matches_reference, bitwise_equal  # noqa: E402

from conftest import BF16, DTYPES, raises_param_error, random  # noqa: E402


def _x64(dtype):
    """float64 (and complex128) need JAX's x64 mode; the others run with it off, as users do."""
    return jax.enable_x64(np.dtype(dtype).itemsize == 8 or np.dtype(dtype) == np.complex128)


# ---- the case table --------------------------------------------------------------------------


@dataclass
class Case:
    """One operator configuration: ``args`` (NumPy, all differentiated), ``ours(*args)`` through
    fastbwd.jax, ``direct(g, *args)`` the gradients by the NumPy call, ``reference(*args)`` an
    independent pure-JAX forward (float64 where the data is)."""

    args: tuple
    ours: Callable
    direct: Callable
    reference: Callable
    rtol: float = None


def _compute(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def upsample_case(dtype, layout="NCHW", align_corners=False):
    n, c, h, w, oh, ow = 2, 3, 5, 7, 9, 12
    shape = (n, h, w, c) if layout == "NHWC" else (n, c, h, w)
    x = random(shape, dtype, 1)
    a_h = ref.upsample_bilinear2d_interp_matrix(h, oh, align_corners, opmath=_compute(dtype))
    a_w = ref.upsample_bilinear2d_interp_matrix(w, ow, align_corners, opmath=_compute(dtype))
    spec = "oh,nhwc,pw->nopc" if layout == "NHWC" else "oh,nchw,pw->ncop"
    return Case(
        (x,),
        lambda x: fj.upsample_bilinear2d(x, (oh, ow), align_corners, layout=layout),
        lambda g, x: fastbwd.upsample_bilinear2d_backward(g, (oh, ow), (n, c, h, w), align_corners, layout=layout),
        lambda x: jnp.einsum(spec, a_h, x, a_w),
    )


def _pool_matrix(size, kernel, stride, pad, out_size):
    """Per axis: the 0/1 window membership (out_size, size) and the window's extent in the
    padded input and in the input (docs/semantics.md §2)."""
    member = np.zeros((out_size, size))
    padded, inside = np.zeros(out_size), np.zeros(out_size)
    for o in range(out_size):
        start = o * stride - pad
        end = min(start + kernel, size + pad)
        padded[o] = end - start
        member[o, max(start, 0) : min(end, size)] = 1
        inside[o] = min(end, size) - max(start, 0)
    return member, padded, inside


def avg_pool_case(
    dtype,
    batched=True,
    kernel=(3, 2),
    stride=(2, 1),
    padding=(1, 0),
    ceil_mode=True,
    count_include_pad=False,
    divisor_override=0,
    layout="NCHW",
):
    shape = (2, 3, 9, 8) if batched else (3, 9, 8)
    x = random(shape, dtype, 2)
    h, w = shape[-2:]
    oh, ow = (
        ref.avg_pool2d_output_size(size, k, s, p, ceil_mode) for size, k, s, p in zip((h, w), kernel, stride, padding)
    )
    m_h, pad_h, in_h = _pool_matrix(h, kernel[0], stride[0], padding[0], oh)
    m_w, pad_w, in_w = _pool_matrix(w, kernel[1], stride[1], padding[1], ow)
    if divisor_override:
        divisor = np.full((oh, ow), float(divisor_override))
    else:
        divisor = np.outer(pad_h, pad_w) if count_include_pad else np.outer(in_h, in_w)
    args = (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    if layout == "NHWC":  # 4-D: the NumPy call reads a channels-last view and returns one
        return Case(
            (np.ascontiguousarray(np.moveaxis(x, 1, -1)),),
            lambda x: fj.avg_pool2d(x, *args, layout="NHWC"),
            lambda g, x: np.moveaxis(fastbwd.avg_pool2d_backward(np.moveaxis(g, -1, 1), shape, *args), 1, -1),
            lambda x: jnp.einsum("oh,nhwc,pw->nopc", m_h, x, m_w) / divisor[:, :, None],
        )
    return Case(
        (x,),
        lambda x: fj.avg_pool2d(x, *args),
        lambda g, x: fastbwd.avg_pool2d_backward(g, x.shape, *args),
        lambda x: jnp.einsum("oh,...hw,pw->...op", m_h, x, m_w) / divisor,
    )


def pad_case(dtype, batched=True, padding=(2, -1, 1, 3), layout="NCHW"):
    shape = (2, 3, 5, 6) if batched else (3, 5, 6)
    x = random(shape, dtype, 3)
    left, right, top, bottom = padding
    h, w = shape[-2:]
    rows = np.clip(np.arange(h + top + bottom) - top, 0, h - 1)
    cols = np.clip(np.arange(w + left + right) - left, 0, w - 1)
    if layout == "NHWC":  # 4-D: the NumPy call reads a channels-last view and returns one
        return Case(
            (np.ascontiguousarray(np.moveaxis(x, 1, -1)),),
            lambda x: fj.replication_pad2d(x, padding, layout="NHWC"),
            lambda g, x: np.moveaxis(fastbwd.replication_pad2d_backward(np.moveaxis(g, -1, 1), shape, padding), 1, -1),
            lambda x: x[:, rows][:, :, cols],
        )
    return Case(
        (x,),
        lambda x: fj.replication_pad2d(x, padding),
        lambda g, x: fastbwd.replication_pad2d_backward(g, x.shape, padding),
        lambda x: x[..., rows, :][..., cols],
    )


def roi_align_case(dtype, sampling_ratio=2, aligned=True, layout="NCHW"):
    shape, pooled, scale = (2, 3, 10, 12), (3, 2), 0.5
    x = random(shape, dtype, 4)
    nhwc = layout == "NHWC"
    boxes = roi_boxes(6, shape, scale, dtype=np.float64)
    boxes[4, 0] = 5.0  # an image index outside the batch: skipped
    boxes[5, 2] = np.nan  # a NaN coordinate: skipped
    boxes = boxes.astype(dtype)
    rows = []
    for box in boxes.astype(np.float64):
        weights = ref._roi_box_weights(box, shape[0], shape[2], shape[3], *pooled, scale, sampling_ratio, aligned)
        if weights is None:
            rows.append(None)
        else:
            b, wy, _, wx, _, count = weights
            rows.append((b, wy / count, wx))

    def reference(x):
        x = jnp.moveaxis(x, -1, 1) if nhwc else x
        out = [
            jnp.zeros((shape[1],) + pooled, x.dtype)
            if row is None
            else jnp.einsum("ph,chw,qw->cpq", row[1], x[row[0]], row[2])
            for row in rows
        ]
        out = jnp.stack(out)
        return jnp.moveaxis(out, 1, -1) if nhwc else out

    return Case(
        (np.ascontiguousarray(np.moveaxis(x, 1, -1)) if nhwc else x,),
        lambda x: fj.roi_align(x, boxes, pooled, scale, sampling_ratio, aligned, layout=layout),
        lambda g, x: fastbwd.roi_align_backward(
            g, boxes, shape, *pooled, scale, sampling_ratio, aligned, layout=layout
        ),
        reference,
    )


def group_norm_swish_case(dtype, layout="NCHW", parameter_dtype=None, swish_scale=1.0, activate_swish=True):
    groups, eps = 3, 1e-5
    shape = (2, 4, 5, 6) if layout == "NHWC" else (2, 6, 4, 5)
    x = random(shape, dtype, 5)
    weight = random((6,), parameter_dtype or dtype, 6)
    bias = random((6,), parameter_dtype or dtype, 7)

    def direct(g, x, weight, bias):
        # The mean and rstd the jitted forward saved, as the handler received them.
        mean, rstd = _RECORDED_STATISTICS[-1]
        return fastbwd.group_norm_swish_backward(
            g, mean, rstd, x, weight, bias, groups, layout, swish_scale, activate_swish=activate_swish
        )

    def reference(x, weight, bias):
        channels_last = jnp.moveaxis(x, -1, 1) if layout == "NHWC" else x
        grouped = channels_last.reshape(shape[0], groups, -1)
        mean = grouped.mean(axis=2, keepdims=True)
        var = ((grouped - mean) ** 2).mean(axis=2, keepdims=True)
        y = ((grouped - mean) / jnp.sqrt(var + eps)).reshape(channels_last.shape)
        y = y * weight[None, :, None, None] + bias[None, :, None, None]
        out = y * jax.nn.sigmoid(swish_scale * y) if activate_swish else y
        return jnp.moveaxis(out, 1, -1) if layout == "NHWC" else out

    return Case(
        (x, weight, bias),
        lambda x, w, b: fj.group_norm_swish(
            x, groups, w, b, eps, swish_scale, layout=layout, activate_swish=activate_swish
        ),
        direct,
        reference,
        rtol=1e-4,
    )


CASES = {
    "upsample": upsample_case,
    "upsample-nhwc-corners": lambda dtype: upsample_case(dtype, "NHWC", True),
    "avg_pool": avg_pool_case,
    "avg_pool-3d-divisor": lambda dtype: avg_pool_case(dtype, False, (2, 3), (1, 2), (1, 1), False, True, -3),
    "avg_pool-include-pad": lambda dtype: avg_pool_case(dtype, True, (3, 3), (2, 2), (1, 1), False, True, 0),
    "avg_pool-nhwc": lambda dtype: avg_pool_case(dtype, layout="NHWC"),
    # stride 1, kernel 2 * pad + 1: the forward is the backward kernel (self-adjoint), or its
    # window sums divided by XLA (count_include_pad=False)
    "avg_pool-same": lambda dtype: avg_pool_case(dtype, True, (3, 5), (1, 1), (1, 2), False, True, 0),
    "avg_pool-same-nhwc": lambda dtype: avg_pool_case(dtype, True, (3, 3), (1, 1), (1, 1), False, True, 0, "NHWC"),
    "avg_pool-same-exclude": lambda dtype: avg_pool_case(dtype, True, (3, 3), (1, 1), (1, 1), False, False, 0),
    "avg_pool-same-divisor": lambda dtype: avg_pool_case(dtype, False, (3, 3), (1, 1), (1, 1), True, False, 7),
    "pad": pad_case,
    "pad-3d": lambda dtype: pad_case(dtype, False, (0, 4, -2, 1)),
    "pad-nhwc": lambda dtype: pad_case(dtype, padding=(1, 2, -1, 3), layout="NHWC"),
    "roi_align": roi_align_case,
    "roi_align-adaptive": lambda dtype: roi_align_case(dtype, 0, False),
    "roi_align-nhwc": lambda dtype: roi_align_case(dtype, 0, True, "NHWC"),
    "group_norm_swish": group_norm_swish_case,
    "group_norm_swish-nhwc": lambda dtype: group_norm_swish_case(dtype, "NHWC", swish_scale=-0.7),
    "group_norm": lambda dtype: group_norm_swish_case(dtype, activate_swish=False),
    "group_norm-nhwc": lambda dtype: group_norm_swish_case(dtype, "NHWC", activate_swish=False),
}


def _operator_and_layout(name, **others):
    """A case's features for the quick set's cover (tests/_covering.py): its operator and layout, and the other
    parameters."""
    return (name.split("-")[0], "nhwc" in name, *others.values())


_RECORDED_STATISTICS = []


@pytest.fixture(autouse=True)
def _record_statistics(monkeypatch):
    """Keep copies of the mean and rstd each group_norm_swish backward receives (XLA computes
    them inside the jitted forward; the NumPy call must see the same arrays)."""
    original = gns_api.run

    def recording(plan, dy, mean, rstd, *args):
        _RECORDED_STATISTICS.append((np.array(mean), np.array(rstd)))
        return original(plan, dy, mean, rstd, *args)

    monkeypatch.setattr(gns_api, "run", recording)
    yield
    _RECORDED_STATISTICS.clear()


def _vjp(case, dtype, jit=True):
    """``(outputs, gradients, g)`` of ``case.ours`` under jax.jit(jax.vjp) for a random ``g``."""
    args = [jnp.asarray(a) for a in case.args]
    y = jax.eval_shape(case.ours, *args)
    g = random(y.shape, y.dtype, 9)

    def step(g, *args):
        out, pullback = jax.vjp(case.ours, *args)
        return out, pullback(g)

    out, grads = (jax.jit(step) if jit else step)(jnp.asarray(g), *args)
    return np.asarray(out), [np.asarray(grad) for grad in grads], g


# ---- gradients: bitwise the NumPy call; close to the pure-JAX reference ----------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_gradient_equals_the_numpy_call_bitwise(name, dtype):
    with _x64(dtype):
        case = CASES[name](dtype)
        _, grads, g = _vjp(case, dtype)
        expected = case.direct(g, *case.args)
        expected = expected if isinstance(expected, tuple) else (expected,)
        for index, (grad, want) in enumerate(zip(grads, expected)):
            assert grad.dtype == case.args[index].dtype
            assert bitwise_equal(grad, want), f"{name} gradient {index} differs from the NumPy call"


@pytest.mark.parametrize("dtype", [np.dtype(np.complex64), np.dtype(np.complex128)], ids=str)
def test_complex_pad_gradient_equals_the_numpy_call(dtype):
    with _x64(dtype):
        case = pad_case(dtype)
        _, (grad,), g = _vjp(case, dtype)
        assert bitwise_equal(grad, case.direct(g, *case.args))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("padding", [(-2, 1, 0, 0), (1, -3, 0, 0), (0, 1, -3, 2), (-4, 2, 2, -4)])
def test_pad_cropping_a_whole_side_has_jaxs_gradient(padding, layout):
    """A negative pad cropping a whole side (the other side's pad replicating what is left):
    the gradient of JAX's own edge pad and slices (fastbwd's kernel once gave such rows a 0)."""
    x = jnp.asarray(random((2, 3, 3, 3), np.float32, 41))
    left, right, top, bottom = padding

    def plain(x):  # NCHW: pad the positive sides, then crop the negative ones
        widths = ((0, 0), (0, 0), (max(top, 0), max(bottom, 0)), (max(left, 0), max(right, 0)))
        padded = jnp.pad(x, widths, mode="edge")
        h, w = padded.shape[2:]
        return padded[:, :, max(-top, 0) : h - max(-bottom, 0), max(-left, 0) : w - max(-right, 0)]

    def ours(x):
        if layout == "NCHW":
            return fj.replication_pad2d(x, padding)
        return jnp.moveaxis(fj.replication_pad2d(jnp.moveaxis(x, 1, -1), padding, layout="NHWC"), -1, 1)

    g = jnp.asarray(random(plain(x).shape, np.float32, 42))
    expected = jax.vjp(plain, x)[1](g)[0]
    output, vjp = jax.vjp(ours, x)
    assert output.shape == g.shape
    np.testing.assert_allclose(np.asarray(vjp(g)[0]), np.asarray(expected), rtol=1e-6, atol=1e-6)


def test_eager_vjp_equals_jitted():
    case = CASES["avg_pool"](np.float32)
    _, eager, _ = _vjp(case, np.float32, jit=False)
    _, jitted, _ = _vjp(case, np.float32, jit=True)
    assert bitwise_equal(eager[0], jitted[0])


@pytest.mark.covering(key=_operator_and_layout)
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_pure_jax_reference(name, dtype):
    """Forward and gradients against jax.vjp of the reference forward, run in float64 on the same
    values (the semantics' tolerances)."""
    with jax.enable_x64(True):
        case = CASES[name](dtype)
        out, grads, g = _vjp(case, dtype)
        wide = [jnp.asarray(a.astype(np.float64)) for a in case.args]
        expected_out, pullback = jax.vjp(case.reference, *wide)
        expected_grads = pullback(jnp.asarray(g.astype(np.float64)))
    rtol = case.rtol if case.rtol and dtype == np.float32 else None
    assert_matches_reference(out, np.asarray(expected_out), rtol=rtol)
    for grad, want in zip(grads, expected_grads):
        assert_matches_reference(grad, np.asarray(want), rtol=rtol, atol=rtol)


@pytest.mark.covering(key=_operator_and_layout, strength=1)
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize(
    "name", ["upsample", "avg_pool", "avg_pool-same-nhwc", "pad", "pad-nhwc", "roi_align", "roi_align-nhwc"]
)
def test_half_formats_are_rounded_once(name, dtype):
    """The linear operators in half formats: forward and gradient within 1 ulp of the float64
    reference on the same (upcast) values."""
    case = CASES[name](dtype)
    out, (grad,), g = _vjp(case, dtype)
    with jax.enable_x64(True):
        wide = jnp.asarray(case.args[0].astype(np.float64))
        expected_out, pullback = jax.vjp(case.reference, wide)
        (expected_grad,) = pullback(jnp.asarray(g.astype(np.float64)))
    assert_matches_reference(out, np.asarray(expected_out))
    assert_matches_reference(grad, np.asarray(expected_grad))


@pytest.mark.covering(key=_operator_and_layout, strength=1)
@pytest.mark.parametrize("name", list(CASES))
def test_check_grads_float64(name):
    with jax.enable_x64(True):
        case = CASES[name](np.float64)
        check_grads(case.ours, tuple(jnp.asarray(a) for a in case.args), order=1, modes=["rev"])


def test_group_norm_swish_mixed_precision_gradients():
    """bfloat16 data with float32 weight and bias: the weight and bias gradients in float32."""
    case = group_norm_swish_case(BF16, parameter_dtype=np.float32)
    _, grads, g = _vjp(case, BF16)
    assert [grad.dtype for grad in grads] == [BF16, np.float32, np.float32]
    for grad, want in zip(grads, case.direct(g, *case.args)):
        assert bitwise_equal(grad, want)


def test_roi_align_nhwc_is_the_nchw_result_transposed():
    """layout="NHWC": the forward and the input gradient are the NCHW ones transposed, bitwise;
    a bad layout is an error of roi_align at trace time."""
    nchw, nhwc = roi_align_case(np.float32, 0, True), roi_align_case(np.float32, 0, True, "NHWC")
    (x,), (x_nhwc,) = nchw.args, nhwc.args
    out, pullback = jax.vjp(nchw.ours, jnp.asarray(x))
    out_nhwc, pullback_nhwc = jax.vjp(nhwc.ours, jnp.asarray(x_nhwc))
    assert out_nhwc.shape == (6, 3, 2, 3)
    assert bitwise_equal(np.asarray(out_nhwc), np.moveaxis(np.asarray(out), 1, -1))
    g = random(out.shape, np.float32, 9)
    (grad,) = pullback(jnp.asarray(g))
    (grad_nhwc,) = jax.jit(pullback_nhwc)(jnp.asarray(np.ascontiguousarray(np.moveaxis(g, 1, -1))))
    assert grad_nhwc.shape == x_nhwc.shape
    assert bitwise_equal(np.asarray(grad_nhwc), np.moveaxis(np.asarray(grad), 1, -1))
    with pytest.raises(fastbwd.ParamError, match=r"^roi_align: layout must be one of 'NCHW', 'NHWC', but got 'CNHW'"):
        fj.roi_align(x, roi_boxes(6, (2, 3, 10, 12), 0.5), 2, layout="CNHW")


def test_roi_align_forward_is_fastbwds_kernel_and_boxes_get_zero_gradient():
    case = roi_align_case(np.float32)
    x, boxes = jnp.asarray(case.args[0]), jnp.asarray(roi_boxes(6, (2, 3, 10, 12), 0.5))
    out = fj.roi_align(x, boxes, (3, 2), 0.5, 2, True)
    assert bitwise_equal(np.asarray(out), roi_align_forward(case.args[0], np.asarray(boxes), 3, 2, 0.5, 2, True))
    box_grad = jax.grad(lambda b: jnp.sum(fj.roi_align(x, b, (3, 2), 0.5, 2, True)))(boxes)
    assert not np.asarray(box_grad).any()


def test_roi_align_takes_a_list_of_boxes_per_image():
    x = jnp.asarray(random((2, 3, 10, 12), np.float32, 4))
    per_image = [
        jnp.asarray([[1.0, 2.0, 9.0, 8.0]], np.float32),
        jnp.asarray([[0.0, 0.0, 5.0, 5.0], [3.0, 1.0, 11.0, 7.0]], np.float32),
    ]
    rows = jnp.asarray([[0, 1, 2, 9, 8], [1, 0, 0, 5, 5], [1, 3, 1, 11, 7]], np.float32)
    assert bitwise_equal(np.asarray(fj.roi_align(x, per_image, 2)), np.asarray(fj.roi_align(x, rows, 2)))


# ---- jax.vmap ---------------------------------------------------------------------------------


def _per_element_and_vmapped(case, batch_axis):
    """The gradients of a batch of 3 by jax.vmap (batch at ``batch_axis`` of each argument)
    and by the NumPy call one element at a time."""
    arrays = [np.stack([random(a.shape, a.dtype, 20 + i) for i in range(3)], axis=batch_axis) for a in case.args]
    elements = [[np.take(a, i, batch_axis) for a in arrays] for i in range(3)]
    y = jax.eval_shape(case.ours, *[jnp.asarray(a) for a in elements[0]])
    gs = np.stack([random(y.shape, y.dtype, 30 + i) for i in range(3)])

    def grads(g, *args):
        return jax.vjp(case.ours, *args)[1](g)

    _RECORDED_STATISTICS.clear()
    vmapped = jax.block_until_ready(
        jax.jit(jax.vmap(grads, in_axes=(0,) + (batch_axis,) * len(arrays)))(
            jnp.asarray(gs), *[jnp.asarray(a) for a in arrays]
        )
    )
    recorded = list(_RECORDED_STATISTICS)
    single = []
    for i in range(3):
        if recorded:  # group_norm_swish: the statistics of element i as the vmapped forward saved them
            _RECORDED_STATISTICS.append(recorded[i])
        result = case.direct(gs[i], *elements[i])
        single.append(result if isinstance(result, tuple) else (result,))
    return vmapped, single


@pytest.mark.covering(key=_operator_and_layout, strength=1)
@pytest.mark.parametrize("batch_axis", [0, 1])
@pytest.mark.parametrize(
    "name",
    [
        "upsample",
        "upsample-nhwc-corners",
        "avg_pool",
        "avg_pool-3d-divisor",
        "avg_pool-nhwc",
        "avg_pool-same-nhwc",
        "pad",
        "pad-3d",
        "pad-nhwc",
        "roi_align",
        "group_norm_swish",
        "group_norm_swish-nhwc",
        "group_norm",
    ],
)
def test_vmap_equals_the_numpy_call_per_element(name, batch_axis):
    case = CASES[name](np.float32)
    vmapped, single = _per_element_and_vmapped(case, batch_axis)
    for index, grad in enumerate(vmapped):
        for i in range(3):
            assert bitwise_equal(np.asarray(grad[i]), single[i][index]), f"element {i}, gradient {index}"


def test_vmap_folds_the_batch_into_one_kernel_call(monkeypatch):
    """The fold targets see the vmap batch merged into N (one call of the NumPy function);
    nested vmaps too."""
    shapes = []
    original = avg_pool_api.run

    def spy(plan, grad_output, *args):
        shapes.append(grad_output.shape)
        return original(plan, grad_output, *args)

    monkeypatch.setattr(avg_pool_api, "run", spy)
    x = jnp.asarray(random((4, 5, 2, 3, 9, 8), np.float32, 1))

    def grad(x):
        return jax.grad(lambda x: jnp.sum(fj.avg_pool2d(x, 2) ** 2))(x)

    result = jax.block_until_ready(jax.jit(jax.vmap(jax.vmap(grad)))(x))
    assert shapes == [(40, 3, 4, 4)]
    assert bitwise_equal(np.asarray(result[1, 2]), np.asarray(grad(x[1, 2])))


# ---- arguments are checked at trace time -------------------------------------------------------

X = np.zeros((2, 3, 8, 8), np.float32)
#: Each bridge function's errors name it and its own arguments, never the fastbwd function it
#: plans through (a backward's grad_output, a forward's pooled_height).
ERRORS = [
    (lambda x: fj.upsample_bilinear2d(x, (0, 4)), r"^upsample_bilinear2d: output_size\[0\] must be > 0"),
    (lambda x: fj.upsample_bilinear2d(x, (4,)), r"^upsample_bilinear2d: output_size must have length 2"),
    (lambda x: fj.upsample_bilinear2d(x, (4, 4), layout="NHCW"), r"^upsample_bilinear2d: layout must be one of"),
    (
        lambda x: fj.upsample_bilinear2d(x, (4, 4), align_corners=1),
        r"^upsample_bilinear2d: align_corners must be a bool, but got 1",
    ),
    (lambda x: fj.upsample_bilinear2d(x[0], (4, 4)), r"^upsample_bilinear2d: x must be 4-D, but got 3-D"),
    (
        lambda x: fj.upsample_bilinear2d(x.astype(jnp.int32), (4, 4)),
        r"^upsample_bilinear2d: x.dtype must be one of float32, float16, bfloat16, float64, but got int32",
    ),
    (
        lambda x: fj.upsample_bilinear2d(x[:, :, :0], (4, 4)),
        r"^upsample_bilinear2d: x.shape\[2\] must be > 0, but got 0",
    ),
    (
        lambda x: fj.upsample_bilinear2d(x[:, :0], (4, 4), layout="NHWC"),
        r"^upsample_bilinear2d: x.shape\[1\] must be > 0, but got 0",
    ),
    (
        lambda x: fj.upsample_bilinear2d(x, (4, 2**20 + 1)),
        r"^upsample_bilinear2d: output_size\[1\] must be at most 1048576, but got 1048577",
    ),
    (lambda x: fj.avg_pool2d(x, 0), r"^avg_pool2d: kernel_size\[0\] must be > 0, but got 0"),
    (lambda x: fj.avg_pool2d(x, 3, 2, 2), r"^avg_pool2d: padding\[0\] must be at most half of kernel_size"),
    (lambda x: fj.avg_pool2d(x, 9), r"^avg_pool2d: kernel_size\[0\] must leave an output height >= 1"),
    (lambda x: fj.avg_pool2d(x, 2.0), r"^avg_pool2d: kernel_size must be a sequence of integers, but got 2.0"),
    (lambda x: fj.avg_pool2d(x[0, 0], 2), r"^avg_pool2d: x must be 3-D or 4-D, but got 2-D"),
    (lambda x: fj.avg_pool2d(x.astype(jnp.int32), 2), r"^avg_pool2d: x.dtype must be one of"),
    (lambda x: fj.avg_pool2d(x[:, :0], 2), r"^avg_pool2d: x.shape\[1\] must be > 0"),
    (lambda x: fj.avg_pool2d(x, 2, layout="HWC"), r"^avg_pool2d: layout must be one of 'NCHW', 'NHWC', but got 'HWC'"),
    (lambda x: fj.avg_pool2d(x, (2, 9), layout="NHWC"), r"^avg_pool2d: kernel_size\[1\] must leave an output width"),
    (lambda x: fj.avg_pool2d(x[:, :, :0], 2, layout="NHWC"), r"^avg_pool2d: x.shape\[2\] must be > 0"),
    (lambda x: fj.replication_pad2d(x, (1, 1, 1)), r"^replication_pad2d: padding must have length 4"),
    (lambda x: fj.replication_pad2d(x, (8, 0, 0, 0)), r"^replication_pad2d: padding\[0\] \(left\) must be less than"),
    (
        lambda x: fj.replication_pad2d(x, (-5, -4, 0, 0)),
        r"^replication_pad2d: padding must leave a padded size of at least 1 x 1",
    ),
    (lambda x: fj.replication_pad2d(x[0, 0], (1, 1, 1, 1)), r"^replication_pad2d: x must be 3-D or 4-D, but got 2-D"),
    (lambda x: fj.replication_pad2d(x.astype(jnp.int32), (1, 1, 1, 1)), r"^replication_pad2d: x.dtype must be one of"),
    (lambda x: fj.replication_pad2d(x[:, :0], (1, 1, 1, 1)), r"^replication_pad2d: x.shape\[1\] must be > 0"),
    (
        lambda x: fj.replication_pad2d(x, (1, 1, 1, 1), layout="nhwc"),
        r"^replication_pad2d: layout must be one of 'NCHW', 'NHWC', but got 'nhwc'",
    ),
    (
        lambda x: fj.replication_pad2d(x, (0, 0, 3, 0), layout="NHWC"),
        r"^replication_pad2d: padding\[2\] \(top\) must be less than the input height 3",
    ),
    (lambda x: fj.group_norm_swish(x, 2, jnp.ones(3), jnp.zeros(3)), r"^group_norm_swish: num_groups must divide"),
    (lambda x: fj.group_norm_swish(x, 3, jnp.ones(4), jnp.zeros(3)), r"^group_norm_swish: weight.shape must be"),
    (lambda x: fj.group_norm_swish(x, 3, jnp.ones(3), jnp.zeros(4)), r"^group_norm_swish: bias.shape must be"),
    (
        lambda x: fj.group_norm_swish(x, 3, jnp.ones(3, jnp.int32), jnp.zeros(3)),
        r"^group_norm_swish: weight.dtype must be x's dtype \(float32\) or float32, but got int32",
    ),
    (lambda x: fj.group_norm_swish(x.astype(jnp.int32), 3, jnp.ones(3), jnp.zeros(3)), r"^group_norm_swish: x.dtype"),
    (
        lambda x: fj.group_norm_swish(x, 3, jnp.ones(3), jnp.zeros(3), eps="1"),
        r"^group_norm_swish: eps must be a real number",
    ),
    (
        lambda x: fj.group_norm_swish(x, 3, jnp.ones(3), jnp.zeros(3), swish_scale="1"),
        r"^group_norm_swish: swish_scale must be a real number",
    ),
    (
        lambda x: fj.group_norm_swish(x, 3, jnp.ones(3), jnp.zeros(3), layout="NCL"),
        r"^group_norm_swish: layout must be one of",
    ),
    (
        lambda x: fj.group_norm_swish(x, 3, jnp.ones(3), jnp.zeros(3), activate_swish=1),
        r"^group_norm_swish: activate_swish must be a bool, but got 1",
    ),
    (lambda x: fj.roi_align(x, jnp.zeros((4, 4)), 7), r"^roi_align: boxes must have shape \(K, 5\)"),
    (
        lambda x: fj.roi_align(x, jnp.zeros((4, 5)), 7, spatial_scale=0.0),
        r"^roi_align: spatial_scale must be greater than FLT_MIN",
    ),
    (lambda x: fj.roi_align(x, jnp.zeros((4, 5)), (7, 0)), r"^roi_align: output_size\[1\] must be > 0, but got 0"),
    (lambda x: fj.roi_align(x, jnp.zeros((4, 5)), (7, 7, 7)), r"^roi_align: output_size must be an int or a pair"),
    (
        lambda x: fj.roi_align(x, jnp.zeros((4, 5)), 7, sampling_ratio=2.0),
        r"^roi_align: sampling_ratio must be an integer",
    ),
    (lambda x: fj.roi_align(x, [jnp.zeros((2, 5))], 7), r"^roi_align: boxes\[0\] must be an array of shape \(L, 4\)"),
    (
        lambda x: fj.roi_align(x, jnp.zeros((4, 5), jnp.float16), 7),
        r"^roi_align: boxes.dtype must equal input.dtype",
    ),
    (lambda x: fj.roi_align(x.astype(jnp.int32), jnp.zeros((4, 5)), 7), r"^roi_align: input.dtype must be one of"),
]


@pytest.mark.parametrize("call, match", ERRORS, ids=[m for _, m in ERRORS])
def test_errors_raise_at_trace_time(call, match):
    traced = []

    def function(x):
        traced.append(True)
        return call(x)

    with raises_param_error(match):
        jax.jit(function).trace(jnp.asarray(X))  # tracing only: nothing compiles or runs
    assert traced
    with pytest.raises(fastbwd.ParamError) as caught:
        call(jnp.asarray(X))
    message = str(caught.value)
    for word in ("_backward", "_forward", "grad_output", "pooled_", "input_size", "gamma", "beta", "data_format"):
        assert word not in message, message
    assert caught.value.param == re.match(r"\w+: (\w+)", message).group(1)


# ---- the transport ----------------------------------------------------------------------------


def test_input_buffers_are_read_in_place():
    """The handler's input array is XLA's buffer itself (the jitted function's argument)."""
    addresses = []

    def adapter(inputs, outputs, config):
        addresses.append(inputs[0].ctypes.data)
        assert not inputs[0].flags.writeable
        outputs[0][...] = inputs[0] * config["factor"]

    name = _ffi.target("test_probe", adapter, fold=False)
    x = jnp.arange(6 * 1024, dtype=jnp.float32)
    result = jax.jit(lambda x: _ffi.call(name, [x], [jax.ShapeDtypeStruct(x.shape, x.dtype)], dict(factor=3))[0])(x)
    assert bitwise_equal(np.asarray(result), np.asarray(x) * 3)
    assert addresses == [x.unsafe_buffer_pointer()]


def test_the_handler_keeps_the_prepared_call_its_adapter_returns():
    """An adapter that returns its call prepared runs once per config and buffers' shapes and
    dtypes (in any program); the handler runs the prepared call when they repeat."""
    made, ran = [], []

    def adapter(inputs, outputs, config):
        made.append((inputs[0].shape, config["factor"]))
        factor = config["factor"]

        def prepared(inputs, outputs):
            ran.append(inputs[0].shape)
            outputs[0][...] = inputs[0] * factor

        prepared(inputs, outputs)
        return prepared

    name = _ffi.target("test_prepared_probe", adapter, fold=False)

    def program(factor):
        config = dict(factor=factor)
        return jax.jit(lambda x: _ffi.call(name, [x], [jax.ShapeDtypeStruct(x.shape, x.dtype)], config)[0])

    six, eight = jnp.arange(6, dtype=jnp.float32), jnp.arange(8, dtype=jnp.float32)
    for function, x, factor in ((program(3), six, 3),) * 3 + ((program(3), eight, 3), (program(2), six, 2)):
        assert bitwise_equal(np.asarray(function(x)), np.asarray(x) * factor)
    assert made == [((6,), 3), ((8,), 3), ((6,), 2)]
    assert ran == [(6,), (6,), (6,), (8,), (6,)]


def test_a_jitted_gradient_prepares_its_call_once(monkeypatch):
    """fastbwd.jax's handlers hold prepared calls: a training loop's repeated gradient prepares
    (validates and plans) its backward once, and each call gives the NumPy function's bits."""
    from fastbwd.api import _plans
    from fastbwd.api import upsample_bilinear2d as upsample_api

    backward = upsample_api.upsample_bilinear2d_backward
    prepared = []
    monkeypatch.setattr(backward, "prepare", lambda *a, _f=backward.prepare, **k: prepared.append(1) or _f(*a, **k))
    _plans.forget_all()
    step = jax.jit(jax.grad(lambda x, g: jnp.sum(fj.upsample_bilinear2d(x, (10, 12)) * g)))
    x, g = random((2, 3, 5, 6), np.float32, 70), random((2, 3, 10, 12), np.float32, 71)
    expected = fastbwd.upsample_bilinear2d_backward(g, (10, 12), x.shape)
    assert prepared == []
    for _ in range(3):
        assert bitwise_equal(np.asarray(step(jnp.asarray(x), jnp.asarray(g))), expected)
    assert prepared == [1]


def test_a_failing_handler_raises_in_the_caller():
    def adapter(inputs, outputs, config):
        raise RuntimeError("deliberate failure 1234")

    name = _ffi.target("test_failure", adapter, fold=False)
    call = jax.jit(lambda x: _ffi.call(name, [x], [jax.ShapeDtypeStruct(x.shape, x.dtype)], {})[0])
    with pytest.raises(Exception, match="deliberate failure 1234"):
        np.asarray(call(jnp.ones(3)))


@pytest.mark.parametrize("name", ["upsample", "avg_pool", "pad"])
def test_empty_batch(name):
    case = CASES[name](np.float32)
    x = case.args[0][:0]
    out, pullback = jax.vjp(case.ours, jnp.asarray(x))
    (grad,) = pullback(jnp.zeros(out.shape, out.dtype))
    assert grad.shape == x.shape and out.shape[0] == 0


def test_jax_guide_example_runs():
    import pathlib
    import re

    guide = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "jax.md").read_text()
    code = re.search(r"```python\n(.*?)```", guide, re.S).group(1)
    namespace = {}
    exec(compile(code, "docs/jax.md", "exec"), namespace)  # noqa: S102 - our own documentation
    dx, dweight, dbias = namespace["grads"]
    assert dx.shape == (2, 64, 32, 32) and dweight.shape == dbias.shape == (64,)
    assert np.isfinite(np.asarray(dx)).all() and np.asarray(dx).any()


def test_import_fastbwd_does_not_import_jax_and_bridge_says_how_to_install():
    code = (
        "import sys, fastbwd; assert 'jax' not in sys.modules and 'jaxlib' not in sys.modules\n"
        "sys.modules['jax'] = None\n"
        "try:\n    import fastbwd.jax\nexcept ImportError as e:\n    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install jax" in result.stdout
