"""Memory traffic of the kernels: prefetch hints, cache-line copies, streaming (non-temporal)
stores and their fence, and :func:`copy_out`, which writes a result with them.

A result larger than the last-level cache is written with streaming stores (from
:data:`STREAM_MIN_BYTES` on): each whole cache line goes to memory without being read into the
cache first. The bytes are copied unchanged, so the choice never changes a result
(docs/design.md).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

from ._jit import leaf_helper
from ._lanes import array_structs, splat

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


# ---- prefetch -----------------------------------------------------------------------------------


def _prefetch_codegen(for_write):
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_pointer = ir.IntType(8).as_pointer()
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, _I32, _I32, _I32]), "llvm.prefetch.p0i8"
        )
        # read or write access, highest temporal locality (all cache levels), data cache
        builder.call(
            function,
            [builder.bitcast(builder.gep(data, [args[1]]), byte_pointer), _I32(int(for_write)), _I32(3), _I32(1)],
        )
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
def stream_line_with_ends(
    typingctx,
    destination,
    destination_index,
    source,
    source_index,
    next_source_index,
    split,
    first_lane,
    first_value,
    last_lane,
    last_value,
):
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
    if not (
        isinstance(destination, types.Array)
        and isinstance(source, types.Array)
        and destination.dtype.bitwidth == source.dtype.bitwidth
        and first_value == destination.dtype
        and last_value == destination.dtype
    ):
        return None
    bits = destination.dtype.bitwidth

    def codegen(context, builder, signature, args):
        dst, src = array_structs(context, builder, signature, args, 0, 2)
        cell = ir.IntType(bits)
        line = ir.VectorType(cell, LINE_BYTES * 8 // bits)
        lanes = ir.Constant(ir.VectorType(_I64, line.count), [_I64(i) for i in range(line.count)])

        def run_at(index):
            return builder.load(builder.bitcast(builder.gep(src.data, [index]), line.as_pointer()), align=1)

        values = builder.select(
            builder.icmp_signed("<", lanes, splat(builder, lanes.type, args[5])), run_at(args[3]), run_at(args[4])
        )
        for lane, value in ((args[6], args[7]), (args[8], args[9])):
            # the value's bits as an integer (a complex value is a pair: through a stack slot)
            cell_bits = builder.load(builder.bitcast(cgutils.alloca_once_value(builder, value), cell.as_pointer()))
            chosen = builder.icmp_signed("==", lanes, splat(builder, lanes.type, lane))
            values = builder.select(chosen, splat(builder, line, cell_bits), values)
        pointer = builder.bitcast(builder.gep(dst.data, [args[1]]), line.as_pointer())
        store = builder.store(values, pointer, align=LINE_BYTES)
        store.set_metadata("nontemporal", builder.module.add_metadata([_I32(1)]))
        return context.get_dummy_value()

    return types.void(
        destination,
        types.intp,
        source,
        types.intp,
        types.intp,
        types.intp,
        types.intp,
        first_value,
        types.intp,
        last_value,
    ), codegen


@intrinsic
def store_fence(typingctx):
    """A full memory fence: every store issued before it, streaming ones included, is visible
    to other threads before any memory access after it."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def flat_rows(typingctx, array, first, stop):
    """``array[first:stop]`` of a C-contiguous array of rank 2 or more as a 1-D view (``first <=
    stop`` within the leading axis: no check). Where ``array[n].reshape(size)`` calls Numba's
    run-time helper (a C call per view: on small groups a visible share of a task), this is a
    few integer operations."""
    if not (isinstance(array, types.Array) and array.layout == "C" and array.ndim >= 2):
        return None
    result = array.copy(ndim=1, layout="C")

    def codegen(context, builder, signature, args):
        (source,) = array_structs(context, builder, signature, args, 0)
        row = cgutils.unpack_tuple(builder, source.shape)[1:]
        row_size = row[0]
        for size in row[1:]:
            row_size = builder.mul(row_size, size)
        start = builder.mul(args[1], row_size)
        view = context.make_array(result)(context, builder)
        context.populate_array(
            view,
            data=builder.gep(source.data, [start]),
            shape=[builder.mul(builder.sub(args[2], args[1]), row_size)],
            strides=[source.itemsize],
            itemsize=source.itemsize,
            meminfo=source.meminfo,
            parent=source.parent,
        )
        return impl_ret_borrowed(context, builder, result, view._getvalue())

    return result(array, types.intp, types.intp), codegen


#: Byte alignment of :func:`stack_array`'s memory (a cache line: vector loads never split one).
STACK_ALIGN = 64


@intrinsic(prefer_literal=True)
def stack_array(typingctx, rows, columns, like):
    """A C-contiguous ``(rows, columns)`` array of ``like``'s dtype in the calling function's
    stack frame (``rows`` and ``columns`` integer constants): scratch rows a task fills and reads
    back while they sit in L1, with no allocation (no reference count either: its meminfo is
    null). It lives until the function that called this returns; its values start undefined."""
    if not (
        isinstance(rows, types.IntegerLiteral)
        and isinstance(columns, types.IntegerLiteral)
        and isinstance(like, types.Array)
    ):
        return None
    shape = (rows.literal_value, columns.literal_value)
    result = types.Array(like.dtype, 2, "C")

    def codegen(context, builder, signature, args):
        element = context.get_data_type(like.dtype)
        itemsize = context.get_abi_sizeof(element)
        with builder.goto_entry_block():
            memory = builder.alloca(ir.ArrayType(element, shape[0] * shape[1]))
            memory.align = STACK_ALIGN
        array = context.make_array(result)(context, builder)
        intp = context.get_value_type(types.intp)
        context.populate_array(
            array,
            data=builder.bitcast(memory, element.as_pointer()),
            shape=[intp(size) for size in shape],
            strides=[intp(shape[1] * itemsize), intp(itemsize)],
            itemsize=intp(itemsize),
            meminfo=None,
        )
        return array._getvalue()

    return result(rows, columns, like), codegen


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
    if not (
        isinstance(destination, types.Array)
        and isinstance(source, types.Array)
        and destination.dtype.bitwidth == source.dtype.bitwidth
    ):
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
            pointers = [
                builder.bitcast(builder.gep(base, [at]), moved.as_pointer())
                for base in (source_bytes, destination_bytes)
                for at in (_I64(0), last)
            ]
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
