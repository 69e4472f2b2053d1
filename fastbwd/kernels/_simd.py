"""Explicit 16-lane vector operations for kernels whose short fixed-length loops LLVM does not
vectorise by itself.

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
read and write.
"""

import contextlib

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._jit import leaf_helper

#: Elements per vector operation (one 512-bit vector of float32, two of float64).
LANES = 16

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
    return builder.shuffle_vector(one, ir.Constant(vector_type, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count))


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
            f"llvm.masked.load.v{LANES}{suffix}.p0v{LANES}{suffix}")
        bits = builder.call(function, [pointer, _I32(align), mask, ir.Constant(stored, None)])
    if native:
        return bits
    if format_name == "float16":
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), vector_type)
    words = builder.zext(bits, ir.VectorType(_I32, LANES))
    return builder.bitcast(builder.shl(words, ir.Constant(ir.VectorType(_I32, LANES), [16] * LANES)),
                           vector_type)


def encode_lanes(builder, vector, format_name):
    """``vector`` (compute type) in its storage form, lane by lane as kernels._halfbits' ``store``:
    float16 by IEEE round to nearest even, bfloat16 by round to nearest even on the bits (NaN
    kept quiet), native unchanged. The inverse of :func:`decode_lanes`."""
    if format_name == "native":
        return vector
    half_words = ir.VectorType(ir.IntType(16), LANES)
    if format_name == "float16":
        return builder.bitcast(builder.fptrunc(vector, ir.VectorType(ir.HalfType(), LANES)), half_words)
    words = ir.VectorType(_I32, LANES)

    def constant(value):
        return ir.Constant(words, [value] * LANES)

    bits = builder.bitcast(vector, words)
    top = builder.lshr(bits, constant(16))
    rounded = builder.lshr(builder.add(builder.add(bits, constant(0x7FFF)), builder.and_(top, constant(1))),
                           constant(16))
    quiet_nan = builder.or_(top, constant(0x0040))
    result = builder.select(builder.fcmp_unordered("uno", vector, vector), quiet_nan, rounded)
    return builder.trunc(result, half_words)


def fold_lanes_by_halving(builder, vector):
    """Lane 0 after adding lane ``j + h`` into lane ``j`` for h = LANES/2, ..., 2, 1."""
    half = LANES // 2
    while half >= 1:
        shifted = builder.shuffle_vector(vector, ir.Constant(vector.type, ir.Undefined),
                                         ir.Constant(ir.VectorType(_I32, LANES),
                                                     [min(j + half, LANES - 1) for j in range(LANES)]))
        vector = builder.fadd(vector, shifted)
        half //= 2
    return builder.extract_element(vector, _I32(0))


def _gathered_sum(builder, source, index, weights, start, stop, column, format_name, vector_type):
    """The 16-lane register sum ``sum over s in [start, stop) of weights[s] *
    source[index[s], column:column + LANES]``, from +0.0, in ascending ``s``."""
    return _gathered_sums(builder, source, index, weights, start, stop, [column], format_name, vector_type)[0]


def _gathered_sums(builder, source, index, weights, start, stop, columns, format_name, vector_type):
    """:func:`_gathered_sum` at each of ``columns``, in one loop over ``s`` (independent sums
    side by side: the core overlaps their latencies)."""
    accumulators = []
    for _ in columns:
        accumulator = cgutils.alloca_once_value(builder, ir.Constant(vector_type, None))
        builder.store(ir.Constant(vector_type, None), accumulator)
        accumulators.append(accumulator)
    with cgutils.for_range_slice(builder, start, stop, _I64(1), inc=True) as (s, _):
        row = builder.load(builder.gep(index.data, [s]))
        weight = splat(builder, vector_type, builder.load(builder.gep(weights.data, [s])))
        for column, accumulator in zip(columns, accumulators):
            values = decode_lanes(builder, _element_pointer(builder, source, row, column), format_name, vector_type)
            builder.store(builder.fadd(builder.load(accumulator), builder.fmul(values, weight)), accumulator)
    return [builder.load(accumulator) for accumulator in accumulators]


def _transpose_registers(builder, rows):
    """The LANES x LANES transpose of LANES vectors: the four-stage shuffle network (stage
    ``d`` swaps the off-diagonal ``d x d`` blocks of every ``2d x 2d`` block: d = 8, 4, 2, 1)."""
    mask_type = ir.VectorType(_I32, LANES)
    rows = list(rows)
    distance = LANES // 2
    while distance >= 1:
        low = [j if j & distance == 0 else LANES + j - distance for j in range(LANES)]
        high = [j + distance if j & distance == 0 else LANES + j for j in range(LANES)]
        for i in range(LANES):
            if i & distance == 0:
                a, b = rows[i], rows[i + distance]
                rows[i] = builder.shuffle_vector(a, b, ir.Constant(mask_type, low))
                rows[i + distance] = builder.shuffle_vector(a, b, ir.Constant(mask_type, high))
        distance //= 2
    return rows


@intrinsic
def lanes_axpy(typingctx, destination, destination_row, destination_column, source, source_row, source_column,
               scale):
    """``destination[dr, dc:dc + LANES] += scale * source[sr, sc:sc + LANES]``."""
    sig = types.void(destination, types.intp, types.intp, source, types.intp, types.intp, destination.dtype)

    def codegen(context, builder, signature, args):
        dst, src = array_structs(context, builder, signature, args, 0, 3)
        vector = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        align = signature.args[0].dtype.bitwidth // 8
        dst_pointer = _vector_pointer(builder, dst, args[1], args[2], vector)
        src_pointer = _vector_pointer(builder, src, args[4], args[5], vector)
        product = builder.fmul(builder.load(src_pointer, align=align), splat(builder, vector, args[6]))
        builder.store(builder.fadd(builder.load(dst_pointer, align=align), product), dst_pointer, align=align)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def transpose_lanes(typingctx, destination, destination_row, destination_column, source, source_row,
                    source_column, fmt):
    """``destination[dr + j, dc + i] = encode(source[sr + i, sc + j])`` for ``i, j < LANES``.

    ``source`` holds compute-type values; ``destination`` holds StorageFormat ``fmt`` (each value
    rounded once, as ``store``; NATIVE: the source dtype). Sixteen vector loads, the register
    transpose, sixteen (encoded) vector stores.
    """
    if not _both_c_matrices(destination, source):
        return None
    sig = types.void(destination, types.intp, types.intp, source, types.intp, types.intp, fmt)
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        dst, src = array_structs(context, builder, signature, args, 0, 3)
        vector = ir.VectorType(context.get_data_type(signature.args[3].dtype), LANES)
        stored = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        rows = [builder.load(_vector_pointer(builder, src, builder.add(args[4], _I64(i)), args[5], vector),
                             align=signature.args[3].dtype.bitwidth // 8) for i in range(LANES)]
        rows = _transpose_registers(builder, rows)
        for j in range(LANES):
            pointer = _vector_pointer(builder, dst, builder.add(args[1], _I64(j)), args[2], stored)
            builder.store(encode_lanes(builder, rows[j], format_name), pointer,
                          align=signature.args[0].dtype.bitwidth // 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def decode_transpose_lanes(typingctx, destination, destination_row, destination_column, source, source_row,
                           source_column, count, fmt):
    """``destination[dr + j, dc + i] = decode(source[sr + i, sc + j])`` for ``i < LANES``,
    ``j < count`` (``count <= LANES``): LANES rows of ``count`` stored elements each (masked loads:
    nothing past them is read), the register transpose, ``count`` compute-type vector stores.

    ``source`` holds StorageFormat ``fmt``; ``destination`` the compute type.
    """
    if not _both_c_matrices(destination, source):
        return None
    sig = types.void(destination, types.intp, types.intp, source, types.intp, types.intp, types.intp, fmt)
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        dst, src = array_structs(context, builder, signature, args, 0, 3)
        vector = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        count = args[6]
        lane_numbers = ir.Constant(ir.VectorType(_I64, LANES), list(range(LANES)))
        used = builder.icmp_signed("<", lane_numbers, splat(builder, ir.VectorType(_I64, LANES), count))
        rows = [decode_lanes(builder, _element_pointer(builder, src, builder.add(args[4], _I64(i)), args[5]),
                             format_name, vector, used) for i in range(LANES)]
        align = signature.args[0].dtype.bitwidth // 8
        for j, column in enumerate(_transpose_registers(builder, rows)):
            with builder.if_then(builder.icmp_signed("<", _I64(j), count), likely=True):
                pointer = _vector_pointer(builder, dst, builder.add(args[1], _I64(j)), args[2], vector)
                builder.store(column, pointer, align=align)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def lanes_gather_sum(typingctx, destination, destination_row, destination_column, source, index, weights, start,
                     stop, source_column, fmt):
    """``destination[dr, dc:dc + LANES] = sum over s in [start, stop) of weights[s] *
    decode(source[index[s], sc:sc + LANES])``, from +0.0 in ascending ``s``, in a register.

    ``source`` holds elements in StorageFormat ``fmt``; ``destination`` and ``weights`` are of
    the compute type; ``index`` is int64.
    """
    sig = types.void(destination, types.intp, types.intp, source, index, weights, types.intp, types.intp,
                     types.intp, fmt)
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        dst, src, idx, wts = array_structs(context, builder, signature, args, 0, 3, 4, 5)
        vector = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        total = _gathered_sum(builder, src, idx, wts, args[6], args[7], args[8], format_name, vector)
        builder.store(total, _vector_pointer(builder, dst, args[1], args[2], vector),
                      align=signature.args[0].dtype.bitwidth // 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def gather_transpose_lanes(typingctx, destination, destination_row, destination_column, source, index, weights,
                           starts, first, count, source_column, fmt):
    """LANES gathered sums stored transposed, in registers all the way.

    For lane ``r < count``, ``v_r`` is the :func:`lanes_gather_sum` of the CSR list ``r`` (``s``
    in ``[starts[first + r], starts[first + r + 1])``); ``v_r = 0`` for ``r >= count``. Then
    ``destination[dr + j, dc + r] = v_r[j]`` for ``j, r < LANES``.
    """
    sig = types.void(destination, types.intp, types.intp, source, index, weights, starts, types.intp,
                     types.intp, types.intp, fmt)
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        dst, src, idx, wts, sts = array_structs(context, builder, signature, args, 0, 3, 4, 5, 6)
        vector = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        first, count = args[7], args[8]
        # One loop over the LANES lists, not LANES unrolled copies of it: the sums go through a
        # stack array (a few cycles per tile) and the kernels that use this compile several
        # times faster (Numba optimises and emits a parallel kernel's body four times).
        sums = cgutils.alloca_once(builder, ir.ArrayType(vector, LANES))
        with cgutils.for_range(builder, _I64(LANES)) as loop:
            r = loop.index
            # an unused lane sums the empty range [0, 0) and reads nothing of ``starts``
            start = cgutils.alloca_once_value(builder, _I64(0))
            stop = cgutils.alloca_once_value(builder, _I64(0))
            builder.store(_I64(0), start)
            builder.store(_I64(0), stop)
            with builder.if_then(builder.icmp_signed("<", r, count)):
                list_index = builder.add(first, r)
                builder.store(builder.load(builder.gep(sts.data, [list_index])), start)
                builder.store(builder.load(builder.gep(sts.data, [builder.add(list_index, _I64(1))])), stop)
            total = _gathered_sum(builder, src, idx, wts, builder.load(start), builder.load(stop), args[9],
                                  format_name, vector)
            builder.store(total, builder.gep(sums, [_I32(0), r]))
        rows = [builder.load(builder.gep(sums, [_I32(0), _I32(r)])) for r in range(LANES)]
        align = signature.args[0].dtype.bitwidth // 8
        for j, column in enumerate(_transpose_registers(builder, rows)):
            pointer = _vector_pointer(builder, dst, builder.add(args[1], _I64(j)), args[2], vector)
            builder.store(column, pointer, align=align)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def lanes_scaled_gather_sums(typingctx, destination, destination_row, destination_shift, source, index, weights,
                             start, stop, first_column, second_column, scale, fmt):
    """For each column ``c`` of ``first_column`` and ``second_column``:
    ``destination[dr, shift + c + j] = scale[0, c + j] * (sum over s in [start, stop) of
    weights[s] * decode(source[index[s], c + j]))`` for ``j < LANES``: :func:`lanes_gather_sum`
    (from +0.0, ascending ``s``), then one multiply by the matching elements of ``scale`` (a
    one-row matrix of the compute type). The two sums share one loop."""
    if not _both_c_matrices(destination, source, scale):
        return None
    sig = types.void(destination, types.intp, types.intp, source, index, weights, types.intp, types.intp,
                     types.intp, types.intp, scale, fmt)
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        dst, src, idx, wts, scl = array_structs(context, builder, signature, args, 0, 3, 4, 5, 10)
        vector = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        align = signature.args[0].dtype.bitwidth // 8
        columns = [args[8], args[9]]
        totals = _gathered_sums(builder, src, idx, wts, args[6], args[7], columns, format_name, vector)
        for column, total in zip(columns, totals):
            factors = builder.load(_vector_pointer(builder, scl, _I64(0), column, vector), align=align)
            builder.store(builder.fmul(factors, total),
                          _vector_pointer(builder, dst, args[1], builder.add(args[2], column), vector), align=align)
        return context.get_dummy_value()

    return sig, codegen


#: Runtime window counts up to this get straight-line code in :func:`lanes_scaled_window_sums` (pooling
#: overlap few times: counts of 1 and 2 are the common ones).
STRAIGHT_COUNTS = 3


def _zero_accumulators(builder, vector_type, count):
    accumulators = []
    for _ in range(count):
        accumulator = cgutils.alloca_once_value(builder, ir.Constant(vector_type, None))
        builder.store(ir.Constant(vector_type, None), accumulator)
        accumulators.append(accumulator)
    return accumulators


def _shifted_sum(builder, source, row, column, count, vector_type, align):
    """``0 + sum over i < count of source[row, column + i : column + i + LANES]``, adding ``i`` in
    ascending order, in a register (loads aligned to ``align`` bytes, the element size)."""
    accumulator, = _zero_accumulators(builder, vector_type, 1)
    with _loop(builder, count) as loop:
        pointer = _vector_pointer(builder, source, row, builder.add(column, loop.index), vector_type)
        builder.store(builder.fadd(builder.load(accumulator), builder.load(pointer, align=align)), accumulator)
    return builder.load(accumulator)


@contextlib.contextmanager
def _loop(builder, count):
    """``cgutils.for_range(builder, count)`` whose loop LLVM neither unrolls nor vectorises
    (``llvm.loop`` metadata on its latch). The loops of the row intrinsics run a few trips each
    (two chunks per A1 row); unrolled, each nest emitted four to five times its code, which the
    four LLVM copies of a parallel kernel then optimised again (compile time)."""
    with cgutils.for_range(builder, count) as loop:
        yield loop
    module = builder.module
    options = [module.add_metadata([ir.MetaDataString(module, "llvm.loop.unroll.disable")]),
               module.add_metadata([ir.MetaDataString(module, "llvm.loop.vectorize.enable"), _I1(0)])]
    # a loop ID is a distinct node whose first operand is itself
    loop_id = ir.values.MDValue(module, [], name=str(len(module.metadata)))
    loop_id.operands = (loop_id, *options)
    latch = loop.index.incomings[-1][1]
    latch.terminator.set_metadata("llvm.loop", loop_id)


def _outlined(builder, name, arrays, scalars, emit):
    """Call ``emit(builder, arrays, scalars)`` emitted as the body of its own function of the
    module (internal, never inlined; one per ``name``, which must tell the argument types apart),
    passing each array's data pointer and shape. A loop nest emitted inline into a large parallel
    kernel has its invariants spilled to the stack and reloaded in its inner loops (the
    kernel's own values take the registers); in its own function it gets the registers."""
    values = [part for array in arrays for part in (array.data, array.shape)] + list(scalars)
    module = builder.module
    function = module.globals.get(name)
    if function is None:
        function = ir.Function(module, ir.FunctionType(ir.VoidType(), [value.type for value in values]), name=name)
        function.linkage = "internal"
        function.attributes.add("noinline")
        inner = ir.IRBuilder(function.append_basic_block("entry"))
        parameters = list(function.args)
        proxies = [_ArrayParts(parameters[2 * i], parameters[2 * i + 1]) for i in range(len(arrays))]
        emit(inner, proxies, parameters[2 * len(arrays):])
        inner.ret_void()
    builder.call(function, values)


class _ArrayParts:
    """The two fields of an array struct the addressing helpers read."""

    def __init__(self, data, shape):
        self.data = data
        self.shape = shape


def _type_tag(*numba_types):
    """A symbol-safe tag of Numba types, for :func:`_outlined` names."""
    return "_".join("".join(c if c.isalnum() else "_" for c in str(t)) for t in numba_types)


def _cyclic_counter(builder, start, period):
    """An i64 loop-carried counter from ``start`` (``0 <= start < period``) and its
    ``advance()``, which adds 1 and wraps at ``period`` to 0, returning whether it wrapped."""
    counter = cgutils.alloca_once_value(builder, start)

    def advance():
        value = builder.add(builder.load(counter), _I64(1))
        wrapped = builder.icmp_signed("==", value, period)
        builder.store(builder.select(wrapped, _I64(0), value), counter)
        return wrapped

    return counter, advance


@intrinsic
def lanes_scaled_window_sums(typingctx, destination, destination_column, destination_step, source, window_first,
                             window_stop, first_row, source_offset, period, rows, width, scale):
    """The height pass of pooling rows: with ``H = len(window_first)``, row ``r < rows`` is the
    input row ``h = (first_row + r) % H`` of plane ``k = (first_row + r) // H`` (``0 <= first_row
    < H``), which lies in the windows ``[window_first[h], window_stop[h])`` (int64 tables),
    stored at the source rows ``source_offset + k * period + window``. Then
    ``destination[0, dc + r * step + c] = scale[0, c] * (0 + sum of those source rows' [c])`` for
    ``c < width`` (``width >= LANES``), adding the rows in ascending order in registers, LANES
    columns at a time (the last vector starts at ``width - LANES`` and recomputes the same
    values). Compute type throughout; straight-line code for up to :data:`STRAIGHT_COUNTS`
    windows."""
    if not _both_c_matrices(destination, source, scale):
        return None
    sig = types.void(destination, types.intp, types.intp, source, window_first, window_stop, types.intp, types.intp,
                     types.intp, types.intp, types.intp, scale)

    def codegen(context, builder, signature, args):
        arrays = array_structs(context, builder, signature, args, 0, 3, 4, 5, 11)
        vector = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        align = signature.args[0].dtype.bitwidth // 8
        name = "fastbwd_window_sums_" + _type_tag(signature.args[0], signature.args[3], signature.args[11])
        _outlined(builder, name, arrays, [args[i] for i in (1, 2, 6, 7, 8, 9, 10)],
                  lambda builder, arrays, scalars: _window_sums(builder, *arrays, *scalars, vector, align))
        return context.get_dummy_value()

    return sig, codegen


def _window_sums(builder, dst, src, firsts, stops, scl, destination_column, destination_step, first_row, source_offset,
                 period, rows, width, vector, align):
    """The loop nest of :func:`lanes_scaled_window_sums`."""
    height = cgutils.unpack_tuple(builder, firsts.shape, 1)[0]
    last = builder.sub(width, _I64(LANES))
    chunks = builder.sdiv(builder.add(width, _I64(LANES - 1)), _I64(LANES))
    h, advance = _cyclic_counter(builder, first_row, height)
    offset = cgutils.alloca_once_value(builder, source_offset)
    with _loop(builder, rows) as row_loop:
        r = row_loop.index
        row = builder.load(h)
        window = builder.load(builder.gep(firsts.data, [row]))
        start = builder.add(builder.load(offset), window)
        count = builder.sub(builder.load(builder.gep(stops.data, [row])), window)
        at = builder.add(destination_column, builder.mul(r, destination_step))

        def emit(fixed):
            with _loop(builder, chunks) as chunk_loop:
                column = builder.mul(chunk_loop.index, _I64(LANES))
                column = builder.select(builder.icmp_signed("<", column, last), column, last)
                if fixed is None:
                    accumulator, = _zero_accumulators(builder, vector, 1)
                    with _loop(builder, count) as loop:
                        pointer = _vector_pointer(builder, src, builder.add(start, loop.index), column, vector)
                        builder.store(builder.fadd(builder.load(accumulator), builder.load(pointer, align=align)),
                                      accumulator)
                    total = builder.load(accumulator)
                else:
                    total = ir.Constant(vector, None)
                    for i in range(fixed):
                        pointer = _vector_pointer(builder, src, builder.add(start, _I64(i)), column, vector)
                        total = builder.fadd(total, builder.load(pointer, align=align))
                factors = builder.load(_vector_pointer(builder, scl, _I64(0), column, vector), align=align)
                builder.store(builder.fmul(factors, total),
                              _vector_pointer(builder, dst, _I64(0), builder.add(at, column), vector), align=align)

        done = builder.append_basic_block("sums.done")
        larger = builder.append_basic_block("sums.loop")
        switch = builder.switch(count, larger)
        for n in range(1, STRAIGHT_COUNTS + 1):
            block = builder.append_basic_block(f"sums.{n}")
            switch.add_case(_I64(n), block)
            builder.position_at_end(block)
            emit(n)
            builder.branch(done)
        builder.position_at_end(larger)
        emit(None)
        builder.branch(done)
        builder.position_at_end(done)
        wrapped = advance()
        builder.store(builder.select(wrapped, builder.add(builder.load(offset), period), builder.load(offset)), offset)


@intrinsic
def lanes_scaled_rows(typingctx, destination, source, source_first, rows, width, factors, first_factor, fmt):
    """``destination[g, c] = decode(source[source_first + g, c]) * factors[(first_factor + g) %
    len(factors)]`` for ``g < rows``, ``c < width`` (``width >= LANES``, ``0 <= first_factor <
    len(factors)``), LANES columns at a time (the last vector starts at ``width - LANES``): the
    multiplies of :func:`lanes_gather_sum`'s terms, on their own. ``source`` in StorageFormat
    ``fmt``; ``destination`` and ``factors`` of the compute type."""
    if not _both_c_matrices(destination, source):
        return None
    sig = types.void(destination, source, types.intp, types.intp, types.intp, factors, types.intp, fmt)
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        dst, src, fct = array_structs(context, builder, signature, args, 0, 1, 5)
        vector = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        align = signature.args[0].dtype.bitwidth // 8
        width = args[4]
        last = builder.sub(width, _I64(LANES))
        chunks = builder.sdiv(builder.add(width, _I64(LANES - 1)), _I64(LANES))
        period = cgutils.unpack_tuple(builder, fct.shape, 1)[0]
        index, advance = _cyclic_counter(builder, args[6], period)
        with _loop(builder, args[3]) as row_loop:
            g = row_loop.index
            factor = splat(builder, vector, builder.load(builder.gep(fct.data, [builder.load(index)])))
            source_row = builder.add(args[2], g)
            with _loop(builder, chunks) as loop:
                column = builder.mul(loop.index, _I64(LANES))
                column = builder.select(builder.icmp_signed("<", column, last), column, last)
                values = decode_lanes(builder, _element_pointer(builder, src, source_row, column), format_name, vector)
                builder.store(builder.fmul(values, factor), _vector_pointer(builder, dst, g, column, vector),
                              align=align)
            advance()
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def lanes_shifted_sum(typingctx, destination, destination_row, destination_column, source, source_row,
                      source_column, count):
    """``destination[dr, dc + j] = 0 + sum over i < count of source[sr, sc + i + j]`` for
    ``j < LANES``, adding ``i`` in ascending order (``count`` shifted vectors of one row, in a
    register; both of the compute type)."""
    if not _both_c_matrices(destination, source):
        return None
    sig = types.void(destination, types.intp, types.intp, source, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        dst, src = array_structs(context, builder, signature, args, 0, 3)
        vector = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        total = _shifted_sum(builder, src, args[4], args[5], args[6], vector, signature.args[0].dtype.bitwidth // 8)
        builder.store(total, _vector_pointer(builder, dst, args[1], args[2], vector),
                      align=signature.args[0].dtype.bitwidth // 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def interleaved_shifted_sums(typingctx, destination, destination_row, destination_column, source, even_column,
                             even_count, odd_column, odd_count, fmt):
    """Two :func:`lanes_shifted_sum` of row 0 of ``source`` (compute type), ``even`` from
    ``even_column`` over ``even_count`` shifts and ``odd`` from ``odd_column`` over ``odd_count``,
    interleaved and stored in StorageFormat ``fmt`` (each value rounded once, as ``store``):
    ``destination[dr, dc + 2 j] = even[j]``, ``destination[dr, dc + 2 j + 1] = odd[j]`` for
    ``j < LANES`` (2 LANES elements), in registers all the way."""
    if not _both_c_matrices(destination, source):
        return None
    sig = types.void(destination, types.intp, types.intp, source, types.intp, types.intp, types.intp, types.intp,
                     fmt)
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        dst, src = array_structs(context, builder, signature, args, 0, 3)
        vector = ir.VectorType(context.get_data_type(signature.args[3].dtype), LANES)
        stored = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        align = signature.args[3].dtype.bitwidth // 8
        even = _shifted_sum(builder, src, _I64(0), args[4], args[5], vector, align)
        odd = _shifted_sum(builder, src, _I64(0), args[6], args[7], vector, align)
        _store_interleaved(builder, dst, args[1], args[2], even, odd, format_name, stored,
                           signature.args[0].dtype.bitwidth // 8)
        return context.get_dummy_value()

    return sig, codegen


def _store_interleaved(builder, destination, row, column, even, odd, format_name, stored_type, align):
    """``destination[row, column + 2 j] = encode(even[j])``, ``... + 2 j + 1] = encode(odd[j])``."""
    mask_type = ir.VectorType(_I32, LANES)
    for half in range(2):
        lanes = [half * LANES // 2 + j // 2 + (LANES if j % 2 else 0) for j in range(LANES)]
        pair = builder.shuffle_vector(even, odd, ir.Constant(mask_type, lanes))
        pointer = _vector_pointer(builder, destination, row, builder.add(column, _I64(half * LANES)), stored_type)
        builder.store(encode_lanes(builder, pair, format_name), pointer, align=align)


#: The (even, odd) shift counts :func:`interleaved_shifted_rows` has straight-line loops for
#: (stride-2 windows of 2 to 4 cells); other counts run the generic loop.
INTERLEAVED_STRAIGHT = ((1, 1), (1, 2), (2, 1), (2, 2))


@intrinsic
def interleaved_shifted_rows(typingctx, destination, destination_column, destination_step, source, source_column,
                             source_step, rows, chunks, even_offset, even_count, odd_offset, odd_count, fmt):
    """:func:`interleaved_shifted_sums` over a block of rows of one-row matrices: for ``r < rows``
    and ``j < chunks``, the sums of ``source[0, source_column + r * source_step + LANES j + offset
    + i]`` (``i`` below the count, even and odd) stored interleaved at ``destination[0,
    destination_column + r * destination_step + 2 LANES j]``. The loop nest is emitted once per
    count pair of :data:`INTERLEAVED_STRAIGHT`, with straight-line sums (the counts are the same
    for every row), and once with loops for any other counts: the same operations either way."""
    if not _both_c_matrices(destination, source):
        return None
    sig = types.void(destination, types.intp, types.intp, source, types.intp, types.intp, types.intp, types.intp,
                     types.intp, types.intp, types.intp, types.intp, fmt)
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        arrays = array_structs(context, builder, signature, args, 0, 3)
        vector = ir.VectorType(context.get_data_type(signature.args[3].dtype), LANES)
        stored = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        name = "fastbwd_interleaved_rows_" + _type_tag(signature.args[0], signature.args[3], signature.args[12])
        _outlined(builder, name, arrays, args[1:3] + args[4:12],
                  lambda builder, arrays, scalars: _interleaved_rows(
                      builder, *arrays, *scalars, format_name, vector, stored, signature.args[3].dtype.bitwidth // 8,
                      signature.args[0].dtype.bitwidth // 8))
        return context.get_dummy_value()

    return sig, codegen


def _interleaved_rows(builder, dst, src, dst_column, dst_step, src_column, src_step, rows, chunks, even_offset,
                      even_count, odd_offset, odd_count, format_name, vector, stored, align, stored_align):
    """The loop nests of :func:`interleaved_shifted_rows`."""

    def fixed_sum(column, count):
        total = ir.Constant(vector, None)
        for i in range(count):
            pointer = _vector_pointer(builder, src, _I64(0), builder.add(column, _I64(i)), vector)
            total = builder.fadd(total, builder.load(pointer, align=align))
        return total

    def loop_nest(counts):
        with _loop(builder, rows) as row_loop:
            r = row_loop.index
            src_row = builder.add(src_column, builder.mul(r, src_step))
            dst_row = builder.add(dst_column, builder.mul(r, dst_step))
            with _loop(builder, chunks) as chunk_loop:
                j = chunk_loop.index
                at = builder.add(src_row, builder.mul(j, _I64(LANES)))
                even_at, odd_at = builder.add(at, even_offset), builder.add(at, odd_offset)
                if counts is None:
                    even = _shifted_sum(builder, src, _I64(0), even_at, even_count, vector, align)
                    odd = _shifted_sum(builder, src, _I64(0), odd_at, odd_count, vector, align)
                else:
                    even, odd = fixed_sum(even_at, counts[0]), fixed_sum(odd_at, counts[1])
                _store_interleaved(builder, dst, _I64(0), builder.add(dst_row, builder.mul(j, _I64(2 * LANES))),
                                   even, odd, format_name, stored, stored_align)

    small = builder.and_(builder.icmp_unsigned("<", even_count, _I64(4)),
                         builder.icmp_unsigned("<", odd_count, _I64(4)))
    key = builder.select(small, builder.add(builder.mul(even_count, _I64(4)), odd_count), _I64(-1))
    done = builder.append_basic_block("interleaved.done")
    generic = builder.append_basic_block("interleaved.generic")
    switch = builder.switch(key, generic)
    for counts in INTERLEAVED_STRAIGHT:
        block = builder.append_basic_block(f"interleaved.{counts[0]}.{counts[1]}")
        switch.add_case(_I64(counts[0] * 4 + counts[1]), block)
        builder.position_at_end(block)
        loop_nest(counts)
        builder.branch(done)
    builder.position_at_end(generic)
    loop_nest(None)
    builder.branch(done)
    builder.position_at_end(done)


def _prefetch_codegen(for_write):
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_pointer = ir.IntType(8).as_pointer()
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, _I32, _I32, _I32]), "llvm.prefetch.p0i8")
        # read or write access, highest temporal locality (all cache levels), data cache
        builder.call(function, [builder.bitcast(builder.gep(data, [args[1]]), byte_pointer), _I32(int(for_write)),
                                _I32(3), _I32(1)])
        return context.get_dummy_value()

    return codegen


@intrinsic
def prefetch(typingctx, array, index):
    """Ask for the cache line holding ``array.ravel()[index]`` (C-contiguous ``array``) to be
    loaded into the cache ahead of a read (``llvm.prefetch``: a hint that never faults and
    changes no value)."""
    if not isinstance(array, types.Array):
        return None
    return types.void(array, types.intp), _prefetch_codegen(False)


@intrinsic
def prefetch_for_write(typingctx, array, index):
    """:func:`prefetch` ahead of a write: the line arrives ready to be modified."""
    if not isinstance(array, types.Array):
        return None
    return types.void(array, types.intp), _prefetch_codegen(True)


# ---- streaming (non-temporal) stores ------------------------------------------------------------

#: Bytes of one cache line: the unit a streaming store writes.
LINE_BYTES = 64


@intrinsic
def line_offset(typingctx, array, index):
    """The byte offset of ``array.ravel()[index]`` (C-contiguous ``array``) inside its 64-byte
    cache line: ``address % LINE_BYTES``."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        address = builder.ptrtoint(builder.gep(data, [args[1]]), _I64)
        return builder.and_(address, _I64(LINE_BYTES - 1))

    return types.intp(array, types.intp), codegen


def _line_copy_codegen(nontemporal):
    def codegen(context, builder, signature, args):
        dst, src = array_structs(context, builder, signature, args, 0, 2)
        line = ir.VectorType(_I32, LINE_BYTES // 4)
        source_pointer = builder.bitcast(builder.gep(src.data, [args[3]]), line.as_pointer())
        destination_pointer = builder.bitcast(builder.gep(dst.data, [args[1]]), line.as_pointer())
        values = builder.load(source_pointer, align=1)
        if nontemporal:
            store = builder.store(values, destination_pointer, align=LINE_BYTES)
            store.set_metadata("nontemporal", builder.module.add_metadata([_I32(1)]))
        else:
            builder.store(values, destination_pointer, align=1)
        return context.get_dummy_value()

    return codegen


@intrinsic
def copy_line(typingctx, destination, destination_index, source, source_index):
    """Copy the 64 bytes from ``source.ravel()[source_index]`` on to
    ``destination.ravel()[destination_index]`` on (C-contiguous arrays of one element type, any
    alignment; the bytes are copied unchanged)."""
    if not (isinstance(destination, types.Array) and isinstance(source, types.Array)):
        return None
    return types.void(destination, types.intp, source, types.intp), _line_copy_codegen(False)


@intrinsic
def stream_line(typingctx, destination, destination_index, source, source_index):
    """:func:`copy_line` with a non-temporal store, to a destination that must start a cache
    line: the line goes to memory without being read into the cache first (a plain store reads
    it) and without evicting what the caches hold. Other threads are guaranteed to see it only
    after a :func:`store_fence`."""
    if not (isinstance(destination, types.Array) and isinstance(source, types.Array)):
        return None
    return types.void(destination, types.intp, source, types.intp), _line_copy_codegen(True)


@intrinsic
def stream_line_with_ends(typingctx, destination, destination_index, source, source_index, next_source_index, split,
                          first_lane, first_value, last_lane, last_value):
    """:func:`stream_line` of a line built in registers from two runs of the source and two
    single cells: lane ``i`` (the destination's cell ``destination_index + i``) holds
    ``source.ravel()[source_index + i]`` for ``i < split`` and ``source.ravel()[next_source_index +
    i]`` from ``split`` on, except that lane ``first_lane`` holds ``first_value`` and lane
    ``last_lane`` holds ``last_value`` (values of the destination's element type, stored bit for
    bit; a lane outside ``[0, cells per line)`` replaces nothing; the last value wins if both name
    one lane). Both source runs are read whole (a line's cells from each), so both must lie in
    ``source``. One line of a replication pad's rows: the copied cells of one row, or of the end
    of one row and the start of the next, with the rows' summed edge cells put in. Built in
    registers before its one streaming store: a line assembled in memory would make its reload
    wait for the stores that built it."""
    if not (isinstance(destination, types.Array) and isinstance(source, types.Array)
            and destination.dtype.bitwidth == source.dtype.bitwidth
            and first_value == destination.dtype and last_value == destination.dtype):
        return None
    bits = destination.dtype.bitwidth

    def codegen(context, builder, signature, args):
        dst, src = array_structs(context, builder, signature, args, 0, 2)
        cell = ir.IntType(bits)
        line = ir.VectorType(cell, LINE_BYTES * 8 // bits)
        lanes = ir.Constant(ir.VectorType(_I64, line.count), [_I64(i) for i in range(line.count)])

        def run_at(index):
            return builder.load(builder.bitcast(builder.gep(src.data, [index]), line.as_pointer()), align=1)

        values = builder.select(builder.icmp_signed("<", lanes, splat(builder, lanes.type, args[5])), run_at(args[3]),
                                run_at(args[4]))
        for lane, value in ((args[6], args[7]), (args[8], args[9])):
            # the value's bits as an integer (a complex value is a pair: through a stack slot)
            cell_bits = builder.load(builder.bitcast(cgutils.alloca_once_value(builder, value), cell.as_pointer()))
            chosen = builder.icmp_signed("==", lanes, splat(builder, lanes.type, lane))
            values = builder.select(chosen, splat(builder, line, cell_bits), values)
        pointer = builder.bitcast(builder.gep(dst.data, [args[1]]), line.as_pointer())
        store = builder.store(values, pointer, align=LINE_BYTES)
        store.set_metadata("nontemporal", builder.module.add_metadata([_I32(1)]))
        return context.get_dummy_value()

    return types.void(destination, types.intp, source, types.intp, types.intp, types.intp, types.intp, first_value,
                      types.intp, last_value), codegen


@intrinsic
def store_fence(typingctx):
    """A full memory fence: every store issued before it, streaming ones included, is visible
    to other threads before any memory access after it."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def cells_per_line(typingctx, array):
    """Elements of ``array``'s type in one cache line (``LINE_BYTES // itemsize``), a constant
    of the compiled code (``array.itemsize`` is read at run time, so dividing by it divides)."""
    if not isinstance(array, types.Array):
        return None
    cells = LINE_BYTES // (array.dtype.bitwidth // 8)

    def codegen(context, builder, signature, args):
        return context.get_constant(types.intp, cells)

    return types.intp(array), codegen


@intrinsic
def copy_part_line(typingctx, destination, destination_index, source, source_index, count):
    """Copy ``count`` elements from ``source.ravel()[source_index]`` on to
    ``destination.ravel()[destination_index]`` on, fewer than a cache line's bytes (C-contiguous
    arrays of one element type, any alignment; the bytes are copied unchanged). Two loads and two
    plain stores of the largest power-of-two size that fits, the second ending at the range's
    end (they overlap unless it is exactly twice that size; the overlap is written twice with the
    same bytes): a few instructions where a loop of element copies costs a dozen per element."""
    if not (isinstance(destination, types.Array) and isinstance(source, types.Array)
            and destination.dtype.bitwidth == source.dtype.bitwidth):
        return None
    itemsize = destination.dtype.bitwidth // 8

    def codegen(context, builder, signature, args):
        dst, src = array_structs(context, builder, signature, args, 0, 2)
        bytes_pointer = ir.IntType(8).as_pointer()
        source_bytes = builder.bitcast(builder.gep(src.data, [args[3]]), bytes_pointer)
        destination_bytes = builder.bitcast(builder.gep(dst.data, [args[1]]), bytes_pointer)
        length = builder.mul(args[4], _I64(itemsize))
        done = builder.append_basic_block("part_line.done")
        size = LINE_BYTES // 2
        while size >= itemsize:
            # 32 and 16 bytes as vectors (one ymm / xmm move), smaller sizes as integers
            moved = ir.VectorType(_I32, size // 4) if size >= 16 else ir.IntType(8 * size)
            this_size = builder.append_basic_block(f"part_line.{size}")
            smaller = builder.append_basic_block(f"part_line.below{size}")
            builder.cbranch(builder.icmp_signed(">=", length, _I64(size)), this_size, smaller)
            builder.position_at_end(this_size)
            last = builder.sub(length, _I64(size))
            pointers = [builder.bitcast(builder.gep(base, [at]), moved.as_pointer())
                        for base in (source_bytes, destination_bytes) for at in (_I64(0), last)]
            head, tail = (builder.load(pointer, align=1) for pointer in pointers[:2])
            builder.store(head, pointers[2], align=1)
            builder.store(tail, pointers[3], align=1)
            builder.branch(done)
            builder.position_at_end(smaller)
            size //= 2
        builder.branch(done)  # nothing left: 0 elements
        builder.position_at_end(done)
        return context.get_dummy_value()

    return types.void(destination, types.intp, source, types.intp, types.intp), codegen


#: Outputs of at least this many bytes are written with streaming stores (:func:`copy_out`): a
#: result larger than the last-level cache would be evicted from it anyway, and a streaming
#: store spares the read of each line that a plain store makes (a third of a copy's traffic).
#: Smaller results are stored normally, so that they are still in the cache when read next.
STREAM_MIN_BYTES = 16 << 20
#: Cache lines :func:`copy_out` copies per trip of its main loop.
COPY_UNROLL = 4


@leaf_helper
def copy_out(destination, first, source, source_first, count, streaming):
    """``destination[first:first + count] = source[source_first:source_first + count]`` (1-D
    C-contiguous arrays of one element type; the values are copied unchanged), a cache line at
    a time. With ``streaming``, the destination's whole cache lines are written with
    :func:`stream_line` and the partial lines at both ends with plain stores (all of them when
    the destination is not aligned to its element size); a kernel calls :func:`store_fence`
    after its task's last ``copy_out``. A source in the cache: :func:`copy_out_reading_ahead`
    for one read from memory."""
    copy_out_reading_ahead(destination, first, source, source_first, count, streaming, 0)


@leaf_helper
def copy_out_reading_ahead(destination, first, source, source_first, count, streaming, read_ahead):
    """:func:`copy_out`, asking for the source's line ``read_ahead`` elements further on with
    each line copied (:func:`prefetch`; none when 0). A streamed copy from memory needs it: with
    the destination's reads gone, the hardware's own prefetching no longer keeps the reads up."""
    per_line = cells_per_line(destination)
    itemsize = LINE_BYTES // per_line
    done = 0
    offset = line_offset(destination, first)
    if streaming and offset % itemsize == 0:
        done = min(count, (LINE_BYTES - offset) % LINE_BYTES // itemsize)
        copy_part_line(destination, first, source, source_first, done)
        while done + COPY_UNROLL * per_line <= count:  # a few lines per loop trip: fewer branches
            for j in range(COPY_UNROLL):
                if read_ahead > 0:
                    prefetch(source, source_first + done + j * per_line + read_ahead)
                stream_line(destination, first + done + j * per_line, source, source_first + done + j * per_line)
            done += COPY_UNROLL * per_line
        while done + per_line <= count:
            if read_ahead > 0:
                prefetch(source, source_first + done + read_ahead)
            stream_line(destination, first + done, source, source_first + done)
            done += per_line
    else:
        while done + COPY_UNROLL * per_line <= count:
            for j in range(COPY_UNROLL):
                copy_line(destination, first + done + j * per_line, source, source_first + done + j * per_line)
            done += COPY_UNROLL * per_line
        while done + per_line <= count:
            copy_line(destination, first + done, source, source_first + done)
            done += per_line
    copy_part_line(destination, first + done, source, source_first + done, count - done)
