"""avg_pool2d_backward loop nests (docs/semantics.md §2).

The general case is separable. NCHW with grad_output rows of at least LANES cells runs here,
whole rows at a time (:func:`avg_pool2d_bwd_rows_nchw`: strided windows need no transposes);
narrower rows and NHWC run on the shared engine (``_separable``), each window given as the taps
of its clipped cells with the window's per-axis weight. Both compute the same sums in the same
order, so their results are bitwise equal. The global case (docs/semantics.md §6 A3: one window
covering the whole input, a 1x1 grad_output) has its own kernels here: every grad_input cell of
a plane is the plane's single gradient divided by the integer divisor, exactly as PyTorch
computes it.

The api calls :func:`plan` once per :class:`Geometry` (it remembers the plan): it chooses the
loop nest and builds the tables that nest reads, in NumPy.
"""

from typing import NamedTuple

import numpy as np
from numba import prange

from . import _memory, _separable
from ._halfbits import StorageFormat, load, one_nan, store
from ._jit import Launch, Plan, parallel_kernel
from ._lane_rows import interleaved_shifted_rows, lanes_scaled_rows, lanes_scaled_window_sums, lanes_shifted_sum
from ._lanes import LANES
from ._memory import copy_out, line_offset, store_fence

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
        value = store(one_nan(load(grad_output[p], fmt) / divisor), fmt)
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
            first[c] = store(one_nan(load(src[c], fmt) / divisor), fmt)
        for i in range(1, plane_size):
            dst = grad_input[n, i]
            for c in range(channels):
                dst[c] = first[c]


@parallel_kernel
def avg_pool2d_bwd_rows_nchw(
    grad_output,
    grad_input,
    window_first,
    window_stop,
    weight_h,
    weight_w,
    residue_taps,
    residue_base,
    columns_layout,
    tasks_layout,
    task_sources,
    interleaved,
    streaming,
    fmt,
):
    """grad_output (P, OH, OW) -> grad_input (P, H, W), P = N*C planes, both C-contiguous,
    ``OW >= LANES``; any width stride.

    The height axis as its windows seen from the input rows (input row ``h`` lies in the windows
    ``[window_first[h], window_stop[h])``, window ``oh`` weighted ``weight_h[oh]``); the width
    axis as its windows (window ``ow`` weighted ``weight_w[ow]``), seen from the residues ``r``
    of ``w`` modulo the stride (``len(residue_taps)``). Each grad_input row is computed whole, in
    the separable engine's order (so with its bits): ``U = 0 + sum_oh weight_h[oh] * g[oh]`` over
    the row's windows ascending, ``V[ow] = weight_w[ow] * U[ow]``, and ``grad_input[h, w] = 0 +
    sum of V[ow]`` over the windows covering ``w``, ascending. The last sum is taken per residue
    class: ``w = stride * j + r`` is covered by ``residue_taps[r]`` consecutive windows, the
    shifted copies of V starting ``residue_base[r]`` before ``j`` in V's zero-padded row (zero
    outside ``[0, OW)``: adding +0.0 to a sum that started from +0.0 changes no bit).
    :func:`_rows_geometry` computes those tables and the layouts:
    ``columns_layout = (lead, span, residue_width)``, V of a block's row ``r`` at ``[r * span +
    lead, r * span + lead + OW)`` and each residue class summed in whole vectors over
    ``residue_width`` cells; ``tasks_layout = (rows_per_task, piece_rows, depth)``; and
    ``task_sources`` (int64, one row per task), the grad_output rows ``[first, stop)`` (of the
    P*OH) each task reads.

    A task runs in phases, each one loop nest in 16-lane registers (``_lanes``): the products
    ``weight_h[oh] * g[oh]`` of every grad_output row the task reads, once each (at most
    ``depth`` rows; rows ``2m`` and ``2m + 1`` of A1 share ``g[m]``'s: the same product, so the
    same bits); ``lanes_scaled_window_sums``, V of every row (straight-line sums for 1-3
    windows); the width pass, ``piece_rows`` rows (about PIECE_BYTES) at a time, each residue
    class summed into scratch and scattered; after each piece its whole destination lines are
    copied out, so the stores overlap the next piece's arithmetic. The last partial vector of a
    row starts LANES before its end and recomputes the same values. For width stride 2,
    ``interleaved`` holds the two residue classes' ``(residue_base, residue_taps)`` as ``(base0,
    taps0, base1, taps1)``: both classes of 16 positions are summed at once and interleaved into
    32 cells in registers (``_lanes.interleaved_shifted_rows``: one loop nest per common count
    pair, straight-line sums, and a generic one); for other strides it is None. Numba drops the
    branch a call does not take at compile time, so each compiles only its own width pass.

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
        # the block's rows, plus room for the last row's whole vectors
        block = np.empty((1, rows_per_task * width + 2 * LANES), grad_input.dtype)
        flat_block = block.reshape(block.size)
        # V of the block's rows, row r at [r * span + lead, r * span + lead + OW), zero around it
        columns = np.zeros((1, rows_per_task * span), weight_h.dtype)
        sums = np.empty((stride_w, residue_width), weight_h.dtype)  # one row's residue classes
        # weight_h[oh] * grad_output[p, oh] for the task's grad_output rows (of the P*OH)
        products = np.empty((depth, out_width), weight_h.dtype)
        for task in range(group * tasks // groups, (group + 1) * tasks // groups):
            first = task * rows_per_task
            count = min(rows_per_task, rows - first)
            # height pass: each window's products once, then for each row V = weight_w * (0 +
            # the sum of its windows' products), LANES columns at a time
            source_first, source_stop = task_sources[task, 0], task_sources[task, 1]
            lanes_scaled_rows(
                products,
                source,
                source_first,
                source_stop - source_first,
                out_width,
                weight_h,
                source_first % out_height,
                fmt,
            )
            p = first // height
            lanes_scaled_window_sums(
                columns,
                lead,
                span,
                products,
                window_first,
                window_stop,
                first - p * height,
                p * out_height - source_first,
                out_height,
                count,
                out_width,
                scale,
            )
            # width pass, a few rows at a time, rounded once; each piece's whole destination lines
            # copied out at once (the stores overlap the arithmetic of the next piece)
            copied = np.int64(0)
            for piece in range(0, count, piece_rows):
                piece_stop = min(piece + piece_rows, count)
                if interleaved is None:
                    for r in range(piece, piece_stop):
                        for residue in range(stride_w):
                            taps, start = residue_taps[residue], r * span + residue_base[residue]
                            for k in range(0, residue_width, LANES):
                                lanes_shifted_sum(sums, residue, k, columns, 0, start + k, taps)
                            for k in range((width - residue + stride_w - 1) // stride_w):
                                flat_block[r * width + stride_w * k + residue] = store(one_nan(sums[residue, k]), fmt)
                else:
                    interleaved_shifted_rows(
                        block,
                        piece * width,
                        width,
                        columns,
                        piece * span,
                        span,
                        piece_stop - piece,
                        residue_width // LANES,
                        interleaved[0],
                        interleaved[1],
                        interleaved[2],
                        interleaved[3],
                        fmt,
                    )
                ready = piece_stop * width
                if piece_stop < count:  # up to the last line boundary (the rest goes with the next piece)
                    ready -= line_offset(flat, first * width + ready) // grad_input.itemsize
                if ready > copied:
                    copy_out(flat, first * width + copied, flat_block, copied, ready - copied, streaming)
                    copied = ready
        store_fence()


# ---- the plan: which loop nest a call runs, and the tables it reads -----------------------------


class Geometry(NamedTuple):
    """A validated, non-empty avg_pool2d_backward call, as its kernels see it."""

    nhwc: bool  # the kernels' memory layout is (N, H, W, C); else (N*C, H, W) planes
    batch: int  # 1 for a 3-D input
    channels: int
    height: int
    width: int
    out_height: int
    out_width: int
    kernel: tuple  # (kH, kW)
    stride: tuple
    padding: tuple
    count_include_pad: bool
    divisor_override: int  # 0: not set
    dtype: np.dtype  # of the data
    compute: np.dtype
    fmt: StorageFormat


def plan(geometry):
    """The plan of a non-empty call (a :class:`~fastbwd.kernels._jit.Plan`), run on the kernel
    views of grad_output and grad_input in the geometry's layout: NCHW, any shapes holding the
    N*C planes (a 3-D call's too); NHWC, ``(N, OH, OW, C)`` and ``(N, H, W, C)``."""
    g = geometry
    planes = g.batch * g.channels
    height, width, out_height, out_width = g.height, g.width, g.out_height, g.out_width
    kernel, stride, padding, compute = g.kernel, g.stride, g.padding, g.compute
    work = planes * (out_height * out_width + height * width)
    start_h, stop_h, extent_h = axis_windows(height, kernel[0], stride[0], padding[0], out_height)
    start_w, stop_w, extent_w = axis_windows(width, kernel[1], stride[1], padding[1], out_width)
    if out_height == out_width == 1 and start_h[0] == start_w[0] == 0 and stop_h[0] == height and stop_w[0] == width:
        if g.divisor_override != 0:
            divisor = g.divisor_override
        elif g.count_include_pad:
            divisor = int(extent_h[0]) * int(extent_w[0])
        else:
            divisor = height * width
        if g.nhwc:
            shapes = ((g.batch, g.channels), (g.batch, height * width, g.channels))
            return Plan(Launch(global_avg_pool2d_bwd_nhwc, work), shapes, (compute.type(divisor), g.fmt))
        shapes = ((planes,), (planes, height * width))
        return Plan(Launch(global_avg_pool2d_bwd_nchw, work), shapes, (compute.type(divisor), g.fmt))

    # The divisor factorises per axis: 1 / (dH * dW) = (1 / dH) * (1 / dW); a divisor_override d
    # is a constant, applied as 1 / d on the H axis and 1 on the W axis.
    override_h, override_w = (g.divisor_override, 1) if g.divisor_override != 0 else (None, None)
    weights = (
        _axis_weights(height, kernel[0], stride[0], padding[0], out_height, g.count_include_pad, override_h, compute),
        _axis_weights(width, kernel[1], stride[1], padding[1], out_width, g.count_include_pad, override_w, compute),
    )
    if g.nhwc or out_width < LANES:  # the engine: each window as the taps of its clipped cells
        if g.nhwc:
            shapes = ((g.batch, out_height, out_width, g.channels), (g.batch, height, width, g.channels))
        else:
            shapes = ((planes, out_height, out_width), (planes, height, width))
        return _separable.plan(
            g.nhwc,
            *shapes,
            *_window_taps(start_h, stop_h, weights[0], compute),
            *_window_taps(start_w, stop_w, weights[1], compute),
            g.fmt,
        )
    # whole rows at a time, the width axis as strided windows (same operations, same bits)
    residue_taps, residue_base, *layouts = _rows_geometry(
        planes,
        height,
        width,
        out_height,
        out_width,
        kernel[0],
        stride[0],
        padding[0],
        kernel[1],
        stride[1],
        padding[1],
        g.dtype.itemsize,
    )
    interleaved = None
    if stride[1] == 2:  # both residue classes at once, interleaved in registers
        interleaved = (residue_base[0], residue_taps[0], residue_base[1], residue_taps[1])
    streaming = planes * height * width * g.dtype.itemsize >= _memory.STREAM_MIN_BYTES
    return Plan(
        Launch(avg_pool2d_bwd_rows_nchw, work),
        ((planes, out_height, out_width), (planes, height, width)),
        (
            *_row_windows(height, kernel[0], stride[0], padding[0], out_height),
            *weights,
            residue_taps,
            residue_base,
            *layouts,
            interleaved,
            streaming,
            g.fmt,
        ),
    )


def axis_windows(size, kernel, stride, pad, out_size):
    """The docs/semantics.md §2 windows of one axis, per output index: ``(start, stop, pool_extent)``
    (the JAX forward divides by them too).

    ``[start, stop)`` is the window clipped to the input; ``pool_extent`` is its length
    counting the padding but not the part of a ceil-mode window beyond the padding (so a
    last window overhanging ``size + pad`` is divided by less than ``kernel``).
    """
    start = np.arange(out_size, dtype=np.int64) * stride - pad
    stop = np.minimum(start + kernel, size + pad)
    pool_extent = stop - start
    return np.maximum(start, 0), np.minimum(stop, size), pool_extent


def _axis_weights(size, kernel, stride, pad, out_size, count_include_pad, divisor, compute):
    """Every window's weight on one axis, ``1 / divisor`` in the compute type, the divisor being
    ``divisor`` when given, else the window's extent (counting the padding or not)."""
    start, stop, extent = axis_windows(size, kernel, stride, pad, out_size)
    if divisor is not None:
        divisors = np.full(out_size, divisor, np.int64)
    elif count_include_pad:
        divisors = extent
    else:
        divisors = stop - start
    return np.divide(1, divisors.astype(compute), dtype=compute)


def _row_windows(size, kernel, stride, pad, out_size):
    """``(first, stop)``: input row ``h`` of one axis lies in the clipped windows
    ``[first[h], stop[h])`` (ascending, consecutive: the windows' clipped starts and stops both
    increase with the window; empty when no window covers the row)."""
    start, stop, _ = axis_windows(size, kernel, stride, pad, out_size)
    rows = np.arange(size, dtype=np.int64)
    # the windows that start at or before h, minus those that stop at or before it
    return (
        np.searchsorted(stop, rows, side="right").astype(np.int64),
        np.searchsorted(start, rows, side="right").astype(np.int64),
    )


def _rows_geometry(
    planes, height, width, out_height, out_width, kernel_h, stride_h, pad_h, kernel_w, stride_w, pad_w, itemsize
):
    """The whole-rows kernels' width tables, layouts and task sources
    (:func:`avg_pool2d_bwd_rows_nchw`): ``(residue_taps, residue_base, (lead, span,
    residue_width), (rows_per_task, piece_rows, depth), task_sources)``.

    The cell ``w = stride * j + r`` is covered by the windows ``[m - a, m]``, ``m = j + (r + pad)
    // stride``, ``a = (kernel - 1 - q) // stride``, ``q = (r + pad) % stride``: residue ``r``
    sums ``residue_taps[r] = a + 1`` shifted copies of V, the first at ``residue_base[r] + j``
    in V's zero-padded row (V at ``[lead, lead + OW)``, ``lead`` the most windows covering one
    cell minus one, ``span`` long, so that every class's whole vectors of ``residue_width``
    cells stay inside it). A task is a run of ``rows_per_task`` consecutive rows of the P*H rows
    of grad_input (the last one shorter); ``task_sources[t] = (first, stop)``: task ``t`` reads the
    grad_output rows (of the P*OH) ``[first, stop)``, from its first row's first window to its
    last row's last (every plane it crosses in between whole; empty when no window covers its
    rows); ``depth`` is the most any task reads.
    """
    lead = (kernel_w - 1) // stride_w
    residue = np.arange(stride_w, dtype=np.int64)
    q = (residue + pad_w) % stride_w
    residue_taps = np.maximum(0, (kernel_w - 1 - q) // stride_w + 1)
    residue_base = lead + (residue + pad_w) // stride_w - (kernel_w - 1 - q) // stride_w
    # each residue class is summed in whole vectors, past its end into scratch that is never stored
    residue_width = (width + stride_w - 1) // stride_w
    residue_width = (residue_width + LANES - 1) // LANES * LANES
    # residue r reads V's row at [base, base + taps - 1 + residue_width), 0 <= base <= lead + (stride - 1 + pad)
    # // stride - taps + 1
    span = lead + max(out_width, (stride_w - 1 + pad_w) // stride_w + residue_width)
    rows_per_task = max(1, TASK_BYTES // (width * itemsize))
    piece_rows = max(1, PIECE_BYTES // (width * itemsize))
    window_first, window_stop = _row_windows(height, kernel_h, stride_h, pad_h, out_height)
    rows = planes * height
    first = np.arange(0, rows, rows_per_task, dtype=np.int64)
    last = np.minimum(first + rows_per_task, rows) - 1
    # the planes of each task's first and last rows (q above is a residue's phase, not a plane)
    first_plane, last_plane = first // height, last // height
    task_sources = np.stack(
        (
            first_plane * out_height + window_first[first - first_plane * height],
            last_plane * out_height + window_stop[last - last_plane * height],
        ),
        axis=1,
    )
    depth = max(1, int(np.max(task_sources[:, 1] - task_sources[:, 0])))
    return (residue_taps, residue_base, (lead, span, residue_width), (rows_per_task, piece_rows, depth), task_sources)


def _window_taps(start, stop, window_weight, compute):
    """The forward tap table of one axis for the separable engine: output ``o`` reads the cells
    ``[start[o], stop[o])`` of its clipped window, each with the window's weight (unused taps of
    shorter windows are -1)."""
    taps = max(1, int(np.max(stop - start)))
    index = start[:, None] + np.arange(taps)[None, :]
    index = np.where(index < stop[:, None], index, -1)
    weight = np.broadcast_to(window_weight[:, None], index.shape)
    return _separable.tap_table(index, weight, compute)
