"""avg-pool's whole-row intrinsics (module doc of ``_lanes``): window sums and scaled rows over
whole grad_output rows, outlined per fixed count, and the interleaved shifted rows of stride 2."""

import contextlib

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._halfbits import one_nan_ir
from ._lanes import (
    _I32,
    _I64,
    LANES,
    _both_c_matrices,
    _element_pointer,
    _vector_pointer,
    array_structs,
    decode_lanes,
    encode_lanes,
    no_unroll,
    splat,
)

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
    (accumulator,) = _zero_accumulators(builder, vector_type, 1)
    with _loop(builder, count) as loop:
        pointer = _vector_pointer(builder, source, row, builder.add(column, loop.index), vector_type)
        builder.store(builder.fadd(builder.load(accumulator), builder.load(pointer, align=align)), accumulator)
    return builder.load(accumulator)


@contextlib.contextmanager
def _loop(builder, count):
    """``cgutils.for_range(builder, count)`` whose loop LLVM neither unrolls nor vectorises
    (``llvm.loop`` metadata on its latch). The loops of the row intrinsics run a few trips each
    (a few chunks per row); unrolled, each nest emitted several times its code, which the four
    LLVM copies of a parallel kernel then optimise again (compile time)."""
    with cgutils.for_range(builder, count) as loop:
        yield loop
    no_unroll(builder, loop)


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
        emit(inner, proxies, parameters[2 * len(arrays) :])
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
def lanes_scaled_window_sums(
    typingctx,
    destination,
    destination_column,
    destination_step,
    source,
    window_first,
    window_stop,
    first_row,
    source_offset,
    period,
    rows,
    width,
    scale,
):
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
    sig = types.void(
        destination,
        types.intp,
        types.intp,
        source,
        window_first,
        window_stop,
        types.intp,
        types.intp,
        types.intp,
        types.intp,
        types.intp,
        scale,
    )

    def codegen(context, builder, signature, args):
        arrays = array_structs(context, builder, signature, args, 0, 3, 4, 5, 11)
        vector = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        align = signature.args[0].dtype.bitwidth // 8
        name = "fastbwd_window_sums_" + _type_tag(signature.args[0], signature.args[3], signature.args[11])
        _outlined(
            builder,
            name,
            arrays,
            [args[i] for i in (1, 2, 6, 7, 8, 9, 10)],
            lambda builder, arrays, scalars: _window_sums(builder, *arrays, *scalars, vector, align),
        )
        return context.get_dummy_value()

    return sig, codegen


def _window_sums(
    builder,
    dst,
    src,
    firsts,
    stops,
    scl,
    destination_column,
    destination_step,
    first_row,
    source_offset,
    period,
    rows,
    width,
    vector,
    align,
):
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
                    (accumulator,) = _zero_accumulators(builder, vector, 1)
                    with _loop(builder, count) as loop:
                        pointer = _vector_pointer(builder, src, builder.add(start, loop.index), column, vector)
                        builder.store(
                            builder.fadd(builder.load(accumulator), builder.load(pointer, align=align)), accumulator
                        )
                    total = builder.load(accumulator)
                else:
                    total = ir.Constant(vector, None)
                    for i in range(fixed):
                        pointer = _vector_pointer(builder, src, builder.add(start, _I64(i)), column, vector)
                        total = builder.fadd(total, builder.load(pointer, align=align))
                factors = builder.load(_vector_pointer(builder, scl, _I64(0), column, vector), align=align)
                builder.store(
                    builder.fmul(factors, total),
                    _vector_pointer(builder, dst, _I64(0), builder.add(at, column), vector),
                    align=align,
                )

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
                builder.store(
                    builder.fmul(values, factor), _vector_pointer(builder, dst, g, column, vector), align=align
                )
            advance()
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def lanes_shifted_sum(
    typingctx, destination, destination_row, destination_column, source, source_row, source_column, count
):
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
        builder.store(
            total, _vector_pointer(builder, dst, args[1], args[2], vector), align=signature.args[0].dtype.bitwidth // 8
        )
        return context.get_dummy_value()

    return sig, codegen


def _store_interleaved(builder, destination, row, column, even, odd, format_name, stored_type, align):
    """``destination[row, column + 2 j] = encode(even[j])``, ``... + 2 j + 1] = encode(odd[j])``,
    each NaN as the one NaN (``_halfbits.one_nan_ir``: they are sums)."""
    mask_type = ir.VectorType(_I32, LANES)
    even, odd = one_nan_ir(builder, even), one_nan_ir(builder, odd)
    for half in range(2):
        lanes = [half * LANES // 2 + j // 2 + (LANES if j % 2 else 0) for j in range(LANES)]
        pair = builder.shuffle_vector(even, odd, ir.Constant(mask_type, lanes))
        pointer = _vector_pointer(builder, destination, row, builder.add(column, _I64(half * LANES)), stored_type)
        builder.store(encode_lanes(builder, pair, format_name), pointer, align=align)


#: The (even, odd) shift counts :func:`interleaved_shifted_rows` has straight-line loops for
#: (stride-2 windows of 2 to 4 cells); other counts run the generic loop.
INTERLEAVED_STRAIGHT = ((1, 1), (1, 2), (2, 1), (2, 2))


@intrinsic
def interleaved_shifted_rows(
    typingctx,
    destination,
    destination_column,
    destination_step,
    source,
    source_column,
    source_step,
    rows,
    chunks,
    even_offset,
    even_count,
    odd_offset,
    odd_count,
    fmt,
):
    """Two :func:`lanes_shifted_sum` per vector, interleaved, over a block of rows of one-row
    matrices (compute-type ``source``, ``destination`` in StorageFormat ``fmt``, each value rounded
    once, as ``store``): for ``r < rows`` and ``j < chunks``, the sums of ``source[0,
    source_column + r * source_step + LANES j + offset + i]`` (``i`` below the count, even and
    odd) stored interleaved (even at ``2 j``, odd at ``2 j + 1``) at ``destination[0,
    destination_column + r * destination_step + 2 LANES j]``. The loop nest is emitted once per
    count pair of :data:`INTERLEAVED_STRAIGHT`, with straight-line sums (the counts are the same
    for every row), and once with loops for any other counts: the same operations either way."""
    if not _both_c_matrices(destination, source):
        return None
    sig = types.void(
        destination,
        types.intp,
        types.intp,
        source,
        types.intp,
        types.intp,
        types.intp,
        types.intp,
        types.intp,
        types.intp,
        types.intp,
        types.intp,
        fmt,
    )
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        arrays = array_structs(context, builder, signature, args, 0, 3)
        vector = ir.VectorType(context.get_data_type(signature.args[3].dtype), LANES)
        stored = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        name = "fastbwd_interleaved_rows_" + _type_tag(signature.args[0], signature.args[3], signature.args[12])
        _outlined(
            builder,
            name,
            arrays,
            args[1:3] + args[4:12],
            lambda builder, arrays, scalars: _interleaved_rows(
                builder,
                *arrays,
                *scalars,
                format_name,
                vector,
                stored,
                signature.args[3].dtype.bitwidth // 8,
                signature.args[0].dtype.bitwidth // 8,
            ),
        )
        return context.get_dummy_value()

    return sig, codegen


def _interleaved_rows(
    builder,
    dst,
    src,
    dst_column,
    dst_step,
    src_column,
    src_step,
    rows,
    chunks,
    even_offset,
    even_count,
    odd_offset,
    odd_count,
    format_name,
    vector,
    stored,
    align,
    stored_align,
):
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
                _store_interleaved(
                    builder,
                    dst,
                    _I64(0),
                    builder.add(dst_row, builder.mul(j, _I64(2 * LANES))),
                    even,
                    odd,
                    format_name,
                    stored,
                    stored_align,
                )

    small = builder.and_(
        builder.icmp_unsigned("<", even_count, _I64(4)), builder.icmp_unsigned("<", odd_count, _I64(4))
    )
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
