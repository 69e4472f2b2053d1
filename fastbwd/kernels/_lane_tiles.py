"""The tile intrinsics (module doc of ``_lanes``): 16 x 16 tiles transposed in registers, axpy
of a row of lanes, and sums gathered over a runtime list of source rows, for the separable
engine (upsample, avg-pool) and RoIAlign."""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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
    splat,
)


def _gathered_sum(builder, source, index, weights, start, stop, column, format_name, vector_type):
    """The 16-lane register sum ``sum over s in [start, stop) of weights[s] *
    source[index[s], column:column + LANES]``, from +0.0, in ascending ``s``."""
    accumulator = cgutils.alloca_once_value(builder, ir.Constant(vector_type, None))
    builder.store(ir.Constant(vector_type, None), accumulator)
    with cgutils.for_range_slice(builder, start, stop, _I64(1), inc=True) as (s, _):
        row = builder.load(builder.gep(index.data, [s]))
        weight = splat(builder, vector_type, builder.load(builder.gep(weights.data, [s])))
        values = decode_lanes(builder, _element_pointer(builder, source, row, column), format_name, vector_type)
        builder.store(builder.fadd(builder.load(accumulator), builder.fmul(values, weight)), accumulator)
    return builder.load(accumulator)


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


def _axpy(format_name):
    """The codegen of ``destination[dr, dc:dc + LANES] += scale * decode(source[sr, sc:sc + LANES])``."""

    def codegen(context, builder, signature, args):
        dst, src = array_structs(context, builder, signature, args, 0, 3)
        vector = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        align = signature.args[0].dtype.bitwidth // 8
        dst_pointer = _vector_pointer(builder, dst, args[1], args[2], vector)
        values = decode_lanes(builder, _element_pointer(builder, src, args[4], args[5]), format_name, vector)
        product = builder.fmul(values, splat(builder, vector, args[6]))
        builder.store(builder.fadd(builder.load(dst_pointer, align=align), product), dst_pointer, align=align)
        return context.get_dummy_value()

    return codegen


@intrinsic
def lanes_axpy(typingctx, destination, destination_row, destination_column, source, source_row, source_column, scale):
    """``destination[dr, dc:dc + LANES] += scale * source[sr, sc:sc + LANES]``."""
    sig = types.void(destination, types.intp, types.intp, source, types.intp, types.intp, destination.dtype)
    return sig, _axpy("native")


@intrinsic
def lanes_decode_axpy(
    typingctx, destination, destination_row, destination_column, source, source_row, source_column, scale, fmt
):
    """``destination[dr, dc:dc + LANES] += scale * decode(source[sr, sc:sc + LANES])``: ``source``
    holds StorageFormat ``fmt`` (decoded exactly, as ``load``), ``destination`` the compute type."""
    if not _both_c_matrices(destination, source):
        return None
    sig = types.void(destination, types.intp, types.intp, source, types.intp, types.intp, destination.dtype, fmt)
    return sig, _axpy(fmt.format_name)


@intrinsic
def transpose_lanes(
    typingctx, destination, destination_row, destination_column, source, source_row, source_column, fmt
):
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
        rows = [
            builder.load(
                _vector_pointer(builder, src, builder.add(args[4], _I64(i)), args[5], vector),
                align=signature.args[3].dtype.bitwidth // 8,
            )
            for i in range(LANES)
        ]
        rows = _transpose_registers(builder, rows)
        for j in range(LANES):
            pointer = _vector_pointer(builder, dst, builder.add(args[1], _I64(j)), args[2], stored)
            builder.store(
                encode_lanes(builder, rows[j], format_name), pointer, align=signature.args[0].dtype.bitwidth // 8
            )
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def decode_transpose_lanes(
    typingctx, destination, destination_row, destination_column, source, source_row, source_column, count, fmt
):
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
        rows = [
            decode_lanes(
                builder,
                _element_pointer(builder, src, builder.add(args[4], _I64(i)), args[5]),
                format_name,
                vector,
                used,
            )
            for i in range(LANES)
        ]
        align = signature.args[0].dtype.bitwidth // 8
        for j, column in enumerate(_transpose_registers(builder, rows)):
            with builder.if_then(builder.icmp_signed("<", _I64(j), count), likely=True):
                pointer = _vector_pointer(builder, dst, builder.add(args[1], _I64(j)), args[2], vector)
                builder.store(column, pointer, align=align)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def lanes_gather_sum(
    typingctx, destination, destination_row, destination_column, source, index, weights, start, stop, source_column, fmt
):
    """``destination[dr, dc:dc + LANES] = sum over s in [start, stop) of weights[s] *
    decode(source[index[s], sc:sc + LANES])``, from +0.0 in ascending ``s``, in a register.

    ``source`` holds elements in StorageFormat ``fmt``; ``destination`` and ``weights`` are of
    the compute type; ``index`` is int64.
    """
    sig = types.void(
        destination, types.intp, types.intp, source, index, weights, types.intp, types.intp, types.intp, fmt
    )
    format_name = fmt.format_name

    def codegen(context, builder, signature, args):
        dst, src, idx, wts = array_structs(context, builder, signature, args, 0, 3, 4, 5)
        vector = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        total = _gathered_sum(builder, src, idx, wts, args[6], args[7], args[8], format_name, vector)
        builder.store(
            total, _vector_pointer(builder, dst, args[1], args[2], vector), align=signature.args[0].dtype.bitwidth // 8
        )
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def gather_transpose_lanes(
    typingctx,
    destination,
    destination_row,
    destination_column,
    source,
    index,
    weights,
    starts,
    first,
    count,
    source_column,
    fmt,
):
    """LANES gathered sums stored transposed, in registers all the way.

    For lane ``r < count``, ``v_r`` is the :func:`lanes_gather_sum` of the CSR list ``r`` (``s``
    in ``[starts[first + r], starts[first + r + 1])``); ``v_r = 0`` for ``r >= count``. Then
    ``destination[dr + j, dc + r] = v_r[j]`` for ``j, r < LANES``.
    """
    sig = types.void(
        destination, types.intp, types.intp, source, index, weights, starts, types.intp, types.intp, types.intp, fmt
    )
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
            total = _gathered_sum(
                builder, src, idx, wts, builder.load(start), builder.load(stop), args[9], format_name, vector
            )
            builder.store(total, builder.gep(sums, [_I32(0), r]))
        rows = [builder.load(builder.gep(sums, [_I32(0), _I32(r)])) for r in range(LANES)]
        align = signature.args[0].dtype.bitwidth // 8
        for j, column in enumerate(_transpose_registers(builder, rows)):
            pointer = _vector_pointer(builder, dst, builder.add(args[1], _I64(j)), args[2], vector)
            builder.store(column, pointer, align=align)
        return context.get_dummy_value()

    return sig, codegen


#: Runtime window counts up to this get straight-line code in :func:`lanes_scaled_window_sums` (pooling
