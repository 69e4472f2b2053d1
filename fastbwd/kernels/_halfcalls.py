"""The two runtime calls LLVM emits for float16 conversions on CPUs without F16C.

Kernels widen float16 with LLVM's ``fpext half`` and narrow with ``fptrunc`` (kernels._halfbits,
kernels._lanes). Where the target CPU has F16C (every x86-64 CPU since 2012, ``x86-64-v3``) these
are single instructions. Without it (``NUMBA_CPU_NAME=generic``, older CPUs) LLVM calls
``__extendhfsf2`` and ``__truncsfhf2`` from the compiler runtime, which Numba's JIT does not
provide: the process would stop with "LLVM ERROR: Symbol not found". :func:`provide` defines both
(integer operations in LLVM IR, with the results of F16C: exact widening, rounding to nearest
even, NaN payloads kept and quieted) and registers them with LLVM's symbol table before the first
kernel is built.
"""

import functools
import threading

import llvmlite.binding as llvm
from llvmlite import ir

NAMES = ("__extendhfsf2", "__truncsfhf2")

_IR = r"""
define float @fastbwd_extendhfsf2(half %value) {
  %bits = bitcast half %value to i16
  %word = zext i16 %bits to i32
  %sign = and i32 %word, 32768
  %sign32 = shl i32 %sign, 16
  %biased = lshr i32 %word, 10
  %exponent = and i32 %biased, 31
  %mantissa = and i32 %word, 1023
  %mantissa32 = shl i32 %mantissa, 13
  %rebiased = add i32 %exponent, 112
  %exponent32 = shl i32 %rebiased, 23
  %normal = or i32 %exponent32, %mantissa32
  ; infinities and NaNs keep their payload; a signalling NaN is quieted (bit 22)
  %special_payload = or i32 %mantissa32, 2139095040
  %is_nan = icmp ne i32 %mantissa, 0
  %quiet = or i32 %special_payload, 4194304
  %special = select i1 %is_nan, i32 %quiet, i32 %special_payload
  ; zeros and subnormals: mantissa * 2^-24, exact in float32
  %count = uitofp i32 %mantissa to float
  %small_value = fmul float %count, 0x3E70000000000000
  %small = bitcast float %small_value to i32
  %is_special = icmp eq i32 %exponent, 31
  %is_small = icmp eq i32 %exponent, 0
  %large = select i1 %is_special, i32 %special, i32 %normal
  %magnitude = select i1 %is_small, i32 %small, i32 %large
  %result = or i32 %magnitude, %sign32
  %float = bitcast i32 %result to float
  ret float %float
}

define half @fastbwd_truncsfhf2(float %value) {
  %word = bitcast float %value to i32
  %sign = and i32 %word, -2147483648
  %sign16 = lshr i32 %sign, 16
  %magnitude = and i32 %word, 2147483647
  ; NaN: quiet, the payload's top 10 bits kept
  %payload_shifted = lshr i32 %magnitude, 13
  %payload = and i32 %payload_shifted, 1023
  %nan = or i32 %payload, 32256
  ; from 65520 (the midpoint above the largest float16) on: infinity
  %is_nan = icmp ugt i32 %magnitude, 2139095040
  %is_huge = icmp uge i32 %magnitude, 1199566848
  ; below 2^-14: a float16 subnormal, rounded to nearest even by adding 0.5 in float32
  %is_small = icmp ult i32 %magnitude, 947912704
  %absolute = bitcast i32 %magnitude to float
  %shifted = fadd float %absolute, 5.000000e-01
  %shifted_bits = bitcast float %shifted to i32
  %small = sub i32 %shifted_bits, 1056964608
  ; normal: rebias, round to nearest even on the 13 dropped bits
  %odd_shifted = lshr i32 %magnitude, 13
  %odd = and i32 %odd_shifted, 1
  %rebiased = add i32 %magnitude, -939520001
  %rounded = add i32 %rebiased, %odd
  %normal = lshr i32 %rounded, 13
  %finite = select i1 %is_small, i32 %small, i32 %normal
  %not_nan = select i1 %is_huge, i32 31744, i32 %finite
  %unsigned = select i1 %is_nan, i32 %nan, i32 %not_nan
  %result = or i32 %unsigned, %sign16
  %bits = trunc i32 %result to i16
  %half = bitcast i16 %bits to half
  ret half %half
}
"""

_lock = threading.Lock()
_engine = None


@functools.cache  # Numba's target is fixed when it is imported
def needed():
    """Whether Numba's target lacks F16C (``NUMBA_CPU_FEATURES``, empty for ``NUMBA_CPU_NAME=generic``,
    else the host's features), so that kernels converting float16 call the two functions."""
    from numba.core import config

    features = config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return "+f16c" not in features.split(",")


def provide_if_needed():
    """:func:`provide` where :func:`needed`; nothing otherwise (no cost on F16C targets)."""
    if _engine is None and needed():
        provide()


def half_type(lanes=None):
    """LLVM's ``half`` (a vector of ``lanes`` of them), for code that converts float16: where the
    target lacks F16C those conversions are calls to the two functions, so they are provided
    first. Every float16 conversion is built with it (kernels, and any njit function using
    ``_halfbits``' or ``_lanes``' conversions, such as the tests' own)."""
    provide_if_needed()
    return ir.HalfType() if lanes is None else ir.VectorType(ir.HalfType(), lanes)


def provide():
    """Define ``__extendhfsf2`` and ``__truncsfhf2`` for LLVM's JIT unless something in the
    process already does (once; about 10 ms). Safe to call from several threads."""
    global _engine
    if _engine is not None:
        return
    with _lock:
        if _engine is not None:
            return
        if all(llvm.address_of_symbol(name) for name in NAMES):
            _engine = False  # provided already (by the process or an earlier call)
            return
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        machine = llvm.Target.from_default_triple().create_target_machine(opt=2)
        engine = llvm.create_mcjit_compiler(llvm.parse_assembly(_IR), machine)
        engine.finalize_object()
        for name in NAMES:
            if not llvm.address_of_symbol(name):
                llvm.add_symbol(name, engine.get_function_address("fastbwd_" + name.lstrip("_")))
        _engine = engine  # kept for the life of the process: kernels call into its code
