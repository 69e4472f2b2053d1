"""The math GroupNorm+Swish's kernels share (``kernels/group_norm_swish.py`` is the overview):
the fixed-order reduction's constants and its lane sums in LLVM IR, fma, a vectorisable exp,
Swish and its derivative, and the task partition over (image, run of groups).

The llvmlite wheel has no SVML, so ``math.exp`` is a scalar call that blocks vectorisation: the
float32 path uses :func:`exp_nonpositive_float32`, a Cephes-style polynomial built from float
and integer operations only (about 1e-7 relative error; subnormal results flushed to 0, which
is faster than scaling into the subnormal range). float64 data uses ``math.exp``.
"""

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._halfbits import float32_as_uint32, one_nan, store, uint32_as_float32
from ._jit import always_inline, helper, leaf_helper, wide_vectors
from ._lanes import LANES, fold_lanes_by_halving, for_each_vector

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


# exp in three steps, so that the staged loops (below) can run each as a loop of its own; the
# one-call exp_nonpositive_float32 chains them: the same operations, the same bits.


@helper
def _exp_reduction(a):
    """``(shifted, r)``: ``a = k*ln2 + r`` with ``|r| <= ln2/2``, ``k`` held in ``shifted``'s low
    mantissa bits (``shifted = a*log2(e) + 1.5*2^23 + 127``, rounded)."""
    shifted = fma(a, _LOG2E, _ROUND_MAGIC)
    k = shifted - _ROUND_MAGIC
    return shifted, fma(k, -_LN2_LO, fma(k, -_LN2_HI, a))


@helper
def _exp_polynomial(r):
    """``exp(r)`` for ``|r| <= ln2/2``: Cephes' degree-5 polynomial, ``1 + r + r^2 p(r)``."""
    p = fma(fma(fma(fma(fma(_P0, r, _P1), r, _P2), r, _P3), r, _P4), r, _P5)
    return fma(p, r * r, r) + _ONE32


@helper
def _exp_scaled(a, shifted, exp_r):
    """``exp(a) = 2^k * exp(r)`` from :func:`_exp_reduction`'s ``shifted`` and
    :func:`_exp_polynomial`'s ``exp(r)``; 0 where it would be subnormal (``a < -87.33``)."""
    # biased exponent k + 127, in [1, 127] when a >= -87.33 (other lanes are discarded below)
    biased = np.uint32(float32_as_uint32(shifted) - _ROUND_MAGIC_BITS)
    result = exp_r * uint32_as_float32(np.uint32(biased << np.uint32(23)))
    return _ZERO32 if a < _EXP_FLUSH else result


@helper
def exp_nonpositive_float32(a):
    """exp(a) for float32 ``a <= 0`` (NaN gives NaN); vectorises (no libm call).

    About 1e-7 relative error down to the smallest normal float32; results that would be
    subnormal (a < -87.33) are flushed to 0, an absolute error below 1.2e-38.
    """
    shifted, r = _exp_reduction(a)
    return _exp_scaled(a, shifted, _exp_polynomial(r))


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


def swish_argument(y, swish_scale):
    """``s*y`` clamped as the Swish derivative clamps it (+-104 in float32, +-750 in float64),
    in y's precision (njit only)."""
    raise NotImplementedError("swish_argument() is only callable from @njit code")


@overload(swish_argument, inline="always")
def _swish_argument(y, swish_scale):
    if y == types.float64:
        return lambda y, swish_scale: _clamp(swish_scale * y, SWISH_CLAMP64)
    return lambda y, swish_scale: _clamp(swish_scale * y, SWISH_CLAMP32)


def swish_derivative(z):
    """The Swish derivative in z's precision (njit only): float32 or float64."""
    raise NotImplementedError("swish_derivative() is only callable from @njit code")


@overload(swish_derivative, inline="always")
def _swish_derivative(z):
    if z == types.float64:
        return lambda z: swish_derivative_float64(z)
    return lambda z: swish_derivative_float32(z)


# ---- the fixed-order reduction ----------------------------------------------------------------


def lane_vectors(builder, vector, start, stop, terms, count, unroll=True):
    """The lanes of :func:`lane_sums` before their fold: ``count`` vectors, lane ``j`` the sum
    (from +0.0, in order) of the terms of the positions ``start + j``, ``start + j + LANES``,
    ... below ``stop``. The sums are independent chains of adds, so several of them run side by
    side."""
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

    for_each_vector(builder, start, stop, add, unroll)
    return [builder.load(total) for total in sums]


def lane_sums(builder, vector, start, stop, terms, count, unroll=True):
    """Code for ``count`` sums over positions ``[start, stop)`` in the fixed order of the module
    doc: ``terms(position, used)`` gives the ``count`` vectors that LANES consecutive positions
    add (lane ``i`` from position ``position + i``; ``used`` masks a last partial vector, else
    None), each lane summed from +0.0 in order (:func:`lane_vectors`), then the lanes folded by
    halving. Returns the totals."""
    lanes = lane_vectors(builder, vector, start, stop, terms, count, unroll)
    return [fold_lanes_by_halving(builder, vector) for vector in lanes]


def for_each_row(builder, first, stop, hw, body):
    """Emit ``body(channel, row_start, row_stop)`` for the channel rows that meet the flat
    positions ``[first, stop)`` of an image (channel ``c`` holds ``[c*hw, (c+1)*hw)``), in
    channel order, each cut to ``[first, stop)``: one loop over a group's rows inside an
    intrinsic, where a loop of intrinsic calls paid each row's setup (views, bounds, vector
    constants) in many more instructions than a 4 x 4 row's arithmetic."""
    one = ir.Constant(hw.type, 1)
    width = builder.select(builder.icmp_signed(">", hw, ir.Constant(hw.type, 0)), hw, one)  # no rows when hw is 0
    first_row = builder.sdiv(first, width)
    end_row = builder.sdiv(builder.add(stop, builder.sub(width, one)), width)
    with cgutils.for_range(builder, builder.sub(end_row, first_row)) as loop:
        c = builder.add(first_row, loop.index)
        row_start = builder.mul(c, width)
        row_stop = builder.add(row_start, width)
        row_start = builder.select(builder.icmp_signed("<", row_start, first), first, row_start)
        row_stop = builder.select(builder.icmp_signed(">", row_stop, stop), stop, row_stop)
        body(c, row_start, row_stop)


@helper
def task_groups(task, runs, groups_per_task, groups):
    """``(n, first group, end group)`` of task ``task`` of a kernel parallel over (image, run of
    ``groups_per_task`` consecutive groups), ``runs`` runs per image (the last may be shorter)."""
    n = task // runs
    first = (task - n * runs) * groups_per_task
    return n, first, min(first + groups_per_task, groups)


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


# ---- the staged Swish loops -----------------------------------------------------------------
# One loop evaluating Swish or its derivative per element is bound by the latency of that
# element's chain of dependent operations (~95 cycles: the exp's reduction, five Horner fmas,
# the division), of which the out-of-order window holds only a few vectors' worth. So float32
# goes through short loops instead, one per stage of the chain, over chunks of up to
# STAGE_CHUNK elements whose intermediates wait in L1 scratch rows: the same operations on each
# element in the same order (float32 values stored exactly), the same bits, 1.3-1.5x faster
# (docs/history.md, issue 53). float64 (math.exp: a libm call, no vector loop) stays one loop.
#
# A NaN's sign may differ between a vector loop's body and its scalar remainder (instruction
# selection orders a commutative operation's operands as it likes, and Swish meets a NaN with
# the exp of its absolute value). So which elements of a row take the remainder must depend on
# the problem alone, never on the task partition (which follows the thread count): the NCHW
# kernels cut chunks from each group's start; the NHWC ones, whose channel runs follow the
# thread count, run the last stage over a whole number of STAGE_ALIGN elements (the scratch
# rows' tails computed and ignored: vector bodies only) and copy the chunk out, or write it in
# place when it is such a whole number already and the output has the scratch's type.

#: Elements per chunk of the staged loops: their scratch rows (2 KB each in float32) stay in L1.
STAGE_CHUNK = 512
#: A multiple of the elements of any target's vector loop iteration (16 float32 lanes,
#: interleaved up to 4 times): a loop over a multiple of it runs its vector body alone.
STAGE_ALIGN = 64
#: Scratch rows the staged loops take (``stack_array(STAGE_ROWS, STAGE_CHUNK, ...)``): row 0
#: the chunk's input (y or z), rows 1 and 2 the exp's intermediates, row 3 the derivative's dy
#: (the caller fills rows 0 and 3), row 4 a result kept in scratch (:data:`STAGE_OUT`): a loop
#: writing a row it reads fails LLVM's run-time overlap check and runs scalar.
STAGE_ROWS = 5
STAGE_OUT = 4


@helper
def groups_share_a_stage(size):
    """Whether two groups of ``size`` elements take one staged Swish pass together: both fit a
    chunk and each is a whole number of :data:`STAGE_ALIGN` elements, so every element goes
    through the same vector code as in a pass of its own group (the same bits)."""
    return 2 * size <= STAGE_CHUNK and size % STAGE_ALIGN == 0


@helper
def aligned(count):
    """``count`` rounded up to a multiple of :data:`STAGE_ALIGN` (at most STAGE_CHUNK when
    ``count`` is)."""
    return (count + STAGE_ALIGN - 1) // STAGE_ALIGN * STAGE_ALIGN


@leaf_helper
def _swish_reduction_rows(y, swish_scale, shifted, r, count):
    """Stage 1 of Swish: :func:`_exp_reduction` of ``-|s*y|``."""
    wide_vectors()
    for i in range(count):
        shifted_i, r_i = _exp_reduction(-abs(swish_scale * y[i]))
        shifted[i] = shifted_i
        r[i] = r_i


@leaf_helper
def _exp_reduction_rows(z, shifted, r, count):
    """Stage 1 of the Swish derivative: :func:`_exp_reduction` of ``-|z|``."""
    wide_vectors()
    always_inline()
    for i in range(count):
        shifted_i, r_i = _exp_reduction(-abs(z[i]))
        shifted[i] = shifted_i
        r[i] = r_i


@leaf_helper
def _exp_polynomial_rows(r, count):
    """Stage 2: ``r[i] = exp(r[i])`` by :func:`_exp_polynomial`, in place."""
    wide_vectors()
    for i in range(count):
        r[i] = _exp_polynomial(r[i])


@leaf_helper
def _swish_finish_rows(y, swish_scale, shifted, exp_r, out, count, fmt):
    """Stage 3 of Swish: ``out[i]`` = :func:`swish_float32` of ``y[i]``, stored in ``fmt``."""
    wide_vectors()
    for i in range(count):
        value = y[i]
        z = swish_scale * value
        e = _exp_scaled(-abs(z), shifted[i], exp_r[i])
        out[i] = store(one_nan((value if z >= 0 else value * e) / (_ONE32 + e)), fmt)


@leaf_helper
def _swish_gradient_finish_rows(z, shifted, exp_r, dy, out, count):
    """Stage 3 of the derivative: ``out[i] = dy[i] * swish_derivative_float32(z[i])`` (``z``
    already clamped, ``dy`` decoded)."""
    wide_vectors()
    for i in range(count):
        z_i = z[i]
        e = _exp_scaled(-abs(z_i), shifted[i], exp_r[i])
        out[i] = dy[i] * _swish_derivative_from(z_i, e, _ONE32)


@leaf_helper
def store_rows(values, out, count, fmt):
    """``out[i] = store(values[i], fmt)`` for ``i < count``: a copy, or the half formats'
    rounding (exact operations: any loop shape gives the same bits)."""
    wide_vectors()
    for i in range(count):
        out[i] = store(values[i], fmt)


@leaf_helper
def _swish_rows_float32(scratch, swish_scale, out, count, fmt):
    wide_vectors()
    whole = aligned(count)
    _swish_reduction_rows(scratch[0], swish_scale, scratch[1], scratch[2], whole)
    _exp_polynomial_rows(scratch[2], whole)
    _swish_finish_rows(scratch[0], swish_scale, scratch[1], scratch[2], out, count, fmt)


@leaf_helper
def _swish_rows_float64(scratch, swish_scale, out, count, fmt):
    wide_vectors()
    y = scratch[0]
    for i in range(count):
        out[i] = store(one_nan(swish_float64(y[i], swish_scale)), fmt)


@leaf_helper
def _swish_gradient_rows_float32(scratch, out, count):
    wide_vectors()
    always_inline()
    whole = aligned(count)
    _exp_reduction_rows(scratch[0], scratch[1], scratch[2], whole)
    _exp_polynomial_rows(scratch[2], whole)
    _swish_gradient_finish_rows(scratch[0], scratch[1], scratch[2], scratch[3], out, count)


@leaf_helper
def _swish_gradient_rows_float64(scratch, out, count):
    wide_vectors()
    z = scratch[0]
    dy = scratch[3]
    for i in range(count):
        z_i = z[i]
        out[i] = dy[i] * _swish_derivative_from(z_i, math.exp(-abs(z_i)), _ONE64)


def swish_rows(scratch, swish_scale, out, count, fmt):
    """``out[i] = store(swish(y[i]), fmt)`` for ``i < count <= STAGE_CHUNK``, ``y`` the
    compute-type ``scratch[0]`` (``scratch``: :data:`STAGE_ROWS` rows of STAGE_CHUNK; rows 1
    and 2 overwritten); staged in float32 (njit only). ``out`` may be ``scratch[STAGE_OUT]``."""
    raise NotImplementedError("swish_rows() is only callable from @njit code")


@overload(swish_rows, inline="always")
def _swish_rows(scratch, swish_scale, out, count, fmt):
    if scratch.dtype == types.float64:
        return lambda scratch, swish_scale, out, count, fmt: _swish_rows_float64(scratch, swish_scale, out, count, fmt)
    return lambda scratch, swish_scale, out, count, fmt: _swish_rows_float32(scratch, swish_scale, out, count, fmt)


def swish_gradient_rows(scratch, out, count):
    """``out[i] = dy[i] * swish_derivative(z[i])`` for ``i < count <= STAGE_CHUNK``, ``z``
    (clamped, :func:`swish_argument`) and ``dy`` the compute-type ``scratch[0]`` and
    ``scratch[3]`` (rows 1 and 2 overwritten); staged in float32 (njit only). ``out`` may be
    ``scratch[STAGE_OUT]``."""
    raise NotImplementedError("swish_gradient_rows() is only callable from @njit code")


@overload(swish_gradient_rows, inline="always")
def _swish_gradient_rows(scratch, out, count):
    if scratch.dtype == types.float64:
        return lambda scratch, out, count: _swish_gradient_rows_float64(scratch, out, count)
    return lambda scratch, out, count: _swish_gradient_rows_float32(scratch, out, count)
