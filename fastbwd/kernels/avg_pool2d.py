"""avg_pool2d_backward loop nests (docs/semantics.md §2).

The general case is separable. NCHW with grad_output rows of at least LANES cells runs here,
whole rows at a time (:func:`avg_pool2d_bwd_rows_nchw`, and :func:`avg_pool2d_bwd_rows_s2_nchw` for
width stride 2: strided windows need no transposes);
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
from ._simd import (LANES, copy_out, interleaved_shifted_rows, lanes_scaled_rows, lanes_scaled_window_sums,
                    line_offset, lanes_shifted_sum, store_fence)

#: A task of :func:`avg_pool2d_bwd_rows_nchw` builds about this many bytes of grad_input rows
#: in a scratch block (inside L1) before copying them out.
TASK_BYTES = 16 << 10
#: ... and copies them out in pieces of about this many bytes, each as soon as it is built.
PIECE_BYTES = 4 << 10
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
def avg_pool2d_bwd_rows_s2_nchw(grad_output, grad_input, window_first, window_stop, weight_h, weight_w, residue_taps,
                                residue_base, columns_layout, tasks_layout, task_sources, streaming, fmt):
    """:func:`avg_pool2d_bwd_rows_nchw` for width stride 2, whose width pass sums both residue
    classes of 16 positions at once and interleaves them into 32 cells in registers
    (``_simd.interleaved_shifted_rows``: one loop nest per common count pair, straight-line
    sums, and a generic one). Same arguments, same results; a kernel of its own so that a call
    compiles only the width pass it runs. valgrind on A1 float32 (serial kernel): 41.2M
    instructions per call, 180 per grad_input row (bfloat16 53.6M, 234; 305 per row before the
    phases)."""
    planes, height, width = grad_input.shape
    out_height, out_width = grad_output.shape[1], grad_output.shape[2]
    source = grad_output.reshape((planes * out_height, out_width))
    lead, span, residue_width = columns_layout
    rows_per_task, piece_rows, depth = tasks_layout
    rows = planes * height
    tasks = len(task_sources)
    groups = min(tasks, TASK_GROUPS)
    flat = grad_input.reshape(grad_input.size)
    scale = weight_w.reshape((1, out_width))
    for group in prange(groups):
        # the block's rows, plus room for the last row's whole vectors
        block = np.empty((1, rows_per_task * width + 2 * LANES), grad_input.dtype)
        flat_block = block.reshape(block.size)
        # V of the block's rows, row r at [r * span + lead, r * span + lead + OW), zero around it
        columns = np.zeros((1, rows_per_task * span), weight_h.dtype)
        # weight_h[oh] * grad_output[p, oh] for the task's grad_output rows (of the P*OH)
        products = np.empty((depth, out_width), weight_h.dtype)
        for task in range(group * tasks // groups, (group + 1) * tasks // groups):
            first = task * rows_per_task
            count = min(rows_per_task, rows - first)
            # height pass: each window's products once, then for each row V = weight_w * (0 +
            # the sum of its windows' products), LANES columns at a time
            source_first, source_stop = task_sources[task, 0], task_sources[task, 1]
            lanes_scaled_rows(products, source, source_first, source_stop - source_first, out_width, weight_h,
                              source_first % out_height, fmt)
            p = first // height
            lanes_scaled_window_sums(columns, lead, span, products, window_first, window_stop, first - p * height,
                                     p * out_height - source_first, out_height, count, out_width, scale)
            # width pass, both residue classes of w at once, interleaved into the rows and
            # rounded once; a few rows at a time, each piece's whole destination lines copied out
            # at once (the stores overlap the arithmetic of the next piece)
            copied = np.int64(0)
            for piece in range(0, count, piece_rows):
                piece_stop = min(piece + piece_rows, count)
                interleaved_shifted_rows(block, piece * width, width, columns, piece * span, span, piece_stop - piece,
                                         residue_width // LANES, residue_base[0], residue_taps[0], residue_base[1],
                                         residue_taps[1], fmt)
                ready = piece_stop * width
                if piece_stop < count:  # up to the last line boundary (the rest goes with the next piece)
                    ready -= line_offset(flat, first * width + ready) // grad_input.itemsize
                if ready > copied:
                    copy_out(flat, first * width + copied, flat_block, copied, ready - copied, streaming)
                    copied = ready
        store_fence()


@parallel_kernel
def avg_pool2d_bwd_rows_nchw(grad_output, grad_input, window_first, window_stop, weight_h, weight_w, residue_taps,
                             residue_base, columns_layout, tasks_layout, task_sources, streaming, fmt):
    """grad_output (P, OH, OW) -> grad_input (P, H, W), P = N*C planes, both C-contiguous,
    ``OW >= LANES``; any width stride (stride 2 runs faster in :func:`avg_pool2d_bwd_rows_s2_nchw`).

    The height axis as its windows seen from the input rows (input row ``h`` lies in the windows
    ``[window_first[h], window_stop[h])``, window ``oh`` weighted ``weight_h[oh]``); the width
    axis as its windows (window ``ow`` weighted ``weight_w[ow]``), seen from the residues ``r``
    of ``w`` modulo the stride (``len(residue_taps)``). Each grad_input row is computed whole, in
    the separable engine's order (so with its bits): ``U = 0 + sum_oh weight_h[oh] * g[oh]`` over
    the row's windows ascending, ``V[ow] = weight_w[ow] * U[ow]``, and ``grad_input[h, w] = 0 +
    sum of V[ow]`` over the windows covering ``w``, ascending. The last sum is taken per residue
    class: ``w = stride * j + r`` is covered by ``residue_taps[r]`` consecutive windows, the
    shifted copies of V starting ``residue_base[r]`` before ``j`` in V's zero-padded row (zero
    outside ``[0, OW)``: adding +0.0 to a sum that started from +0.0 changes no bit). The api
    computes those tables and the layouts (:func:`fastbwd.api.avg_pool2d._rows_geometry`):
    ``columns_layout = (lead, span, residue_width)``, V of a block's row ``r`` at ``[r * span +
    lead, r * span + lead + OW)`` and each residue class summed in whole vectors over
    ``residue_width`` cells; ``tasks_layout = (rows_per_task, piece_rows, depth)``; and
    ``task_sources`` (int64, one row per task), the grad_output rows ``[first, stop)`` (of the
    P*OH) each task reads.

    A task runs in phases, each one loop nest in 16-lane registers (``_simd``): the products
    ``weight_h[oh] * g[oh]`` of every grad_output row the task reads, once each (at most
    ``depth`` rows; rows ``2m`` and ``2m + 1`` of A1 share ``g[m]``'s: the same product, so the
    same bits); ``lanes_scaled_window_sums``, V of every row (straight-line sums for 1-3
    windows); the width pass, ``piece_rows`` rows (about PIECE_BYTES) at a time, each residue
    class summed into scratch and scattered (stride 2: both at once, in registers, in the other
    kernel); after each piece its whole destination lines are copied out, so the stores overlap
    the next piece's arithmetic. The last partial vector of a row starts LANES before its end
    and recomputes the same values.

    Parallel over TASK_GROUPS fixed groups of tasks; a task is a run of ``rows_per_task``
    consecutive rows of the P*H rows of grad_input (about TASK_BYTES) and writes only those,
    built in a scratch block and copied out in line-aligned pieces (``copy_out``, with streaming
    stores if ``streaming``).
    """
    planes, height, width = grad_input.shape
    out_height, out_width = grad_output.shape[1], grad_output.shape[2]
    source = grad_output.reshape((planes * out_height, out_width))
    stride_w = len(residue_taps)
    lead, span, residue_width = columns_layout
    rows_per_task, piece_rows, depth = tasks_layout
    rows = planes * height
    tasks = len(task_sources)
    groups = min(tasks, TASK_GROUPS)
    flat = grad_input.reshape(grad_input.size)
    scale = weight_w.reshape((1, out_width))
    for group in prange(groups):
        block = np.empty((1, rows_per_task * width + 2 * LANES), grad_input.dtype)
        flat_block = block.reshape(block.size)
        columns = np.zeros((1, rows_per_task * span), weight_h.dtype)
        sums = np.empty((stride_w, residue_width), weight_h.dtype)
        products = np.empty((depth, out_width), weight_h.dtype)
        for task in range(group * tasks // groups, (group + 1) * tasks // groups):
            first = task * rows_per_task
            count = min(rows_per_task, rows - first)
            source_first, source_stop = task_sources[task, 0], task_sources[task, 1]
            lanes_scaled_rows(products, source, source_first, source_stop - source_first, out_width, weight_h,
                              source_first % out_height, fmt)
            p = first // height
            lanes_scaled_window_sums(columns, lead, span, products, window_first, window_stop, first - p * height,
                                     p * out_height - source_first, out_height, count, out_width, scale)
            copied = np.int64(0)
            for piece in range(0, count, piece_rows):
                piece_stop = min(piece + piece_rows, count)
                for r in range(piece, piece_stop):
                    for residue in range(stride_w):
                        taps, start = residue_taps[residue], r * span + residue_base[residue]
                        for k in range(0, residue_width, LANES):
                            lanes_shifted_sum(sums, residue, k, columns, 0, start + k, taps)
                        for k in range((width - residue + stride_w - 1) // stride_w):
                            flat_block[r * width + stride_w * k + residue] = store(sums[residue, k], fmt)
                ready = piece_stop * width
                if piece_stop < count:  # up to the last line boundary (the rest goes with the next piece)
                    ready -= line_offset(flat, first * width + ready) // grad_input.itemsize
                if ready > copied:
                    copy_out(flat, first * width + copied, flat_block, copied, ready - copied, streaming)
                    copied = ready
        store_fence()
