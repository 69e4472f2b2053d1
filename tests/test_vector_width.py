"""kernels._jit.wide_vectors: the LLVM function it is called in prefers the widest vectors, and
the width changes no result (docs/design.md, "Vector width")."""

import numba.core.config
import numpy as np
import pytest
from llvmlite import binding as llvm

from fastbwd.kernels._jit import helper, wide_vectors

ATTRIBUTE = '"prefer-vector-width"="512"'


def _scaled(wide):
    """A loop compiled with the kernels' options (IEEE division: it vectorises)."""

    def scaled(values, factor, result):
        if wide:
            wide_vectors()
        for i in range(values.shape[0]):
            result[i] = values[i] / (factor + values[i] * values[i])

    return helper(scaled)


def test_wide_vectors_marks_the_calling_function_only():
    values = np.linspace(-3, 3, 1001, dtype=np.float32)
    args = (values, np.float32(1.5), np.empty_like(values))
    wide, plain = _scaled(True), _scaled(False)
    wide(*args)
    plain(*args)
    assert any(ATTRIBUTE in ir for ir in wide.inspect_llvm().values())
    assert not any(ATTRIBUTE in ir for ir in plain.inspect_llvm().values())


def test_wide_vectors_changes_no_bit():
    rng = np.random.default_rng(0)
    values = rng.standard_normal(4099).astype(np.float32) * np.float32(1e3)
    results = []
    for wide in (True, False):
        result = np.empty_like(values)
        _scaled(wide)(values, np.float32(0.25), result)
        results.append(result)
    assert np.array_equal(results[0].view(np.uint32), results[1].view(np.uint32))


# flatten() lists every feature with "+" or "-": ask for the feature itself. Numba's target is
# the host's unless NUMBA_CPU_NAME names another (generic, x86-64-v3: no 512-bit registers)
_TARGET_HAS_AVX512 = numba.core.config.CPU_NAME in (None, "host") and llvm.get_host_cpu_features().get("avx512f", False)


@pytest.mark.skipif(not _TARGET_HAS_AVX512, reason="needs an AVX-512 target")
def test_wide_vectors_uses_512_bit_registers_on_avx512():
    values = np.ones(1024, np.float32)
    wide = _scaled(True)
    wide(values, np.float32(1.0), np.empty_like(values))
    assert any("zmm" in asm for asm in wide.inspect_asm().values())
