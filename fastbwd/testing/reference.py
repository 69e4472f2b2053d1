"""Float64 NumPy reference oracle for fastbwd (see docs/semantics.md).

This module is the slow, obviously-correct implementation that the fast kernels, the tests and the
benchmarks compare against. It is written to read like the math of docs/semantics.md, not to be fast:

- only NumPy is used (nothing from fastbwd, no numba, no torch);
- every array argument is converted to float64 (complex128 for complex input to the pad
  functions) and every result is float64 (or complex128);
- sizes and parameters are plain Python values that are already normalised (tuples of ints,
  floats, bools) -- no argument validation is done here, that is the package's job;
- layout is always NCHW (channels at axis 1).

For every backward there is the matching forward, so that the pair can be checked with the
adjoint identity ``<forward(x), g> == <x, backward(g)>`` (see tests/test_reference.py). The
forwards of the linear operators (pad, upsample, avg_pool) are separate transcriptions of the
docs/semantics.md that share no index or window helper with their backwards: the identity then checks two
independent readings of docs/semantics.md against each other, not only that one is the other's transpose.

Index and weight arithmetic is float64, except upsample's scale, source index and lambdas:
docs/semantics.md §1 prescribes them in float32 for float32/float16/bfloat16 data, and in float64 they differ
by up to ~4e-6 relative on 100-wide axes (random shapes then exceeded the float32 tolerance and
1 half-format ulp), so that function follows docs/semantics.md's opmath rule. Elsewhere the kernels'
float32 index math makes them agree with this oracle to a tolerance, not bitwise.
"""

import math
from fractions import Fraction

import numpy as np

__all__ = [
    "replication_pad2d_forward",
    "replication_pad2d_backward",
    "upsample_bilinear2d_interp_matrix",
    "upsample_bilinear2d_forward",
    "upsample_bilinear2d_backward",
    "avg_pool2d_output_size",
    "avg_pool2d_forward",
    "avg_pool2d_backward",
    "roi_align_forward",
    "roi_align_backward",
    "roi_align_axis_weights",
    "group_norm_swish_forward",
    "group_norm_swish_backward",
]


def _as_float(a):
    """float64 array, or complex128 if the input is complex."""
    a = np.asarray(a)
    if np.iscomplexobj(a):
        return np.asarray(a, dtype=np.complex128)
    return np.asarray(a, dtype=np.float64)


def _clamp(v, lo, hi):
    return min(max(v, lo), hi)


# ---------------------------------------------------------------------------------------------
# docs/semantics.md §3: replication_pad2d
# ---------------------------------------------------------------------------------------------


def replication_pad2d_forward(x, padding):
    """Replication pad of the last two axes (docs/semantics.md §3; PyTorch semantics, negative pads crop).

    x: (C, H, W) or (N, C, H, W); padding: (left, right, top, bottom).
    out[..., i, j] = x[..., clamp(i - top, 0, H-1), clamp(j - left, 0, W-1)].
    """
    x = _as_float(x)
    left, right, top, bottom = (int(p) for p in padding)
    H, W = x.shape[-2], x.shape[-1]
    # index arrays, not the backward's scalar loop: the adjoint test compares two transcriptions
    rows = np.clip(np.arange(H + top + bottom) - top, 0, H - 1)
    cols = np.clip(np.arange(W + left + right) - left, 0, W - 1)
    return x[..., rows[:, None], cols[None, :]]


def replication_pad2d_backward(grad_output, input_shape, padding):
    """Gradient of replication_pad2d_forward: the scatter loop of docs/semantics.md §3.

    grad_output: (..., H + top + bottom, W + left + right); input_shape: (C, H, W) or
    (N, C, H, W); padding: (left, right, top, bottom). Returns an array of input_shape.
    """
    g = _as_float(grad_output)
    left, right, top, bottom = (int(p) for p in padding)
    input_shape = tuple(int(s) for s in input_shape)
    H, W = input_shape[-2], input_shape[-1]
    grad_input = np.zeros(input_shape, dtype=g.dtype)
    for i in range(g.shape[-2]):
        for j in range(g.shape[-1]):
            grad_input[..., _clamp(i - top, 0, H - 1), _clamp(j - left, 0, W - 1)] += g[..., i, j]
    return grad_input


# ---------------------------------------------------------------------------------------------
# docs/semantics.md §1: upsample_bilinear2d
# ---------------------------------------------------------------------------------------------


def upsample_bilinear2d_interp_matrix(in_size, out_size, align_corners, scale=0.0, opmath=np.float64):
    """Dense (out_size, in_size) interpolation matrix A of one axis (docs/semantics.md §1 per-axis formula).

    ``scale`` is the user's scales_h / scales_w value (0.0 or None = unset). Row ``o`` holds the
    two weights l0, l1 at columns h0, h1 (added, so h0 == h1 gives one entry l0 + l1). Includes
    PyTorch's identity shortcut for out_size == in_size. The scale, ``src`` and the lambdas are
    computed in ``opmath`` as docs/semantics.md §1 prescribes (float32 for float32 and half-format data:
    ``1 / scale`` divided in float64 and then rounded); the matrix itself is float64.
    """
    H, OH = int(in_size), int(out_size)
    f = np.dtype(opmath).type
    user_scale = 0.0 if scale is None else float(scale)
    if align_corners:
        ratio = f(H - 1) / f(OH - 1) if OH > 1 else f(0)
    else:
        ratio = f(1.0 / user_scale) if user_scale > 0 else f(H) / f(OH)
    A = np.zeros((OH, H), dtype=np.float64)
    for oh in range(OH):
        if OH == H:
            h0 = h1 = oh
            l0, l1 = f(1), f(0)
        else:
            if align_corners:
                src = ratio * f(oh)
            else:
                src = max(f(0), ratio * (f(oh) + f(0.5)) - f(0.5))
            h0 = min(int(math.floor(src)), H - 1)
            l1 = min(max(src - f(h0), f(0)), f(1))
            l0 = f(1) - l1
            h1 = h0 + (1 if h0 < H - 1 else 0)
        A[oh, h0] += float(l0)
        A[oh, h1] += float(l1)
    return A


def _upsample_opmath(array):
    """docs/semantics.md §1's index and weight arithmetic type for data of ``array``'s dtype."""
    return np.float64 if np.asarray(array).dtype == np.float64 else np.float32


def _upsample_source(o, in_size, out_size, align_corners, scale, f):
    """docs/semantics.md §1 for one output index of one axis, written out for the forward on its own (it
    shares nothing with the backward's matrix): ``(i0, i1, l0, l1)``."""
    if out_size == in_size:
        return o, o, 1.0, 0.0
    if align_corners:
        step = f(in_size - 1) / f(out_size - 1) if out_size > 1 else f(0)
        src = step * f(o)
    else:
        if scale is not None and scale > 0:
            step = f(1.0 / scale)
        else:
            step = f(in_size) / f(out_size)
        src = step * (f(o) + f(0.5)) - f(0.5)
        if src < 0:
            src = f(0)
    i0 = min(int(math.floor(src)), in_size - 1)
    l1 = src - f(i0)
    l1 = f(0) if l1 < 0 else (f(1) if l1 > 1 else l1)
    l0 = f(1) - l1
    i1 = i0 + 1 if i0 < in_size - 1 else i0
    return i0, i1, float(l0), float(l1)


def upsample_bilinear2d_forward(x, output_size, align_corners, scales_h=0.0, scales_w=0.0):
    """Bilinear upsampling forward (docs/semantics.md §1): x (N, C, H, W) -> (N, C, OH, OW).

    A plain loop over output cells, each the weighted sum of its four source cells. It does not
    use the backward's interpolation matrices, so the adjoint identity between the two checks
    both (two independent transcriptions of docs/semantics.md §1), not merely that one is the other's
    transpose. Index and lambda arithmetic in the opmath type of x's dtype.
    """
    f = np.dtype(_upsample_opmath(x)).type
    x = np.asarray(x, dtype=np.float64)
    OH, OW = (int(s) for s in output_size)
    H, W = x.shape[2], x.shape[3]
    out = np.zeros(x.shape[:2] + (OH, OW), dtype=np.float64)
    for oh in range(OH):
        h0, h1, lh0, lh1 = _upsample_source(oh, H, OH, align_corners, scales_h, f)
        for ow in range(OW):
            w0, w1, lw0, lw1 = _upsample_source(ow, W, OW, align_corners, scales_w, f)
            out[:, :, oh, ow] = (
                lh0 * lw0 * x[:, :, h0, w0]
                + lh0 * lw1 * x[:, :, h0, w1]
                + lh1 * lw0 * x[:, :, h1, w0]
                + lh1 * lw1 * x[:, :, h1, w1]
            )
    return out


def upsample_bilinear2d_backward(grad_output, output_size, input_size, align_corners, scales_h=0.0, scales_w=0.0):
    """Bilinear upsampling backward (docs/semantics.md §1): Ah.T @ g @ Aw, shape input_size (N, C, H, W).

    The weights follow docs/semantics.md §1's opmath rule for grad_output's dtype; the sums are float64.
    """
    opmath = _upsample_opmath(grad_output)
    g = np.asarray(grad_output, dtype=np.float64)
    OH, OW = (int(s) for s in output_size)
    N, C, H, W = (int(s) for s in input_size)
    Ah = upsample_bilinear2d_interp_matrix(H, OH, align_corners, scales_h, opmath)
    Aw = upsample_bilinear2d_interp_matrix(W, OW, align_corners, scales_w, opmath)
    out = np.einsum("oh,ncop,pw->nchw", Ah, g, Aw)
    return out.reshape(N, C, H, W)


# ---------------------------------------------------------------------------------------------
# docs/semantics.md §2: avg_pool2d
# ---------------------------------------------------------------------------------------------


def avg_pool2d_output_size(in_size, kernel, stride, pad, ceil_mode):
    """Pooled size of one axis (docs/semantics.md §2, PyTorch ``pooling_output_shape``, modern rule)."""
    H, k, s, p = int(in_size), int(kernel), int(stride), int(pad)
    out = (H + 2 * p - k + ((s - 1) if ceil_mode else 0)) // s + 1  # Python // is floor
    if ceil_mode and (out - 1) * s >= H + p:
        out -= 1
    return out


def _avg_pool2d_windows(H, W, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """Yield (oh, ow, hs, he, ws, we, div) for every output cell: the docs/semantics.md §2 windows."""
    kH, kW = (int(v) for v in kernel_size)
    sH, sW = (int(v) for v in stride)
    pH, pW = (int(v) for v in padding)
    OH = avg_pool2d_output_size(H, kH, sH, pH, ceil_mode)
    OW = avg_pool2d_output_size(W, kW, sW, pW, ceil_mode)
    for oh in range(OH):
        for ow in range(OW):
            hs = oh * sH - pH
            ws = ow * sW - pW
            he = min(hs + kH, H + pH)
            we = min(ws + kW, W + pW)
            pool_size = (he - hs) * (we - ws)  # includes padding, excludes ceil overhang
            hs, ws = max(hs, 0), max(ws, 0)
            he, we = min(he, H), min(we, W)
            if divisor_override != 0:
                div = divisor_override
            elif count_include_pad:
                div = pool_size
            else:
                div = (he - hs) * (we - ws)
            yield oh, ow, hs, he, ws, we, div


def avg_pool2d_forward(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override=0):
    """Average pooling forward, docs/semantics.md §2 written out per output cell.

    x: (C, H, W) or (N, C, H, W); kernel_size, stride, padding: (h, w) tuples;
    divisor_override: 0 = unset. It does not use the backward's window helper: each window is
    the padded input's cells ``[oh*sH, oh*sH + kH)`` (in padded coordinates) that lie inside the
    padded input, its input cells summed, divided by the divisor. So the adjoint identity checks
    two independent transcriptions of the windows and divisors.
    """
    x = np.asarray(x, dtype=np.float64)
    unbatched = x.ndim == 3
    if unbatched:
        x = x[None]
    N, C, H, W = x.shape
    kH, kW = (int(v) for v in kernel_size)
    sH, sW = (int(v) for v in stride)
    pH, pW = (int(v) for v in padding)
    OH = avg_pool2d_output_size(H, kH, sH, pH, ceil_mode)
    OW = avg_pool2d_output_size(W, kW, sW, pW, ceil_mode)
    out = np.zeros((N, C, OH, OW), dtype=np.float64)
    for oh in range(OH):
        # rows of the padded input (0 .. H + 2*pH - 1) this window covers
        padded_rows = [r for r in range(oh * sH, oh * sH + kH) if r < H + 2 * pH]
        rows = [r - pH for r in padded_rows if pH <= r < H + pH]
        for ow in range(OW):
            padded_cols = [c for c in range(ow * sW, ow * sW + kW) if c < W + 2 * pW]
            cols = [c - pW for c in padded_cols if pW <= c < W + pW]
            if divisor_override != 0:
                div = int(divisor_override)
            elif count_include_pad:
                div = len(padded_rows) * len(padded_cols)
            else:
                div = len(rows) * len(cols)
            total = np.zeros((N, C), dtype=np.float64)
            for r in rows:
                for c in cols:
                    total += x[:, :, r, c]
            if rows and cols:
                out[:, :, oh, ow] = total / div
    return out[0] if unbatched else out


def avg_pool2d_backward(
    grad_output, input_shape, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override=0
):
    """Average pooling backward: the plain scatter loop of docs/semantics.md §2.

    grad_output: (C, OH, OW) or (N, C, OH, OW); input_shape: the forward input's shape (same
    rank). grad_input[..., hs:he, ws:we] += grad_output[..., oh, ow] / div.
    """
    g = np.asarray(grad_output, dtype=np.float64)
    input_shape = tuple(int(s) for s in input_shape)
    unbatched = len(input_shape) == 3
    if unbatched:
        g = g[None]
        input_shape = (1,) + input_shape
    N, C, H, W = input_shape
    grad_input = np.zeros(input_shape, dtype=np.float64)
    for oh, ow, hs, he, ws, we, div in _avg_pool2d_windows(
        H, W, kernel_size, stride, padding, ceil_mode, count_include_pad, int(divisor_override)
    ):
        if he <= hs or we <= ws:
            continue
        grad_input[:, :, hs:he, ws:we] += (g[:, :, oh, ow] / div)[:, :, None, None]
    return grad_input[0] if unbatched else grad_input


# ---------------------------------------------------------------------------------------------
# docs/semantics.md §4: roi_align
# ---------------------------------------------------------------------------------------------

# Above this many samples along one axis of one bin, the per-axis weights are computed in exact
# rational arithmetic over the samples grouped by pixel; up to it every sample is visited. The
# per-sample 2-D loop (roi_align_backward_by_samples) visits only the samples that can land in
# the image when there are more than this many.
_ROI_FULL_LOOP_MAX = 1 << 12


def _roi_sample_indices(start, step, n, size):
    """Sample indices i in [0, n) of one bin along one axis whose coordinate
    ``start + (i + 0.5) * step`` may lie inside [-1, size].

    For ordinary grids this is simply range(n). For huge adaptive grids (a huge box with
    sampling_ratio 0) it is the candidate interval solved from the linear formula and widened
    by 2 on each side against rounding; the caller still applies the exact docs/semantics.md test to every
    candidate, so the result is the same as iterating all n samples.
    """
    if n <= _ROI_FULL_LOOP_MAX or not (step > 0):
        return range(max(n, 0))
    a = (-1.0 - start) / step - 0.5  # first index with coordinate >= -1 (before rounding)
    b = (size - start) / step - 0.5  # last index with coordinate <= size (before rounding)
    if math.isnan(a) or math.isnan(b) or b < -2 or a > n + 2:
        return range(0)  # every coordinate is NaN, < -1 or > size
    lo = max(math.floor(max(a, -1.0)) - 2, 0)
    hi = min(math.ceil(min(b, float(n))) + 2, n - 1)
    return range(lo, hi + 1)


def _roi_box_geometry(box, B, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned):
    """docs/semantics.md §4 per-box setup. Returns None for a box that contributes nothing, else
    (b, x1, y1, bin_h, bin_w, gh, gw, count)."""
    box = [float(v) for v in box]
    if not all(math.isfinite(v) for v in box):
        return None
    b = math.floor(box[0])
    if b < 0 or b >= B:
        return None
    off = 0.5 if aligned else 0.0
    x1 = box[1] * spatial_scale - off
    y1 = box[2] * spatial_scale - off
    x2 = box[3] * spatial_scale - off
    y2 = box[4] * spatial_scale - off
    roi_w, roi_h = x2 - x1, y2 - y1
    if not aligned:
        roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
    bin_h = roi_h / pooled_height
    bin_w = roi_w / pooled_width
    # A finite box can still overflow after scaling; then every sample coordinate is NaN or
    # +-Inf and is skipped by the sample test, so the box contributes nothing.
    if not all(math.isfinite(v) for v in (x1, y1, bin_h, bin_w)):
        return None
    gh = sampling_ratio if sampling_ratio > 0 else math.ceil(roi_h / pooled_height)
    gw = sampling_ratio if sampling_ratio > 0 else math.ceil(roi_w / pooled_width)
    if gh <= 0 or gw <= 0:
        return None  # no samples
    count = float(gh) * float(gw)  # float64 product: no integer overflow (may be inf)
    return b, x1, y1, bin_h, bin_w, gh, gw, count


def _roi_bilinear(y, x, H, W):
    """docs/semantics.md §4 sample rule. Returns None for a skipped sample, else
    (yl, yh, xl, xh, w_ll, w_lh, w_hl, w_hh) with w_ab the weight of pixel (y_a, x_b)."""
    if math.isnan(y) or math.isnan(x) or y < -1.0 or y > H or x < -1.0 or x > W:
        return None
    y, x = max(y, 0.0), max(x, 0.0)
    yl, xl = int(y), int(x)
    if yl >= H - 1:
        yh = yl = H - 1
        y = float(yl)
    else:
        yh = yl + 1
    if xl >= W - 1:
        xh = xl = W - 1
        x = float(xl)
    else:
        xh = xl + 1
    ly, lx = y - yl, x - xl
    hy, hx = 1.0 - ly, 1.0 - lx
    return yl, yh, xl, xh, hy * hx, hy * lx, ly * hx, ly * lx


def _roi_samples(box, B, H, W, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned):
    """Yield (b, ph, pw, yl, yh, xl, xh, w_ll, w_lh, w_hl, w_hh, count) for every sample of a
    box that contributes (docs/semantics.md §4)."""
    geo = _roi_box_geometry(box, B, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned)
    if geo is None:
        return
    b, x1, y1, bin_h, bin_w, gh, gw, count = geo
    for ph in range(pooled_height):
        for pw in range(pooled_width):
            ystart = y1 + ph * bin_h
            xstart = x1 + pw * bin_w
            for iy in _roi_sample_indices(ystart, bin_h / gh, gh, H):
                y = y1 + ph * bin_h + (iy + 0.5) * bin_h / gh
                for ix in _roi_sample_indices(xstart, bin_w / gw, gw, W):
                    x = x1 + pw * bin_w + (ix + 0.5) * bin_w / gw
                    s = _roi_bilinear(y, x, H, W)
                    if s is None:
                        continue
                    yield (b, ph, pw) + s + (count,)


def _roi_sample_weights_1d(p, size):
    """docs/semantics.md §4 sample rule along one axis: None for a skipped coordinate, else
    ((low, weight), (high, weight)) of the clamped bilinear split."""
    if math.isnan(p) or p < -1.0 or p > size:
        return None
    y = max(p, 0.0)
    low = int(y)
    if low >= size - 1:
        high = low = size - 1
        y = float(low)
    else:
        high = low + 1
    lam = y - low
    return (low, 1.0 - lam), (high, lam)


def _roi_axis_by_samples(start, bin_size, grid, size):
    """Per-pixel weight sums of one bin along one axis, visiting every sample in float64."""
    parts = [[] for _ in range(size)]
    for i in range(grid):
        split = _roi_sample_weights_1d(start + (i + 0.5) * bin_size / grid, size)
        if split is not None:
            for pixel, w in split:
                parts[pixel].append(w)
    weights = np.array([math.fsum(ws) for ws in parts], dtype=np.float64)
    touched = np.array([len(ws) > 0 for ws in parts], dtype=bool)
    return weights, touched


def _roi_axis_exact(start, bin_size, grid, size):
    """Per-pixel weight sums of one bin along one axis in exact rational arithmetic.

    The samples are the arithmetic progression p_i = start + (i + 1/2) * bin_size / grid,
    i = 0 .. grid-1, taken as exact rationals. They are grouped by the coordinate interval that
    decides their split (docs/semantics.md §4): [-1, 0) clamps to pixel 0 (weight 1, pixel 1 touched with 0),
    [L, L+1) splits between L and L+1 with lambda = p - L, [size-1, size] clamps to pixel size-1.
    The indices of each group follow from solving the progression for the interval ends, and the
    sum of lambda over a group is its count times its mean position minus L.
    """
    start, bin_size = Fraction(start), Fraction(bin_size)
    d = bin_size / grid
    if d < 0:  # the same samples in the opposite order: start from the far end
        start, d = start + bin_size, -d
    weights = [Fraction(0)] * size
    touched = [False] * size

    def indices(low, low_closed, high, high_closed):
        """(first, last) sample indices with low <(=) p_i <(=) high, clipped to [0, grid)."""
        if d == 0:
            inside = (start >= low if low_closed else start > low) and (start <= high if high_closed else start < high)
            return (0, grid - 1) if inside else (0, -1)
        lo = (low - start) / d - Fraction(1, 2)
        hi = (high - start) / d - Fraction(1, 2)
        first = math.ceil(lo) if low_closed else math.floor(lo) + 1
        last = math.floor(hi) if high_closed else math.ceil(hi) - 1
        return max(first, 0), min(last, grid - 1)

    def add(low, high, first, last, lam_offset):
        n = last - first + 1
        if n <= 0:
            return
        if lam_offset is None:
            lam_sum = Fraction(0)
        else:  # sum of (p_i - lam_offset): n times the mean position minus the offset
            lam_sum = n * (start + (Fraction(first + last, 2) + Fraction(1, 2)) * d - lam_offset)
        weights[low] += n - lam_sum
        weights[high] += lam_sum
        touched[low] = touched[high] = True

    if size == 1:
        add(0, 0, *indices(-1, True, 1, True), None)
    else:
        add(0, 1, *indices(-1, True, 0, False), None)
        for L in range(size - 1):
            add(L, L + 1, *indices(L, True, L + 1, False), L)
        add(size - 1, size - 1, *indices(size - 1, True, size, True), None)
    return np.array([float(w) for w in weights], dtype=np.float64), np.array(touched, dtype=bool)


def roi_align_axis_weights(start, bin_size, grid, size):
    """``(weights, touched)``: for each pixel of an axis of length ``size``, the sum over the
    valid samples of one bin (``grid`` samples from ``start``, spanning ``bin_size``) of their
    bilinear weight on it, and whether any valid sample touches it (even with weight 0).

    Up to ``_ROI_FULL_LOOP_MAX`` samples every sample is visited in float64 (exact sums with
    math.fsum); larger grids are evaluated in exact rational arithmetic (``_roi_axis_exact``).
    """
    if grid <= _ROI_FULL_LOOP_MAX:
        return _roi_axis_by_samples(start, bin_size, grid, size)
    return _roi_axis_exact(start, bin_size, grid, size)


def _roi_box_weights(box, B, H, W, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned):
    """None for a box without samples, else (b, wy (PH, H), ty, wx (PW, W), tx, count): the
    per-axis weight sums and touched masks of docs/semantics.md §4's product form."""
    geo = _roi_box_geometry(box, B, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned)
    if geo is None or H == 0 or W == 0:
        return None
    b, x1, y1, bin_h, bin_w, gh, gw, count = geo
    wy, ty = zip(*[roi_align_axis_weights(y1 + ph * bin_h, bin_h, gh, H) for ph in range(pooled_height)])
    wx, tx = zip(*[roi_align_axis_weights(x1 + pw * bin_w, bin_w, gw, W) for pw in range(pooled_width)])
    return b, np.array(wy), np.array(ty), np.array(wx), np.array(tx), count


def roi_align_forward(x, boxes, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned):
    """torchvision roi_align forward in docs/semantics.md §4's product form, in float64.

    x: (B, C, H, W); boxes: (K, 5) rows (batch_index, x1, y1, x2, y2). Returns (K, C, PH, PW):
    out[k, c, ph, pw] = sum over the touched rows and columns of
    x[b, c, row, col] * wy[ph, row] * wx[pw, col] / count (the mean over the gh*gw samples of
    the bilinear value; skipped samples count as 0; a skipped box or a box without samples
    gives 0). The batch index is floor(boxes[k, 0]).
    """
    x = np.asarray(x, dtype=np.float64)
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 5)
    B, C, H, W = x.shape
    PH, PW = int(pooled_height), int(pooled_width)
    out = np.zeros((boxes.shape[0], C, PH, PW), dtype=np.float64)
    for k in range(boxes.shape[0]):
        weights = _roi_box_weights(boxes[k], B, H, W, PH, PW, float(spatial_scale), int(sampling_ratio), bool(aligned))
        if weights is None:
            continue
        b, wy, ty, wx, tx, count = weights
        for ph in range(PH):
            for pw in range(PW):
                rows, cols = np.flatnonzero(ty[ph]), np.flatnonzero(tx[pw])
                w = np.outer(wy[ph, rows], wx[pw, cols]) / count
                patch = x[b][:, rows][:, :, cols]
                out[k, :, ph, pw] = np.einsum("crs,rs->c", patch, w)
    return out


def roi_align_backward(
    grad_output, boxes, input_shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned
):
    """roi_align backward in docs/semantics.md §4's product form, in float64. Returns (B, C, H, W).

    Each bin adds g * wy[ph, row] * wx[pw, col] / count to every pixel whose row and column are
    touched by a valid sample of the bin (an inf or NaN gradient then gives NaN where a weight is
    0, as in the per-sample loop). Skipped: a box with NaN/Inf in any of its 5 values or
    floor(batch_index) outside [0, B); samples with NaN coordinates or outside [-1, H] x [-1, W];
    gh <= 0 or gw <= 0 means no samples.
    """
    g = np.asarray(grad_output, dtype=np.float64)
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 5)
    B, C, H, W = (int(s) for s in input_shape)
    PH, PW = int(pooled_height), int(pooled_width)
    grad_input = np.zeros((B, C, H, W), dtype=np.float64)
    for k in range(boxes.shape[0]):
        weights = _roi_box_weights(boxes[k], B, H, W, PH, PW, float(spatial_scale), int(sampling_ratio), bool(aligned))
        if weights is None:
            continue
        b, wy, ty, wx, tx, count = weights
        for ph in range(PH):
            for pw in range(PW):
                rows, cols = np.flatnonzero(ty[ph]), np.flatnonzero(tx[pw])
                w = np.outer(wy[ph, rows], wx[pw, cols]) / count
                grad_input[b][:, rows[:, None], cols[None, :]] += g[k, :, ph, pw, None, None] * w
    return grad_input


def roi_align_backward_by_samples(
    grad_output, boxes, input_shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned
):
    """The docs/semantics.md §4 loop itself in float64, sample by sample (every sample scatters g * weight /
    count to its four pixels), to check the product form against (small grids only)."""
    g = np.asarray(grad_output, dtype=np.float64)
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 5)
    B, C, H, W = (int(s) for s in input_shape)
    PH, PW = int(pooled_height), int(pooled_width)
    grad_input = np.zeros((B, C, H, W), dtype=np.float64)
    for k in range(boxes.shape[0]):
        for b, ph, pw, yl, yh, xl, xh, w_ll, w_lh, w_hl, w_hh, count in _roi_samples(
            boxes[k], B, H, W, PH, PW, float(spatial_scale), int(sampling_ratio), bool(aligned)
        ):
            gk = g[k, :, ph, pw]
            grad_input[b, :, yl, xl] += gk * w_ll / count
            grad_input[b, :, yl, xh] += gk * w_lh / count
            grad_input[b, :, yh, xl] += gk * w_hl / count
            grad_input[b, :, yh, xh] += gk * w_hh / count
    return grad_input


# ---------------------------------------------------------------------------------------------
# docs/semantics.md §5: group_norm_swish
# ---------------------------------------------------------------------------------------------


def _sigmoid(z):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-z))


def group_norm_swish_forward(x, gamma, beta, num_groups, eps=1e-5, swish_scale=1.0, activate_swish=True):
    """GroupNorm followed by swish (docs/semantics.md §5.1), in float64.

    x: (N, C, *spatial), rank >= 2; gamma, beta: (C,). Returns (out, mean, rstd) with
    mean, rstd of shape (N, G): biased variance, rstd = 1 / sqrt(var + eps) (inf for a constant
    group at eps = 0), all float64. y = (x - mean) * rstd * gamma + beta; out = y * sigmoid(
    swish_scale * y) when activate_swish, else y.
    """
    x = np.asarray(x, dtype=np.float64)
    gamma = np.asarray(gamma, dtype=np.float64)
    beta = np.asarray(beta, dtype=np.float64)
    N, C = x.shape[0], x.shape[1]
    G = int(num_groups)
    s = float(swish_scale)
    xg = x.reshape(N, G, -1)  # (N, G, D*HxW)
    mean = xg.mean(axis=2)
    var = ((xg - mean[:, :, None]) ** 2).mean(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):  # var + eps == 0: rstd inf, y NaN
        rstd = 1.0 / np.sqrt(var + eps)
        xhat = ((xg - mean[:, :, None]) * rstd[:, :, None]).reshape(x.shape)
    cshape = (1, C) + (1,) * (x.ndim - 2)
    y = xhat * gamma.reshape(cshape) + beta.reshape(cshape)
    if not activate_swish:
        return y, mean, rstd
    with np.errstate(invalid="ignore"):
        out = y * _sigmoid(s * y)
    return out, mean, rstd


def group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, num_groups, swish_scale=1.0, activate_swish=True):
    """GroupNorm+swish backward: the docs/semantics.md §5 formulas verbatim, in float64.

    mean, rstd: (N, G) or flat (N*G,), used as given (not recomputed). Returns
    (dx, dgamma, dbeta). swish_scale is used as given in float64 (the kernels use it in their
    compute type: for float32 or half data pass float(np.float32(scale))). Where s*y is +-inf
    (an infinite scale) the Swish derivative is its limit, 1 or 0, instead of the formula's
    inf * 0 = NaN. ``activate_swish=False``: the plain GroupNorm backward (gnew = dy).
    """
    dy = np.asarray(dy, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    gamma = np.asarray(gamma, dtype=np.float64)
    beta = np.asarray(beta, dtype=np.float64)
    N, C = x.shape[0], x.shape[1]
    G = int(num_groups)
    D = C // G
    HxW = int(np.prod(x.shape[2:], dtype=np.int64)) if x.ndim > 2 else 1
    M = D * HxW
    s = float(swish_scale)
    mean = np.asarray(mean, dtype=np.float64).reshape(N, G)
    rstd = np.asarray(rstd, dtype=np.float64).reshape(N, G)

    # work on (N, G, D, HxW) views
    x4 = x.reshape(N, G, D, HxW)
    dy4 = dy.reshape(N, G, D, HxW)
    gam = gamma.reshape(1, G, D, 1)
    bet = beta.reshape(1, G, D, 1)
    mean4 = mean[:, :, None, None]
    rstd4 = rstd[:, :, None, None]

    xhat = (x4 - mean4) * rstd4
    y = xhat * gam + bet
    with np.errstate(invalid="ignore", over="ignore"):  # an infinite s: inf * 0 at y = 0
        z = s * y
        sig = _sigmoid(z)
        dsw = sig * (1.0 + z * (1.0 - sig))
    dsw = np.where(np.isinf(z), (z > 0).astype(np.float64), dsw)  # the limits at z = +-inf
    gnew = dy4 * dsw if activate_swish else dy4

    dbeta = gnew.sum(axis=(0, 3)).reshape(C)
    dgamma = (gnew * xhat).sum(axis=(0, 3)).reshape(C)

    sum_g = gnew.sum(axis=3)  # (N, G, D): sum_hw gnew
    sum_gx = (gnew * xhat).sum(axis=3)  # (N, G, D): sum_hw gnew * xhat
    c1 = (gam[..., 0] * sum_g).sum(axis=2) / M  # (N, G)
    c2 = (gam[..., 0] * sum_gx).sum(axis=2) / M  # (N, G)
    dx = rstd4 * (gnew * gam - xhat * c2[:, :, None, None] - c1[:, :, None, None])
    return dx.reshape(x.shape), dgamma, dbeta
