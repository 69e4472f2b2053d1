"""fastbwd.torch.roi_align against torchvision.ops.roi_align itself, forward and backward
(docs/semantics.md §7): every dtype, aligned or not, adaptive and fixed sampling, both box forms,
NCHW and channels_last, CPU autocast, and the errors of a non-float input. Skips cleanly where
torchvision is not installed (CI installs it beside PyTorch 2.14.1 only)."""

import itertools

import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
from torchvision.ops import roi_align as tv_roi_align  # noqa: E402

import fastbwd.torch as ft  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
LAYOUTS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}


def _randn(shape, dtype, seed, memory_format=torch.contiguous_format):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64)
    return values.to(dtype).contiguous(memory_format=memory_format)


def _boxes(dtype):
    """(K, 5) boxes over two 11 x 13 images (after spatial_scale 0.5: 22 x 26 box units): inside,
    partly outside, tiny, reversed (x2 < x1: torchvision's size clamp) and the whole image."""
    return torch.tensor(
        [
            [0, 2.0, 4.0, 19.0, 14.0],
            [1, -6.0, 8.0, 28.0, 25.0],
            [1, 10.4, 10.2, 10.8, 10.6],
            [0, 16.0, 6.0, 4.0, 2.0],
            [1, 0.0, 0.0, 26.0, 22.0],
            [0, 3.3, 17.1, 9.9, 21.7],
        ],
        dtype=dtype,
    )


def _box_form(boxes, form):
    """The Tensor[K, 5] form, or a list of Tensor[L, 4], one per image."""
    if form == "tensor":
        return boxes
    return [boxes[boxes[:, 0] == image, 1:] for image in range(2)]


def _runs_in(dtype):
    """True when torchvision's CPU kernel takes ``dtype`` (0.29.1: not bfloat16)."""
    x = torch.zeros(1, 1, 2, 2, dtype=dtype)
    try:
        tv_roi_align(x, torch.zeros(1, 5, dtype=dtype), 1)
    except RuntimeError as error:
        assert "not implemented for" in str(error)
        return False
    return True


def _forward_backward(function, x, boxes, grad, *args):
    x = x.detach().requires_grad_()
    y = function(x, boxes, *args)
    (dx,) = torch.autograd.grad(y, x, grad)
    return y.detach(), dx


def _torchvision(x, boxes, form, grad, args, native):
    """torchvision's output and input gradient in ``x``'s dtype: computed in it where its CPU
    kernel takes it (``native``), else in float32 on the same values and rounded once."""
    if native:
        return _forward_backward(tv_roi_align, x, _box_form(boxes, form), grad, *args)
    results = _forward_backward(tv_roi_align, x.float(), _box_form(boxes.float(), form), grad.float(), *args)
    return tuple(t.to(x.dtype) for t in results)


def _assert_as_close_as_torchvision(ours, theirs, truth, what):
    """``ours`` is as close to the float64 ``truth`` as torchvision's result in the same dtype
    (within twice its error), or within a rounding of the dtype at the values' scale."""
    scale = float(truth.abs().max()) if truth.numel() else 0.0
    our_error = float((ours.double() - truth).abs().max()) if truth.numel() else 0.0
    their_error = float((theirs.double() - truth).abs().max()) if truth.numel() else 0.0
    rounding = torch.finfo(ours.dtype).eps * max(scale, 1.0)
    assert our_error <= 2 * their_error + rounding, (
        f"{what}: error {our_error:.3g}, torchvision's {their_error:.3g} (scale {scale:.3g})"
    )


#: aligned, sampling_ratio (adaptive -1 and 0, fixed 1 to 3), output_size, box form
CASES = list(itertools.product((False, True), (-1, 0, 1, 2, 3), ((3, 4), 2), ("tensor", "list")))
TOLERANCES = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-6)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roi_align_matches_torchvision(dtype, layout):
    """Forward and input gradient equal torchvision's in every case: float64 and float32 to
    their rounding; a half dtype torchvision's CPU kernel takes (float16) as close to the float64
    truth as torchvision's own result (fastbwd accumulates in float32 and rounds once); one it
    does not take (bfloat16, in 0.29.1) within a rounding of torchvision's float32 result on the
    same values. channels_last in, channels_last out (torchvision's CPU kernel copies)."""
    memory_format = LAYOUTS[layout]
    x = _randn((2, 3, 11, 13), dtype, 1, memory_format)
    boxes = _boxes(dtype)
    native = _runs_in(dtype)
    for aligned, sampling_ratio, output_size, form in CASES:
        what = f"{layout} aligned={aligned} sampling_ratio={sampling_ratio} output_size={output_size} {form}"
        args = (output_size, 0.5, sampling_ratio, aligned)
        grad = _randn(tv_roi_align(x.float(), boxes.float(), *args).shape, dtype, 2)
        ours = _forward_backward(ft.roi_align, x, _box_form(boxes, form), grad, *args)
        theirs = _torchvision(x, boxes, form, grad, args, native)
        truths = _torchvision(x.double(), boxes.double(), form, grad.double(), args, True)
        for name, a, e, truth in zip(("output", "input gradient"), ours, theirs, truths):
            assert a.shape == e.shape and a.dtype == e.dtype == dtype, f"{what}: {name}"
            if dtype in TOLERANCES:
                rtol, atol = TOLERANCES[dtype]
                torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=f"{what}: {name}")
            elif native:
                _assert_as_close_as_torchvision(a, e, truth, f"{what}: {name}")
            else:
                torch.testing.assert_close(a, e, rtol=2**-7, atol=2**-7, msg=f"{what}: {name}")
            assert a.is_contiguous(memory_format=memory_format), f"{what}: {name}"


def test_roi_align_without_boxes_matches_torchvision():
    x = _randn((2, 3, 11, 13), torch.float32, 3)
    for boxes in (_boxes(torch.float32)[:0], [torch.zeros(0, 4), _boxes(torch.float32)[:2, 1:]]):
        ours, theirs = ft.roi_align(x, boxes, (3, 4), 0.5, 2, True), tv_roi_align(x, boxes, (3, 4), 0.5, 2, True)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_roi_align_under_cpu_autocast_matches_torchvision(dtype):
    """Under CPU autocast both compute in float32 from inputs and boxes of any float dtypes and
    return the input's dtype: the same values, to one rounding of it (bfloat16 included, which
    torchvision's CPU kernel takes only this way)."""
    x = _randn((2, 3, 11, 13), dtype, 4)
    boxes = _boxes(torch.float32)
    grad = _randn((6, 3, 3, 4), dtype, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _forward_backward(ft.roi_align, x, boxes, grad, (3, 4), 0.5, 0, True)
        theirs = _forward_backward(tv_roi_align, x, boxes, grad, (3, 4), 0.5, 0, True)
    # float32 results: to float32's rounding of sums in another order; half results: one rounding
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (torch.finfo(dtype).eps,) * 2
    for name, a, e in zip(("output", "input gradient"), ours, theirs):
        assert a.dtype == e.dtype == dtype, name
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64], ids=str)
def test_non_float_input_raises_torchvisions_exception_type(dtype):
    """An integer, bool or complex input: torchvision raises a RuntimeError (not implemented for
    the dtype, or boxes of another type); so does fastbwd, saying which dtypes it takes."""
    x = torch.ones(2, 3, 11, 13).to(dtype)
    for boxes in (_boxes(torch.float32), _boxes(torch.float32).to(dtype)):
        with pytest.raises(RuntimeError) as theirs:
            tv_roi_align(x, boxes, 2)
        with pytest.raises(RuntimeError, match="^roi_align: input.dtype must be one of") as ours:
            ft.roi_align(x, boxes, 2)
        assert type(ours.value) is type(theirs.value)
