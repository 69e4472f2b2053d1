"""replication_pad2d_backward loop nests (docs/semantics.md §3).

A gather: every grad_input cell sums the rectangle of grad_output cells that replicate it
(``replicate_source_range`` per axis), rows in ascending order, within a row columns ascending.
A cell with exactly one source copies its bits; others are summed in the compute type and
rounded once. Both layouts use the same rule and order, so they agree bitwise.
"""

import numpy as np
from numba import prange

from ._halfbits import accumulator, load, store
from ._index import replicate_source_range
from ._jit import helper, parallel_kernel


@helper
def _gather_cell(plane, row_start, row_stop, col_start, col_stop, fmt):
    """Sum of ``plane[row_start:row_stop, col_start:col_stop]``, stored (a lone source is copied)."""
    if row_stop - row_start == 1 and col_stop - col_start == 1:
        return plane[row_start, col_start]
    acc = accumulator(plane, fmt)
    for i in range(row_start, row_stop):
        for j in range(col_start, col_stop):
            acc += load(plane[i, j], fmt)
    return store(acc, fmt)


@parallel_kernel
def replication_pad2d_bwd_nchw(grad_output, grad_input, pad_top, pad_left, fmt):
    """grad_output (P, OH, OW) -> grad_input (P, H, W), P = N*C planes, both C-contiguous.

    Parallel over the P*H rows of grad_input; iteration ``t`` writes only row ``t`` (plane
    ``t // H``, row ``t % H``).
    """
    planes, height, width = grad_input.shape
    out_height, out_width = grad_output.shape[1], grad_output.shape[2]
    # Columns 1 <= w < width-1 whose only reader is w + pad_left (inside grad_output).
    copy_start = max(1, -pad_left)
    copy_stop = max(copy_start, min(width - 1, out_width - pad_left))
    first_stop = replicate_source_range(0, width, out_width, pad_left)[1]
    last_start = replicate_source_range(width - 1, width, out_width, pad_left)[0]
    for t in prange(planes * height):
        p = t // height
        h = t - p * height
        src = grad_output[p]
        dst = grad_input[p, h]
        row_start, row_stop = replicate_source_range(h, height, out_height, pad_top)
        if row_stop - row_start == 1 and width > 1:
            row = src[row_start]
            # Zero-based loop over slices: no negative-index wraparound, so LLVM vectorises it.
            copy_dst = dst[copy_start:copy_stop]
            copy_src = row[copy_start + pad_left:copy_stop + pad_left]
            for k in range(copy_stop - copy_start):
                copy_dst[k] = copy_src[k]
            # The two edge cells sum their strips (a lone source is copied).
            if first_stop == 1:
                dst[0] = row[0]
            else:
                acc = accumulator(row, fmt)
                for j in range(first_stop):
                    acc += load(row[j], fmt)
                dst[0] = store(acc, fmt)
            if out_width - last_start == 1:
                dst[width - 1] = row[last_start]
            else:
                acc = accumulator(row, fmt)
                for j in range(last_start, out_width):
                    acc += load(row[j], fmt)
                dst[width - 1] = store(acc, fmt)
            for w in range(1, copy_start):  # cropped away by a negative left pad
                dst[w] = store(accumulator(row, fmt), fmt)
            for w in range(copy_stop, width - 1):  # cropped away by a negative right pad
                dst[w] = store(accumulator(row, fmt), fmt)
        else:
            for w in range(width):
                col_start, col_stop = replicate_source_range(w, width, out_width, pad_left)
                dst[w] = _gather_cell(src, row_start, row_stop, col_start, col_stop, fmt)


@parallel_kernel
def replication_pad2d_bwd_nhwc(grad_output, grad_input, pad_top, pad_left, fmt):
    """grad_output (N, OH, OW, C) -> grad_input (N, H, W, C), both C-contiguous.

    Parallel over the N*H rows of grad_input; iteration ``t`` writes only ``grad_input[n, h]``.
    """
    batch, height, width, channels = grad_input.shape
    out_height, out_width = grad_output.shape[1], grad_output.shape[2]
    for t in prange(batch * height):
        n = t // height
        h = t - n * height
        dst = grad_input[n, h]
        row_start, row_stop = replicate_source_range(h, height, out_height, pad_top)
        acc = np.full(channels, accumulator(grad_output, fmt))  # per-row scratch
        for w in range(width):
            col_start, col_stop = replicate_source_range(w, width, out_width, pad_left)
            if row_stop - row_start == 1 and col_stop - col_start == 1:
                src = grad_output[n, row_start, col_start]
                for c in range(channels):
                    dst[w, c] = src[c]
                continue
            acc[:] = 0
            for i in range(row_start, row_stop):
                for j in range(col_start, col_stop):
                    src = grad_output[n, i, j]
                    for c in range(channels):
                        acc[c] += load(src[c], fmt)
            for c in range(channels):
                dst[w, c] = store(acc[c], fmt)
