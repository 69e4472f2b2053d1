"""kernels._halfcalls: float16 conversions on targets without F16C give the hardware's bits, and
a float16 call on ``NUMBA_CPU_NAME=generic`` runs (it used to stop the process: "LLVM ERROR:
Symbol not found: __extendhfsf2")."""

import ctypes
import os
import subprocess
import sys
import textwrap

import llvmlite.binding as llvm
import numpy as np
import pytest

from fastbwd.kernels import _halfcalls

HOST_FEATURES = llvm.get_host_cpu_features().flatten().split(",")

# Loops converting an array with the host's instructions (fpext/fptrunc of half) and with the
# functions of _halfcalls (declared under other names), side by side.
_LOOP = r"""
define void @{name}({source}* %source, {result}* %host, {result}* %provided, i64 %count) {{
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
  %in = getelementptr {source}, {source}* %source, i64 %i
  %bits = load {source}, {source}* %in
  %value = bitcast {source} %bits to {source_float}
  %converted = {instruction} {source_float} %value to {result_float}
  %converted_bits = bitcast {result_float} %converted to {result}
  %host_out = getelementptr {result}, {result}* %host, i64 %i
  store {result} %converted_bits, {result}* %host_out
  %ours = call {result_float} @provided_{name}({source_float} %value)
  %ours_bits = bitcast {result_float} %ours to {result}
  %provided_out = getelementptr {result}, {result}* %provided, i64 %i
  store {result} %ours_bits, {result}* %provided_out
  %next = add i64 %i, 1
  %more = icmp ult i64 %next, %count
  br i1 %more, label %loop, label %done
done:
  ret void
}}
declare {result_float} @provided_{name}({source_float})
"""
_LOOPS = _LOOP.format(
    name="extend", source="i16", source_float="half", result="i32", result_float="float", instruction="fpext"
) + _LOOP.format(
    name="trunc", source="i32", source_float="float", result="i16", result_float="half", instruction="fptrunc"
)


@pytest.fixture(scope="module")
def loops():
    if "+f16c" not in HOST_FEATURES:
        pytest.skip("the host has no F16C to compare with")
    _halfcalls.provide()  # builds the functions even where the target does not need them
    engine = _halfcalls._engine
    if not engine:
        pytest.skip("the process already provides the symbols")
    llvm.add_symbol("provided_extend", engine.get_function_address("fastbwd_extendhfsf2"))
    llvm.add_symbol("provided_trunc", engine.get_function_address("fastbwd_truncsfhf2"))
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=",".join(HOST_FEATURES), opt=0
    )
    module = llvm.parse_assembly(_LOOPS)
    assembly = machine.emit_assembly(module)
    assert not any(name in assembly for name in _halfcalls.NAMES), "the host converts by calls"
    loop_engine = llvm.create_mcjit_compiler(module, machine)
    loop_engine.finalize_object()
    signature = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    loops = {name: signature(loop_engine.get_function_address(name)) for name in ("extend", "trunc")}
    loops["engine"] = loop_engine  # keeps the code alive
    return loops


def _run(loop, source, out_dtype):
    host, provided = np.empty(source.size, out_dtype), np.empty(source.size, out_dtype)
    loop(source.ctypes.data, host.ctypes.data, provided.ctypes.data, source.size)
    return host, provided


def test_extend_equals_the_hardware_on_every_float16(loops):
    host, provided = _run(loops["extend"], np.arange(1 << 16, dtype=np.uint32).astype(np.uint16), np.uint32)
    assert np.array_equal(host, provided)


def test_trunc_equals_the_hardware(loops):
    rng = np.random.default_rng(0)
    edges = np.array(
        [
            0,
            0x7F800000,
            0x7FC00000,
            0x7F800001,
            0x7FBFFFFF,
            0x7F7FFFFF,
            1,
            0x477FEFFF,
            0x477FF000,
            0x477FF001,
            0x47800000,  # around 65504 and 65520
            0x387FFFFF,
            0x38800000,
            0x33000000,
            0x33000001,
            0x32FFFFFF,
        ],
        np.uint32,
    )
    # every float32 within 3 ulps of each float16 rounding midpoint and boundary, normal range
    midpoints = np.arange(0x33000000 >> 12, 0x47800000 >> 12, dtype=np.int64) << 12
    near = (midpoints[:, None] + np.arange(-3, 4)[None, :]).ravel().astype(np.uint32)
    source = np.concatenate([edges, near, rng.integers(0, 1 << 32, 2_000_000, dtype=np.uint64).astype(np.uint32)])
    source = np.concatenate([source, source | np.uint32(0x80000000)])
    host, provided = _run(loops["trunc"], source, np.uint16)
    differ = np.nonzero(host != provided)[0]
    assert differ.size == 0, [(hex(source[i]), hex(host[i]), hex(provided[i])) for i in differ[:5]]


@pytest.mark.slow
def test_generic_target_computes_float16_with_the_hosts_bits(tmp_path):
    """A float16 and a bfloat16 call of three kernels under NUMBA_CPU_NAME=generic and x86-64-v3,
    in child processes, give the bits this process gets; so do GroupNorm+Swish calls whose x
    and dy hold NaN of both signs, in both layouts (every NaN result is the one NaN); and an
    njit function of the test's own converting float16 compiles before any kernel is built."""
    program = textwrap.dedent("""
        import ml_dtypes, numba, numpy as np, fastbwd
        from fastbwd.kernels._halfbits import FLOAT16, load, store

        @numba.njit
        def round_trip(values, fmt):  # compiled before any kernel: it needs the calls itself
            out = np.empty(values.size, np.uint16)
            for i in range(values.size):
                out[i] = store(load(store(values[i], fmt), fmt) * np.float32(3), fmt)
            return out

        rng = np.random.default_rng(5)
        results = [round_trip(rng.uniform(-7e4, 7e4, 300).astype(np.float32), FLOAT16)]
        for dtype in (np.float16, ml_dtypes.bfloat16):
            x = rng.uniform(-3, 3, (2, 4, 6, 20)).astype(dtype)
            gamma, beta = rng.uniform(0.5, 2, 4).astype(dtype), rng.uniform(-1, 1, 4).astype(dtype)
            y, mean, rstd = fastbwd.group_norm_swish(x, gamma, beta, 2)
            dx, dgamma, dbeta = fastbwd.group_norm_swish_backward(y, mean, rstd, x, gamma, beta, 2)
            up = fastbwd.upsample_bilinear2d_backward(x, (6, 20), (2, 4, 3, 10), False)
            results += [a.view(np.uint16) for a in (y, mean, rstd, dx, dgamma, dbeta, up)]
        for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
            for layout in ("NCHW", "NHWC"):
                x = rng.uniform(-3, 3, (2, 4, 6, 20)).astype(dtype)
                dy = rng.uniform(-3, 3, (2, 4, 6, 20)).astype(dtype)
                x[0, 0, 1, 1], x[0, 1, 2, 3], x[1, 3, 4, 5] = np.nan, -np.nan, -np.nan
                dy[0, 2, 1, 1], dy[1, 1, 0, 7], dy[1, 3, 4, 6] = -np.nan, np.nan, np.nan
                if layout == "NHWC":
                    x, dy = (np.ascontiguousarray(np.moveaxis(a, 1, -1)) for a in (x, dy))
                gamma, beta = rng.uniform(0.5, 2, 4).astype(dtype), rng.uniform(-1, 1, 4).astype(dtype)
                y, mean, rstd = fastbwd.group_norm_swish(x, gamma, beta, 2, layout)
                grads = fastbwd.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, 2, layout)
                results += [a.view(np.uint8) for a in (y, mean, rstd, *grads)]
        np.savez(OUT, *results)
    """)
    outputs = {}
    targets = (("host", {}), ("generic", {"NUMBA_CPU_NAME": "generic"}), ("v3", {"NUMBA_CPU_NAME": "x86-64-v3"}))
    for name, env in targets:
        out = tmp_path / f"{name}.npz"
        child_env = dict(os.environ, **env)
        child_env.pop("NUMBA_CPU_FEATURES", None)
        result = subprocess.run(
            [sys.executable, "-c", f"OUT = {str(out)!r}\n" + program],
            env=child_env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        with np.load(out) as arrays:
            outputs[name] = [arrays[key] for key in sorted(arrays.files, key=lambda k: int(k.split("_")[1]))]
    assert len(outputs["host"]) == 1 + 14 + 36
    for other in ("generic", "v3"):
        for index, (host, theirs) in enumerate(zip(outputs["host"], outputs[other])):
            assert np.array_equal(host, theirs), (other, index)


@pytest.mark.parametrize(
    "features, needed",
    [
        ("+sse2,+avx,+f16c,+avx2", False),
        ("+f16c", False),
        # a target without F16C: "-f16c" holds the letters of "+f16c" but not the feature
        ("+sse2,+avx,-f16c,+avx2", True),
        ("-f16c", True),
        ("", True),  # NUMBA_CPU_NAME=generic: no features at all
    ],
)
def test_needed_reads_the_target_features(monkeypatch, features, needed):
    from numba.core import config

    monkeypatch.setattr(config, "CPU_FEATURES", features)
    assert _halfcalls.needed.__wrapped__() is needed


def test_needed_without_numba_features_reads_the_host(monkeypatch):
    from numba.core import config

    class Host:
        def __init__(self, flat):
            self.flat = flat

        def flatten(self):
            return self.flat

    monkeypatch.setattr(config, "CPU_FEATURES", None)
    for flat, needed in (("+avx,-f16c", True), ("+avx,+f16c", False)):
        monkeypatch.setattr(llvm, "get_host_cpu_features", lambda flat=flat: Host(flat))
        assert _halfcalls.needed.__wrapped__() is needed


_ONE_SYMBOL_PRESENT = """
import ctypes, llvmlite.binding as llvm
from fastbwd.kernels import _halfcalls
assert not any(llvm.address_of_symbol(name) for name in _halfcalls.NAMES), "the process has them"
present = ctypes.cast(ctypes.CDLL(None).abs, ctypes.c_void_p).value  # any address: never called
llvm.add_symbol(PRESENT, present)
_halfcalls.provide()
assert _halfcalls._engine, "provide() did nothing: one of the two symbols was still missing"
assert llvm.address_of_symbol(PRESENT) == present, "provide() replaced the symbol already there"
missing = [name for name in _halfcalls.NAMES if name != PRESENT][0]
assert llvm.address_of_symbol(missing) == _halfcalls._engine.get_function_address("fastbwd_" + missing.lstrip("_"))
print("ok")
"""


@pytest.mark.parametrize("present", _halfcalls.NAMES)
def test_provide_defines_only_the_symbol_that_is_missing(present):
    """With one of the two symbols already defined (by the process or another library), provide()
    defines the other and leaves that one alone. A process of its own: LLVM's symbols are global."""
    done = subprocess.run(
        [sys.executable, "-c", f"PRESENT = {present!r}\n" + _ONE_SYMBOL_PRESENT],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


_LANES_PROGRAM = textwrap.dedent("""
    import numba, numpy as np
    from fastbwd.kernels import _group_norm_forward as forward
    from fastbwd.kernels._halfbits import FLOAT16, store

    @numba.njit
    def stored(values, fmt):  # _halfbits' float16 store alone (no load to provide the calls)
        out = np.empty(values.size, np.uint16)
        for i in range(values.size):
            out[i] = store(values[i], fmt)
        return out

    @numba.njit
    def affine(x, mean, rstd, gamma, beta, fmt):  # _lanes' float16 vectors, before any kernel
        out = np.empty(x.size, np.uint16)
        forward._affine_rows(x, 0, x.size, 37, out, 0, mean, rstd, gamma, beta, fmt, fmt)
        return out

    def result(which):  # one of them per process: the first compiled provides for both
        rng = np.random.default_rng(11)
        if which == "stored":
            return stored(rng.uniform(-7e4, 7e4, 50).astype(np.float32), FLOAT16)
        x = rng.uniform(-3, 3, 74).astype(np.float16).view(np.uint16)
        gamma, beta = rng.uniform(-2, 2, 2).astype(np.float32), rng.uniform(-1, 1, 2).astype(np.float32)
        return affine(x, np.float32(0.25), np.float32(1.5), gamma, beta, FLOAT16)
""")


@pytest.mark.parametrize("which", ["stored", "affine"])
def test_generic_target_compiles_float16_conversions_before_any_kernel(tmp_path, which):
    """njit functions of one's own storing float16 (_halfbits' store alone) and using _lanes'
    float16 vector conversions (a kernel's row step), compiled under NUMBA_CPU_NAME=generic before
    any kernel is built, run and give this process's bits: every half_type, scalar or vector,
    provides the F16C-less calls (tools/mutants/nan_audit.toml)."""
    out = tmp_path / "generic.npy"
    child_env = dict(os.environ, NUMBA_CPU_NAME="generic")
    child_env.pop("NUMBA_CPU_FEATURES", None)
    done = subprocess.run(
        [sys.executable, "-c", _LANES_PROGRAM + f"np.save({str(out)!r}, result({which!r}))\n"],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    namespace = {}
    exec(_LANES_PROGRAM, namespace)
    assert np.array_equal(np.load(out), namespace["result"](which))
