"""Tests of the float64 reference oracle itself (fastbwd/testing/reference.py).

The oracle is what every kernel test trusts, so it is checked on its own:
- adjoint identity <forward(x), g> == <x, backward(g)> for the linear ops (pad, upsample,
  avg_pool, roi_align) on random non-square shapes and many parameter combinations;
- the worked examples of docs/semantics.md and small hand-computed cases;
- central finite differences of the full group_norm_swish forward against its backward;
- when torch is importable, cross-checks against PyTorch's CPU kernels in float64.

"""

import zlib

import numpy as np
import pytest

from fastbwd.testing import reference as ref


def rng_for(*key):
    """A generator seeded deterministically from the test's parameters."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def randn(rng, shape, complex_=False):
    a = rng.standard_normal(shape)
    if complex_:
        a = a + 1j * rng.standard_normal(shape)
    return a


def assert_adjoint(fx, g, x, bg, rtol=1e-10):
    """<fx, g> == <x, bg> (bilinear, no conjugation), relative to the sum of |terms|."""
    assert fx.shape == g.shape and x.shape == bg.shape
    lhs = np.sum(fx * g)
    rhs = np.sum(x * bg)
    scale = max(np.sum(np.abs(fx * g)), np.sum(np.abs(x * bg)), 1e-300)
    assert abs(lhs - rhs) <= rtol * scale, (lhs, rhs)


# ---------------------------------------------------------------------------------------------
# replication pad (docs/semantics.md §3)
# ---------------------------------------------------------------------------------------------

PAD_SHAPES = [(2, 3, 5, 7), (3, 4, 6), (1, 1, 1, 4)]
PADDINGS = [(1, 2, 3, 0), (0, 0, 0, 0), (-1, 2, 1, -2), (3, 6, 4, 2), (-2, -3, -1, -1), (0, 3, 0, 0)]


def _pad_ok(shape, padding):
    """docs/semantics.md §3: each pad < the dimension it pads, padded sizes >= 1."""
    H, W = shape[-2:]
    left, right, top, bottom = padding
    return left < W and right < W and top < H and bottom < H and H + top + bottom >= 1 and W + left + right >= 1


PAD_CASES = [(shape, padding) for shape in PAD_SHAPES for padding in PADDINGS if _pad_ok(shape, padding)]


@pytest.mark.parametrize("shape,padding", PAD_CASES)
@pytest.mark.parametrize("complex_", [False, True])
def test_pad_adjoint(shape, padding, complex_):
    rng = rng_for("pad", shape, padding, complex_)
    x = randn(rng, shape, complex_)
    fx = ref.replication_pad2d_forward(x, padding)
    H, W = shape[-2:]
    left, right, top, bottom = padding
    assert fx.shape == shape[:-2] + (H + top + bottom, W + left + right)
    assert fx.dtype == (np.complex128 if complex_ else np.float64)
    g = randn(rng, fx.shape, complex_)
    bg = ref.replication_pad2d_backward(g, shape, padding)
    assert bg.dtype == fx.dtype
    assert_adjoint(fx, g, x, bg)


@pytest.mark.parametrize("padding", [(1, 2, 3, 0), (0, 0, 0, 0), (3, 6, 4, 2)])
def test_pad_forward_matches_np_pad_edge(padding):
    x = rng_for("padedge", padding).standard_normal((2, 3, 5, 7))
    left, right, top, bottom = padding
    expected = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), mode="edge")
    np.testing.assert_array_equal(ref.replication_pad2d_forward(x, padding), expected)


def test_pad_negative_crops():
    x = np.arange(5 * 6, dtype=np.float64).reshape(1, 5, 6)
    np.testing.assert_array_equal(ref.replication_pad2d_forward(x, (-1, -2, -1, 0)), x[:, 1:, 1:4])


def test_pad_spec_document_example():
    g = np.array([[[1, 1, 1, 1, 1, 1, 1]]], dtype=np.float32)
    out = ref.replication_pad2d_backward(g, (1, 1, 5), (1, 1, 0, 0))
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, [[[2, 1, 1, 1, 2]]])


def test_pad_corners_sum_rectangle():
    # H=3, W=4, padding (left, right, top, bottom) = (2, 3, 2, 1)
    g = np.ones((1, 1, 3 + 2 + 1, 4 + 2 + 3))
    out = ref.replication_pad2d_backward(g, (1, 1, 3, 4), (2, 3, 2, 1))
    expected = np.ones((3, 4))
    expected[0, :] *= 3  # top strip (2 rows) + the row itself
    expected[-1, :] *= 2  # bottom strip (1 row) + the row itself
    expected[:, 0] *= 3  # left strip (2 columns) + the column itself
    expected[:, -1] *= 4  # right strip (3 columns) + the column itself
    np.testing.assert_array_equal(out[0, 0], expected)
    assert out.sum() == g.sum()


# ---------------------------------------------------------------------------------------------
# upsample bilinear (docs/semantics.md §1)
# ---------------------------------------------------------------------------------------------

UP_CASES = [
    # (input (N, C, H, W), output (OH, OW), scales_h, scales_w)
    ((2, 3, 5, 7), (9, 4), 0.0, 0.0),
    ((2, 3, 5, 7), (5, 7), 0.0, 0.0),  # identity shortcut on both axes
    ((2, 3, 5, 7), (5, 13), 0.0, 0.0),  # identity shortcut on H only
    ((1, 2, 4, 6), (1, 1), 0.0, 0.0),
    ((1, 2, 4, 6), (11, 13), 0.0, 0.0),
    ((1, 2, 4, 6), (11, 13), 2.5, 2.0),  # user scales (consistent-ish)
    ((1, 2, 4, 6), (9, 3), 1.7, 0.6),  # user scales (inconsistent with sizes)
    ((1, 2, 4, 6), (4, 6), 3.0, 0.5),  # identity shortcut wins over scales
    ((2, 1, 1, 3), (3, 1), 0.0, 0.0),
    ((1, 2, 4, 6), (9, 3), -2.0, float("nan")),  # negative and NaN scales mean unset
    ((2, 1, 5, 3), (7, 8), -0.5, 1.5),
]


@pytest.mark.parametrize("case", UP_CASES)
@pytest.mark.parametrize("align_corners", [False, True])
def test_upsample_adjoint(case, align_corners):
    in_shape, out_size, sh, sw = case
    rng = rng_for("up", case, align_corners)
    x = rng.standard_normal(in_shape)
    fx = ref.upsample_bilinear2d_forward(x, out_size, align_corners, sh, sw)
    assert fx.shape == in_shape[:2] + out_size
    g = rng.standard_normal(fx.shape)
    bg = ref.upsample_bilinear2d_backward(g, out_size, in_shape, align_corners, sh, sw)
    assert_adjoint(fx, g, x, bg)


@pytest.mark.covering
@pytest.mark.parametrize("in_size,out_size", [(5, 9), (7, 3), (1, 4), (4, 1), (6, 6), (3, 17)])
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("scale", [0.0, 1.3, 0.4])
def test_upsample_matrix_rows_are_convex_weights(in_size, out_size, align_corners, scale):
    A = ref.upsample_bilinear2d_interp_matrix(in_size, out_size, align_corners, scale)
    assert A.shape == (out_size, in_size)
    assert (A >= 0).all()
    np.testing.assert_allclose(A.sum(axis=1), 1.0, rtol=0, atol=1e-15)
    assert ((A > 0).sum(axis=1) <= 2).all()


def test_upsample_matrix_hand_values():
    A = ref.upsample_bilinear2d_interp_matrix(2, 4, False, 0.0)
    np.testing.assert_array_equal(A, [[1, 0], [0.75, 0.25], [0.25, 0.75], [0, 1]])
    A = ref.upsample_bilinear2d_interp_matrix(3, 5, True, 0.0)
    np.testing.assert_array_equal(A, [[1, 0, 0], [0.5, 0.5, 0], [0, 1, 0], [0, 0.5, 0.5], [0, 0, 1]])
    np.testing.assert_array_equal(ref.upsample_bilinear2d_interp_matrix(4, 4, False, 3.0), np.eye(4))
    # align_corners False with OH == 1: scale = H, src = max(0, H*0.5 - 0.5)
    np.testing.assert_array_equal(ref.upsample_bilinear2d_interp_matrix(4, 1, False, 0.0), [[0, 0.5, 0.5, 0]])
    np.testing.assert_array_equal(ref.upsample_bilinear2d_interp_matrix(4, 1, True, 0.0), [[1, 0, 0, 0]])


# ---------------------------------------------------------------------------------------------
# avg pool (docs/semantics.md §2)
# ---------------------------------------------------------------------------------------------

POOL_GEOMS = [
    # (input shape, kernel, stride, padding)
    ((2, 3, 7, 9), (3, 2), (2, 1), (1, 1)),
    ((2, 3, 7, 9), (3, 3), (2, 2), (1, 0)),
    ((1, 2, 5, 6), (2, 3), (2, 2), (0, 1)),
    ((3, 6, 5), (2, 2), (3, 2), (1, 0)),  # unbatched (C, H, W)
    ((1, 1, 5, 5), (5, 5), (1, 1), (2, 2)),
    ((1, 2, 6, 4), (1, 1), (1, 1), (0, 0)),
    # ceil_mode's last window overhangs the padding (its divisor excludes the overhang):
    ((1, 2, 6, 6), (3, 3), (2, 2), (1, 1)),  # on both axes
    ((2, 1, 7, 6), (4, 3), (3, 2), (1, 1)),  # on both axes, non-square
    ((1, 1, 7, 4), (4, 2), (3, 3), (1, 1)),  # on the H axis only
    ((1, 1, 4, 7), (2, 4), (3, 3), (1, 1)),  # on the W axis only
]


@pytest.mark.covering
@pytest.mark.parametrize("geom", POOL_GEOMS)
@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("count_include_pad", [False, True])
@pytest.mark.parametrize("divisor_override", [0, 5, -3])
def test_avg_pool_adjoint(geom, ceil_mode, count_include_pad, divisor_override):
    shape, k, s, p = geom
    rng = rng_for("pool", geom, ceil_mode, count_include_pad, divisor_override)
    x = rng.standard_normal(shape)
    fx = ref.avg_pool2d_forward(x, k, s, p, ceil_mode, count_include_pad, divisor_override)
    OH = ref.avg_pool2d_output_size(shape[-2], k[0], s[0], p[0], ceil_mode)
    OW = ref.avg_pool2d_output_size(shape[-1], k[1], s[1], p[1], ceil_mode)
    assert fx.shape == shape[:-2] + (OH, OW)
    g = rng.standard_normal(fx.shape)
    bg = ref.avg_pool2d_backward(g, shape, k, s, p, ceil_mode, count_include_pad, divisor_override)
    assert_adjoint(fx, g, x, bg)


def test_avg_pool_ceil_mode_example():
    g = np.ones((1, 1, 1, 3))
    out = ref.avg_pool2d_backward(g, (1, 1, 1, 5), (1, 2), (1, 2), (0, 0), True, True, 0)
    np.testing.assert_array_equal(out, [[[[0.5, 0.5, 0.5, 0.5, 1.0]]]])


@pytest.mark.parametrize("axis", ["h", "w"])
def test_avg_pool_ceil_mode_overhang_hand_values(axis):
    # 6 cells, k 3, s 2, p 1, ceil_mode: windows [-1, 2), [1, 4), [3, 6), [5, 8), the last one
    # overhanging the padded input [-1, 7) by one: it holds cell 5 and one pad cell, divisor 2
    # with count_include_pad (3 for the others); without it, 2, 3, 3 and 1.
    def along(values):
        values = np.asarray(values, np.float64)
        return values.reshape(1, 1, -1, 1) if axis == "h" else values.reshape(1, 1, 1, -1)

    def geometry(a, b):
        return (a, b) if axis == "h" else (b, a)

    k, s, p = geometry(3, 1), geometry(2, 1), geometry(1, 0)
    x = along(np.ones(6))
    include = ref.avg_pool2d_forward(x, k, s, p, True, True, 0)
    np.testing.assert_allclose(include, along([2 / 3, 1, 1, 1 / 2]), rtol=1e-15)
    np.testing.assert_allclose(ref.avg_pool2d_forward(x, k, s, p, True, False, 0), along([1, 1, 1, 1]), rtol=1e-15)
    g = along(np.ones(4))
    np.testing.assert_allclose(
        ref.avg_pool2d_backward(g, x.shape, k, s, p, True, True, 0),
        along([1 / 3, 2 / 3, 1 / 3, 2 / 3, 1 / 3, 1 / 3 + 1 / 2]),
        rtol=1e-15,
    )
    np.testing.assert_allclose(
        ref.avg_pool2d_backward(g, x.shape, k, s, p, True, False, 0),
        along([1 / 2, 1 / 2 + 1 / 3, 1 / 3, 2 / 3, 1 / 3, 1 / 3 + 1]),
        rtol=1e-15,
    )


def test_avg_pool_output_size_values():
    f = ref.avg_pool2d_output_size
    assert f(5, 2, 2, 0, False) == 2
    assert f(5, 2, 2, 0, True) == 3
    assert f(56, 3, 2, 1, False) == 28
    assert f(7, 7, 1, 0, False) == 1
    assert f(4, 2, 2, 1, True) == 3
    # ceil_mode: the last window would start in the right padding -> dropped
    assert f(5, 3, 3, 1, True) == 2
    assert f(6, 3, 3, 1, True) == 3


def test_avg_pool_forward_hand_values():
    x = np.arange(1, 10, dtype=np.float64).reshape(1, 1, 3, 3)
    # k2 s1 p1: corner window holds only x[0,0]; include_pad divides by 4, exclude by 1
    inc = ref.avg_pool2d_forward(x, (2, 2), (1, 1), (1, 1), False, True, 0)
    exc = ref.avg_pool2d_forward(x, (2, 2), (1, 1), (1, 1), False, False, 0)
    assert inc[0, 0, 0, 0] == 1 / 4 and exc[0, 0, 0, 0] == 1.0
    assert inc[0, 0, 1, 1] == (1 + 2 + 4 + 5) / 4 == exc[0, 0, 1, 1]
    ovr = ref.avg_pool2d_forward(x, (2, 2), (1, 1), (1, 1), False, True, -2)
    assert ovr[0, 0, 1, 1] == -(1 + 2 + 4 + 5) / 2


# ---------------------------------------------------------------------------------------------
# roi align (docs/semantics.md §4)
# ---------------------------------------------------------------------------------------------


def _random_boxes(rng, K, B, H, W, spatial_scale, spread=1.5):
    """Boxes in image coordinates, some partly/fully outside the feature map."""
    Hi, Wi = H / spatial_scale, W / spatial_scale
    b = rng.integers(0, B, size=K).astype(np.float64) + rng.uniform(0, 0.9, size=K)
    x1 = rng.uniform(-0.3 * Wi, spread * Wi * 0.7, size=K)
    y1 = rng.uniform(-0.3 * Hi, spread * Hi * 0.7, size=K)
    x2 = x1 + rng.uniform(0, 0.8 * Wi, size=K)
    y2 = y1 + rng.uniform(0, 0.8 * Hi, size=K)
    return np.stack([b, x1, y1, x2, y2], axis=1)


ROI_CASES = [
    # (input (B, C, H, W), PH, PW, spatial_scale, sampling_ratio)
    ((2, 3, 9, 11), 3, 2, 0.5, 2),
    ((2, 3, 9, 11), 2, 3, 0.5, 0),
    ((1, 2, 6, 5), 4, 3, 1.0, 0),
    ((3, 2, 7, 8), 2, 2, 0.25, 1),
    ((1, 1, 4, 4), 1, 1, 1.0, 3),
]


@pytest.mark.parametrize("case", ROI_CASES)
@pytest.mark.parametrize("aligned", [False, True])
def test_roi_align_adjoint(case, aligned):
    shape, PH, PW, scale, sr = case
    B, C, H, W = shape
    rng = rng_for("roi", case, aligned)
    boxes = _random_boxes(rng, 6, B, H, W, scale)
    # degenerate / bad boxes: reversed (roi < 0 when aligned), NaN, Inf, batch out of range
    # (negative, fractional negative, >= B), a zero-size box
    extra = np.array(
        [
            [0, 6.0, 6.0, 2.0, 3.0],
            [0, np.nan, 1.0, 3.0, 3.0],
            [0, 1.0, 1.0, np.inf, 3.0],
            [np.nan, 1.0, 1.0, 3.0, 3.0],
            [-1, 1.0, 1.0, 3.0, 3.0],
            [-0.5, 1.0, 1.0, 3.0, 3.0],
            [B, 1.0, 1.0, 3.0, 3.0],
            [0, 2.0, 2.0, 2.0, 2.0],
        ]
    )
    boxes = np.concatenate([boxes, extra])
    x = rng.standard_normal(shape)
    fx = ref.roi_align_forward(x, boxes, PH, PW, scale, sr, aligned)
    assert fx.shape == (boxes.shape[0], C, PH, PW)
    assert np.isfinite(fx).all()
    assert (fx[7:13] == 0).all()  # NaN/Inf/out-of-range boxes give 0
    g = rng.standard_normal(fx.shape)
    bg = ref.roi_align_backward(g, boxes, shape, PH, PW, scale, sr, aligned)
    assert bg.shape == shape
    assert_adjoint(fx, g, x, bg)
    # the bad boxes contribute nothing to the backward
    g_bad = np.zeros_like(g)
    g_bad[7:13] = 1.0
    assert (ref.roi_align_backward(g_bad, boxes, shape, PH, PW, scale, sr, aligned) == 0).all()


def test_roi_align_sample_on_pixel_center():
    # not aligned, scale 1, 1x1 bin, 1 sample: x = x1 + 0.5*roi_w = 3, y = y1 + 0.5*roi_h = 2
    boxes = np.array([[1.0, 2.0, 1.0, 4.0, 3.0]])
    g = np.array([[[[1.5]], [[-2.0]]]])  # (K=1, C=2, 1, 1)
    out = ref.roi_align_backward(g, boxes, (2, 2, 5, 6), 1, 1, 1.0, 1, False)
    expected = np.zeros((2, 2, 5, 6))
    expected[1, 0, 2, 3] = 1.5
    expected[1, 1, 2, 3] = -2.0
    np.testing.assert_array_equal(out, expected)
    x = rng_for("pc").standard_normal((2, 2, 5, 6))
    fwd = ref.roi_align_forward(x, boxes, 1, 1, 1.0, 1, False)
    np.testing.assert_array_equal(fwd[0, :, 0, 0], x[1, :, 2, 3])
    # aligned: the same pixel is reached with the box shifted by half a pixel
    out_al = ref.roi_align_backward(g, boxes + [0, 0.5, 0.5, 0.5, 0.5], (2, 2, 5, 6), 1, 1, 1.0, 1, True)
    np.testing.assert_array_equal(out_al, expected)


def test_roi_align_hand_bilinear_and_edges():
    shape = (1, 1, 4, 5)
    g = np.ones((1, 1, 1, 1))
    # sample at y = 1.25, x = 2.5 (aligned, box centre (3.0, 1.75) + 0.5 offset)
    boxes = np.array([[0, 2.5, 1.25, 3.5, 2.25]])  # aligned: x1=2, y1=0.75, roi 1x1
    out = ref.roi_align_backward(g, boxes, shape, 1, 1, 1.0, 1, True)[0, 0]
    expected = np.zeros((4, 5))
    expected[1, 2] = 0.75 * 0.5
    expected[1, 3] = 0.75 * 0.5
    expected[2, 2] = 0.25 * 0.5
    expected[2, 3] = 0.25 * 0.5
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-15)
    # sample at y = 3.5 (in (H-1, H]): clamped to the last row; x = -0.5 clamped to 0
    boxes = np.array([[0, -1.0, 3.0, 0.0, 4.0]])  # not aligned: roi 1x1, sample (3.5, -0.5)
    out = ref.roi_align_backward(g, boxes, shape, 1, 1, 1.0, 1, False)[0, 0]
    expected = np.zeros((4, 5))
    expected[3, 0] = 1.0
    np.testing.assert_array_equal(out, expected)
    # sample beyond y > H: skipped
    boxes = np.array([[0, 0.0, 4.2, 1.0, 5.2]])
    assert (ref.roi_align_backward(g, boxes, shape, 1, 1, 1.0, 1, False) == 0).all()
    # 2x2 samples, count 4: each sample gets g/4
    boxes = np.array([[0, 0.5, 0.5, 2.5, 2.5]])  # not aligned: samples at 1.0 and 2.0
    out = ref.roi_align_backward(g, boxes, shape, 1, 1, 1.0, 2, False)[0, 0]
    expected = np.zeros((4, 5))
    expected[1:3, 1:3] = 0.25
    np.testing.assert_array_equal(out, expected)
    # adaptive grid with roi_h <= 0 (aligned, reversed box): no samples
    boxes = np.array([[0, 3.0, 3.0, 1.0, 1.0]])
    assert (ref.roi_align_backward(g, boxes, shape, 1, 1, 1.0, 0, True) == 0).all()


def test_roi_align_exact_axis_weights_equal_the_sample_loop(monkeypatch):
    # The rational (grouped by pixel) evaluation of the per-axis weights against visiting every
    # sample, and the product form against the per-sample 2-D docs/semantics.md loop.
    shape = (1, 2, 6, 7)
    rng = rng_for("narrow")
    boxes = np.array(
        [
            [0, -30.0, -20.0, 40.0, 35.0],
            [0, -3.0, 2.0, 9.0, 5.5],
            [0, 1.0, -50.0, 3.0, 2.0],
            [0, -1.7, -1.2, 7.9, 6.3],
            [0, 5.0, 4.0, 2.0, 1.0],  # reversed: negative bins when aligned
        ]
    )
    g = rng.standard_normal((5, 2, 3, 2))
    for ratio, aligned in ((0, True), (7, True), (5, False), (40, True)):
        full = ref.roi_align_backward(g, boxes, shape, 3, 2, 1.0, ratio, aligned)
        by_samples = ref.roi_align_backward_by_samples(g, boxes, shape, 3, 2, 1.0, ratio, aligned)
        np.testing.assert_allclose(full, by_samples, rtol=1e-12, atol=1e-14)
        with monkeypatch.context() as m:
            m.setattr(ref, "_ROI_FULL_LOOP_MAX", 0)
            exact = ref.roi_align_backward(g, boxes, shape, 3, 2, 1.0, ratio, aligned)
        np.testing.assert_allclose(exact, full, rtol=1e-12, atol=1e-14)
        x = rng.standard_normal(shape)
        fx = ref.roi_align_forward(x, boxes, 3, 2, 1.0, ratio, aligned)
        assert_adjoint(fx, g, x, full)
    # the touched masks agree too (a zero weight still touches its pixel)
    for args in [
        (0.3, 2.5, 5, 4),
        (-1.7, 3.1, 7, 3),
        (-0.9, 10.0, 3, 1),
        (2.2, -1.5, 4, 5),
        (3.0, 0.0, 3, 5),
        (-2.5, 6.0, 11, 4),
        (1.0, 2.0, 2, 4),
    ]:
        w1, t1 = ref._roi_axis_by_samples(*args)
        w2, t2 = ref._roi_axis_exact(*args)
        np.testing.assert_allclose(w2, w1, rtol=0, atol=1e-14)
        np.testing.assert_array_equal(t1, t2)


def test_roi_align_axis_weights_huge_grid():
    # 2^31 - 1 samples over pixels [1.5, 3.5): the sums approach the integral of the hat
    # functions (per sample: 1/grid of the bin), total = grid; pixel 1 gets 1/16 of the weight.
    grid = 2**31 - 1
    weights, touched = ref.roi_align_axis_weights(1.5, 2.0, grid, 6)
    assert touched.tolist() == [False, True, True, True, True, False]
    np.testing.assert_allclose(weights / grid, [0, 0.0625, 0.4375, 0.4375, 0.0625, 0], rtol=1e-9, atol=1e-12)
    assert weights.sum() == grid


def test_roi_align_huge_box_is_fast_and_finite():
    shape = (1, 1, 6, 7)
    boxes = np.array([[0, -1e6, -2e6, 3e6, 1e6], [0, -1e300, -1e300, 1e300, 1e300], [0, 0.0, 0.0, 1e308, 1e308]])
    g = np.ones((3, 1, 2, 2))
    out = ref.roi_align_backward(g, boxes, shape, 2, 2, 10.0, 0, False)
    assert np.isfinite(out).all()
    assert out.sum() > 0  # the first box does reach the image
    x = rng_for("huge").standard_normal(shape)
    fx = ref.roi_align_forward(x, boxes, 2, 2, 10.0, 0, False)
    assert_adjoint(fx, g, x, out)


# ---------------------------------------------------------------------------------------------
# group norm + swish (docs/semantics.md §5)
# ---------------------------------------------------------------------------------------------

GN_CASES = [
    # (x shape, num_groups)
    ((2, 6, 2, 3), 3),
    ((3, 4), 2),
    ((1, 4, 5), 1),
    ((2, 4, 1, 2, 2), 4),
]
SWISH_SCALES = [1.0, -0.75, 0.0, 2.5]


def _gn_inputs(shape, seed):
    rng = rng_for("gn", shape, seed)
    C = shape[1]
    x = rng.standard_normal(shape) * 1.5 + 0.3
    gamma = rng.standard_normal(C)
    beta = rng.standard_normal(C)
    dy = rng.standard_normal(shape)
    return x, gamma, beta, dy


@pytest.mark.covering
@pytest.mark.parametrize("case", GN_CASES)
@pytest.mark.parametrize("s", SWISH_SCALES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_norm_swish_finite_differences(case, s, seed):
    shape, G = case
    x, gamma, beta, dy = _gn_inputs(shape, seed)
    eps = 1e-5

    def loss(x_, gamma_, beta_):
        out, _, _ = ref.group_norm_swish_forward(x_, gamma_, beta_, G, eps, s)
        return np.sum(out * dy)

    def fd(arr, which):
        h = 1e-6
        grad = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            args = [x, gamma, beta]
            plus = arr.copy()
            plus[idx] += h
            minus = arr.copy()
            minus[idx] -= h
            args[which] = plus
            lp = loss(*args)
            args[which] = minus
            lm = loss(*args)
            grad[idx] = (lp - lm) / (2 * h)
        return grad

    out, mean, rstd = ref.group_norm_swish_forward(x, gamma, beta, G, eps, s)
    assert mean.shape == rstd.shape == (shape[0], G)
    dx, dgamma, dbeta = ref.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, G, s)
    assert dx.shape == shape and dgamma.shape == dbeta.shape == (shape[1],)
    np.testing.assert_allclose(dx, fd(x, 0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dgamma, fd(gamma, 1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dbeta, fd(beta, 2), rtol=1e-5, atol=1e-7)
    # flat (N*G,) mean/rstd give the same result
    flat = ref.group_norm_swish_backward(dy, mean.ravel(), rstd.ravel(), x, gamma, beta, G, s)
    for a, b in zip(flat, (dx, dgamma, dbeta)):
        np.testing.assert_array_equal(a, b)


def test_group_norm_swish_forward_hand_values():
    x = np.array([[1.0, 3.0, 5.0, 7.0]])  # N=1, C=4, G=2
    out, mean, rstd = ref.group_norm_swish_forward(x, np.ones(4), np.zeros(4), 2, eps=0.0, swish_scale=0.0)
    np.testing.assert_array_equal(mean, [[2.0, 6.0]])
    np.testing.assert_array_equal(rstd, [[1.0, 1.0]])
    np.testing.assert_array_equal(out, [[-0.5, 0.5, -0.5, 0.5]])  # y * sigmoid(0) = y/2


def test_group_norm_swish_large_scale_is_finite():
    x, gamma, beta, dy = _gn_inputs((2, 4, 3), 7)
    for s in (1e4, -1e4):
        out, mean, rstd = ref.group_norm_swish_forward(x, gamma * 50, beta, 2, 1e-5, s)
        res = ref.group_norm_swish_backward(dy, mean, rstd, x, gamma * 50, beta, 2, s)
        assert np.isfinite(out).all()
        assert all(np.isfinite(r).all() for r in res)


# ---------------------------------------------------------------------------------------------
# cross-checks against PyTorch (float64), skipped without torch
# ---------------------------------------------------------------------------------------------


def _t(a):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(np.ascontiguousarray(a))


@pytest.mark.parametrize("shape,padding", PAD_CASES)
@pytest.mark.parametrize("complex_", [False, True])
def test_pad_vs_torch(shape, padding, complex_):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    rng = rng_for("tpad", shape, padding, complex_)
    x = randn(rng, shape, complex_)
    fx = ref.replication_pad2d_forward(x, padding)
    np.testing.assert_array_equal(F.pad(_t(x), padding, mode="replicate").numpy(), fx)
    g = randn(rng, fx.shape, complex_)
    expected = torch.ops.aten.replication_pad2d_backward(_t(g), _t(x), list(padding)).numpy()
    np.testing.assert_allclose(ref.replication_pad2d_backward(g, shape, padding), expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("case", UP_CASES)
@pytest.mark.parametrize("align_corners", [False, True])
def test_upsample_vs_torch(case, align_corners):
    torch = pytest.importorskip("torch")
    in_shape, out_size, sh, sw = case
    rng = rng_for("tup", case, align_corners)
    x = rng.standard_normal(in_shape)
    g = rng.standard_normal(in_shape[:2] + out_size)
    th = sh if sh > 0 else None
    tw = sw if sw > 0 else None
    fwd = torch.ops.aten.upsample_bilinear2d(_t(x), list(out_size), align_corners, th, tw)
    np.testing.assert_allclose(
        ref.upsample_bilinear2d_forward(x, out_size, align_corners, sh, sw), fwd.numpy(), rtol=1e-13, atol=1e-13
    )
    bwd = torch.ops.aten.upsample_bilinear2d_backward(_t(g), list(out_size), list(in_shape), align_corners, th, tw)
    np.testing.assert_allclose(
        ref.upsample_bilinear2d_backward(g, out_size, in_shape, align_corners, sh, sw),
        bwd.numpy(),
        rtol=1e-13,
        atol=1e-13,
    )


@pytest.mark.covering
@pytest.mark.parametrize("geom", POOL_GEOMS)
@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("count_include_pad", [False, True])
@pytest.mark.parametrize("divisor_override", [0, 5, -3])
def test_avg_pool_vs_torch(geom, ceil_mode, count_include_pad, divisor_override):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    shape, k, s, p = geom
    rng = rng_for("tpool", geom, ceil_mode, count_include_pad, divisor_override)
    x = rng.standard_normal(shape)
    dov = divisor_override or None
    tf = F.avg_pool2d(_t(x), k, s, p, ceil_mode, count_include_pad, dov)
    fx = ref.avg_pool2d_forward(x, k, s, p, ceil_mode, count_include_pad, divisor_override)
    assert fx.shape == tuple(tf.shape)
    np.testing.assert_allclose(fx, tf.numpy(), rtol=1e-13, atol=1e-13)
    g = rng.standard_normal(fx.shape)
    tb = torch.ops.aten.avg_pool2d_backward(_t(g), _t(x), list(k), list(s), list(p), ceil_mode, count_include_pad, dov)
    np.testing.assert_allclose(
        ref.avg_pool2d_backward(g, shape, k, s, p, ceil_mode, count_include_pad, divisor_override),
        tb.numpy(),
        rtol=1e-13,
        atol=1e-13,
    )


@pytest.mark.parametrize("case", GN_CASES)
@pytest.mark.parametrize("s", SWISH_SCALES)
def test_group_norm_swish_vs_torch(case, s):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    shape, G = case
    x, gamma, beta, dy = _gn_inputs(shape, 11)
    eps = 1e-5
    out, mean, rstd = ref.group_norm_swish_forward(x, gamma, beta, G, eps, s)
    N, C = shape[:2]
    HxW = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    _, tmean, trstd = torch.ops.aten.native_group_norm(_t(x), _t(gamma), _t(beta), N, C, HxW, G, eps)
    np.testing.assert_allclose(mean, tmean.numpy(), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(rstd, trstd.numpy(), rtol=1e-12)

    tx = _t(x).requires_grad_(True)
    tg = _t(gamma).requires_grad_(True)
    tb = _t(beta).requires_grad_(True)
    y = F.group_norm(tx, G, tg, tb, eps)
    tout = y * torch.sigmoid(s * y)
    tout.backward(_t(dy))
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=1e-13, atol=1e-14)
    dx, dgamma, dbeta = ref.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, G, s)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dgamma, tg.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dbeta, tb.grad.numpy(), rtol=1e-10, atol=1e-12)
