"""roi_align loop nests (docs/semantics.md §4): per-axis weight tables, the backward scatter and
the forward gather.

The weight of pixel ``(row, col)`` in bin ``(ph, pw)`` of a box is ``wy[ph, row] * wx[pw, col] /
count``: the sample positions are separable (``y`` depends on ``(ph, iy)`` only, ``x`` on
``(pw, ix)`` only) and a sample's bilinear weight is ``(y weight) * (x weight)``. So each box gets
one table per axis (torchvision's ``pre_calc``, factored and collapsed per pixel):

1. Weight tables (:func:`roi_align_sample_counts` sizes the slots, :func:`roi_align_sample_tables`
   fills them; parallel over boxes, each box writes only its own slots). For every bin and every
   pixel its samples touch, one entry: the pixel index and the summed weight divided by the bin's
   sample count along that axis (``wy / gh``, ``wx / gw``), summed in float64 and rounded once to
   the compute type. The samples of a bin that share a pixel pair are a run of consecutive sample
   indices (positions are monotonic in the index, rounding included), found by galloping and
   bisection with the exact per-sample test of docs/semantics.md §4 (:func:`_sample_key`, evaluated in the compute
   type like torchvision), so the work per bin is bounded by the pixels it touches times
   ``log2(grid)``, never by the grid: any ``sampling_ratio`` up to 2^31 - 1 (and any adaptive grid)
   returns promptly. A short run's weights are summed sample by sample in float64; a long run's by
   the closed form of the arithmetic progression of its positions (its mean position times its
   length), which a float32 running sum of a million tiny weights could not match.
2. The backward scatter (:func:`roi_align_bwd`), parallel over (image, channel block, band of
   rows): a task owns that block and band of ``grad_input[b]``, accumulates in a small
   channels-last scratch, and walks the boxes of image ``b`` in their given order, every bin
   ``(ph, pw)``, every (y entry, x entry) pair: each output element gets one update per
   (box, bin), in that fixed order, whatever the number of threads, block or band.
3. The forward gather (:func:`roi_align_fwd`), parallel over (image, channel block), or over
   (box, channel block) for a channels-last input: the same entries in the same order, the same
   products ``wy * wx``, summed per bin instead of scattered (the adjoint of 2).

Both run on NCHW or NHWC (channels-last) memory (docs/semantics.md §4, ``layout``): only the
copies into and out of the channels-last scratches differ, so every element's sum, and its bits,
are the same in both layouts.

The api's entries, :func:`backward` and :func:`forward`, build a call's tables (they depend on
the boxes' values, so on every call) and run 1 and then 2 or 3.

Coordinates, sample tests and clamping are computed in the boxes' dtype (float32 for float32,
float16 and bfloat16 data; float64 for float64), as torchvision does; the tables' weights and the
accumulations are of that compute type.
"""

import math
from typing import NamedTuple

import numpy as np
from numba import prange, types
from numba.extending import intrinsic

from ._halfbits import NATIVE, StorageFormat, load, store
from ._jit import ONE_THREAD_BELOW, Launch, helper, parallel_kernel
from ._lane_tiles import decode_transpose_lanes, lanes_decode_axpy, transpose_lanes
from ._lanes import LANES

#: A run of at most this many samples on one pixel pair is summed sample by sample (in float64);
#: longer runs use the closed form of their arithmetic progression.
SHORT_RUN = 32


@intrinsic(prefer_literal=False)
def like(typingctx, value, template):
    """``value`` converted to the floating type of ``template`` (njit only): as ``np.float32(value)``
    for a float32 template, else ``np.float64(value)``. An intrinsic, so that typing a call
    compiles nothing (an inlined overload compiled one function per argument types)."""
    value = types.unliteral(value)
    target = types.float32 if template == types.float32 else types.float64

    def codegen(context, builder, signature, args):
        return context.cast(builder, args[0], signature.args[0], target)

    return target(value, template), codegen


@intrinsic(prefer_literal=False)
def same_type_or(typingctx, array, fallback):
    """``(array, True)`` when ``array`` has ``fallback``'s Numba type, else ``(fallback, False)``
    (njit only; decided at compile time). Lets a kernel use its result as its accumulator where
    the storage is the compute type, and still compile for the half formats (which never take
    that branch: the flag is False there)."""
    same = array == fallback
    chosen = array if same else fallback
    signature = types.Tuple((chosen, types.boolean))(array, fallback)

    def codegen(context, builder, signature, args):
        value = args[0] if same else args[1]
        context.nrt.incref(builder, chosen, value)
        flag = context.get_constant(types.boolean, same)
        return context.make_tuple(builder, signature.return_type, (value, flag))

    return signature, codegen


@helper
def box_geometry(box, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned):
    """docs/semantics.md §4 per-box setup in the boxes' dtype.

    ``box`` is a finite row ``(b, x1, y1, x2, y2)``; ``sampling_ratio`` is a float (0 = adaptive).
    Returns ``(y1, x1, bin_h, bin_w, grid_h, grid_w)``, all floats of the box dtype;
    ``grid_h < 1`` or ``grid_w < 1`` means the box has no samples. The grid sizes stay floats (an
    adaptive grid of an absurd box does not fit any integer type).
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
        return y1, x1, bin_h, bin_w, zero, zero
    if sampling_ratio > 0:
        grid_h = like(sampling_ratio, zero)
        grid_w = grid_h
    else:
        # np.ceil keeps the float type: math.ceil would convert to an int64 that can overflow.
        grid_h = like(np.ceil(roi_h / like(pooled_height, zero)), zero)
        grid_w = like(np.ceil(roi_w / like(pooled_width, zero)), zero)
    return y1, x1, bin_h, bin_w, grid_h, grid_w


@helper
def _bin_start(origin, index, bin_size):
    """Start of bin ``index`` along an axis: ``origin + index * bin_size`` in the box dtype."""
    return origin + like(index, origin) * bin_size


@helper
def _sample_position(bin_origin, bin_size, grid, index):
    """Sample ``index`` (an integral float64) of a bin, in the box dtype.

    torchvision: ``start + static_cast<T>(i + .5f) * bin_size / static_cast<T>(grid)``.
    """
    return bin_origin + (like(index, bin_origin) + like(0.5, bin_origin)) * bin_size / grid


@helper
def _sample_key(position, size):
    """The sample test and clamping (docs/semantics.md §4) of one coordinate, as one ordered integer:

    * ``-2``: skipped below (``position < -1``; NaN too);
    * ``-1``: ``-1 <= position < 0``, clamped to 0: weight 1 on pixel 0, 0 on pixel 1;
    * ``0 <= L <= size - 2``: between pixels ``L`` and ``L + 1``, ``lambda = position - L``;
    * ``size - 1``: at or beyond the last pixel (``size - 1 <= position <= size``), clamped: weight
      1 on pixel ``size - 1``;
    * ``size``: skipped above (``position > size``).

    Non-decreasing in ``position`` (for non-NaN positions), hence in the sample index.
    """
    if not (position >= -1):
        return -2
    if position > size:
        return size
    low = int(max(position, like(0.0, position)))
    if low >= size - 1:
        return size - 1
    if position < 0:
        return -1
    return low


@helper
def _key_at(t, bin_origin, bin_size, grid, size):
    """:func:`_sample_key` of the ``t``-th sample in increasing position order (``t >= grid``: past
    the end). A bin of negative size (a reversed box with a fixed sampling_ratio) runs its samples
    from the last index down, so that positions never decrease with ``t``."""
    grid64 = np.float64(grid)
    if not (t < grid64):
        return size
    index = grid64 - 1.0 - t if bin_size < 0 else t
    return _sample_key(_sample_position(bin_origin, bin_size, grid, index), size)


@helper
def _end_of_run(key, t, bin_origin, bin_size, grid, size):
    """The first ``t' > t`` whose key exceeds ``key``, given ``key(t) <= key`` (``grid`` if none):
    gallop (steps 1, 2, 4, ...) then bisect; at most about 2 log2(grid) key evaluations."""
    low = t
    step = 1.0
    high = low + step
    while _key_at(high, bin_origin, bin_size, grid, size) <= key:
        low = high
        step *= 2.0
        high = low + step
    # key(low) <= key < key(high)
    while high - low > 1.0:
        middle = np.floor(low + (high - low) * 0.5)
        if not (low < middle < high):
            break  # indices beyond 2^53 are not all representable
        if _key_at(middle, bin_origin, bin_size, grid, size) <= key:
            low = middle
        else:
            high = middle
    return min(high, np.float64(grid))


@helper
def _bin_weights(bin_origin, bin_size, grid, size, weight_sum, touched):
    """Sum the weights of every valid sample of one bin along one axis, per pixel, in float64.

    Adds ``sum of (1 - lambda)`` to ``weight_sum[low]`` and ``sum of lambda`` to
    ``weight_sum[high]`` over every valid sample, and marks both pixels in ``touched`` (docs/semantics.md
    §4: a sample adds its corner weights to ``low`` and ``high`` even when one of them is 0).
    Returns the lowest and highest touched pixel (``size, -1`` if none).
    """
    lowest, highest = size, -1
    grid64 = np.float64(grid)
    if not (grid64 >= 1.0):
        return lowest, highest
    step64 = np.float64(bin_size) / grid64
    t = 0.0
    if _key_at(t, bin_origin, bin_size, grid, size) < -1:
        # np.int64(-2), not -2: a literal argument would compile a second _end_of_run
        t = _end_of_run(np.int64(-2), t, bin_origin, bin_size, grid, size)
    while t < grid64:
        key = _key_at(t, bin_origin, bin_size, grid, size)
        if key >= size:
            break
        end = _end_of_run(key, t, bin_origin, bin_size, grid, size)
        n = end - t
        lam_sum = 0.0
        if 0 <= key < size - 1:
            if n <= SHORT_RUN:
                for s in range(int(n)):
                    u = t + s
                    index = grid64 - 1.0 - u if bin_size < 0 else u
                    lam_sum += np.float64(_sample_position(bin_origin, bin_size, grid, index)) - key
            else:
                # Closed form: n times the run's mean position (an arithmetic progression).
                first = grid64 - 1.0 - t if bin_size < 0 else t
                last = grid64 - end if bin_size < 0 else end - 1.0
                mean = np.float64(bin_origin) + (0.5 * (first + last) + 0.5) * step64
                lam_sum = n * min(max(mean - key, 0.0), 1.0)
        low = max(key, 0)
        high = low if key == size - 1 else low + 1
        weight_sum[low] += n - lam_sum
        weight_sum[high] += lam_sum
        touched[low] = True
        touched[high] = True
        lowest, highest = min(lowest, low), max(highest, high)
        t = end
    return lowest, highest


@helper
def slot_bound(grid, size):
    """Entries one bin can need along an axis: each sample touches at most 2 pixels."""
    if not (grid >= 1):
        return 0
    return int(min(np.float64(size), 2.0 * np.float64(grid)))


@parallel_kernel
def roi_align_boxes_by_image(boxes, batch, box_order, image_start, skipped):
    """The boxes that contribute, grouped by image (run serially: a few operations per box).

    A box contributes when its five values are finite and ``floor(batch_index)`` is in
    ``[0, batch)`` (docs/semantics.md §4: floor, where torchvision truncates). Writes
    ``box_order[:n]``, the ``n`` contributing boxes sorted by image, each image's in their given
    order; ``image_start``, image ``b`` owning ``box_order[image_start[b]:image_start[b + 1]]``;
    ``skipped[:K - n]``, the others in ascending order. Returns ``n``.
    """
    num_boxes = boxes.shape[0]
    image_start[:] = 0
    images = np.empty(num_boxes, np.int64)
    misses = 0
    for k in range(num_boxes):
        finite = True
        for i in range(5):
            finite = finite and math.isfinite(boxes[k, i])
        image = np.floor(boxes[k, 0]) if finite else -1.0  # a float: a huge index stays out of range
        if image >= 0 and image < batch:
            images[k] = int(image)
            image_start[int(image) + 1] += 1
        else:
            images[k] = -1
            skipped[misses] = k
            misses += 1
    for b in range(batch):
        image_start[b + 1] += image_start[b]
    cursor = image_start[:batch].copy()
    for k in range(num_boxes):
        if images[k] >= 0:
            box_order[cursor[images[k]]] = k
            cursor[images[k]] += 1
    return num_boxes - misses


@parallel_kernel
def roi_align_sample_counts(
    boxes,
    box_order,
    pooled_height,
    pooled_width,
    spatial_scale,
    sampling_ratio,
    aligned,
    height,
    width,
    y_slots,
    x_slots,
):
    """Slot counts of the weight tables: ``y_slots[j, ph]`` / ``x_slots[j, pw]`` for box ``j``.

    Parallel over the boxes of ``box_order``; iteration ``j`` writes only row ``j``.
    """
    for j in prange(box_order.shape[0]):
        y1, x1, bin_h, bin_w, grid_h, grid_w = box_geometry(
            boxes[box_order[j]], pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned
        )
        both = grid_h >= 1 and grid_w >= 1
        for ph in range(pooled_height):
            y_slots[j, ph] = slot_bound(grid_h, height) if both else 0
        for pw in range(pooled_width):
            x_slots[j, pw] = slot_bound(grid_w, width) if both else 0


@helper
def _fill_axis(table, row, bins, origin, bin_size, grid, size, weight_sum, touched):
    """Fill one box's :class:`AxisTable` entries along one axis (see the module docstring).

    Returns the lowest and highest pixel the box's samples touch (``size, -1`` if none).
    """
    lowest, highest = size, -1
    for p in range(bins):
        slot = table.start[row * bins + p]
        capacity = table.slots[row * bins + p]
        first, last = _bin_weights(_bin_start(origin, p, bin_size), bin_size, grid, size, weight_sum, touched)
        used = 0
        for q in range(first, last + 1):
            if touched[q]:
                if used < capacity:  # always true (slot_bound); a guard against writing elsewhere
                    table.pixel[slot + used] = q
                    table.weight[slot + used] = weight_sum[q] / np.float64(grid)  # rounded once
                    used += 1
                weight_sum[q] = 0.0
                touched[q] = False
        table.used[row * bins + p] = used
        if used > 0:
            lowest, highest = min(lowest, first), max(highest, last)
    return lowest, highest


@parallel_kernel
def roi_align_sample_tables(
    boxes,
    box_order,
    pooled_height,
    pooled_width,
    spatial_scale,
    sampling_ratio,
    aligned,
    height,
    width,
    box_rows,
    y_table,
    x_table,
):
    """Fill the :class:`AxisTable` of each axis for every box in ``box_order`` (slots from the
    counts): ``start[j * bins + p]`` / ``slots[...]`` are the first slot and capacity of bin ``p``
    of box ``j``; ``used`` receives its number of entries; entry ``e`` holds a pixel index
    (ascending within a bin) and its weight ``(sum of the bin's sample weights on it) / grid``.
    ``box_rows[j]`` receives the first and last row box ``j`` touches (``H, -1`` if none).
    Parallel over boxes; iteration ``j`` writes only box ``j``'s slots and counters.
    """
    for j in prange(box_order.shape[0]):
        y1, x1, bin_h, bin_w, grid_h, grid_w = box_geometry(
            boxes[box_order[j]], pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned
        )
        if not (grid_h >= 1 and grid_w >= 1):
            grid_h = grid_w = like(0.0, y1)  # no samples at all: both tables stay empty
        # zeroed by a loop: np.zeros would compile two more functions per dtype on the first call
        weight_sum = np.empty(max(height, width), np.float64)
        touched = np.empty(max(height, width), np.bool_)
        for i in range(weight_sum.shape[0]):
            weight_sum[i] = 0.0
            touched[i] = False
        # np.int64(j): Numba types j differently in the two calls (int64, uint64), which
        # compiled _fill_axis twice
        box_rows[j, 0], box_rows[j, 1] = _fill_axis(
            y_table, np.int64(j), pooled_height, y1, bin_h, grid_h, height, weight_sum, touched
        )
        _fill_axis(x_table, np.int64(j), pooled_width, x1, bin_w, grid_w, width, weight_sum, touched)


# --------------------------------------------------------------------------------------------
# backward: scatter
# --------------------------------------------------------------------------------------------


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
def _load_rows(source, first, c0, destination, fmt):
    """``destination[i, c] = load(source[first + i, c0 + c])``: rows of a channels-last matrix
    (the NHWC layout's grad_output), decoded to the compute type."""
    rows, channels = destination.shape
    for i in range(rows):
        # sliced first: indexing with c0 + c kept LLVM from vectorising the loop (6x slower)
        values = source[first + i, c0 : c0 + channels]
        row = destination[i]
        for c in range(channels):
            row[c] = load(values[c], fmt)


@helper
def _store_rows(source, destination, first, c0, fmt):
    """``destination[first + i, c0 + c] = store(source[i, c])``: a channels-last scratch into the
    rows of a channels-last result (the NHWC layout), each element rounded once."""
    rows, channels = source.shape
    for i in range(rows):
        values = source[i]
        row = destination[first + i, c0 : c0 + channels]  # sliced first, as in _load_rows
        for c in range(channels):
            row[c] = store(values[c], fmt)


@helper
def _scatter_band(
    grad_bins,
    channels_last,
    box_order,
    box_begin,
    box_end,
    box_rows,
    c0,
    row_begin,
    row_end,
    target,
    row_grad,
    width,
    fmt,
    y_table,
    x_table,
):
    """Add the boxes at table positions ``[box_begin, box_end)`` (box ``box_order[j]`` at ``j``) to the rows
    ``[row_begin, row_end)`` of channels ``c0 : c0 + nc``: ``target`` is a channels-last scratch
    ``((row_end - row_begin) * W, nc)``; ``grad_bins`` is grad_output as ``(K, C, PH * PW)``, or
    (``channels_last``) ``(K, PH * PW, C)``.

    Channels innermost: every entry pair's offset and weight are computed once for the block and
    the channel loop is contiguous (vectorised). The gradient of a row of bins that reaches the
    band is first copied (decoded) into ``row_grad`` ``(PW, nc)``: by :func:`_decode_bin_row`,
    reading grad_output along its rows, or by :func:`_load_rows` from channels-last bins. Per
    element the order is fixed: boxes, bins ``(ph, pw)`` (one update each).
    """
    pooled_width, channels = row_grad.shape
    pooled_height = (grad_bins.shape[1] if channels_last else grad_bins.shape[2]) // pooled_width
    for j in range(box_begin, box_end):
        if box_rows[j, 1] < row_begin or box_rows[j, 0] >= row_end:
            continue
        box = grad_bins[box_order[j]]
        for ph in range(pooled_height):
            ys = y_table.start[j * pooled_height + ph]
            ye = ys + y_table.used[j * pooled_height + ph]
            # Entries are in ascending pixel order: the bin's rows lie between its end entries.
            if ye == ys or y_table.pixel[ye - 1] < row_begin or y_table.pixel[ys] >= row_end:
                continue
            if channels_last:
                _load_rows(box, ph * pooled_width, c0, row_grad, fmt)
            else:
                _decode_bin_row(box, c0, ph * pooled_width, row_grad, fmt)
            for ey in range(ys, ye):
                row = y_table.pixel[ey]
                if not (row_begin <= row < row_end):
                    continue
                offset = (row - row_begin) * width
                wy = y_table.weight[ey]
                for pw in range(pooled_width):
                    gvals = row_grad[pw]
                    xs = x_table.start[j * pooled_width + pw]
                    for ex in range(xs, xs + x_table.used[j * pooled_width + pw]):
                        w = wy * x_table.weight[ex]
                        pixel = offset + x_table.pixel[ex]
                        for c in range(channels):
                            target[pixel, c] += gvals[c] * w


@parallel_kernel
def roi_align_bwd(
    grad_bins,
    channels_last,
    box_order,
    image_start,
    box_rows,
    grad_input,
    width,
    pooled_width,
    channel_block,
    band_rows,
    fmt,
    y_table,
    x_table,
):
    """grad_output as ``grad_bins`` (K, C, PH * PW) -> grad_input (B, C, H * W), or
    (``channels_last``, the NHWC layout) (K, PH * PW, C) -> (B, H * W, C); any storage format.

    Parallel over (image ``b``, channel block, band of rows); a task writes only its block of
    channels and band of rows of ``grad_input[b]``. It accumulates in a zeroed channels-last
    scratch of the compute type (float32, or float64 for float64 data; small enough to stay in
    cache), then stores each element once (rounding the half formats); in the NHWC layout with
    every channel in one block and float32 or float64 data, it accumulates in its (zeroed) band
    of the result instead. Table position ``j`` holds box ``box_order[j]``; image ``b`` owns
    positions ``image_start[b] : image_start[b + 1]``. The layouts differ only in where the sums
    are kept and the copies in and out, so each element gets the same sum, in the same order,
    in both.
    """
    batch = grad_input.shape[0]
    channels = grad_input.shape[2] if channels_last else grad_input.shape[1]
    height = (grad_input.shape[1] if channels_last else grad_input.shape[2]) // width
    blocks = (channels + channel_block - 1) // channel_block
    bands = (height + band_rows - 1) // band_rows
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
            if channels_last:
                grad_input[b, row_begin * width : row_end * width, c0:c1] = 0
            else:
                for c in range(c0, c1):
                    grad_input[b, c, row_begin * width : row_end * width] = 0
            continue
        row_grad = np.empty((pooled_width, c1 - c0), y_table.weight.dtype)
        # NHWC, one block of all channels, stored in the compute type: the band of the result is
        # one contiguous matrix, accumulated in place (no scratch to zero and copy out)
        band, in_place = same_type_or(grad_input[b][row_begin * width : row_end * width], row_grad)
        in_place = in_place and channels_last and c1 - c0 == channels
        if in_place:
            band[:] = 0
            target = band
        else:
            target = np.zeros(((row_end - row_begin) * width, c1 - c0), y_table.weight.dtype)
        _scatter_band(
            grad_bins,
            channels_last,
            box_order,
            image_start[b],
            image_start[b + 1],
            box_rows,
            c0,
            row_begin,
            row_end,
            target,
            row_grad,
            width,
            fmt,
            y_table,
            x_table,
        )
        if in_place:
            continue
        if channels_last:
            _store_rows(target, grad_input[b], row_begin * width, c0, fmt)
        else:
            _store_band(target, grad_input[b], c0, row_begin * width, fmt)


@helper
def _store_band(target, plane, c0, first, fmt):
    """``plane[c0 + c, first + i] = store(target[i, c])``: the channels-last scratch back to the
    channel-major result, each element rounded once.

    Whole 16-channel blocks go by 16 x 16 register transposes (``transpose_lanes``), a block's
    pixel tiles in order, the last tile overlapping its neighbour: reading the scratch one channel
    at a time (a 4-byte load per cache line) had cost about as much as the scatter's output
    stream itself. Leftover channels, and bands under 16 pixels, go one by one.
    """
    pixels, channels = target.shape
    tiled = channels // LANES * LANES if pixels >= LANES else 0
    for cc in range(0, tiled, LANES):
        for p in range(0, pixels, LANES):
            tile = min(p, pixels - LANES)
            transpose_lanes(plane, c0 + cc, first + tile, target, tile, cc, fmt)
    for c in range(tiled, channels):
        destination = plane[c0 + c, first : first + pixels]
        for i in range(pixels):
            destination[i] = store(target[i, c], fmt)


# --------------------------------------------------------------------------------------------
# forward: gather
# --------------------------------------------------------------------------------------------


@helper
def _gather_box(
    source,
    first_row,
    column,
    width,
    acc,
    j,
    pooled_height,
    pooled_width,
    fmt,
    y_table,
    x_table,
):
    """``acc[ph * PW + pw, c] = sum over the bin's (y entry, x entry) pairs, y then x ascending,
    of load(source[(row - first_row) * W + col, column + c]) * (wy * wx)`` for box ``j``.

    ``source`` is a channels-last ``(rows * W, channels)`` matrix of StorageFormat ``fmt``
    holding the rows from ``first_row`` on: a task's decoded scratch (``NATIVE``), or a
    channels-last input read in place; ``acc`` ``(PH * PW, nc)``. The products ``wy * wx`` are
    those of the backward scatter. Whole 16-channel groups go by ``lanes_decode_axpy`` (a decode,
    a multiply then an add per lane, as the plain loop, which LLVM did not vectorise well),
    leftover channels one by one.
    """
    channels = acc.shape[1]
    tiled = channels // LANES * LANES
    acc[:] = 0
    for ph in range(pooled_height):
        ys = y_table.start[j * pooled_height + ph]
        for ey in range(ys, ys + y_table.used[j * pooled_height + ph]):
            offset = (y_table.pixel[ey] - first_row) * width
            wy = y_table.weight[ey]
            for pw in range(pooled_width):
                bin_index = ph * pooled_width + pw
                xs = x_table.start[j * pooled_width + pw]
                for ex in range(xs, xs + x_table.used[j * pooled_width + pw]):
                    w = wy * x_table.weight[ex]
                    pixel = offset + x_table.pixel[ex]
                    for cc in range(0, tiled, LANES):
                        lanes_decode_axpy(acc, bin_index, cc, source, pixel, column + cc, w, fmt)
                    for c in range(tiled, channels):
                        acc[bin_index, c] += load(source[pixel, column + c], fmt) * w


@helper
def _store_box(acc, out_box, c0, fmt):
    """``out_box[c0 + c, bin] = store(acc[bin, c])`` (``out_box`` is ``(C, PH * PW)``)."""
    bins, channels = acc.shape
    for c in range(channels):
        destination = out_box[c0 + c]
        for i in range(bins):
            destination[i] = store(acc[i, c], fmt)


@helper
def _zero_skipped(out, skipped):
    for i in range(skipped.shape[0]):
        out[skipped[i]] = 0


@helper
def _image_rows(box_rows, begin, end, height):
    """The first row and the number of rows the boxes at positions ``[begin, end)`` touch."""
    first_row, last_row = height, -1
    for j in range(begin, end):
        first_row, last_row = min(first_row, box_rows[j, 0]), max(last_row, box_rows[j, 1])
    return first_row, max(last_row - first_row + 1, 0)


@helper
def _store_result(acc, out, k, c0, result_channels_last, fmt):
    """Box ``k``'s gathered channels ``c0 : c0 + nc`` into ``out``: ``(K, C, PH * PW)``, or
    (``result_channels_last``) ``(K, PH * PW, C)``; each element rounded once."""
    if result_channels_last:
        _store_rows(acc, out[k], 0, c0, fmt)
    else:
        _store_box(acc, out[k], c0, fmt)


@parallel_kernel
def roi_align_fwd(
    source,
    channels_last,
    result_channels_last,
    height,
    width,
    box_order,
    image_start,
    box_rows,
    skipped,
    out,
    pooled_height,
    pooled_width,
    channel_block,
    fmt,
    y_table,
    x_table,
):
    """input -> out (K, C, PH * PW), or (``result_channels_last``, the NHWC layout)
    (K, PH * PW, C); any storage format. ``source`` is the input's memory read in place:
    (B, C, H * W), or (``channels_last``) (B, H * W, C). Table position ``j`` holds box
    ``box_order[j]``; image ``b`` owns positions ``image_start[b] : image_start[b + 1]``.

    Each result element is one box's bin, gathered by :func:`_gather_box` in the same order
    whatever the layouts and the partition, and rounded once; one more task zeroes the results
    of the ``skipped`` boxes.

    * channels-last input: parallel over (table position, channel block); the gather reads the
      input in place (decoding as it goes), its channels contiguous.
    * (B, C, H * W) input: parallel over (image ``b``, channel block); a task first copies the
      rows its image's boxes touch, decoded, into a channels-last scratch with
      :func:`_decode_bin_row` (16 x 16 register transposes; a scalar loop storing elements ``nc``
      apart made this copy cost three times the gather on R1), so that the gather's channel loop
      is contiguous, then gathers its boxes one by one.
    """
    channels = source.shape[2] if channels_last else source.shape[1]
    blocks = (channels + channel_block - 1) // channel_block
    compute = y_table.weight.dtype
    if channels_last:
        positions = box_order.shape[0]
        for t in prange(positions * blocks + 1):
            if t == positions * blocks:
                _zero_skipped(out, skipped)
                continue
            j = t // blocks
            c0 = (t % blocks) * channel_block
            c1 = min(c0 + channel_block, channels)
            b = np.searchsorted(image_start, j, side="right") - 1
            acc = np.empty((pooled_height * pooled_width, c1 - c0), compute)
            _gather_box(source[b], 0, c0, width, acc, j, pooled_height, pooled_width, fmt, y_table, x_table)
            _store_result(acc, out, box_order[j], c0, result_channels_last, fmt)
        return
    batch = source.shape[0]
    for t in prange(batch * blocks + 1):
        if t == batch * blocks:
            _zero_skipped(out, skipped)
            continue
        b = t // blocks
        c0 = (t % blocks) * channel_block
        c1 = min(c0 + channel_block, channels)
        if image_start[b + 1] == image_start[b]:
            continue
        first_row, rows = _image_rows(box_rows, image_start[b], image_start[b + 1], height)
        scratch = np.empty((rows * width, c1 - c0), compute)
        _decode_bin_row(source[b], c0, first_row * width, scratch, fmt)
        acc = np.empty((pooled_height * pooled_width, c1 - c0), compute)
        for j in range(image_start[b], image_start[b + 1]):
            _gather_box(scratch, first_row, 0, width, acc, j, pooled_height, pooled_width, NATIVE, y_table, x_table)
            _store_result(acc, out, box_order[j], c0, result_channels_last, fmt)


# ---- the plans: the weight tables of a call's boxes, then the kernels ---------------------------

#: Channels per task of the scatter kernel, at most: each entry pair's offset and weight are
#: shared by this many channels, one pixel's block is one contiguous (vectorised) run of the
#: channels-last scratch.
CHANNEL_BLOCK = 64
#: Channels per task of the forward gather, at most (an image's channels-last scratch holds that
#: many values per pixel).
FORWARD_CHANNEL_BLOCK = 64
#: Channels per task in the NHWC layout (backward) and from a channels-last input (forward), at
#: most: a pixel's channels are contiguous in memory, so a wider block reads and writes longer
#: runs and shares each entry pair's offset and weight over more channels, and a block of all
#: channels lets the backward accumulate in the result itself (docs/history.md, issue 40).
CHANNELS_LAST_BLOCK = 256
#: Bytes of each scatter task's scratch, about (see :func:`_band_rows`).
SCRATCH_BYTES = 1 << 20


class AxisTable(NamedTuple):
    """The weight table of one axis for a call's boxes (module doc, 1): bin ``p`` of the box at
    table position ``j`` owns ``slots[j * bins + p]`` entries from ``start[j * bins + p]`` on, of
    which it uses ``used[...]``; entry ``e`` is pixel ``pixel[e]`` (ascending within a bin) with
    weight ``weight[e]`` (the compute type). The kernels take the table whole."""

    start: np.ndarray
    slots: np.ndarray
    used: np.ndarray
    pixel: np.ndarray
    weight: np.ndarray


class Geometry(NamedTuple):
    """A validated roi_align_backward call with a non-empty result, as its kernels see it."""

    num_boxes: int
    batch: int
    channels: int
    height: int
    width: int
    pooled_height: int
    pooled_width: int
    channels_last: bool  # the NHWC layout: grad_output (K, PH * PW, C), grad_input (B, H * W, C)
    spatial_scale: float
    sampling_ratio: int
    aligned: bool
    compute: np.dtype
    fmt: StorageFormat


class ForwardGeometry(NamedTuple):
    """A validated roi_align_forward call with a non-empty result, as its kernels see it."""

    num_boxes: int
    batch: int
    channels: int
    height: int
    width: int
    pooled_height: int
    pooled_width: int
    channels_last: bool  # the input's memory is read as (B, H * W, C); else (B, C, H * W)
    result_channels_last: bool  # the result is written as (K, PH * PW, C) (the NHWC layout)
    spatial_scale: float
    sampling_ratio: int
    aligned: bool
    compute: np.dtype
    fmt: StorageFormat


def plan(geometry):
    """The plan of a :class:`Geometry` (``run(grad_output, boxes, grad_input)``) or of a
    :class:`ForwardGeometry` (``run(source, boxes, out)``): see their ``run``."""
    if isinstance(geometry, ForwardGeometry):
        return ForwardPlan(geometry)
    return BackwardPlan(geometry)


class _BoxTables:
    """Builds the weight tables of a call's boxes (they depend on the boxes' values, so on every
    call): the counts kernel always on its serial twin (a few operations per (box, bin) gain
    nothing from the pool, and it compiles faster than the parallel kernel), the tables kernel
    on its serial twin or the pool by the number of entries the boxes need."""

    def __init__(self, geometry):
        g = geometry
        self.geometry = g
        with np.errstate(over="ignore"):
            # Rounded to the compute type like torchvision; a huge scale becomes inf and then
            # every box is skipped by the kernels' finiteness test.
            self.scale = g.compute.type(g.spatial_scale)
        # sampling_ratio travels as a float: any Python int is accepted, none overflows.
        self.ratio = float(g.sampling_ratio)
        self.by_image = Launch(roi_align_boxes_by_image, None)
        self.counts = Launch(roi_align_sample_counts, None, read_only=(0, 1))
        self.fill = (Launch(roi_align_sample_tables, 0), Launch(roi_align_sample_tables, ONE_THREAD_BELOW))

    def __call__(self, boxes):
        """``(box_order, image_start, box_rows, y_table, x_table, skipped)`` for ``boxes`` (K, 5)
        (``skipped``: the boxes that contribute nothing), or None when no box contributes."""
        g = self.geometry
        # Half-format boxes become float32 (exact); the kernels compute in this dtype.
        boxes = np.ascontiguousarray(boxes, dtype=g.compute)
        order, image_start = np.empty((2, boxes.shape[0]), np.int64), np.empty(g.batch + 1, np.int64)
        contributing = self.by_image(boxes, g.batch, order[0], image_start, order[1])
        box_order, skipped = order[0, :contributing], order[1, : boxes.shape[0] - contributing]
        if contributing == 0 or g.height == 0 or g.width == 0:
            return None
        geometry = (g.pooled_height, g.pooled_width, self.scale, self.ratio, g.aligned, g.height, g.width)
        y_slots = np.zeros((box_order.size, g.pooled_height), np.int64)
        x_slots = np.zeros((box_order.size, g.pooled_width), np.int64)
        self.counts(boxes, box_order, *geometry, y_slots, x_slots)
        y_table, x_table = _weight_table(y_slots, g.compute), _weight_table(x_slots, g.compute)
        box_rows = np.empty((box_order.size, 2), np.int64)
        entries = y_table.pixel.size + x_table.pixel.size
        self.fill[entries >= ONE_THREAD_BELOW](boxes, box_order, *geometry, box_rows, y_table, x_table)
        return box_order, image_start, box_rows, y_table, x_table, skipped


class BackwardPlan:
    """roi_align_backward's plan: the boxes' tables, then the scatter kernel."""

    def __init__(self, geometry):
        g = geometry
        self.tables = _BoxTables(g)
        self.block = min(g.channels, CHANNELS_LAST_BLOCK if g.channels_last else CHANNEL_BLOCK)
        self.band_rows = _band_rows(g.width, self.block, g.compute)
        work = g.batch * g.channels * g.height * g.width + g.num_boxes * g.channels * g.pooled_height * g.pooled_width
        self.scatter = Launch(roi_align_bwd, work)
        self.geometry = g

    def run(self, grad_output, boxes, grad_input):
        """grad_output (K, C, PH, PW) -> grad_input (B, C, H, W), or for a ``channels_last``
        geometry (K, PH, PW, C) -> (B, H, W, C); kernel views, C-contiguous; ``boxes`` (K, 5)
        of the data's dtype. Zero where no box contributes."""
        g = self.geometry
        tables = self.tables(boxes) if grad_output.size else None
        if tables is None:
            grad_input.fill(0)
            return
        box_order, image_start, box_rows, y_table, x_table, _ = tables
        bins, pixels = g.pooled_height * g.pooled_width, g.height * g.width
        if g.channels_last:
            grad_bins = grad_output.reshape(g.num_boxes, bins, g.channels)
            grad_input = grad_input.reshape(g.batch, pixels, g.channels)
        else:
            grad_bins = grad_output.reshape(g.num_boxes, g.channels, bins)
            grad_input = grad_input.reshape(g.batch, g.channels, pixels)
        self.scatter(
            grad_bins,
            g.channels_last,
            box_order,
            image_start,
            box_rows,
            grad_input,
            g.width,
            g.pooled_width,
            self.block,
            self.band_rows,
            g.fmt,
            y_table,
            x_table,
        )


class ForwardPlan:
    """roi_align_forward's plan: the boxes' tables, then the gather kernel."""

    def __init__(self, geometry):
        g = geometry
        self.tables = _BoxTables(g)
        self.block = min(g.channels, CHANNELS_LAST_BLOCK if g.channels_last else FORWARD_CHANNEL_BLOCK)
        work = g.batch * g.channels * g.height * g.width + g.num_boxes * g.channels * g.pooled_height * g.pooled_width
        self.gather = Launch(roi_align_fwd, work)
        self.geometry = g

    def run(self, source, boxes, out):
        """``source`` the input's (B, C, H*W) kernel view, or (B, H*W, C) when the geometry is
        ``channels_last``, -> ``out`` (K, C, PH, PW), or (K, PH, PW, C) when it is
        ``result_channels_last`` (a C-contiguous kernel view); ``boxes`` (K, 5) of the data's
        dtype. Zero for the boxes that contribute nothing."""
        g = self.geometry
        tables = self.tables(boxes) if source.size else None
        if tables is None:
            out.fill(0)
            return
        box_order, image_start, box_rows, y_table, x_table, skipped = tables
        bins = g.pooled_height * g.pooled_width
        self.gather(
            source,
            g.channels_last,
            g.result_channels_last,
            g.height,
            g.width,
            box_order,
            image_start,
            box_rows,
            skipped,
            out.reshape((g.num_boxes, bins, g.channels) if g.result_channels_last else (g.num_boxes, g.channels, bins)),
            g.pooled_height,
            g.pooled_width,
            self.block,
            g.fmt,
            y_table,
            x_table,
        )


def _weight_table(slots, compute):
    """One axis's :class:`AxisTable` for the slot counts per (box, bin), its entries to be filled."""
    start = np.zeros(slots.size, np.int64)
    np.cumsum(slots.ravel()[:-1], out=start[1:])
    total = int(slots.sum())
    return AxisTable(
        start, slots.ravel(), np.zeros(slots.size, np.int64), np.empty(total, np.int64), np.empty(total, compute)
    )


def _band_rows(width, channel_block, compute):
    """Rows per task: the task's channels-last scratch stays within ``SCRATCH_BYTES`` (cache).
    Fixed by the problem size; any banding gives the same bits (each element's order is fixed)."""
    row_bytes = width * channel_block * compute.itemsize
    return max(1, SCRATCH_BYTES // row_bytes)
