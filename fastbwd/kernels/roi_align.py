"""roi_align_backward loop nests (SPEC §4).

Two passes, no atomics:

1. Per-box sample tables (parallel over boxes; each box writes only its own slots). The sample
   positions of a box are separable: ``y`` depends on ``(ph, iy)`` only and ``x`` on ``(pw, ix)``
   only, and the bilinear weight of a corner is ``(y weight) * (x weight)``. So each box gets one
   table per axis (torchvision's ``pre_calc``, factored): for every bin and every sample of that
   bin that lands inside ``[-1, H]`` (resp. ``[-1, W]``), its low pixel index, the step to the high
   pixel (0 or 1) and its two weights ``(1 - l, l)``; the y weights are already divided by the
   bin's sample count. Only the sample indices that can land inside the image are visited
   (:func:`visible_samples`), so a table holds at most the samples that can land in the image
   (at most about ``2 (H + 1) + 6`` per bin along y for an adaptive grid), never the whole grid.
   :func:`roi_align_sample_counts` sizes the slots, :func:`roi_align_sample_tables` fills them.
2. The scatter (:func:`roi_align_bwd`), parallel over (image, channel block, band of rows): a
   task owns that block and band of ``grad_input[b]``, accumulates in a small channels-last
   scratch, and walks the boxes of image ``b`` in their given order, every bin, every sample
   ``(iy, ix)``, then the four corners ``ll, lh, hl, hh`` (skipping corners on other rows): the
   SPEC loop order for every output element, whatever the number of threads, block or band.

All coordinate and weight arithmetic is done in the boxes' dtype (float32 for float32, float16
and bfloat16 data; float64 for float64), as torchvision does.
"""

import math

import numpy as np
from numba import prange, types
from numba.extending import overload

from ._halfbits import load, store
from ._jit import helper, parallel_kernel
from ._simd import LANES, decode_transpose_lanes, transpose_lanes


def like(value, template):
    """``value`` converted to the floating type of ``template`` (njit only)."""
    raise NotImplementedError("like() is only callable from @njit code")


@overload(like, inline="always")
def _like(value, template):
    if template == types.float32:
        return lambda value, template: np.float32(value)
    return lambda value, template: np.float64(value)


@helper
def box_geometry(box, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned):
    """SPEC §4 per-box setup in the boxes' dtype.

    ``box`` is a finite row ``(b, x1, y1, x2, y2)``; ``sampling_ratio`` is a float (0 = adaptive).
    Returns ``(y1, x1, bin_h, bin_w, grid_h, grid_w, count)``, all floats of the box dtype;
    ``grid_h <= 0`` or ``grid_w <= 0`` means the box has no samples. The grid sizes stay floats
    (an adaptive grid of an absurd box does not fit any integer type) and so does the divisor
    ``count = grid_h * grid_w``, which may round or overflow to +inf (its samples then add 0).
    """
    zero = like(0.0, box[0])
    offset = like(0.5, zero) if aligned else zero
    scale = like(spatial_scale, zero)
    x1 = box[1] * scale - offset
    y1 = box[2] * scale - offset
    roi_w = (box[3] * scale - offset) - x1
    roi_h = (box[4] * scale - offset) - y1
    if not aligned:
        # torchvision forces malformed boxes to at least 1 x 1 (not done when aligned).
        roi_w = max(roi_w, like(1.0, zero))
        roi_h = max(roi_h, like(1.0, zero))
    bin_h = roi_h / like(pooled_height, zero)
    bin_w = roi_w / like(pooled_width, zero)
    # A finite box can still overflow after scaling: every sample coordinate would be NaN or
    # +-Inf and skipped, so the whole box is skipped here (also keeps the index math finite).
    if not (math.isfinite(x1) and math.isfinite(y1) and math.isfinite(bin_h) and math.isfinite(bin_w)):
        return y1, x1, bin_h, bin_w, zero, zero, zero
    if sampling_ratio > 0:
        grid_h = like(sampling_ratio, zero)
        grid_w = grid_h
    else:
        # np.ceil keeps the float type: math.ceil would convert to an int64 that can overflow.
        grid_h = like(np.ceil(roi_h / like(pooled_height, zero)), zero)
        grid_w = like(np.ceil(roi_w / like(pooled_width, zero)), zero)
    return y1, x1, bin_h, bin_w, grid_h, grid_w, grid_h * grid_w


@helper
def visible_samples(start, bin_size, grid, size):
    """The candidate sample indices ``[first, first + n)`` of one bin along one axis.

    Sample ``i`` of the bin sits at ``start + (i + 0.5) * bin_size / grid``; only those in
    ``[-1, size]`` contribute. The interval solved from that linear formula (in float64) is
    widened by 2 on each side against rounding; the caller applies the exact SPEC test to every
    candidate, so the result equals visiting all ``grid`` samples. ``first`` is a float (it may
    exceed any integer type for an absurd box); ``n`` is at most ``(size + 1) / step + 6``.
    """
    if not (grid >= 1):
        return 0.0, 0
    grid64 = np.float64(grid)
    step = np.float64(bin_size) / grid64
    if not (step != 0.0):
        # Every sample at the same coordinate (an empty bin with a fixed sampling_ratio).
        return 0.0, np.int64(grid64)
    low = (-1.0 - np.float64(start)) / step - 0.5
    high = (np.float64(size) - np.float64(start)) / step - 0.5
    if step < 0.0:
        low, high = high, low
    first = max(np.floor(low) - 2.0, 0.0)
    last = min(np.ceil(high) + 2.0, grid64 - 1.0)
    if not (last >= first):
        return 0.0, 0
    return first, np.int64(last - first + 1.0)


@helper
def _bin_start(origin, index, bin_size):
    """Start of bin ``index`` along an axis: ``origin + index * bin_size`` in the box dtype."""
    return origin + like(index, origin) * bin_size


@parallel_kernel
def roi_align_sample_counts(boxes, box_order, pooled_height, pooled_width, spatial_scale,
                            sampling_ratio, aligned, height, width, y_slots, x_slots):
    """Slot counts of the sample tables: ``y_slots[j, ph]`` / ``x_slots[j, pw]`` for box ``j``.

    Parallel over the boxes of ``box_order``; iteration ``j`` writes only row ``j``.
    """
    for j in prange(box_order.shape[0]):
        y1, x1, bin_h, bin_w, grid_h, grid_w, count = box_geometry(
            boxes[box_order[j]], pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned)
        for ph in range(pooled_height):
            first, n = visible_samples(_bin_start(y1, ph, bin_h), bin_h, grid_h, height)
            y_slots[j, ph] = n if grid_w >= 1 else 0
        for pw in range(pooled_width):
            first, n = visible_samples(_bin_start(x1, pw, bin_w), bin_w, grid_w, width)
            x_slots[j, pw] = n if grid_h >= 1 else 0


@helper
def _fill_axis(table_start, table_used, row, bins, origin, bin_size, grid, size, divisor,
               low_index, high_step, low_weight, high_weight):
    """Fill one box's table along one axis (see the module docstring); weights / ``divisor``.

    Returns the lowest and highest pixel index the box's samples touch (``size, -1`` if none).
    """
    lowest, highest = size, -1
    one = like(1.0, origin)
    half = like(0.5, origin)
    for p in range(bins):
        slot = table_start[row * bins + p]
        bin_origin = _bin_start(origin, p, bin_size)
        first, n = visible_samples(bin_origin, bin_size, grid, size)
        used = 0
        for i in range(n):
            # torchvision: start + static_cast<T>(i + .5f) * bin_size / static_cast<T>(grid)
            position = bin_origin + (like(first + i, origin) + half) * bin_size / grid
            # SPEC sample test; NaN fails every comparison and is skipped too.
            if not (position >= -one and position <= like(size, origin)):
                continue
            position = max(position, like(0.0, origin))
            low = int(position)
            if low >= size - 1:
                low = size - 1
                high = size - 1
                position = like(low, origin)
            else:
                high = low + 1
            lam = position - like(low, origin)
            low_index[slot + used] = low
            high_step[slot + used] = high - low
            low_weight[slot + used] = (one - lam) / divisor
            high_weight[slot + used] = lam / divisor
            used += 1
            lowest, highest = min(lowest, low), max(highest, high)
        table_used[row * bins + p] = used
    return lowest, highest


@parallel_kernel
def roi_align_sample_tables(boxes, box_order, pooled_height, pooled_width, spatial_scale,
                            sampling_ratio, aligned, height, width, box_rows,
                            y_start, y_used, y_low, y_step, y_low_weight, y_high_weight,
                            x_start, x_used, x_low, x_step, x_low_weight, x_high_weight):
    """Fill the per-axis sample tables of every box in ``box_order`` (slots from the counts).

    ``box_rows[j]`` receives the first and last row box ``j`` touches (``H, -1`` if none).

    ``*_start[j * bins + p]`` is the first slot of bin ``p`` of box ``j``; ``*_used`` receives how
    many samples passed the exact test. The y weights carry the division by the sample count.
    Parallel over boxes; iteration ``j`` writes only box ``j``'s slots and counters.
    """
    for j in prange(box_order.shape[0]):
        y1, x1, bin_h, bin_w, grid_h, grid_w, count = box_geometry(
            boxes[box_order[j]], pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned)
        if not (grid_h >= 1 and grid_w >= 1):
            grid_h = grid_w = like(0.0, y1)  # no samples at all: both tables stay empty
        box_rows[j, 0], box_rows[j, 1] = _fill_axis(
            y_start, y_used, j, pooled_height, y1, bin_h, grid_h, height, count,
            y_low, y_step, y_low_weight, y_high_weight)
        _fill_axis(x_start, x_used, j, pooled_width, x1, bin_w, grid_w, width, like(1.0, x1),
                   x_low, x_step, x_low_weight, x_high_weight)


@helper
def _decode_bin_row(box, c0, first, row_grad, fmt):
    """``row_grad[pw, c] = load(box[c0 + c, first + pw])`` for the ``(PW, nc)`` ``row_grad``:
    whole 16-channel blocks by 16 x 16 register transposes (``decode_transpose_lanes``; a scalar
    loop storing ``PW`` elements ``nc`` apart made this copy the kernel's hottest loop), leftover
    channels one by one."""
    pooled_width, channels = row_grad.shape
    tiled = channels // LANES * LANES
    for cc in range(0, tiled, LANES):
        for pw in range(0, pooled_width, LANES):
            decode_transpose_lanes(row_grad, pw, cc, box, c0 + cc, first + pw, min(LANES, pooled_width - pw), fmt)
    for c in range(tiled, channels):
        source = box[c0 + c]
        for pw in range(pooled_width):
            row_grad[pw, c] = load(source[first + pw], fmt)


@helper
def _scatter_band(grad_bins, box_order, box_begin, box_end, box_rows, c0, row_begin, row_end, target, row_grad,
                  width, fmt, y_start, y_used, y_low, y_step, y_low_weight, y_high_weight,
                  x_start, x_used, x_low, x_step, x_low_weight, x_high_weight):
    """Add the boxes at table positions ``[box_begin, box_end)`` (box ``box_order[j]`` at ``j``) to the rows
    ``[row_begin, row_end)`` of channels ``c0 : c0 + nc``: ``target`` is a channels-last scratch
    ``((row_end - row_begin) * W, nc)``; ``grad_bins`` is grad_output as ``(K, C, PH * PW)``.
    Corners on other rows are left to their band's task.

    Channels innermost: every sample's offsets and weights are computed once for the block and
    the channel loops are contiguous (vectorised). The gradient of a row of bins that reaches the
    band is first copied (decoded) into ``row_grad`` ``(PW, nc)`` by :func:`_decode_bin_row`,
    reading grad_output along its rows: gathered per bin, its channels were ``PH * PW``
    elements apart, one cache miss each (that gather was the kernel's hottest loop). Per element
    the order is that of the SPEC loop: boxes, bins, samples, then the corners ll, lh, hl, hh.
    """
    pooled_width, channels = row_grad.shape
    pooled_height = grad_bins.shape[2] // pooled_width
    for j in range(box_begin, box_end):
        if box_rows[j, 1] < row_begin or box_rows[j, 0] >= row_end:
            continue
        box = grad_bins[box_order[j]]
        for ph in range(pooled_height):
            ys = y_start[j * pooled_height + ph]
            ye = ys + y_used[j * pooled_height + ph]
            if ye == ys:
                continue
            # Positions along a bin are monotonic, so its rows lie between its end entries.
            first_row = min(y_low[ys], y_low[ye - 1])
            last_row = max(y_low[ys] + y_step[ys], y_low[ye - 1] + y_step[ye - 1])
            if last_row < row_begin or first_row >= row_end:
                continue
            _decode_bin_row(box, c0, ph * pooled_width, row_grad, fmt)
            for pw in range(pooled_width):
                xs = x_start[j * pooled_width + pw]
                xe = xs + x_used[j * pooled_width + pw]
                if xe == xs:
                    continue
                gvals = row_grad[pw]
                for ey in range(ys, ye):
                    row_low = y_low[ey]
                    row_high = row_low + y_step[ey]
                    low_inside = row_begin <= row_low < row_end
                    high_inside = row_begin <= row_high < row_end
                    if not (low_inside or high_inside):
                        continue
                    o_low = (row_low - row_begin) * width
                    o_high = (row_high - row_begin) * width
                    hy = y_low_weight[ey]
                    ly = y_high_weight[ey]
                    for ex in range(xs, xe):
                        col_low = x_low[ex]
                        col_high = col_low + x_step[ex]
                        hx = x_low_weight[ex]
                        lx = x_high_weight[ex]
                        # One contiguous (vectorised) channel loop per corner, in corner order.
                        # Written out on purpose: a helper per corner, or the 16-lane intrinsics
                        # of _simd, measured about 3x slower on R1 than these four plain loops.
                        if low_inside:
                            w = hy * hx
                            for c in range(channels):
                                target[o_low + col_low, c] += gvals[c] * w
                            w = hy * lx
                            for c in range(channels):
                                target[o_low + col_high, c] += gvals[c] * w
                        if high_inside:
                            w = ly * hx
                            for c in range(channels):
                                target[o_high + col_low, c] += gvals[c] * w
                            w = ly * lx
                            for c in range(channels):
                                target[o_high + col_high, c] += gvals[c] * w


@parallel_kernel
def roi_align_bwd(grad_output, box_order, image_start, box_rows, grad_input, width,
                  channel_block, band_rows, fmt,
                  y_start, y_used, y_low, y_step, y_low_weight, y_high_weight,
                  x_start, x_used, x_low, x_step, x_low_weight, x_high_weight):
    """grad_output (K, C, PH, PW) -> grad_input (B, C, H*W), any storage format.

    Parallel over (image ``b``, channel block, band of rows); a task writes only its block of
    channels and band of rows of ``grad_input[b]``. It accumulates in a zeroed channels-last
    scratch of the compute type (float32, or float64 for float64 data; small enough to stay in
    cache), then stores each element once (rounding the half formats). Table position ``j``
    holds box ``box_order[j]``; image ``b`` owns positions
    ``image_start[b] : image_start[b + 1]``.
    """
    batch, channels, plane_size = grad_input.shape
    height = plane_size // width
    blocks = (channels + channel_block - 1) // channel_block
    bands = (height + band_rows - 1) // band_rows
    # (K, C, PH * PW), reshaped once: bin row ph of channel c of box k is [k, c, ph*PW:(ph+1)*PW]
    pooled_height, pooled_width = grad_output.shape[2], grad_output.shape[3]
    grad_bins = grad_output.reshape(grad_output.shape[0], channels, pooled_height * pooled_width)
    for t in prange(batch * blocks * bands):
        b = t // (blocks * bands)
        block = (t // bands) % blocks
        row_begin = (t % bands) * band_rows
        row_end = min(row_begin + band_rows, height)
        c0 = block * channel_block
        c1 = min(c0 + channel_block, channels)
        touched = False
        for j in range(image_start[b], image_start[b + 1]):
            touched = touched or (box_rows[j, 0] < row_end and box_rows[j, 1] >= row_begin)
        if not touched:
            # No box reaches this band: plain zeros (all-zero bits are +0.0 in every format).
            for c in range(c0, c1):
                grad_input[b, c, row_begin * width:row_end * width] = 0
            continue
        row_grad = np.empty((pooled_width, c1 - c0), y_low_weight.dtype)
        target = np.zeros(((row_end - row_begin) * width, c1 - c0), y_low_weight.dtype)
        _scatter_band(grad_bins, box_order, image_start[b], image_start[b + 1], box_rows, c0,
                      row_begin, row_end, target, row_grad, width, fmt,
                      y_start, y_used, y_low, y_step, y_low_weight, y_high_weight,
                      x_start, x_used, x_low, x_step, x_low_weight, x_high_weight)
        _store_band(target, grad_input[b], c0, row_begin * width, fmt)


@helper
def _store_band(target, plane, c0, first, fmt):
    """``plane[c0 + c, first + i] = store(target[i, c])``: the channels-last scratch back to the
    channel-major result, each element rounded once.

    Whole 16-channel blocks go by 16 x 16 register transposes (``transpose_lanes``), a block's
    pixel tiles in order, the last tile overlapping its neighbour: reading the scratch one channel
    at a time (a 4-byte load per cache line) had cost about as much as the scatter's output
    stream itself (R1 1.25x faster). Leftover channels, and bands under 16 pixels, go one by one.
    """
    pixels, channels = target.shape
    tiled = channels // LANES * LANES if pixels >= LANES else 0
    for cc in range(0, tiled, LANES):
        for p in range(0, pixels, LANES):
            tile = min(p, pixels - LANES)
            transpose_lanes(plane, c0 + cc, first + tile, target, tile, cc, fmt)
    for c in range(tiled, channels):
        destination = plane[c0 + c, first:first + pixels]
        for i in range(pixels):
            destination[i] = store(target[i, c], fmt)
