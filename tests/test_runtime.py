"""Safe from any caller (docs/semantics.md §0.3), caching without failing, and a clean import.

Each scenario runs in a fresh subprocess with a time limit: the failures guarded against here
(Numba's workqueue layer aborting on concurrent parallel calls, GNU OpenMP terminating a forked
child, a hang) would otherwise take the test process down with them.
"""

import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest
from numba import get_num_threads, prange

from fastbwd.kernels import _jit

from conftest import ROOT, child_environment

_PRELUDE = """
import sys, threading
import numpy as np
import fastbwd

def case(seed):
    rng = np.random.default_rng(seed)
    grad_output = rng.standard_normal((3, 8, 41, 37)).astype(np.float32)
    return grad_output, (3, 8, 35, 33), (2, 2, 3, 3)

def expected(seed):
    from fastbwd.testing import reference
    grad_output, shape, padding = case(seed)
    return reference.replication_pad2d_backward(grad_output, shape, padding)
"""


def run_script(body, env=None, timeout=240):
    script = textwrap.dedent(_PRELUDE) + textwrap.dedent(body)
    environment = child_environment(**(env or {}))
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=environment, cwd=ROOT
    )
    assert completed.returncode == 0, (
        f"exit {completed.returncode}\nstdout:\n{completed.stdout}\nstderr:\n{completed.stderr}"
    )
    return completed.stdout


_CONCURRENT = """
results = {}
errors = []
def worker(index):
    try:
        for repeat in range(25):
            grad_output, shape, padding = case(index)
            results[index, repeat] = fastbwd.replication_pad2d_backward(grad_output, shape, padding)
    except BaseException as error:  # pragma: no cover - reported below
        errors.append(repr(error))
threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
for (index, repeat), result in results.items():
    assert np.allclose(result, expected(index), rtol=1e-5, atol=1e-5), (index, repeat)
    assert result.tobytes() == results[index, 0].tobytes()
from fastbwd.kernels._jit import threading_layer
print("layer", threading_layer())
"""


@pytest.mark.parametrize("layer", [pytest.param("workqueue", marks=pytest.mark.slow), "omp"])
def test_eight_python_threads_at_once(layer):
    out = run_script(_CONCURRENT, env={"NUMBA_THREADING_LAYER": layer})
    assert f"layer {layer}" in out


_FORK = """
import os
grad_output, shape, padding = case(1)
parent = fastbwd.replication_pad2d_backward(grad_output, shape, padding)  # starts the thread pool
pid = os.fork()
if pid == 0:
    try:
        child = fastbwd.replication_pad2d_backward(grad_output, shape, padding)
        ok = child.tobytes() == parent.tobytes()
    except BaseException:
        ok = False
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
# the parent still runs in parallel afterwards
assert fastbwd.replication_pad2d_backward(grad_output, shape, padding).tobytes() == parent.tobytes()
print("fork ok")
"""


@pytest.mark.parametrize("layer", ["omp", pytest.param("workqueue", marks=pytest.mark.slow)])
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_call_in_a_forked_child(layer):
    assert "fork ok" in run_script(_FORK, env={"NUMBA_THREADING_LAYER": layer})


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_multiprocessing_fork_pool():
    body = """
    import multiprocessing as mp
    grad_output, shape, padding = case(2)
    parent = fastbwd.replication_pad2d_backward(grad_output, shape, padding)
    def work(_):
        return fastbwd.replication_pad2d_backward(grad_output, shape, padding).tobytes()
    with mp.get_context("fork").Pool(2) as pool:
        assert all(r == parent.tobytes() for r in pool.map(work, range(4)))
    print("pool ok")
    """
    assert "pool ok" in run_script(body)


@pytest.mark.slow
def test_runs_without_a_writable_cache_folder():
    body = """
    import numba.core.caching as caching
    caching.CacheImpl._locator_classes = []   # as if no cache folder were writable anywhere
    grad_output, shape, padding = case(3)
    result = fastbwd.replication_pad2d_backward(grad_output, shape, padding)
    assert np.allclose(result, expected(3), rtol=1e-5, atol=1e-5)
    print("no cache ok")
    """
    assert "no cache ok" in run_script(body)


def test_cache_dir_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    body = """
    grad_output, shape, padding = case(4)
    assert np.allclose(fastbwd.replication_pad2d_backward(grad_output, shape, padding), expected(4), rtol=1e-5, atol=1e-5)
    print("bad cache dir ok")
    """
    assert "bad cache dir ok" in run_script(body, env={"NUMBA_CACHE_DIR": str(blocker / "cache")})


@pytest.mark.slow
def test_serial_switch():
    body = """
    import numba.np.ufunc.parallel as parallel
    grad_output, shape, padding = case(5)
    result = fastbwd.replication_pad2d_backward(grad_output, shape, padding)
    assert np.allclose(result, expected(5), rtol=1e-5, atol=1e-5)
    # NHWC GroupNorm+Swish sizes its tasks by the thread count: serial mode counts one thread
    from fastbwd.kernels._jit import thread_count
    assert thread_count() == 1
    x = np.ones((2, 3, 3, 4), np.float32)
    dx = fastbwd.group_norm_swish_backward(x, np.zeros((2, 2), np.float32), np.ones((2, 2), np.float32), x,
                                           np.ones(4, np.float32), np.zeros(4, np.float32), 2, "NHWC")[0]
    assert np.isfinite(dx).all()
    assert not parallel._is_initialized, "FASTBWD_SERIAL=1 must never start the thread pool"
    print("serial ok")
    """
    assert "serial ok" in run_script(body, env={"FASTBWD_SERIAL": "1"})


def test_import_compiles_nothing_and_never_imports_torch():
    body = """
    import gc
    from fastbwd.kernels._jit import Kernel
    kernels = [o for o in gc.get_objects() if isinstance(o, Kernel)]
    assert kernels, "expected the kernel objects to exist"
    assert all(k._parallel is None and k._serial is None for k in kernels), "a kernel was built at import"
    assert "torch" not in sys.modules
    import numba.np.ufunc.parallel as parallel
    assert not parallel._is_initialized
    print("clean import", len(kernels))
    """
    assert "clean import" in run_script(body)


_EVERY_KERNEL_PATH = """
from fastbwd.testing import reference as ref
from bench.inputs import roi_boxes
rng = np.random.default_rng(0)

def close(actual, want):
    actual = np.asarray(actual, np.float64)
    assert np.allclose(actual, want, rtol=1e-4, atol=1e-4), np.abs(actual - want).max()

# upsample: row blocks reading in place (OW >= 16, prefetching), staged narrow rows, NHWC with
# 16+ and fewer channels, 16 planes at a time (>= 128 small planes)
for n, c, h, w, oh, ow in [(1, 3, 20, 70, 45, 130), (2, 3, 9, 13, 7, 11), (1, 130, 5, 6, 9, 11)]:
    g = rng.standard_normal((n, c, oh, ow)).astype(np.float32)
    want = ref.upsample_bilinear2d_backward(g, (oh, ow), (n, c, h, w), False)
    close(fastbwd.upsample_bilinear2d_backward(g, (oh, ow), (n, c, h, w)), want)
    for channels in (c, 19):
        g = rng.standard_normal((n, channels, oh, ow)).astype(np.float32)
        want = ref.upsample_bilinear2d_backward(g, (oh, ow), (n, channels, h, w), True)
        nhwc = fastbwd.upsample_bilinear2d_backward(np.ascontiguousarray(g.transpose(0, 2, 3, 1)), (oh, ow),
                                                    (n, channels, h, w), True, layout="NHWC")
        close(nhwc.transpose(0, 3, 1, 2), want)
# avg_pool: row blocks, and the global kernel
g = rng.standard_normal((2, 3, 18, 20)).astype(np.float32)
close(fastbwd.avg_pool2d_backward(g, (2, 3, 36, 40), 3, 2, 1, False, False),
      ref.avg_pool2d_backward(g, (2, 3, 36, 40), (3, 3), (2, 2), (1, 1), False, False))
g = rng.standard_normal((2, 5, 1, 1)).astype(np.float32)
close(fastbwd.avg_pool2d_backward(g, (2, 5, 7, 7), 7, 1, 0, False, True),
      ref.avg_pool2d_backward(g, (2, 5, 7, 7), (7, 7), (1, 1), (0, 0), False, True))
# pad
grad_output, shape, padding = case(1)
close(fastbwd.replication_pad2d_backward(grad_output, shape, padding), expected(1))
# group_norm_swish, both layouts, a spatial size that is no multiple of 16
x = rng.standard_normal((2, 8, 7, 9)).astype(np.float32)
dy = rng.standard_normal(x.shape).astype(np.float32)
gamma, beta = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
mean = rng.standard_normal((2, 4)).astype(np.float32) * 0.1
rstd = (1 + rng.random((2, 4))).astype(np.float32)
expected_gns = ref.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, 4)
for result, want in zip(fastbwd.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, 4), expected_gns):
    close(result, want)
nhwc = fastbwd.group_norm_swish_backward(np.ascontiguousarray(dy.transpose(0, 2, 3, 1)), mean, rstd,
                                         np.ascontiguousarray(x.transpose(0, 2, 3, 1)), gamma, beta, 4,
                                         data_format="NHWC")
close(nhwc[0].transpose(0, 3, 1, 2), expected_gns[0])
# group_norm_swish (the forward): both layouts, a group of several blocks, without Swish too
for shape, groups, swish in (((2, 8, 7, 9), 4, True), ((1, 2, 70, 65), 1, False)):
    x = rng.standard_normal(shape).astype(np.float32)
    gamma, beta = rng.standard_normal(shape[1]).astype(np.float32), rng.standard_normal(shape[1]).astype(np.float32)
    want = ref.group_norm_swish_forward(x, gamma, beta, groups, activate_swish=swish)
    for result, expect in zip(fastbwd.group_norm_swish(x, gamma, beta, groups, activate_swish=swish), want):
        close(result, expect)
    nhwc = fastbwd.group_norm_swish(np.ascontiguousarray(np.moveaxis(x, 1, -1)), gamma, beta, groups, "NHWC",
                                    activate_swish=swish)
    close(np.moveaxis(nhwc[0], -1, 1), want[0])
# roi_align, fixed and adaptive sampling
shape = (2, 5, 20, 24)
boxes = roi_boxes(12, shape, 0.5)
g = rng.standard_normal((12, 5, 3, 3)).astype(np.float32)
for ratio in (2, 0):
    close(fastbwd.roi_align_backward(g, boxes, shape, 3, 3, 0.5, ratio, True),
          ref.roi_align_backward(g, boxes, shape, 3, 3, 0.5, ratio, True))
# roi_align register tiles: 37 channels (two tiles and a rest), bin rows of 18 (a full and a
# partial tile)
shape = (2, 37, 20, 24)
g = rng.standard_normal((12, 37, 2, 18)).astype(np.float32)
close(fastbwd.roi_align_backward(g, boxes, shape, 2, 18, 0.5, 2, True),
      ref.roi_align_backward(g, boxes, shape, 2, 18, 0.5, 2, True))
print("ok")
"""


#: The bounds-checked kernels' disk cache: a folder of their own (the ordinary cache holds kernels
#: compiled without the checks), so each kernel compiles with them once, not on every run. Under
#: ``FASTBWD_CACHE=0`` (the mutation check) they compile afresh.
BOUNDSCHECK_CACHE = os.path.join(ROOT, "tests", "__pycache__", "numba-boundscheck")


@pytest.mark.slow
def test_every_kernel_path_within_bounds():
    # Compiled with Numba's bounds checks on: an out-of-bounds index anywhere in a kernel
    # raises instead of corrupting memory. (It caught a scratch size that Numba's allocation
    # hoisting got wrong; the intrinsics of kernels._lanes and kernels._memory are not checked.)
    assert "ok" in run_script(
        _EVERY_KERNEL_PATH, env={"NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": BOUNDSCHECK_CACHE}, timeout=900
    )


_MORE_THREADS_THAN_CORES = """
import itertools, numba, os
import ml_dtypes
from bench.inputs import channels_last, roi_boxes
sys.path.insert(0, "tests")
from conftest import assert_thread_invariant, thread_counts

assert numba.config.NUMBA_NUM_THREADS == 4 and thread_counts() == [1, 2, 3, 4], thread_counts()
# the check itself can fail: a result that depends on the thread count (4 vs 1) is flagged
try:
    assert_thread_invariant(lambda: np.array([min(numba.get_num_threads(), 4) // 4]))
except AssertionError:
    pass
else:
    raise SystemExit("assert_thread_invariant missed a difference at 4 threads")
rng = np.random.default_rng(0)
BF16 = np.dtype(ml_dtypes.bfloat16)
checked = 0
# the dtypes this run checks (the test's parameter)
DTYPES = [BF16 if name == "bfloat16" else np.dtype(name) for name in os.environ["FASTBWD_TEST_DTYPES"].split()]

def invariant(call):
    global checked
    assert_thread_invariant(call)
    checked += 1

def nhwc(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))

for dtype in [dtype for dtype in DTYPES if dtype.kind != "c"]:
    # upsample: row blocks read in place (OW >= 16), staged narrow rows, 16 planes at a time
    # (>= 128 small planes), NHWC with >= 16 and < 16 channels, channels-last strides
    for (n, c, h, w), (oh, ow), corners in [((1, 3, 37, 21), (70, 45), False), ((2, 3, 9, 13), (7, 11), True),
                                            ((1, 130, 5, 6), (9, 11), False)]:
        g = rng.standard_normal((n, c, oh, ow)).astype(dtype)
        invariant(lambda: fastbwd.upsample_bilinear2d_backward(g, (oh, ow), (n, c, h, w), corners))
        invariant(lambda: fastbwd.upsample_bilinear2d_backward(channels_last(g), (oh, ow), (n, c, h, w), corners))
        for channels in (c, 5):
            gc = rng.standard_normal((n, oh, ow, channels)).astype(dtype)
            invariant(lambda: fastbwd.upsample_bilinear2d_backward(gc, (oh, ow), (n, channels, h, w), corners,
                                                                  1.7, 0.0, layout="NHWC"))
    # avg_pool: the separable engine both layouts, the global kernels both layouts
    g = rng.standard_normal((2, 3, 19, 16)).astype(dtype)
    invariant(lambda: fastbwd.avg_pool2d_backward(g, (2, 3, 37, 29), (3, 4), 2, (1, 2), True, False))
    invariant(lambda: fastbwd.avg_pool2d_backward(channels_last(g), (2, 3, 37, 29), (3, 4), 2, (1, 2), True, False))
    g1 = rng.standard_normal((3, 37, 1, 1)).astype(dtype)
    invariant(lambda: fastbwd.avg_pool2d_backward(g1, (3, 37, 6, 7), (6, 7)))
    invariant(lambda: fastbwd.avg_pool2d_backward(g1, channels_last(np.zeros((3, 37, 6, 7), dtype)), (6, 7)))
    # roi_align: fixed and adaptive sampling, several channel blocks and bands
    shape = (2, 70, 40, 36)
    boxes = roi_boxes(24, shape, 0.5, dtype=dtype)
    g = rng.standard_normal((24, 70, 3, 4)).astype(dtype)
    for ratio in (2, 0):
        invariant(lambda: fastbwd.roi_align_backward(g, boxes, shape, 3, 4, 0.5, ratio, True))
    # group_norm_swish: NCHW and NHWC (whose tasks are sized by the thread count), parameters
    # in the data's dtype and in float32
    x = rng.standard_normal((3, 64, 9, 7)).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    mean = (0.1 * rng.standard_normal((3, 16))).astype(dtype)
    rstd = rng.uniform(0.5, 2, (3, 16)).astype(dtype)
    for param in {np.dtype(dtype), np.dtype(np.float32)}:
        gamma = rng.uniform(-1.5, 1.5, 64).astype(param)
        beta = rng.standard_normal(64).astype(param)
        invariant(lambda: fastbwd.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, 16, swish_scale=1.5))
        invariant(lambda: fastbwd.group_norm_swish_backward(nhwc(dy), mean, rstd, nhwc(x), gamma, beta, 16, "NHWC",
                                                            swish_scale=1.5))
        invariant(lambda: fastbwd.group_norm_swish(x, gamma, beta, 16, swish_scale=1.5))
        invariant(lambda: fastbwd.group_norm_swish(nhwc(x), gamma, beta, 16, "NHWC", swish_scale=1.5))

# replication_pad: both layouts, every dtype including complex
for dtype in DTYPES:
    g = (rng.standard_normal((2, 5, 23, 31)) * (1 + 1j if np.dtype(dtype).kind == "c" else 1)).astype(dtype)
    invariant(lambda: fastbwd.replication_pad2d_backward(g, (2, 5, 18, 26), (3, 2, 4, 1)))
    invariant(lambda: fastbwd.replication_pad2d_backward(channels_last(g), (2, 5, 18, 26), (3, 2, 4, 1)))
    invariant(lambda: fastbwd.replication_pad2d_backward(g, (2, 5, 26, 33), (-1, -1, -2, -1)))
print("threads ok", checked)
"""


@pytest.mark.parametrize(
    "dtypes",
    # float32 in the quick set (each of its kernel paths compiles in the child: the others' would
    # be most of a cold quick run's compiling), the other dtypes in the slow set
    ["float32", pytest.param("float64 float16 bfloat16 complex64 complex128", marks=pytest.mark.slow)],
    ids=["float32", "other dtypes"],
)
def test_more_threads_than_cores_give_the_same_bits(dtypes):
    # NUMBA_NUM_THREADS is 2 on the 2-core CI machine, so in-process tests compare 1 and 2
    # threads only. Here 4 threads (more than the cores) and 3 (uneven shares) in a subprocess,
    # every operator, every dtype (quick and slow sets together), both layouts and each kernel path.
    env = {"NUMBA_NUM_THREADS": "4", "FASTBWD_TEST_DTYPES": dtypes}
    out = run_script(_MORE_THREADS_THAN_CORES, env=env, timeout=900)
    assert "threads ok" in out


@_jit.parallel_kernel
def _team_sizes(out):
    for i in prange(out.shape[0]):
        out[i] = get_num_threads()


@pytest.mark.filterwarnings("ignore:Cannot cache compiled function")  # get_num_threads in nopython
def test_small_calls_stay_on_the_calling_thread():
    """A call whose work is below ONE_THREAD_BELOW runs its parallel code on one thread (as
    PyTorch does below its grain size); a larger one on all of them; the count is restored."""
    if numba.get_num_threads() < 2:
        pytest.skip("needs two threads")
    team_sizes = _team_sizes
    out = np.zeros(64, np.int64)
    threads = numba.get_num_threads()
    team_sizes(out, work=_jit.ONE_THREAD_BELOW - 1)
    assert set(out) == {1} and numba.get_num_threads() == threads
    team_sizes(out, work=_jit.ONE_THREAD_BELOW)
    assert set(out) == {threads}
    team_sizes(out)
    assert set(out) == {threads}


@_jit.parallel_kernel
def _thread_ids(out):
    for i in prange(out.shape[0]):
        out[i] = numba.get_thread_id()


@pytest.mark.filterwarnings("ignore:Cannot cache compiled function")  # get_thread_id in nopython
def test_launches_run_the_serial_twin_below_the_threshold(monkeypatch):
    """A planned launch runs the serial twin on the calling thread when its work is below
    ONE_THREAD_BELOW and the parallel kernel on the pool from there; the serial switch (after
    fork, FASTBWD_SERIAL) makes every launch, planned before or after, run the twin."""
    if numba.get_num_threads() < 2:
        pytest.skip("needs two threads")
    out = np.zeros(64, np.int64)
    small = _jit.Launch(_thread_ids, _jit.ONE_THREAD_BELOW - 1, read_only=())
    large = _jit.Launch(_thread_ids, _jit.ONE_THREAD_BELOW, read_only=())
    assert not small.parallel and large.parallel
    small(out)
    assert set(out) == {0} and _thread_ids._serial is not None
    large(out)
    assert len(set(out)) > 1  # each thread gets a static share of the 64 iterations
    monkeypatch.setattr(_jit, "_serial_only", True)
    out[:] = -1
    large(out)
    assert set(out) == {0}
