"""replication_pad2d_backward (docs/semantics.md §3) against the float64 reference, its forward's adjoint,
every dtype and layout, threads, out=, strides, and every error of docs/semantics.md."""

import itertools

import numpy as np
import pytest

import fastbwd
from fastbwd import replication_pad2d_backward as pad_bwd
from fastbwd.testing import reference as ref
from fastbwd.testing.checks import assert_matches_reference, bitwise_equal

import kernel_twins
from _covering import float32_quick
from conftest import (
    BF16,
    COMPLEX,
    DTYPES,
    channels_last,
    has_the_bits_of,
    nan_cells_are_the_positive_nan,
    raises_param_error,
    random,
    to_nhwc,
    with_signed_nan,
)

F = "replication_pad2d_backward"


def padded_shape(input_shape, padding):
    left, right, top, bottom = padding
    return (*input_shape[:-2], input_shape[-2] + top + bottom, input_shape[-1] + left + right)


def random_case(rng):
    """A random valid (input_shape, padding): non-square, 3-D or 4-D, pads of either sign, a
    crop down to a whole side and beyond (``pad <= -size``: the other side's padding replicates
    what is left) one time in four."""
    ndim = int(rng.integers(3, 5))
    h, w = (int(s) for s in rng.integers(1, 9, size=2))
    leading = tuple(int(s) for s in rng.integers(1, 4, size=ndim - 2))
    pads = []
    for size in (w, w, h, h):
        low = -2 * size + 2 if rng.integers(4) == 0 else -size + 1
        pads.append(int(rng.integers(low, size)) if size > 1 else 0)
    left, right, top, bottom = pads
    # keep the padded size >= 1
    while w + left + right < 1:
        left += 1
    while h + top + bottom < 1:
        top += 1
    return leading + (h, w), (left, right, top, bottom)


# --------------------------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------------------------


def test_document_example():
    grad_output = np.array([[[1, 1, 1, 1, 1, 1, 1]]], np.float32)
    result = pad_bwd(grad_output, np.ones((1, 1, 5), np.float32), (1, 1, 0, 0))
    assert result.dtype == np.float32 and result.shape == (1, 1, 5)
    assert np.array_equal(result, [[[2, 1, 1, 1, 2]]])


def test_corners_sum_their_rectangle():
    grad_output = np.arange(1.0, 1 + 6 * 7).reshape(1, 1, 6, 7)
    result = pad_bwd(grad_output, (1, 1, 3, 3), (2, 2, 1, 2))
    # top-left corner: rows 0..1, cols 0..2 of grad_output
    assert result[0, 0, 0, 0] == grad_output[0, 0, 0:2, 0:3].sum()
    # bottom-right: rows 3..5, cols 4..6
    assert result[0, 0, 2, 2] == grad_output[0, 0, 3:6, 4:7].sum()
    # the middle cell is a copy
    assert result[0, 0, 1, 1] == grad_output[0, 0, 2, 3]


@pytest.mark.parametrize("dtype", float32_quick(DTYPES + COMPLEX), ids=str)
def test_matches_reference_random_cases(dtype):
    rng = np.random.default_rng(7)
    for case in range(25):
        input_shape, padding = random_case(rng)
        grad_output = random(padded_shape(input_shape, padding), dtype, case)
        expected = ref.replication_pad2d_backward(grad_output, input_shape, padding)
        result = pad_bwd(grad_output, input_shape, padding)
        assert result.dtype == dtype and result.shape == input_shape
        assert_matches_reference(result, expected)


def _nan_out(grad_output, input_shape, padding):
    """An out= for the call filled with NaN, in the memory layout of the result (channels-last
    strides when grad_output's are, which a plane of one row or column cannot show)."""
    return np.full_like(pad_bwd(grad_output, input_shape, padding), np.nan)


@pytest.mark.parametrize("dtype", float32_quick(DTYPES + COMPLEX), ids=str)
@pytest.mark.parametrize("strides_channels_last", [False, True])
def test_every_cell_written_into_a_nan_filled_out(dtype, strides_channels_last):
    # out= prefilled with NaN: a cell that a kernel forgot to write (a cropped-away cell must
    # become 0, not keep what the memory held) shows up whatever the allocator returned.
    # Pads down to -(size - 1) on every side, both kernels (NCHW and NHWC).
    rng = np.random.default_rng(17)
    cases = [((2, 3, 6, 7), (-3, 2, 1, -2)), ((1, 2, 5, 8), (-5, -2, -3, 4)), ((2, 1, 7, 4), (2, -3, -4, -2))]
    cases += [random_case(rng) for _ in range(12)]
    for case, (input_shape, padding) in enumerate(cases):
        if len(input_shape) == 3:
            input_shape = (1,) + input_shape
        grad_output = random(padded_shape(input_shape, padding), dtype, 300 + case)
        if strides_channels_last:
            grad_output = channels_last(grad_output)
        out = _nan_out(grad_output, input_shape, padding)
        assert pad_bwd(grad_output, input_shape, padding, out=out) is out
        assert_matches_reference(out, ref.replication_pad2d_backward(grad_output, input_shape, padding))


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=str)
@pytest.mark.parametrize("strides_channels_last", [False, True])
def test_every_whole_side_crop(dtype, strides_channels_last):
    # A negative pad that crops a whole side (pad <= -size; the other side's pad then replicates
    # what is left): every such padding of small planes, into a NaN-filled out=. The last cell of
    # a row once came out 0 when the left crop passed it (and a wider crop wrote past the row).
    cases = 0
    for height, width in ((1, 2), (2, 1), (2, 3), (3, 2), (3, 4), (4, 3)):
        for padding in itertools.product(range(-7, 4), repeat=4):
            left, right, top, bottom = padding
            if max(left, right) >= width or max(top, bottom) >= height:
                continue
            if width + left + right < 1 or height + top + bottom < 1:
                continue
            if min(width + left, width + right, height + top, height + bottom) > 0:
                continue
            input_shape = (2, 3, height, width)
            grad_output = random(padded_shape(input_shape, padding), dtype, cases)
            if strides_channels_last:
                grad_output = channels_last(grad_output)
            out = _nan_out(grad_output, input_shape, padding)
            assert pad_bwd(grad_output, input_shape, padding, out=out) is out
            assert_matches_reference(out, ref.replication_pad2d_backward(grad_output, input_shape, padding))
            cases += 1
    assert cases > 300


@pytest.mark.parametrize("dtype", [np.float64, pytest.param(np.complex128, marks=pytest.mark.slow)], ids=str)
def test_adjoint_of_the_forward(dtype):
    rng = np.random.default_rng(11)
    for case in range(20):
        input_shape, padding = random_case(rng)
        x = random(input_shape, dtype, 100 + case)
        g = random(padded_shape(input_shape, padding), dtype, 200 + case)
        forward = ref.replication_pad2d_forward(x, padding)
        lhs = np.vdot(g, forward)  # <g, f(x)>
        rhs = np.vdot(pad_bwd(g, input_shape, padding), x)  # <f^T(g), x>
        assert np.isclose(lhs, rhs, rtol=1e-12, atol=1e-12), (input_shape, padding)


def test_full_jacobian_tiny():
    input_shape, padding = (1, 3, 3), (1, -1, 2, 1)
    out_shape = padded_shape(input_shape, padding)
    size_in, size_out = int(np.prod(input_shape)), int(np.prod(out_shape))
    jacobian = np.zeros((size_out, size_in))
    for k in range(size_in):
        e = np.zeros(size_in)
        e[k] = 1
        jacobian[:, k] = ref.replication_pad2d_forward(e.reshape(input_shape), padding).ravel()
    for k in range(size_out):
        e = np.zeros(size_out)
        e[k] = 1
        assert np.array_equal(pad_bwd(e.reshape(out_shape), input_shape, padding).ravel(), jacobian[k])


@pytest.mark.parametrize("dtype, half_ulp", [(np.float16, 2.0**-11), (BF16, 2.0**-8)], ids=str)
def test_half_formats_round_once(dtype, half_ulp):
    # The right edge cell sums 1 + half_ulp + half_ulp: rounding after every addition would give
    # 1 (two ties to even); summing in float32 and rounding once gives 1 + ulp exactly.
    grad_output = np.array([[[0.0, 0.0, 1.0, half_ulp, half_ulp]]], dtype)
    result = pad_bwd(grad_output, (1, 1, 3), (0, 2, 0, 0))
    assert result[0, 0, 2] == np.array(1.0 + 2 * half_ulp, dtype)
    assert result[0, 0, 2] != np.array(1.0, dtype)


def test_nan_and_inf_propagate():
    grad_output = np.zeros((1, 1, 4, 4), np.float32)
    grad_output[0, 0, 0, 0] = np.nan
    grad_output[0, 0, 3, 3] = np.inf
    grad_output[0, 0, 3, 2] = -np.inf
    result = pad_bwd(grad_output, (1, 1, 2, 2), (1, 1, 1, 1))
    assert np.isnan(result[0, 0, 0, 0])
    assert np.isnan(result[0, 0, 1, 1])  # inf + -inf
    assert result[0, 0, 0, 1] == 0 and result[0, 0, 1, 0] == 0


# --------------------------------------------------------------------------------------------
# layouts, strides, out=, threads
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", float32_quick([np.float32, np.float16, np.complex64]), ids=str)
def test_channels_last_is_kept_and_equal(dtype):
    input_shape, padding = (2, 5, 6, 7), (2, 1, -1, 3)
    grad_output = random(padded_shape(input_shape, padding), dtype, 3)
    grad_cl = channels_last(grad_output)
    result_nchw = pad_bwd(grad_output, input_shape, padding)
    result_nhwc = pad_bwd(grad_cl, input_shape, padding)
    assert result_nhwc.transpose(0, 2, 3, 1).flags.c_contiguous
    assert result_nchw.flags.c_contiguous
    assert bitwise_equal(np.ascontiguousarray(result_nhwc), result_nchw)


def test_strided_and_negative_stride_inputs():
    input_shape, padding = (2, 3, 5, 4), (1, 2, 2, 0)
    base = random((2, 6, 7 * 2, 7), np.float32, 5)
    grad_output = base[:, ::2, ::-2, :]  # non-contiguous, negative stride along H
    assert grad_output.shape == padded_shape(input_shape, padding)
    expected = pad_bwd(np.ascontiguousarray(grad_output), input_shape, padding)
    assert bitwise_equal(pad_bwd(grad_output, input_shape, padding), expected)


def test_inputs_are_not_mutated_and_out_is_overwritten():
    input_shape, padding = (2, 3, 5, 4), (1, 2, 2, 0)
    grad_output = random(padded_shape(input_shape, padding), np.float32, 9)
    x = random(input_shape, np.float32, 10)
    snapshot = (grad_output.copy(), x.copy())
    out = np.full(input_shape, np.nan, np.float32)
    returned = pad_bwd(grad_output, x, padding, out=out)
    assert returned is out
    assert bitwise_equal(out, pad_bwd(grad_output, input_shape, padding))
    assert bitwise_equal(grad_output, snapshot[0]) and bitwise_equal(x, snapshot[1])


def test_out_channels_last():
    input_shape, padding = (2, 3, 5, 4), (1, 1, 1, 1)
    grad_output = random(padded_shape(input_shape, padding), np.float32, 1)
    grad_cl = channels_last(grad_output)
    out = np.empty((2, 5, 4, 3), np.float32).transpose(0, 3, 1, 2)
    assert pad_bwd(grad_cl, input_shape, padding, out=out) is out
    assert bitwise_equal(np.ascontiguousarray(out), pad_bwd(grad_output, input_shape, padding))
    with raises_param_error(r"out must be C-contiguous like the result", param="out"):
        pad_bwd(grad_output, input_shape, padding, out=out)


@pytest.mark.parametrize(
    "read_ahead", [None, pytest.param(512 * 16, marks=pytest.mark.slow)], ids=["plain", "streaming"]
)
def test_serial_twin_equals_parallel(read_ahead):
    from fastbwd.kernels import replication_pad2d as kernels
    from fastbwd.kernels._halfbits import NATIVE

    grad_output = random((6, 40, 33), np.float32, 8)
    parallel, serial = np.empty((6, 33, 30), np.float32), np.empty((6, 33, 30), np.float32)
    parallel_kernel, serial_twin = kernel_twins.twins(kernels.replication_pad2d_bwd_nchw)
    parallel_kernel(grad_output, parallel, 3, 2, read_ahead, NATIVE)
    serial_twin(grad_output, serial, 3, 2, read_ahead, NATIVE)
    assert bitwise_equal(parallel, serial)


@pytest.mark.slow  # the streaming path compiles kernels of its own in every dtype: the slow set's
@pytest.mark.parametrize("dtype", DTYPES + COMPLEX, ids=str)
def test_streaming_stores_change_no_bit(dtype, monkeypatch, replan):
    # Results of at least STREAM_MIN_BYTES stream their rows: with no column cropped, every
    # whole cache line of a row with one source row, edge cells put in, and the line it shares
    # with the next such row of its run; otherwise the interiors' whole lines. Every alignment of
    # out, pads of either sign and rows shorter than a line give the bits of plain stores, and
    # nothing outside out is touched. More rows than the kernel's 256 runs put several rows in a
    # run, so that rows share lines.
    from fastbwd.kernels import _memory

    cases = [
        ((2, 3, 21, 70), (3, 4, 2, 5)),  # rows of several lines, one per run
        ((2, 5, 60, 70), (3, 4, 2, 5)),  # two or three rows per run: shared lines
        ((3, 4, 30, 16), (0, 2, 0, 0)),  # every row one source row; rows of 16 cells
        ((3, 25, 7, 40), (0, 3, 0, 0)),  # planes of seven such rows: runs cross planes
        ((2, 4, 41, 33), (1, 0, -3, 2)),  # negative top pad: rows with no source row first
        ((2, 2, 9, 40), (-5, 7, -2, 3)),  # interior cropped on the left
        ((3, 2, 8, 37), (6, -9, 1, 0)),  # and on the right
        ((1, 3, 6, 5), (2, 1, 1, 2)),
    ]  # rows shorter than a line
    for input_shape, padding in cases:
        grad_output = random(padded_shape(input_shape, padding), dtype, 12)
        monkeypatch.setattr(_memory, "STREAM_MIN_BYTES", 16 << 20)
        replan()
        expected = pad_bwd(grad_output, input_shape, padding)
        assert_matches_reference(expected, ref.replication_pad2d_backward(grad_output, input_shape, padding))
        monkeypatch.setattr(_memory, "STREAM_MIN_BYTES", 0)
        replan()
        size = int(np.prod(input_shape))
        for offset in range(_memory.LINE_BYTES // np.dtype(dtype).itemsize + 1):
            buffer = np.full(size + offset + 1, np.nan, dtype)
            out = buffer[offset : offset + size].reshape(input_shape)
            assert pad_bwd(grad_output, input_shape, padding, out=out) is out
            assert bitwise_equal(out, expected), (input_shape, padding, offset)
            assert np.isnan(buffer[:offset]).all() and np.isnan(buffer[-1]), (input_shape, padding, offset)
        raw = np.zeros(size * np.dtype(dtype).itemsize + 1, np.uint8)
        odd = raw[1:].view(dtype).reshape(input_shape)  # not aligned to its element size: plain stores
        assert bitwise_equal(pad_bwd(grad_output, input_shape, padding, out=odd), expected)


# --------------------------------------------------------------------------------------------
# argument forms
# --------------------------------------------------------------------------------------------


def test_input_as_array_or_shape_and_lists():
    grad_output = [[[1.0, 2.0, 3.0, 4.0]]]  # a list: float64
    by_shape = pad_bwd(grad_output, (1, 1, 2), [1, 1, 0, 0])
    by_array = pad_bwd(np.array(grad_output), np.zeros((1, 1, 2)), np.array([1, 1, 0, 0]))
    assert by_shape.dtype == np.float64 and np.array_equal(by_shape, [[[3.0, 7.0]]])
    assert bitwise_equal(by_shape, by_array)


def test_empty_batch():
    result = pad_bwd(np.zeros((0, 3, 7, 8), BF16), (0, 3, 5, 4), (2, 2, 1, 1))
    assert result.shape == (0, 3, 5, 4) and result.dtype == BF16


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    grad = torch.randn(2, 3, 7, 6, dtype=torch.bfloat16, requires_grad=True)
    result = pad_bwd(grad, (2, 3, 5, 4), (1, 1, 1, 1))
    assert result.dtype == BF16
    expected = torch.ops.aten.replication_pad2d_backward(grad.detach().float(), torch.empty(2, 3, 5, 4), [1, 1, 1, 1])
    assert_matches_reference(result, expected.double().numpy())


@pytest.mark.parametrize("dtype", float32_quick(["float32", "float64", "complex64", "float16"]))
def test_matches_torch(dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    for _ in range(6):
        input_shape, padding = random_case(rng)
        if len(input_shape) == 3:
            input_shape = (1,) + input_shape
        grad = torch.from_numpy(random(padded_shape(input_shape, padding), dtype, 1))
        expected = torch.ops.aten.replication_pad2d_backward(
            grad, torch.empty(input_shape, dtype=grad.dtype), list(padding)
        )
        result = pad_bwd(grad, input_shape, padding)
        if dtype == "float16":  # torch accumulates float16 in float16 on CPU; compare loosely
            assert np.allclose(result.astype(np.float32), expected.float().numpy(), rtol=2e-3, atol=2e-3)
        else:
            assert_matches_reference(result, expected.numpy())


# --------------------------------------------------------------------------------------------
# errors (docs/semantics.md §3)
# --------------------------------------------------------------------------------------------

GOOD = dict(grad_output=np.zeros((2, 3, 7, 8), np.float32), input=(2, 3, 5, 4), padding=(2, 2, 1, 1))


def call(**changes):
    return pad_bwd(**dict(GOOD, **changes))


@pytest.mark.parametrize(
    "changes, message, param",
    [
        (
            dict(grad_output=np.zeros((7, 8), np.float32)),
            r"grad_output must be 4-D like input, but got 2-D",
            "grad_output",
        ),
        (dict(input=(5, 4)), r"input must have length 3 or 4, but got length 2", "input"),
        (dict(input=np.zeros((1, 2, 3, 5, 4))), r"input must be 3-D or 4-D, but got 5-D", "input"),
        (
            dict(grad_output=np.zeros((3, 7, 8), np.float32)),
            r"grad_output must be 4-D like input, but got 3-D",
            "grad_output",
        ),
        (dict(padding=(2, 2, 1)), r"padding must have length 4, but got length 3", "padding"),
        (dict(padding=(2, 2, 1, 1, 0)), r"padding must have length 4, but got length 5", "padding"),
        (dict(padding=(2.0, 2, 1, 1)), r"padding\[0\] must be an integer, but got 2.0 \(a float\)", "padding"),
        (dict(padding=(2, True, 1, 1)), r"padding\[1\] must be an integer, but got True \(a bool\)", "padding"),
        (dict(padding=4), r"padding must be a sequence of integers, but got 4", "padding"),
        (
            dict(padding=(4, 0, 1, 1), grad_output=np.zeros((2, 3, 7, 8), np.float32)),
            r"padding\[0\] \(left\) must be less than the input width 4, but got 4",
            "padding",
        ),
        (
            dict(padding=(0, 5, 1, 1)),
            r"padding\[1\] \(right\) must be less than the input width 4, but got 5",
            "padding",
        ),
        (
            dict(padding=(2, 2, 5, 1)),
            r"padding\[2\] \(top\) must be less than the input height 5, but got 5",
            "padding",
        ),
        (
            dict(padding=(2, 2, 1, 7)),
            r"padding\[3\] \(bottom\) must be less than the input height 5, but got 7",
            "padding",
        ),
        (
            dict(padding=(-3, -3, 1, 1)),
            r"padding must leave a padded size of at least 1 x 1 for input 5 x 4, but got "
            r"\(-3, -3, 1, 1\), giving 7 x -2",
            "padding",
        ),
        (
            dict(grad_output=np.zeros((3, 3, 7, 8), np.float32)),
            r"grad_output\.shape\[0\] must be 2 \(as input\), but got 3",
            "grad_output",
        ),
        (
            dict(grad_output=np.zeros((2, 4, 7, 8), np.float32)),
            r"grad_output\.shape\[1\] must be 3 \(as input\), but got 4",
            "grad_output",
        ),
        (
            dict(grad_output=np.zeros((2, 3, 6, 8), np.float32)),
            r"grad_output\.shape\[2\] must be 7 \(input height 5 \+ top 1 \+ bottom 1\), but got 6",
            "grad_output",
        ),
        (
            dict(grad_output=np.zeros((2, 3, 7, 9), np.float32)),
            r"grad_output\.shape\[3\] must be 8 \(input width 4 \+ left 2 \+ right 2\), but got 9",
            "grad_output",
        ),
        (
            dict(input=(2, 0, 5, 4), grad_output=np.zeros((2, 0, 7, 8), np.float32)),
            r"input\.shape\[1\] must be > 0 \(only the batch dimension of a 4-D input may be empty\), but got 0",
            "input",
        ),
        (dict(input=(0, 5, 4), grad_output=np.zeros((0, 7, 8), np.float32)), r"input\.shape\[0\] must be > 0", "input"),
        (dict(input=(2, 3, -5, 4)), r"input\[2\] must be >= 0, but got -5", "input"),
        (
            dict(grad_output=np.zeros((2, 3, 7, 8), np.int32)),
            r"grad_output\.dtype must be one of float32, float16, bfloat16, float64, complex64, complex128, but got int32",
            "grad_output",
        ),
        (
            dict(input=np.zeros((2, 3, 5, 4), np.float64)),
            r"input\.dtype must equal grad_output\.dtype \(float32\), but got float64",
            "input",
        ),
        (dict(grad_output=np.array(["a"])), r"grad_output must be a numeric array", "grad_output"),
        (dict(grad_output=object()), r"grad_output must be a numeric array", "grad_output"),
    ],
)
def test_errors(changes, message, param):
    with raises_param_error(message, param=param):
        call(**changes)


@pytest.mark.parametrize("name", ["grad_output", "input", "padding"])
def test_none_is_nullptr(name):
    with raises_param_error(rf"{name} is required, but got None", status=161001, param=name):
        call(**{name: None})


def test_param_error_is_value_and_type_error():
    assert issubclass(fastbwd.ParamError, ValueError) and issubclass(fastbwd.ParamError, TypeError)
    with pytest.raises(ValueError):
        call(padding=(9, 9, 9, 9))
    with pytest.raises(TypeError):
        call(padding=(9, 9, 9, 9))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("padding", [(3, 4, 2, 3), (1, 1, 5, 0), (2, -1, -1, 2)])
def test_nan_sums_are_the_positive_nan_and_copies_keep_their_bits(dtype, layout, padding):
    """A grad_input cell that sums several grad_output cells (edges, corners, rows the pad
    repeats) stores a NaN as the positive quiet NaN, whichever NaN it met; a cell with one
    source is that cell's copy, its NaN's bits included (docs/semantics.md §0.2)."""
    left, right, top, bottom = padding
    shape = (2, 3, 6, 20)
    out = (2, 3, 6 + top + bottom, 20 + left + right)
    rows, cols = np.arange(out[2])[:, None], np.arange(out[3])[None, :]
    # the cells the edge rows and columns sum (only where the pad repeats them: a positive pad)
    border = (top > 0) & (rows <= top) | (bottom > 0) & (rows >= top + 5)
    border = border | (left > 0) & (cols <= left) | (right > 0) & (cols >= left + 19)
    go = with_signed_nan(random(out, dtype, 45), 46, where=border)
    interior = (slice(None), slice(None), slice(max(top, 0) + 2, top + 4), slice(max(left, 0) + 2, left + 18))
    go[interior][:, :, 0, 0] = -np.nan  # a copied cell: its NaN stays negative
    args = (to_nhwc(go), (2, 6, 20, 3), padding) if layout == "NHWC" else (go, shape, padding)
    grad = pad_bwd(*args, layout=layout)
    if layout == "NHWC":
        grad = np.moveaxis(grad, -1, 1)
    copied = grad[:, :, max(-top, 0) + 2, max(-left, 0) + 2]
    assert has_the_bits_of(copied, -np.nan).all()
    sums = grad.copy()
    sums[:, :, max(-top, 0) + 2, max(-left, 0) + 2] = 0
    assert nan_cells_are_the_positive_nan(sums)
