"""PyTorch-bridge benchmarks T1-T9 (fastbwd.torch against plain PyTorch, same thread count), and O4/O5
(fastbwd's GroupNorm+Swish called directly on a tiny input against PyTorch's own ops).

Nothing is built when pytest collects this file: the cases are built on first use, each
parametrised by ids known beforehand. As a smoke run (``python -m pytest``) the quick set runs
one case of each kind of benchmark, the slow set the others (docs/testing.md)."""

import contextlib
import functools

import numba
import pytest

torch = pytest.importorskip("torch")

import fastbwd.torch as ft  # noqa: E402

from .torch_cases import (  # noqa: E402
    CASE_IDS,
    cases,
    compile_cases,
    direct_cases,
    measure_overhead,
    overhead_cases,
    prepared_cases,
)


def _one_of_each(ids, quick):
    """``ids`` as parameters, those outside ``quick`` in the slow set."""
    return [case_id if case_id in quick else pytest.param(case_id, marks=pytest.mark.slow) for case_id in ids]


@functools.cache
def _case(quick, case_id):
    """One case at one size, built on first use: the benchmark shapes, or the smoke run's small ones."""
    (case,) = cases(quick=quick, ids=[case_id])
    return case


@functools.cache
def _compile_cases(quick):
    return {case.id: case for case in compile_cases(quick=quick)}


@pytest.fixture(scope="module", autouse=True)
def _same_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(numba.get_num_threads())
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("variant", ["fastbwd", "torch"])
@pytest.mark.parametrize("case_id", _one_of_each(CASE_IDS, quick={"T1"}))
def bench_torch_bridge(case_id, variant, benchmark, smoke):
    case = _case(smoke, case_id)
    if variant == "fastbwd":
        case.check()  # gradients agree with plain PyTorch before anything is timed
    function = getattr(case, variant)
    function()  # warm-up (compiles)
    benchmark.group = f"{case.id} {case.label}"
    benchmark.extra_info.update(case=case.id, variant=variant, target=case.target, threads=numba.get_num_threads())
    benchmark.pedantic(function, rounds=10, warmup_rounds=1, iterations=1)


#: C1-C9's ids: models under torch.compile (Inductor compiles each twice: slow even when small).
COMPILE_IDS = ["C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8", "C9"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["fastbwd", "torch"])
@pytest.mark.parametrize("case_id", COMPILE_IDS)
def bench_torch_compile(case_id, variant, benchmark, smoke):
    case = _compile_cases(smoke)[case_id]
    if variant == "fastbwd":
        case.check()  # gradients agree with eager before anything is timed
    function = getattr(case, variant)
    function()  # warm-up (compiles)
    benchmark.group = f"{case.id} {case.label}"
    benchmark.extra_info.update(case=case.id, variant=variant, target=case.target, threads=numba.get_num_threads())
    benchmark.pedantic(function, rounds=10, warmup_rounds=1, iterations=1)


# ---- two thread pools on one machine ----------------------------------------------------------
# A training step alternates PyTorch ops (its intra-op pool) and fastbwd kernels (Numba's pool).
# "alternating" runs one conv and one fastbwd backward back to back; compared with the two run
# apart ("torch op", "fastbwd op"), it shows whether either pool slows the other.


def _pool_workloads(smoke):
    import numpy as np
    from torch.nn import functional as F

    import fastbwd

    n, c, size = (2, 8, 16) if smoke else (8, 64, 64)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, size, size, generator=generator)
    weight = torch.randn(c, c, 3, 3, generator=generator)
    grad = np.random.default_rng(0).standard_normal((n, c, 2 * size, 2 * size)).astype(np.float32)
    out = np.empty((n, c, size, size), np.float32)

    def torch_op():
        return F.conv2d(x, weight, padding=1)

    def fastbwd_op():
        return fastbwd.upsample_bilinear2d_backward(grad, (2 * size, 2 * size), (n, c, size, size), False, out=out)

    return {"torch op": torch_op, "fastbwd op": fastbwd_op, "alternating": lambda: (torch_op(), fastbwd_op())}


@pytest.mark.parametrize("variant", ["torch op", "fastbwd op", "alternating"])
def bench_two_pools(variant, benchmark, smoke):
    function = _pool_workloads(smoke)[variant]
    function()
    benchmark.group = "two thread pools: conv (8,64,64,64) and upsample backward U1"
    benchmark.extra_info.update(variant=variant, threads=numba.get_num_threads(), torch_threads=torch.get_num_threads())
    benchmark.pedantic(function, rounds=15, warmup_rounds=1, iterations=1)


# ---- per-call overhead of the routing --------------------------------------------------------
# Tiny inputs, where the kernels take a few microseconds: the routed aten call against the direct
# fastbwd call with out= on the same memory (measure_overhead checks they agree bitwise first).

#: The ids of overhead_cases(), direct_cases() and prepared_cases() (checked when they are built);
#: direct_cases() has issue 53's K9 rows (the kernels alone) between O3 and O4.
OVERHEAD_IDS = ("O1", "O2", "O3")
_O_IDS = ("O1", "O2", "O3", "O4", "O5")
_K9_IDS = tuple(f"K9.{index}{suffix}" for index in (1, 2) for suffix in ("", "c", "b"))
DIRECT_IDS = (*_O_IDS[:3], *_K9_IDS, *_O_IDS[3:])
PREPARED_IDS = tuple(f"{case_id}p" for case_id in _O_IDS)


def _by_id(built, ids):
    by_id = {case.id: case for case in built}
    assert tuple(by_id) == ids, f"the cases' ids {tuple(by_id)}, not {ids}: update the ids above"
    return by_id


@functools.cache
def _overhead():
    return _by_id(overhead_cases(), OVERHEAD_IDS)


@pytest.mark.parametrize("way", ["routed", "direct", "torch"])
@pytest.mark.parametrize("case_id", _one_of_each(OVERHEAD_IDS, quick={"O1"}))
def bench_routing_overhead(case_id, way, benchmark):
    """One group per case: the routed aten call, the direct fastbwd call and PyTorch's own kernel."""
    case = _overhead()[case_id]
    if way == "routed":
        # checks first that the routed call is served by fastbwd and equals the direct one bitwise
        us = measure_overhead(case, calls=100)
        benchmark.extra_info.update({f"{k}_us": v for k, v in us.items() if k != "rounds"})
    benchmark.group = f"{case.id} routing overhead: {case.label}"
    benchmark.extra_info.update(case=case.id, label=case.label, variant=way)
    assert not ft.is_enabled()  # "torch" runs PyTorch's own kernel
    with ft.enabled() if way == "routed" else contextlib.nullcontext():
        benchmark.pedantic(case.direct if way == "direct" else case.aten, rounds=200, warmup_rounds=10, iterations=1)


# ---- O1-O5: warm direct calls on tiny inputs against PyTorch's own ops (O1-O3: .grad_input ops) ------


@functools.cache
def _direct():
    return _by_id(direct_cases(), DIRECT_IDS)


@pytest.mark.parametrize("variant", ["fastbwd", "torch"])
@pytest.mark.parametrize("case_id", _one_of_each(DIRECT_IDS, quick={"O1", "K9.1", "O4"}))
def bench_direct_call(case_id, variant, benchmark):
    case = _direct()[case_id]
    if variant == "fastbwd":
        case.check()  # the results agree with PyTorch's before anything is timed
    benchmark.group = f"{case.id} {case.label}"
    benchmark.extra_info.update(case=case.id, variant=variant, target=case.target, threads=numba.get_num_threads())
    benchmark.pedantic(getattr(case, variant), rounds=200, warmup_rounds=10, iterations=1)


# ---- O1p-O5p: the same calls prepared once (issue 46), beside PyTorch's ops and the bare kernel call --


@functools.cache
def _prepared():
    return _by_id(prepared_cases(), PREPARED_IDS)


@pytest.mark.parametrize("variant", ["fastbwd", "torch", "kernel"])
@pytest.mark.parametrize("case_id", _one_of_each(PREPARED_IDS, quick={"O1p"}))
def bench_prepared_call(case_id, variant, benchmark):
    case = _prepared()[case_id]
    if variant == "fastbwd":
        case.check()
    benchmark.group = f"{case.id} {case.label}"
    benchmark.extra_info.update(case=case.id, variant=variant, target=case.target, threads=numba.get_num_threads())
    benchmark.pedantic(getattr(case, variant), rounds=200, warmup_rounds=10, iterations=1)


# ---- T7's fusion: what fuse_group_norm_swish finds in the small UNet, and what it costs ------
# (T7's training steps themselves run in bench_torch_bridge above, from torch_cases.cases()).


def bench_unet_fusion(benchmark):
    """fuse_group_norm_swish on a fresh SmallUNet (one example forward decides): its time, and
    the fused and skipped counts in extra_info."""
    from .models.torch_unet import SmallUNet

    models = iter([SmallUNet() for _ in range(6)])
    example = (torch.randn(1, 3, 16, 16), torch.randn(1, 128))
    reports = []
    benchmark.group = "T7 fusion: fuse_group_norm_swish(SmallUNet(), example inputs)"
    benchmark.pedantic(
        lambda: reports.append(ft.fuse_group_norm_swish(next(models), example)),
        rounds=5,
        warmup_rounds=1,
        iterations=1,
    )
    benchmark.extra_info.update(fused=reports[-1].count, skipped=len(reports[-1].skipped))
    assert reports[-1].count == 15 and not reports[-1].skipped
