"""Shared pytest-benchmark plumbing for bench/bench_*.py.

Each benchmark file parametrises over its operator's cases (``benchutil.op_cases``) and calls
the ``measure`` fixture, which compiles first (a warm-up call outside the timing), times
the callable, and records threads, threading layer and GB/s in ``extra_info``. Each case is a
benchmark group: fastbwd's calls beside their baselines (PyTorch's, or JAX's own gradient).
With ``--benchmark-disable`` (the default in pyproject.toml) every benchmark runs once as a smoke
test, on small shapes (the ``smoke`` fixture); ``--benchmark-enable`` times the benchmark shapes,
or with ``--small-shapes`` the smoke run's small ones (a quick comparison between two commits).
"""

import numba
import pytest

from fastbwd.kernels._jit import threading_layer


@pytest.fixture
def measure(benchmark):
    def run(case, function, nbytes, variant):
        function()  # warm-up: compile and fault in pages outside the timing
        benchmark.group = f"{case.id} {case.dtype}"
        benchmark.extra_info.update(
            case=case.id,
            label=case.label,
            dtype=case.dtype,
            variant=variant,
            threads=numba.get_num_threads(),
            threading_layer=threading_layer(),
            nbytes=nbytes,
        )
        benchmark.pedantic(function, rounds=15, warmup_rounds=1, iterations=1)
        stats = getattr(benchmark, "stats", None)
        if stats is not None:  # absent when benchmarks are disabled (smoke run)
            benchmark.extra_info["gbps"] = nbytes / stats.stats.median / 1e9

    return run


def pytest_addoption(parser):
    parser.addoption(
        "--small-shapes",
        action="store_true",
        help="fastbwd benchmarks: time the smoke run's small shapes instead of the benchmark shapes",
    )


@pytest.fixture
def smoke(benchmark, request):
    """True when the cases take small shapes: when the benchmarks run once each as a smoke test
    (pytest-benchmark disabled, as ``python -m pytest`` runs them), or with ``--small-shapes``."""
    return not benchmark.enabled or request.config.getoption("small_shapes", default=False)
