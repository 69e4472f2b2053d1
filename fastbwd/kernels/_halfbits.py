"""float16 / bfloat16 <-> float32 inside kernels, and the StorageFormat that selects them.

Numba rejects ``np.float16`` and ``ml_dtypes.bfloat16`` arrays, so both reach kernels as
``uint16`` views together with a :class:`StorageFormat` object. The format is a Numba *type*
(one per format), so every kernel is specialised per format at compile time and the decode and
encode below are inlined into its loops with no branch; native float32/float64/complex arrays
use :data:`NATIVE`, for which both are the identity.

* float16 decodes with LLVM ``bitcast i16 -> half`` + ``fpext`` (exact; vectorises to
  ``vcvtph2ps``) and encodes with ``fptrunc`` + ``bitcast`` (IEEE round to nearest even).
* bfloat16 decodes as ``uint32(u) << 16`` reinterpreted as float32 (exact) and encodes as
  ``(u + 0x7FFF + ((u >> 16) & 1)) >> 16`` on the float32 bits (round to nearest even), with a
  NaN kept a quiet NaN of the same sign.

Kernel-facing API (all usable only inside ``@njit`` code):
``load(value, fmt)`` -> compute value, ``store(value, fmt)`` -> storage value,
``accumulator(array, fmt)`` -> a zero of the compute type (float32 for the half formats and
float32, float64 for float64, the complex type for complex arrays).
"""

import math

from llvmlite import ir
from numba import types
from numba.core.imputils import lower_constant
from numba.extending import (
    NativeValue,
    intrinsic,
    models,
    register_model,
    typeof_impl,
    unbox,
)

from ._halfcalls import half_type

__all__ = ["StorageFormat", "NATIVE", "FLOAT16", "BFLOAT16", "load", "store", "accumulator", "one_nan"]


class StorageFormat:
    """How the elements of a kernel's array argument are stored (a compile-time tag)."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"StorageFormat({self.name!r})"

    def __reduce__(self):
        return (_format_by_name, (self.name,))

    @property
    def _numba_type_(self):
        """Numba's type for this argument, read by its dispatcher's fast path (typing a
        StorageFormat through ``typeof_impl`` is a slow fallback, paid on every kernel call)."""
        return _TYPES[self.name]


NATIVE = StorageFormat("native")
FLOAT16 = StorageFormat("float16")
BFLOAT16 = StorageFormat("bfloat16")
_BY_NAME = {f.name: f for f in (NATIVE, FLOAT16, BFLOAT16)}


def _format_by_name(name):
    return _BY_NAME[name]


class StorageFormatType(types.Dummy):
    """The Numba type of a StorageFormat: carries the format name, no runtime data."""

    def __init__(self, format_name):
        self.format_name = format_name
        super().__init__(name=f"StorageFormat[{format_name}]")


_TYPES = {name: StorageFormatType(name) for name in _BY_NAME}


@typeof_impl.register(StorageFormat)
def _typeof_storage_format(value, context):
    # the three types made once: typing a kernel's arguments is part of every call's overhead
    return _TYPES[value.name]


register_model(StorageFormatType)(models.OpaqueModel)


@unbox(StorageFormatType)
def _unbox_storage_format(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


@lower_constant(StorageFormatType)
def _constant_storage_format(context, builder, typ, value):
    """A kernel may name a format as a global (``NATIVE`` for its float32 scratch)."""
    return context.get_dummy_value()


# --------------------------------------------------------------------------------------------
# bit-level intrinsics
# --------------------------------------------------------------------------------------------


@intrinsic
def uint32_as_float32(typingctx, bits):
    """Reinterpret 32 bits as a float32."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def float32_as_uint32(typingctx, value):
    """Reinterpret a float32 as its 32 bits."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


# --------------------------------------------------------------------------------------------
# the kernel-facing API, selected at compile time by the StorageFormat type
# --------------------------------------------------------------------------------------------


def _format_name(fmt):
    if not isinstance(fmt, StorageFormatType):
        raise TypeError(f"expected a StorageFormat, got {fmt}")
    return fmt.format_name


# load, store and accumulator are intrinsics, not inlined overloads: typing one needs no compiled
# implementation (an overload compiled one per argument type on a kernel's first call), and the
# IR is exactly what the overloads' bodies lowered to.


def _decode_ir(builder, bits, format_name):
    """float32 from the 16 stored bits (exact)."""
    if format_name == "float16":
        return builder.fpext(builder.bitcast(bits, half_type()), ir.FloatType())
    word = builder.shl(builder.zext(bits, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
    return builder.bitcast(word, ir.FloatType())


def _encode_ir(builder, value, format_name):
    """The 16 stored bits of a float32, rounded to nearest even (a bfloat16 NaN stays a quiet NaN)."""
    if format_name == "float16":
        return builder.bitcast(builder.fptrunc(value, half_type()), ir.IntType(16))
    word = ir.IntType(32)
    bits = builder.bitcast(value, word)
    top = builder.lshr(bits, word(16))
    rounded = builder.lshr(builder.add(builder.add(bits, word(0x7FFF)), builder.and_(top, word(1))), word(16))
    quiet_nan = builder.or_(top, word(0x0040))
    is_nan = builder.fcmp_unordered("uno", value, value)
    return builder.trunc(builder.select(is_nan, quiet_nan, rounded), ir.IntType(16))


def _identity(context, builder, signature, args):
    return args[0]


@intrinsic(prefer_literal=False)
def load(typingctx, value, fmt):
    """Decode one stored element to its compute type (njit only)."""
    name = _format_name(fmt)
    value = types.unliteral(value)
    if name == "native":
        return value(value, fmt), _identity
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return _decode_ir(builder, context.cast(builder, args[0], signature.args[0], types.uint16), name)

    return types.float32(value, fmt), codegen


@intrinsic(prefer_literal=False)
def store(typingctx, value, fmt):
    """Encode one compute-type value for storage, rounding once (njit only)."""
    name = _format_name(fmt)
    value = types.unliteral(value)
    if name == "native":
        return value(value, fmt), _identity
    if not isinstance(value, (types.Float, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        # as np.float32(value): a float64 is rounded to float32 first
        single = context.cast(builder, args[0], signature.args[0], types.float32)
        return _encode_ir(builder, single, name)

    return types.uint16(value, fmt), codegen


def one_nan_ir(builder, value):
    """``value`` (a float or a vector of them), each NaN replaced by the positive quiet NaN.

    Which NaN an operation of two NaN operands returns (its sign, its payload) follows the order
    instruction selection gives the operands, which differs between code shapes (a vector body
    or its scalar tail, a group summed alone or beside another, AVX-512 or SSE), so that a
    result computed from NaN of both signs would follow the task partition, hence the thread
    count, and the target: results that sum several inputs (or, in GroupNorm+Swish, meet NaN
    from several) are stored as this one NaN (docs/semantics.md §0.2)."""
    element = value.type.element if isinstance(value.type, ir.VectorType) else value.type
    nan = ir.Constant(element, math.nan)
    if isinstance(value.type, ir.VectorType):
        nan = ir.Constant(value.type, [math.nan] * value.type.count)
    return builder.select(builder.fcmp_unordered("uno", value, value), nan, value)


@intrinsic
def one_nan(typingctx, value):
    """:func:`one_nan_ir` of one compute-type value (njit only); a complex value (the pad's
    complex gradients) is returned as it is."""
    if isinstance(value, types.Complex):
        return value(value), _identity
    if not isinstance(value, types.Float):
        return None

    def codegen(context, builder, signature, args):
        return one_nan_ir(builder, args[0])

    return value(value), codegen


def _compute_type(array, fmt):
    if _format_name(fmt) != "native":
        return types.float32
    dtype = array.dtype
    if isinstance(dtype, types.Complex):
        return types.complex64 if dtype.bitwidth == 64 else types.complex128
    return types.float64 if dtype == types.float64 else types.float32


@intrinsic(prefer_literal=False)
def accumulator(typingctx, array, fmt):
    """A zero of the compute type of ``array``'s elements (njit only)."""
    if not isinstance(array, types.Array):
        return None
    zero_type = _compute_type(array, fmt)

    def codegen(context, builder, signature, args):
        return context.get_constant_generic(builder, signature.return_type, 0)

    return zero_type(array, fmt), codegen
