"""replication_pad2d_backward loop nests (docs/semantics.md §3).

A gather: every grad_input cell sums the rectangle of grad_output cells that replicate it
(``replicate_source_range`` per axis), rows in ascending order, within a row columns ascending.
A cell with exactly one source copies its bits; others are summed in the compute type and
rounded once. Both layouts use the same rule and order, so they agree bitwise. :func:`plan`
chooses a call's loop nest once per :class:`Geometry`.
"""

from typing import NamedTuple

import numpy as np
from numba import prange

from . import _memory
from ._halfbits import StorageFormat, accumulator, load, one_nan, store
from ._index import replicate_source_range
from ._jit import Launch, Plan, leaf_helper, parallel_kernel
from ._memory import (
    LINE_BYTES,
    cells_per_line,
    copy_out_reading_ahead,
    copy_part_line,
    line_offset,
    prefetch,
    store_fence,
    stream_line_with_ends,
)

#: The NCHW kernel's rows run in this many fixed groups of consecutive rows (fewer when there
#: are fewer rows); a group allocates its scratch once. Results do not depend on it.
TASK_GROUPS = 256
#: A streamed row asks for the grad_output lines this many lines ahead of those it copies (32 KB,
#: about 60 rows of P1): with streaming stores the hardware's prefetching alone leaves the reads
#: behind. Results do not depend on it.
READ_AHEAD_LINES = 512


@leaf_helper
def _gather_cell(plane, row_start, row_stop, col_start, col_stop, fmt):
    """Sum of ``plane[row_start:row_stop, col_start:col_stop]``, stored (a lone source is copied)."""
    if row_stop - row_start == 1 and col_stop - col_start == 1:
        return plane[row_start, col_start]
    acc = accumulator(plane, fmt)
    for i in range(row_start, row_stop):
        for j in range(col_start, col_stop):
            acc += load(plane[i, j], fmt)
    return store(one_nan(acc), fmt)


@leaf_helper
def _edge_cells(row, width, pad_left, fmt):
    """The first and last cells of a grad_input row of ``width > 1`` cells with one source row
    ``row``: each sums its strip of ``row`` (a lone source is copied)."""
    out_width = row.shape[0]
    # np.int64(0), not 0: a literal argument would compile a second replicate_source_range
    first_stop = replicate_source_range(np.int64(0), width, out_width, pad_left)[1]
    last_start = replicate_source_range(width - 1, width, out_width, pad_left)[0]
    if first_stop == 1:
        first = row[0]
    else:
        acc = accumulator(row, fmt)
        for j in range(first_stop):
            acc += load(row[j], fmt)
        first = store(one_nan(acc), fmt)
    if out_width - last_start == 1:
        last = row[last_start]
    else:
        acc = accumulator(row, fmt)
        for j in range(last_start, out_width):
            acc += load(row[j], fmt)
        last = store(one_nan(acc), fmt)
    return first, last


@leaf_helper
def _pad_row(src, dst, row_start, row_stop, pad_left, column_sums, read_ahead, fmt):
    """One grad_input row (``dst``) from its plane's grad_output ``src`` and its source rows
    ``[row_start, row_stop)``.

    With one source row, the interior is a copy and the two edge cells sum their strips. The
    copy has plain stores when ``read_ahead`` is None (the branch is dropped at compile time);
    else it streams its whole cache lines, asking for grad_output ``read_ahead`` elements ahead
    (``_memory.copy_out_reading_ahead``; the kernel fences). With
    several (the top and bottom edges) or none (cropped away), each interior column sums its
    cells of those rows, one whole source row after the other into ``column_sums`` (compute-type
    scratch of at least ``width``): the order of the cell-by-cell sum. The other cells (edges,
    corners, columns cropped away) go cell by cell.
    """
    width, out_width = dst.shape[0], src.shape[1]
    # Columns 1 <= w < width-1 whose only reader is w + pad_left (inside grad_output); a left
    # crop wider than the row leaves none, and the last cell is the right edge's (never cropped)
    copy_start = min(max(1, -pad_left), max(width - 1, 1))
    copy_stop = max(copy_start, min(width - 1, out_width - pad_left))
    interior = dst[copy_start:copy_stop]
    if row_stop - row_start == 1 and width > 1:
        row = src[row_start]
        copy_src = row[copy_start + pad_left : copy_stop + pad_left]
        if read_ahead is None:
            for k in range(copy_stop - copy_start):  # zero-based, over slices: LLVM vectorises it
                interior[k] = copy_src[k]
        else:
            copy_out_reading_ahead(interior, 0, copy_src, 0, copy_stop - copy_start, True, read_ahead)
        dst[0], dst[width - 1] = _edge_cells(row, width, pad_left, fmt)
        for w in range(1, copy_start):  # cropped away by a negative left pad
            dst[w] = store(accumulator(row, fmt), fmt)
        for w in range(copy_stop, width - 1):  # cropped away by a negative right pad
            dst[w] = store(accumulator(row, fmt), fmt)
        return
    sums = column_sums[: copy_stop - copy_start]
    for k in range(copy_stop - copy_start):
        sums[k] = accumulator(src, fmt)
    for i in range(row_start, row_stop):
        row = src[i, copy_start + pad_left : copy_stop + pad_left]
        for k in range(copy_stop - copy_start):
            sums[k] += load(row[k], fmt)
    for k in range(copy_stop - copy_start):
        interior[k] = store(one_nan(sums[k]), fmt)
    for w in range(copy_start):
        col_start, col_stop = replicate_source_range(w, width, out_width, pad_left)
        dst[w] = _gather_cell(src, row_start, row_stop, col_start, col_stop, fmt)
    for w in range(copy_stop, width):
        col_start, col_stop = replicate_source_range(w, width, out_width, pad_left)
        dst[w] = _gather_cell(src, row_start, row_stop, col_start, col_stop, fmt)


@leaf_helper
def _pad_rows(grad_output, grad_input, first, stop, pad_top, pad_left, column_sums, read_ahead, fmt):
    """Rows ``[first, stop)`` of the P*H rows of grad_input, one after the other
    (:func:`_pad_row`). A leaf helper: the views it takes of each row cost no reference counting
    (atomic operations, several per row in the kernel's own loop)."""
    height = grad_input.shape[1]
    out_height = grad_output.shape[1]
    p = first // height
    h = first - p * height
    for _ in range(first, stop):
        row_start, row_stop = replicate_source_range(h, height, out_height, pad_top)
        _pad_row(grad_output[p], grad_input[p, h], row_start, row_stop, pad_left, column_sums, read_ahead, fmt)
        h += 1
        if h == height:
            p, h = p + 1, 0


@leaf_helper
def _stream_pad_rows(grad_output, grad_input, first, stop, pad_top, pad_left, column_sums, read_ahead, fmt):
    """:func:`_pad_rows` with streaming stores. When no column is cropped away (``pad_left >=
    0``, ``pad_right >= 0``), rows are at least a cache line wide and grad_input is aligned to
    its element size, every whole cache line of a row with one source row is streamed, its two
    edge cells put in in registers (``_memory.stream_line_with_ends``, asking for grad_output
    ``read_ahead`` elements ahead), and so is the line such a row shares with the next row of
    the run when that row also has one source row: only the rows with several sources (the top
    and bottom edges of a plane) and the lines a run shares with its neighbours take plain
    stores. A line written partly by plain stores is read from memory first, and between
    streaming stores that costs more than the line, as for rows offset from the cache lines (a
    NumPy array's data starts 16 bytes into a page) with their shared lines stored plainly. Other geometries go row by row (:func:`_pad_row`, interiors streamed)."""
    planes, height, width = grad_input.shape
    out_height, out_width = grad_output.shape[1], grad_output.shape[2]
    per_line = cells_per_line(grad_input)
    itemsize = LINE_BYTES // per_line
    if pad_left < 0 or pad_left + width > out_width or width < per_line or line_offset(grad_input, 0) % itemsize != 0:
        _pad_rows(grad_output, grad_input, first, stop, pad_top, pad_left, column_sums, read_ahead, fmt)
        return
    destination = grad_input.reshape(grad_input.size)
    source = grad_output.reshape(grad_output.size)
    p = first // height
    h = first - p * height
    head_written = False  # whether the row's first partial line went out with the row before
    next_first = next_last = grad_output[0, 0, 0]  # the next row's edge cells, set with head_written
    for r in range(first, stop):
        row_start, row_stop = replicate_source_range(h, height, out_height, pad_top)
        next_p, next_h = (p, h + 1) if h + 1 < height else (p + 1, 0)
        if row_stop - row_start != 1:
            _pad_row(grad_output[p], grad_input[p, h], row_start, row_stop, pad_left, column_sums, read_ahead, fmt)
            head_written = False
        else:
            row = (p * out_height + row_start) * out_width + pad_left  # the source of the row's cell 0
            start = r * width
            done = min(width, (LINE_BYTES - line_offset(destination, start)) % LINE_BYTES // itemsize)
            if head_written:  # the edge sums came with the line this row shares with the row before
                first_value, last_value = next_first, next_last
            else:
                first_value, last_value = _edge_cells(grad_output[p, row_start], width, pad_left, fmt)
                copy_part_line(destination, start, source, row, done)
                if done > 0:
                    destination[start] = first_value
            while done + per_line <= width:
                if read_ahead > 0:
                    prefetch(source, row + done + read_ahead)
                stream_line_with_ends(
                    destination,
                    start + done,
                    source,
                    row + done,
                    row + done,
                    per_line,
                    -done,
                    first_value,
                    width - 1 - done,
                    last_value,
                )
                done += per_line
            tail = width - done
            head_written = False
            if tail > 0:
                next_start, next_stop = replicate_source_range(next_h, height, out_height, pad_top)
                if r + 1 < stop and next_stop - next_start == 1:
                    # the line shared with the next row, built from both rows' sources (a line's
                    # cells are read from each: the next row's source row follows this row's, so
                    # both reads stay inside grad_output)
                    next_row = (next_p * out_height + next_start) * out_width + pad_left
                    next_first, next_last = _edge_cells(grad_output[next_p, next_start], width, pad_left, fmt)
                    stream_line_with_ends(
                        destination,
                        start + done,
                        source,
                        row + done,
                        next_row - tail,
                        tail,
                        tail,
                        next_first,
                        tail - 1,
                        last_value,
                    )
                    head_written = True
                else:
                    copy_part_line(destination, start + done, source, row + done, tail)
                    destination[start + width - 1] = last_value
        p, h = next_p, next_h


@parallel_kernel
def replication_pad2d_bwd_nchw(grad_output, grad_input, pad_top, pad_left, read_ahead, fmt):
    """grad_output (P, OH, OW) -> grad_input (P, H, W), P = N*C planes, both C-contiguous.

    Parallel over TASK_GROUPS fixed runs of consecutive rows of the P*H rows of grad_input
    (fewer when there are fewer rows); a run writes only its rows, one after the other, with its
    own scratch. ``read_ahead`` None: plain stores (:func:`_pad_rows`). Otherwise, for a result
    larger than the cache, the same runs and the same values, but the rows with one source row
    are written with streaming stores, edge cells and the lines rows share included where the
    geometry allows (:func:`_stream_pad_rows`, reading grad_output ``read_ahead`` elements
    ahead), and each run ends with a store fence. Numba drops the branch a call does not take at
    compile time, so a first (small) call does not compile the streaming code.
    """
    rows = grad_input.shape[0] * grad_input.shape[1]
    runs = min(rows, TASK_GROUPS)
    # every run's scratch in one allocation (one per run cost more than a tiny call's work)
    scratch = np.full((runs, grad_input.shape[2]), accumulator(grad_output, fmt))
    for run in prange(runs):
        column_sums = scratch[run]
        first, stop = run * rows // runs, (run + 1) * rows // runs
        if read_ahead is None:
            _pad_rows(grad_output, grad_input, first, stop, pad_top, pad_left, column_sums, None, fmt)
        else:
            _stream_pad_rows(grad_output, grad_input, first, stop, pad_top, pad_left, column_sums, read_ahead, fmt)
            store_fence()


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
                dst[w, c] = store(one_nan(acc[c]), fmt)


class Geometry(NamedTuple):
    """A validated, non-empty replication_pad2d_backward call, as its kernels see it."""

    nhwc: bool  # the kernels' memory layout is (N, H, W, C); else (N*C, H, W) planes
    batch: int  # 1 for a 3-D input
    channels: int
    height: int
    width: int
    out_height: int
    out_width: int
    pad_top: int
    pad_left: int
    itemsize: int  # of the data
    fmt: StorageFormat


def plan(geometry):
    """The plan of a non-empty call (a :class:`~fastbwd.kernels._jit.Plan`), run on the kernel
    views of grad_output and grad_input in the geometry's layout: NCHW, any shapes holding the
    N*C planes (a 3-D call's too); NHWC, ``(N, OH, OW, C)`` and ``(N, H, W, C)``. An NCHW result
    of ``_memory.STREAM_MIN_BYTES`` or more (larger than the cache) is written with streaming
    stores."""
    g = geometry
    planes = g.batch * g.channels
    work = planes * (g.out_height * g.out_width + g.height * g.width)
    if g.nhwc:
        shapes = ((g.batch, g.out_height, g.out_width, g.channels), (g.batch, g.height, g.width, g.channels))
        return Plan(Launch(replication_pad2d_bwd_nhwc, work), shapes, (g.pad_top, g.pad_left, g.fmt))
    read_ahead = None
    if planes * g.height * g.width * g.itemsize >= _memory.STREAM_MIN_BYTES:
        read_ahead = READ_AHEAD_LINES * (LINE_BYTES // g.itemsize)
    shapes = ((planes, g.out_height, g.out_width), (planes, g.height, g.width))
    return Plan(Launch(replication_pad2d_bwd_nchw, work), shapes, (g.pad_top, g.pad_left, read_ahead, g.fmt))
