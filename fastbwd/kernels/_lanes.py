"""Explicit 16-lane vector operations for kernels whose short fixed-length loops LLVM does not
vectorise by itself: the IR building blocks (this module), the tile intrinsics of the separable
engine and RoIAlign (``_lane_tiles``) and avg-pool's whole-row intrinsics (``_lane_rows``).

LLVM fully unrolls a loop of 16 iterations into scalar code and its SLP vectoriser then gives
up (it cannot prove the tiles do not alias), so the tile loops of the separable engine ran
scalar; and a sum over a runtime-length list of source rows cannot keep its 16-lane
accumulator in a register when written as Numba loops. These intrinsics emit the vector IR
directly. They perform exactly the scalar operations they replace (a multiply, then an add: no
fused multiply-add; sums start from +0.0 and add in list order), so results are bitwise those
of the plain loops.

They operate on 2-D C-contiguous arrays (float32 or float64 results; sources may also be
float16/bfloat16 ``uint16`` views, decoded with their StorageFormat) and trust their indices
(no bounds checks, like every kernel): the caller guarantees ``LANES`` elements exist where they
read and write. The memory side (prefetch, streaming stores, ``copy_out``) is in ``_memory``.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils

from ._halfcalls import half_type

#: Elements per vector operation (one 512-bit vector of float32, two of float64).
LANES = 16
#: Vectors up to which :func:`for_each_vector` (``unroll=False``) runs a loop LLVM does not unroll.
SHORT_LOOP = 4

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_I1 = ir.IntType(1)


def _element_pointer(builder, array, row, column):
    """Address of ``array[row, column]`` of a 2-D C-contiguous array struct."""
    columns = cgutils.unpack_tuple(builder, array.shape, 2)[1]
    return builder.gep(array.data, [builder.add(builder.mul(row, columns), column)])


def array_structs(context, builder, signature, args, *positions):
    """The array structs (data pointer, shape, ...) of the intrinsic arguments at ``positions``."""
    return [context.make_array(signature.args[i])(context, builder, args[i]) for i in positions]


def _both_c_matrices(*arrays):
    """Typing guard of the tile intrinsics: their addressing assumes 2-D C-contiguous arrays (any
    other layout is a typing error, never a wrong address)."""
    return all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays)


def _vector_pointer(builder, array, row, column, vector_type):
    return builder.bitcast(_element_pointer(builder, array, row, column), vector_type.as_pointer())


# ---- IR building blocks (also used by other kernels' intrinsics) ------------------------------


def splat(builder, vector_type, value):
    """``value`` in every lane."""
    one = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, _I32(0))
    return builder.shuffle_vector(
        one,
        ir.Constant(vector_type, ir.Undefined),
        ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count),
    )


def decode_lanes(builder, pointer, format_name, vector_type, mask=None):
    """The LANES elements from element ``pointer`` on, decoded to ``vector_type`` (see
    kernels._halfbits: float16 widens exactly, bfloat16 bits move to the top half of a float32).

    With a ``mask`` (``<LANES x i1>``) only the lanes it selects are read (``llvm.masked.load``:
    nothing else is touched) and the others are 0.
    """
    native = format_name == "native"
    stored = vector_type if native else ir.VectorType(ir.IntType(16), LANES)
    pointer = builder.bitcast(pointer, stored.as_pointer())
    if native:
        single = isinstance(vector_type.element, ir.FloatType)
        align, suffix = (4, "f32") if single else (8, "f64")
    else:
        align, suffix = 2, "i16"
    if mask is None:
        bits = builder.load(pointer, align=align)
    else:
        function = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(stored, [stored.as_pointer(), _I32, ir.VectorType(ir.IntType(1), LANES), stored]),
            f"llvm.masked.load.v{LANES}{suffix}.p0v{LANES}{suffix}",
        )
        bits = builder.call(function, [pointer, _I32(align), mask, ir.Constant(stored, None)])
    if native:
        return bits
    if format_name == "float16":
        return builder.fpext(builder.bitcast(bits, half_type(LANES)), vector_type)
    words = builder.zext(bits, ir.VectorType(_I32, LANES))
    return builder.bitcast(builder.shl(words, ir.Constant(ir.VectorType(_I32, LANES), [16] * LANES)), vector_type)


def encode_lanes(builder, vector, format_name):
    """``vector`` (compute type) in its storage form, lane by lane as kernels._halfbits' ``store``:
    float16 by IEEE round to nearest even, bfloat16 by round to nearest even on the bits (NaN
    kept quiet), native unchanged. The inverse of :func:`decode_lanes`."""
    if format_name == "native":
        return vector
    half_words = ir.VectorType(ir.IntType(16), LANES)
    if format_name == "float16":
        return builder.bitcast(builder.fptrunc(vector, half_type(LANES)), half_words)
    words = ir.VectorType(_I32, LANES)

    def constant(value):
        return ir.Constant(words, [value] * LANES)

    bits = builder.bitcast(vector, words)
    top = builder.lshr(bits, constant(16))
    rounded = builder.lshr(
        builder.add(builder.add(bits, constant(0x7FFF)), builder.and_(top, constant(1))), constant(16)
    )
    quiet_nan = builder.or_(top, constant(0x0040))
    result = builder.select(builder.fcmp_unordered("uno", vector, vector), quiet_nan, rounded)
    return builder.trunc(result, half_words)


def fma_lanes(builder, a, b, c):
    """``a * b + c`` rounded once, lane by lane (``llvm.fma`` of the vector type: what the
    kernels' scalar ``fma`` vectorises to)."""
    element = "f32" if isinstance(a.type.element, ir.FloatType) else "f64"
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(a.type, [a.type] * 3), f"llvm.fma.v{a.type.count}{element}"
    )
    return builder.call(function, [a, b, c])


def store_lanes(builder, pointer, vector, format_name, mask=None):
    """Store ``vector`` (compute type) at element ``pointer`` on in its storage form
    (:func:`encode_lanes`). With a ``mask`` (``<LANES x i1>``) only the lanes it selects are
    written (``llvm.masked.store``: nothing else is touched); the inverse of :func:`decode_lanes`."""
    stored = encode_lanes(builder, vector, format_name)
    if format_name == "native":
        single = isinstance(vector.type.element, ir.FloatType)
        align, suffix = (4, "f32") if single else (8, "f64")
    else:
        align, suffix = 2, "i16"
    pointer = builder.bitcast(pointer, stored.type.as_pointer())
    if mask is None:
        builder.store(stored, pointer, align=align)
        return
    function = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(ir.VoidType(), [stored.type, stored.type.as_pointer(), _I32, ir.VectorType(_I1, LANES)]),
        f"llvm.masked.store.v{LANES}{suffix}.p0v{LANES}{suffix}",
    )
    builder.call(function, [stored, pointer, _I32(align), mask])


def for_each_vector(builder, start, stop, body, unroll=True):
    """Emit ``body(position, mask)`` for the vectors of LANES consecutive positions from
    ``start`` to ``stop`` (i64 values), in order: whole vectors with ``mask`` None (a loop), then
    a last partial one, if any, with a ``<LANES x i1>`` mask of its positions (so that a row of
    any length takes one loop and at most one masked step, without a scalar remainder).
    ``unroll=False`` emits the loop twice: for up to :data:`SHORT_LOOP` vectors one LLVM does not
    unroll (:func:`no_unroll`: a short row skips the unrolled loop's checks and remainder), for
    more one it may unroll (a long row's loop overhead)."""
    length = builder.sub(stop, start)
    whole = builder.sdiv(length, _I64(LANES))

    def vectors():
        with cgutils.for_range(builder, whole) as loop:
            body(builder.add(start, builder.mul(loop.index, _I64(LANES))), None)
        return loop

    if unroll:
        vectors()
    else:
        with builder.if_else(builder.icmp_signed("<=", whole, _I64(SHORT_LOOP))) as (short, long):
            with short:
                no_unroll(builder, vectors())
            with long:
                vectors()
    tail = builder.add(start, builder.mul(whole, _I64(LANES)))
    remaining = builder.sub(stop, tail)
    with builder.if_then(builder.icmp_signed(">", remaining, _I64(0))):
        lane_numbers = ir.Constant(ir.VectorType(_I64, LANES), list(range(LANES)))
        body(tail, builder.icmp_signed("<", lane_numbers, splat(builder, ir.VectorType(_I64, LANES), remaining)))


def no_unroll(builder, loop):
    """Mark the loop of ``cgutils.for_range`` whose ``loop`` this is (just closed) as one LLVM
    neither unrolls nor vectorises (``llvm.loop`` metadata on its latch)."""
    module = builder.module
    options = [
        module.add_metadata([ir.MetaDataString(module, "llvm.loop.unroll.disable")]),
        module.add_metadata([ir.MetaDataString(module, "llvm.loop.vectorize.enable"), _I1(0)]),
    ]
    # a loop ID is a distinct node whose first operand is itself
    loop_id = ir.values.MDValue(module, [], name=str(len(module.metadata)))
    loop_id.operands = (loop_id, *options)
    latch = loop.index.incomings[-1][1]
    latch.terminator.set_metadata("llvm.loop", loop_id)


def fold_lanes_by_halving(builder, vector):
    """Lane 0 after adding lane ``j + h`` into lane ``j`` for h = LANES/2, ..., 2, 1."""
    half = LANES // 2
    while half >= 1:
        shifted = builder.shuffle_vector(
            vector,
            ir.Constant(vector.type, ir.Undefined),
            ir.Constant(ir.VectorType(_I32, LANES), [min(j + half, LANES - 1) for j in range(LANES)]),
        )
        vector = builder.fadd(vector, shifted)
        half //= 2
    return builder.extract_element(vector, _I32(0))


def fold_rows_by_halving(builder, vectors):
    """:func:`fold_lanes_by_halving` of LANES/2 vectors (the rows' lanes) at once: a vector of
    LANES/2 lanes, lane ``r`` row ``r``'s lane 0 after the same adds (lane ``j + h`` into lane
    ``j``, h = LANES/2, ..., 2, 1). The first level adds each row's high half to its low half;
    each further level adds, for two vectors of rows, the high halves of all their rows' lanes
    to the low halves in one vector add, so a row's share is a fraction of an add and of a
    shuffle where its own fold took one of each per level, each waiting on the one before."""
    half = LANES // 2
    assert len(vectors) == half
    low = ir.Constant(ir.VectorType(_I32, half), list(range(half)))
    high = ir.Constant(ir.VectorType(_I32, half), list(range(half, LANES)))
    undefined = ir.Constant(vectors[0].type, ir.Undefined)
    level = [
        builder.fadd(builder.shuffle_vector(v, undefined, low), builder.shuffle_vector(v, undefined, high))
        for v in vectors
    ]
    segment = half  # lanes of each row still to fold, rows side by side in each vector
    while segment > 1:
        step = segment // 2
        rows = half // segment  # rows per vector
        low_lanes = [vector * half + row * segment + j for vector in (0, 1) for row in range(rows) for j in range(step)]
        low_mask = ir.Constant(ir.VectorType(_I32, half), low_lanes)
        high_mask = ir.Constant(ir.VectorType(_I32, half), [lane + step for lane in low_lanes])
        level = [
            builder.fadd(builder.shuffle_vector(x, y, low_mask), builder.shuffle_vector(x, y, high_mask))
            for x, y in zip(level[0::2], level[1::2])
        ]
        segment = step
    return level[0]
