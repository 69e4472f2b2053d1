"""group_norm_swish_backward loop nests (docs/semantics.md §5), and the vectorisable exp and Swish derivative.

One task per (n, group) (NCHW family) or per (n, run of whole groups) (NHWC) does both passes
while its data is still in cache:

1. recompute ``xhat``, ``y`` and the Swish derivative, and accumulate the per-(n, channel) sums
   of ``gnew`` and ``gnew * xhat`` into ``sum_g[n, c]`` and ``sum_gx[n, c]`` (its own slots);
2. form the group coefficients ``c1``, ``c2`` from those sums and write ``dx`` for the group.

Every per-(n, c) sum has the same fixed order in both layouts, so NCHW and NHWC agree bitwise
and no thread count changes a bit: spatial positions are cut into blocks of :data:`BLOCK`;
inside a block position ``i`` is added (in order) to lane ``i % PARTIAL_SUMS``, the lanes are folded
by halving (:func:`_fold_lanes`), and the block sums are added to the total in block order.
The lanes make the sums vectorise without fastmath (each lane is its own sequential sum): the
NCHW kernel keeps its PARTIAL_SUMS = 16 lanes in a vector register
(:func:`_block_sums`, an intrinsic: accumulators in memory made the loop store-bound), while
the NHWC loop vectorises along channels with one row of lanes per channel. dgamma and dbeta
then add the per-(n, c) sums over n in order (:func:`group_norm_swish_param_grads`).

NHWC tasks read whole rows (all C channels of a position) wherever they can: a narrow channel
strip of an NHWC array streams from memory several times slower than whole rows, which ruled out
transposing L2-sized channel strips into NCHW-shaped scratch (docs/design.md). So an NHWC task's x and gnew span the whole image and its second pass
rereads them from L3 or memory. In both layouts, when dx has the compute type (float32,
float64) a task keeps gnew in its own dx elements, and the second pass overwrites each with its
dx: the dx lines are read for ownership once, in the first pass, and no separate scratch is
allocated or passes through the caches (in NHWC also faster than a scratch with streaming dx
stores). float16 and bfloat16 keep gnew (float32) in a scratch array; NHWC writes their dx with
streaming stores when the plan asks (large dx), so that the dx lines are neither read first nor
evict x and gnew.

The llvmlite wheel has no SVML, so ``math.exp`` is a scalar call that blocks vectorisation: the
float32 path uses :func:`exp_nonpositive_float32`, a Cephes-style polynomial built from float
and integer operations only (about 1e-7 relative error; subnormal results flushed to 0, which
is faster than scaling into the subnormal range). float64 data uses ``math.exp``.
"""

import math
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._halfbits import StorageFormat, float32_as_uint32, load, store, uint32_as_float32
from ._jit import Launch, helper, leaf_helper, parallel_kernel, wide_vectors
from ._lanes import LANES, array_structs, decode_lanes, fold_lanes_by_halving, splat
from ._memory import copy_out, store_fence

#: Spatial positions per block of every per-(n, c) reduction (a multiple of PARTIAL_SUMS).
BLOCK = 4096
#: NHWC tasks spanning all channels take PARTIAL_SUMS positions per step (:func:`_nhwc_task`)
#: up to this many channels: their tiled constants and lane rows (6 * PARTIAL_SUMS * C
#: compute-type elements, 120 KB at C = 320 in float32) stay in L2; wider, steps of one position
#: are faster (docs/history.md, "Numbers that were in code comments").
WHOLE_ROWS_MAX_CHANNELS = 320
#: Interleaved partial sums inside a block: one vector register of float32 lanes
#: (kernels._lanes.LANES); a power of two (the lanes are folded by halving).
PARTIAL_SUMS = LANES

# ---- exp(a) for a <= 0 in float32 (Cephes expf: exp(a) = 2^k * p(r), |r| <= ln2/2) -----------
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)  # few mantissa bits: k * _LN2_HI is exact
_LN2_LO = np.float32(-2.12194440e-4)
# Adding 1.5 * 2^23 + 127 rounds a float32 |t| < 2^21 to the integer k = round(t) and leaves
# k + 127, the biased exponent of 2^k, in the low mantissa bits: 2^k is built with unsigned
# 32-bit integer operations only (they vectorise).
_ROUND_MAGIC = np.float32(12583039.0)
_ROUND_MAGIC_BITS = np.uint32(0x4B400000)
#: Below this exp(a) is under the smallest normal float32 (1.18e-38) and is returned as 0.
_EXP_FLUSH = np.float32(-87.33)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
_ONE32 = np.float32(1.0)
_ZERO32 = np.float32(0.0)
_ONE64 = np.float64(1.0)

#: |s*y| is clamped here so that it stays finite (no inf * 0); beyond it the Swish derivative
#: is its limit (1 above, 0 below) anyway: exp(-104) flushes to 0 in float32 and exp(-750)
#: underflows to 0 in float64.
SWISH_CLAMP32 = np.float32(104.0)
SWISH_CLAMP64 = np.float64(750.0)


@intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` rounded once (LLVM ``llvm.fma``; vectorises, exact IEEE semantics).

    Written explicitly because kernels run without fastmath, so LLVM never fuses on its own;
    every use is deliberate and identical in both layouts.
    """
    if not (isinstance(a, types.Float) and a == b == c):
        return None
    sig = a(a, b, c)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


@helper
def exp_nonpositive_float32(a):
    """exp(a) for float32 ``a <= 0`` (NaN gives NaN); vectorises (no libm call).

    About 1e-7 relative error down to the smallest normal float32; results that would be
    subnormal (a < -87.33) are flushed to 0, an absolute error below 1.2e-38.
    """
    shifted = fma(a, _LOG2E, _ROUND_MAGIC)
    k = shifted - _ROUND_MAGIC
    r = fma(k, -_LN2_LO, fma(k, -_LN2_HI, a))
    p = fma(fma(fma(fma(fma(_P0, r, _P1), r, _P2), r, _P3), r, _P4), r, _P5)
    p = fma(p, r * r, r) + _ONE32
    # biased exponent k + 127, in [1, 127] when a >= -87.33 (other lanes are discarded below)
    biased = np.uint32(float32_as_uint32(shifted) - _ROUND_MAGIC_BITS)
    result = p * uint32_as_float32(np.uint32(biased << np.uint32(23)))
    return _ZERO32 if a < _EXP_FLUSH else result


@helper
def _clamp(z, limit):
    """``z`` limited to [-limit, limit]; NaN stays NaN (both comparisons are false)."""
    z = limit if z > limit else z
    return -limit if z < -limit else z


@helper
def _swish_derivative_from(z, e, one):
    """``sig*(1 + z*(1-sig))`` at a clamped ``z``, given ``e = exp(-|z|)``.

    ``sig`` and ``1 - sig`` are ``1/(1+e)`` and ``e/(1+e)`` (which is which depends on the sign
    of z): neither is formed by cancellation and their product ``sig*(1-sig)`` is the same in
    both cases, so the result is ``sig + z*(sig*(1-sig))`` with finite factors only (no
    ``inf * 0``, no lost ``z*(1-sig)`` term when sig rounds to 1).
    """
    inv = one / (one + e)
    other = e * inv
    sig = inv if z >= 0 else other
    return fma(z, inv * other, sig)


@helper
def swish_derivative_float32(z):
    """The Swish derivative ``d(y*sigmoid(z))/dy`` at ``z = s*y``, in float32, for any ``z``.

    ``z`` is clamped to +-104 (where the result is its limit 1 or 0 anyway), and the
    exponential only ever sees ``-|z|``, so nothing overflows; NaN propagates.
    """
    z = _clamp(z, SWISH_CLAMP32)
    return _swish_derivative_from(z, exp_nonpositive_float32(-abs(z)), _ONE32)


@helper
def swish_derivative_float64(z):
    """:func:`swish_derivative_float32` in float64 (``math.exp``, clamp +-750)."""
    z = _clamp(z, SWISH_CLAMP64)
    return _swish_derivative_from(z, math.exp(-abs(z)), _ONE64)


def swish_derivative(z):
    """The Swish derivative in z's precision (njit only): float32 or float64."""
    raise NotImplementedError("swish_derivative() is only callable from @njit code")


@overload(swish_derivative, inline="always")
def _swish_derivative(z):
    if z == types.float64:
        return lambda z: swish_derivative_float64(z)
    return lambda z: swish_derivative_float32(z)


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
    """``rstd * (gnew*gamma - (xhat*c2 + c1))`` (docs/semantics.md §5)."""
    return rstd * fma(gnew, gamma, -fma(xhat, c2, c1))


@helper
def _group_coefficients(sum_g, sum_gx, gamma, start, stop, count):
    """``c1, c2`` of the group of channels ``[start, stop)``: gamma-weighted sums / (D*HxW)."""
    c1 = gamma[start] * sum_g[start]
    c2 = gamma[start] * sum_gx[start]
    for c in range(start + 1, stop):
        c1 += gamma[c] * sum_g[c]
        c2 += gamma[c] * sum_gx[c]
    return c1 / count, c2 / count


# ---- the fixed-order reduction ----------------------------------------------------------------


def _lane_sums(builder, vector, start, stop, terms, count):
    """Code for ``count`` sums over positions ``[start, stop)`` in the fixed order of the module
    doc: ``terms(position, used)`` gives the ``count`` vectors that LANES consecutive positions
    add (lane ``i`` from position ``position + i``; ``used`` masks a last partial vector, else
    None), each lane summed from +0.0 in order, then the lanes folded by halving. Returns the
    totals. The sums are independent chains of adds, so several of them run side by side."""
    i64 = ir.IntType(64)
    lane_numbers = ir.Constant(ir.VectorType(i64, LANES), list(range(LANES)))
    sums = [cgutils.alloca_once_value(builder, ir.Constant(vector, None)) for _ in range(count)]
    for total in sums:
        builder.store(ir.Constant(vector, None), total)

    def add(position, used):
        olds = [builder.load(total) for total in sums]
        news = [builder.fadd(old, term) for old, term in zip(olds, terms(position, used))]
        if used is not None:  # lanes past the end keep their sums (0 * inf would be NaN)
            news = [builder.select(used, new, old) for new, old in zip(news, olds)]
        for total, new in zip(sums, news):
            builder.store(new, total)

    length = builder.sub(stop, start)
    whole = builder.sdiv(length, i64(LANES))
    with cgutils.for_range(builder, whole) as loop:
        add(builder.add(start, builder.mul(loop.index, i64(LANES))), None)
    tail = builder.add(start, builder.mul(whole, i64(LANES)))
    remaining = builder.sub(stop, tail)
    with builder.if_then(builder.icmp_signed(">", remaining, i64(0))):
        add(tail, builder.icmp_signed("<", lane_numbers, splat(builder, ir.VectorType(i64, LANES), remaining)))
    return [fold_lanes_by_halving(builder, builder.load(total)) for total in sums]


@intrinsic
def _block_sums(typingctx, gnew_row, x_row, start, stop, mean, rstd, fmt):
    """``(sum of gnew, sum of gnew * xhat)`` over positions ``[start, stop)`` of one block, in
    the fixed order of the module doc: position ``start + i`` goes to lane ``i % LANES``
    (vectors of LANES consecutive positions added in order, each lane from +0.0), then the
    lanes are folded by halving. ``xhat = (decode(x) - mean) * rstd`` as in
    :func:`_gnew_xhat`. Both rows are 1-D and C-contiguous; a last partial vector loads only
    its positions (masked loads) and leaves the other lanes untouched.
    """
    sig = types.UniTuple(mean, 2)(gnew_row, x_row, types.intp, types.intp, mean, rstd, fmt)
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        gnew, x = array_structs(context, builder, signature, args, 0, 1)
        start, stop, mean_value, rstd_value = args[2], args[3], args[4], args[5]
        vector = ir.VectorType(context.get_data_type(signature.args[4]), LANES)
        mean_lanes = splat(builder, vector, mean_value)
        rstd_lanes = splat(builder, vector, rstd_value)

        def terms(position, used):
            g = decode_lanes(builder, builder.gep(gnew.data, [position]), "native", vector, used)
            x_value = decode_lanes(builder, builder.gep(x.data, [position]), format_name, vector, used)
            return g, builder.fmul(g, builder.fmul(builder.fsub(x_value, mean_lanes), rstd_lanes))

        totals = _lane_sums(builder, vector, start, stop, terms, 2)
        return context.make_tuple(builder, signature.return_type, totals)

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


def _gnew_rows(dx, like, n, group_size, in_place):
    """The rows an NCHW task keeps its gnew in: ``dx[n]`` itself when ``in_place`` (only ever
    true when :func:`_gnew_in_dx`; the task's rows start at its first channel), else a new
    compute-type ``(group_size, HxW)`` array."""
    raise NotImplementedError("_gnew_rows() is only callable from @njit code")


@overload(_gnew_rows, inline="always")
def _gnew_rows_overload(dx, like, n, group_size, in_place):
    if dx.dtype == like.dtype:
        return lambda dx, like, n, group_size, in_place: (
            dx[n] if in_place else np.empty((group_size, dx.shape[2]), like.dtype)
        )
    return lambda dx, like, n, group_size, in_place: np.empty((group_size, dx.shape[2]), like.dtype)


@helper
def _task_groups(task, runs, groups_per_task, groups):
    """``(n, first group, end group)`` of task ``task`` of a kernel parallel over (image, run of
    ``groups_per_task`` consecutive groups), ``runs`` runs per image (the last may be shorter)."""
    n = task // runs
    first = (task - n * runs) * groups_per_task
    return n, first, min(first + groups_per_task, groups)


# ---- NCHW family: x, dy, dx as (N, C, HxW) ----------------------------------------------------


@parallel_kernel
def group_norm_swish_bwd_nchw(dy, x, mean, rstd, gamma, beta, swish_scale, dx, sum_g, sum_gx, fmt):
    """dy, x -> dx, all (N, C, HxW) C-contiguous; mean, rstd (N, G), gamma, beta (C,) and
    swish_scale in the compute type (None: no Swish, gnew = dy: the plain GroupNorm backward);
    sum_g, sum_gx (N, C) compute-type outputs.

    Parallel over the N*G (n, group) pairs; task ``(n, g)`` writes only ``dx[n, gD:(g+1)D]`` and
    ``sum_g[n, gD:(g+1)D]``, ``sum_gx[n, gD:(g+1)D]``. It keeps its group's ``gnew`` between the
    two passes in those dx elements themselves when dx has the compute type (the second pass
    overwrites each gnew with its dx), else in a scratch array (D*HxW compute-type elements).
    """
    batch, channels, hw = x.shape
    groups = mean.shape[1]
    group_size = channels // groups
    count = sum_g.dtype.type(group_size * hw)
    in_place = _gnew_in_dx(dx, sum_g)
    for task in prange(batch * groups):
        wide_vectors()
        n = task // groups
        g = task - n * groups
        start = g * group_size
        group_mean = mean[n, g]
        group_rstd = rstd[n, g]
        gnew_rows = _gnew_rows(dx, sum_g, n, group_size, in_place)
        gnew_first = start if in_place else 0
        for k in range(group_size):
            c = start + k
            dy_row = dy[n, c]
            x_row = x[n, c]
            gnew_row = gnew_rows[gnew_first + k]
            channel_gamma = gamma[c]
            channel_beta = beta[c]
            total_g = sum_g.dtype.type(0)
            total_gx = total_g
            for block_start in range(0, hw, BLOCK):
                block_stop = min(block_start + BLOCK, hw)
                # sliced so that the loop runs from 0 (a runtime start blocks vectorisation)
                block_dy = dy_row[block_start:block_stop]
                block_x = x_row[block_start:block_stop]
                block_gnew = gnew_row[block_start:block_stop]
                for i in range(block_stop - block_start):
                    block_gnew[i] = _gnew_xhat(
                        load(block_dy[i], fmt),
                        load(block_x[i], fmt),
                        group_mean,
                        group_rstd,
                        channel_gamma,
                        channel_beta,
                        swish_scale,
                    )[0]
                block_g, block_gx = _block_sums(gnew_row, x_row, block_start, block_stop, group_mean, group_rstd, fmt)
                total_g += block_g
                total_gx += block_gx
            sum_g[n, c] = total_g
            sum_gx[n, c] = total_gx
        c1, c2 = _group_coefficients(sum_g[n], sum_gx[n], gamma, start, start + group_size, count)
        for k in range(group_size):
            c = start + k
            x_row = x[n, c]
            dx_row = dx[n, c]
            gnew_row = gnew_rows[gnew_first + k]
            channel_gamma = gamma[c]
            for i in range(hw):
                xhat = (load(x_row[i], fmt) - group_mean) * group_rstd
                dx_row[i] = store(_dx(gnew_row[i], xhat, group_rstd, channel_gamma, c1, c2), fmt)


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
        n, first, last = _task_groups(task, runs, groups_per_task, groups)
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
    for j in range(tiled):
        k = j % width
        group = first_group + k // group_size
        tile_mean[j] = mean[n, group]
        tile_rstd[j] = rstd[n, group]
        tile_gamma[j] = gamma[start + k]
        tile_beta[j] = beta[start + k]
    flat_dy = dy[n].reshape(hw * channels)
    flat_x = x[n].reshape(hw * channels)
    flat_dx = dx[n].reshape(hw * channels)
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
            for j in range(size):
                gnew, xhat = _gnew_xhat(
                    load(step_dy[j], fmt),
                    load(step_x[j], fmt),
                    tile_mean[j],
                    tile_rstd[j],
                    tile_gamma[j],
                    tile_beta[j],
                    swish_scale,
                )
                step_gnew[j] = gnew
                lanes_g[lane + j] += gnew
                lanes_gx[lane + j] += gnew * xhat
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
    """dgamma[c] = sum_n sum_gx[n, c], dbeta[c] = sum_n sum_g[n, c], n ascending, stored once.

    Parallel over channels; iteration ``c`` writes only ``dgamma[c]`` and ``dbeta[c]`` (each
    only when wanted: the other may be a dummy array).
    """
    batch, channels = sum_g.shape
    for c in prange(channels):
        wide_vectors()
        if want_dgamma:
            acc = sum_gx[0, c]
            for n in range(1, batch):
                acc += sum_gx[n, c]
            dgamma[c] = store(acc, fmt)
        if want_dbeta:
            acc = sum_g[0, c]
            for n in range(1, batch):
                acc += sum_g[n, c]
            dbeta[c] = store(acc, fmt)


# ---- the forward (docs/semantics.md §5.1) -----------------------------------------------------
#
# One task per (n, group) or per two groups of an image (NCHW family), or per (n, run of whole
# groups) (NHWC). Statistics in two passes over the group, which a task rereads from its cache
# (G1's group is 64 KB): the
# mean of ``x - shift`` (``shift`` is the group's first element, so a constant group has mean
# exactly that value and variance exactly 0, hence rstd = inf at eps = 0 as in PyTorch), then
# the centred sums ``t1 = sum(x - mean)`` and ``t2 = sum((x - mean)^2)`` with
# ``var = (t2 - t1*t1/M) / M`` (t1 corrects for the rounding of the mean). A third pass writes
# y. Every sum has a fixed order (below), so no thread count changes a bit.


@helper
def swish_float32(y, swish_scale):
    """``y * sigmoid(swish_scale * y)`` in float32 for any ``y`` and scale; vectorises.

    The exponential sees ``-|z|`` only (``z = s*y``), so nothing overflows (beyond |z| = 87.3
    it is flushed to 0 and sigmoid is exactly 1 or 0, its value to float32 precision there);
    the result is ``y/(1+e)`` or ``y*e/(1+e)`` with ``e = exp(-|z|)``: one division, no
    cancellation. NaN propagates.
    """
    z = swish_scale * y
    e = exp_nonpositive_float32(-abs(z))
    return (y if z >= 0 else y * e) / (_ONE32 + e)


@helper
def swish_float64(y, swish_scale):
    """:func:`swish_float32` in float64 (``math.exp``, which underflows to 0 past |z| = 745)."""
    z = swish_scale * y
    e = math.exp(-abs(z))
    return (y if z >= 0 else y * e) / (_ONE64 + e)


def swish(y, swish_scale):
    """``y * sigmoid(swish_scale * y)`` in y's precision (njit only): float32 or float64."""
    raise NotImplementedError("swish() is only callable from @njit code")


@overload(swish, inline="always")
def _swish(y, swish_scale):
    if y == types.float64:
        return lambda y, swish_scale: swish_float64(y, swish_scale)
    return lambda y, swish_scale: swish_float32(y, swish_scale)


@intrinsic
def _block_moments(typingctx, row, start, stop, offset, center, other_center, fmt):
    """``(sum of d, sum of d^2, other sum of d, other sum of d^2)``: ``d = x - center`` over
    ``row[start:stop]`` (1-D, C-contiguous, decoded with ``fmt``), and ``x - other_center`` over
    the same positions ``offset`` elements on (a second group's block; offset 0 repeats the
    first). Each sum in the order of the backward's :func:`_block_sums`: element ``start + i``
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

        totals = _lane_sums(builder, vector, start, stop, terms, 4)
        return context.make_tuple(builder, signature.return_type, totals)

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
def _normalise_row(x_row, y_row, mean, scale, beta, activate_swish, swish_scale, fmt):
    """``y = (x - mean) * scale + beta`` (``scale = rstd * gamma``, one rounding: fma), then
    Swish when ``activate_swish``; two loops so that each vectorises without a branch."""
    wide_vectors()
    if activate_swish:
        for i in range(x_row.shape[0]):
            y_row[i] = store(swish(fma(load(x_row[i], fmt) - mean, scale, beta), swish_scale), fmt)
    else:
        for i in range(x_row.shape[0]):
            y_row[i] = store(fma(load(x_row[i], fmt) - mean, scale, beta), fmt)


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
        n, first, last = _task_groups(task, runs, groups_per_task, groups)
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
        x[n].reshape(channels * hw), g * size, size, offset, count, eps, zero, one, fmt
    )
    mean[n, g] = group_mean
    rstd[n, g] = group_rstd
    if offset:
        mean[n, g + 1] = other_mean
        rstd[n, g + 1] = other_rstd
    for c in range(g * group_size, last * group_size):
        group = c // group_size
        _normalise_row(
            x[n, c], y[n, c], mean[n, group], rstd[n, group] * gamma[c], beta[c], activate_swish, swish_scale, fmt
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
        n, first, last = _task_groups(task, runs, groups_per_task, groups)
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
        mean[n, g] = center[first]
        rstd[n, g] = group_rstd
        for k in range(first, first + group_size):
            scale[k] = group_rstd * gamma[start + k]
    channel_beta = beta[start : start + width]
    for i in range(hw):
        x_row = x[n, i, start : start + width]
        y_row = y[n, i, start : start + width]
        if activate_swish:
            for k in range(width):
                y_row[k] = store(
                    swish(fma(load(x_row[k], fmt) - center[k], scale[k], channel_beta[k]), swish_scale), fmt
                )
        else:
            for k in range(width):
                y_row[k] = store(fma(load(x_row[k], fmt) - center[k], scale[k], channel_beta[k]), fmt)


# ---- plans (docs/design.md, "The one contract") ------------------------------------------------

#: Channels an NHWC task aims to span (its inner loops run along them, once per position):
#: narrow runs are slow, and keeping dy and x in cache matters less (docs/history.md).
NHWC_TASK_CHANNELS = 512
#: Tasks per thread the NHWC runs are split into at least, when the batch alone gives fewer.
NHWC_TASKS_PER_THREAD = 2
#: NCHW forward tasks take two groups each (:func:`nchw_groups_per_task`) only while that
#: leaves at least this many tasks per thread: fewer, larger tasks balance worse.
NCHW_PAIRED_TASKS_PER_THREAD = 4
#: An NHWC dx of float16 or bfloat16 (a float32 or float64 dx holds gnew between the kernel's
#: passes and is overwritten in place) of at least this many bytes is written with streaming
#: (non-temporal) stores. An NHWC task's x and gnew (a whole image's channels) outgrow L2 and are
#: reread from L3 in its second pass; a plain dx store first reads its line and then evicts
#: them. The floor is kept above the size where streaming starts to win, so that a smaller dx
#: stays in cache for whatever reads it next (docs/history.md).
NHWC_STREAM_MIN_BYTES = 4 << 20


class Geometry(NamedTuple):
    """A validated group_norm_swish_backward call, as its kernels see it."""

    nhwc: bool  # the kernels' layout is (N, HxW, C); else (N, C, HxW)
    batch: int
    channels: int
    positions: int  # HxW: the product of the spatial sizes
    groups: int
    itemsize: int  # of dy, x and dx
    fmt: StorageFormat  # of dy, x and dx
    compute: np.dtype  # the kernels' arithmetic: float64 for float64 data, else float32
    parameter_fmt: StorageFormat  # of dgamma and dbeta (gamma's dtype)
    want_dgamma: bool
    want_dbeta: bool
    threads: int  # the thread count a parallel launch runs on (it sizes the NHWC tasks)
    activate_swish: bool = True  # False: the plain GroupNorm backward (gnew = dy)


class ForwardGeometry(NamedTuple):
    """A validated group_norm_swish (forward) call, as its kernel sees it."""

    nhwc: bool  # the kernel's layout is (N, HxW, C); else (N, C, HxW)
    batch: int
    channels: int
    positions: int
    groups: int
    fmt: StorageFormat  # of x and y
    compute: np.dtype  # of the statistics, gamma, beta and the scalars
    activate_swish: bool
    threads: int


def plan(geometry):
    """The plan of a call of either direction: :class:`BackwardPlan` for a :class:`Geometry`,
    :class:`ForwardPlan` for a :class:`ForwardGeometry` (the task partition, the launches and
    the scratch each call allocates)."""
    if isinstance(geometry, ForwardGeometry):
        return _forward_plan(geometry)
    return _backward_plan(geometry)


def nhwc_groups_per_task(groups, group_size, batch, threads):
    """Consecutive groups one NHWC task handles: about :data:`NHWC_TASK_CHANNELS` channels, fewer
    only until there are :data:`NHWC_TASKS_PER_THREAD` tasks per thread, never fewer than one
    group. Any choice gives the same bits (every per-(n, c) sum has a fixed order)."""
    if groups * group_size <= WHOLE_ROWS_MAX_CHANNELS and batch >= threads:
        return groups  # a whole image per task: steps of PARTIAL_SUMS positions (narrow runs are slower)
    by_width = -(-NHWC_TASK_CHANNELS // group_size)
    runs_per_image = -(-NHWC_TASKS_PER_THREAD * threads // batch)
    by_tasks = -(-groups // runs_per_image)
    return max(1, min(groups, by_width, by_tasks))


def nchw_groups_per_task(groups, batch, threads):
    """Groups one NCHW forward task handles: two (their sums interleaved, the same bits) while
    that leaves at least :data:`NCHW_PAIRED_TASKS_PER_THREAD` tasks per thread, else one."""
    return 2 if batch * (groups // 2) >= NCHW_PAIRED_TASKS_PER_THREAD * threads else 1


class BackwardPlan(NamedTuple):
    """The plan of a backward call: the dx kernel's launch, shape and last arguments, and the
    launch of the parameter gradients' kernel (None when neither is wanted)."""

    dx: Launch
    shape: tuple  # (N, C, HxW) or (N, HxW, C)
    arguments: tuple  # the dx kernel's arguments after sum_gx
    parameter_grads: Launch
    wants: tuple  # (want_dgamma, want_dbeta, parameter_fmt): the last arguments of parameter_grads
    sums: tuple  # the shape of the per-(n, c) sums
    compute: np.dtype
    activate_swish: bool

    def run(self, dy, mean, rstd, x, gamma, beta, dx, dgamma, dbeta, swish_scale):
        """dx (and dgamma, dbeta when wanted) from the kernel views of dy, x and dx (C-contiguous
        in the plan's layout, any shape holding it); mean, rstd ``(N, G)``, gamma, beta ``(C,)``
        and ``swish_scale`` in the compute type, C-contiguous (ignored without Swish); dgamma,
        dbeta ``(C,)`` kernel views in the parameters' dtype (one that is not wanted is not
        written)."""
        sum_g = np.empty(self.sums, self.compute)
        sum_gx = np.empty(self.sums, self.compute)
        shape = self.shape
        self.dx(
            dy.reshape(shape),
            x.reshape(shape),
            mean,
            rstd,
            gamma,
            beta,
            swish_scale if self.activate_swish else None,  # None: the kernels compiled without Swish
            dx.reshape(shape),
            sum_g,
            sum_gx,
            *self.arguments,
        )
        if self.parameter_grads is not None:
            self.parameter_grads(sum_g, sum_gx, dgamma, dbeta, *self.wants)


def _backward_plan(g):
    work = g.batch * g.channels * g.positions
    dx = Launch(group_norm_swish_bwd_nhwc if g.nhwc else group_norm_swish_bwd_nchw, work, read_only=(0, 1, 2, 3, 4, 5))
    if g.nhwc:
        threads = g.threads if dx.parallel else 1
        streaming = work * g.itemsize >= NHWC_STREAM_MIN_BYTES  # only a half-format dx is streamed
        groups_per_task = nhwc_groups_per_task(g.groups, g.channels // g.groups, g.batch, threads)
        shape, arguments = (g.batch, g.positions, g.channels), (groups_per_task, streaming, g.fmt)
    else:
        shape, arguments = (g.batch, g.channels, g.positions), (g.fmt,)
    # the serial twin: only N*C additions, and building the parallel one cost ~1.3 s (of
    # ~7.7 s CPU on a loaded machine) in the first call's compile
    parameter_grads = None
    if g.want_dgamma or g.want_dbeta:
        parameter_grads = Launch(group_norm_swish_param_grads, None, read_only=(0, 1))
    return BackwardPlan(
        dx,
        shape,
        arguments,
        parameter_grads,
        (g.want_dgamma, g.want_dbeta, g.parameter_fmt),
        (g.batch, g.channels),
        g.compute,
        g.activate_swish,
    )


class ForwardPlan(NamedTuple):
    """The plan of a forward call: the kernel's launch, shape and partition."""

    launch: Launch
    shape: tuple  # (N, C, HxW) or (N, HxW, C)
    activate_swish: bool
    groups_per_task: int
    fmt: StorageFormat

    def run(self, x, gamma, beta, y, mean, rstd, eps, swish_scale):
        """y, mean and rstd from the kernel views of x and y (C-contiguous in the plan's layout,
        any shape holding it); gamma, beta ``(C,)``, ``eps`` and ``swish_scale`` in the compute
        type; mean and rstd ``(N, G)`` compute-type outputs, C-contiguous."""
        self.launch(
            x.reshape(self.shape),
            gamma,
            beta,
            eps,
            self.activate_swish,
            swish_scale,
            y.reshape(self.shape),
            mean,
            rstd,
            self.groups_per_task,
            self.fmt,
        )


def _forward_plan(g):
    work = g.batch * g.channels * g.positions
    launch = Launch(group_norm_swish_fwd_nhwc if g.nhwc else group_norm_swish_fwd_nchw, work, read_only=(0, 1, 2))
    threads = g.threads if launch.parallel else 1
    if g.nhwc:
        groups_per_task = nhwc_groups_per_task(g.groups, g.channels // g.groups, g.batch, threads)
        shape = (g.batch, g.positions, g.channels)
    else:
        groups_per_task = nchw_groups_per_task(g.groups, g.batch, threads)
        shape = (g.batch, g.channels, g.positions)
    return ForwardPlan(launch, shape, g.activate_swish, groups_per_task, g.fmt)
