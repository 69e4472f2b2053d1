"""fastbwd.upsample_bilinear2d_backward against the docs/semantics.md §1 float64 reference (and PyTorch)."""

import numpy as np
import pytest

import fastbwd
from fastbwd.testing import reference as ref
from fastbwd.testing.checks import assert_matches_reference, bitwise_equal

from _covering import float32_quick
from conftest import BF16, DTYPES, nan_cells_are_the_positive_nan, raises_param_error, random, to_nhwc, with_signed_nan

F = fastbwd.upsample_bilinear2d_backward


def grad_for(rng, input_size, output_size, dtype=np.float32):
    n, c = input_size[:2]
    return rng.standard_normal((n, c) + tuple(output_size)).astype(dtype)


def check(grad, output_size, input_size, align_corners, scales_h=0.0, scales_w=0.0, **kwargs):
    """Compare with the float64 reference (whose weights follow docs/semantics.md §1's opmath rule, as the
    kernel's do: the default tolerance, 1 ulp for the half formats)."""
    result = F(grad, output_size, input_size, align_corners, scales_h, scales_w, **kwargs)
    expected = ref.upsample_bilinear2d_backward(
        np.asarray(grad), output_size, input_size, align_corners, scales_h, scales_w
    )
    assert_matches_reference(result, expected)
    return result


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("dtype", float32_quick([np.float32, np.float64]))
def test_matches_reference_non_square(align_corners, dtype):
    rng = np.random.default_rng(0)
    for input_size, output_size in [
        ((2, 3, 5, 7), (11, 4)),
        ((1, 2, 9, 6), (9, 13)),
        ((3, 1, 17, 12), (40, 25)),
        ((1, 1, 30, 1), (7, 3)),
    ]:
        check(grad_for(rng, input_size, output_size, dtype), output_size, input_size, align_corners)


def test_scales_per_axis_and_identity_with_scale():
    rng = np.random.default_rng(1)
    # Different user scales per axis (not consistent with the sizes: used as given).
    grad = grad_for(rng, (2, 2, 6, 7), (13, 9))
    check(grad, (13, 9), (2, 2, 6, 7), False, 2.5, 1.5)
    check(grad, (13, 9), (2, 2, 6, 7), False, None, 0.7)
    # align_corners ignores the scales.
    assert bitwise_equal(F(grad, (13, 9), (2, 2, 6, 7), True, 2.5, 1.5), F(grad, (13, 9), (2, 2, 6, 7), True))
    # OH == H: PyTorch's identity shortcut whatever the scale; W still interpolates.
    grad = grad_for(rng, (1, 2, 8, 5), (8, 10))
    result = check(grad, (8, 10), (1, 2, 8, 5), False, 3.0, 3.0)
    assert bitwise_equal(result, F(grad, (8, 10), (1, 2, 8, 5), False, 0.0, 3.0))


@pytest.mark.parametrize("unset", [-2.0, -0.5, -1e-30, float("nan"), float("-inf")], ids=repr)
@pytest.mark.parametrize("dtype", float32_quick([np.float32, np.float64, BF16]), ids=str)
def test_negative_and_nan_scales_mean_unset(unset, dtype):
    # docs/semantics.md §1: "scale = 1 / scales_h if scales_h > 0 else H / OH": a negative or NaN scale is
    # unset (NaN > 0 is False), exactly like 0 or None, on each axis independently. Sizes that
    # differ on both axes, so that a scale that were used would move the weights.
    rng = np.random.default_rng(11)
    input_size, output_size = (2, 3, 6, 9), (13, 5)
    grad = grad_for(rng, input_size, output_size, dtype)
    unset_both = F(grad, output_size, input_size, False, None, None)
    expected = ref.upsample_bilinear2d_backward(grad, output_size, input_size, False, 0.0, 0.0)
    assert_matches_reference(unset_both, expected)
    assert bitwise_equal(F(grad, output_size, input_size, False, unset, unset), unset_both)
    # one axis unset, the other set: the set one must still apply
    h_unset = F(grad, output_size, input_size, False, unset, 1.7)
    assert_matches_reference(h_unset, ref.upsample_bilinear2d_backward(grad, output_size, input_size, False, 0.0, 1.7))
    w_unset = F(grad, output_size, input_size, False, 2.5, unset)
    assert_matches_reference(w_unset, ref.upsample_bilinear2d_backward(grad, output_size, input_size, False, 2.5, 0.0))
    assert not bitwise_equal(h_unset, unset_both) and not bitwise_equal(w_unset, unset_both)
    # NHWC reads the same tables
    nhwc = F(
        np.ascontiguousarray(grad.transpose(0, 2, 3, 1)), output_size, input_size, False, unset, unset, layout="NHWC"
    )
    assert bitwise_equal(np.ascontiguousarray(nhwc.transpose(0, 3, 1, 2)), unset_both)


@pytest.mark.parametrize("dtype", float32_quick([np.float32, np.float64]), ids=str)
def test_tiny_scales_put_everything_on_the_last_row(dtype):
    # scales far below out/in send every source position past the last input row: lambda1 is
    # clamped to 1 there (docs/semantics.md §1: min(max(src - h0, 0), 1)), so the last row and column receive
    # the whole gradient, exactly as summed in order. Unclamped, lambda0 = 1 - lambda1 would be
    # a huge negative weight cancelling a huge positive one.
    rng = np.random.default_rng(13)
    input_size, output_size = (1, 2, 4, 5), (9, 7)
    grad = grad_for(rng, input_size, output_size, dtype)
    for scales in [(1e-3, 1e-3), (1e-30, 0.0), (0.0, 1e-12)]:
        result = check(grad, output_size, input_size, False, *scales)
        if scales[0] and scales[1]:
            assert np.count_nonzero(result[:, :, :-1, :]) == np.count_nonzero(result[:, :, :, :-1]) == 0
            np.testing.assert_allclose(result[:, :, -1, -1], grad.sum(axis=(2, 3), dtype=np.float64), rtol=1e-5)


def test_negative_scale_matches_torch():
    # ATen treats a scale that is not > 0 as absent too (area_pixel_compute_scale).
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    grad = grad_for(rng, (1, 2, 6, 9), (13, 5), np.float64)
    expected = torch.ops.aten.upsample_bilinear2d_backward(
        torch.from_numpy(grad), [13, 5], [1, 2, 6, 9], False, -2.0, -0.5
    ).numpy()
    np.testing.assert_allclose(F(grad, (13, 5), (1, 2, 6, 9), False, -2.0, -0.5), expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("align_corners", [False, True])
def test_size_one_axes(align_corners):
    rng = np.random.default_rng(2)
    for input_size, output_size in [
        ((1, 2, 5, 4), (1, 1)),
        ((1, 2, 1, 1), (6, 3)),
        ((1, 1, 1, 7), (1, 3)),
        ((2, 1, 4, 1), (1, 5)),
    ]:
        check(grad_for(rng, input_size, output_size), output_size, input_size, align_corners)


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("axis", ["h", "w"])
def test_partition_of_unity(align_corners, axis):
    # All-ones gradient: every output cell spreads exactly 1 over its inputs.
    for size, out_size in [(1, 9), (9, 1), (2, 10), (3, 24), (8, 200), (200, 8)]:
        input_size = (1, 2, size, 3) if axis == "h" else (1, 2, 3, size)
        output_size = (out_size, 4) if axis == "h" else (4, out_size)
        grad = np.ones((1, 2) + output_size, np.float64)
        total = F(grad, output_size, input_size, align_corners).sum()
        assert total == pytest.approx(grad.sum(), rel=1e-12)


def test_adjoint_identity():
    rng = np.random.default_rng(3)
    for align_corners, scales in [(False, (0.0, 0.0)), (True, (0.0, 0.0)), (False, (1.7, 0.4))]:
        input_size, output_size = (2, 3, 7, 10), (12, 6)
        x = rng.standard_normal(input_size)
        grad = rng.standard_normal((2, 3) + output_size)
        forward = ref.upsample_bilinear2d_forward(x, output_size, align_corners, *scales)
        backward = F(grad, output_size, input_size, align_corners, *scales)
        assert np.vdot(forward, grad) == pytest.approx(np.vdot(x, backward), rel=1e-12)


@pytest.mark.parametrize("dtype", float32_quick([np.float16, BF16], BF16))
def test_half_formats_within_one_ulp(dtype):
    rng = np.random.default_rng(4)
    input_size, output_size = (2, 3, 6, 9), (13, 17)
    grad = grad_for(rng, input_size, output_size, dtype)
    for align_corners in (False, True):
        result = check(grad, output_size, input_size, align_corners)
        assert result.dtype == dtype
        nhwc = F(
            np.ascontiguousarray(grad.transpose(0, 2, 3, 1)), output_size, input_size, align_corners, layout="NHWC"
        )
        assert bitwise_equal(nhwc, np.ascontiguousarray(result.transpose(0, 2, 3, 1)))


def test_layouts_bitwise_equal():
    rng = np.random.default_rng(5)
    input_size, output_size = (2, 5, 7, 6), (15, 11)
    grad = grad_for(rng, input_size, output_size)
    nchw = F(grad, output_size, input_size, False)
    nhwc_grad = np.ascontiguousarray(grad.transpose(0, 2, 3, 1))
    nhwc = F(nhwc_grad, output_size, input_size, False, layout="NHWC")
    assert nhwc.shape == (2, 7, 6, 5) and nhwc.flags.c_contiguous
    assert bitwise_equal(nhwc, np.ascontiguousarray(nchw.transpose(0, 2, 3, 1)))
    # NCHW-shaped with channels-last strides: no copy of the input, channels-last result.
    channels_last = nhwc_grad.transpose(0, 3, 1, 2)
    result = F(channels_last, output_size, input_size, False)
    assert result.shape == nchw.shape and result.transpose(0, 2, 3, 1).flags.c_contiguous
    assert bitwise_equal(result, nchw)
    out = np.empty((2, 7, 6, 5), np.float32).transpose(0, 3, 1, 2)
    assert F(channels_last, output_size, input_size, False, out=out) is out
    assert bitwise_equal(out, nchw)


@pytest.mark.parametrize("align_corners", [False, True])
def test_integer_ratios_vectorised_rows_equal_reference_and_nhwc(align_corners):
    # W ratios 2x, 3x, 4x, 1/2 and 1: the NCHW row pass vectorises the affine interior of the
    # W table; NHWC sums every entry one by one. Both must agree bitwise, Inf/NaN included.
    rng = np.random.default_rng(9)
    for width, out_width in [(20, 40), (33, 99), (16, 64), (40, 20), (24, 24), (17, 35)]:
        input_size, output_size = (1, 3, 5, width), (7, out_width)
        grad = grad_for(rng, input_size, output_size)
        grad[0, 1, 3, out_width // 2] = np.inf
        grad[0, 2, 2, out_width // 3] = np.nan
        nchw = F(grad, output_size, input_size, align_corners)
        nhwc = F(
            np.ascontiguousarray(grad.transpose(0, 2, 3, 1)), output_size, input_size, align_corners, layout="NHWC"
        )
        assert bitwise_equal(nhwc, np.ascontiguousarray(nchw.transpose(0, 2, 3, 1)))
        check(grad[:, :1], output_size, (1, 1, 5, width), align_corners)


@pytest.mark.parametrize("dtype", float32_quick([np.float32, np.float64, BF16]), ids=str)
@pytest.mark.parametrize("align_corners", [False, True])
def test_many_small_planes_run_as_lanes(dtype, align_corners):
    # >= 128 planes with grad rows narrower than 16: the engine runs 16 planes at a time as
    # vector lanes (a path of its own); 150 planes leave a partial last group of 6.
    rng = np.random.default_rng(14)
    for input_size, output_size in [((2, 75, 5, 6), (9, 11)), ((1, 150, 7, 3), (4, 13)), ((3, 50, 1, 9), (6, 5))]:
        grad = grad_for(rng, input_size, output_size, dtype)
        result = check(grad, output_size, input_size, align_corners, 0.0, 1.3 if not align_corners else 0.0)
        nhwc = F(
            np.ascontiguousarray(grad.transpose(0, 2, 3, 1)),
            output_size,
            input_size,
            align_corners,
            0.0,
            1.3 if not align_corners else 0.0,
            layout="NHWC",
        )
        assert bitwise_equal(np.ascontiguousarray(nhwc.transpose(0, 3, 1, 2)), result)


def test_strides_lists_and_no_mutation():
    rng = np.random.default_rng(6)
    input_size, output_size = (1, 2, 33, 20), (70, 41)  # few planes: blocks of rows
    grad = grad_for(rng, input_size, output_size)
    copy = grad.copy()
    assert bitwise_equal(grad, copy)
    expected = F(grad, output_size, input_size, False)
    flipped = grad[:, ::-1, ::-1, ::-1].copy()[:, ::-1, ::-1, ::-1]  # negative strides, same values
    assert bitwise_equal(F(flipped, output_size, input_size, False), expected)
    wide = np.zeros((1, 4, 70, 82), np.float32)
    wide[:, ::2, :, ::2] = grad
    assert bitwise_equal(F(wide[:, ::2, :, ::2], output_size, input_size, False), expected)
    as_float64 = F(grad.astype(np.float64), output_size, input_size, False)
    assert bitwise_equal(F(grad.tolist(), output_size, input_size, False), as_float64)


def test_empty_batch_or_channels():
    for input_size in [(0, 3, 4, 5), (2, 0, 4, 5)]:
        grad = np.zeros(input_size[:2] + (6, 7), BF16)
        result = F(grad, (6, 7), input_size, True)
        assert result.shape == input_size and result.dtype == BF16
        nhwc = F(np.zeros((input_size[0], 6, 7, input_size[1]), np.float32), (6, 7), input_size, False, layout="NHWC")
        assert nhwc.shape == (input_size[0], 4, 5, input_size[1])


def test_nan_and_inf_propagate_like_torch():
    torch = pytest.importorskip("torch")
    grad = np.ones((1, 1, 6, 8), np.float32)
    grad[0, 0, 2, 3] = np.inf
    grad[0, 0, 5, 0] = np.nan
    for input_size, align_corners in [((1, 1, 3, 4), False), ((1, 1, 6, 5), True)]:
        result = F(grad, (6, 8), input_size, align_corners)
        expected = torch.ops.aten.upsample_bilinear2d_backward(
            torch.from_numpy(grad), [6, 8], list(input_size), align_corners, None, None
        ).numpy()
        assert np.array_equal(np.isnan(result), np.isnan(expected))
        assert np.array_equal(np.isinf(result), np.isinf(expected))


@pytest.mark.parametrize("dtype", float32_quick(["float32", "float64", "bfloat16"]))
def test_torch_cross_check(dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    cases = [
        ((2, 3, 10, 14), (17, 31), False, None, None),
        ((2, 3, 10, 14), (17, 31), True, None, None),
        ((1, 2, 100, 7), (173, 7), False, None, None),
        ((1, 2, 9, 12), (20, 5), False, 2.3, 0.45),
        ((1, 2, 16, 16), (8, 8), False, None, None),
    ]
    for input_size, output_size, align_corners, scales_h, scales_w in cases:
        grad = grad_for(rng, input_size, output_size, np.float32)
        tgrad = torch.from_numpy(grad).to(getattr(torch, dtype))
        expected = (
            torch.ops.aten.upsample_bilinear2d_backward(
                tgrad, list(output_size), list(input_size), align_corners, scales_h, scales_w
            )
            .float()
            .numpy()
        )
        result = F(tgrad, output_size, input_size, align_corners, scales_h, scales_w)
        scale = np.abs(expected).max()
        if dtype == "bfloat16":  # both round once from float32 sums: at most 1 ulp apart
            assert np.allclose(result.astype(np.float32), expected, rtol=2**-7, atol=1e-6 * scale)
        else:
            np.testing.assert_allclose(result, expected, rtol=1e-5, atol=2e-6 * scale)


G = np.zeros((1, 2, 6, 8), np.float32)


@pytest.mark.parametrize(
    "call, match, param, status",
    [
        (lambda: F(None, (6, 8), (1, 2, 3, 4)), "grad_output is required", "grad_output", 161001),
        (lambda: F(G, None, (1, 2, 3, 4)), "output_size is required", "output_size", 161001),
        (lambda: F(G, (6, 8), None), "input_size is required", "input_size", 161001),
        (lambda: F(G[0], (6, 8), (1, 2, 3, 4)), "grad_output must be 4-D, but got 3-D", "grad_output", 161002),
        (lambda: F(G, (6, 8, 1), (1, 2, 3, 4)), "output_size must have length 2", "output_size", 161002),
        (lambda: F(G, (6, 8), (2, 3, 4)), "input_size must have length 4", "input_size", 161002),
        (lambda: F(G, (6, 8.0), (1, 2, 3, 4)), r"output_size\[1\] must be an integer", "output_size", 161002),
        (lambda: F(G, (0, 8), (1, 2, 3, 4)), r"output_size\[0\] must be > 0, but got 0", "output_size", 161002),
        (lambda: F(G, (6, -1), (1, 2, 3, 4)), r"output_size\[1\] must be > 0", "output_size", 161002),
        (lambda: F(G, (6, 8), (1, 2, 0, 4)), r"input_size\[2\] must be > 0", "input_size", 161002),
        (lambda: F(G, (6, 8), (1, 2, 3, -4)), r"input_size\[3\] must be > 0", "input_size", 161002),
        (lambda: F(G, (6, 8), (1, -2, 3, 4)), r"input_size\[1\] must be >= 0", "input_size", 161002),
        (
            lambda: F(G, (6, 8), (1, 2, 3, 2**20 + 1)),
            r"input_size\.shape\[3\] must be at most 1048576",
            "input_size",
            161002,
        ),
        (
            lambda: F(np.broadcast_to(np.float32(0), (1, 1, 1, 2**20 + 1)), (1, 2**20 + 1), (1, 1, 1, 4)),
            r"grad_output\.shape\[3\] must be at most 1048576",
            "grad_output",
            161002,
        ),
        (lambda: F(G, (6, 7), (1, 2, 3, 4)), r"grad_output\.shape must be \(1, 2, 6, 7\)", "grad_output", 161002),
        (lambda: F(G, (6, 8), (1, 3, 3, 4)), r"grad_output\.shape must be \(1, 3, 6, 8\)", "grad_output", 161002),
        (
            lambda: F(G, (6, 8), (1, 2, 3, 4), layout="NHWC"),
            r"grad_output\.shape must be \(1, 6, 8, 2\)",
            "grad_output",
            161002,
        ),
        (
            lambda: F(G.astype(np.int32), (6, 8), (1, 2, 3, 4)),
            r"grad_output\.dtype must be one of float32",
            "grad_output",
            161002,
        ),
        (
            lambda: F(G.astype(np.complex64), (6, 8), (1, 2, 3, 4)),
            r"grad_output\.dtype must be one of",
            "grad_output",
            161002,
        ),
        (lambda: F(G, (6, 8), (1, 2, 3, 4), layout="nchw"), "layout must be one of 'NCHW', 'NHWC'", "layout", 161002),
        (lambda: F(G, (6, 8), (1, 2, 3, 4), 1), "align_corners must be a bool", "align_corners", 161002),
        (lambda: F(G, (6, 8), (1, 2, 3, 4), False, "2"), "scales_h must be a real number", "scales_h", 161002),
        (lambda: F(G, (6, 8), (1, 2, 3, 4), False, 0.0, True), "scales_w must be a real number", "scales_w", 161002),
        (lambda: F(G, (6, 8), (1, 2, 3, 4), out=np.zeros((1, 2, 3, 4))), r"out\.dtype must be float32", "out", 161002),
    ],
)
def test_errors(call, match, param, status):
    with raises_param_error(match, status=status, param=param):
        call()


@pytest.mark.slow
def test_random_shapes_every_dtype_and_layout():
    # Sizes up to 150: wide enough for the float32 source index to round (the oracle had
    # float64 weights once, and random shapes like these exposed the difference), the engine's
    # narrow, in-place and 16-planes paths, both layouts, both align_corners.
    rng = np.random.default_rng(20261121)
    for _ in range(40):
        dtype = (np.float32, np.float64, np.float16, BF16)[rng.integers(4)]
        n, c = int(rng.integers(1, 3)), int(rng.choice([1, 3, 17, 130]))
        input_size = (n, c, int(rng.integers(1, 40)), int(rng.integers(1, 90)))
        output_size = (int(rng.integers(1, 60)), int(rng.integers(1, 150)))
        align_corners = bool(rng.random() < 0.5)
        grad = grad_for(rng, input_size, output_size, dtype)
        check(grad, output_size, input_size, align_corners)
        nhwc = F(
            np.ascontiguousarray(grad.transpose(0, 2, 3, 1)), output_size, input_size, align_corners, layout="NHWC"
        )
        assert bitwise_equal(
            np.ascontiguousarray(nhwc.transpose(0, 3, 1, 2)), F(grad, output_size, input_size, align_corners)
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize(
    "sizes",
    [
        ((2, 5, 7, 9), (14, 18)),
        ((1, 20, 5, 40), (9, 80)),
        ((2, 3, 30, 17), (11, 40)),
        ((4, 40, 5, 6), (10, 12)),  # NCHW: many small planes, LANES of them at a time
    ],
)
def test_nan_sums_are_the_positive_nan(dtype, layout, sizes):
    """Every NaN of grad_input is the positive quiet NaN, whichever NaN (of either sign) its sum
    met: which of two NaN an addition returns follows the compiled code's operand order, which
    differs between CPUs (docs/semantics.md §0.2)."""
    input_size, output_size = sizes
    go = with_signed_nan(random((input_size[0], input_size[1], *output_size), dtype, 41), 42)
    for align_corners in (False, True):
        args = (to_nhwc(go) if layout == "NHWC" else go, output_size, input_size, align_corners)
        assert nan_cells_are_the_positive_nan(F(*args, layout=layout))
