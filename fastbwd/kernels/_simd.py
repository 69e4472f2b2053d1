"""Explicit 16-lane vector operations for kernels whose short fixed-length loops LLVM does not
vectorise by itself.

LLVM fully unrolls a loop of 16 iterations into scalar code and its SLP vectoriser then gives
up (it cannot prove the tiles do not alias), so the tile loops of the separable engine ran
scalar. These intrinsics emit the vector IR directly. They perform exactly the scalar
operations they replace (a multiply, then an add: no fused multiply-add), so results are
bitwise those of the plain loops.

Both operate on 2-D C-contiguous float32 or float64 arrays and trust their indices (no bounds
checks, like every kernel): the caller guarantees ``LANES`` elements exist where they read and
write.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Elements per vector operation (one 512-bit vector of float32, two of float64).
LANES = 16

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


def _element_pointer(builder, array, row, column):
    """Address of ``array[row, column]`` of a 2-D C-contiguous array struct."""
    columns = cgutils.unpack_tuple(builder, array.shape, 2)[1]
    return builder.gep(array.data, [builder.add(builder.mul(row, columns), column)])


def _vector_pointer(builder, array, row, column, vector_type):
    return builder.bitcast(_element_pointer(builder, array, row, column), vector_type.as_pointer())


@intrinsic
def lanes_axpy(typingctx, destination, destination_row, destination_column, source, source_row, source_column,
               scale):
    """``destination[dr, dc:dc + LANES] += scale * source[sr, sc:sc + LANES]``."""
    sig = types.void(destination, types.intp, types.intp, source, types.intp, types.intp, destination.dtype)

    def codegen(context, builder, signature, args):
        dst = context.make_array(signature.args[0])(context, builder, args[0])
        src = context.make_array(signature.args[3])(context, builder, args[3])
        vector = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        align = signature.args[0].dtype.bitwidth // 8
        dst_pointer = _vector_pointer(builder, dst, args[1], args[2], vector)
        src_pointer = _vector_pointer(builder, src, args[4], args[5], vector)
        splat = builder.insert_element(ir.Constant(vector, ir.Undefined), args[6], _I32(0))
        splat = builder.shuffle_vector(splat, ir.Constant(vector, ir.Undefined),
                                       ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))
        product = builder.fmul(builder.load(src_pointer, align=align), splat)
        builder.store(builder.fadd(builder.load(dst_pointer, align=align), product), dst_pointer, align=align)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def transpose_lanes(typingctx, destination, destination_row, destination_column, source, source_row,
                    source_column):
    """``destination[dr + j, dc + i] = source[sr + i, sc + j]`` for ``i, j < LANES``.

    Sixteen vector loads, the four-stage shuffle network (stage ``d`` swaps the off-diagonal
    ``d x d`` blocks of every ``2d x 2d`` block: d = 8, 4, 2, 1), sixteen vector stores.
    """
    sig = types.void(destination, types.intp, types.intp, source, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        dst = context.make_array(signature.args[0])(context, builder, args[0])
        src = context.make_array(signature.args[3])(context, builder, args[3])
        vector = ir.VectorType(context.get_data_type(signature.args[0].dtype), LANES)
        mask_type = ir.VectorType(_I32, LANES)
        align = signature.args[0].dtype.bitwidth // 8
        rows = [builder.load(_vector_pointer(builder, src, builder.add(args[4], _I64(i)), args[5], vector),
                             align=align) for i in range(LANES)]
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
        for j in range(LANES):
            pointer = _vector_pointer(builder, dst, builder.add(args[1], _I64(j)), args[2], vector)
            builder.store(rows[j], pointer, align=align)
        return context.get_dummy_value()

    return sig, codegen
