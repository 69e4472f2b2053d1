"""group_norm_swish's (the forward's) loop nests (docs/semantics.md §5.1), NCHW and NHWC.

One task per (n, group) or per two groups of an image (NCHW family), or per (n, run of whole
groups) (NHWC). Statistics in two passes over the group, which a task rereads from its cache
(G1's group is 64 KB): the mean of ``x - shift`` (``shift`` is the group's first element, so a
constant group has mean exactly that value and variance exactly 0, hence rstd = inf at eps = 0
as in PyTorch), then the centred sums ``t1 = sum(x - mean)`` and ``t2 = sum((x - mean)^2)`` with
``var = (t2 - t1*t1/M) / M`` (t1 corrects for the rounding of the mean). A third pass writes
y. Every sum has a fixed order (below), so no thread count changes a bit.
"""

import math

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic, overload

from ._group_norm_math import (
    BLOCK,
    STAGE_CHUNK,
    STAGE_OUT,
    STAGE_ROWS,
    aligned,
    fma,
    for_each_row,
    groups_share_a_stage,
    lane_sums,
    store_rows,
    swish_rows,
    task_groups,
)
from ._halfbits import NATIVE, load, one_nan, one_nan_ir, store
from ._jit import helper, leaf_helper, parallel_kernel, wide_vectors
from ._lanes import LANES, array_structs, decode_lanes, fma_lanes, for_each_vector, splat, store_lanes
from ._memory import flat_rows, stack_array


@intrinsic
def _block_moments(typingctx, row, start, stop, offset, center, other_center, fmt):
    """``(sum of d, sum of d^2, other sum of d, other sum of d^2)``: ``d = x - center`` over
    ``row[start:stop]`` (1-D, C-contiguous, decoded with ``fmt``), and ``x - other_center`` over
    the same positions ``offset`` elements on (a second group's block; offset 0 repeats the
    first). Each sum in the order of the backward's :func:`_channel_sums`: element ``start + i``
    goes to lane ``i % LANES`` (each lane from +0.0, in order), then the lanes are folded by
    halving; a last partial vector reads only its elements (masked loads). The two groups' adds
    are independent chains that run side by side, where one group's sums would wait on each
    add's latency."""
    sig = types.UniTuple(center, 4)(row, types.intp, types.intp, types.intp, center, other_center, fmt)
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        (x,) = array_structs(context, builder, signature, args, 0)
        start, stop, offset = args[1], args[2], args[3]
        vector = ir.VectorType(context.get_data_type(signature.args[4]), LANES)
        centers = [splat(builder, vector, value) for value in (args[4], args[5])]

        def terms(position, used):
            deviations = [
                builder.fsub(decode_lanes(builder, builder.gep(x.data, [at]), format_name, vector, used), center)
                for at, center in zip((position, builder.add(position, offset)), centers)
            ]
            return [term for d in deviations for term in (d, builder.fmul(d, d))]

        totals = lane_sums(builder, vector, start, stop, terms, 4)
        return context.make_tuple(builder, signature.return_type, totals)

    return sig, codegen


@intrinsic
def _affine_rows(typingctx, x, first, stop, hw, out, out_start, mean, rstd, gamma, beta, fmt, out_fmt):
    """``out[out_start + i - first] = fma(x[i] - mean, rstd * gamma[c], beta[c])`` for ``i`` in
    ``[first, stop)``, flat positions of one image (channel ``c = i // hw``): ``x`` decoded
    with ``fmt``, the result stored in ``out_fmt`` (both 1-D, C-contiguous; ``gamma``, ``beta``
    in the compute type). Row by row (:func:`for_each_row`), LANES elements per step and one
    masked step at a row's end, so that a short channel row costs a few vector operations and
    no loop remainder."""
    sig = types.void(x, types.intp, types.intp, types.intp, out, types.intp, mean, mean, gamma, beta, fmt, out_fmt)
    format_name, out_format_name = fmt.format_name, out_fmt.format_name

    def codegen(context, builder, signature, args):
        x_struct, out_struct, gamma_struct, beta_struct = array_structs(context, builder, signature, args, 0, 4, 8, 9)
        first, stop, hw, out_start = args[1], args[2], args[3], args[5]
        vector = ir.VectorType(context.get_data_type(signature.args[6]), LANES)
        mean_lanes = splat(builder, vector, args[6])
        offset = builder.sub(out_start, first)

        def row(c, row_start, row_stop):
            scale = builder.fmul(args[7], builder.load(builder.gep(gamma_struct.data, [c])))
            scale_lanes = splat(builder, vector, scale)
            beta_lanes = splat(builder, vector, builder.load(builder.gep(beta_struct.data, [c])))

            def body(position, used):
                values = decode_lanes(builder, builder.gep(x_struct.data, [position]), format_name, vector, used)
                result = one_nan_ir(
                    builder, fma_lanes(builder, builder.fsub(values, mean_lanes), scale_lanes, beta_lanes)
                )
                pointer = builder.gep(out_struct.data, [builder.add(position, offset)])
                store_lanes(builder, pointer, result, out_format_name, used)

            for_each_vector(builder, row_start, row_stop, body, unroll=False)

        for_each_row(builder, first, stop, hw, row)
        return context.get_dummy_value()

    return sig, codegen


@helper
def _shift_of(first, zero):
    """The shift a group's first pass sums from: its first element, or 0 when that is an
    infinity or NaN (which would turn every other element into NaN)."""
    return first if abs(first) < math.inf else zero


@helper
def _group_rstd(t1, t2, count, eps, zero, one):
    """``1/sqrt(var + eps)`` from the centred sums: ``var = (t2 - t1*t1/M) / M``, and +0 where
    rounding leaves it below 0 (NaN stays NaN)."""
    var = (t2 - t1 * (t1 / count)) / count
    var = zero if var < zero else var
    return one / math.sqrt(var + eps)


@leaf_helper
def _normalise_groups(x, y, hw, first, last, group_size, mean, rstd, gamma, beta, activate_swish, swish_scale, fmt):
    """``y = (x - mean) * (rstd*gamma) + beta`` (one rounding: fma), then Swish when
    ``activate_swish``, for groups ``[first, last)`` of one image (``x``, ``y``: its flat
    ``(C*HxW,)`` rows; ``mean``, ``rstd``: its ``(G,)`` statistics). Each group in chunks of
    whole rows (or of :data:`STAGE_CHUNK` elements of a longer row), counted from the group's
    start: each row's affine part into a scratch row, then the staged Swish over the whole chunk
    (:func:`swish_rows`), so that short rows (4 x 4, 8 x 8) cost no loop of their own in the
    Swish's stages. The chunks depend on the group alone, not on the task's groups: any NaN comes
    out the same wherever the loops' vector and scalar code split (the task partition follows the
    thread count), but for two groups that share one (:func:`groups_share_a_stage`: at 4 x 4 half
    the stage loops)."""
    wide_vectors()
    scratch = stack_array(STAGE_ROWS, STAGE_CHUNK, mean)
    step = STAGE_CHUNK if hw >= STAGE_CHUNK else (STAGE_CHUNK // hw) * hw
    size = group_size * hw
    if activate_swish and last - first == 2 and groups_share_a_stage(size):
        for group in range(first, last):
            start = group * size
            at = start - first * size
            _affine_rows(x, start, start + size, hw, scratch[0], at, mean[group], rstd[group], gamma, beta, fmt, NATIVE)
        swish_rows(scratch, swish_scale, y[first * size : last * size], 2 * size, fmt)
        return
    for group in range(first, last):
        group_stop = (group + 1) * size
        for chunk in range(group * size, group_stop, step):
            chunk_stop = min(chunk + step, group_stop)
            if activate_swish:
                _affine_rows(
                    x, chunk, chunk_stop, hw, scratch[0], 0, mean[group], rstd[group], gamma, beta, fmt, NATIVE
                )
                swish_rows(scratch, swish_scale, y[chunk:chunk_stop], chunk_stop - chunk, fmt)
            else:
                _affine_rows(x, chunk, chunk_stop, hw, y, chunk, mean[group], rstd[group], gamma, beta, fmt, fmt)


@leaf_helper
def _moment_sums(row, first, stop, offset, center, other_center, zero, fmt):
    """:func:`_block_moments` over ``row[first:stop]`` (and ``offset`` further) in blocks of
    :data:`BLOCK`, block sums added in order: ``(t1, t2, other t1, other t2)``."""
    t1 = zero
    t2 = zero
    other_t1 = zero
    other_t2 = zero
    for block_start in range(first, stop, BLOCK):
        d1, d2, other_d1, other_d2 = _block_moments(
            row, block_start, min(block_start + BLOCK, stop), offset, center, other_center, fmt
        )
        t1 += d1
        t2 += d2
        other_t1 += other_d1
        other_t2 += other_d2
    return t1, t2, other_t1, other_t2


@leaf_helper
def _group_statistics(row, first, size, offset, count, eps, zero, one, fmt):
    """``(mean, rstd, other mean, other rstd)`` of the group ``row[first:first + size]`` and of
    the group ``offset`` elements on (offset 0: the same group twice, its results repeated):
    the shifted sums, then the centred sums, the two groups' side by side."""
    shift = _shift_of(load(row[first], fmt), zero)
    other_shift = _shift_of(load(row[first + offset], fmt), zero)
    stop = first + size
    total, _, other_total, _ = _moment_sums(row, first, stop, offset, shift, other_shift, zero, fmt)
    group_mean = shift + total / count
    other_mean = other_shift + other_total / count
    t1, t2, other_t1, other_t2 = _moment_sums(row, first, stop, offset, group_mean, other_mean, zero, fmt)
    return (
        group_mean,
        _group_rstd(t1, t2, count, eps, zero, one),
        other_mean,
        _group_rstd(other_t1, other_t2, count, eps, zero, one),
    )


@parallel_kernel
def group_norm_swish_fwd_nchw(x, gamma, beta, eps, activate_swish, swish_scale, y, mean, rstd, groups_per_task, fmt):
    """x -> y, both (N, C, HxW) C-contiguous; gamma, beta (C,), eps and swish_scale in the
    compute type; mean, rstd (N, G) compute-type outputs.

    Parallel over (n, run of ``groups_per_task`` groups, 1 or 2; the last run of an image may
    be shorter); a task writes only its groups' channels of ``y[n]`` and their ``mean[n, g]``
    and ``rstd[n, g]``. A group is one contiguous run of D*HxW elements, summed in blocks of
    :data:`BLOCK` (:func:`_block_moments`), block sums added in order; the sums of a task's
    two groups run side by side (a lone group's with a copy of themselves:
    :func:`_group_statistics`), each in the same order, so the run length changes no bit.
    """
    groups = mean.shape[1]
    runs = (groups + groups_per_task - 1) // groups_per_task
    for task in prange(x.shape[0] * runs):
        wide_vectors()
        n, first, last = task_groups(task, runs, groups_per_task, groups)
        _nchw_forward_task(x, gamma, beta, eps, activate_swish, swish_scale, y, mean, rstd, n, first, last, fmt)


@leaf_helper
def _nchw_forward_task(x, gamma, beta, eps, activate_swish, swish_scale, y, mean, rstd, n, g, last, fmt):
    """Image ``n``, groups ``[g, last)`` (one or two) of the NCHW forward. A leaf helper (no
    reference counting): its row views would otherwise cost two atomic operations each, a
    large part of a call on small groups."""
    wide_vectors()
    _, channels, hw = x.shape
    group_size = channels // mean.shape[1]
    size = group_size * hw
    zero = mean.dtype.type(0)
    one = mean.dtype.type(1)
    count = mean.dtype.type(size)
    offset = size if last - g == 2 else 0  # a lone group is summed twice, side by side
    group_mean, group_rstd, other_mean, other_rstd = _group_statistics(
        flat_rows(x, n, n + 1), g * size, size, offset, count, eps, zero, one, fmt
    )
    # a NaN statistic is stored as one NaN whatever summed it (one_nan)
    mean[n, g] = one_nan(group_mean)
    rstd[n, g] = one_nan(group_rstd)
    if offset:
        mean[n, g + 1] = one_nan(other_mean)
        rstd[n, g + 1] = one_nan(other_rstd)
    _normalise_groups(
        flat_rows(x, n, n + 1),
        flat_rows(y, n, n + 1),
        hw,
        g,
        last,
        group_size,
        mean[n],
        rstd[n],
        gamma,
        beta,
        activate_swish,
        swish_scale,
        fmt,
    )


@parallel_kernel
def group_norm_swish_fwd_nhwc(x, gamma, beta, eps, activate_swish, swish_scale, y, mean, rstd, groups_per_task, fmt):
    """x -> y, both (N, HxW, C) C-contiguous; the other arguments as for the NCHW kernel.

    Parallel over (n, run of ``groups_per_task`` consecutive groups); a task writes only its
    channels of ``y[n]`` and its groups' ``mean[n]``, ``rstd[n]``. Per channel, positions are
    added in order within blocks of :data:`BLOCK`, block sums in order; a group adds its
    channels' sums in channel order. So the run width changes no bit; the order differs from
    the NCHW kernel's, so the two layouts agree to rounding, not bitwise.
    """
    groups = mean.shape[1]
    runs = (groups + groups_per_task - 1) // groups_per_task
    for task in prange(x.shape[0] * runs):
        wide_vectors()
        n, first, last = task_groups(task, runs, groups_per_task, groups)
        _nhwc_forward_run(x, gamma, beta, eps, activate_swish, swish_scale, y, mean, rstd, n, first, last, fmt)


@helper
def _nhwc_channel_sums(x, n, start, center, total_d, total_dd, block_d, block_dd, fmt):
    """``total_d[k] = sum over positions of (x[n, :, start + k] - center[k])`` and ``total_dd``
    of its squares, for the run's channels ``k``; inner loops along the channels."""
    wide_vectors()
    hw = x.shape[1]
    width = total_d.shape[0]
    total_d[:] = 0
    total_dd[:] = 0
    for block_start in range(0, hw, BLOCK):
        block_d[:] = 0
        block_dd[:] = 0
        for i in range(block_start, min(block_start + BLOCK, hw)):
            x_row = x[n, i, start : start + width]
            for k in range(width):
                d = load(x_row[k], fmt) - center[k]
                block_d[k] += d
                block_dd[k] += d * d
        total_d += block_d
        total_dd += block_dd


@helper
def _nhwc_forward_run(x, gamma, beta, eps, activate_swish, swish_scale, y, mean, rstd, n, first_group, last_group, fmt):
    """Image ``n``, groups ``[first_group, last_group)`` of the NHWC forward."""
    wide_vectors()
    _, hw, channels = x.shape
    groups = mean.shape[1]
    group_size = channels // groups
    zero = mean.dtype.type(0)
    one = mean.dtype.type(1)
    count = mean.dtype.type(group_size * hw)
    start = first_group * group_size
    width = (last_group - first_group) * group_size
    center = np.empty(width, mean.dtype)
    scale = np.empty(width, mean.dtype)
    total_d = np.empty(width, mean.dtype)
    total_dd = np.empty(width, mean.dtype)
    block_d = np.empty(width, mean.dtype)
    block_dd = np.empty(width, mean.dtype)
    for k in range(width):
        center[k] = _shift_of(load(x[n, 0, start + (k // group_size) * group_size], fmt), zero)
    _nhwc_channel_sums(x, n, start, center, total_d, total_dd, block_d, block_dd, fmt)
    for g in range(first_group, last_group):
        first = (g - first_group) * group_size
        total = total_d[first]
        for k in range(first + 1, first + group_size):
            total += total_d[k]
        group_mean = center[first] + total / count
        for k in range(first, first + group_size):
            center[k] = group_mean
    _nhwc_channel_sums(x, n, start, center, total_d, total_dd, block_d, block_dd, fmt)
    for g in range(first_group, last_group):
        first = (g - first_group) * group_size
        t1 = total_d[first]
        t2 = total_dd[first]
        for k in range(first + 1, first + group_size):
            t1 += total_d[k]
            t2 += total_dd[k]
        group_rstd = _group_rstd(t1, t2, count, eps, zero, one)
        mean[n, g] = one_nan(center[first])  # one NaN whatever summed it, as NCHW's
        rstd[n, g] = one_nan(group_rstd)
        for k in range(first, first + group_size):
            scale[k] = group_rstd * gamma[start + k]
    _nhwc_normalise(
        flat_rows(x, n, n + 1),
        flat_rows(y, n, n + 1),
        channels,
        start,
        center,
        scale,
        beta[start : start + width],
        activate_swish,
        swish_scale,
        fmt,
    )


@leaf_helper
def _nhwc_affine(x, y, count, center, scale, beta, fmt, out_fmt):
    """``y[k] = fma(x[k] - center[k], scale[k], beta[k])`` for ``k < count`` (``x`` decoded with
    ``fmt``, ``y`` stored with ``out_fmt``)."""
    wide_vectors()
    for k in range(count):
        y[k] = store(one_nan(fma(load(x[k], fmt) - center[k], scale[k], beta[k])), out_fmt)


@leaf_helper
def _nhwc_normalise(x, y, channels, start, center, scale, beta, activate_swish, swish_scale, fmt):
    """y for the channels ``[start, start + width)`` of every position of one image (``x``, ``y``:
    its flat ``(HxW*C,)`` rows; ``center``, ``scale``, ``beta``: the run's per-channel mean,
    rstd*gamma and beta, ``width`` long). Staged Swish (:func:`swish_rows`) over chunks of whole
    positions when the run spans all channels (contiguous), else of one position's run."""
    wide_vectors()
    width = center.shape[0]
    hw = x.shape[0] // channels
    if not activate_swish:
        for i in range(hw):
            row = i * channels + start
            _nhwc_affine(x[row : row + width], y[row : row + width], width, center, scale, beta, fmt, fmt)
        return
    scratch = stack_array(STAGE_ROWS, STAGE_CHUNK, center)
    values = scratch[0]
    per_chunk = max(1, STAGE_CHUNK // width) if width == channels else 1
    for first in range(0, hw, per_chunk):
        last = min(first + per_chunk, hw)
        if per_chunk > 1:
            for i in range(first, last):
                row = i * channels
                _nhwc_affine(
                    x[row : row + width], values[(i - first) * width :], width, center, scale, beta, fmt, NATIVE
                )
            _swish_run(scratch, swish_scale, y[first * channels :], (last - first) * width, fmt)
            continue
        row = first * channels + start
        for piece in range(0, width, STAGE_CHUNK):
            count = min(STAGE_CHUNK, width - piece)
            _nhwc_affine(x[row + piece :], values, count, center[piece:], scale[piece:], beta[piece:], fmt, NATIVE)
            _swish_run(scratch, swish_scale, y[row + piece :], count, fmt)


def _swish_run(scratch, swish_scale, out, count, fmt):
    """:func:`swish_rows` of ``scratch[0]``'s first ``count`` elements into ``out``, for an NHWC
    run: over a whole number of STAGE_ALIGN elements (vector loop bodies alone: the run starts
    where the task's channels do, which follows the thread count), into a scratch row copied
    out (:func:`store_rows`), or, for an ``out`` of the scratch rows' type (float32 or float64,
    aligned) and a whole number already, straight into ``out`` (njit only)."""
    raise NotImplementedError("_swish_run() is only callable from @njit code")


@overload(_swish_run, inline="always")
def _swish_run_overload(scratch, swish_scale, out, count, fmt):
    # in place only into an output of the scratch rows' very type (not a misaligned out=, say)
    if fmt.format_name == "native" and out == scratch.copy(ndim=1):
        return lambda scratch, swish_scale, out, count, fmt: _swish_run_native(scratch, swish_scale, out, count)
    return lambda scratch, swish_scale, out, count, fmt: _swish_run_copied(scratch, swish_scale, out, count, fmt)


@leaf_helper
def _swish_run_copied(scratch, swish_scale, out, count, fmt):
    wide_vectors()
    swish_rows(scratch, swish_scale, scratch[STAGE_OUT], aligned(count), NATIVE)
    store_rows(scratch[STAGE_OUT], out, count, fmt)


@leaf_helper
def _swish_run_native(scratch, swish_scale, out, count):
    # out has the scratch rows' type: the same compiled loop either way, so the same bits (a
    # NaN's sign too) whichever the thread count makes the run's length
    wide_vectors()
    if count == aligned(count):
        swish_rows(scratch, swish_scale, out, count, NATIVE)
    else:
        _swish_run_copied(scratch, swish_scale, out, count, NATIVE)
