"""avg_pool2d_backward loop nests (docs/semantics.md §2).

The general case is separable and runs on the shared engine (``_separable``), each window
given as the taps of its clipped cells with the window's per-axis weight. The global case
(docs/semantics.md §6 A3: one window covering the whole input, a 1x1 grad_output) has its own kernels
here: every grad_input cell of a plane is the plane's single gradient divided by the integer
divisor, exactly as PyTorch computes it.
"""

from numba import prange

from ._halfbits import load, store
from ._jit import parallel_kernel


@parallel_kernel
def global_avg_pool2d_bwd_nchw(grad_output, grad_input, divisor, fmt):
    """grad_output (P,) -> grad_input (P, H*W), P = N*C planes, both C-contiguous.

    ``divisor`` is the window's divisor in the compute type (float32, or float64 for float64
    data). Parallel over planes; iteration ``p`` writes only ``grad_input[p]``.
    """
    planes, plane_size = grad_input.shape
    for p in prange(planes):
        value = store(load(grad_output[p], fmt) / divisor, fmt)
        dst = grad_input[p]
        for i in range(plane_size):
            dst[i] = value


@parallel_kernel
def global_avg_pool2d_bwd_nhwc(grad_output, grad_input, divisor, fmt):
    """grad_output (N, C) -> grad_input (N, H*W, C), both C-contiguous.

    Parallel over images; iteration ``n`` writes only ``grad_input[n]``: the C quotients are
    computed once into the first position, then copied to the other H*W - 1.
    """
    batch, plane_size, channels = grad_input.shape
    for n in prange(batch):
        src = grad_output[n]
        first = grad_input[n, 0]
        for c in range(channels):
            first[c] = store(load(src[c], fmt) / divisor, fmt)
        for i in range(1, plane_size):
            dst = grad_input[n, i]
            for c in range(channels):
                dst[c] = first[c]

