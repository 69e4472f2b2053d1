"""GroupNorm+Swish's staged loops (issue 53): the Swish and its derivative evaluated stage by
stage over L1 chunks, the per-row vector steps (short rows, masked ends) and the scratch rows on
the stack. Each must give exactly the bits of the one-element formulas it replaces
(``swish_float32``, ``swish_derivative_float32``, ``_gnew_xhat``, ``_dx``), and the kernels
built on them the same bits for any task partition and thread count, NaN and infinities
included; the float64 reference checks the values at every row length the chunking treats
apart."""

import ml_dtypes
import numba
import numpy as np
import pytest

from bench.inputs import group_norm_swish_inputs
from fastbwd import group_norm_swish as gns
from fastbwd import group_norm_swish_backward as gns_bwd
from fastbwd.kernels import _group_norm_backward as backward
from fastbwd.kernels import _group_norm_forward as forward
from fastbwd.kernels import _group_norm_math as math_
from fastbwd.kernels import group_norm_swish as kernels
from fastbwd.kernels._halfbits import BFLOAT16, FLOAT16, NATIVE, load, store
from fastbwd.kernels._memory import flat_rows, stack_array
from fastbwd.testing import reference as ref
from fastbwd.testing.checks import assert_matches_reference, bitwise_equal

import kernel_twins
from conftest import BF16, assert_thread_invariant, has_the_bits_of, to_nhwc

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
FORMATS = {F32: NATIVE, F64: NATIVE, F16: FLOAT16, BF16: BFLOAT16}
CHUNK, ROWS = math_.STAGE_CHUNK, math_.STAGE_ROWS


def special_values(dtype, count, seed):
    """``count`` values of ``dtype``: a wide random spread with zeros of both signs, infinities,
    NaN of both signs, values past the clamp and the exp's flush point, and subnormals."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(count) * rng.choice([0.1, 3.0, 30.0, 200.0], count)
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 87.0, -87.4, 104.5, -104.5, 800.0, -800.0, 1e-40, -3e-39]
    values[: min(count, len(specials))] = specials[:count]
    rng.shuffle(values)
    return values.astype(dtype)


# ---- the staged rows against the one-element formulas -----------------------------------------


def same_values(a, b, dtype):
    """The same bits wherever ``a`` is not NaN, and NaN where it is: a NaN's sign is not part of
    the formulas (instruction selection orders a NaN's operands as it likes), only its being NaN
    and its not depending on the task partition (tested on the kernels below)."""
    a_values, b_values = np.asarray(a).view(dtype), np.asarray(b).view(dtype)
    nan = np.isnan(a_values.astype(np.float64))
    return bitwise_equal(nan, np.isnan(b_values.astype(np.float64))) and bitwise_equal(a[~nan], b[~nan])


def nans_are_positive(stored, dtype):
    """Whether every NaN of ``stored`` (``dtype``'s values or their uint16 bits) is the quiet NaN
    of positive sign."""
    values = np.asarray(stored).view(dtype)
    return bool(has_the_bits_of(values[np.isnan(values.astype(np.float64))], np.nan).all())


@numba.njit
def _swish_rows_of(y, scale, count, out, fmt):
    scratch = stack_array(ROWS, CHUNK, y)
    for i in range(count):
        scratch[0, i] = y[i]
    math_.swish_rows(scratch, scale, out, count, fmt)


@numba.njit
def _swish_one_by_one(y, scale, count, out, fmt):
    for i in range(count):
        out[i] = store(math_.swish(y[i], scale), fmt)


@numba.njit
def _gradient_rows_of(z, dy, count, out):
    scratch = stack_array(ROWS, CHUNK, z)
    for i in range(count):
        scratch[0, i] = z[i]
        scratch[3, i] = dy[i]
    math_.swish_gradient_rows(scratch, out, count)


@numba.njit
def _gradient_one_by_one(y, scale, dy, count, out):
    for i in range(count):
        out[i] = dy[i] * math_.swish_derivative(scale * y[i])


@numba.njit
def _arguments(y, scale, count, out):
    for i in range(count):
        out[i] = math_.swish_argument(y[i], scale)


@pytest.mark.parametrize("dtype, fmt_dtype", [(F32, F32), (F32, BF16), (F32, F16), (F64, F64)], ids=str)
@pytest.mark.parametrize("scale", [1.0, -0.7, 3.0, 0.0, np.inf])
@pytest.mark.parametrize("count", [1, 15, 16, 63, 64, 65, 200, CHUNK])
def test_swish_rows_give_the_one_element_bits(dtype, fmt_dtype, scale, count):
    y = special_values(dtype, count, seed=count)
    fmt = FORMATS[fmt_dtype]
    storage = np.uint16 if fmt_dtype in (F16, BF16) else dtype
    staged, single = np.empty(count, storage), np.empty(count, storage)
    _swish_rows_of(y, dtype.type(scale), count, staged, fmt)
    _swish_one_by_one(y, dtype.type(scale), count, single, fmt)
    assert same_values(staged, single, fmt_dtype)
    assert nans_are_positive(staged, fmt_dtype)  # the stages store every NaN as the one NaN


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize("scale", [1.0, -0.7, 3.0, 0.0, -np.inf])
@pytest.mark.parametrize("count", [1, 17, 64, 100, CHUNK])
def test_swish_gradient_rows_give_the_one_element_bits(dtype, scale, count):
    y = special_values(dtype, count, seed=count + 1)
    dy = special_values(dtype, count, seed=count + 2)
    z = np.empty(count, dtype)
    _arguments(y, dtype.type(scale), count, z)
    staged, single = np.empty(count, dtype), np.empty(count, dtype)
    _gradient_rows_of(z, dy, count, staged)
    _gradient_one_by_one(y, dtype.type(scale), dy, count, single)
    assert same_values(staged, single, dtype)


@numba.njit
def _stage_rows_into_scratch(y, scale, count):
    """The NHWC way: the stages over a whole number of STAGE_ALIGN elements into a scratch row."""
    scratch = stack_array(ROWS, CHUNK, y)
    for i in range(count):
        scratch[0, i] = y[i]
    math_.swish_rows(scratch, scale, scratch[math_.STAGE_OUT], math_.aligned(count), NATIVE)
    return scratch[math_.STAGE_OUT, :count].copy()


@pytest.mark.parametrize("count", [1, 13, 64, 77, CHUNK])
def test_rows_over_a_whole_number_of_vectors_give_the_same_bits(count):
    """Running the stages past ``count`` (to a multiple of STAGE_ALIGN) changes none of the
    first ``count`` results, whatever the scratch rows held before, nor does stopping at
    ``count``: NaN signs included (a scalar tail may order a NaN's operands otherwise, seen on
    AVX-512, but the last stage stores every NaN as the one NaN)."""
    y = special_values(F32, count, seed=3 * count)
    direct = np.empty(count, F32)
    _swish_rows_of(y, F32.type(1.0), count, direct, NATIVE)
    # the second time over the first call's leftovers on the stack
    staged = [_stage_rows_into_scratch(y, F32.type(1.0), count) for _ in range(2)]
    assert bitwise_equal(staged[0], staged[1]) and bitwise_equal(staged[0], direct)
    assert math_.aligned(count) % math_.STAGE_ALIGN == 0 and math_.aligned(count) <= CHUNK


@numba.njit
def _gradient_rows_into_scratch(z, dy, count, run):
    """The derivative's stages over ``run`` elements into a scratch row (the NHWC backward's way
    when ``run`` is ``aligned(count)``)."""
    scratch = stack_array(ROWS, CHUNK, z)
    for i in range(count):
        scratch[0, i] = z[i]
        scratch[3, i] = dy[i]
    math_.swish_gradient_rows(scratch, scratch[math_.STAGE_OUT], run)
    return scratch[math_.STAGE_OUT, :count].copy()


@pytest.mark.parametrize("count", [1, 13, 64, 77, 199, CHUNK])
def test_gradient_rows_over_a_whole_number_of_vectors_give_the_same_bits(count):
    """The derivative's stages run past ``count`` (the NHWC backward's pieces) or stopping at it
    give the same first ``count`` results, NaN signs included (z and dy both NaN of either sign)."""
    rng = np.random.default_rng(5 * count)
    choices = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -2.0, 104.0, -104.0], F32)
    z, dy = rng.choice(choices, count), rng.choice(choices, count)
    direct = _gradient_rows_into_scratch(z, dy, count, count)
    assert bitwise_equal(_gradient_rows_into_scratch(z, dy, count, math_.aligned(count)), direct)


# ---- the per-row vector steps -----------------------------------------------------------------


@numba.njit
def _affine_both_ways(x, start, stop, hw, mean, rstd, gamma, beta, fmt, out_lanes, out_loop):
    forward._affine_rows(x, start, stop, hw, out_lanes, 3, mean, rstd, gamma, beta, fmt, NATIVE)
    for i in range(start, stop):
        c = i // hw
        out_loop[3 + i - start] = math_.fma(load(x[i], fmt) - mean, rstd * gamma[c], beta[c])


@numba.njit
def _argument_both_ways(
    x, dy, start, stop, hw, mean, rstd, gamma, beta, scale, fmt, z_lanes, dy_lanes, z_loop, dy_loop
):
    backward._swish_argument_rows(
        x, dy, start, stop, hw, z_lanes[2:], dy_lanes[2:], mean, rstd, gamma, beta, scale, fmt
    )
    for i in range(start, stop):
        c = i // hw
        xhat = (load(x[i], fmt) - mean) * rstd
        z_loop[2 + i - start] = math_.swish_argument(math_.fma(xhat, gamma[c], beta[c]), scale)
        dy_loop[2 + i - start] = load(dy[i], fmt)


@numba.njit
def _dx_both_ways(gnew, x, start, stop, hw, mean, rstd, gamma, c1, c2, fmt, dx_lanes, dx_loop):
    backward._dx_rows(gnew, x, dx_lanes, start, stop, hw, -2, mean, rstd, gamma, c1, c2, fmt)
    for i in range(start, stop):
        xhat = (load(x[i], fmt) - mean) * rstd
        dx_loop[i] = store(backward._dx(gnew[i + 2], xhat, rstd, gamma[i // hw], c1, c2), fmt)


@numba.njit
def _sums_both_ways(gnew, x, start, stop, hw, mean, rstd, fmt, sums_rows, sums_loop):
    backward._channel_sums(gnew, x, sums_rows[0], sums_rows[1], start, stop, hw, -2, mean, rstd, fmt)
    for c in range(start // hw, stop // hw):
        total_g = sums_loop.dtype.type(0)
        total_gx = total_g
        for block_start in range(c * hw, (c + 1) * hw, math_.BLOCK):
            lanes = np.zeros((2, math_.PARTIAL_SUMS), sums_loop.dtype)
            for i in range(block_start, min(block_start + math_.BLOCK, (c + 1) * hw)):
                g = gnew[i + 2]
                lanes[0, (i - block_start) % math_.PARTIAL_SUMS] += g
                lanes[1, (i - block_start) % math_.PARTIAL_SUMS] += g * ((load(x[i], fmt) - mean) * rstd)
            h = math_.PARTIAL_SUMS // 2
            while h >= 1:
                for j in range(h):
                    lanes[0, j] += lanes[0, j + h]
                    lanes[1, j] += lanes[1, j + h]
                h //= 2
            total_g += lanes[0, 0]
            total_gx += lanes[1, 0]
        sums_loop[0, c] = total_g
        sums_loop[1, c] = total_gx


def _stored(values, dtype):
    return values.astype(dtype).view(np.uint16) if dtype in (F16, BF16) else values.astype(dtype)


@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=str)
@pytest.mark.parametrize("start, stop", [(0, 1), (5, 21), (16, 32), (3, 50), (0, 128), (7, 7)])
@pytest.mark.parametrize("hw", [16, 7, 200])
def test_row_vector_steps_give_the_loops_bits(dtype, start, stop, hw):
    """The intrinsics that handle channel rows of ``hw`` positions in vectors of LANES with a
    masked last step per row (no loop remainder: a 4 x 4 row is one step) give exactly the
    scalar loops' bits, with each row's channel constants, and write nothing outside their
    range."""
    compute = F64 if dtype == F64 else F32
    fmt = FORMATS[dtype]
    x = _stored(special_values(F64, 140, seed=start + stop), dtype)
    dy = _stored(special_values(F64, 140, seed=start + stop + 1), dtype)
    c = [compute.type(v) for v in (0.3, 1.7, 0.25, 1.0, -0.6)]
    rng = np.random.default_rng(hw)
    gamma, beta = (rng.standard_normal(160).astype(compute) for _ in range(2))
    a = np.full(160, 7.0, compute)
    b = a.copy()
    _affine_both_ways(x, start, stop, hw, c[0], c[1], gamma, beta, fmt, a, b)
    assert same_values(a, b, compute)
    z_lanes, dy_lanes, z_loop, dy_loop = (np.full(160, 7.0, compute) for _ in range(4))
    _argument_both_ways(x, dy, start, stop, hw, c[0], c[1], gamma, beta, c[3], fmt, z_lanes, dy_lanes, z_loop, dy_loop)
    assert same_values(z_lanes, z_loop, compute) and bitwise_equal(dy_lanes, dy_loop)
    gnew = special_values(compute, 160, seed=start)
    dx_lanes, dx_loop = np.full(150, 5, x.dtype), np.full(150, 5, x.dtype)
    _dx_both_ways(gnew, x, start, stop, hw, c[0], c[1], gamma, c[2], c[4], fmt, dx_lanes, dx_loop)
    assert same_values(dx_lanes, dx_loop, dtype)
    # the channel sums over the whole rows in [start, stop)
    first, end = -(-start // hw) * hw, stop // hw * hw
    if first < end:
        sums_rows, sums_loop = np.full((2, 160), 3.0, compute), np.full((2, 160), 3.0, compute)
        _sums_both_ways(gnew, x, first, end, hw, c[0], c[1], fmt, sums_rows, sums_loop)
        assert same_values(sums_rows, sums_loop, compute)


# ---- scratch rows on the stack ----------------------------------------------------------------


@numba.njit(_nrt=False)
def _stack_sum(values):
    scratch = stack_array(3, 64, values)
    for i in range(64):
        scratch[2, i] = values[i] * 2
    total = values.dtype.type(0)
    for i in range(64):
        total += scratch[2, i]
    return total, scratch.shape[0], scratch.shape[1], scratch.strides[0]


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_stack_array_is_a_c_contiguous_array_of_the_like_dtype(dtype):
    values = np.arange(64, dtype=dtype)
    total, rows, columns, stride = _stack_sum(values)
    assert (total, rows, columns, stride) == (2 * values.sum(), 3, 64, 64 * dtype.itemsize)


@numba.njit
def _flat_rows_view(array, first, stop):
    view = flat_rows(array, first, stop)
    view[0] = -1  # a view, not a copy
    return view.copy(), view.strides[0]


@pytest.mark.parametrize("shape", [(3, 4, 5), (2, 3, 4, 2), (4, 7)], ids=str)
def test_flat_rows_is_the_flat_view_of_leading_rows(shape):
    array = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    for first, stop in ((0, 1), (1, shape[0]), (shape[0] - 1, shape[0])):
        copy = array.copy()
        values, stride = _flat_rows_view(copy, first, stop)
        expected = array[first:stop].reshape(-1)
        assert stride == 4 and np.array_equal(values[1:], expected[1:]) and values[0] == -1
        assert copy[first:stop].reshape(-1)[0] == -1 and np.array_equal(copy[:first], array[:first])


# ---- the kernels: every chunking, every partition, NaN and infinities ------------------------


SHORT_AND_LONG_ROWS = [
    ((2, 16, 1, 1), 2),  # one position
    ((2, 64, 4, 4), 32),  # rows of 16: one vector each, 32 rows a chunk
    ((1, 12, 3, 5), 3),  # rows of 15: masked steps only
    ((2, 6, 17, 1), 2),  # rows of 17: a vector and a masked step
    ((1, 4, 8, 64), 2),  # rows of 512: one chunk a row
    ((1, 4, 513), 2),  # rows of 513: a chunk and a one-element chunk
    ((1, 2, 37, 31), 1),  # rows of 1147: chunks inside a row
    ((3, 30, 5, 7), 5),  # groups of 6 rows of 35: a chunk of 14 rows does not divide a group
]


def _with_non_finite(arrays, seed):
    """Copies of ``arrays`` (same shapes) with NaN, infinities and huge values sprinkled in."""
    rng = np.random.default_rng(seed)
    result = []
    for array in arrays:
        values = array.astype(np.float64)
        flat = values.reshape(-1)
        picks = rng.choice(flat.size, size=max(1, flat.size // 40), replace=False)
        flat[picks] = rng.choice([np.nan, -np.nan, np.inf, -np.inf, 1e4, -1e4], picks.size)
        result.append(values.astype(array.dtype))
    return result


@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=str)
@pytest.mark.parametrize("shape, groups", SHORT_AND_LONG_ROWS)
def test_every_chunking_matches_the_reference(dtype, shape, groups):
    dy, _, _, x, gamma, beta = group_norm_swish_inputs(shape, groups, dtype, seed=31)
    y, mean, rstd = gns(x, gamma, beta, groups, swish_scale=0.7)
    assert_matches_reference(y, ref.group_norm_swish_forward(x, gamma, beta, groups, swish_scale=0.7)[0])
    result = gns_bwd(dy, mean, rstd, x, gamma, beta, groups, "NCHW", 0.7)
    expected = ref.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, groups, swish_scale=0.7)
    for ours, theirs in zip(result, expected):
        assert_matches_reference(ours, theirs)
    if len(shape) >= 3:
        nhwc = gns_bwd(to_nhwc(dy), mean, rstd, to_nhwc(x), gamma, beta, groups, "NHWC", 0.7)
        assert bitwise_equal(np.moveaxis(nhwc[0], -1, 1), result[0])
        assert bitwise_equal(nhwc[1], result[1]) and bitwise_equal(nhwc[2], result[2])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape, groups", [((2, 64, 4, 4), 32), ((3, 24, 9, 13), 6), ((1, 48, 40, 17), 8)])
def test_non_finite_values_give_the_same_bits_for_any_thread_count(dtype, layout, shape, groups):
    dy, mean, rstd, x, gamma, beta = group_norm_swish_inputs(shape, groups, dtype, seed=33)
    dy, x = _with_non_finite((dy, x), seed=34)
    mean, rstd = _with_non_finite((mean, rstd), seed=35)
    if layout == "NHWC":
        dy, x = to_nhwc(dy), to_nhwc(x)

    assert_thread_invariant(lambda: gns(x, gamma, beta, groups, layout))
    assert_thread_invariant(lambda: gns_bwd(dy, mean, rstd, x, gamma, beta, groups, layout, 1.3))


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=str)
@pytest.mark.parametrize("shape, groups", [((3, 24, 17, 9), 6), ((2, 336, 3, 7), 42), ((2, 40, 9, 9), 10)])
def test_nhwc_run_widths_give_the_same_bits_with_non_finite_values(dtype, shape, groups, monkeypatch, replan):
    """NHWC tasks span channel runs whose widths follow the thread count: every width, the flat
    whole-image steps too, gives the same bits, NaN signs included, in both directions."""
    dy, mean, rstd, x, gamma, beta = group_norm_swish_inputs(shape, groups, dtype, seed=36)
    dy, x = _with_non_finite((dy, x), seed=37)
    dy, x = to_nhwc(dy), to_nhwc(x)
    group_size = shape[1] // groups
    results = []
    for channels, per_thread in ((shape[1], 1), (group_size, 1), (3 * group_size, 2), (512, 64)):
        monkeypatch.setattr(kernels, "NHWC_TASK_CHANNELS", channels)
        monkeypatch.setattr(kernels, "NHWC_TASKS_PER_THREAD", per_thread)
        replan()
        results.append(
            gns(x, gamma, beta, groups, "NHWC", swish_scale=-0.9)
            + gns_bwd(dy, mean, rstd, x, gamma, beta, groups, "NHWC", -0.9)
        )
    for other in results[1:]:
        assert all(bitwise_equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
@pytest.mark.parametrize("groups_per_task", [1, 2])
def test_nchw_forward_pairs_give_the_same_bits_with_non_finite_values(dtype, groups_per_task):
    """An NCHW forward task of two groups cuts its chunks from each group's start: NaN and
    infinities anywhere give the bits of tasks of one group."""
    shape, groups = (2, 40, 6, 7), 10
    _, _, _, x, gamma, beta = group_norm_swish_inputs(shape, groups, dtype, seed=38)
    (x,) = _with_non_finite((x,), seed=39)
    kernel_x = x.view(np.uint16) if dtype in (F16, BF16) else x
    results = []
    for per_task in (1, groups_per_task):
        y = np.empty_like(kernel_x)
        mean, rstd = np.empty((2, groups), F32), np.empty((2, groups), F32)
        kernel_twins.serial(kernels.group_norm_swish_fwd_nchw, kernels.FORWARD_READ_ONLY)(
            kernel_x.reshape(2, 40, 42),
            gamma.astype(F32),
            beta.astype(F32),
            F32.type(1e-5),
            True,
            F32.type(1),
            y.reshape(2, 40, 42),
            mean,
            rstd,
            per_task,
            FORMATS[dtype],
        )
        results.append((y, mean, rstd))
    assert all(bitwise_equal(a, b) for a, b in zip(*results))
    public = gns(x, gamma.astype(F32), beta.astype(F32), groups)
    assert bitwise_equal(public[0].view(np.uint16) if dtype in (F16, BF16) else public[0], results[0][0])


def test_the_chunking_is_every_row_length_the_kernels_treat_apart():
    """SHORT_AND_LONG_ROWS reaches rows shorter than a vector, rows of whole vectors, chunks of
    many rows, a chunk per row and chunks inside a row."""
    lengths = {int(np.prod(shape[2:])) for shape, _ in SHORT_AND_LONG_ROWS}
    assert min(lengths) < 16 and 16 in lengths
    assert any(length < CHUNK and CHUNK % length for length in lengths)
    assert CHUNK in lengths and any(length > CHUNK for length in lengths)
    assert any(length > 2 * CHUNK for length in lengths)


def test_half_rows_store_what_the_float32_rows_round_to():
    """bfloat16 and float16 results are the float32 results rounded once (the staged rows store
    through the same encoder)."""
    y = special_values(F32, 300, seed=41)
    out32 = np.empty(300, F32)
    _swish_rows_of(y, F32.type(1.0), 300, out32, NATIVE)
    for dtype, fmt in ((BF16, BFLOAT16), (F16, FLOAT16)):
        out = np.empty(300, np.uint16)
        _swish_rows_of(y, F32.type(1.0), 300, out, fmt)
        expected = out32.astype(ml_dtypes.bfloat16 if dtype == BF16 else np.float16).view(np.uint16)
        finite = np.isfinite(out32)
        assert bitwise_equal(out[finite], expected[finite])
        assert np.isnan(out.view(dtype)[~finite & np.isnan(out32)].astype(F32)).all()
