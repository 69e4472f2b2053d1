"""JAX-bridge benchmarks J1-J11: ``jax.jit(jax.grad(loss))`` through fastbwd.jax against the same
forward differentiated by JAX (same process), and the transport's per-call cost.

Nothing is built when pytest collects this file: each part of the cases is built on first use,
parametrised by ids known beforehand. As a smoke run (``python -m pytest``) the quick set runs
one operator's row, the slow set the others and the models' (docs/testing.md)."""

import functools

import numba
import pytest

pytest.importorskip("jax")

from .jax_cases import cases, transport_overhead  # noqa: E402

#: The ids of each part of jax_cases.cases(), the same at both sizes (checked when it is built): the
#: models' need Flax (J7, J10, J11) or Equinox (J8), the sharded row two devices.
IDS = {
    "operators": ("J1", "J1b", "J1r", "J1rb", "J2", "J2b", "J3", "J3b", "J4", "J4b", "J5", "J6", "J6b"),
    "models": ("J7", "J7a", "J7b", "J7c", "J7d", "J7e", "J7f", "J10a", "J10b", "J11a", "J11b", "J8"),
    "sharded": ("J9",),
}
QUICK = {"J1"}


@functools.cache
def _cases(quick, part):
    """One part of the cases at one size, built on first use: the benchmark shapes, or the smoke
    run's small ones."""
    built = {case.id: case for case in cases(quick=quick, parts=(part,))}
    assert set(built) <= set(IDS[part]), f"{sorted(set(built) - set(IDS[part]))}: add them to IDS"
    return built


@pytest.mark.parametrize("variant", ["fastbwd", "jax"])
@pytest.mark.parametrize(
    "part, case_id",
    [
        pytest.param(part, case_id, id=case_id, marks=() if case_id in QUICK else pytest.mark.slow)
        for part, ids in IDS.items()
        for case_id in ids
    ],
)
def bench_jax_bridge(part, case_id, variant, benchmark, smoke):
    case = _cases(smoke, part).get(case_id)
    if case is None:
        pytest.skip(f"{case_id} is not built here (it needs Flax, Equinox or two devices)")
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
