"""The separable backward engine shared by upsample_bilinear2d_backward and avg_pool2d_backward.

Both backwards are separable linear maps: per (n, c) plane,
``grad_input = A_h^T . grad_output . A_w`` with band matrices ``A_h`` (OH x H) and ``A_w``
(OW x W). The engine takes each axis in *forward tap* form, the way the forward reads it:

    output index ``o`` reads input ``index[o, t]`` with weight ``weight[o, t]`` for each tap
    ``t`` (a negative index marks an unused tap)

``index`` is int64 and ``weight`` float32 (float64 for float64 data), both ``(output size,
taps)`` C-contiguous. Bilinear upsampling has two taps per output index (``index0, lambda0`` and
``index1, lambda1``), average pooling one tap per window cell. Used indices must lie in
``[0, input size)``: the kernels do no bounds checking; the api layer builds the tables.

Result, in the compute type (float32 for float32/float16/bfloat16, float64 for float64)::

    U[p, h, ow]  = sum over oh ascending, taps t with index_h[oh, t] == h of weight_h[oh, t] * grad_output[p, oh, ow]
    grad_input[p, h, w] = sum over ow ascending, taps t with index_w[ow, t] == w of weight_w[ow, t] * U[p, h, ow]

Every sum starts from +0.0 and adds in that order (height axis first, then width); each value
is stored once (half formats round to nearest even); an input index no tap reads gets 0. Both
layouts perform the same operations in the same order, so NCHW and NHWC results are bitwise
equal, and the task partition never changes a bit (it does not depend on the thread count).

How, with task-local scratch that stays in cache and no atomics. Both passes work in *gather
form* (tables from :func:`gather_table`: each input index adds its sources, in the order above)
with 16-lane register sums (``_lanes`` intrinsics; LLVM keeps neither a runtime-length sum nor a
16 x 16 tile in registers by itself):

* NCHW, large planes: a task is one block of LANES input rows of one plane. The height pass sums
  the block's source rows 16 columns at a time for its 16 rows, read in place, and transposes
  each 16 x 16 tile in registers (``U_t``: OW x LANES); the width pass sums ``U_t`` rows into 16
  columns of the block's rows and transposes back; the rows are stored, rounded once. Memory
  works while the core computes: after each tile a few cache lines of the next task's source
  rows are prefetched (height pass) or of its destination rows, for writing (width pass).
  Without the prefetches, reading the rows in place is slower than first copying them in one
  sequential read (16-column chunks of many rows defeat the hardware prefetcher); with them it
  is faster than that copy (docs/history.md). Tasks run in TASK_GROUPS fixed groups, each allocating its scratch once. A last
  partial tile starts LANES columns before the end and recomputes the columns it shares with
  its neighbour (the same operations, so the same bits); rows narrower than LANES are staged
  into zero-padded rows instead.
* NCHW, small planes with grad rows narrower than LANES: LANES planes at a time as the vector
  lanes (:func:`_separable_bwd_planes`).
* NHWC: a task is one input row; its height-pass sum ``U`` (OW x C) adds whole source rows one
  after the other (one sequential stream), then each ``w`` sums its ``U`` columns as 16-channel
  vectors while the next task's new source rows and its destination row are prefetched.
"""

import math

import numpy as np
from numba import prange

from ._halfbits import NATIVE, accumulator, load, one_nan, store
from ._jit import Launch, Plan, helper, parallel_kernel
from ._lane_tiles import gather_transpose_lanes, lanes_axpy, lanes_gather_sum, transpose_lanes
from ._lanes import LANES
from ._memory import prefetch, prefetch_for_write

#: NCHW planes with grad_output rows narrower than LANES, whose grad_output, height-pass and
#: result planes together hold at most this many elements (x LANES planes: 512 KiB of float32,
#: inside L2), run LANES planes at a time: faster than row blocks, which stage such narrow
#: rows; from 16-wide grad rows on, row blocks read in place and win (docs/history.md).
PLANE_LANES_SCRATCH = 8192
#: ... when there are enough planes to keep every thread busy that way.
PLANE_LANES_MIN_PLANES = 8 * LANES
#: The (plane, row block) tasks of large NCHW planes run in this many fixed groups (fewer when
#: there are fewer tasks); a group allocates its scratch once. Results do not depend on it.
TASK_GROUPS = 64
#: Row-block tasks prefetch the next task's source and destination rows when a grad_output row
#: has at least this many bytes: long rows gain, short rows lose (docs/history.md).
PREFETCH_MIN_ROW_BYTES = 256


def tap_table(index, weight, dtype):
    """The C-contiguous ``(index, weight)`` pair of one axis from array-likes of shape (O, taps)."""
    index = np.ascontiguousarray(index, dtype=np.int64)
    weight = np.ascontiguousarray(weight, dtype=dtype)
    if index.ndim == 1:
        index, weight = index[:, None], weight[:, None]
    return index, weight


def plan(nhwc, grad_shape, result_shape, index_h, weight_h, index_w, weight_w, fmt):
    """The engine's plan (a :class:`~fastbwd.kernels._jit.Plan`) for grad_output of kernel shape
    ``grad_shape`` -> grad_input of ``result_shape``: ``(P, OH, OW)`` -> ``(P, H, W)``, P = N*C
    planes, or with ``nhwc`` ``(N, OH, OW, C)`` -> ``(N, H, W, C)``, both C-contiguous; the tap
    tables of both axes as in the module doc; ``fmt`` the arrays' StorageFormat.

    NCHW: small planes with narrow grad rows run LANES planes at a time
    (:func:`_separable_bwd_planes`), the others LANES rows at a time (:func:`_separable_bwd_nchw`);
    both compute every element with the same operations in the same order. Both NCHW row blocks
    and NHWC read the axes as gather tables (:func:`gather_table`), built here once.
    """
    work = math.prod(grad_shape) + math.prod(result_shape)
    if nhwc:
        height, width = result_shape[1], result_shape[2]
        kernel, tables = _separable_bwd_nhwc, None
    else:
        planes, height, width = result_shape
        out_height, out_width = grad_shape[1], grad_shape[2]
        scratch = out_height * out_width + height * out_width + height * width
        if out_width < LANES and scratch <= PLANE_LANES_SCRATCH and planes >= PLANE_LANES_MIN_PLANES:
            kernel, tables = _separable_bwd_planes, (index_h, weight_h, index_w, weight_w)
        else:
            kernel, tables = _separable_bwd_nchw, None
    if tables is None:
        tables = (*gather_table(index_h, weight_h, height), *gather_table(index_w, weight_w, width))
    return Plan(Launch(kernel, work), (grad_shape, result_shape), (*tables, fmt))


def gather_table(index, weight, input_size):
    """The tap table of one axis seen from the inputs (CSR): input ``i`` reads the outputs
    ``source[start[i]:start[i + 1]]`` with the matching weights, in ascending output index and
    then tap order, which is the engine's summation order."""
    outputs = np.repeat(np.arange(index.shape[0], dtype=np.int64), index.shape[1])
    targets, weights = index.ravel(), weight.ravel()
    used = targets >= 0
    outputs, targets, weights = outputs[used], targets[used], weights[used]
    order = np.argsort(targets, kind="stable")
    start = np.zeros(input_size + 1, np.int64)
    np.cumsum(np.bincount(targets, minlength=input_size), out=start[1:])
    return start, np.ascontiguousarray(outputs[order]), np.ascontiguousarray(weights[order])


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@helper
def _source_rows(start_h, source_h, row_start, row_stop):
    """``[lo, hi)``: the grad_output rows that input rows ``[row_start, row_stop)`` read
    (``hi <= lo`` when they read none)."""
    lo, hi = 1 << 62, 0
    for s in range(start_h[row_start], start_h[row_stop]):
        lo = min(lo, source_h[s])
        hi = max(hi, source_h[s] + 1)
    return lo, hi


@helper
def _lines_per_step(itemsize, first, stop, steps):
    """How many cache lines of elements ``[first, stop)`` of an array of ``itemsize``-byte
    elements each of ``steps`` steps prefetches so that together they cover them (at least one).
    (The element size, not the array: one compiled function for the source and the result.)"""
    line = 64 // itemsize
    return (stop - first + line - 1) // line // steps + 1


@helper
def _prefetch_share(flat, ahead, stop, lines, for_write):
    """Prefetch the next ``lines`` cache lines of ``flat[ahead:stop]`` (for writing when
    ``for_write``) and return where the next share starts: a kernel spreads a region's
    prefetches over its compute steps, so that memory works while the core computes."""
    line = 64 // flat.itemsize
    for _ in range(lines):
        if ahead < stop:
            if for_write:
                prefetch_for_write(flat, ahead)
            else:
                prefetch(flat, ahead)
        ahead += line
    return ahead


@helper
def _next_source_elements(start_h, source_h, task, tasks, blocks, height, out_height, out_width):
    """``[first, stop)``: the flat grad_output elements that task ``task`` of the row-block kernel
    reads (empty past the last task)."""
    if task >= tasks:
        return 0, 0
    plane = task // blocks
    row_start = (task - plane * blocks) * LANES
    lo, hi = _source_rows(start_h, source_h, row_start, min(row_start + LANES, height))
    if hi <= lo:
        return 0, 0
    return (plane * out_height + lo) * out_width, (plane * out_height + hi) * out_width


@helper
def _narrow_height_pass(source, block_t, staged, staged_index, start_h, source_h, weight_h, row_start, rows, fmt):
    """The height pass of one row block when grad_output rows are narrower than LANES: the
    block's source rows are staged (decoded) into rows of LANES columns, zero beyond OW, so that
    the tile reads no further than a row."""
    lo, hi = _source_rows(start_h, source_h, row_start, row_start + rows)
    for i in range(hi - lo):
        source_row = source[lo + i]
        target = staged[i]
        for k in range(source.shape[1]):
            target[k] = load(source_row[k], fmt)
    for s in range(start_h[row_start], start_h[row_start + rows]):
        staged_index[s] = source_h[s] - lo
    gather_transpose_lanes(block_t, 0, 0, staged, staged_index, weight_h, start_h, row_start, rows, 0, NATIVE)


@helper
def _destination_elements(task, blocks, height, width):
    """``[first, stop)``: the flat grad_input elements that task ``task`` of the row-block kernel
    writes."""
    plane = task // blocks
    row_start = (task - plane * blocks) * LANES
    return (plane * height + row_start) * width, (plane * height + min(row_start + LANES, height)) * width


@parallel_kernel
def _separable_bwd_nchw(grad_output, grad_input, start_h, source_h, weight_h, start_w, source_w, weight_w, fmt):
    """Parallel over fixed groups of (plane, block of LANES input rows) tasks; a task writes only
    its rows. Gather tables (:func:`gather_table`) for both axes."""
    planes, height, width = grad_input.shape
    out_width = grad_output.shape[2]
    blocks = (height + LANES - 1) // LANES
    tasks = planes * blocks
    groups = min(tasks, TASK_GROUPS)
    # grad_output rows narrower than LANES are staged (decoded) into rows of LANES columns, zero
    # beyond OW, so that no tile reads past a row; wider rows are read in place
    narrow = out_width < LANES
    # the most source rows a block reads; computed unconditionally: Numba hoists the scratch
    # allocations below out of the parallel loop, and a size computed under an ``if`` here
    # reached them wrong (out-of-bounds writes, caught by NUMBA_BOUNDSCHECK=1)
    span = 0
    for block in range(blocks):
        first_row, stop_row = _source_rows(start_h, source_h, block * LANES, min(block * LANES + LANES, height))
        span = max(span, stop_row - first_row)
    tile_rows, result_width = max(out_width, LANES), max(width, LANES)
    flat_source = grad_output.reshape(grad_output.size)
    flat_result = grad_input.reshape(grad_input.size)
    prefetching = out_width * grad_output.itemsize >= PREFETCH_MIN_ROW_BYTES
    for group in prange(groups):
        staged = np.zeros((span if narrow else 0, LANES), weight_h.dtype)
        staged_index = np.empty(source_h.shape[0] if narrow else 0, np.int64)  # source_h, block-relative
        block_t = np.empty((tile_rows, LANES), weight_h.dtype)  # U_t: OW x the block's rows
        result = np.empty((LANES, result_width), weight_h.dtype)
        for task in range(group * tasks // groups, (group + 1) * tasks // groups):
            plane = task // blocks
            row_start = (task - plane * blocks) * LANES
            rows = min(LANES, height - row_start)
            # 1. height pass, 16 columns at a time, transposed into U_t
            if narrow:
                _narrow_height_pass(
                    grad_output[plane], block_t, staged, staged_index, start_h, source_h, weight_h, row_start, rows, fmt
                )
            else:
                # meanwhile the next task's source rows are prefetched, a few lines after each tile
                ahead, ahead_stop = 0, 0
                if prefetching:
                    ahead, ahead_stop = _next_source_elements(
                        start_h, source_h, task + 1, tasks, blocks, height, grad_output.shape[1], out_width
                    )
                per_tile = _lines_per_step(flat_source.itemsize, ahead, ahead_stop, (out_width + LANES - 1) // LANES)
                source = grad_output[plane]
                for k in range(0, out_width, LANES):
                    column = min(k, out_width - LANES)
                    gather_transpose_lanes(
                        block_t, column, 0, source, source_h, weight_h, start_h, row_start, rows, column, fmt
                    )
                    ahead = _prefetch_share(flat_source, ahead, ahead_stop, per_tile, False)
            # 2. width pass, 16 input columns at a time, transposed back to rows; meanwhile the
            #    next task's destination rows are prefetched for writing
            ahead, ahead_stop = 0, 0
            if prefetching and task + 1 < tasks:
                ahead, ahead_stop = _destination_elements(task + 1, blocks, height, width)
            per_tile = _lines_per_step(flat_result.itemsize, ahead, ahead_stop, (result_width + LANES - 1) // LANES)
            for w in range(0, result_width, LANES):
                column = min(w, result_width - LANES)
                gather_transpose_lanes(
                    result,
                    0,
                    column,
                    block_t,
                    source_w,
                    weight_w,
                    start_w,
                    column,
                    min(LANES, width - column),
                    0,
                    NATIVE,
                )
                ahead = _prefetch_share(flat_result, ahead, ahead_stop, per_tile, True)
            # 3. store the block's rows, rounding once
            for r in range(rows):
                destination = grad_input[plane, row_start + r]
                values = result[r]
                for w in range(width):
                    destination[w] = store(one_nan(values[w]), fmt)


@parallel_kernel
def _separable_bwd_planes(grad_output, grad_input, index_h, weight_h, index_w, weight_w, fmt):
    """Parallel over groups of LANES planes; a task writes only its planes.

    The group is transposed so that its LANES planes become the lanes of every position
    (``(position, LANES)``); both passes then add 16-lane vectors, exactly the operations of the
    per-element formula; the result is transposed back. A partial last group computes on zero
    lanes that are never stored.
    """
    planes, height, width = grad_input.shape
    out_height, out_width = grad_output.shape[1], grad_output.shape[2]
    taps_h, taps_w = index_h.shape[1], index_w.shape[1]
    out_size, in_size = out_height * out_width, height * width
    padded_out = (out_size + LANES - 1) // LANES * LANES
    padded_in = (in_size + LANES - 1) // LANES * LANES
    groups = (planes + LANES - 1) // LANES
    zero = accumulator(grad_output, fmt)
    for group in prange(groups):
        first = group * LANES
        used = min(LANES, planes - first)
        # decoded planes (LANES, OH*OW), transposed to (OH*OW, LANES)
        staged = np.full((LANES, padded_out), zero)
        for lane in range(used):
            source = grad_output[first + lane].reshape(out_size)
            target = staged[lane]
            for k in range(out_size):
                target[k] = load(source[k], fmt)
        lanes_out = np.empty((padded_out, LANES), staged.dtype)
        for k in range(0, padded_out, LANES):
            transpose_lanes(lanes_out, k, 0, staged, 0, k, NATIVE)
        # height pass: (H*OW, LANES)
        partial = np.full((height * out_width, LANES), zero)
        for oh in range(out_height):
            for t in range(taps_h):
                h = index_h[oh, t]
                if h >= 0:
                    c = weight_h[oh, t]
                    for ow in range(out_width):
                        lanes_axpy(partial, h * out_width + ow, 0, lanes_out, oh * out_width + ow, 0, c)
        # width pass: (H*W, LANES)
        result = np.full((padded_in, LANES), zero)
        for h in range(height):
            for ow in range(out_width):
                for t in range(taps_w):
                    w = index_w[ow, t]
                    if w >= 0:
                        lanes_axpy(result, h * width + w, 0, partial, h * out_width + ow, 0, weight_w[ow, t])
        # transpose back and store (rounding once)
        planes_in = np.empty((LANES, padded_in), staged.dtype)
        for k in range(0, padded_in, LANES):
            transpose_lanes(planes_in, 0, k, result, k, 0, NATIVE)
        for lane in range(used):
            destination = grad_input[first + lane].reshape(in_size)
            values = planes_in[lane]
            for k in range(in_size):
                destination[k] = store(one_nan(values[k]), fmt)


@helper
def _next_new_rows(start_h, source_h, task, tasks, height, out_height):
    """``[first, stop)``: the (n, oh) rows of grad_output, counted over the flattened N*OH, that
    NHWC task ``task + 1`` reads and task ``task`` does not (empty past the last task)."""
    if task + 1 >= tasks:
        return 0, 0
    n, h = task // height, task % height
    next_n, next_h = (task + 1) // height, (task + 1) % height
    lo, hi = _source_rows(start_h, source_h, next_h, next_h + 1)
    if next_n == n:
        lo = max(lo, _source_rows(start_h, source_h, h, h + 1)[1])
    if hi <= lo:
        return 0, 0
    return next_n * out_height + lo, next_n * out_height + hi


@parallel_kernel
def _separable_bwd_nhwc(grad_output, grad_input, start_h, source_h, weight_h, start_w, source_w, weight_w, fmt):
    """Parallel over the N*H input rows; a task writes only its row ``grad_input[n, h]``.

    In gather form (tables from :func:`gather_table`): the row's height-pass sum ``U`` (OW x C)
    adds its source rows one after the other, then each ``w`` sums its ``U`` columns as
    16-channel vectors in a register, while the source rows new to the next task are
    prefetched, and its destination row for writing. Same
    operations, same order as the NCHW kernels. A last partial vector starts LANES channels
    before the end (recomputing the shared ones, bit for bit); fewer than LANES channels run as
    scalar loops.
    """
    batch, height, width, channels = grad_input.shape
    out_height, out_width = grad_output.shape[1], grad_output.shape[2]
    row_length = out_width * channels
    zero = accumulator(grad_output, fmt)
    flat_source = grad_output.reshape(grad_output.size)
    flat_result = grad_input.reshape(grad_input.size)
    for task in prange(batch * height):
        n = task // height
        h = task - n * height
        # 1. height pass: U = sum of the source rows, ascending, one whole row after the other
        #    (a single sequential stream: summing 16 elements of all of them at a time in a
        #    register was slower from DRAM)
        partial = np.full(row_length, zero)
        for j in range(start_h[h], start_h[h + 1]):
            c = weight_h[j]
            row = grad_output[n, source_h[j]].reshape(row_length)
            for k in range(row_length):
                partial[k] += c * load(row[k], fmt)
        columns = partial.reshape((out_width, channels))
        # the rows the next task reads and this one did not are prefetched during the width pass
        # and so is, for writing, the next task's destination row
        ahead, ahead_stop = _next_new_rows(start_h, source_h, task, batch * height, height, out_height)
        ahead, ahead_stop = ahead * row_length, ahead_stop * row_length
        per_w = _lines_per_step(flat_source.itemsize, ahead, ahead_stop, width)
        out_ahead = (task + 1) * width * channels
        out_stop = min(out_ahead + width * channels, grad_input.size)
        out_per_w = _lines_per_step(flat_result.itemsize, out_ahead, out_stop, width)
        # 2. width pass: each w sums its source columns, ascending, as channel vectors
        result = np.empty((width, channels), weight_h.dtype)
        for w in range(width):
            ahead = _prefetch_share(flat_source, ahead, ahead_stop, per_w, False)
            out_ahead = _prefetch_share(flat_result, out_ahead, out_stop, out_per_w, True)
            if channels >= LANES:
                for k in range(0, channels, LANES):
                    channel = min(k, channels - LANES)
                    lanes_gather_sum(
                        result, w, channel, columns, source_w, weight_w, start_w[w], start_w[w + 1], channel, NATIVE
                    )
            else:
                for k in range(channels):
                    acc = zero
                    for j in range(start_w[w], start_w[w + 1]):
                        acc += weight_w[j] * columns[source_w[j], k]
                    result[w, k] = acc
        destination = grad_input[n, h]
        for w in range(width):
            for k in range(channels):
                destination[w, k] = store(one_nan(result[w, k]), fmt)
