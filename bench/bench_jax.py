"""JAX-bridge benchmarks J1-J6: ``jax.jit(jax.grad(loss))`` through fastbwd.jax against the same
forward differentiated by JAX (same process), and the transport's per-call cost."""

import functools

import numba
import pytest

pytest.importorskip("jax")

from .jax_cases import cases, transport_overhead  # noqa: E402

#: J1-J6's ids, the same at both sizes.
CASE_IDS = [case.id for case in cases(quick=True)]


@functools.cache
def _cases(quick):
    """The cases at one size, built on first use: the benchmark shapes, or the smoke run's small ones."""
    return {case.id: case for case in cases(quick=quick)}


@pytest.mark.parametrize("variant", ["fastbwd", "jax"])
@pytest.mark.parametrize("case_id", CASE_IDS)
def bench_jax_bridge(case_id, variant, benchmark, smoke):
    case = _cases(smoke)[case_id]
    function = getattr(case, variant)
    if function is None:
        pytest.skip(f"{case.id}: JAX has no such operator to compare with")
    if variant == "fastbwd":
        case.check()  # gradients agree with JAX's own before anything is timed
    function()  # warm-up (compiles)
    benchmark.group = f"{case.id} {case.label}"
    benchmark.extra_info.update(case=case.id, variant=variant, target=case.target, threads=numba.get_num_threads())
    benchmark.pedantic(function, rounds=10, warmup_rounds=1, iterations=1)


@pytest.mark.parametrize("variant", ["1 call", "11 calls"])
def bench_transport_overhead(variant, benchmark):
    function = transport_overhead()[variant]
    function()
    benchmark.group = "fastbwd.jax transport: jitted programs of 1 and 11 chained no-op FFI calls on 4 KB"
    benchmark.extra_info.update(variant=variant)
    benchmark.pedantic(function, rounds=200, warmup_rounds=5, iterations=1)
