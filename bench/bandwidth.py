"""The main job's yardsticks for this machine's memory bandwidth: a parallel copy, and a
parallel streamed write (the floor of a kernel whose traffic is mostly its result)."""

from numba import prange

from fastbwd.kernels._jit import parallel_kernel
from fastbwd.kernels._memory import copy_out, store_fence

#: :func:`parallel_stream_fill` writes its destination in this many fixed shares.
FILL_GROUPS = 64


@parallel_kernel
def parallel_copy(source, destination):
    """destination[:] = source (1-D, same length); parallel over elements, each written once."""
    for i in prange(source.shape[0]):
        destination[i] = source[i]


@parallel_kernel
def parallel_stream_fill(destination, pattern):
    """destination[i] = pattern[(i - start of i's share) % len(pattern)] (1-D, one element type,
    ``len(pattern) > 0``): FILL_GROUPS fixed shares, each written with ``_memory.copy_out``'s
    streaming stores from ``pattern`` (small: it stays in the cache), then fenced. A kernel that
    writes a large result from registers or the cache has no faster way to put it in memory."""
    size = destination.shape[0]
    for group in prange(FILL_GROUPS):
        first, stop = group * size // FILL_GROUPS, (group + 1) * size // FILL_GROUPS
        done = first
        while done < stop:
            count = min(pattern.shape[0], stop - done)
            copy_out(destination, done, pattern, 0, count, True)
            done += count
        store_fence()
