"""group_norm_swish, the forward (docs/semantics.md §5.1), against the float64 reference and
PyTorch's native_group_norm; every dtype, layout and flag; eps = 0; threads, strides, out=;
every error; and the forward's statistics fed to the backward against PyTorch autograd."""

import numpy as np
import pytest

from fastbwd import group_norm_swish as gns
from fastbwd import group_norm_swish_backward as gns_bwd
from fastbwd.kernels import group_norm_swish as kernels
from fastbwd.testing import reference as ref
from fastbwd.testing.checks import assert_matches_reference, bitwise_equal

import kernel_twins
from _covering import float32_quick
from conftest import BF16, has_the_bits_of, raises_param_error, to_nhwc

F = "group_norm_swish"
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)


def inputs(shape, groups, dtype, seed=0, param_dtype=None):
    """x (offset per group, so the statistics differ) and signed gamma (every fifth channel's 0:
    a kernel that drops gamma's sign fails), beta."""
    rng = np.random.default_rng(seed)
    n, c = shape[:2]
    offsets = rng.uniform(-2, 2, (n, c))[(...,) + (None,) * (len(shape) - 2)]
    x = (rng.standard_normal(shape) * rng.uniform(0.5, 3) + offsets).astype(dtype)
    gamma = rng.uniform(-1.5, 1.5, c)
    gamma[2::5] = 0.0
    param_dtype = dtype if param_dtype is None else param_dtype
    return x, gamma.astype(param_dtype), rng.uniform(-0.5, 0.5, c).astype(param_dtype)


def run(x, gamma, beta, groups, data_format="NCHW", **kwargs):
    """gns in either layout from NCHW-family x; y returned in NCHW order."""
    if data_format == "NHWC":
        y, mean, rstd = gns(to_nhwc(x), gamma, beta, groups, "NHWC", **kwargs)
        return np.moveaxis(y, -1, 1), mean, rstd
    return gns(x, gamma, beta, groups, data_format, **kwargs)


def expected(x, gamma, beta, groups, eps=1e-5, scale=1.0, activate=True):
    """The float64 reference from the same (upcast) inputs; the scale as the kernel uses it."""
    if np.asarray(x).dtype != F64:
        scale = float(np.float32(scale))
    return ref.group_norm_swish_forward(
        *(np.asarray(a).astype(F64) for a in (x, gamma, beta)), groups, eps, scale, activate
    )


def assert_all_match(results, references, **tolerance):
    for result, reference in zip(results, references):
        assert_matches_reference(result, reference, **tolerance)


# (shape, G, swish_scale, activate_swish): ranks 2 to 5, lane tails, a group of several blocks
# (6 * 70 * 65 / 2 > BLOCK = 4096), scales of both signs and 0.
CASES = [
    ((3, 12, 7, 5), 4, 1.0, True),
    ((2, 6, 300), 3, -0.75, True),
    ((4, 40), 5, 0.0, True),
    ((2, 4, 3, 5, 6), 2, 2.5, False),
    ((1, 6, 70, 65), 2, 1.0, True),
    ((2, 8, 17, 1), 8, -1.3, True),
]


@pytest.mark.covering
@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", float32_quick([F64, F32]), ids=str)
@pytest.mark.parametrize("shape, groups, scale, activate", CASES)
def test_matches_reference(dtype, data_format, shape, groups, scale, activate):
    x, gamma, beta = inputs(shape, groups, dtype, seed=len(shape) + groups)
    results = run(x, gamma, beta, groups, data_format, swish_scale=scale, activate_swish=activate)
    assert results[0].dtype == dtype and results[0].shape == shape
    assert results[1].shape == results[2].shape == (shape[0], groups)
    assert_all_match(results, expected(x, gamma, beta, groups, 1e-5, scale, activate))


@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", float32_quick([F16, BF16], BF16), ids=str)
def test_half_formats_round_once(dtype, data_format):
    """y, mean and rstd within 1 ulp of the reference from the same inputs, rounded once; with
    float32 parameters the statistics come back in float32."""
    shape, groups = (2, 6, 70, 65), 3
    x, gamma, beta = inputs(shape, groups, dtype, seed=3)
    results = run(x, gamma, beta, groups, data_format, swish_scale=1.5)
    assert all(r.dtype == dtype for r in results)
    assert_all_match(results, expected(x, gamma, beta, groups, scale=1.5))
    gamma32, beta32 = gamma.astype(F32), beta.astype(F32)
    y, mean, rstd = run(x, gamma32, beta32, groups, data_format, swish_scale=1.5)
    assert y.dtype == dtype and mean.dtype == rstd.dtype == F32
    reference = expected(x, gamma32, beta32, groups, scale=1.5)
    assert_matches_reference(y, reference[0])
    assert_all_match((mean, rstd), reference[1:], rtol=2e-6, atol=1e-6)


def test_float64_uses_scale_and_eps_as_given():
    x, gamma, beta = inputs((2, 6, 5, 4), 3, F64, seed=4)
    results = gns(x, gamma, beta, 3, eps=0.3, swish_scale=-0.7)
    assert_all_match(results, ref.group_norm_swish_forward(x, gamma, beta, 3, 0.3, -0.7), rtol=1e-13)


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", float32_quick([F64, F32, BF16]), ids=str)
def test_constant_group_at_eps_zero_gives_inf_rstd(dtype, data_format):
    """A constant group (whose float mean is not exact in any partial sum: 0.1 repeated) has
    variance exactly 0: at eps = 0 rstd is inf and y NaN, as in PyTorch; other groups are normal."""
    x, gamma, beta = inputs((2, 6, 40, 33), 3, dtype, seed=5)
    x[1, 2:4] = 0.1
    y, mean, rstd = run(x, gamma, beta, 3, data_format, eps=0.0)
    assert np.isinf(rstd[1, 1]) and mean[1, 1] == x[1, 2, 0, 0] and np.isnan(y[1, 2:4].astype(F64)).all()
    assert np.isfinite(rstd[0]).all() and np.isfinite(y[0].astype(F64)).all()
    assert_all_match((y, mean, rstd), expected(x, gamma, beta, 3, eps=0.0))


@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
def test_statistics_stay_exact_far_from_zero(data_format):
    """Groups at 1000 with a spread of 0.003-1 (float32 spacing there: 6e-5): the variance comes
    from centred sums, and corrects for the rounding of the mean it is centred on."""
    rng = np.random.default_rng(24)
    x = (
        1000
        + rng.standard_normal((2, 8, 20, 30)) * np.array([0.01, 0.1, 1, 0.003])[None, :, None, None].repeat(2, axis=1)
    ).astype(F32)
    gamma, beta = np.ones(8, F32), np.zeros(8, F32)
    _, mean, rstd = run(x, gamma, beta, 4, data_format)
    _, ref_mean, ref_rstd = expected(x, gamma, beta, 4)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-7)
    np.testing.assert_allclose(rstd, ref_rstd, rtol=2e-6)


def test_nan_and_inf_propagate():
    x, gamma, beta = inputs((2, 6, 5, 4), 3, F32, seed=6)
    x[0, 0, 0, 0] = np.inf  # the first element of its group, which the mean pass shifts by
    x[1, 5, 2, 1] = np.nan
    y, mean, rstd = gns(x, gamma, beta, 3)
    assert mean[0, 0] == np.inf and np.isnan(rstd[0, 0]) and np.isnan(mean[1, 2])
    assert np.isnan(y[0, :2]).all() and np.isnan(y[1, 4:]).all() and np.isfinite(y[0, 2:]).all()


@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
def test_negative_infinity_first_in_its_group(data_format):
    """-inf as a group's first element (the element its first pass shifts by): that group's mean
    is -inf, its rstd and y NaN; the other groups are as without it."""
    x, gamma, beta = inputs((2, 6, 5, 4), 3, F32, seed=24)
    clean = run(x, gamma, beta, 3, data_format)
    x[1, 2, 0, 0] = -np.inf  # group 1 of image 1: channels 2 and 3
    y, mean, rstd = run(x, gamma, beta, 3, data_format)
    assert mean[1, 1] == -np.inf and np.isnan(rstd[1, 1]) and np.isnan(y[1, 2:4]).all()
    others = np.ones((2, 3), bool)
    others[1, 1] = False
    assert bitwise_equal(mean[others], clean[1][others]) and bitwise_equal(rstd[others], clean[2][others])
    assert bitwise_equal(y[0], clean[0][0]) and bitwise_equal(y[1, [0, 1, 4, 5]], clean[0][1, [0, 1, 4, 5]])


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["first", "inside"])
def test_non_finite_in_the_second_group_of_a_paired_task(value, where):
    """An NCHW task of two groups runs their sums side by side: a non-finite value in the second
    group (as its first element, which shifts that group's sums, or inside it) gives what a task
    of that group alone gives, and leaves the first group's statistics alone."""
    shape, groups = (2, 8, 6, 5), 4
    x, gamma, beta = inputs(shape, groups, F32, seed=25)
    x[0, 2 if where == "first" else 3, 0 if where == "first" else 4, 0 if where == "first" else 3] = value
    results = []
    for groups_per_task in (1, 2):  # group 1 of image 0 is the second group of task 0 when paired
        y, mean, rstd = np.empty_like(x), np.empty((2, groups), F32), np.empty((2, groups), F32)
        kernel_twins.serial(kernels.group_norm_swish_fwd_nchw, kernels.FORWARD_READ_ONLY)(
            x.reshape(2, 8, 30),
            gamma,
            beta,
            F32.type(1e-5),
            True,
            F32.type(1),
            y.reshape(2, 8, 30),
            mean,
            rstd,
            groups_per_task,
            kernels_native(),
        )
        results.append((y, mean, rstd))
    assert all(bitwise_equal(a, b) for a, b in zip(*results))
    y, mean, rstd = results[1]
    # an infinity makes its group's sum, hence its mean, that infinity; NaN makes it NaN
    assert mean[0, 1] == value if np.isinf(value) else np.isnan(mean[0, 1])
    assert np.isnan(rstd[0, 1]) and np.isnan(y[0, 2:4]).all()
    clean = expected(np.where(np.isfinite(x), x, 0), gamma, beta, groups)
    for result, reference in zip((y[0, :2], mean[0, 0], rstd[0, 0]), (clean[0][0, :2], clean[1][0, 0], clean[2][0, 0])):
        assert_matches_reference(result, reference)
    # the public function (pairing the groups or not by the thread count) gives the same bits
    assert all(bitwise_equal(a, b) for a, b in zip(gns(x, gamma, beta, groups), results[1]))


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("dtype", float32_quick([F32, BF16, F64]), ids=str)
@pytest.mark.parametrize("scale", [1e4, -1e4, np.inf, -np.inf])
def test_huge_scale_is_relu_like_without_warnings(dtype, scale):
    """s*y beyond the clamp: sigmoid is 1 or (nearly) 0, so y*sigmoid is y or ~0, never NaN."""
    x, gamma, beta = inputs((2, 4, 6, 5), 2, dtype, seed=7)
    with np.errstate(all="raise"):
        y = gns(x, gamma, beta, 2, swish_scale=scale)[0].astype(F64)
    plain = gns(x, gamma, beta, 2, activate_swish=False)[0].astype(F64)
    big, kept = np.abs(plain) > 0.02, plain * scale > 0  # |s*y| > 200
    assert np.array_equal(y[big & kept], plain[big & kept]) and (np.abs(y[big & ~kept]) < 1e-80).all()


def test_matches_torch_native_group_norm():
    """mean and rstd as native_group_norm's to float32 rounding, y as its y * sigmoid(s*y); and
    the forward's statistics fed to the backward give PyTorch autograd's gradients."""
    torch = pytest.importorskip("torch")
    shape, groups, eps, scale = (3, 8, 6, 5), 4, 1e-5, 1.25
    x, gamma, beta = inputs(shape, groups, F32, seed=8)
    dy = np.random.default_rng(9).standard_normal(shape).astype(F32)
    tx, tg, tb = (torch.tensor(a, requires_grad=True) for a in (x, gamma, beta))
    t_y, t_mean, t_rstd = torch.native_group_norm(tx, tg, tb, shape[0], shape[1], 30, groups, eps)
    t_out = t_y * torch.sigmoid(scale * t_y)
    t_grads = torch.autograd.grad(t_out, (tx, tg, tb), torch.tensor(dy))
    y, mean, rstd = gns(x, gamma, beta, groups, eps=eps, swish_scale=scale)
    # float32 sums of data up to |x| ~ 6 round at ~1e-7 of that, whichever the order
    np.testing.assert_allclose(
        mean, t_mean.detach().numpy().reshape(mean.shape), rtol=1e-6, atol=1e-6 * np.abs(x).max()
    )
    np.testing.assert_allclose(rstd, t_rstd.detach().numpy().reshape(rstd.shape), rtol=2e-6)
    np.testing.assert_allclose(y, t_out.detach().numpy(), rtol=1e-5, atol=1e-6)
    grads = gns_bwd(dy, mean, rstd, x, gamma, beta, groups, "NCHW", scale)
    for grad, t_grad in zip(grads, t_grads):
        np.testing.assert_allclose(grad, t_grad.numpy(), rtol=1e-4, atol=1e-4 * np.abs(t_grad.numpy()).max())
    # eps = 0 and a constant group: PyTorch's rstd is inf too
    x[1, 4:6] = 0.1
    t_rstd = torch.native_group_norm(torch.tensor(x), tg.detach(), tb.detach(), 3, 8, 30, groups, 0.0)[2]
    assert np.array_equal(np.isinf(gns(x, gamma, beta, groups, eps=0.0)[2]), np.isinf(t_rstd.numpy()))


# --------------------------------------------------------------------------------------------
# layouts, strides, threads
# --------------------------------------------------------------------------------------------


def test_nhwc_task_partition_does_not_change_bits(monkeypatch, replan):
    x, gamma, beta = inputs((3, 24, 17, 9), 6, F32, seed=11)
    x = to_nhwc(x)
    first = gns(x, gamma, beta, 6, "NHWC")
    for channels, per_thread in ((1, 1), (8, 2), (512, 64)):
        monkeypatch.setattr(kernels, "NHWC_TASK_CHANNELS", channels)
        monkeypatch.setattr(kernels, "NHWC_TASKS_PER_THREAD", per_thread)
        replan()
        assert all(bitwise_equal(a, b) for a, b in zip(gns(x, gamma, beta, 6, "NHWC"), first))
    for groups_per_task in (1, 4, 6):  # the kernel itself, runs of every width
        y, mean, rstd = np.empty_like(x), np.empty((3, 6), F32), np.empty((3, 6), F32)
        kernel_twins.parallel(kernels.group_norm_swish_fwd_nhwc, kernels.FORWARD_READ_ONLY)(
            x.reshape(3, -1, 24),
            gamma,
            beta,
            F32.type(1e-5),
            True,
            F32.type(1),
            y.reshape(3, -1, 24),
            mean,
            rstd,
            groups_per_task,
            kernels_native(),
        )
        assert all(bitwise_equal(a, b) for a, b in zip((y, mean, rstd), first)), groups_per_task


@pytest.mark.parametrize(
    "dtype", [F32, BF16, pytest.param(F64, marks=pytest.mark.slow), pytest.param(F16, marks=pytest.mark.slow)], ids=str
)
@pytest.mark.parametrize("activate", [True, False])
def test_nhwc_runs_of_every_width_match_the_reference_and_each_other(monkeypatch, replan, dtype, activate):
    """Task runs of 16, 48, 64 and all 384 channels, a position at a time: Swish through a scratch
    row copied out (runs of 16 and 48) or written in place (64 and 384: whole numbers of
    STAGE_ALIGN; the half formats always copy, rounding), and without Swish the affine part
    alone, at each run's own channels. Every width gives the same bits and the reference's values."""
    shape, groups = (2, 384, 8, 6), 24
    x, gamma, beta = inputs(shape, groups, dtype, seed=13)
    reference = expected(x, gamma, beta, groups, scale=1.25, activate=activate)
    monkeypatch.setattr(kernels, "NHWC_TASKS_PER_THREAD", 1)  # runs as wide as NHWC_TASK_CHANNELS asks
    first = None
    for channels in (16, 48, 64, 512):
        monkeypatch.setattr(kernels, "NHWC_TASK_CHANNELS", channels)
        replan()
        results = run(x, gamma, beta, groups, "NHWC", swish_scale=1.25, activate_swish=activate)
        assert_all_match(results, reference)
        first = first or results
        assert all(bitwise_equal(a, b) for a, b in zip(results, first)), channels


def kernels_native():
    from fastbwd.kernels._halfbits import NATIVE

    return NATIVE


def test_serial_twin_and_paired_groups_equal_parallel():
    """The serial twin, and NCHW tasks of one group or of two (sums interleaved, an odd group
    count leaving a task of one), give the same bits; blocks of BLOCK elements included, and
    groups of 256 and 64 elements, whose pairs share one staged Swish pass."""
    for shape, groups in (((2, 6, 300), 3), ((3, 4, kernels.BLOCK + 50), 2), ((2, 12, 64), 3), ((3, 8, 16), 2)):
        x, gamma, beta = inputs(shape, groups, F32, seed=12)
        results = []
        for kernel in kernel_twins.twins(kernels.group_norm_swish_fwd_nchw, kernels.FORWARD_READ_ONLY):
            for groups_per_task in (1, 2):
                y, mean, rstd = np.empty_like(x), np.empty((shape[0], groups), F32), np.empty((shape[0], groups), F32)
                kernel(
                    x, gamma, beta, F32.type(1e-5), True, F32.type(1), y, mean, rstd, groups_per_task, kernels_native()
                )
                results.append((y, mean, rstd))
        assert_all_match(results[0], expected(x, gamma, beta, groups))
        for other in results[1:]:
            assert all(bitwise_equal(a, b) for a, b in zip(results[0], other))


def test_channels_last_strides_strided_views_and_synonyms():
    x, gamma, beta = inputs((2, 8, 6, 7), 4, F32, seed=13)
    x_cl = to_nhwc(x).transpose(0, 3, 1, 2)
    y, mean, rstd = gns(x_cl, gamma, beta, 4)
    assert y.transpose(0, 2, 3, 1).flags.c_contiguous and not y.flags.c_contiguous
    nhwc = gns(to_nhwc(x), gamma, beta, 4, "NHWC")
    assert bitwise_equal(y.transpose(0, 2, 3, 1), nhwc[0]) and bitwise_equal(mean, nhwc[1])
    assert_all_match((y, mean, rstd), expected(x, gamma, beta, 4))
    big, gamma2, beta2 = inputs((2, 16, 12, 7), 4, F32, seed=14)
    views = (big[:, 1::2, ::-2], gamma2[::-2], beta2[1::2])
    strided = gns(*views, 4)
    assert all(bitwise_equal(a, b) for a, b in zip(strided, gns(*(np.ascontiguousarray(v) for v in views), 4)))
    for name in ("ND", "NCL", "NCDHW"):
        assert all(bitwise_equal(a, b) for a, b in zip(gns(x, gamma, beta, 4, name), gns(x, gamma, beta, 4)))


# --------------------------------------------------------------------------------------------
# out=
# --------------------------------------------------------------------------------------------


def test_out_entries_and_inputs_not_mutated():
    x, gamma, beta = inputs((2, 6, 4, 3), 3, BF16, seed=15, param_dtype=F32)
    snapshot = [a.copy() for a in (x, gamma, beta)]
    full = gns(x, gamma, beta, 3)
    out_y, out_rstd = np.full(x.shape, np.nan, BF16), np.full((2, 3), np.nan, F32)
    y, mean, rstd = gns(x, gamma, beta, 3, out=(out_y, None, out_rstd))
    assert y is out_y and rstd is out_rstd and mean.dtype == F32
    assert all(bitwise_equal(a, b) for a, b in zip((y, mean, rstd), full))
    assert all(bitwise_equal(a, b) for a, b in zip((x, gamma, beta), snapshot))
    x_cl = to_nhwc(x).transpose(0, 3, 1, 2)
    out_cl = np.empty((2, 4, 3, 6), BF16).transpose(0, 3, 1, 2)
    assert gns(x_cl, gamma, beta, 3, out=[out_cl, None, None])[0] is out_cl


def test_bad_out_is_rejected_and_nothing_is_written():
    x, gamma, beta = inputs((2, 6, 4, 3), 3, F32, seed=16)
    good_y, good_mean = np.full(x.shape, 7.0, F32), np.full((2, 3), 7.0, F32)
    read_only = np.zeros((2, 3), F32)
    read_only.flags.writeable = False
    cases = [
        ((good_y, good_mean, np.zeros(6, F32)), r"out\[2\]\.shape must be \(2, 3\), but got \(6,\)"),
        ((good_y, good_mean, np.zeros((2, 3), F64)), r"out\[2\]\.dtype must be float32, but got float64"),
        ((good_y, good_mean, good_mean), r"out\[2\] must not overlap out\[1\]"),
        ((good_y, read_only, None), r"out\[1\] must be writeable, but got a read-only array"),
        ((x, None, None), r"out\[0\] must not overlap x"),
        ((good_y, good_mean[:, ::-1], None), r"out\[1\] must be C-contiguous like the result"),
        ((good_y, good_mean), r"out must be a tuple \(y, mean, rstd\) of arrays or None, but got"),
        (good_y, r"out must be a tuple \(y, mean, rstd\) of arrays or None"),
    ]
    for out, message in cases:
        with raises_param_error(message, param="out"):
            gns(x, gamma, beta, 3, out=out)
        assert (good_y == 7).all() and (good_mean == 7).all()


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    x, gamma, beta = inputs((2, 6, 4, 3), 3, BF16, seed=17)
    tensors = [torch.from_numpy(np.asarray(a).view(np.int16)).view(torch.bfloat16) for a in (x, gamma, beta)]
    assert all(bitwise_equal(a, b) for a, b in zip(gns(*tensors, 3), gns(x, gamma, beta, 3)))


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------

_X, _GAMMA, _BETA = inputs((2, 6, 4, 3), 3, F32, seed=23)
GOOD = dict(x=_X, gamma=_GAMMA, beta=_BETA, num_groups=3)


def zeros(shape, dtype=F32):
    return np.zeros(shape, dtype)


@pytest.mark.parametrize(
    "changes, message, param",
    [
        (dict(x=zeros((6,))), r"x must have rank 2 to 8, but got 1-D with shape \(6,\)", "x"),
        (dict(x=zeros((2, 6) + (1,) * 7)), r"x must have rank 2 to 8, but got 9-D", "x"),
        (
            dict(x=zeros((0, 6, 4, 3))),
            r"x\.shape\[0\] \(N\) must be > 0 \(empty tensors are not supported\), but got 0",
            "x",
        ),
        (dict(x=zeros((2, 6, 4, 0))), r"x\.shape\[3\] \(spatial\) must be > 0", "x"),
        (dict(x=zeros((2, 4, 3, 0)), data_format="NHWC"), r"x\.shape\[3\] \(C\) must be > 0", "x"),
        (dict(num_groups=0), r"num_groups must be > 0, but got 0", "num_groups"),
        (dict(num_groups=4), r"num_groups must divide the channel count C = 6, but got 4", "num_groups"),
        (dict(num_groups=3.0), r"num_groups must be an integer, but got 3.0 \(a float\)", "num_groups"),
        (
            dict(x=zeros((1, 4001, 1)), gamma=zeros(4001), beta=zeros(4001), num_groups=1),
            r"num_groups must leave at most 4000 channels per group \(C = 4001\)",
            "num_groups",
        ),
        (dict(gamma=zeros(5)), r"gamma\.shape must be \(6,\) \(one per channel\), but got \(5,\)", "gamma"),
        (dict(beta=zeros((6, 1))), r"beta\.shape must be \(6,\) \(one per channel\), but got \(6, 1\)", "beta"),
        (
            dict(x=zeros((2, 6, 4, 3), np.int32)),
            r"x\.dtype must be one of float32, float16, bfloat16, float64, but got int32",
            "x",
        ),
        (dict(gamma=zeros(6, F64)), r"gamma\.dtype must be x's dtype \(float32\) or float32, but got float64", "gamma"),
        (
            dict(x=zeros((2, 6, 4, 3), BF16), beta=zeros(6, F16)),
            r"beta\.dtype must be x's dtype \(bfloat16\) or float32, but got float16",
            "beta",
        ),
        (
            dict(data_format="NDHWC"),
            r"data_format must be one of 'NCHW', 'ND', 'NCL', 'NCDHW', 'NHWC', but got 'NDHWC'",
            "data_format",
        ),
        (dict(eps=-1e-5), r"eps must be a finite number >= 0, but got -1e-05", "eps"),
        (dict(eps=np.inf), r"eps must be a finite number >= 0, but got inf", "eps"),
        (dict(eps=np.nan), r"eps must be a finite number >= 0, but got nan", "eps"),
        (dict(eps="1"), r"eps must be a real number, but got '1'", "eps"),
        (dict(swish_scale=True), r"swish_scale must be a real number, but got True \(a bool\)", "swish_scale"),
        (dict(activate_swish=1), r"activate_swish must be a bool, but got 1", "activate_swish"),
        (dict(x=np.array(["a"])), r"x must be a numeric array", "x"),
    ],
)
def test_errors(changes, message, param):
    with raises_param_error(message, param=param):
        gns(**dict(GOOD, **changes))


@pytest.mark.parametrize(
    "name", ["x", "gamma", "beta", "num_groups", "data_format", "eps", "activate_swish", "swish_scale"]
)
def test_none_is_nullptr(name):
    with raises_param_error(rf"{name} is required, but got None", status=161001, param=name):
        gns(**dict(GOOD, **{name: None}))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_nchw_statistics_of_a_group_with_nan_are_the_positive_nan(dtype):
    """A group's NaN mean and rstd are stored with one sign (positive, quiet), whichever NaN
    the group held: a sum's NaN sign would follow the compiled code's operand order (AVX-512
    and AVX2 builds of the same loops disagreed)."""
    x, gamma, beta = inputs((2, 8, 3, 5), 4, dtype, seed=21)
    x[0, 0, 1, 2] = -np.nan  # group 0 of image 0: a negative NaN alone
    x[1, 2, 0, 0], x[1, 3, 2, 4] = np.nan, -np.nan  # group 1 of image 1: both signs
    x[1, 6, 0, 1], x[1, 7, 1, 1] = np.inf, -np.inf  # group 3 of image 1: inf - inf
    _, mean, rstd = gns(x, gamma, beta, 4)
    for n, g in ((0, 0), (1, 1), (1, 3)):
        assert has_the_bits_of(mean[n, g], np.nan) and has_the_bits_of(rstd[n, g], np.nan), (n, g)
    assert np.isfinite(mean[0, 1:]).all() and np.isfinite(mean[1, [0, 2]]).all()


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=str)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("activate_swish", [True, False])
def test_nan_outputs_are_the_positive_nan(dtype, layout, activate_swish):
    """Every NaN of y is stored as the quiet NaN of positive sign: x's NaN meets its group's
    NaN mean in ``x - mean`` (and Swish's ``-|z|`` flips a NaN's sign), so which NaN an operation
    returned would follow the compiled code's operand order, which differs between CPUs."""
    x, gamma, beta = inputs((2, 8, 3, 5), 4, dtype, seed=22)
    x[0, 0, 1, 2] = -np.nan
    x[1, 2, 0, 0], x[1, 3, 2, 4] = np.nan, -np.nan
    y, mean, rstd = run(x, gamma, beta, 4, layout, activate_swish=activate_swish)
    for n in range(2):
        for g in range(4):
            group = y[n, 2 * g : 2 * g + 2]
            if (n, g) in {(0, 0), (1, 1)}:  # NaN mean and rstd: all of the group's y is NaN
                assert has_the_bits_of(group, np.nan).all(), (n, g)
                assert has_the_bits_of(mean[n, g], np.nan) and has_the_bits_of(rstd[n, g], np.nan), (n, g)
            else:
                assert np.isfinite(group.astype(np.float64)).all(), (n, g)


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=str)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("activate_swish", [True, False])
def test_nan_parameters_of_negative_sign_give_the_positive_nan(dtype, layout, activate_swish):
    """A NaN gamma or beta of negative sign (finite x and statistics) gives y's positive NaN:
    the one NaN is taken of the affine result, not of x (tools/mutants/nan_audit.toml)."""
    x, gamma, beta = inputs((2, 8, 3, 5), 4, dtype, seed=27)
    gamma[1], beta[6] = -np.nan, -np.nan
    assert np.signbit(gamma[1].astype(np.float32)) and np.signbit(beta[6].astype(np.float32))
    y, mean, rstd = run(x, gamma, beta, 4, layout, activate_swish=activate_swish)
    assert np.isfinite(mean.astype(np.float64)).all() and np.isfinite(rstd.astype(np.float64)).all()
    assert has_the_bits_of(y[:, [1, 6]], np.nan).all()
    assert np.isfinite(y[:, [0, 2, 3, 4, 5, 7]].astype(np.float64)).all()
