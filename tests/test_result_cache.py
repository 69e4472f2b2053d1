"""The result cache (fastbwd/_result_cache.py): large results reuse the memory of dropped ones,
never of one still viewed; every public function's results are the same with and without it."""

import subprocess
import sys
import threading

import ml_dtypes
import numpy as np
import pytest

import fastbwd
from fastbwd import _result_cache as cache
from fastbwd.api import _plans

from conftest import child_environment


@pytest.fixture
def small_cache(monkeypatch):
    """The cache for results of 1 KiB and more, at most 64 KiB kept, empty at the start and end;
    no plan made before (a plan keeps the floor its results were planned under)."""
    monkeypatch.setattr(cache, "SMALLEST", 1024)
    monkeypatch.setattr(cache, "LIMIT", 64 * 1024)
    _clear_plans()
    cache.clear_result_cache()
    yield cache
    _clear_plans()
    cache.clear_result_cache()


def _clear_plans():
    for table in list(_plans._TABLES):
        table.clear()


def _kept():
    """The addresses of the blocks the cache holds."""
    return {raw.ctypes.data for raw in cache._idle.values()}


def _pool_backward(shape=(2, 3, 16, 20)):
    grad_output = np.random.default_rng(0).standard_normal((shape[0], shape[1], shape[2] // 2, shape[3] // 2))
    return lambda: fastbwd.avg_pool2d_backward(grad_output.astype(np.float32), shape, 2)


def test_a_dropped_result_gives_its_memory_to_the_next_one_of_its_size(small_cache):
    call = _pool_backward()
    first = call()
    address, expected = first.ctypes.data, first.copy()
    assert first.nbytes >= cache.SMALLEST and not first.flags.owndata
    del first
    assert cache._idle_bytes == expected.nbytes
    second = call()
    assert second.ctypes.data == address and cache._idle_bytes == 0
    np.testing.assert_array_equal(second, expected)


def test_memory_a_view_still_reads_is_never_reused(small_cache):
    call = _pool_backward()
    result = call()
    address = result.ctypes.data
    view, transposed = result[1], result.transpose(0, 2, 3, 1)
    saved = view.copy()
    del result
    assert cache._idle_bytes == 0  # the views keep the block
    others = [call() for _ in range(3)]
    for other in others:
        assert not np.shares_memory(other, view) and not np.shares_memory(other, transposed)
        other.fill(7.0)
    np.testing.assert_array_equal(view, saved)
    del view, others
    assert address not in _kept()  # the transposed view still holds the first block
    del transposed
    assert address in _kept()


def test_live_results_never_share_memory(small_cache):
    call = _pool_backward()
    results = []
    for _ in range(6):
        results.append(call())
        if len(results) == 4:
            del results[1]  # one block back to the cache, reused by the next call
    for index, a in enumerate(results):
        for b in results[index + 1 :]:
            assert not np.shares_memory(a, b)


def test_a_torch_tensor_over_a_result_keeps_its_memory(small_cache):
    torch = pytest.importorskip("torch")
    call = _pool_backward()
    tensor = torch.from_numpy(call())
    saved = tensor.clone()
    assert cache._idle_bytes == 0
    other = call()
    other.fill(3.0)
    assert torch.equal(tensor, saved)
    del tensor
    assert cache._idle_bytes == other.nbytes


def test_the_bridge_reuses_the_memory_of_dropped_outputs_and_gradients(small_cache):
    torch = pytest.importorskip("torch")
    import fastbwd.torch as ft

    x = torch.randn(2, 32, 8, 8, requires_grad=True)
    module = ft.GroupNormSwish(8, 32)
    grad_output = torch.randn(2, 32, 8, 8)

    def step():
        y = module(x)
        return y, torch.autograd.grad(y, x, grad_output)[0]

    y, grad = step()
    addresses, expected = {y.data_ptr(), grad.data_ptr()}, (y.detach().clone(), grad.clone())
    del y, grad
    y, grad = step()
    assert {y.data_ptr(), grad.data_ptr()} == addresses
    assert torch.equal(y, expected[0]) and torch.equal(grad, expected[1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.complex64])
def test_results_are_plain_writeable_arrays_of_the_asked_shape_and_dtype(small_cache, dtype):
    array = cache.empty((3, 5, 7, 11), dtype)
    assert array.shape == (3, 5, 7, 11) and array.dtype == np.dtype(dtype)
    assert array.flags.c_contiguous and array.flags.writeable and array.flags.aligned
    assert array.ctypes.data % 16 == 0
    array[...] = 1
    assert np.all(array == 1)


def test_small_results_and_results_over_the_limit_are_plain_numpy_arrays(small_cache):
    assert cache.empty((255,), np.float32).flags.owndata  # 1020 bytes, below SMALLEST
    assert not cache.empty((256,), np.float32).flags.owndata
    assert cache.empty((16 * 1024 + 1,), np.float32).flags.owndata  # over LIMIT
    cache.LIMIT = 0
    assert cache.empty((4096,), np.float32).flags.owndata


def test_at_most_the_limit_is_kept_and_the_blocks_kept_longest_make_way(small_cache):
    blocks = [cache.empty((2048 + index,), np.float32) for index in range(8)]  # 8-8.03 KiB each
    sizes = [block.nbytes for block in blocks]
    for index in range(8):
        blocks[index] = None  # dropped in this order
    assert 0 < cache._idle_bytes <= cache.LIMIT
    assert [raw.nbytes for raw in cache._idle.values()] == sizes[1:]  # the eighth pushed out the first
    big = cache.empty((12 * 1024,), np.float32)  # 48 KiB
    del big
    assert cache._idle_bytes <= cache.LIMIT
    assert [raw.nbytes for raw in cache._idle.values()] == sizes[7:] + [48 * 1024]  # 56.03 KiB
    assert sorted(cache._by_size) == [sizes[7], 48 * 1024]
    address = cache._idle[cache._by_size[sizes[7]][0]].ctypes.data
    again = cache.empty((2048 + 7,), np.float32)
    assert again.ctypes.data == address
    assert [raw.nbytes for raw in cache._idle.values()] == [48 * 1024] and list(cache._by_size) == [48 * 1024]


def test_clear_result_cache_frees_every_kept_block(small_cache):
    del [cache.empty((1024,), np.float32) for _ in range(3)][:]
    assert cache._idle_bytes == 3 * 4096
    fastbwd.clear_result_cache()
    assert cache._idle_bytes == 0 and not cache._idle


def test_threads_allocating_and_dropping_at_once_get_their_own_memory(small_cache):
    failures = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(300):
            arrays = [cache.empty((int(rng.integers(256, 1024)),), np.float64) for _ in range(3)]
            for value, array in enumerate(arrays):
                array.fill(seed * 10 + value)
            for value, array in enumerate(arrays):
                if not np.all(array == seed * 10 + value):
                    failures.append(seed)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert cache._idle_bytes <= cache.LIMIT


def _run(code, timeout=120, **environment):
    return subprocess.run(
        [sys.executable, "-c", code],
        env=child_environment(**environment),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("setting", "limit"),
    # a size and a word that is none in the quick set (each a process of its own), the rest in the slow set
    [
        pytest.param("0", 0, marks=pytest.mark.slow),
        ("16", 16 * 2**20),
        pytest.param("0.5", 2**19, marks=pytest.mark.slow),
        ("lots", 256 * 2**20),
        pytest.param("nan", 256 * 2**20, marks=pytest.mark.slow),
        pytest.param("-3", 0, marks=pytest.mark.slow),
    ],
)
def test_the_environment_sets_the_limit(setting, limit):
    done = _run("from fastbwd import _result_cache; print(_result_cache.LIMIT)", FASTBWD_RESULT_CACHE_MB=setting)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == limit


def test_a_forked_child_allocates_even_if_the_lock_was_held_at_the_fork():
    code = """
import os, threading, numpy as np
from fastbwd import _result_cache as cache
from fastbwd.api import _plans
cache.SMALLEST = 1024
held, release = threading.Event(), threading.Event()
def hold():
    with cache._lock:
        held.set(); release.wait()
threading.Thread(target=hold, daemon=True).start()
held.wait()
pid = os.fork()
if pid == 0:
    array = cache.empty((4096,), np.float32)
    del array
    os._exit(0 if cache._idle_bytes == 16384 else 3)
release.set()
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


def test_results_exit_cleanly_with_blocks_alive_at_interpreter_exit():
    code = """
import numpy as np
import fastbwd
keep = fastbwd.avg_pool2d_backward(np.ones((8, 64, 64, 64), np.float32), (8, 64, 128, 128), 2)
dropped = fastbwd.avg_pool2d_backward(np.ones((8, 64, 64, 64), np.float32), (8, 64, 128, 128), 2)
del dropped
print("ok")
"""
    done = _run(code)
    assert done.returncode == 0 and done.stdout.strip() == "ok" and not done.stderr, done.stderr


def test_eviction_among_blocks_of_one_size_keeps_the_index_right(small_cache):
    blocks = [cache.empty((1024,), np.float32) for _ in range(6)]  # 4 KiB each
    addresses = [block.ctypes.data for block in blocks]
    for index in range(6):
        blocks[index] = None  # six kept, the first kept longest
    big = cache.empty((13 * 1024,), np.float32)  # 52 KiB: the three kept longest make way
    del big
    assert cache._idle_bytes == 3 * 4096 + 52 * 1024
    kept = _kept()
    assert addresses[3:] == [address for address in addresses if address in kept]
    again = [cache.empty((1024,), np.float32) for _ in range(4)]  # the three kept, then a new one
    assert [array.ctypes.data for array in again[:3]] == addresses[5:2:-1]
    assert list(cache._by_size) == [52 * 1024] and cache._idle_bytes == 52 * 1024  # the fourth is new


def _first_result(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.parametrize("name", sorted(__import__("test_contract").CONTRACTS))
def test_every_public_function_puts_its_result_in_the_cache(small_cache, name):
    from test_contract import CONTRACTS

    small_cache.SMALLEST = 64
    builder = next(iter(CONTRACTS[name].cases.values()))
    call = builder(np.dtype(np.float32))
    result = _first_result(call.run(call.arrays))
    assert not result.flags.owndata, name
    address, expected = result.ctypes.data, result.copy()
    del result
    again = _first_result(call.run(call.arrays))
    assert again.ctypes.data == address, name
    np.testing.assert_array_equal(again, expected)


@pytest.mark.parametrize("memory_format", ["contiguous_format", "channels_last"])
def test_the_bridge_allocates_in_the_cache_in_both_memory_formats(small_cache, memory_format):
    torch = pytest.importorskip("torch")
    import fastbwd.torch as ft
    from bench.inputs import roi_boxes

    memory_format = getattr(torch, memory_format)
    x = torch.randn(2, 16, 12, 14).contiguous(memory_format=memory_format).requires_grad_()
    boxes = torch.from_numpy(roi_boxes(5, (2, 16, 12, 14), 0.5))
    grad_output = torch.randn(5, 16, 3, 3)

    def step():
        output = ft.roi_align(x, boxes, (3, 3), 0.5, 2, True)
        return output, torch.autograd.grad(output, x, grad_output)[0]

    output, grad = step()
    assert grad.is_contiguous(memory_format=memory_format)
    nbytes = output.numel() * 4 + grad.numel() * 4
    addresses, expected = {output.data_ptr(), grad.data_ptr()}, (output.detach().clone(), grad.clone())
    del output, grad
    assert cache._idle_bytes == nbytes  # both went back to the cache
    output, grad = step()
    assert {output.data_ptr(), grad.data_ptr()} == addresses and cache._idle_bytes == 0
    assert torch.equal(output, expected[0]) and torch.equal(grad, expected[1])


def test_a_result_dying_while_its_thread_holds_the_cache_lock_does_not_deadlock():
    # The garbage collector runs at allocations, some of them under the cache's lock: a result
    # in a reference cycle can die on the thread that holds it. Its block is then freed.
    code = """
import numpy as np
from fastbwd import _result_cache as cache
from fastbwd.api import _plans
cache.SMALLEST = 1024
result = cache.empty((1024,), np.float32)
with cache._lock:
    del result
print("ok", cache._idle_bytes)
"""
    done = _run(code, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["ok", "0"], done.stderr
