"""The contract every public function keeps, driven by the registry (fastbwd/_registry.py): for
each operator it names, every dtype x memory layout (C-contiguous, channels-last strides,
strided with negative steps) against the float64 reference, bitwise the same result for every
thread count, ``out=`` (fresh, read-only, overlapping an input, the wrong shape, dtype, type or
layout: refused with nothing written) and the errors every array argument shares (None, a
non-float dtype). What is specific to one operator stays in its own file."""

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest

import fastbwd
from bench.inputs import group_norm_swish_inputs, roi_boxes
from fastbwd._errors import ACLNN_ERR_PARAM_NULLPTR
from fastbwd._registry import OPERATORS
from fastbwd.api.roi_align import roi_align_forward
from fastbwd.testing import reference as ref
from fastbwd.testing.checks import assert_matches_reference, bitwise_equal

from conftest import COMPLEX, DTYPES, assert_thread_invariant, channels_last, raises_param_error, random


@dataclass
class Call:
    """One call of a public function: its array arguments by name (NCHW-family logical shapes)
    and the rest, and how to get the float64 reference of its result."""

    arrays: dict
    run: object  # run(arrays, out=None) -> the public function's result
    reference: object  # reference(arrays as float64) -> the float64 result (a tuple for tuples)
    #: the arrays that take channels-last strides in the channels-last variant (4-D data)
    spatial: tuple = ()
    #: extra keywords of assert_matches_reference for this call
    tolerance: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Contract:
    """How the matrix calls one public function of the registry."""

    dtypes: tuple
    #: case name -> builder(dtype) -> Call; the first is the small case of the reference and out=
    #: tests, every case runs the thread-count check (each reaches a different kernel or partition)
    cases: dict
    #: out= takes a tuple (one entry per result) rather than one array
    tuple_out: bool = False


# ---- the calls ---------------------------------------------------------------------------------


def _upsample(grad_shape, input_size, align_corners):
    def build(dtype):
        output_size = grad_shape[2:]
        return Call(
            {"grad_output": random(grad_shape, dtype, 1)},
            lambda a, out=None: fastbwd.upsample_bilinear2d_backward(
                a["grad_output"], output_size, input_size, align_corners, out=out
            ),
            lambda a: ref.upsample_bilinear2d_backward(a["grad_output"], output_size, input_size, align_corners),
            spatial=("grad_output",),
        )

    return build


def _pair(value):
    return (value, value) if isinstance(value, int) else tuple(value)


def _avg_pool(input_shape, kernel, stride, padding, ceil_mode, count_include_pad, divisor=0, input_array=False):
    def build(dtype):
        # the reference takes pairs, stride given (PyTorch's default: the kernel size)
        pairs = (_pair(kernel), _pair(kernel if stride is None else stride), _pair(padding))
        sizes = [ref.avg_pool2d_output_size(input_shape[2 + i], *(p[i] for p in pairs), ceil_mode) for i in (0, 1)]
        arrays = {"grad_output": random((*input_shape[:2], *sizes), dtype, 2)}
        if input_array:
            arrays["input"] = random(input_shape, dtype, 3)
        params = (kernel, stride, padding, ceil_mode, count_include_pad, divisor)
        return Call(
            arrays,
            lambda a, out=None: fastbwd.avg_pool2d_backward(
                a["grad_output"], a.get("input", input_shape), *params, out=out
            ),
            lambda a: ref.avg_pool2d_backward(
                a["grad_output"], input_shape, *pairs, ceil_mode, count_include_pad, divisor
            ),
            spatial=("grad_output", "input") if input_array else ("grad_output",),
        )

    return build


def _pad(input_shape, padding):
    def build(dtype):
        left, right, top, bottom = padding
        n, c, h, w = input_shape
        return Call(
            {"grad_output": random((n, c, h + top + bottom, w + left + right), dtype, 4)},
            lambda a, out=None: fastbwd.replication_pad2d_backward(a["grad_output"], input_shape, padding, out=out),
            lambda a: ref.replication_pad2d_backward(a["grad_output"], input_shape, padding),
            spatial=("grad_output",),
        )

    return build


def _roi_align(input_shape, num_boxes, pooled, params):
    def build(dtype):
        channels = input_shape[1]
        return Call(
            {
                "grad_output": random((num_boxes, channels, *pooled), dtype, 5),
                "boxes": roi_boxes(num_boxes, input_shape, params[0], seed=6, dtype=dtype),
            },
            lambda a, out=None: fastbwd.roi_align_backward(
                a["grad_output"], a["boxes"], input_shape, *pooled, *params, out=out
            ),
            lambda a: ref.roi_align_backward(a["grad_output"], a["boxes"], input_shape, *pooled, *params),
            spatial=("grad_output",),
        )

    return build


def _roi_align_forward(input_shape, num_boxes, pooled, params, skipped=()):
    def build(dtype):
        boxes = roi_boxes(num_boxes, input_shape, params[0], seed=8, dtype=dtype)
        boxes[list(skipped), 0] = [(-1, input_shape[0])[i % 2] for i in range(len(skipped))]
        return Call(
            {"input": random(input_shape, dtype, 7), "boxes": boxes},
            lambda a, out=None: roi_align_forward(a["input"], a["boxes"], *pooled, *params, out=out),
            lambda a: ref.roi_align_forward(a["input"], a["boxes"], *pooled, *params),
            spatial=("input",),
            # a bin sums many products with cancellation: float32 within 2e-5 of the largest
            # value rather than per element; half formats that much near zero (test_roi_align.py)
            tolerance={"rtol": 0, "atol": 2e-5} if dtype == np.float32 else {"atol_scale": 2e-5},
        )

    return build


_GNS_NAMES = ("dy", "mean", "rstd", "x", "gamma", "beta")


def _group_norm_swish_backward(shape, groups):
    def build(dtype):
        arrays = dict(zip(_GNS_NAMES, group_norm_swish_inputs(shape, groups, dtype, seed=9)))
        return Call(
            arrays,
            lambda a, out=None: fastbwd.group_norm_swish_backward(*(a[k] for k in _GNS_NAMES), groups, out=out),
            lambda a: ref.group_norm_swish_backward(*(a[k] for k in _GNS_NAMES), groups),
            spatial=("dy", "x"),
        )

    return build


def _group_norm_swish(shape, groups):
    def build(dtype):
        _, _, _, x, gamma, beta = group_norm_swish_inputs(shape, groups, dtype, seed=10)
        return Call(
            {"x": x, "gamma": gamma, "beta": beta},
            lambda a, out=None: fastbwd.group_norm_swish(a["x"], a["gamma"], a["beta"], groups, out=out),
            lambda a: ref.group_norm_swish_forward(a["x"], a["gamma"], a["beta"], groups),
            spatial=("x",),
        )

    return build


#: One contract per name in the registry. The later cases are those the operators' own files
#: used to check across thread counts: sizes that split into many tasks, each kernel path.
CONTRACTS = {
    "upsample_bilinear2d_backward": Contract(
        tuple(DTYPES),
        {
            "small": _upsample((2, 3, 9, 7), (2, 3, 5, 4), False),
            "row blocks": _upsample((1, 2, 70, 41), (1, 2, 33, 20), False),
            "row blocks, align_corners": _upsample((1, 2, 70, 41), (1, 2, 33, 20), True),
            "planes as lanes": _upsample((2, 130, 9, 6), (2, 130, 5, 4), False),
        },
    ),
    "avg_pool2d_backward": Contract(
        tuple(DTYPES),
        {
            "small": _avg_pool((2, 3, 7, 8), 3, 2, 1, False, True, input_array=True),
            "general": _avg_pool((3, 5, 37, 29), (3, 4), (2, 3), (1, 2), True, False),
            "whole rows, stride 2": _avg_pool((3, 5, 29, 61), 3, 2, 1, False, False),
            "whole rows, stride 3": _avg_pool((3, 5, 29, 61), 3, 3, 1, False, False),
            "global": _avg_pool((3, 5, 6, 7), (6, 7), None, 0, False, True),
        },
    ),
    "replication_pad2d_backward": Contract(
        tuple(DTYPES + COMPLEX),
        {
            "small": _pad((2, 3, 5, 4), (2, 1, 1, 2)),
            "large": _pad((3, 5, 37, 29), (3, 2, 4, 1)),
        },
    ),
    "roi_align_backward": Contract(
        tuple(DTYPES),
        {
            "small": _roi_align((2, 3, 8, 9), 4, (2, 3), (0.5, 2, True)),
            "large": _roi_align((3, 37, 45, 61), 40, (5, 4), (0.5, 0, True)),
        },
    ),
    "roi_align_forward": Contract(
        tuple(DTYPES),
        {
            "small": _roi_align_forward((2, 3, 8, 9), 4, (2, 3), (0.5, 2, True)),
            # boxes 3 and 17 name no image (-1, 3): skipped, their bins zero
            "large": _roi_align_forward((3, 70, 45, 61), 30, (5, 4), (0.5, 0, True), skipped=(3, 17)),
        },
    ),
    "group_norm_swish_backward": Contract(
        tuple(DTYPES),
        {
            "small": _group_norm_swish_backward((2, 6, 4, 5), 3),
            "large": _group_norm_swish_backward((3, 12, 40, 33), 4),
        },
        tuple_out=True,
    ),
    "group_norm_swish": Contract(
        tuple(DTYPES),
        {
            "small": _group_norm_swish((2, 6, 4, 5), 3),
            "large": _group_norm_swish((3, 12, 40, 33), 4),
        },
        tuple_out=True,
    ),
}

MEMORY = ("contiguous", "channels_last", "strided")


def _as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


def _strided(array):
    """The same values through a view with a gap between elements and negative steps."""
    spread = np.zeros(tuple(2 * s for s in array.shape), array.dtype)
    view = spread[(slice(None, None, -2),) * array.ndim]
    view[...] = array
    return view


def _in_memory(call, memory):
    """The call's arrays laid out as ``memory`` says (the same values)."""
    if memory == "contiguous":
        return call.arrays
    if memory == "channels_last":
        return {k: channels_last(v) if k in call.spatial else v for k, v in call.arrays.items()}
    return {k: _strided(v) for k, v in call.arrays.items()}


def _small(name, dtype):
    return next(iter(CONTRACTS[name].cases.values()))(np.dtype(dtype))


#: The operators whose channels-last calls run kernels of their own (RoIAlign's run the NCHW
#: ones). In any dtype but float32 such a case compiles a channels-last twin for the contract
#: tests alone (3-6 s each in a cold run): the slow set's. The quick cover then meets these
#: operators on channels_last in float32 and the other dtypes on channels_last in RoIAlign.
_OWN_CHANNELS_LAST_KERNELS = {
    "upsample_bilinear2d_backward",
    "avg_pool2d_backward",
    "replication_pad2d_backward",
    "group_norm_swish_backward",
    "group_norm_swish",
}


def _matrix(*axes):
    """(name, dtype, ...) for every contract and each of its dtypes, then the other axes."""
    return [
        pytest.param(
            name,
            dtype,
            *rest,
            id="-".join([name, str(dtype), *map(str, rest)]),
            marks=[pytest.mark.slow] if _channels_last_twin(name, dtype, rest) else [],
        )
        for name, contract in CONTRACTS.items()
        for dtype in contract.dtypes
        for rest in itertools.product(*axes)
    ]


def _channels_last_twin(name, dtype, rest):
    return "channels_last" in rest and name in _OWN_CHANNELS_LAST_KERNELS and np.dtype(dtype) != np.float32


def test_every_registered_operator_has_a_contract():
    assert set(CONTRACTS) == set(OPERATORS)
    assert set(fastbwd.__all__) - {"ParamError", "__version__", "precompile", "clear_result_cache"} <= set(CONTRACTS)


@pytest.mark.covering
@pytest.mark.parametrize("name, dtype, memory", _matrix(MEMORY))
def test_matches_the_float64_reference(name, dtype, memory):
    call = _small(name, dtype)
    arrays = _in_memory(call, memory)
    snapshot = {k: v.copy() for k, v in arrays.items()}
    result = _as_tuple(call.run(arrays))
    expected = _as_tuple(
        call.reference(
            {k: v.astype(np.complex128 if v.dtype.kind == "c" else np.float64) for k, v in call.arrays.items()}
        )
    )
    assert len(result) == len(expected)
    for actual, want in zip(result, expected):
        assert_matches_reference(actual, want, **call.tolerance)
    assert result[0].dtype == np.dtype(dtype)
    for k, v in arrays.items():  # the inputs are read, never written
        assert bitwise_equal(v, snapshot[k]), k
    if memory == "strided":  # a view reads as its contiguous copy: the same bits
        contiguous = _as_tuple(call.run(call.arrays))
        assert all(bitwise_equal(a, b) for a, b in zip(result, contiguous))


def _thread_matrix():
    """Every case, dtype and layout: float32's in the quick set (each other dtype's parallel
    kernels are as many compiles again: the slow set's), and there a case of each operator on
    each layout (the covering marker); every case's kernel path and partition in the slow set."""
    return [
        pytest.param(
            name,
            case,
            dtype,
            memory,
            id=f"{name}-{case}-{dtype}-{memory}",
            marks=() if np.dtype(dtype) == np.float32 else pytest.mark.slow,
        )
        for name, contract in CONTRACTS.items()
        for case in contract.cases
        for dtype in contract.dtypes
        for memory in ("contiguous", "channels_last")
    ]


@pytest.mark.covering("name", "memory")
@pytest.mark.parametrize("name, case, dtype, memory", _thread_matrix())
def test_thread_count_does_not_change_bits(name, case, dtype, memory):
    call = CONTRACTS[name].cases[case](np.dtype(dtype))
    arrays = _in_memory(call, memory)
    assert_thread_invariant(lambda: call.run(arrays))


# ---- out= ---------------------------------------------------------------------------------------


def _out_for(contract, results, make):
    """``out=`` with ``make(result)`` in every place: an array, or a tuple of them."""
    outs = tuple(make(r) for r in results)
    return outs if contract.tuple_out else outs[0]


@pytest.mark.covering
@pytest.mark.parametrize("name, dtype, memory", _matrix(("contiguous", "channels_last")))
def test_out_is_written_and_returned(name, dtype, memory):
    contract, call = CONTRACTS[name], _small(name, dtype)
    arrays = _in_memory(call, memory)
    fresh = _as_tuple(call.run(arrays))
    # NaN-filled, in the result's own layout (channels-last results stay channels-last)
    out = _out_for(contract, fresh, lambda r: np.full_like(r, np.nan))
    returned = call.run(arrays, out=out)
    assert returned is out if not contract.tuple_out else all(a is b for a, b in zip(returned, out))
    assert all(bitwise_equal(a, b) for a, b in zip(_as_tuple(returned), fresh))


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("name, dtype", _matrix())
def test_out_read_only_is_refused_and_nothing_written(name, dtype):
    contract, call = CONTRACTS[name], _small(name, dtype)
    fresh = _as_tuple(call.run(call.arrays))
    for index in range(len(fresh)):
        outs = [np.full_like(r, 7) for r in fresh]
        outs[index].flags.writeable = False
        out = tuple(outs) if contract.tuple_out else outs[0]
        where = f"out\\[{index}\\]" if contract.tuple_out else "out"
        with raises_param_error(rf"^{name}: {where} must be writeable, but got a read-only array", param="out"):
            call.run(call.arrays, out=out)
        assert all((o == 7).all() for o in outs)


def _overlapping(array, like):
    """``array``'s values in memory that an array shaped and typed as ``like`` then overlaps."""
    nbytes = max(array.nbytes, like.nbytes)
    memory = np.zeros(2 * nbytes + 64, np.uint8)
    placed = memory[: array.nbytes].view(array.dtype).reshape(array.shape)
    placed[...] = array
    start = (array.nbytes // 2) // 16 * 16  # inside the array's bytes, aligned for any dtype
    overlapping = memory[start : start + like.nbytes].view(like.dtype).reshape(like.shape)
    return placed, overlapping


@pytest.mark.parametrize("name", list(CONTRACTS))
def test_out_overlapping_an_input_is_refused_and_nothing_written(name):
    contract, call = CONTRACTS[name], _small(name, np.float32)
    fresh = _as_tuple(call.run(call.arrays))
    for argument in call.arrays:
        for index, result in enumerate(fresh):
            arrays = dict(call.arrays)
            arrays[argument], overlapping = _overlapping(call.arrays[argument], result)
            outs = [np.empty_like(r) for r in fresh]
            outs[index] = overlapping
            out = tuple(outs) if contract.tuple_out else outs[0]
            where = f"out\\[{index}\\]" if contract.tuple_out else "out"
            with raises_param_error(rf"^{name}: {where} must not overlap {argument}, but got overlapping memory"):
                call.run(arrays, out=out)
            assert bitwise_equal(arrays[argument], call.arrays[argument]), (argument, index)


def _bad_outs(result):
    """(bad out, the message it gets) for a result array."""
    shape, dtype = result.shape, result.dtype
    other = np.dtype(np.float64 if dtype != np.float64 else np.float32)
    wider = shape[:-1] + (shape[-1] + 1,)
    spread = np.full(shape[:-1] + (2 * shape[-1],), 7, dtype)[..., ::2]
    return [
        (np.full(wider, 7, dtype), rf"\.shape must be \({', '.join(map(str, shape))},?\), but got"),
        (np.full(shape, 7, other), rf"\.dtype must be {dtype}, but got {other}"),
        (spread, r" must be C-contiguous like the result"),
    ]


@pytest.mark.parametrize("name", list(CONTRACTS))
def test_bad_out_is_refused_and_nothing_written(name):
    contract, call = CONTRACTS[name], _small(name, np.float32)
    fresh = _as_tuple(call.run(call.arrays))
    for index, result in enumerate(fresh):
        for bad, message in _bad_outs(result) + [([7.0], r" must be a numpy.ndarray, but got \[7.0\]")]:
            outs = [np.full_like(r, 7) for r in fresh]
            outs[index] = bad
            out = tuple(outs) if contract.tuple_out else outs[0]
            where = f"out\\[{index}\\]" if contract.tuple_out else "out"
            with raises_param_error(f"^{name}: {where}{message}", param="out"):
                call.run(call.arrays, out=out)
            assert all((np.asarray(o) == 7).all() for o in outs)


# ---- the errors every array argument shares ----------------------------------------------------------


@pytest.mark.parametrize("name", list(CONTRACTS))
def test_an_array_argument_of_none_is_refused(name):
    call = _small(name, np.float32)
    for argument in call.arrays:
        with raises_param_error(
            rf"^{name}: {argument} is required, but got None", status=ACLNN_ERR_PARAM_NULLPTR, param=argument
        ):
            call.run(dict(call.arrays, **{argument: None}))


@pytest.mark.parametrize("name", list(CONTRACTS))
@pytest.mark.parametrize("dtype", [np.int32, np.bool_], ids=str)
def test_an_array_argument_of_another_kind_is_refused(name, dtype):
    call = _small(name, np.float32)
    for argument, array in call.arrays.items():
        with raises_param_error(rf"^{name}: {argument}\.dtype must "):
            call.run(dict(call.arrays, **{argument: array.astype(dtype)}))
