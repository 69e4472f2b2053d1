"""JAX-bridge benchmarks J1-J5: ``jax.jit(jax.grad(loss))`` through fastbwd.jax against the same
forward differentiated by JAX (same process), and the transport's per-call cost."""

import numba
import pytest

pytest.importorskip("jax")

from fastbwd.testing.jax_cases import cases, transport_overhead  # noqa: E402

CASES = {case.id: case for case in cases()}


@pytest.mark.parametrize("variant", ["fastbwd", "jax"])
@pytest.mark.parametrize("case_id", list(CASES))
def bench_jax_bridge(case_id, variant, benchmark):
    case = CASES[case_id]
    function = getattr(case, variant)
    if function is None:
        pytest.skip(f"{case.id}: JAX has no such operator to compare with")
    if variant == "fastbwd":
        case.check()  # gradients agree with JAX's own before anything is timed
    function()  # warm-up (compiles)
    benchmark.group = f"{case.id} {case.label}"
    benchmark.extra_info.update(case=case.id, variant=variant, target=case.target,
                                threads=numba.get_num_threads())
    benchmark.pedantic(function, rounds=10, warmup_rounds=1, iterations=1)


@pytest.mark.parametrize("variant", ["1 call", "11 calls"])
def bench_transport_overhead(variant, benchmark):
    function = transport_overhead()[variant]
    function()
    benchmark.group = "fastbwd.jax transport: jitted programs of 1 and 11 chained no-op FFI calls on 4 KB"
    benchmark.extra_info.update(variant=variant)
    benchmark.pedantic(function, rounds=200, warmup_rounds=5, iterations=1)
