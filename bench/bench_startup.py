"""Start-up costs (foundation issue targets): import time, cold compile, first call from a warm cache.

Each measurement runs in a fresh interpreter; the interesting number is printed by the child
and recorded in ``extra_info["seconds"]`` (pytest-benchmark's own timing is of the whole child).
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_FIRST_CALL = """
import time
t0 = time.perf_counter()
import numpy as np
import fastbwd
g = np.ones((2, 3, 7, 8), np.float32)
t1 = time.perf_counter()
fastbwd.replication_pad2d_backward(g, (2, 3, 5, 4), (2, 2, 1, 1))
t2 = time.perf_counter()
print(t1 - t0, t2 - t1, t2 - t0)
"""


def _child(code, env=None):
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    environment.update(env or {})
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, check=True, cwd=ROOT
    )
    return [float(x) for x in result.stdout.split()]


def _import_seconds(module):
    return _child(f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)")[0]


@pytest.fixture
def record(benchmark):
    def run(name, measure):
        benchmark.group = "startup"
        values = []
        benchmark.pedantic(lambda: values.append(measure()), rounds=3, iterations=1)
        values.sort()
        benchmark.extra_info.update(what=name, seconds=values[len(values) // 2])
        return values[len(values) // 2]

    return run


def bench_import_numba(record):
    record("import numba", lambda: _import_seconds("numba"))


def bench_import_fastbwd(record):
    # fastbwd imports numba: the difference with bench_import_numba is fastbwd's own cost (target <= 0.3 s)
    record("import fastbwd", lambda: _import_seconds("fastbwd"))


@pytest.mark.slow
def bench_cold_compile(record):
    # in-memory compile of one operator for one dtype (no disk cache): target <= 3 s
    record("cold compile (pad, float32)", lambda: _child(_FIRST_CALL, {"FASTBWD_CACHE": "0"})[1])


@pytest.mark.slow
def bench_warm_first_call(record):
    # import + first call, the compiled code loaded from the disk cache: target <= 1 s
    _child(_FIRST_CALL)  # make sure the cache is populated
    record("import + first call, warm cache", lambda: _child(_FIRST_CALL)[2])
