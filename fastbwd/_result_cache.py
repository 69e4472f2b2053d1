"""Memory for large results, kept for reuse after the caller drops them.

A new multi-megabyte result is new memory to the operating system: the kernel's first write to
each page faults, and the page is zeroed before the kernel writes it. Freed, the memory goes back
to the system, and the next call of the same size pays again. At (8, 512, 32, 32) float32 that is
about half of a GroupNorm+Swish forward + backward (docs/history.md). So results of
:data:`SMALLEST` bytes or more are carved from blocks that return here, not to the allocator,
when the last array viewing them is gone, and the next result of the same size reuses one.

Results are ordinary arrays (C-contiguous, writeable, independent of every live array); only
``flags.owndata`` is False, as for a view. At most :data:`LIMIT` bytes of dropped results are
kept (``FASTBWD_RESULT_CACHE_MB``, default 256; 0 turns the cache off), and
``fastbwd.clear_result_cache()`` frees them. Where a process allocates mostly through PyTorch
the cache changes little (glibc keeps such memory warm anyway; docs/history.md).
"""

import collections
import math
import os
import threading

import numpy as np

#: Results smaller than this (bytes) are plain ``np.empty`` arrays.
SMALLEST = 4 * 2**20


def _limit_from_environment():
    text = os.environ.get("FASTBWD_RESULT_CACHE_MB", "256")
    try:
        megabytes = float(text)
    except ValueError:
        megabytes = 256.0
    if not math.isfinite(megabytes):
        megabytes = 256.0
    return int(max(megabytes, 0.0) * 2**20)


#: The most bytes of dropped results kept for reuse.
LIMIT = _limit_from_environment()

_idle = collections.OrderedDict()  # id -> a uint8 array nobody views, the longest kept first
_by_size = {}  # size in bytes -> the ids of the kept arrays of that size, the newest last
_idle_bytes = 0
_lock = threading.Lock()


def _forget_all():
    global _idle_bytes
    _idle.clear()
    _by_size.clear()
    _idle_bytes = 0


def _after_fork_in_child():
    # A lock some other thread held at the fork would stay held in the child forever.
    global _lock
    _lock = threading.Lock()
    _forget_all()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Block:
    """The owner of one result's memory (``raw``, a uint8 array): every array viewing the result
    has it as its base, so it goes when the last of them goes, and gives ``raw`` back."""

    __slots__ = ("raw", "__array_interface__")

    def __init__(self, raw):
        self.raw = raw
        self.__array_interface__ = {
            "shape": raw.shape,
            "typestr": "|u1",
            "data": (raw.ctypes.data, False),
            "version": 3,
        }

    def __del__(self):
        try:
            _give_back(self.raw)
        except Exception:  # at interpreter exit the module may be gone: the memory is freed
            pass


def _give_back(raw):
    global _idle_bytes
    # Not blocking: this runs wherever the last view dies, possibly inside empty() on this
    # thread; a block that cannot be kept is simply freed.
    if raw.nbytes > LIMIT or not _lock.acquire(blocking=False):
        return
    try:
        while _idle_bytes + raw.nbytes > LIMIT:  # the blocks kept longest make way
            _, oldest = _idle.popitem(last=False)
            _take(oldest.nbytes, id(oldest))
        _idle[id(raw)] = raw
        _by_size.setdefault(raw.nbytes, []).append(id(raw))
        _idle_bytes += raw.nbytes
    finally:
        _lock.release()


def _take(nbytes, key):
    """Remove the kept block ``key`` of ``nbytes`` from the size index and the count (under the lock)."""
    global _idle_bytes
    keys = _by_size[nbytes]
    keys.remove(key)
    if not keys:
        del _by_size[nbytes]
    _idle_bytes -= nbytes


def empty(shape, dtype):
    """A new uninitialised C-contiguous array, as ``np.empty(shape, dtype)``; large ones reuse
    the memory of dropped results of the same size."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < SMALLEST or nbytes > LIMIT:
        return np.empty(shape, dtype)
    raw = None
    with _lock:
        keys = _by_size.get(nbytes)
        if keys:
            key = keys[-1]
            raw = _idle.pop(key)
            _take(nbytes, key)
    if raw is None:
        raw = np.empty(nbytes, np.uint8)
    return np.asarray(_Block(raw)).view(dtype).reshape(shape)


def clear_result_cache() -> None:
    """Free the memory fastbwd keeps from dropped results for reuse (see ``fastbwd._result_cache``:
    results of 4 MiB and more, at most ``FASTBWD_RESULT_CACHE_MB`` megabytes, default 256)."""
    with _lock:
        _forget_all()
