"""group_norm_swish_backward's loop nests (docs/semantics.md §5): NCHW, NHWC and the parameter
gradients; the per-element formulas and the block sums they share (module doc of
``kernels/group_norm_swish.py``: the passes and the fixed order of every sum)."""

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic, overload

from ._group_norm_math import (
    BLOCK,
    PARTIAL_SUMS,
    STAGE_ALIGN,
    STAGE_CHUNK,
    STAGE_OUT,
    STAGE_ROWS,
    SWISH_CLAMP32,
    SWISH_CLAMP64,
    WHOLE_ROWS_MAX_CHANNELS,
    aligned,
    fma,
    for_each_row,
    lane_sums,
    lane_vectors,
    swish_argument,
    swish_derivative,
    swish_gradient_rows,
    task_groups,
)
from ._halfbits import load, one_nan, one_nan_ir, store
from ._jit import helper, leaf_helper, parallel_kernel, wide_vectors
from ._lanes import (
    LANES,
    array_structs,
    decode_lanes,
    fma_lanes,
    fold_rows_by_halving,
    for_each_vector,
    splat,
    store_lanes,
)
from ._memory import copy_out, flat_rows, stack_array, store_fence

#: Channel rows up to this many positions have their sums folded eight rows at a time
#: (:func:`_channel_sums`); longer rows spend little in their folds.
FOLD_ROWS_MAX = 256
assert FOLD_ROWS_MAX <= BLOCK

# ---- the per-element formulas, shared by both layouts and both passes ------------------------


def swish_gradient(dy_value, y, swish_scale):
    """``dy * d(y*sigmoid(s*y))/dy`` at ``s = swish_scale``, or ``dy`` itself when
    ``swish_scale`` is None (the plain GroupNorm backward, ``activate_swish=False``): a choice
    made when the kernel compiles, by the scale's type (njit only)."""
    raise NotImplementedError("swish_gradient() is only callable from @njit code")


@overload(swish_gradient, inline="always")
def _swish_gradient(dy_value, y, swish_scale):
    if isinstance(swish_scale, types.NoneType):
        return lambda dy_value, y, swish_scale: dy_value
    return lambda dy_value, y, swish_scale: dy_value * swish_derivative(swish_scale * y)


@helper
def _gnew_xhat(dy_value, x_value, mean, rstd, gamma, beta, swish_scale):
    """``(gnew, xhat)`` of one element, in the compute type (``swish_scale`` None: no Swish)."""
    xhat = (x_value - mean) * rstd
    y = fma(xhat, gamma, beta)
    gnew = swish_gradient(dy_value, y, swish_scale)
    return gnew, xhat


@helper
def _dx(gnew, xhat, rstd, gamma, c1, c2):
    """``rstd * (gnew*gamma - (xhat*c2 + c1))`` (docs/semantics.md §5), a NaN as the one NaN
    (:func:`one_nan`: dy, x and the group's sums each bring their own)."""
    return one_nan(rstd * fma(gnew, gamma, -fma(xhat, c2, c1)))


@helper
def _group_coefficients(sum_g, sum_gx, gamma, start, stop, count):
    """``c1, c2`` of the group of channels ``[start, stop)``: gamma-weighted sums / (D*HxW)."""
    c1 = gamma[start] * sum_g[start]
    c2 = gamma[start] * sum_gx[start]
    for c in range(start + 1, stop):
        c1 += gamma[c] * sum_g[c]
        c2 += gamma[c] * sum_gx[c]
    return c1 / count, c2 / count


@intrinsic
def _channel_sums(typingctx, gnew, x, sums_g, sums_gx, first, stop, hw, gnew_first, mean, rstd, fmt):
    """``sums_g[c]``, ``sums_gx[c]`` = the sums of ``gnew`` and of ``gnew * xhat`` over channel
    row ``c`` of one image, for the whole rows in ``[first, stop)`` (flat positions; ``x`` the
    image's flat rows, ``gnew[i - gnew_first]`` position ``i``'s gnew, ``sums_g``, ``sums_gx``
    the image's (C,) sums), in the fixed order of the module doc: blocks of :data:`BLOCK`
    positions from the row's start, in each position ``start + i`` of a block to lane ``i %
    LANES`` (vectors of LANES consecutive positions added in order, each lane from +0.0), the
    lanes folded by halving, the block sums added in order to +0.0. ``xhat = (decode(x) -
    mean) * rstd`` as in :func:`_gnew_xhat`. A last partial vector loads only its positions
    (masked loads) and leaves the other lanes untouched.
    """
    sig = types.void(gnew, x, sums_g, sums_gx, types.intp, types.intp, types.intp, types.intp, mean, rstd, fmt)
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        gnew_struct, x_struct, g_struct, gx_struct = array_structs(context, builder, signature, args, 0, 1, 2, 3)
        first, stop, hw, gnew_first, mean_value, rstd_value = args[4:10]
        element = context.get_data_type(signature.args[8])
        vector = ir.VectorType(element, LANES)
        mean_lanes = splat(builder, vector, mean_value)
        rstd_lanes = splat(builder, vector, rstd_value)
        block = ir.Constant(hw.type, BLOCK)
        totals = [cgutils.alloca_once(builder, element) for _ in range(2)]

        def terms(position, used):
            at = builder.sub(position, gnew_first)
            g = decode_lanes(builder, builder.gep(gnew_struct.data, [at]), "native", vector, used)
            x_value = decode_lanes(builder, builder.gep(x_struct.data, [position]), format_name, vector, used)
            return g, builder.fmul(g, builder.fmul(builder.fsub(x_value, mean_lanes), rstd_lanes))

        def row(c, row_start, row_stop):
            for total in totals:
                builder.store(ir.Constant(element, 0.0), total)
            blocks = builder.sdiv(builder.add(builder.sub(row_stop, row_start), ir.Constant(hw.type, BLOCK - 1)), block)
            with cgutils.for_range(builder, blocks) as loop:
                block_start = builder.add(row_start, builder.mul(loop.index, block))
                block_stop = builder.add(block_start, block)
                block_stop = builder.select(builder.icmp_signed(">", block_stop, row_stop), row_stop, block_stop)
                for total, value in zip(
                    totals, lane_sums(builder, vector, block_start, block_stop, terms, 2, unroll=False)
                ):
                    builder.store(builder.fadd(builder.load(total), value), total)
            for total, out in zip(totals, (g_struct, gx_struct)):
                builder.store(builder.load(total), builder.gep(out.data, [c]))

        # Short rows (one block) in batches of LANES/2: each row's lanes kept, then the batch's
        # folds together (fold_rows_by_halving), each total +0.0 + its block's sum.
        batch = LANES // 2
        kept = [cgutils.alloca_once(builder, ir.ArrayType(vector, batch)) for _ in range(2)]
        zero = ir.Constant(hw.type, 0)
        one_block = builder.and_(
            builder.icmp_signed(">", hw, zero), builder.icmp_signed("<=", hw, ir.Constant(hw.type, FOLD_ROWS_MAX))
        )
        width = builder.select(one_block, hw, ir.Constant(hw.type, 1))
        first_row = builder.sdiv(first, width)
        rows = builder.sub(builder.sdiv(stop, width), first_row)
        batches = builder.select(one_block, builder.sdiv(rows, ir.Constant(hw.type, batch)), zero)
        with cgutils.for_range(builder, batches) as batch_loop:
            batch_row = builder.add(first_row, builder.mul(batch_loop.index, ir.Constant(hw.type, batch)))
            with cgutils.for_range(builder, ir.Constant(hw.type, batch)) as row_loop:
                row_start = builder.mul(builder.add(batch_row, row_loop.index), width)
                lanes = lane_vectors(builder, vector, row_start, builder.add(row_start, width), terms, 2, unroll=False)
                for rows_lanes, value in zip(kept, lanes):
                    builder.store(value, builder.gep(rows_lanes, [zero, row_loop.index]))
            for rows_lanes, out in zip(kept, (g_struct, gx_struct)):
                folded = fold_rows_by_halving(
                    builder,
                    [builder.load(builder.gep(rows_lanes, [zero, ir.Constant(hw.type, r)])) for r in range(batch)],
                )
                totals_vector = builder.fadd(ir.Constant(folded.type, None), folded)  # +0.0 + the block sum
                pointer = builder.bitcast(builder.gep(out.data, [batch_row]), folded.type.as_pointer())
                builder.store(totals_vector, pointer, align=context.get_abi_sizeof(element))
        batched = builder.mul(builder.mul(batches, ir.Constant(hw.type, batch)), width)
        for_each_row(builder, builder.add(first, batched), stop, hw, row)
        return context.get_dummy_value()

    return sig, codegen


@helper
def _fold_lanes(lanes, width, used):
    """Add lanes ``[0, used)`` into lane 0 by halving; ``lanes`` is the flat C-order view of a
    (PARTIAL_SUMS, width) array (width 1 for the NCHW kernel's 1-D lanes).

    Level ``h`` (PARTIAL_SUMS/2, ..., 2, 1) adds lane ``j + h`` into lane ``j``; lanes at or above
    ``used`` hold +0 and are skipped, which changes no bit (a lane that started at +0 is never
    -0, so adding +0 is exact). Each level is one contiguous vector loop: the lanes ``[0, count)``
    and ``[h, h + count)`` are two disjoint runs of ``count * width`` elements.
    """
    wide_vectors()
    h = PARTIAL_SUMS // 2
    while h >= 1:
        if used > h:
            low = lanes[: (used - h) * width]
            high = lanes[h * width : used * width]
            for i in range(low.shape[0]):
                low[i] += high[i]
            used = h
        h //= 2


@intrinsic
def _swish_argument_rows(typingctx, x, dy, first, stop, hw, z, dy_values, mean, rstd, gamma, beta, swish_scale, fmt):
    """For ``i`` in ``[first, stop)``, flat positions of one image (``x``, ``dy``: its flat rows
    in ``fmt``; channel ``c = i // hw``): ``z[i - first] = clamp(s * fma((x[i] - mean) * rstd,
    gamma[c], beta[c]))`` (the argument of the Swish derivative as :func:`_gnew_xhat` and
    ``swish_derivative`` form it, clamped to +-``SWISH_CLAMP32``, ``SWISH_CLAMP64`` in float64)
    and ``dy_values[i - first] = dy[i]`` (decoded): ``z``, ``dy_values``, ``gamma`` and
    ``beta`` in the compute type, all 1-D and C-contiguous. Row by row (:func:`for_each_row`),
    LANES elements per step and one masked step at a row's end (no loop remainder): a short
    channel row costs a few vector operations."""
    sig = types.void(x, dy, types.intp, types.intp, types.intp, z, dy_values, mean, mean, gamma, beta, mean, fmt)
    format_name = fmt.format_name
    limit_value = float(SWISH_CLAMP64 if mean == types.float64 else SWISH_CLAMP32)

    def codegen(context, builder, signature, args):
        x_struct, dy_struct, z_struct, dy_out, gamma_struct, beta_struct = array_structs(
            context, builder, signature, args, 0, 1, 5, 6, 9, 10
        )
        first, stop, hw = args[2], args[3], args[4]
        vector = ir.VectorType(context.get_data_type(signature.args[7]), LANES)
        mean_lanes, rstd_lanes, scale_lanes = (splat(builder, vector, args[i]) for i in (7, 8, 11))
        limit = ir.Constant(vector, [limit_value] * LANES)
        negative_limit = ir.Constant(vector, [-limit_value] * LANES)

        def row(c, row_start, row_stop):
            gamma_lanes = splat(builder, vector, builder.load(builder.gep(gamma_struct.data, [c])))
            beta_lanes = splat(builder, vector, builder.load(builder.gep(beta_struct.data, [c])))

            def body(position, used):
                values = decode_lanes(builder, builder.gep(x_struct.data, [position]), format_name, vector, used)
                xhat = builder.fmul(builder.fsub(values, mean_lanes), rstd_lanes)
                argument = builder.fmul(scale_lanes, fma_lanes(builder, xhat, gamma_lanes, beta_lanes))
                # as _clamp: a NaN fails both comparisons and stays
                argument = builder.select(builder.fcmp_ordered(">", argument, limit), limit, argument)
                argument = builder.select(builder.fcmp_ordered("<", argument, negative_limit), negative_limit, argument)
                at = builder.sub(position, first)
                store_lanes(builder, builder.gep(z_struct.data, [at]), argument, "native", used)
                gradient = decode_lanes(builder, builder.gep(dy_struct.data, [position]), format_name, vector, used)
                store_lanes(builder, builder.gep(dy_out.data, [at]), gradient, "native", used)

            for_each_vector(builder, row_start, row_stop, body, unroll=False)

        for_each_row(builder, first, stop, hw, row)
        return context.get_dummy_value()

    return sig, codegen


@leaf_helper
def _gnew_staged(dy, x, gnew, hw, first, stop, mean, rstd, gamma, beta, swish_scale, fmt):
    """``gnew[i - first] = dy[i] * swish_derivative(s * y[i])`` for the flat positions ``[first,
    stop)`` of one image's group (``dy``, ``x``: the image's flat ``(C*HxW,)`` rows; ``gnew``
    compute-type): in chunks of whole rows (or of :data:`STAGE_CHUNK` elements of a longer
    row) cut from the group's start, each row's argument ``z`` and its dy into scratch rows
    (:func:`_swish_argument_rows`), then the staged derivative over the whole chunk
    (:func:`swish_gradient_rows`)."""
    wide_vectors()
    scratch = stack_array(STAGE_ROWS, STAGE_CHUNK, gnew)
    step = STAGE_CHUNK if hw >= STAGE_CHUNK else (STAGE_CHUNK // hw) * hw
    for chunk in range(first, stop, step):
        chunk_stop = min(chunk + step, stop)
        _swish_argument_rows(
            x, dy, chunk, chunk_stop, hw, scratch[0], scratch[3], mean, rstd, gamma, beta, swish_scale, fmt
        )
        swish_gradient_rows(scratch, gnew[chunk - first : chunk_stop - first], chunk_stop - chunk)


@leaf_helper
def _gnew_plain(dy, gnew, first, stop, fmt):
    """``gnew[i - first] = dy[i]`` (decoded): the plain GroupNorm backward's gnew."""
    wide_vectors()
    for i in range(stop - first):
        gnew[i] = load(dy[first + i], fmt)


def _gnew_run(dy, x, gnew, hw, first, stop, mean, rstd, gamma, beta, swish_scale, fmt):
    """gnew of the flat positions ``[first, stop)``: :func:`_gnew_staged`, or :func:`_gnew_plain`
    when ``swish_scale`` is None (no Swish); a choice made when the kernel compiles (njit only)."""
    raise NotImplementedError("_gnew_run() is only callable from @njit code")


@overload(_gnew_run, inline="always")
def _gnew_run_overload(dy, x, gnew, hw, first, stop, mean, rstd, gamma, beta, swish_scale, fmt):
    if isinstance(swish_scale, types.NoneType):
        return lambda dy, x, gnew, hw, first, stop, mean, rstd, gamma, beta, swish_scale, fmt: _gnew_plain(
            dy, gnew, first, stop, fmt
        )
    return lambda dy, x, gnew, hw, first, stop, mean, rstd, gamma, beta, swish_scale, fmt: _gnew_staged(
        dy, x, gnew, hw, first, stop, mean, rstd, gamma, beta, swish_scale, fmt
    )


@leaf_helper
def _swish_argument_tiled(dy, x, z, dy_values, tile_mean, tile_rstd, tile_gamma, tile_beta, swish_scale, count, fmt):
    """``z[j]`` = the clamped ``s*y`` of ``x[j]`` with the tiles' constants, and ``dy_values[j]`` =
    ``dy[j]`` decoded, for ``j < count``."""
    wide_vectors()
    for j in range(count):
        xhat = (load(x[j], fmt) - tile_mean[j]) * tile_rstd[j]
        z[j] = swish_argument(fma(xhat, tile_gamma[j], tile_beta[j]), swish_scale)
        dy_values[j] = load(dy[j], fmt)


@leaf_helper
def _piece_gnew_staged(dy, x, scratch, out, tile_mean, tile_rstd, tile_gamma, tile_beta, swish_scale, count, fmt):
    """``out[j] = gnew`` of the piece's ``j < count`` elements (NHWC, with the tiles' constants):
    the staged derivative over a whole number of STAGE_ALIGN elements (the piece starts where
    the task's channel run does, which follows the thread count), so ``out`` is
    ``scratch[STAGE_OUT]`` unless ``count`` is such a whole number already."""
    wide_vectors()
    _swish_argument_tiled(
        dy, x, scratch[0], scratch[3], tile_mean, tile_rstd, tile_gamma, tile_beta, swish_scale, count, fmt
    )
    swish_gradient_rows(scratch, out, aligned(count))


@leaf_helper
def _piece_gnew_plain(dy, out, count, fmt):
    wide_vectors()
    for j in range(count):
        out[j] = load(dy[j], fmt)


def _piece_gnew(dy, x, scratch, out, tile_mean, tile_rstd, tile_gamma, tile_beta, swish_scale, count, fmt):
    """gnew of an NHWC piece into ``out`` (``scratch[STAGE_OUT]``, or the piece's own gnew when
    ``count`` is a whole number of STAGE_ALIGN elements): :func:`_piece_gnew_staged`, or dy
    itself when ``swish_scale`` is None (no Swish); a choice made when the kernel compiles (njit
    only)."""
    raise NotImplementedError("_piece_gnew() is only callable from @njit code")


@overload(_piece_gnew, inline="always")
def _piece_gnew_overload(dy, x, scratch, out, tile_mean, tile_rstd, tile_gamma, tile_beta, swish_scale, count, fmt):
    if isinstance(swish_scale, types.NoneType):
        return lambda dy, x, scratch, out, tile_mean, tile_rstd, tile_gamma, tile_beta, swish_scale, count, fmt: (
            _piece_gnew_plain(dy, out, count, fmt)
        )
    return lambda dy, x, scratch, out, tile_mean, tile_rstd, tile_gamma, tile_beta, swish_scale, count, fmt: (
        _piece_gnew_staged(dy, x, scratch, out, tile_mean, tile_rstd, tile_gamma, tile_beta, swish_scale, count, fmt)
    )


@leaf_helper
def _nhwc_step_first_pass(
    dy, x, gnew, lanes_g, lanes_gx, tile_mean, tile_rstd, tile_gamma, tile_beta, swish_scale, size, fmt
):
    """An NHWC step's first pass (all 1-D, from the step's first element; ``lanes_g``,
    ``lanes_gx`` from the step's lane), in pieces of :data:`STAGE_CHUNK`: a piece of a whole
    number of STAGE_ALIGN elements gets its gnew straight into ``gnew`` (the staged
    derivative's last stage stores it, as the NCHW kernel's does) and then added to its lanes
    (:func:`_add_lanes`); another piece gets it into a scratch row (the stages run past its
    end), then stored and added (:func:`_store_and_add_lanes`). Either way the same compiled
    stages give each element the same bits."""
    wide_vectors()
    scratch = stack_array(STAGE_ROWS, STAGE_CHUNK, gnew)
    values = scratch[STAGE_OUT]
    for piece in range(0, size, STAGE_CHUNK):
        count = min(STAGE_CHUNK, size - piece)
        whole = count % STAGE_ALIGN == 0
        _piece_gnew(
            dy[piece:],
            x[piece:],
            scratch,
            gnew[piece : piece + count] if whole else values,
            tile_mean[piece:],
            tile_rstd[piece:],
            tile_gamma[piece:],
            tile_beta[piece:],
            swish_scale,
            count,
            fmt,
        )
        if whole:
            _add_lanes(
                gnew[piece:],
                x[piece:],
                lanes_g[piece:],
                lanes_gx[piece:],
                tile_mean[piece:],
                tile_rstd[piece:],
                count,
                fmt,
            )
        else:
            _store_and_add_lanes(
                values,
                x[piece:],
                gnew[piece:],
                lanes_g[piece:],
                lanes_gx[piece:],
                tile_mean[piece:],
                tile_rstd[piece:],
                count,
                fmt,
            )


@leaf_helper
def _store_and_add_lanes(values, x, gnew, lanes_g, lanes_gx, tile_mean, tile_rstd, count, fmt):
    """``gnew[j] = values[j]``, ``lanes_g[j] += gnew``, ``lanes_gx[j] += gnew * xhat`` (``xhat``
    as :func:`_gnew_xhat` forms it) for ``j < count``."""
    wide_vectors()
    for j in range(count):
        g = values[j]
        gnew[j] = g
        xhat = (load(x[j], fmt) - tile_mean[j]) * tile_rstd[j]
        lanes_g[j] += g
        lanes_gx[j] += g * xhat


@leaf_helper
def _add_lanes(gnew, x, lanes_g, lanes_gx, tile_mean, tile_rstd, count, fmt):
    """:func:`_store_and_add_lanes` for a gnew already stored: ``lanes_g[j] += gnew[j]``,
    ``lanes_gx[j] += gnew[j] * xhat`` for ``j < count``."""
    wide_vectors()
    for j in range(count):
        g = gnew[j]
        xhat = (load(x[j], fmt) - tile_mean[j]) * tile_rstd[j]
        lanes_g[j] += g
        lanes_gx[j] += g * xhat


# ---- where a task keeps gnew between its passes -------------------------------------------------


def _gnew_in_dx(dx, like):
    """Whether dx's elements have the compute type (``like``'s), so that a task can keep its
    gnew in its own dx elements between the passes (njit only; a constant of the types)."""
    raise NotImplementedError("_gnew_in_dx() is only callable from @njit code")


@overload(_gnew_in_dx, inline="always")
def _gnew_in_dx_overload(dx, like):
    if dx.dtype == like.dtype:
        return lambda dx, like: True
    return lambda dx, like: False


def _gnew_storage(flat_dx, like, size, in_place):
    """``flat_dx`` itself when ``in_place`` (only ever true when :func:`_gnew_in_dx`), else a
    new compute-type array of ``size`` elements."""
    raise NotImplementedError("_gnew_storage() is only callable from @njit code")


@overload(_gnew_storage, inline="always")
def _gnew_storage_overload(flat_dx, like, size, in_place):
    if flat_dx.dtype == like.dtype:
        return lambda flat_dx, like, size, in_place: flat_dx if in_place else np.empty(size, like.dtype)
    return lambda flat_dx, like, size, in_place: np.empty(size, like.dtype)


#: An NCHW task whose dx cannot hold its gnew (float16, bfloat16) keeps it in a stack array when
#: its group has at most this many elements (16 KB in float32), else in an array of its own.
GNEW_STACK = 4096


@intrinsic
def _task_gnew(typingctx, dx, n, first, stop, stacked, own):
    """The compute-type span (1-D, ``stop - first`` elements) an NCHW task keeps the gnew of
    image ``n``'s flat positions ``[first, stop)`` in: those dx elements themselves when dx has
    the compute type (a choice of the types), else ``stacked[0]`` (its ``(1, GNEW_STACK)`` stack
    array) when the group fits it, else ``own`` (the ``(D, HxW)`` array the kernel allocated for
    the task). A view built in place: no reference count, no run-time call."""
    if not all(isinstance(a, types.Array) and a.layout == "C" for a in (dx, stacked, own)):
        return None
    if stacked.ndim != 2 or own.ndim != 2 or stacked.dtype != own.dtype or dx.ndim != 3:
        return None
    result = types.Array(stacked.dtype, 1, "C")
    in_place = dx.dtype == stacked.dtype

    def codegen(context, builder, signature, args):
        dx_struct, stacked_struct, own_struct = array_structs(context, builder, signature, args, 0, 4, 5)
        n_value, first_value, stop_value = args[1], args[2], args[3]
        size = builder.sub(stop_value, first_value)
        if in_place:
            _, channels, hw = cgutils.unpack_tuple(builder, dx_struct.shape, 3)
            at = builder.add(builder.mul(n_value, builder.mul(channels, hw)), first_value)
            data, meminfo = builder.gep(dx_struct.data, [at]), dx_struct.meminfo
        else:
            room = cgutils.unpack_tuple(builder, stacked_struct.shape, 2)[1]
            fits = builder.icmp_signed("<=", size, room)
            data = builder.select(fits, stacked_struct.data, own_struct.data)
            meminfo = builder.select(fits, stacked_struct.meminfo, own_struct.meminfo)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(stacked.dtype)))
        view = context.make_array(result)(context, builder)
        context.populate_array(view, data=data, shape=[size], strides=[itemsize], itemsize=itemsize, meminfo=meminfo)
        return impl_ret_borrowed(context, builder, result, view._getvalue())

    return result(dx, types.intp, types.intp, types.intp, stacked, own), codegen


# ---- NCHW family: x, dy, dx as (N, C, HxW) ----------------------------------------------------


@parallel_kernel
def group_norm_swish_bwd_nchw(
    dy, x, mean, rstd, gamma, beta, swish_scale, dx, dgamma, dbeta, want_dgamma, want_dbeta, fmt, parameter_fmt
):
    """dy, x -> dx, all (N, C, HxW) C-contiguous; mean, rstd (N, G), gamma, beta (C,) and
    swish_scale in the compute type (None: no Swish, gnew = dy: the plain GroupNorm backward);
    dgamma, dbeta (C,) in ``parameter_fmt``, each written only when wanted (the other may be an
    empty array).

    Parallel over the N*G (n, group) pairs; task ``(n, g)`` writes only ``dx[n, gD:(g+1)D]`` and
    its per-(n, c) sums ``sum_g[n, gD:(g+1)D]``, ``sum_gx[n, gD:(g+1)D]`` (the kernel's own
    arrays); then the calling thread adds the sums over n into dgamma and dbeta
    (:func:`_parameter_grads`), in the same launch. A task keeps its group's ``gnew`` between
    the two passes in its dx elements themselves when dx has the compute type (the second pass
    overwrites each gnew with its dx), else in a scratch array (D*HxW compute-type elements: on
    the task's stack up to GNEW_STACK, else allocated for the task). Nothing per task touches a
    reference count: at 4 x 4 a view's two atomic operations or an allocation cost as much as a
    row's arithmetic.
    """
    batch, channels, hw = x.shape
    groups = mean.shape[1]
    group_size = channels // groups
    # allocated here rather than by the caller: at 4 x 4 two arrays fewer to allocate and unbox
    sum_g = np.empty((batch, channels), mean.dtype)
    sum_gx = np.empty((batch, channels), mean.dtype)
    # an array per task only for a half-format dx and a group too large for the task's stack
    own_arrays = not _gnew_in_dx(dx, sum_g) and group_size * hw > GNEW_STACK
    for task in prange(batch * groups):
        wide_vectors()
        n = task // groups
        g = task - n * groups
        if own_arrays:
            own = np.empty((group_size, hw), sum_g.dtype)
            _nchw_task(dy, x, mean, rstd, gamma, beta, swish_scale, dx, sum_g, sum_gx, n, g, own, fmt)
        else:  # sum_g: an array of own's type, not used
            _nchw_task(dy, x, mean, rstd, gamma, beta, swish_scale, dx, sum_g, sum_gx, n, g, sum_g, fmt)
    _parameter_grads(sum_g, sum_gx, dgamma, dbeta, want_dgamma, want_dbeta, parameter_fmt)


@leaf_helper
def _nchw_task(dy, x, mean, rstd, gamma, beta, swish_scale, dx, sum_g, sum_gx, n, g, own, fmt):
    """Task ``(n, g)`` of the NCHW kernel, its gnew in its dx elements, a stack array or ``own``
    (:func:`_task_gnew`). A leaf helper (no reference counting): a row view in the kernel's body
    costs two atomic operations, much of a short row's time."""
    wide_vectors()
    _, channels, hw = x.shape
    group_size = channels // mean.shape[1]
    count = sum_g.dtype.type(group_size * hw)
    start = g * group_size
    group_mean = mean[n, g]
    group_rstd = rstd[n, g]
    flat_x = flat_rows(x, n, n + 1)
    first = start * hw  # the group's flat positions [first, stop) in the image
    stop = first + group_size * hw
    flat_gnew = _task_gnew(dx, n, first, stop, stack_array(1, GNEW_STACK, sum_g), own)
    _gnew_run(
        flat_rows(dy, n, n + 1),
        flat_x,
        flat_gnew,
        hw,
        first,
        stop,
        group_mean,
        group_rstd,
        gamma,
        beta,
        swish_scale,
        fmt,
    )
    sums_g = sum_g[n]
    sums_gx = sum_gx[n]
    _channel_sums(flat_gnew, flat_x, sums_g, sums_gx, first, stop, hw, first, group_mean, group_rstd, fmt)
    c1, c2 = _group_coefficients(sums_g, sums_gx, gamma, start, start + group_size, count)
    _dx_rows(
        flat_gnew, flat_x, flat_rows(dx, n, n + 1), first, stop, hw, first, group_mean, group_rstd, gamma, c1, c2, fmt
    )


@intrinsic
def _dx_rows(typingctx, gnew, x, dx, first, stop, hw, gnew_first, mean, rstd, gamma, c1, c2, fmt):
    """``dx[i] = rstd * fma(gnew[i - gnew_first], gamma[c], -fma(xhat, c2, c1))`` with ``xhat =
    (x[i] - mean) * rstd`` (:func:`_dx`), for ``i`` in ``[first, stop)``, flat positions of one
    image (channel ``c = i // hw``): ``x`` and ``dx`` in ``fmt``, ``gnew`` and ``gamma`` in the
    compute type, all 1-D and C-contiguous. Row by row (:func:`for_each_row`), LANES elements
    per step and one masked step at a row's end: a short channel row costs a few vector
    operations."""
    sig = types.void(gnew, x, dx, types.intp, types.intp, types.intp, types.intp, mean, mean, gamma, mean, mean, fmt)
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        gnew_struct, x_struct, dx_struct, gamma_struct = array_structs(context, builder, signature, args, 0, 1, 2, 9)
        first, stop, hw, gnew_first = args[3], args[4], args[5], args[6]
        vector = ir.VectorType(context.get_data_type(signature.args[7]), LANES)
        mean_lanes, rstd_lanes, c1_lanes, c2_lanes = (splat(builder, vector, args[i]) for i in (7, 8, 10, 11))
        negative_zero = ir.Constant(vector, [-0.0] * LANES)

        def row(c, row_start, row_stop):
            gamma_lanes = splat(builder, vector, builder.load(builder.gep(gamma_struct.data, [c])))

            def body(position, used):
                values = decode_lanes(builder, builder.gep(x_struct.data, [position]), format_name, vector, used)
                g = decode_lanes(
                    builder, builder.gep(gnew_struct.data, [builder.sub(position, gnew_first)]), "native", vector, used
                )
                xhat = builder.fmul(builder.fsub(values, mean_lanes), rstd_lanes)
                # -fma(...) as Numba negates a float: -0.0 - value
                inner = builder.fsub(negative_zero, fma_lanes(builder, xhat, c2_lanes, c1_lanes))
                result = one_nan_ir(builder, builder.fmul(rstd_lanes, fma_lanes(builder, g, gamma_lanes, inner)))
                store_lanes(builder, builder.gep(dx_struct.data, [position]), result, format_name, used)

            for_each_vector(builder, row_start, row_stop, body, unroll=False)

        for_each_row(builder, first, stop, hw, row)
        return context.get_dummy_value()

    return sig, codegen


# ---- NHWC: x, dy, dx as (N, HxW, C) -----------------------------------------------------------


@parallel_kernel
def group_norm_swish_bwd_nhwc(
    dy, x, mean, rstd, gamma, beta, swish_scale, dx, sum_g, sum_gx, groups_per_task, streaming, fmt
):
    """dy, x -> dx, all (N, HxW, C) C-contiguous; the other arguments as for the NCHW kernel.

    Parallel over (n, run of ``groups_per_task`` consecutive groups); a task writes only its
    channels of ``dx[n]``, ``sum_g[n]`` and ``sum_gx[n]``, and keeps their ``gnew`` between the
    passes in those dx elements themselves when dx has the compute type (the second pass then
    overwrites each gnew with its dx; ``streaming`` is ignored), else in a scratch array. With a
    scratch, the second pass stores dx directly, or when ``streaming`` (the plan decides by size)
    computes each step's dx into a small buffer and copies it out with streaming stores
    (``_memory.copy_out``), then fences. Every per-(n, c) sum has the NCHW kernel's order (lane
    rows ``i % PARTIAL_SUMS``, the same folds and blocks). :func:`_nhwc_task` does one task.
    """
    groups = mean.shape[1]
    runs = (groups + groups_per_task - 1) // groups_per_task
    for task in prange(x.shape[0] * runs):
        wide_vectors()
        n, first, last = task_groups(task, runs, groups_per_task, groups)
        _nhwc_task(dy, x, mean, rstd, gamma, beta, swish_scale, dx, sum_g, sum_gx, n, first, last, streaming, fmt)


@helper
def _nhwc_task(
    dy, x, mean, rstd, gamma, beta, swish_scale, dx, sum_g, sum_gx, n, first_group, last_group, streaming, fmt
):
    """Image ``n``, groups ``[first_group, last_group)`` of the NHWC kernel, in steps of
    positions. A task spanning all C <= WHOLE_ROWS_MAX_CHANNELS channels takes PARTIAL_SUMS
    positions per step: PARTIAL_SUMS*C contiguous elements laid out exactly like its
    (PARTIAL_SUMS, C) lane rows (element ``j`` of a step is lane ``j // C``, channel ``j % C``),
    one flat loop per step; a loop of PARTIAL_SUMS*C elements instead of C keeps the vector
    loops busy when C is small (C = 64 left a 32-element loop per position: about one vector
    iteration behind its alias checks and remainder). A narrower task takes one position per
    step (its channels of one row). Either way each element gets the same arithmetic, in the
    same order; the per-channel constants are tiled once per position of a step."""
    wide_vectors()
    _, hw, channels = x.shape
    groups = mean.shape[1]
    group_size = channels // groups
    count = sum_g.dtype.type(group_size * hw)
    start = first_group * group_size
    width = (last_group - first_group) * group_size
    step = PARTIAL_SUMS if width == channels and channels <= WHOLE_ROWS_MAX_CHANNELS else 1
    tiled = step * width
    tile_mean = np.empty(tiled, sum_g.dtype)
    tile_rstd = np.empty(tiled, sum_g.dtype)
    tile_gamma = np.empty(tiled, sum_g.dtype)
    tile_beta = np.empty(tiled, sum_g.dtype)
    for k in range(width):
        tile_gamma[k] = gamma[start + k]
        tile_beta[k] = beta[start + k]
    for group in range(first_group, last_group):
        for k in range((group - first_group) * group_size, (group - first_group + 1) * group_size):
            tile_mean[k] = mean[n, group]
            tile_rstd[k] = rstd[n, group]
    for j in range(width, tiled):  # the other positions of a step: copies of the first's
        tile_mean[j] = tile_mean[j - width]
        tile_rstd[j] = tile_rstd[j - width]
        tile_gamma[j] = tile_gamma[j - width]
        tile_beta[j] = tile_beta[j - width]
    flat_dy = flat_rows(dy, n, n + 1)
    flat_x = flat_rows(x, n, n + 1)
    flat_dx = flat_rows(dx, n, n + 1)
    # gnew of position i at gnew_all[i * gnew_stride + gnew_start:][:width]: in the task's own dx
    # elements when dx has the compute type (float32, float64), else in a scratch array
    in_place = _gnew_in_dx(dx, sum_g)
    gnew_all = _gnew_storage(flat_dx, sum_g, hw * width, in_place)
    gnew_stride = channels if in_place else width
    gnew_start = start if in_place else 0
    lanes_g = np.empty(PARTIAL_SUMS * width, sum_g.dtype)
    lanes_gx = np.empty(PARTIAL_SUMS * width, sum_g.dtype)
    total_g = sum_g[n, start : start + width]
    total_gx = sum_gx[n, start : start + width]
    total_g[:] = 0
    total_gx[:] = 0
    for block_start in range(0, hw, BLOCK):
        block_stop = min(block_start + BLOCK, hw)
        used = min(block_stop - block_start, PARTIAL_SUMS)
        lanes_g[: used * width] = 0
        lanes_gx[: used * width] = 0
        for position in range(block_start, block_stop, step):
            first = position * channels + start
            size = (min(position + step, block_stop) - position) * width
            lane = ((position - block_start) % PARTIAL_SUMS) * width
            gnew_first = position * gnew_stride + gnew_start
            step_dy = flat_dy[first : first + size]
            step_x = flat_x[first : first + size]
            step_gnew = gnew_all[gnew_first : gnew_first + size]
            _nhwc_step_first_pass(
                step_dy,
                step_x,
                step_gnew,
                lanes_g[lane:],
                lanes_gx[lane:],
                tile_mean,
                tile_rstd,
                tile_gamma,
                tile_beta,
                swish_scale,
                size,
                fmt,
            )
        _fold_lanes(lanes_g, width, used)
        _fold_lanes(lanes_gx, width, used)
        total_g += lanes_g[:width]
        total_gx += lanes_gx[:width]
    # c1, c2 tiled like the other constants (the lane arrays, at least as long, hold them)
    tile_c1 = lanes_g
    tile_c2 = lanes_gx
    for g in range(first_group, last_group):
        c1, c2 = _group_coefficients(sum_g[n], sum_gx[n], gamma, g * group_size, (g + 1) * group_size, count)
        for k in range((g - first_group) * group_size, (g - first_group + 1) * group_size):
            tile_c1[k] = c1
            tile_c2[k] = c2
    for j in range(width, tiled):
        tile_c1[j] = tile_c1[j - width]
        tile_c2[j] = tile_c2[j - width]
    if in_place:
        for position in range(0, hw, step):
            first = position * channels + start
            size = (min(position + step, hw) - position) * width
            step_x = flat_x[first : first + size]
            step_dx = flat_dx[first : first + size]
            for j in range(size):
                xhat = (load(step_x[j], fmt) - tile_mean[j]) * tile_rstd[j]
                step_dx[j] = store(
                    _dx(load(step_dx[j], fmt), xhat, tile_rstd[j], tile_gamma[j], tile_c1[j], tile_c2[j]), fmt
                )
        return
    buffer = np.empty(tiled if streaming else 0, dx.dtype)
    for position in range(0, hw, step):
        first = position * channels + start
        size = (min(position + step, hw) - position) * width
        step_x = flat_x[first : first + size]
        step_gnew = gnew_all[position * width : position * width + size]
        step_dx = buffer if streaming else flat_dx[first : first + size]
        for j in range(size):
            xhat = (load(step_x[j], fmt) - tile_mean[j]) * tile_rstd[j]
            step_dx[j] = store(_dx(step_gnew[j], xhat, tile_rstd[j], tile_gamma[j], tile_c1[j], tile_c2[j]), fmt)
        if streaming:
            copy_out(flat_dx, first, step_dx, 0, size, True)
    store_fence()


# ---- dgamma, dbeta ----------------------------------------------------------------------------


@parallel_kernel
def group_norm_swish_param_grads(sum_g, sum_gx, dgamma, dbeta, want_dgamma, want_dbeta, fmt):
    """The NHWC kernel's dgamma and dbeta from its per-(n, c) sums (:func:`_parameter_grads`,
    which the NCHW kernel calls in its own launch); the plans run it on the calling thread."""
    _parameter_grads(sum_g, sum_gx, dgamma, dbeta, want_dgamma, want_dbeta, fmt)


@leaf_helper
def _parameter_grads(sum_g, sum_gx, dgamma, dbeta, want_dgamma, want_dbeta, fmt):
    """dgamma[c] = sum_n sum_gx[n, c], dbeta[c] = sum_n sum_g[n, c], n ascending, stored once
    (each only when wanted: the other may be an empty array). The sums are scratch: row 0 takes
    each row in turn, a loop along c that vectorises (a loop over n per channel did not)."""
    wide_vectors()
    if want_dgamma:
        _add_rows(sum_gx, dgamma, fmt)
    if want_dbeta:
        _add_rows(sum_g, dbeta, fmt)


@leaf_helper
def _add_rows(sums, total, fmt):
    """``total[c] = store(sums[0, c] + sums[1, c] + ...)``, added in row order into ``sums[0]``
    (a NaN stored as the one NaN, :func:`one_nan`)."""
    wide_vectors()
    batch, channels = sums.shape
    first = sums[0]
    for n in range(1, batch):
        row = sums[n]
        for c in range(channels):
            first[c] += row[c]
    for c in range(channels):
        total[c] = store(one_nan(first[c]), fmt)
