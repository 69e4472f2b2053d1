"""A parallel copy: the main job's yardstick for this machine's memory bandwidth."""

from numba import prange

from ._jit import parallel_kernel


@parallel_kernel
def parallel_copy(source, destination):
    """destination[:] = source (1-D, same length); parallel over elements, each written once."""
    for i in prange(source.shape[0]):
        destination[i] = source[i]
