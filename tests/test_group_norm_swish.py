"""group_norm_swish_backward (docs/semantics.md §5) against the float64 reference, finite differences and
PyTorch autograd; every dtype, layout, flag and limit; threads, out=, strides; every error.
Also the accuracy of the kernel module's vectorisable exp and Swish derivative."""

import itertools
import warnings

import numba
import numpy as np
import pytest

from bench.inputs import group_norm_swish_inputs
from fastbwd import group_norm_swish_backward as gns_bwd
from fastbwd.api import _plans
from fastbwd.kernels import group_norm_swish as kernels
from fastbwd.kernels._group_norm_backward import GNEW_STACK
from fastbwd.testing import reference as ref
from fastbwd.testing.checks import assert_matches_reference, bitwise_equal

import kernel_twins
from _covering import float32_quick
from conftest import BF16, assert_thread_invariant, has_the_bits_of, raises_param_error, to_nhwc

F = "group_norm_swish_backward"
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
HALVES = [F16, BF16]


def inputs(shape, groups, dtype, seed=0, param_dtype=None):
    """dy, mean, rstd, x, gamma, beta (NCHW family) from the shared case builder, with gamma
    redrawn from [-1.5, 1.5] and every fifth channel's gamma 0 (from the third): a kernel that
    dropped gamma's sign (or used |gamma|) anywhere must fail."""
    dy, mean, rstd, x, gamma, beta = group_norm_swish_inputs(shape, groups, dtype, seed=seed, param_dtype=param_dtype)
    signed = np.random.default_rng(seed + 1000).uniform(-1.5, 1.5, gamma.shape)
    signed[2::5] = 0.0
    return dy, mean, rstd, x, signed.astype(gamma.dtype), beta


def perturbed_statistics(mean, rstd, seed):
    """mean shifted by up to +-0.5 and rstd scaled by 0.6 to 1.6, per (n, group): statistics
    that are not x's own, so only a kernel that uses the ones it is given matches."""
    rng = np.random.default_rng(seed + 2000)
    shifted = np.asarray(mean, np.float64) + rng.uniform(-0.5, 0.5, mean.shape)
    scaled = np.asarray(rstd, np.float64) * rng.uniform(0.6, 1.6, rstd.shape)
    return shifted.astype(mean.dtype), scaled.astype(rstd.dtype)


def nhwc_streaming(shape, groups, dtype):
    """Whether the backward's plan of an NHWC call on x of NCHW-family ``shape`` streams dx."""
    from fastbwd._dtypes import compute_dtype, storage_format

    batch, channels = shape[:2]
    geometry = kernels.Geometry(
        True,
        batch,
        channels,
        int(np.prod(shape[2:])),
        groups,
        np.dtype(dtype).itemsize,
        storage_format(dtype),
        compute_dtype(dtype),
        storage_format(dtype),
        True,
        True,
        1,
    )
    groups_per_task, streaming, fmt = kernels.plan(geometry).arguments
    return streaming


def expected(args, groups, scale=1.0):
    """The float64 reference from the same (upcast) inputs."""
    dy, mean, rstd, x, gamma, beta = (np.asarray(a).astype(np.float64) for a in args)
    return ref.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, groups, scale)


def run(args, groups, data_format, scale):
    """gns_bwd in either layout from NCHW-family args; results returned in NCHW order."""
    if data_format == "NHWC":
        dy, mean, rstd, x, gamma, beta = args
        dx, dgamma, dbeta = gns_bwd(to_nhwc(dy), mean, rstd, to_nhwc(x), gamma, beta, groups, "NHWC", scale)
        return np.moveaxis(dx, -1, 1), dgamma, dbeta
    return gns_bwd(*args, groups, data_format, scale)


def assert_all_match(results, references, **tolerance):
    for result, reference in zip(results, references):
        assert_matches_reference(result, reference, **tolerance)


# Random non-square cases (shape, G, swish_scale): ranks 2 to 5, tails of the 16 lanes, one
# multi-block spatial size (4550 > BLOCK = 4096), scales of both signs and 0 (all exact in float32).
CASES = [
    ((3, 12, 7, 5), 4, 1.0),
    ((2, 6, 300), 3, -0.75),
    ((4, 40), 5, 0.0),
    ((2, 4, 3, 5, 6), 2, 2.5),
    ((1, 6, 70, 65), 2, 1.0),
    ((2, 8, 17, 1), 8, 0.5),
]


# --------------------------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", float32_quick([F64, F32]), ids=str)
@pytest.mark.parametrize("shape, groups, scale", CASES)
def test_matches_reference(dtype, shape, groups, scale):
    args = inputs(shape, groups, dtype, seed=len(shape) + groups)
    results = gns_bwd(*args, groups, "NCHW", scale)
    for result, like in zip(results, (args[3], args[4], args[4])):
        assert result.dtype == dtype and result.shape == like.shape and result.flags.c_contiguous
    assert_all_match(results, expected(args, groups, scale))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_finite_differences_of_the_forward(seed):
    """dx, dgamma, dbeta (float64) equal central differences of sum(dy * forward)."""
    rng = np.random.default_rng(seed)
    shape, groups, scale, eps, h = (2, 6, 3, 2), 3, 0.8, 1e-5, 1e-6
    x, dy = rng.standard_normal(shape) * 1.5 + 0.3, rng.standard_normal(shape)
    gamma, beta = rng.uniform(0.5, 1.5, 6), rng.uniform(-0.5, 0.5, 6)
    _, mean, rstd = ref.group_norm_swish_forward(x, gamma, beta, groups, eps, scale)
    dx, dgamma, dbeta = gns_bwd(dy, mean, rstd, x, gamma, beta, groups, "NCHW", scale)

    def numeric(which):
        arrays = [x, gamma, beta]
        grad = np.zeros_like(arrays[which])
        for index in np.ndindex(grad.shape):
            values = []
            for step in (h, -h):
                moved = [a.copy() for a in arrays]
                moved[which][index] += step
                values.append(np.sum(ref.group_norm_swish_forward(*moved, groups, eps, scale)[0] * dy))
            grad[index] = (values[0] - values[1]) / (2 * h)
        return grad

    for result, which in ((dx, 0), (dgamma, 1), (dbeta, 2)):
        np.testing.assert_allclose(result, numeric(which), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", float32_quick(HALVES, BF16), ids=str)
def test_half_formats_round_once(dtype):
    """float16/bfloat16 within 1 ulp of the reference from the same inputs, rounded once.

    dgamma and dbeta sum 2 * 4550 products here; 1 ulp still holds for them: the float32 sums
    (fixed blocks of 16 lanes) carry a relative error of about 1e-6 of the summed magnitudes,
    far below half an ulp of the half formats (2^-9 for bfloat16, 2^-12 for float16), and the
    test's small-value clause (1e-6 of the largest value) covers results that cancel to ~0.
    """
    shape, groups = (2, 6, 70, 65), 3
    args = inputs(shape, groups, dtype, seed=3)
    results = gns_bwd(*args, groups, "NCHW", 1.5)
    assert all(r.dtype == dtype for r in results)
    assert_all_match(results, expected(args, groups, 1.5))


@pytest.mark.parametrize("dtype", float32_quick(HALVES, BF16), ids=str)
@pytest.mark.parametrize(
    "shape, groups", [((2, 4, 64, 64), 4), ((1, 1, 1, 4097), 1), ((2, 4, 48, 48), 2)], ids=["4096", "4097", "4608"]
)
def test_half_formats_gnew_on_either_side_of_the_stack_scratch(dtype, shape, groups):
    """A float16/bfloat16 NCHW task keeps its gnew in a stack array for groups of up to
    GNEW_STACK elements and in an array of its own above: groups of 4096, 4097 and 4608
    elements, each within 1 ulp of the reference."""
    assert GNEW_STACK == 4096  # the sizes straddle it
    args = inputs(shape, groups, dtype, seed=5)
    assert_all_match(gns_bwd(*args, groups, "NCHW", 1.5), expected(args, groups, 1.5))


def test_mixed_precision_float32_parameters():
    """bfloat16 data with float32 mean/rstd/gamma/beta: dgamma/dbeta come back in float32."""
    shape, groups = (2, 8, 9, 11), 4
    args = inputs(shape, groups, BF16, seed=4, param_dtype=np.float32)
    dx, dgamma, dbeta = gns_bwd(*args, groups)
    assert dx.dtype == BF16 and dgamma.dtype == dbeta.dtype == F32
    reference = expected(args, groups)
    assert_matches_reference(dx, reference[0])
    assert_all_match((dgamma, dbeta), reference[1:], rtol=1e-5, atol=1e-6)
    # float16 data with a float32 gamma but float16 statistics is accepted too
    dy, mean, rstd, x, gamma, beta = inputs(shape, groups, F16, seed=5)
    result = gns_bwd(dy, mean, rstd, x, gamma.astype(np.float32), beta, groups)
    assert result[1].dtype == F32 and result[0].dtype == F16


@pytest.mark.parametrize("scale", [1.25, -0.7, -0.01, 1 / 3])
def test_matches_torch_autograd(scale):
    """PyTorch autograd of y * sigmoid(s*y) after F.group_norm, with that forward's statistics;
    float64 data uses the scale as given (-0.7, -0.01 and 1/3 are not float32 numbers: rounding
    them to float32 cost up to 7e-9 relative)."""
    torch = pytest.importorskip("torch")
    shape, groups, eps = (3, 8, 6, 5), 4, 1e-5
    rng = np.random.default_rng(6)
    x = rng.standard_normal(shape) * 2 + 0.5
    dy = rng.standard_normal(shape)
    gamma, beta = rng.uniform(-1.5, 1.5, 8), rng.uniform(-0.5, 0.5, 8)
    tx, tg, tb = (torch.tensor(a, requires_grad=True) for a in (x, gamma, beta))
    y = torch.nn.functional.group_norm(tx, groups, tg, tb, eps)
    torch_grads = torch.autograd.grad(y * torch.sigmoid(scale * y), (tx, tg, tb), torch.tensor(dy))
    _, mean, rstd = torch.ops.aten.native_group_norm(
        torch.tensor(x), torch.tensor(gamma), torch.tensor(beta), shape[0], shape[1], 30, groups, eps
    )
    for dtype, rtol in ((np.float64, 1e-11), (np.float32, 2e-5)):
        cast = [np.asarray(a, dtype) for a in (dy, mean.numpy(), rstd.numpy(), x, gamma, beta)]
        results = gns_bwd(*cast, groups, "NCHW", scale)
        for result, grad in zip(results, torch_grads):
            expect = grad.numpy()
            np.testing.assert_allclose(result, expect, rtol=rtol, atol=rtol * np.abs(expect).max())


# --------------------------------------------------------------------------------------------
# activate_swish=False: the plain GroupNorm backward (gnew = dy)
# --------------------------------------------------------------------------------------------


_WITHOUT_SWISH_SHAPES = [((3, 12, 7, 5), 4), ((2, 6, 300), 3), ((1, 6, 70, 65), 2), ((2, 64, 9, 5), 32)]


@pytest.mark.covering("dtype", "data_format", strength=1)
@pytest.mark.parametrize("dtype", float32_quick([F64, F32, F16, BF16]), ids=str)
@pytest.mark.parametrize(
    "data_format, shape, groups",
    [
        (data_format, shape, groups)
        for data_format in ("NCHW", "NHWC", "channels_last")
        for shape, groups in _WITHOUT_SWISH_SHAPES
        if data_format != "channels_last" or len(shape) == 4  # channels-last strides: 4-D arrays
    ],
)
def test_without_swish_matches_reference(dtype, data_format, shape, groups):
    """Every dtype and layout against the float64 reference without Swish (the scale is
    ignored: 0.0 and 2.5 give the same bits), and bitwise the same dx in every layout."""
    args = inputs(shape, groups, dtype, seed=31)
    dy, mean, rstd, x, gamma, beta = args
    nchw = gns_bwd(*args, groups, "NCHW", 2.5, activate_swish=False)
    if data_format == "NHWC":
        results = gns_bwd(to_nhwc(dy), mean, rstd, to_nhwc(x), gamma, beta, groups, "NHWC", 0.0, activate_swish=False)
        results = (np.moveaxis(results[0], -1, 1),) + results[1:]
    elif data_format == "channels_last":
        channels_last = (to_nhwc(dy).transpose(0, 3, 1, 2), to_nhwc(x).transpose(0, 3, 1, 2))
        results = gns_bwd(channels_last[0], mean, rstd, channels_last[1], gamma, beta, groups, activate_swish=False)
        assert results[0].transpose(0, 2, 3, 1).flags.c_contiguous
    else:
        results = gns_bwd(*args, groups, "NCHW", 0.0, activate_swish=False)
    assert all(bitwise_equal(a, b) for a, b in zip(results, nchw))
    for result, like in zip(results, (x, gamma, beta)):
        assert result.dtype == like.dtype and result.shape == like.shape
    upcast = [np.asarray(a).astype(np.float64) for a in args]
    reference = ref.group_norm_swish_backward(*upcast, groups, activate_swish=False)
    assert_all_match(results, reference)
    # not the Swish gradient
    with_swish = gns_bwd(*args, groups, "NCHW", 2.5)
    assert not bitwise_equal(with_swish[0], nchw[0])


def test_without_swish_matches_torch_native_group_norm_backward():
    """PyTorch autograd of F.group_norm alone, with that forward's statistics."""
    torch = pytest.importorskip("torch")
    shape, groups, eps = (3, 8, 6, 5), 4, 1e-5
    rng = np.random.default_rng(8)
    x, dy = rng.standard_normal(shape) * 2 + 0.5, rng.standard_normal(shape)
    gamma, beta = rng.uniform(-1.5, 1.5, 8), rng.uniform(-0.5, 0.5, 8)
    tx, tg, tb = (torch.tensor(a, requires_grad=True) for a in (x, gamma, beta))
    y = torch.nn.functional.group_norm(tx, groups, tg, tb, eps)
    torch_grads = torch.autograd.grad(y, (tx, tg, tb), torch.tensor(dy))
    _, mean, rstd = torch.ops.aten.native_group_norm(
        torch.tensor(x), torch.tensor(gamma), torch.tensor(beta), shape[0], shape[1], 30, groups, eps
    )
    for dtype, rtol in ((np.float64, 1e-11), (np.float32, 2e-5)):
        cast = [np.asarray(a, dtype) for a in (dy, mean.numpy(), rstd.numpy(), x, gamma, beta)]
        results = gns_bwd(*cast, groups, activate_swish=False)
        for result, grad in zip(results, torch_grads):
            expect = grad.numpy()
            np.testing.assert_allclose(result, expect, rtol=rtol, atol=rtol * np.abs(expect).max())


@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
def test_without_swish_is_thread_invariant(data_format):
    """Every thread count on the pool, and the serial twin, give the same bits."""
    shape, groups = (2, 12, 70, 65), 3
    dy, mean, rstd, x, gamma, beta = inputs(shape, groups, F32, seed=32)
    if data_format == "NHWC":
        dy, x = to_nhwc(dy), to_nhwc(x)

    def call():
        return gns_bwd(dy, mean, rstd, x, gamma, beta, groups, data_format, activate_swish=False)

    assert_thread_invariant(call)
    with _plans.launching("serial"):
        serial = call()
    assert all(bitwise_equal(a, b) for a, b in zip(serial, call()))


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("dtype", float32_quick(HALVES, BF16), ids=str)
@pytest.mark.parametrize("scale", [80.0, -80.0, 1e4, -1e4])
def test_huge_swish_arguments_stay_finite(dtype, scale):
    """s*y of +-80 and +-1e4: the derivative saturates without inf*0 and still matches."""
    shape, groups = (2, 4, 6, 5), 2
    args = inputs(shape, groups, dtype, seed=7)
    results = gns_bwd(*args, groups, "NCHW", scale)
    assert all(np.isfinite(r.astype(np.float64)).all() for r in results)
    assert_all_match(results, expected(args, groups, float(np.float32(scale))))


@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
@pytest.mark.parametrize("scale", [-0.7, -0.01, 0.1, 1 / 3, -1e-7])
def test_float64_uses_the_scale_as_given(scale, data_format):
    """float64 data: the scale in float64 (scales that are not float32 numbers), against the
    oracle at 1e-11 (rounding s to float32 was up to 7e-9 off)."""
    shape, groups = (2, 6, 9, 7), 3
    args = inputs(shape, groups, F64, seed=30)
    assert float(np.float32(scale)) != scale
    assert_all_match(run(args, groups, data_format, scale), expected(args, groups, scale))


@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
@pytest.mark.parametrize("scale", [8.0, -8.0, 30.0, -30.0, 1e4, -1e300])
def test_float64_saturation(scale, data_format):
    """float64 data with |s*y| well past 10 (up to ~1e301): the derivative follows the formula
    until it saturates (clamp at 750, where exp underflows), then is exactly its limit."""
    shape, groups = (2, 6, 11, 13), 3
    args = inputs(shape, groups, F64, seed=31)
    results = run(args, groups, data_format, scale)
    assert all(np.isfinite(r).all() for r in results)
    assert_all_match(results, expected(args, groups, scale))


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("dtype", float32_quick([F32, F16, BF16, F64]), ids=str)
@pytest.mark.parametrize("scale", [1e300, -1e300, np.inf, -np.inf, 1e39])
def test_huge_scale_is_a_step_without_warnings(dtype, scale):
    """A scale beyond the compute type's range (1e300 or 1e39 with float32 compute) is an
    infinity there: the derivative is the step 1 (y > 0) / 0 (y < 0), no RuntimeWarning."""
    shape, groups = (2, 4, 6, 5), 2
    args = inputs(shape, groups, dtype, seed=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = [run(args, groups, data_format, scale) for data_format in ("NCHW", "NHWC")]
    with np.errstate(over="ignore"):
        compute_scale = scale if dtype == F64 else float(np.float32(scale))
    if dtype != F64:
        assert np.isinf(compute_scale)
    for result in results:
        assert all(np.isfinite(r.astype(np.float64)).all() for r in result)
        assert_all_match(result, expected(args, groups, compute_scale))


def test_reference_swish_limits_at_infinite_scale():
    """The oracle's derivative at s = +-inf is the step (not the formula's inf * 0 = NaN)."""
    x = np.array([[-1.0, 1.0, -3.0, 3.0]])  # one group: mean 0, rstd 1 below
    mean, rstd = np.zeros((1, 1)), np.ones((1, 1))
    dy, gamma, beta = np.ones((1, 4)), np.ones(4), np.zeros(4)
    for scale, steps in ((np.inf, [0.0, 1.0, 0.0, 1.0]), (-np.inf, [1.0, 0.0, 1.0, 0.0])):
        _, _, dbeta = ref.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, 1, scale)
        assert dbeta.tolist() == steps


@pytest.mark.parametrize("dtype", float32_quick([F64, F32, BF16]), ids=str)
def test_nan_scale_gives_nan(dtype):
    shape, groups = (2, 4, 3, 5), 2
    args = inputs(shape, groups, dtype, seed=33)
    for data_format in ("NCHW", "NHWC"):
        results = run(args, groups, data_format, np.nan)
        assert all(np.isnan(r.astype(np.float64)).all() for r in results)
        assert_all_match(results, expected(args, groups, np.nan))


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("dtype", float32_quick([F64, F32, F16, BF16]), ids=str)
@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
def test_uses_the_statistics_it_is_given(dtype, data_format):
    """mean and rstd that are not x's own (shifted, scaled): the result is the oracle's from the
    same statistics, and differs from the one with x's own statistics."""
    shape, groups = (3, 8, 10, 7), 4
    dy, mean, rstd, x, gamma, beta = inputs(shape, groups, dtype, seed=34, param_dtype=F32)
    mean, rstd = perturbed_statistics(mean, rstd, 34)
    args = (dy, mean, rstd, x, gamma, beta)
    results = run(args, groups, data_format, -1.5)
    assert_all_match(results, expected(args, groups, -1.5))


def test_constant_group_with_huge_rstd_stays_finite():
    shape, groups = (2, 4, 5, 6), 2
    dy, _, _, x, gamma, beta = inputs(shape, groups, F32, seed=8)
    x[0, :2] = 3.0  # group (0, 0) constant: variance 0
    grouped = x.astype(np.float64).reshape(2, groups, -1)
    mean = grouped.mean(axis=2)
    rstd = 1.0 / np.sqrt(grouped.var(axis=2) + 1e-12)  # 1e6 for the constant group
    mean, rstd = mean.astype(np.float32), rstd.astype(np.float32)
    results = gns_bwd(dy, mean, rstd, x, gamma, beta, groups)
    assert all(np.isfinite(r).all() for r in results)
    assert_all_match(results, expected((dy, mean, rstd, x, gamma, beta), groups))


@pytest.mark.parametrize("shape, groups", [((2, 6, 5), 1), ((2, 6, 5), 6), ((2, 4000, 1), 1), ((1, 8000), 2)])
def test_group_size_limits_accepted(shape, groups):
    args = inputs(shape, groups, F32, seed=9)
    assert_all_match(gns_bwd(*args, groups), expected(args, groups))


def test_two_dimensional_input():
    shape, groups = (5, 48), 3
    args = inputs(shape, groups, F32, seed=10)
    results = gns_bwd(*args, groups, "ND")
    assert results[0].shape == shape
    assert_all_match(results, expected(args, groups))
    # "NHWC" with 2-D x is the same (N, C) layout
    assert all(bitwise_equal(a, b) for a, b in zip(gns_bwd(*args, groups, "NHWC"), results))


def test_flat_statistics_and_format_synonyms_agree():
    shape, groups = (2, 6, 4, 5), 3
    dy, mean, rstd, x, gamma, beta = inputs(shape, groups, F32, seed=11)
    baseline = gns_bwd(dy, mean, rstd, x, gamma, beta, groups)
    for data_format in ("NCHW", "ND", "NCL", "NCDHW"):
        result = gns_bwd(dy, mean.ravel(), rstd.ravel(), x, gamma, beta, groups, data_format)
        assert all(bitwise_equal(a, b) for a, b in zip(result, baseline))


def test_nan_propagates():
    shape, groups = (2, 4, 3, 3), 2
    dy, mean, rstd, x, gamma, beta = inputs(shape, groups, F32, seed=12)
    dy[1, 3, 2, 0] = np.nan
    dx, dgamma, dbeta = gns_bwd(dy, mean, rstd, x, gamma, beta, groups)
    assert np.isnan(dx[1, 2:]).all() and not np.isnan(dx[0]).any() and not np.isnan(dx[1, :2]).any()
    assert np.isnan(dbeta[3]) and np.isnan(dgamma[3]) and not np.isnan(dbeta[:3]).any()


# --------------------------------------------------------------------------------------------
# layouts, strides, threads
# --------------------------------------------------------------------------------------------


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("dtype", float32_quick([F64, F32, F16, BF16]), ids=str)
@pytest.mark.parametrize(
    "shape, groups", [((2, 12, 70, 65), 3), ((3, 20, 9, 7, 2), 5), ((2, 64, 9, 37), 32), ((2, 160, 5, 7), 32)]
)
def test_nhwc_equals_nchw_bitwise(dtype, shape, groups):
    dy, mean, rstd, x, gamma, beta = inputs(shape, groups, dtype, seed=13)
    nchw = gns_bwd(dy, mean, rstd, x, gamma, beta, groups, "NCHW", 0.5)
    nhwc = gns_bwd(to_nhwc(dy), mean, rstd, to_nhwc(x), gamma, beta, groups, "NHWC", 0.5)
    assert nhwc[0].shape == to_nhwc(x).shape and nhwc[0].flags.c_contiguous
    assert nhwc[0].dtype == dtype
    assert bitwise_equal(np.moveaxis(nhwc[0], -1, 1), nchw[0])
    assert bitwise_equal(nhwc[1], nchw[1]) and bitwise_equal(nhwc[2], nchw[2])
    assert_all_match(nchw, expected((dy, mean, rstd, x, gamma, beta), groups, 0.5))


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("dtype", float32_quick([F64, F32, F16, BF16]), ids=str)
@pytest.mark.parametrize("shape, groups", [((2, 12, 70, 65), 3), ((1, 400, 5, 3), 40)])
def test_nhwc_streaming_stores_change_no_bits(dtype, shape, groups, monkeypatch, replan):
    # (2, 12, ...) takes steps of PARTIAL_SUMS positions, (1, 400, ...) steps of one position
    dy, mean, rstd, x, gamma, beta = inputs(shape, groups, dtype, seed=19)
    nchw = gns_bwd(dy, mean, rstd, x, gamma, beta, groups, "NCHW", 0.5)
    monkeypatch.setattr(kernels, "NHWC_STREAM_MIN_BYTES", x.nbytes)  # dx has x's size: streamed ("at least")
    replan()
    assert nhwc_streaming(x.shape, groups, dtype) and not nhwc_streaming((1, 1) + x.shape[2:], 1, dtype)
    nhwc = gns_bwd(to_nhwc(dy), mean, rstd, to_nhwc(x), gamma, beta, groups, "NHWC", 0.5)
    assert bitwise_equal(np.moveaxis(nhwc[0], -1, 1), nchw[0])
    assert bitwise_equal(nhwc[1], nchw[1]) and bitwise_equal(nhwc[2], nchw[2])


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("dtype", float32_quick([F64, F32, F16, BF16]), ids=str)
@pytest.mark.parametrize("shape, groups", [((2, 12, 70, 65), 3), ((2, 336, 3, 7), 42)])
def test_nhwc_gnew_held_in_dx_every_run_width(dtype, shape, groups, monkeypatch, replan):
    # float32/float64 tasks keep gnew in their own dx elements between the passes (the others a
    # scratch): whole images (steps of PARTIAL_SUMS positions, C = 12; of one position, C = 336
    # > WHOLE_ROWS_MAX_CHANNELS) and channel runs narrower than C (their gnew rows sit at a
    # stride of C inside dx), into an out= dx holding garbage; no streaming stores (below the
    # plan's floor)
    dy, mean, rstd, x, gamma, beta = inputs(shape, groups, dtype, seed=20)
    nchw = gns_bwd(dy, mean, rstd, x, gamma, beta, groups, "NCHW", 0.5)
    dy_l, x_l = to_nhwc(dy), to_nhwc(x)
    assert not nhwc_streaming(shape, groups, dtype)
    group_size = shape[1] // groups
    for channels in (shape[1], 2 * group_size, group_size):
        monkeypatch.setattr(kernels, "NHWC_TASK_CHANNELS", channels)
        replan()
        out = (np.full_like(x_l, np.nan), np.empty_like(gamma), np.empty_like(beta))
        nhwc = gns_bwd(dy_l, mean, rstd, x_l, gamma, beta, groups, "NHWC", 0.5, out=out)
        assert nhwc[0] is out[0]
        assert bitwise_equal(np.moveaxis(out[0], -1, 1), nchw[0]), channels
        assert bitwise_equal(out[1], nchw[1]) and bitwise_equal(out[2], nchw[2]), channels


def test_channels_last_strides_are_read_in_place_and_kept():
    shape, groups = (2, 8, 6, 7), 4
    dy, mean, rstd, x, gamma, beta = inputs(shape, groups, F32, seed=14)
    x_cl = to_nhwc(x).transpose(0, 3, 1, 2)
    dy_cl = to_nhwc(dy).transpose(0, 3, 1, 2)
    dx, dgamma, dbeta = gns_bwd(dy_cl, mean, rstd, x_cl, gamma, beta, groups)
    assert dx.transpose(0, 2, 3, 1).flags.c_contiguous and not dx.flags.c_contiguous
    baseline = gns_bwd(dy, mean, rstd, x, gamma, beta, groups)
    assert bitwise_equal(np.ascontiguousarray(dx), baseline[0])
    assert bitwise_equal(dgamma, baseline[1]) and bitwise_equal(dbeta, baseline[2])


def test_strided_and_negative_stride_inputs():
    shape, groups = (2, 6, 5, 4), 3
    dy, mean, rstd, x, gamma, beta = inputs((2, 12, 10, 4), 3, F32, seed=15)
    views = (dy[:, ::2, ::-2], mean[:, ::-1], rstd[:, ::-1], x[:, 1::2, ::2], gamma[::-2], beta[1::2])
    assert views[0].shape == views[3].shape == shape
    result = gns_bwd(*views, groups)
    contiguous = gns_bwd(*(np.ascontiguousarray(v) for v in views), groups)
    assert all(bitwise_equal(a, b) for a, b in zip(result, contiguous))


def test_nhwc_task_partition_does_not_change_bits(monkeypatch, replan):
    from fastbwd.kernels._halfbits import NATIVE

    shape, groups = (3, 24, 17, 9), 6
    dy, mean, rstd, x, gamma, beta = inputs(shape, groups, F32, seed=18)
    dy, x = to_nhwc(dy), to_nhwc(x)
    expected = gns_bwd(dy, mean, rstd, x, gamma, beta, groups, "NHWC")
    for channels, per_thread in ((1, 1), (4, 8), (8, 2), (512, 1), (512, 64)):
        monkeypatch.setattr(kernels, "NHWC_TASK_CHANNELS", channels)
        monkeypatch.setattr(kernels, "NHWC_TASKS_PER_THREAD", per_thread)
        replan()
        result = gns_bwd(dy, mean, rstd, x, gamma, beta, groups, "NHWC")
        assert all(bitwise_equal(a, b) for a, b in zip(result, expected)), (channels, per_thread)
    # the kernel itself, every run length: 6 groups per task takes steps of PARTIAL_SUMS
    # positions (C = 24 <= WHOLE_ROWS_MAX_CHANNELS), fewer steps of one position
    assert shape[1] <= kernels.WHOLE_ROWS_MAX_CHANNELS
    dx_expected = np.ascontiguousarray(np.moveaxis(expected[0], -1, 1))
    sums = []
    # with and without streaming dx stores (the plan streams only a dx of 4 MB or more)
    for groups_per_task, streaming in itertools.product((1, 2, 4, 5, 6), (False, True)):
        dx = np.empty_like(x)
        sum_g, sum_gx = np.empty((3, 24), F32), np.empty((3, 24), F32)
        kernel_twins.parallel(kernels.group_norm_swish_bwd_nhwc, kernels.BACKWARD_READ_ONLY)(
            dy.reshape(3, -1, 24),
            x.reshape(3, -1, 24),
            mean,
            rstd,
            gamma,
            beta,
            np.float32(1.0),
            dx.reshape(3, -1, 24),
            sum_g,
            sum_gx,
            groups_per_task,
            streaming,
            NATIVE,
        )
        assert bitwise_equal(np.moveaxis(dx, -1, 1), dx_expected), (groups_per_task, streaming)
        sums.append((sum_g, sum_gx))
    assert all(bitwise_equal(a[0], sums[0][0]) and bitwise_equal(a[1], sums[0][1]) for a in sums)


def test_serial_twin_equals_parallel():
    from fastbwd.kernels._halfbits import NATIVE

    dy, mean, rstd, x, gamma, beta = inputs((2, 6, 300), 3, F32, seed=17)
    results = []
    for run in kernel_twins.twins(kernels.group_norm_swish_bwd_nchw, kernels.BACKWARD_READ_ONLY):
        dx, dgamma, dbeta = np.empty_like(x), np.empty(6, F32), np.empty(6, F32)
        run(dy, x, mean, rstd, gamma, beta, np.float32(1.0), dx, dgamma, dbeta, True, True, NATIVE, NATIVE)
        results.append((dx, dgamma, dbeta))
    assert all(bitwise_equal(a, b) for a, b in zip(*results))


# --------------------------------------------------------------------------------------------
# flags and out=
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("want_dgamma, want_dbeta", [(True, True), (True, False), (False, True), (False, False)])
def test_require_flags(want_dgamma, want_dbeta):
    shape, groups = (2, 6, 4, 3), 3
    args = inputs(shape, groups, F32, seed=18)
    full = gns_bwd(*args, groups)
    dx, dgamma, dbeta = gns_bwd(*args, groups, "NCHW", 1.0, want_dgamma, want_dbeta)
    assert bitwise_equal(dx, full[0])
    assert (dgamma is None) != want_dgamma and (dbeta is None) != want_dbeta
    if want_dgamma:
        assert bitwise_equal(dgamma, full[1])
    if want_dbeta:
        assert bitwise_equal(dbeta, full[2])
    # with out=: the arrays of gradients not required are zero-filled, None is returned
    out = tuple(np.full_like(a, np.nan) for a in full)
    returned = gns_bwd(*args, groups, "NCHW", 1.0, want_dgamma, want_dbeta, out=out)
    assert returned[0] is out[0] and bitwise_equal(out[0], full[0])
    for want, given, got, reference in (
        (want_dgamma, out[1], returned[1], full[1]),
        (want_dbeta, out[2], returned[2], full[2]),
    ):
        if want:
            assert got is given and bitwise_equal(given, reference)
        else:
            assert got is None and not given.any()


def test_out_entries_may_be_none_and_inputs_are_not_mutated():
    shape, groups = (2, 6, 4, 3), 3
    args = inputs(shape, groups, BF16, seed=19)
    snapshot = [a.copy() for a in args]
    full = gns_bwd(*args, groups)
    out_dgamma = np.full(6, np.nan, BF16)
    dx, dgamma, dbeta = gns_bwd(*args, groups, out=(None, out_dgamma, None))
    assert dgamma is out_dgamma and bitwise_equal(dgamma, full[1])
    assert bitwise_equal(dx, full[0]) and bitwise_equal(dbeta, full[2])
    assert all(bitwise_equal(a, b) for a, b in zip(args, snapshot))


def test_out_channels_last():
    shape, groups = (2, 8, 6, 7), 4
    dy, mean, rstd, x, gamma, beta = inputs(shape, groups, F32, seed=20)
    x_cl, dy_cl = (to_nhwc(a).transpose(0, 3, 1, 2) for a in (x, dy))
    out_cl = np.empty((2, 6, 7, 8), F32).transpose(0, 3, 1, 2)
    assert gns_bwd(dy_cl, mean, rstd, x_cl, gamma, beta, groups, out=(out_cl, None, None))[0] is out_cl
    assert bitwise_equal(np.ascontiguousarray(out_cl), gns_bwd(dy, mean, rstd, x, gamma, beta, groups)[0])
    with raises_param_error(r"out\[0\] must be C-contiguous like the result", param="out"):
        gns_bwd(dy, mean, rstd, x, gamma, beta, groups, out=(out_cl, None, None))


def test_bad_out_is_rejected_and_nothing_is_written():
    shape, groups = (2, 6, 4, 3), 3
    args = inputs(shape, groups, F32, seed=21)
    good_dx, good_dgamma = np.full(shape, 7.0, F32), np.full(6, 7.0, F32)
    cases = [
        ((good_dx, good_dgamma, np.zeros(5, F32)), r"out\[2\]\.shape must be \(6,\), but got \(5,\)", "out"),
        ((good_dx, good_dgamma, np.zeros(6, F64)), r"out\[2\]\.dtype must be float32, but got float64", "out"),
        ((good_dx, good_dgamma, good_dgamma), r"out\[2\] must not overlap out\[1\]", "out"),
        ((good_dx, args[4], None), r"out\[1\] must not overlap gamma", "out"),
        ((np.zeros((2, 6, 4, 4), F32), None, None), r"out\[0\]\.shape must be \(2, 6, 4, 3\)", "out"),
        ((good_dx, good_dgamma), r"out must be a tuple \(dx, dgamma, dbeta\) of arrays or None, but got", "out"),
        (good_dx, r"out must be a tuple \(dx, dgamma, dbeta\) of arrays or None", "out"),
        (([1.0], None, None), r"out\[0\] must be a numpy.ndarray, but got \[1.0\]", "out"),
    ]
    for out, message, param in cases:
        with raises_param_error(message, param=param):
            gns_bwd(*args, groups, out=out)
        assert (good_dx == 7).all() and (good_dgamma == 7).all()
    read_only = np.zeros(6, F32)
    read_only.flags.writeable = False
    with raises_param_error(r"out\[1\] must be writeable, but got a read-only array", param="out"):
        gns_bwd(*args, groups, out=(good_dx, read_only, None))
    with raises_param_error(r"out\[0\] must not overlap x", param="out"):
        gns_bwd(*args, groups, out=(args[3], None, None))
    assert (good_dx == 7).all()


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    shape, groups = (2, 6, 4, 3), 3
    args = inputs(shape, groups, BF16, seed=22)
    tensors = [torch.from_numpy(np.asarray(a).view(np.int16)).view(torch.bfloat16) for a in args]
    assert all(bitwise_equal(a, b) for a, b in zip(gns_bwd(*tensors, groups), gns_bwd(*args, groups)))


# --------------------------------------------------------------------------------------------
# the vectorisable exp and Swish derivative
# --------------------------------------------------------------------------------------------


@numba.njit
def _map_exp(values):
    out = np.empty_like(values)
    for i in range(values.size):
        out[i] = kernels.exp_nonpositive_float32(values[i])
    return out


@numba.njit
def _map_swish(values):
    out = np.empty_like(values)
    for i in range(values.size):
        out[i] = kernels.swish_derivative_float32(values[i])
    return out


def test_polynomial_exp_accuracy():
    """exp_nonpositive_float32 over [-104, 0]: <= 2e-7 relative down to the smallest normal
    result, 0 below (an absolute error of at most ~1.2e-38); NaN stays NaN."""
    values = np.concatenate([-np.linspace(0, 104, 1_000_001), -np.geomspace(1e-30, 104, 100_000)]).astype(F32)
    result = _map_exp(values).astype(F64)
    exact = np.exp(values.astype(F64))
    normal = values >= kernels._EXP_FLUSH  # -87.33: exp is about the smallest normal there
    assert np.max(np.abs(result[normal] - exact[normal]) / exact[normal]) <= 2e-7
    assert (result[~normal] == 0).all() and np.max(exact[~normal]) < 1.01 * np.finfo(F32).tiny
    assert _map_exp(np.array([0.0, -0.0], F32)).tolist() == [1.0, 1.0]
    assert np.isnan(_map_exp(np.array([np.nan], F32))[0])


def test_swish_derivative_accuracy_and_limits():
    """sig*(1 + z*(1-sig)) in float32 for any z: close to the float64 formula everywhere,
    exactly 1 / 0 at +-inf and beyond the clamp, NaN for NaN, never inf or NaN otherwise."""
    z = np.concatenate(
        [np.linspace(-120, 120, 400_001), np.geomspace(1e-30, 3e38, 20_000), -np.geomspace(1e-30, 3e38, 20_000)]
    ).astype(F32)
    result = _map_swish(z).astype(F64)
    z64 = z.astype(F64)
    with np.errstate(over="ignore", invalid="ignore"):
        sig = 1.0 / (1.0 + np.exp(-z64))
        exact = sig * (1.0 + z64 * (1.0 - sig))
    exact[z64 > 700] = 1.0
    exact[z64 < -700] = 0.0
    assert np.isfinite(result).all()
    # absolute error relative to the derivative's scale (it ranges over about [-0.1, 1.1])
    assert np.max(np.abs(result - exact)) <= 4e-7
    big = np.array([np.inf, 1e4, 105.0, -np.inf, -1e4, -105.0], F32)
    assert _map_swish(big).tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert np.isnan(_map_swish(np.array([np.nan], F32))[0])
    assert _map_swish(np.array([0.0], F32))[0] == 0.5


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------

_DY, _MEAN, _RSTD, _X, _GAMMA, _BETA = inputs((2, 6, 4, 3), 3, F32, seed=23)
GOOD = dict(dy=_DY, mean=_MEAN, rstd=_RSTD, x=_X, gamma=_GAMMA, beta=_BETA, num_groups=3)


def call(**changes):
    return gns_bwd(**dict(GOOD, **changes))


def zeros(shape, dtype=F32):
    return np.zeros(shape, dtype)


@pytest.mark.parametrize(
    "changes, message, param",
    [
        (dict(x=zeros((6,)), dy=zeros((6,))), r"x must have rank 2 to 8, but got 1-D with shape \(6,\)", "x"),
        (dict(x=zeros((2, 6) + (1,) * 7), dy=zeros((2, 6) + (1,) * 7)), r"x must have rank 2 to 8, but got 9-D", "x"),
        (dict(dy=zeros((2, 6, 4, 4))), r"dy\.shape must be \(2, 6, 4, 3\) \(as x\), but got \(2, 6, 4, 4\)", "dy"),
        (
            dict(x=zeros((0, 6, 4, 3)), dy=zeros((0, 6, 4, 3))),
            r"x\.shape\[0\] \(N\) must be > 0 \(empty tensors are not "
            r"supported\), but got 0",
            "x",
        ),
        (dict(x=zeros((2, 0, 4, 3)), dy=zeros((2, 0, 4, 3))), r"x\.shape\[1\] \(C\) must be > 0", "x"),
        (dict(x=zeros((2, 6, 4, 0)), dy=zeros((2, 6, 4, 0))), r"x\.shape\[3\] \(spatial\) must be > 0", "x"),
        (
            dict(x=zeros((2, 4, 3, 0)), dy=zeros((2, 4, 3, 0)), data_format="NHWC"),
            r"x\.shape\[3\] \(C\) must be > 0",
            "x",
        ),
        (dict(num_groups=0), r"num_groups must be > 0, but got 0", "num_groups"),
        (dict(num_groups=-3), r"num_groups must be > 0, but got -3", "num_groups"),
        (dict(num_groups=4), r"num_groups must divide the channel count C = 6, but got 4", "num_groups"),
        (dict(num_groups=3.0), r"num_groups must be an integer, but got 3.0 \(a float\)", "num_groups"),
        (dict(num_groups=True), r"num_groups must be an integer, but got True \(a bool\)", "num_groups"),
        (
            dict(
                x=zeros((1, 4001, 1)),
                dy=zeros((1, 4001, 1)),
                gamma=zeros(4001),
                beta=zeros(4001),
                mean=zeros((1, 1)),
                rstd=zeros((1, 1)),
                num_groups=1,
            ),
            r"num_groups must leave at most 4000 channels per group \(C = 4001\), but got 1 \(4001 channels per group\)",
            "num_groups",
        ),
        (dict(mean=zeros((2, 2))), r"mean\.shape must be \(2, 3\) or \(6,\) \(N, G\), but got \(2, 2\)", "mean"),
        (dict(mean=zeros((3, 2))), r"mean\.shape must be \(2, 3\) or \(6,\) \(N, G\), but got \(3, 2\)", "mean"),
        (dict(mean=zeros(7)), r"mean\.shape must be \(2, 3\) or \(6,\) \(N, G\), but got \(7,\)", "mean"),
        (dict(rstd=zeros(6)), r"rstd\.shape must be \(2, 3\) \(as mean\), but got \(6,\)", "rstd"),
        (dict(gamma=zeros(5)), r"gamma\.shape must be \(6,\) \(one per channel\), but got \(5,\)", "gamma"),
        (dict(beta=zeros((6, 1))), r"beta\.shape must be \(6,\) \(one per channel\), but got \(6, 1\)", "beta"),
        (
            dict(x=zeros((2, 6, 4, 3), np.int32)),
            r"x\.dtype must be one of float32, float16, bfloat16, float64, but got int32",
            "x",
        ),
        (dict(dy=zeros((2, 6, 4, 3), F64)), r"dy\.dtype must equal x\.dtype \(float32\), but got float64", "dy"),
        (dict(gamma=zeros(6, F64)), r"gamma\.dtype must be x's dtype \(float32\) or float32, but got float64", "gamma"),
        (
            dict(x=zeros((2, 6, 4, 3), BF16), dy=zeros((2, 6, 4, 3), BF16), mean=zeros((2, 3), F16)),
            r"mean\.dtype must be x's dtype \(bfloat16\) or float32, but got float16",
            "mean",
        ),
        (
            dict(rstd=zeros((2, 3), F16)),
            r"rstd\.dtype must be x's dtype \(float32\) or float32, but got float16",
            "rstd",
        ),
        (dict(beta=zeros(6, np.int64)), r"beta\.dtype must be x's dtype \(float32\) or float32, but got int64", "beta"),
        (
            dict(data_format="NDHWC"),
            r"data_format must be one of 'NCHW', 'ND', 'NCL', 'NCDHW', 'NHWC', but got 'NDHWC'",
            "data_format",
        ),
        (dict(data_format=1), r"data_format must be one of .*, but got 1", "data_format"),
        (dict(swish_scale="1"), r"swish_scale must be a real number, but got '1'", "swish_scale"),
        (dict(swish_scale=True), r"swish_scale must be a real number, but got True \(a bool\)", "swish_scale"),
        (dict(dgamma_is_require=1), r"dgamma_is_require must be a bool, but got 1", "dgamma_is_require"),
        (dict(dbeta_is_require="no"), r"dbeta_is_require must be a bool, but got 'no'", "dbeta_is_require"),
        (dict(activate_swish=1), r"activate_swish must be a bool, but got 1", "activate_swish"),
        (dict(x=np.array(["a"])), r"x must be a numeric array", "x"),
        (dict(gamma=object()), r"gamma must be a numeric array", "gamma"),
    ],
)
def test_errors(changes, message, param):
    with raises_param_error(message, param=param):
        call(**changes)


@pytest.mark.parametrize("name", ["dy", "mean", "rstd", "x", "gamma", "beta", "num_groups"])
def test_none_is_nullptr(name):
    with raises_param_error(rf"{name} is required, but got None", status=161001, param=name):
        call(**{name: None})


def test_param_error_is_value_and_type_error():
    with pytest.raises(ValueError):
        call(num_groups=4)
    with pytest.raises(TypeError):
        call(num_groups=4)


def test_none_for_optional_scalars_is_an_error():
    for name in ("data_format", "swish_scale", "dgamma_is_require", "dbeta_is_require", "activate_swish"):
        with raises_param_error(rf"{name} is required, but got None", status=161001, param=name):
            call(**{name: None})


def test_nhwc_tasks_take_whole_images_up_to_the_whole_rows_width():
    """Up to WHOLE_ROWS_MAX_CHANNELS an NHWC task takes a whole image, also with fewer images than
    threads (narrow runs of those rows read by several threads were 2-7x slower); wider images
    are cut into runs of about NHWC_TASK_CHANNELS, narrower while the batch leaves threads idle."""
    assert kernels.WHOLE_ROWS_MAX_CHANNELS == 320
    for batch, threads in ((1, 2), (1, 8), (4, 2), (3, 64)):
        assert kernels.nhwc_groups_per_task(32, 4, batch, threads) == 32, (batch, threads)
        assert kernels.nhwc_groups_per_task(32, 10, batch, threads) == 32, (batch, threads)
    assert kernels.nhwc_groups_per_task(32, 16, 1, 2) == 8  # 512 channels, 4 runs for 2 threads
    assert kernels.nhwc_groups_per_task(32, 16, 8, 2) == 32


def _planned_tasks(nhwc, batch, channels, groups, threads):
    """The tasks the forward's and the backward's plans launch (the fewer), read from the plans."""
    from fastbwd.kernels._halfbits import NATIVE

    positions, compute = 4096, np.dtype(np.float32)  # enough work for the parallel launches
    forward = kernels.plan(
        kernels.ForwardGeometry(nhwc, batch, channels, positions, groups, NATIVE, compute, True, threads)
    )
    backward = kernels.plan(
        kernels.Geometry(nhwc, batch, channels, positions, groups, 4, NATIVE, compute, NATIVE, True, True, threads)
    )
    assert forward.launch.parallel and backward.dx.parallel
    backward_per_task = backward.arguments[0] if nhwc else 1
    return batch * min(-(-groups // forward.groups_per_task), -(-groups // backward_per_task))


def test_parallel_tasks_are_the_plans_tasks():
    """What the bridges' decision counts (api ``parallel_tasks``) is what the kernels launch: an
    NHWC image of up to WHOLE_ROWS_MAX_CHANNELS channels is one task, whatever the threads."""
    from fastbwd.api import group_norm_swish as api

    for nhwc, batch, channels, groups, threads in itertools.product(
        (False, True), (1, 2, 3, 8), (16, 64, 320, 512, 1024), (1, 4, 8, 32), (1, 2, 3, 4, 16)
    ):
        if channels % groups:
            continue
        expected = _planned_tasks(nhwc, batch, channels, groups, threads)
        data_format = "NHWC" if nhwc else "NCHW"
        assert api.parallel_tasks(batch, channels, groups, data_format, threads) == expected
    assert api.parallel_tasks(1, 128, 32, "NHWC", 2) == 1  # one image: one thread of two busy
    assert api.parallel_tasks(1, 128, 32, "NCHW", 2) == 16  # the forward pairs groups
    assert api.parallel_tasks(1, 512, 32, "NHWC", 2) == 4
    assert api.parallel_tasks(2, 16, 3, "NCHW", 2) is None  # groups the kernels refuse
    assert api.parallel_tasks(2, 16, 0, "NHWC", 2) is None


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=str)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_nan_gradients_are_the_positive_nan(dtype, layout):
    """Every NaN of dx, dgamma and dbeta is stored as the quiet NaN of positive sign, whichever
    NaN (dy's, x's, a sum's) reached it: which of two NaN an operation returns follows the
    compiled code's operand order, so the signs would follow the task partition and the CPU."""
    dy, mean, rstd, x, gamma, beta = group_norm_swish_inputs((2, 8, 3, 5), 4, dtype, seed=23)
    dy[0, 0, 1, 2] = -np.nan  # group 0 of image 0: a negative NaN alone
    dy[1, 2, 0, 0], x[1, 3, 2, 4] = np.nan, -np.nan  # group 1 of image 1: both signs
    dx, dgamma, dbeta = run((dy, mean, rstd, x, gamma, beta), 4, layout, 1.0)
    nan_groups = {(0, 0), (1, 1)}  # their sums are NaN, so every dx of theirs is
    for n in range(2):
        for g in range(4):
            group = dx[n, 2 * g : 2 * g + 2]
            if (n, g) in nan_groups:
                assert has_the_bits_of(group, np.nan).all(), (n, g)
            else:
                assert np.isfinite(group.astype(np.float64)).all(), (n, g)
    for parameter_grad in (dgamma, dbeta):
        assert has_the_bits_of(parameter_grad[[0, 2, 3]], np.nan).all()  # channels of those groups
        assert np.isfinite(parameter_grad[[4, 5, 6, 7]].astype(np.float64)).all()


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=str)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_nan_gradients_of_a_negative_nan_rstd_or_one_image_are_the_positive_nan(dtype, layout):
    """A NaN rstd of negative sign given by the caller, and the NaN sums of a single image, give
    positive NaN too: the one NaN is taken of dx after its last product (``rstd * ...``), and of
    dgamma/dbeta also when there is no second row of sums to add (tools/mutants/nan_audit.toml)."""
    dy, mean, rstd, x, gamma, beta = group_norm_swish_inputs((1, 8, 3, 5), 4, dtype, seed=29)
    rstd[0, 1] = -np.nan  # group 1: its every dx is NaN, rstd's sign last in the product
    dy[0, 6, 1, 2] = -np.nan  # channel 6 (group 3): dgamma, dbeta NaN from one image's sums
    assert np.signbit(rstd[0, 1].astype(np.float32)) and np.signbit(dy[0, 6, 1, 2].astype(np.float32))
    dx, dgamma, dbeta = run((dy, mean, rstd, x, gamma, beta), 4, layout, 1.0)
    assert has_the_bits_of(dx[0, 2:4], np.nan).all()
    assert has_the_bits_of(dx[0, 6:8], np.nan).all()
    assert np.isfinite(dx[0, [0, 1, 4, 5]].astype(np.float64)).all()
    for parameter_grad in (dgamma, dbeta):
        assert has_the_bits_of(parameter_grad[[2, 3, 6]], np.nan).all()
        assert np.isfinite(parameter_grad[[0, 1, 4, 5, 7]].astype(np.float64)).all()
