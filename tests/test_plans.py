"""The api layer's remembered validations (fastbwd/api/_plans.py): a repeated call reuses its
plan, and nothing the full validation would refuse ever gets through a stored plan."""

import numpy as np
import pytest

import fastbwd
from fastbwd.api import _plans
from fastbwd.api import group_norm_swish as gn_api
from fastbwd.api import roi_align as roi_api
from fastbwd.api import upsample_bilinear2d as up_api

from conftest import BF16


@pytest.fixture
def rng():
    return np.random.default_rng(20261123)


def _gn_args(rng, shape=(2, 6, 3, 5), groups=3):
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    mean = rng.standard_normal((shape[0], groups)).astype(np.float32)
    rstd = (1 + rng.random((shape[0], groups))).astype(np.float32)
    gamma = rng.standard_normal(shape[1]).astype(np.float32)
    beta = rng.standard_normal(shape[1]).astype(np.float32)
    return dy, mean, rstd, x, gamma, beta, groups


def test_key_tells_types_apart():
    # values that compare equal but mean different things to the validation
    assert _plans.key(1) != _plans.key(True)
    assert _plans.key(2) != _plans.key(2.0)
    assert _plans.key([1, 2]) != _plans.key([True, 2])
    assert _plans.key([1, 2]) != _plans.key((1, 2))
    assert _plans.key(np.int64(3)) != _plans.key(3)
    a = np.zeros((2, 3), np.float32)
    assert _plans.key(a) == _plans.key(np.ones((2, 3), np.float32))  # metadata only
    assert _plans.key(a) != _plans.key(a.T.copy().T)  # other strides
    assert _plans.key(a) != _plans.key(a.astype(np.float64))
    read_only = a.copy()
    read_only.flags.writeable = False
    assert _plans.key(a) != _plans.key(read_only)
    # a plan's launches call the entry points compiled for the arrays of its first call
    misaligned = np.zeros(a.nbytes + 1, np.uint8)[1:].view(np.float32).reshape(a.shape)
    assert not misaligned.flags.aligned and misaligned.strides == a.strides
    assert _plans.key(a) != _plans.key(misaligned)
    # what the strides alone do not tell: the batch size (C-contiguous strides do not depend
    # on it), a dtype of the same size, the strides' signs
    assert _plans.key(a) != _plans.key(np.zeros((5, 3), np.float32))
    assert _plans.key(a.astype(np.float16)) != _plans.key(a.astype(BF16))
    assert _plans.key(a) != _plans.key(a[:, ::-1].copy()[:, ::-1])
    with pytest.raises(_plans.Unkeyable):
        _plans.key(object())


def test_table_is_bounded_and_keeps_the_newest():
    plans = _plans.Plans(size=3)
    built = []

    def build(value):
        built.append(value)
        return ("plan", value)

    for value in (1, 2, 1, 3, 4, 1):
        assert plans(build, value) == ("plan", value)
    assert built == [1, 2, 3, 4, 1]  # 1 was dropped as the oldest when 4 came
    assert len(plans) == 3


def test_failed_validation_is_not_stored():
    plans = _plans.Plans()
    calls = []

    def build(value):
        calls.append(value)
        raise fastbwd.ParamError("refused")

    for _ in range(2):
        with pytest.raises(fastbwd.ParamError):
            plans(build, 5)
    assert calls == [5, 5] and len(plans) == 0


def test_repeated_call_reuses_the_plan(rng):
    gn_api.OPERATION.plans.clear()
    args = _gn_args(rng)
    first = fastbwd.group_norm_swish_backward(*args)
    assert len(gn_api.OPERATION.plans) == 1
    again = fastbwd.group_norm_swish_backward(*args, swish_scale=1.0)
    assert len(gn_api.OPERATION.plans) == 1
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    # another swish_scale is not part of the plan: same plan, other numbers
    other = fastbwd.group_norm_swish_backward(*args, swish_scale=-0.5)
    assert len(gn_api.OPERATION.plans) == 1
    assert not np.array_equal(other[0], first[0])


def test_a_plan_is_not_taken_for_another_batch_dtype_or_direction(rng):
    """Arrays whose strides are a stored plan's but not the rest of their metadata: another
    batch size, bfloat16 after float16, a flipped array: each call gives a fresh call's result."""

    def fresh(function, operation, *args):
        operation.plans.clear()
        return function(*args)

    function = fastbwd.group_norm_swish_backward
    small, big = _gn_args(rng), _gn_args(rng, shape=(4, 6, 3, 5))
    function(*small)
    for a, b in zip(function(*big), fresh(function, gn_api.OPERATION, *big)):
        np.testing.assert_array_equal(a, b)
    function = fastbwd.upsample_bilinear2d_backward
    grad = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    size = ((6, 8), (1, 2, 3, 4), False)
    for first, second in ((grad.astype(np.float16), grad.astype(BF16)), (grad, grad[..., ::-1])):
        function(first, *size)
        result = function(second, *size)
        assert result.dtype == second.dtype
        np.testing.assert_array_equal(result, fresh(function, up_api.OPERATION, second, *size))
        np.testing.assert_array_equal(result, function(np.ascontiguousarray(second), *size))


def test_the_last_plan_argument_is_in_the_key_too(rng):
    """A call that differs from a stored plan's only in its last plan argument (GroupNorm+Swish's
    activate_swish, upsampling's out=) gets a plan of its own."""
    args = _gn_args(rng)
    with_swish = fastbwd.group_norm_swish_backward(*args)
    plain = fastbwd.group_norm_swish_backward(*args, activate_swish=False)
    assert not np.array_equal(plain[0], with_swish[0])
    gn_api.OPERATION.plans.clear()
    for a, b in zip(plain, fastbwd.group_norm_swish_backward(*args, activate_swish=False)):
        np.testing.assert_array_equal(a, b)
    grad = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    size = ((6, 8), (1, 2, 3, 4), False)
    fastbwd.upsample_bilinear2d_backward(grad, *size)
    with pytest.raises(fastbwd.ParamError, match=r"out\.dtype must be float32"):
        fastbwd.upsample_bilinear2d_backward(grad, *size, out=np.empty((1, 2, 3, 4), np.float64))


def test_stored_plan_does_not_let_bad_arguments_through(rng):
    dy, mean, rstd, x, gamma, beta, groups = _gn_args(rng)
    fastbwd.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, groups)
    with pytest.raises(fastbwd.ParamError, match="num_groups must be an integer"):
        fastbwd.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, float(groups))
    with pytest.raises(fastbwd.ParamError, match="dgamma_is_require must be a bool"):
        fastbwd.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, groups, "NCHW", 1.0, 1)
    with pytest.raises(fastbwd.ParamError, match="swish_scale must be a real number"):
        fastbwd.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, groups, "NCHW", "1")

    out = (np.empty_like(x), np.empty_like(gamma), np.empty_like(beta))
    fastbwd.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, groups, out=out)
    # the same metadata, but dx now overlaps dy: checked on every call, not stored
    with pytest.raises(fastbwd.ParamError, match=r"out\[0\] must not overlap dy"):
        fastbwd.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, groups, out=(dy, out[1], out[2]))
    read_only = out[0].copy()
    read_only.flags.writeable = False
    with pytest.raises(fastbwd.ParamError, match=r"out\[0\] must be writeable"):
        fastbwd.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, groups, out=(read_only, out[1], out[2]))


def test_upsample_plan_checks_overlap_and_types_every_call(rng):
    grad_output = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    out = np.empty((1, 2, 3, 4), np.float32)
    fastbwd.upsample_bilinear2d_backward(grad_output, (6, 8), (1, 2, 3, 4), out=out)
    planned = len(up_api.OPERATION.plans)
    fastbwd.upsample_bilinear2d_backward(grad_output, (6, 8), (1, 2, 3, 4), out=out)
    assert len(up_api.OPERATION.plans) == planned
    # an out= that is a view into grad_output, with the metadata of a valid one
    inside = grad_output[:, :, :3, :4].copy()
    view = np.lib.stride_tricks.as_strided(grad_output, inside.shape, inside.strides)
    with pytest.raises(fastbwd.ParamError, match="must not overlap grad_output"):
        fastbwd.upsample_bilinear2d_backward(grad_output, (6, 8), (1, 2, 3, 4), out=view)
    with pytest.raises(fastbwd.ParamError, match="align_corners must be a bool"):
        fastbwd.upsample_bilinear2d_backward(grad_output, (6, 8), (1, 2, 3, 4), 0)
    with pytest.raises(fastbwd.ParamError, match=r"output_size\[0\] must be an integer"):
        fastbwd.upsample_bilinear2d_backward(grad_output, (6.0, 8), (1, 2, 3, 4))


@pytest.mark.parametrize("op", ["avg_pool", "pad"])
def test_pool_and_pad_plans_check_every_call(rng, op):
    x = rng.standard_normal((2, 3, 6, 7)).astype(np.float32)
    if op == "avg_pool":
        grad_output = rng.standard_normal((2, 3, 3, 4)).astype(np.float32)

        def call(*, input=x, kernel_size=3, out=None):
            return fastbwd.avg_pool2d_backward(grad_output, input, kernel_size, 2, 1, out=out)

        bad_size, message = True, "kernel_size must be a sequence of integers"
    else:
        grad_output = rng.standard_normal((2, 3, 8, 10)).astype(np.float32)

        def call(*, input=x, kernel_size=(1, 2, 1, 1), out=None):
            return fastbwd.replication_pad2d_backward(grad_output, input, kernel_size, out=out)

        bad_size, message = (1, 2, 1, True), r"padding\[3\] must be an integer"
    expected = call()
    for input in (x, x.shape, list(x.shape)):  # the input or its shape, twice each
        for _ in range(2):
            np.testing.assert_array_equal(call(input=input), expected)
    with pytest.raises(fastbwd.ParamError, match=message):
        call(kernel_size=bad_size)
    out = np.empty_like(x)
    call(out=out)
    np.testing.assert_array_equal(out, expected)
    # x has out's metadata: a stored plan must not let the overlap through
    with pytest.raises(fastbwd.ParamError, match="must not overlap input"):
        call(out=x)
    channels_last = np.empty((2, 6, 7, 3), np.float32).transpose(0, 3, 1, 2)
    with pytest.raises(fastbwd.ParamError, match="must be C-contiguous like the result"):
        call(out=channels_last)


def test_roi_align_plan_keeps_no_box_values(rng):
    # The plan holds the validated metadata only: the boxes' values (their tables) are read on
    # every call, and the overlap of out= is checked on every call.
    memory = rng.standard_normal(2 * 3 * 8 * 8).astype(np.float32)
    grad_output = memory[: 2 * 3 * 2 * 2].reshape(2, 3, 2, 2)
    boxes = np.array([[0, 1, 1, 6, 5], [1, 0, 0, 3, 4]], np.float32)
    other_boxes = np.array([[1, 2, 0, 7, 3], [0, 0, 2, 5, 6]], np.float32)

    def call(boxes=boxes, spatial_scale=0.5, out=None):
        return fastbwd.roi_align_backward(grad_output, boxes, (2, 3, 8, 8), 2, 2, spatial_scale, 2, True, out=out)

    roi_api.OPERATION.plans.clear()
    first = call()
    assert len(roi_api.OPERATION.plans) == 1
    np.testing.assert_array_equal(call(), first)
    moved = call(other_boxes)
    assert len(roi_api.OPERATION.plans) == 1
    assert not np.array_equal(moved, first)
    with pytest.raises(fastbwd.ParamError, match="spatial_scale must be greater than FLT_MIN"):
        call(spatial_scale=float("nan"))
    with pytest.raises(fastbwd.ParamError, match="must not overlap grad_output"):
        call(out=memory.reshape(first.shape))  # the metadata of a valid out=
