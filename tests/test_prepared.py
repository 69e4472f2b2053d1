"""Prepared calls (docs/semantics.md §0.1): ``function.prepare(...)`` validates and plans once;
the prepared callable gives the direct call's bits and errors, checking only what can differ
from its example (shape, strides, dtype, alignment; ``out=``'s metadata, writeability and
overlap)."""

import numpy as np
import pytest

import fastbwd
from fastbwd.api.roi_align import roi_align_forward
from fastbwd.testing.checks import bitwise_equal

from conftest import BF16, raises_param_error

F32 = np.float32


def _random(shape, dtype=F32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _cases(dtype):
    """(function, prepare's arguments, the arrays a prepared call takes, out=) per operation."""
    boxes = np.array([[0, 1, 1, 6, 5], [1, -2, 0, 3, 9]], dtype)
    x = _random((2, 4, 3, 3), dtype, 1)
    gamma, beta = _random(4, dtype, 2), _random(4, dtype, 3)
    _, mean, rstd = fastbwd.group_norm_swish(x, gamma, beta, 2)
    dy = _random(x.shape, dtype, 4)
    up = _random((1, 2, 6, 8), dtype, 5)
    pool = _random((1, 2, 2, 3), dtype, 6)
    pad = _random((1, 2, 6, 7), dtype, 7)
    roi_grad = _random((2, 3, 2, 2), dtype, 8)
    image = _random((2, 3, 8, 8), dtype, 9)
    forward_input = np.zeros((1, 2, 4, 6), dtype)
    return {
        "upsample": (fastbwd.upsample_bilinear2d_backward, (up, (6, 8), (1, 2, 3, 4), False), (up,)),
        "avg_pool shape": (fastbwd.avg_pool2d_backward, (pool, (1, 2, 4, 6), 2), (pool,)),
        "avg_pool array": (fastbwd.avg_pool2d_backward, (pool, forward_input, 2), (pool, forward_input)),
        "pad": (fastbwd.replication_pad2d_backward, (pad, (1, 2, 4, 5), (1, 1, 1, 1)), (pad,)),
        "roi_align": (
            fastbwd.roi_align_backward,
            (roi_grad, boxes, (2, 3, 8, 8), 2, 2, 1.0, 0, True),
            (roi_grad, boxes),
        ),
        "roi_align_forward": (roi_align_forward, (image, boxes, 2, 2, 0.5, 2, False), (image, boxes)),
        "group_norm_swish_backward": (
            fastbwd.group_norm_swish_backward,
            (dy, mean, rstd, x, gamma, beta, 2, "NCHW", 0.75),
            (dy, mean, rstd, x, gamma, beta),
        ),
        "group_norm_swish": (fastbwd.group_norm_swish, (x, gamma, beta, 2, "NCHW", 1e-3, True, 1.5), (x, gamma, beta)),
    }


#: _cases' names (known without building them: nothing compiles while pytest collects)
CASES = [
    "upsample",
    "avg_pool shape",
    "avg_pool array",
    "pad",
    "roi_align",
    "roi_align_forward",
    "group_norm_swish_backward",
    "group_norm_swish",
]


def _same(a, b):
    a, b = (x if isinstance(x, tuple) else (x,) for x in (a, b))
    return len(a) == len(b) and all(
        (x is None and y is None) or bitwise_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("dtype", [F32, np.float64, np.float16, BF16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_prepared_call_gives_the_direct_calls_bits(case, dtype):
    assert list(_cases(dtype)) == CASES
    function, arguments, arrays = _cases(dtype)[case]
    prepared = function.prepare(*arguments)
    direct = function(*arguments)
    assert _same(prepared(*arrays), direct)
    assert _same(prepared(*arrays), direct)  # again: nothing is kept from a call
    # new arrays of the same metadata, other values: the direct call's bits for those
    others = tuple(a[::-1].copy() if a.ndim and a.flags.c_contiguous else a for a in arrays)
    moved = list(arguments)
    for old, new in zip(arrays, others):
        moved[next(i for i, a in enumerate(arguments) if a is old)] = new
    assert _same(prepared(*others), function(*moved))


@pytest.mark.parametrize("case", CASES)
def test_prepared_call_writes_out_and_checks_it(case):
    function, arguments, arrays = _cases(F32)[case]
    direct = function(*arguments)
    results = direct if isinstance(direct, tuple) else (direct,)
    out = tuple(np.full_like(r, np.nan) if r is not None else None for r in results)
    out_argument = out if isinstance(direct, tuple) else out[0]
    prepared = function.prepare(*arguments)
    returned = prepared(*arrays, out=out_argument)
    assert _same(returned, direct)
    first = out[0]
    assert (returned[0] if isinstance(returned, tuple) else returned) is first
    entry = (lambda a: (a,) + out[1:]) if isinstance(direct, tuple) else (lambda a: a)
    read_only = first.copy()
    read_only.flags.writeable = False
    name = "out[0]" if isinstance(direct, tuple) else "out"
    with raises_param_error(rf"{function.__name__}: {name.replace('[', '.').replace(']', '.')} must be writeable"):
        prepared(*arrays, out=entry(read_only))
    with raises_param_error(rf"{function.__name__}: .* must be"):
        prepared(*arrays, out=entry(first[..., :-1]))
    # the overlap of out= with an input depends on addresses: checked on every call
    big = arrays[0]
    if big.shape == first.shape and big.dtype == first.dtype:
        with raises_param_error(rf"{function.__name__}: .* must not overlap"):
            prepared(*arrays, out=entry(big))


def test_an_array_of_other_metadata_gets_the_direct_calls_error_or_a_clear_one():
    function, arguments, arrays = _cases(F32)["group_norm_swish_backward"]
    prepared = function.prepare(*arguments)
    dy, mean, rstd, x, gamma, beta = arrays
    # refused by the direct call too: the same message
    with raises_param_error(r"group_norm_swish_backward: dy\.shape must be \(2, 4, 3, 3\) \(as x\)", param="dy"):
        prepared(dy[:1], mean, rstd, x, gamma, beta)
    with raises_param_error(r"group_norm_swish_backward: dy\.dtype must equal x\.dtype", param="dy"):
        prepared(dy.astype(np.float64), mean, rstd, x, gamma, beta)
    # a valid call of another geometry: refused, naming the array and the prepared metadata
    bigger = [np.concatenate([a, a]) for a in (dy, mean, rstd, x)]
    with raises_param_error(r"group_norm_swish_backward: dy must have the prepared shape \(2, 4, 3, 3\)", param="dy"):
        prepared(*bigger, gamma, beta)
    # other strides are other metadata: a strided view of the same shape is refused too
    wide = np.empty((2, 8, 3, 3), F32)[:, ::2]
    wide[...] = dy
    with raises_param_error(r"dy must have the prepared shape .* strides", param="dy"):
        prepared(wide, mean, rstd, x, gamma, beta)
    with raises_param_error(r"group_norm_swish_backward: arrays must be the 6 prepared \(dy, mean, rstd"):
        prepared(dy, mean, rstd, x, gamma)


def test_prepare_validates_everything_once():
    function, arguments, _ = _cases(F32)["group_norm_swish_backward"]
    with raises_param_error(r"group_norm_swish_backward: num_groups must divide", param="num_groups"):
        function.prepare(*arguments[:6], 3)
    with raises_param_error(r"swish_scale must be a real number", param="swish_scale"):
        function.prepare(*arguments[:6], 2, "NCHW", "1")
    with raises_param_error(r"group_norm_swish: eps must be a finite number", param="eps"):
        fastbwd.group_norm_swish.prepare(*_cases(F32)["group_norm_swish"][2], 2, eps=-1.0)
    with pytest.raises(TypeError):
        function.prepare(*arguments, unknown=1)


def test_tensors_and_shape_dtype_examples():
    torch = pytest.importorskip("torch")
    function, arguments, arrays = _cases(F32)["upsample"]

    class ShapeDtype:  # as jax.ShapeDtypeStruct
        shape, dtype = arrays[0].shape, arrays[0].dtype

    prepared = function.prepare(ShapeDtype(), *arguments[1:])
    direct = function(*arguments)
    assert bitwise_equal(prepared(arrays[0]), direct)
    assert bitwise_equal(prepared(torch.from_numpy(arrays[0])), direct)


def test_prepared_calls_from_threads():
    from concurrent.futures import ThreadPoolExecutor

    function, arguments, arrays = _cases(F32)["group_norm_swish_backward"]
    prepared = function.prepare(*arguments)
    direct = function(*arguments)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: prepared(*arrays), range(32)))
    assert all(_same(result, direct) for result in results)


@pytest.mark.parametrize("function", ["avg_pool2d_backward", "replication_pad2d_backward"])
def test_layout_nhwc_is_the_channels_last_call(function):
    """``layout="NHWC"`` (the one layout argument): NHWC-ordered arrays and shapes give the NCHW
    call's values, C-contiguous, the same bits as channels-last strides."""
    call = getattr(fastbwd, function)
    grad = _random((2, 3, 4, 5) if function.startswith("avg") else (2, 3, 10, 14))
    shape = (2, 3, 8, 10)
    parameters = (3, 2, 1) if function.startswith("avg") else ((2, 2, 1, 1),)
    channels_last = np.ascontiguousarray(grad.transpose(0, 2, 3, 1))
    nhwc_shape = (2, 8, 10, 3)
    result = call(channels_last, nhwc_shape, *parameters, layout="NHWC")
    assert result.shape == nhwc_shape and result.flags.c_contiguous
    strided = call(channels_last.transpose(0, 3, 1, 2), shape, *parameters)
    assert bitwise_equal(result, np.ascontiguousarray(strided.transpose(0, 2, 3, 1)))
    with raises_param_error(rf"{function}: layout must be one of 'NCHW', 'NHWC'", param="layout"):
        call(grad, shape, *parameters, layout="NDHWC")
    with raises_param_error(rf"{function}: grad_output must be 4-D with layout='NHWC'", param="grad_output"):
        call(grad[0], shape[1:], *parameters, layout="NHWC")


def test_group_norm_swish_layout_is_data_format():
    function, arguments, arrays = _cases(F32)["group_norm_swish_backward"]
    dy, mean, rstd, x, gamma, beta = arrays
    nhwc = [np.ascontiguousarray(np.moveaxis(a, 1, -1)) for a in (dy, x)]
    by_format = function(nhwc[0], mean, rstd, nhwc[1], gamma, beta, 2, "NHWC")
    by_layout = function(nhwc[0], mean, rstd, nhwc[1], gamma, beta, 2, layout="NHWC")
    assert _same(by_layout, by_format)
    with raises_param_error(r"layout must agree with data_format \('NHWC'\)", param="layout"):
        function(nhwc[0], mean, rstd, nhwc[1], gamma, beta, 2, "NHWC", layout="NCHW")
    assert _same(function(*arrays, 2, "ND", layout="NCHW"), function(*arrays, 2))


def test_array_likes_are_arrays_in_prepare():
    """A list where an array goes is an array (as the direct call reads it); only avg-pool's and
    pad's ``input`` may be a shape."""
    function, arguments, arrays = _cases(np.float64)["group_norm_swish"]
    x, gamma, beta = arrays
    prepared = function.prepare(x, gamma.tolist(), beta, 2)
    assert prepared.arrays == ("x", "gamma", "beta")
    assert _same(prepared(x, gamma, beta), function(x, gamma.tolist(), beta, 2))


def _misaligned(array):
    """A copy of ``array`` with its metadata (shape, strides, dtype) at an odd address."""
    buffer = np.empty(array.nbytes + 1, np.uint8)
    moved = buffer[1:].view(array.dtype).reshape(array.shape)
    moved[...] = array
    assert not moved.flags.aligned and moved.strides == array.strides
    return moved


def test_an_array_the_plan_was_not_made_for_is_refused_even_where_the_bytes_agree():
    """Metadata the comparison could confuse: bfloat16 where float16 was prepared (same shape,
    strides and item size), and the example's metadata at a misaligned address (the plan's
    kernels were compiled for aligned arrays). The direct call takes both."""
    function, arguments, arrays = _cases(np.float16)["upsample"]
    prepared = function.prepare(*arguments)
    (grad,) = arrays
    other = grad.astype(BF16)
    assert function(other, *arguments[1:]).dtype == BF16
    with raises_param_error(r"grad_output must have the prepared shape .* and dtype float16", param="grad_output"):
        prepared(other)
    function, arguments, arrays = _cases(F32)["group_norm_swish_backward"]
    prepared = function.prepare(*arguments)
    for index in range(len(arrays)):
        moved = list(arrays)
        moved[index] = _misaligned(arrays[index])
        assert _same(function(*moved, *arguments[6:]), function(*arguments))
        with raises_param_error(rf"{function.__name__}: \w+ must be aligned as the prepared arrays"):
            prepared(*moved)


@pytest.mark.parametrize("case", CASES)
def test_prepared_out_of_other_metadata_or_alignment(case):
    """``out=`` of the result's shape but another dtype (of another or the same item size) or
    other strides, or misaligned: refused with the direct call's message, or, misaligned,
    because the plan's kernels were compiled for aligned arrays."""
    function, arguments, arrays = _cases(F32)[case]
    direct = function(*arguments)
    results = direct if isinstance(direct, tuple) else (direct,)
    first = results[0]
    entry = (lambda a: (a,) + (None,) * (len(results) - 1)) if isinstance(direct, tuple) else (lambda a: a)
    name = r"out\[0\]" if isinstance(direct, tuple) else "out"
    prepared = function.prepare(*arguments)
    for dtype in (np.float64, np.int32):
        with raises_param_error(rf"{function.__name__}: {name}\.dtype must be float32"):
            prepared(*arrays, out=entry(np.empty(first.shape, dtype)))
    strided = np.empty(first.shape[:-1] + (2 * first.shape[-1],), F32)[..., ::2]
    with raises_param_error(rf"{function.__name__}: {name} must be C-contiguous like the result"):
        prepared(*arrays, out=entry(strided))
    with raises_param_error(rf"{function.__name__}: {name} must be aligned for this prepared call"):
        prepared(*arrays, out=entry(_misaligned(np.zeros_like(first))))


@pytest.mark.parametrize("case", ["upsample", "avg_pool shape", "avg_pool array", "pad"])  # results of N = 1
def test_prepared_out_with_a_size_one_axis_of_any_stride(case):
    """A size-1 axis's stride is no part of C-contiguity: an ``out=`` the direct call takes with
    another stride there, the prepared call takes too, and writes the same bits."""
    function, arguments, arrays = _cases(F32)[case]
    direct = function(*arguments)
    axis = direct.shape.index(1)
    taller = np.full(direct.shape[:axis] + (3,) + direct.shape[axis + 1 :], np.nan, F32)
    out = taller[(slice(None),) * axis + (slice(None, None, 3),)]
    assert out.shape == direct.shape and out.strides != direct.strides
    assert function(*arguments, out=out) is out
    out[...] = np.nan
    prepared = function.prepare(*arguments)
    assert prepared(*arrays, out=out) is out
    assert bitwise_equal(out, direct)


@pytest.mark.parametrize("case", ["avg_pool array", "roi_align", "roi_align_forward"])
def test_prepared_out_over_any_array_is_refused(case):
    """``out=`` over the memory of an array other than the first (avg-pool's input, RoIAlign's
    boxes): refused as the direct call refuses it, on every call."""
    function, arguments, arrays = _cases(F32)[case]
    result = function(*arguments)
    second = arrays[1]
    memory = np.zeros(max(result.size, second.size), F32)
    shared = memory[: second.size].reshape(second.shape)
    shared[...] = second
    out = memory[: result.size].reshape(result.shape)
    moved = [shared if a is second else a for a in arguments]
    name = "input" if case.startswith("avg_pool") else "boxes"
    with raises_param_error(rf"{function.__name__}: out must not overlap {name}", param="out"):
        function(*moved, out=out)
    prepared = function.prepare(*moved)
    with raises_param_error(rf"{function.__name__}: out must not overlap {name}", param="out"):
        prepared(arrays[0], shared, out=out)


def test_shape_dtype_examples_of_no_array_are_param_errors():
    """A stand-in whose shape is not integers or whose dtype is no NumPy dtype: a ParamError
    naming the argument (not NumPy's TypeError)."""
    function, arguments, _ = _cases(F32)["upsample"]

    class ShapeDtype:
        def __init__(self, shape, dtype):
            self.shape, self.dtype = shape, dtype

    for example in (ShapeDtype((1, 2, 6.5, 8), F32), ShapeDtype((1, 2, 6, 8), "no such dtype")):
        with raises_param_error(r"grad_output must be an array or have an integer shape", param="grad_output"):
            function.prepare(example, *arguments[1:])


@pytest.mark.parametrize("case", ["avg_pool shape", "pad"])
def test_prepare_takes_a_list_as_the_input_shape(case):
    """avg-pool's and pad's ``input`` as a list is a shape, as a tuple is: the prepared call
    takes grad_output alone."""
    function, arguments, arrays = _cases(F32)[case]
    listed = (arguments[0], list(arguments[1]), *arguments[2:])
    prepared = function.prepare(*listed)
    assert prepared.arrays == ("grad_output",)
    assert bitwise_equal(prepared(*arrays), function(*arguments))


def test_group_norm_swish_prepared_calls_keep_their_bound_arguments():
    """activate_swish=False and layout="NHWC" given to ``prepare`` are the prepared call's, in
    both directions, as the direct call's."""
    function, arguments, arrays = _cases(F32)["group_norm_swish_backward"]
    plain = function.prepare(*arguments, activate_swish=False)
    assert _same(plain(*arrays), function(*arguments, activate_swish=False))
    assert not _same(plain(*arrays), function(*arguments))
    dy, mean, rstd, x, gamma, beta = arrays
    nhwc = [np.ascontiguousarray(np.moveaxis(a, 1, -1)) for a in (dy, x)]
    nhwc_arrays = (nhwc[0], mean, rstd, nhwc[1], gamma, beta)
    by_layout = function.prepare(*nhwc_arrays, 2, swish_scale=0.75, layout="NHWC")
    assert _same(by_layout(*nhwc_arrays), function(*nhwc_arrays, 2, "NHWC", 0.75))
    forward, arguments, arrays = _cases(F32)["group_norm_swish"]
    plain = forward.prepare(*arguments[:6], False, arguments[7])
    assert _same(plain(*arrays), forward(*arguments[:6], False, arguments[7]))
    assert not _same(plain(*arrays), forward(*arguments))
