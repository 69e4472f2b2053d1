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

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.imputils import lower_constant
from numba.extending import (
    NativeValue,
    intrinsic,
    models,
    overload,
    register_jitable,
    register_model,
    typeof_impl,
    unbox,
)

__all__ = ["StorageFormat", "NATIVE", "FLOAT16", "BFLOAT16", "load", "store", "accumulator"]


class StorageFormat:
    """How the elements of a kernel's array argument are stored (a compile-time tag)."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"StorageFormat({self.name!r})"

    def __reduce__(self):
        return (_format_by_name, (self.name,))


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
def float16_bits_to_float32(typingctx, bits):
    """Exact float16 -> float32 from the 16 storage bits."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return sig, codegen


@intrinsic
def float32_to_float16_bits(typingctx, value):
    """float32 -> float16 bits, IEEE round to nearest even (overflow to inf, NaN stays NaN)."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))

    return sig, codegen


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


@register_jitable(inline="always")
def _bfloat16_bits_to_float32(bits):
    return uint32_as_float32(np.uint32(bits) << np.uint32(16))


@register_jitable(inline="always")
def _float32_to_bfloat16_bits(value):
    bits = float32_as_uint32(value)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x0040)
    return np.uint16(quiet_nan if value != value else rounded)


# --------------------------------------------------------------------------------------------
# the kernel-facing API, selected at compile time by the StorageFormat type
# --------------------------------------------------------------------------------------------

def load(value, fmt):
    """Decode one stored element to its compute type (njit only)."""
    raise NotImplementedError("load() is only callable from @njit code")


def store(value, fmt):
    """Encode one compute-type value for storage, rounding once (njit only)."""
    raise NotImplementedError("store() is only callable from @njit code")


def accumulator(array, fmt):
    """A zero of the compute type of ``array``'s elements (njit only)."""
    raise NotImplementedError("accumulator() is only callable from @njit code")


def _format_name(fmt):
    if not isinstance(fmt, StorageFormatType):
        raise TypeError(f"expected a StorageFormat, got {fmt}")
    return fmt.format_name


@overload(load, inline="always")
def _load(value, fmt):
    name = _format_name(fmt)
    if name == "float16":
        return lambda value, fmt: float16_bits_to_float32(value)
    if name == "bfloat16":
        return lambda value, fmt: _bfloat16_bits_to_float32(value)
    return lambda value, fmt: value


@overload(store, inline="always")
def _store(value, fmt):
    name = _format_name(fmt)
    if name == "float16":
        return lambda value, fmt: float32_to_float16_bits(np.float32(value))
    if name == "bfloat16":
        return lambda value, fmt: _float32_to_bfloat16_bits(np.float32(value))
    return lambda value, fmt: value


@overload(accumulator, inline="always")
def _accumulator(array, fmt):
    name = _format_name(fmt)
    if name != "native":
        return lambda array, fmt: np.float32(0)
    dtype = array.dtype
    if isinstance(dtype, types.Complex):
        zero = np.complex64(0) if dtype.bitwidth == 64 else np.complex128(0)
    elif dtype == types.float64:
        zero = np.float64(0)
    else:
        zero = np.float32(0)
    return lambda array, fmt: zero
