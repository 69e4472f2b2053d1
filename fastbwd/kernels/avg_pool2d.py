"""avg_pool2d_backward loop nests (docs/semantics.md §2).

The general case is separable. NCHW with grad_output rows of at least LANES cells runs here,
whole rows at a time (:func:`avg_pool2d_bwd_rows_nchw`: strided windows need no transposes);
narrower rows and NHWC run on the shared engine (``_separable``), each window given as the taps
of its clipped cells with the window's per-axis weight. Both compute the same sums in the same
order, so their results are bitwise equal. The global case (docs/semantics.md §6 A3: one window
covering the whole input, a 1x1 grad_output) has its own kernels here: every grad_input cell of
a plane is the plane's single gradient divided by the integer divisor, exactly as PyTorch
computes it.
"""

import numpy as np
from numba import prange

from ._halfbits import load, store
from ._jit import parallel_kernel
from ._simd import (LANES, copy_out, interleaved_shifted_sums, lanes_scaled_gather_sums, lanes_shifted_sum,
                    store_fence)

#: A task of :func:`avg_pool2d_bwd_rows_nchw` builds about this many bytes of grad_input rows
#: in a scratch block (inside L1) before copying them out.
TASK_BYTES = 16 << 10
#: Its tasks run in this many fixed groups (fewer when there are fewer tasks); a group allocates
#: its scratch once. Results do not depend on it.
TASK_GROUPS = 64


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


@parallel_kernel
def avg_pool2d_bwd_rows_nchw(grad_output, grad_input, start_h, source_h, weight_h, weight_w, kernel_w, stride_w,
                             pad_w, streaming, fmt):
    """grad_output (P, OH, OW) -> grad_input (P, H, W), P = N*C planes, both C-contiguous,
    ``OW >= LANES``.

    The height axis as a gather table (``_separable.gather_table``: input row ``h`` sums
    ``weight_h[j] * grad_output[source_h[j]]`` for ``j`` in ``[start_h[h], start_h[h + 1])``);
    the width axis as its windows (``kernel_w``, ``stride_w``, ``pad_w``, window ``ow`` weighted
    ``weight_w[ow]``). Each grad_input row is computed whole, in the separable engine's order
    (so with its bits): ``U = 0 + sum_j weight_h[j] * g[source_h[j]]`` over the row's source
    rows ascending, ``V[ow] = weight_w[ow] * U[ow]``, and ``grad_input[h, w] = 0 + sum of V[ow]``
    over the windows covering ``w``, ascending. The last sum is taken per residue ``r`` of ``w``
    modulo the stride: ``w = stride * j + r`` is covered by the windows ``[m - a, m]`` with
    ``m = j + (r + pad) // stride`` and ``a = (kernel - 1 - q) // stride``,
    ``q = (r + pad) % stride``, so each residue class sums ``a + 1`` shifted copies of V (zero
    outside ``[0, OW)``: adding +0.0 to a sum that started from +0.0 changes no bit).

    All in 16-lane registers (``_simd``): the height pass two vectors of V at a time (a last
    partial vector starts LANES before the end and recomputes the same values); stride 2 sums
    both residue classes of 16 positions and interleaves them into 32 cells, other strides sum
    each class into scratch and scatter it. Measured on A1 ((32,128,56,56) k3 s2 p1): 1.4-1.7x
    the engine's speed, whose transposes and per-list loops dominated it.

    Parallel over TASK_GROUPS fixed groups of tasks; a task is a run of consecutive rows of the
    P*H rows of grad_input (about TASK_BYTES of them) and writes only those, built in a scratch
    block and copied out in one stretch (``copy_out``, with streaming stores if ``streaming``).
    """
    planes, height, width = grad_input.shape
    out_width = grad_output.shape[2]
    rows = planes * height
    rows_per_task = max(1, TASK_BYTES // (width * grad_input.itemsize))
    tasks = (rows + rows_per_task - 1) // rows_per_task
    groups = min(tasks, TASK_GROUPS)
    flat = grad_input.reshape(grad_input.size)
    lead = (kernel_w - 1) // stride_w  # the most windows covering one cell, minus one
    # each residue class is summed in whole vectors, past its end into scratch that is never stored
    residue_width = (width + stride_w - 1) // stride_w
    residue_width = (residue_width + LANES - 1) // LANES * LANES
    # V's zero-padded row: residue r reads [base, base + taps - 1 + residue_width) with
    # 0 <= base <= lead + (stride - 1 + pad) // stride - taps + 1
    span = lead + max(out_width, (stride_w - 1 + pad_w) // stride_w + residue_width)
    scale = weight_w.reshape((1, out_width))
    # per residue r of w modulo the stride: how many windows cover it and where its V starts
    residue_taps = np.empty(stride_w, np.int64)
    residue_base = np.empty(stride_w, np.int64)
    for residue in range(stride_w):
        q = (residue + pad_w) % stride_w
        residue_taps[residue] = max(0, (kernel_w - 1 - q) // stride_w + 1)
        residue_base[residue] = lead + (residue + pad_w) // stride_w - (kernel_w - 1 - q) // stride_w
    for group in prange(groups):
        # the block's rows, plus room for the last row's whole vectors
        block = np.empty((1, rows_per_task * width + 2 * LANES), grad_input.dtype)
        flat_block = block.reshape(block.size)
        column = np.zeros((1, span), weight_h.dtype)  # V at [lead, lead + OW), zero around it
        sums = np.empty((stride_w, residue_width), weight_h.dtype)
        for task in range(group * tasks // groups, (group + 1) * tasks // groups):
            first = task * rows_per_task
            count = min(rows_per_task, rows - first)
            p = first // height
            h = first - p * height
            for r in range(count):
                # height pass and window weights: V, two vectors at a time
                for k in range(0, out_width, 2 * LANES):
                    lanes_scaled_gather_sums(column, 0, lead, grad_output[p], source_h, weight_h, start_h[h],
                                             start_h[h + 1], min(k, out_width - LANES),
                                             min(k + LANES, out_width - LANES), scale, fmt)
                # width pass, one residue class of w at a time, interleaved into the row and
                # rounded once (stride 2: both classes at once, in registers)
                row = r * width
                if stride_w == 2:
                    even_taps, even_base = residue_taps[0], residue_base[0]
                    odd_taps, odd_base = residue_taps[1], residue_base[1]
                    for k in range(0, residue_width, LANES):
                        interleaved_shifted_sums(block, 0, row + 2 * k, column, even_base + k, even_taps,
                                                 odd_base + k, odd_taps, fmt)
                else:
                    for residue in range(stride_w):
                        taps, base = residue_taps[residue], residue_base[residue]
                        for k in range(0, residue_width, LANES):
                            lanes_shifted_sum(sums, residue, k, column, 0, base + k, taps)
                        for k in range((width - residue + stride_w - 1) // stride_w):
                            flat_block[row + stride_w * k + residue] = store(sums[residue, k], fmt)
                h += 1
                if h == height:
                    p, h = p + 1, 0
            copy_out(flat, first * width, flat_block, 0, count * width, streaming)
        store_fence()
