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

How, per task = (plane, block of input rows) or (group of 16 planes) for NCHW, one input row
for NHWC, with task-local scratch that stays in cache and no atomics:

1. height pass: every grad_output row a tap sends into the block is added, scaled, to the
   scratch row of its target: contiguous, vectorised row operations;
2. NCHW: the scratch block is transposed (``OW x LANES``, 16 x 16 register transposes), so
   that the width pass ``G[w, :] += weight * U_t[ow, :]`` runs on 16-lane vectors of the
   block's rows (``_simd`` intrinsics: LLVM leaves such short loops scalar); the result is
   transposed back before the rows are stored. NHWC works in gather form (each input row and
   column adds its sources in the same ascending order) on channel vectors.
"""

import numpy as np
from numba import prange

from ._halfbits import accumulator, load, store
from ._jit import helper, parallel_kernel
from ._simd import LANES, lanes_axpy, transpose_lanes

#: NCHW planes whose grad_output, height-pass and result planes together hold at most this many
#: elements (x LANES planes: 512 KiB of float32, inside L2) run LANES planes at a time...
PLANE_LANES_SCRATCH = 8192
#: ... when there are enough planes to keep every thread busy that way.
PLANE_LANES_MIN_PLANES = 8 * LANES


def tap_table(index, weight, dtype):
    """The C-contiguous ``(index, weight)`` pair of one axis from array-likes of shape (O, taps)."""
    index = np.ascontiguousarray(index, dtype=np.int64)
    weight = np.ascontiguousarray(weight, dtype=dtype)
    if index.ndim == 1:
        index, weight = index[:, None], weight[:, None]
    return index, weight


def separable_bwd_nchw(grad_output, grad_input, index_h, weight_h, index_w, weight_w, fmt):
    """grad_output (P, OH, OW) -> grad_input (P, H, W), P = N*C planes, both C-contiguous.

    Half formats as uint16 views with their StorageFormat ``fmt``; tables as in the module doc.
    Small planes run LANES planes at a time (:func:`_separable_bwd_planes`), large ones LANES
    rows at a time; both compute every element with the same operations in the same order.
    """
    planes, height, width = grad_input.shape
    out_height, out_width = grad_output.shape[1], grad_output.shape[2]
    scratch = out_height * out_width + height * out_width + height * width
    if scratch <= PLANE_LANES_SCRATCH and planes >= PLANE_LANES_MIN_PLANES:
        _separable_bwd_planes(grad_output, grad_input, index_h, weight_h, index_w, weight_w, fmt)
    else:
        _separable_bwd_nchw(grad_output, grad_input, index_h, weight_h, index_w, weight_w, fmt)


def separable_bwd_nhwc(grad_output, grad_input, index_h, weight_h, index_w, weight_w, fmt):
    """grad_output (N, OH, OW, C) -> grad_input (N, H, W, C), both C-contiguous.

    Half formats as uint16 views with their StorageFormat ``fmt``; tables as in the module doc.
    """
    height, width = grad_input.shape[1], grad_input.shape[2]
    _separable_bwd_nhwc(grad_output, grad_input, *gather_table(index_h, weight_h, height),
                        *gather_table(index_w, weight_w, width), fmt)


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
def _touching_rows(index_h, row_start, row_stop):
    """``[lo, hi)``: the output rows with a tap into input rows ``[row_start, row_stop)``."""
    lo = index_h.shape[0]
    hi = 0
    for oh in range(index_h.shape[0]):
        for t in range(index_h.shape[1]):
            target = index_h[oh, t]
            if row_start <= target < row_stop:
                lo = min(lo, oh)
                hi = max(hi, oh + 1)
    return lo, max(hi, lo)


@parallel_kernel
def _separable_bwd_nchw(grad_output, grad_input, index_h, weight_h, index_w, weight_w, fmt):
    """Parallel over (plane, block of LANES input rows); a task writes only its rows."""
    planes, height, width = grad_input.shape
    out_width = grad_output.shape[2]
    taps_h, taps_w = index_h.shape[1], index_w.shape[1]
    blocks = (height + LANES - 1) // LANES
    zero = accumulator(grad_output, fmt)
    for task in prange(planes * blocks):
        plane = task // blocks
        row_start = (task - plane * blocks) * LANES
        rows = min(LANES, height - row_start)
        source = grad_output[plane]
        # 1. height pass into rows x OW
        block = np.full((LANES, out_width), zero)
        lo, hi = _touching_rows(index_h, row_start, row_start + rows)
        for oh in range(lo, hi):
            row = source[oh]
            for t in range(taps_h):
                r = index_h[oh, t] - row_start
                if 0 <= r < rows:
                    c = weight_h[oh, t]
                    acc = block[r]
                    for k in range(out_width):
                        acc[k] += c * load(row[k], fmt)
        # 2. transpose to OW x LANES; width pass on vectors of the block's LANES rows
        block_t = np.empty((out_width, LANES), block.dtype)
        whole = out_width - out_width % LANES
        for k in range(0, whole, LANES):
            transpose_lanes(block_t, k, 0, block, 0, k)
        for k in range(whole, out_width):
            for r in range(LANES):
                block_t[k, r] = block[r, k]
        result_t = np.full((width, LANES), zero)
        for ow in range(out_width):
            for t in range(taps_w):
                w = index_w[ow, t]
                if w >= 0:
                    lanes_axpy(result_t, w, 0, block_t, ow, 0, weight_w[ow, t])
        # 3. transpose back to LANES x W, store the block's rows (rounding once)
        result = np.empty((LANES, width), block.dtype)
        whole = width - width % LANES
        for w in range(0, whole, LANES):
            transpose_lanes(result, 0, w, result_t, w, 0)
        for w in range(whole, width):
            for r in range(LANES):
                result[r, w] = result_t[w, r]
        for r in range(rows):
            destination = grad_input[plane, row_start + r]
            values = result[r]
            for w in range(width):
                destination[w] = store(values[w], fmt)


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
            transpose_lanes(lanes_out, k, 0, staged, 0, k)
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
            transpose_lanes(planes_in, 0, k, result, k, 0)
        for lane in range(used):
            destination = grad_input[first + lane].reshape(in_size)
            values = planes_in[lane]
            for k in range(in_size):
                destination[k] = store(values[k], fmt)


@parallel_kernel
def _separable_bwd_nhwc(grad_output, grad_input, start_h, source_h, weight_h, start_w, source_w, weight_w, fmt):
    """Parallel over the N*H input rows; a task writes only its row ``grad_input[n, h]``.

    In gather form (tables from :func:`gather_table`): the row's height-pass sum ``U`` (OW x C)
    adds its source rows one after the other while it stays in L1, then each ``w`` adds its
    ``U`` columns as 16-channel vectors. Same operations, same order as the NCHW kernels.
    """
    batch, height, width, channels = grad_input.shape
    out_width = grad_output.shape[2]
    row_length = out_width * channels
    whole = channels - channels % LANES
    zero = accumulator(grad_output, fmt)
    for task in prange(batch * height):
        n = task // height
        h = task - n * height
        # 1. height pass: U = sum of the source rows, ascending
        partial = np.full(row_length, zero)
        for j in range(start_h[h], start_h[h + 1]):
            c = weight_h[j]
            row = grad_output[n, source_h[j]].reshape(row_length)
            for k in range(row_length):
                partial[k] += c * load(row[k], fmt)
        columns = partial.reshape((out_width, channels))
        # 2. width pass: each w adds its source columns, ascending, as channel vectors
        result = np.full((width, channels), zero)
        for w in range(width):
            for j in range(start_w[w], start_w[w + 1]):
                c = weight_w[j]
                ow = source_w[j]
                for k in range(0, whole, LANES):
                    lanes_axpy(result, w, k, columns, ow, k, c)
                acc = result[w]
                column = columns[ow]
                for k in range(whole, channels):
                    acc[k] += c * column[k]
        destination = grad_input[n, h]
        for w in range(width):
            for k in range(channels):
                destination[w, k] = store(result[w, k], fmt)
