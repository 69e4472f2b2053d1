"""fastbwd's registered PyTorch operators (docs/semantics.md §7, "Registered operators"):
opcheck, FX, TorchScript, torch.compile, CPU autocast, nn.GroupNorm's constructor and errors,
double backward. Skips cleanly without torch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import fastbwd  # noqa: E402
import fastbwd.torch as ft  # noqa: E402
from fastbwd.api import group_norm_swish as gns_api  # noqa: E402

from conftest import pytorch_deprecation  # noqa: E402

OPS = torch.ops.fastbwd
CHANNELS_LAST = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}


def _randn(shape, dtype=torch.float32, seed=0, memory_format=torch.contiguous_format):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).contiguous(memory_format=memory_format)
    )


def _boxes(dtype=torch.float32):
    """(K, 5) boxes over two 9 x 11 images: inside, partly outside, tiny."""
    return torch.tensor(
        [[0, 1.0, 2.0, 8.5, 7.0], [1, -3.0, 4.0, 12.0, 10.5], [1, 5.2, 5.1, 5.4, 5.3], [0, 0.0, 0.0, 10.0, 8.0]],
        dtype=dtype,
    )


def _per_image(boxes):
    return [boxes[boxes[:, 0] == i, 1:] for i in range(2)]


class _Counter:
    """Wraps the kernels' plans' ``run`` (what every path to fastbwd's kernels ends in: a direct
    call, a prepared call or the api's ``run``) and counts the calls."""

    def __init__(self, monkeypatch):
        from fastbwd.kernels import group_norm_swish as gns_kernels
        from fastbwd.kernels import roi_align as roi_align_kernels

        self.calls = {}
        for owner, attribute, name in (
            (roi_align_kernels.ForwardPlan, "run", "roi_align_forward"),
            (roi_align_kernels.BackwardPlan, "run", "roi_align_backward"),
            (gns_kernels.ForwardPlan, "run", "group_norm_swish"),
            (gns_kernels.BackwardPlan, "run", "group_norm_swish_backward"),
        ):
            monkeypatch.setattr(owner, attribute, self._counting(name, getattr(owner, attribute)))

    def _counting(self, name, function):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return function(*args, **kwargs)

        return counted


# ---- opcheck ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(CHANNELS_LAST))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("boxes", ["tensor", "list", "none"])
def test_opcheck_roi_align(boxes, dtype, layout):
    if boxes != "tensor" and layout == "channels_last" and dtype != torch.float32:
        pytest.skip("the box forms are layout-independent: one layout is enough")
    x = _randn((2, 3, 9, 11), dtype, 1, CHANNELS_LAST[layout]).requires_grad_()
    rois = {
        "tensor": _boxes(dtype),
        "list": ft._roi_align.boxes_to_rois(_per_image(_boxes(dtype)), x),
        "none": ft._roi_align.boxes_to_rois([], x),
    }[boxes]
    torch.library.opcheck(OPS.roi_align, (x, rois, 0.8, 3, 4, 2, True))
    torch.library.opcheck(OPS.roi_align, (x, rois, 1.0, 2, 2, -1, False))
    grad = _randn((rois.shape[0], 3, 3, 4), dtype, 2).requires_grad_()
    channels_last = layout == "channels_last"  # the backward's channels_last flag: its NHWC kernel
    torch.library.opcheck(OPS.roi_align_backward, (grad, rois, 0.8, 3, 4, 2, 3, 9, 11, 0, True, channels_last))


@pytest.mark.parametrize(
    "dtype, params, layout",
    [
        (torch.float32, torch.float32, "nchw"),
        (torch.float64, torch.float64, "channels_last"),
        (torch.bfloat16, torch.bfloat16, "nchw"),
        (torch.bfloat16, torch.float32, "channels_last"),
    ],
    ids=str,
)
@pytest.mark.slow
def test_opcheck_group_norm_swish(dtype, params, layout):
    x = _randn((2, 6, 4, 5), dtype, 3, CHANNELS_LAST[layout]).requires_grad_()
    weight = _randn((6,), params, 4).requires_grad_()
    bias = _randn((6,), params, 5).requires_grad_()
    torch.library.opcheck(OPS.group_norm_swish, (x, weight, bias, 3, 1e-5, 0.8))
    torch.library.opcheck(OPS.group_norm_swish, (x, None, bias, 2, 1e-5, 1.0))
    _, mean, rstd = OPS.group_norm_swish(x, weight, bias, 3, 1e-5, 0.8)
    dy = _randn(x.shape, dtype, 6, CHANNELS_LAST[layout]).requires_grad_()
    for mask in ([True, True, True], [True, False, True]):
        torch.library.opcheck(OPS.group_norm_swish_backward, (dy, x, mean, rstd, weight, bias, 3, 0.8, mask))
    # an affine-free input
    _, mean, rstd = OPS.group_norm_swish(x, None, None, 3, 1e-5, 1.0)
    torch.library.opcheck(OPS.group_norm_swish_backward, (dy, x, mean, rstd, None, None, 3, 1.0, [True, True, True]))


def test_fake_kernels_give_the_real_layouts():
    """The strides opcheck compares, stated outright: channels_last in, channels_last out."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = _randn((2, 6, 4, 5), memory_format=torch.channels_last)
    weight, bias = _randn((6,), seed=1), _randn((6,), seed=2)
    real = OPS.group_norm_swish(x, weight, bias, 3, 1e-5, 1.0)
    real_grads = OPS.group_norm_swish_backward(x, x, real[1], real[2], weight, bias, 3, 1.0, [True, False, True])
    with FakeTensorMode() as mode:
        fake_x, fake_w, fake_b = (mode.from_tensor(t) for t in (x, weight, bias))
        fake = OPS.group_norm_swish(fake_x, fake_w, fake_b, 3, 1e-5, 1.0)
        fake_grads = OPS.group_norm_swish_backward(
            fake_x, fake_x, fake[1], fake[2], fake_w, fake_b, 3, 1.0, [True, False, True]
        )
    for r, f in zip(real + real_grads, fake + fake_grads):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    assert real[0].is_contiguous(memory_format=torch.channels_last)
    assert real_grads[1].shape == (0,) and real_grads[2].shape == (6,)


@pytest.mark.parametrize("layout", list(CHANNELS_LAST))
def test_roi_align_fake_kernels_give_the_real_layouts(layout):
    """RoIAlign's operators in both layouts: a channels_last feature map gives channels_last
    pooled values and, with ``channels_last=True``, a channels_last input gradient; the fakes
    (what torch.compile plans its buffers by) say the same strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    memory_format = CHANNELS_LAST[layout]
    channels_last = layout == "channels_last"
    x = _randn((2, 3, 9, 11), memory_format=memory_format)
    rois = _boxes()
    grad = _randn((rois.shape[0], 3, 3, 4), seed=2, memory_format=memory_format)
    backward_args = (0.8, 3, 4, 2, 3, 9, 11, 0, True, channels_last)
    real = (OPS.roi_align(x, rois, 0.8, 3, 4, 2, True), OPS.roi_align_backward(grad, rois, *backward_args))
    with FakeTensorMode() as mode:
        fake_x, fake_rois, fake_grad = (mode.from_tensor(t) for t in (x, rois, grad))
        fake = (
            OPS.roi_align(fake_x, fake_rois, 0.8, 3, 4, 2, True),
            OPS.roi_align_backward(fake_grad, fake_rois, *backward_args),
        )
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
        assert r.is_contiguous(memory_format=memory_format)


# ---- FX and TorchScript -------------------------------------------------------------------------


def _roi_with_tensor(x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    return ft.roi_align(x, boxes, [3, 4], 0.8, 2, True) * 2


def _roi_with_list(x: torch.Tensor, boxes: list[torch.Tensor]) -> torch.Tensor:
    return ft.roi_align(x, boxes, 3, 0.8, -1, False) * 2


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = ft.GroupNormSwish(3, 6)
        self.pool = ft.RoIAlign((3, 4), 0.8, 2, aligned=True)

    def forward(self, x, boxes):
        return self.pool(self.norm(x), boxes)


def test_fx_symbolic_trace_keeps_the_operators_as_leaves():
    x, boxes = _randn((2, 6, 9, 11)), _boxes()
    for function, box_form in ((_roi_with_tensor, boxes), (_roi_with_list, _per_image(boxes))):
        traced = torch.fx.symbolic_trace(function)
        torch.testing.assert_close(traced(x, box_form), function(x, box_form), rtol=0, atol=0)
    head = _Head()
    traced = torch.fx.symbolic_trace(head)
    targets = {node.target for node in traced.graph.nodes if node.op == "call_function"}
    assert {ft.roi_align, ft.group_norm_swish} <= targets
    torch.testing.assert_close(traced(x, boxes), head(x, boxes), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # the eager shape checks, traced
def test_torch_jit_script_and_trace_both_box_forms():
    """TorchScript works, and is deprecated: each call expects PyTorch's warning where it gives one."""
    x, boxes = _randn((2, 3, 9, 11)), _boxes()
    for function, box_form in ((_roi_with_tensor, boxes), (_roi_with_list, _per_image(boxes))):
        with pytorch_deprecation("torch.jit.script"):
            scripted = torch.jit.script(function)
        torch.testing.assert_close(scripted(x, box_form), function(x, box_form), rtol=0, atol=0)
    module = ft.RoIAlign((3, 4), 0.8, 2, aligned=True)
    with pytorch_deprecation("torch.jit.script"):
        scripted = torch.jit.script(module)
    for box_form in (boxes, _per_image(boxes)):
        torch.testing.assert_close(scripted(x, box_form), module(x, box_form), rtol=0, atol=0)
    with pytorch_deprecation("torch.jit.trace"):
        traced = torch.jit.trace(_roi_with_tensor, (x, boxes))  # records the operator, not Python
    assert "fastbwd::roi_align" in str(traced.graph)
    torch.testing.assert_close(traced(x, boxes), _roi_with_tensor(x, boxes), rtol=0, atol=0)
    # Scripted code skips the eager checks; the operator's own validation still refuses bad boxes.
    with pytorch_deprecation("torch.jit.script"):
        scripted = torch.jit.script(_roi_with_tensor)
    with pytest.raises(RuntimeError, match="boxes must have shape \\(K, 5\\)"):
        scripted(x, boxes[:, :4])


def test_the_tested_releases_deprecate_torchscript():
    """The releases CI runs warn on TorchScript (2.13 a DeprecationWarning, 2.14 a FutureWarning),
    so the test above expects the warning there (pytorch_deprecation asks PyTorch which)."""
    if torch.__version__ < "2.13":
        pytest.skip(f"PyTorch {torch.__version__}: not a release CI runs")
    expected = FutureWarning if torch.__version__ >= "2.14" else DeprecationWarning
    calls = {
        "torch.jit.script": lambda: torch.jit.script(_roi_with_tensor),
        "torch.jit.trace": lambda: torch.jit.trace(torch.neg, _randn(2)),
    }
    for api, call in calls.items():
        with pytorch_deprecation(api) as record:
            call()
        assert record is not None and {w.category for w in record} == {expected}, api


# ---- torch.compile --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_fullgraph_runs_fastbwd_kernels(backend, monkeypatch):
    torch._dynamo.reset()
    head = _Head()
    with torch.no_grad():
        head.norm.weight.normal_(generator=torch.Generator().manual_seed(7))
    x, boxes = _randn((2, 6, 9, 11), seed=8), _boxes()

    def step(model, x):
        x = x.detach().requires_grad_()
        y = model(x, boxes)
        grads = torch.autograd.grad((y * y).sum(), (x, head.norm.weight, head.norm.bias))
        return (y,) + grads

    expected = step(head, x)
    counter = _Counter(monkeypatch)
    compiled = torch.compile(head, backend=backend, fullgraph=True)  # fullgraph: a break raises
    actual = step(compiled, x)
    assert counter.calls == {
        "roi_align_forward": 1,
        "roi_align_backward": 1,
        "group_norm_swish": 1,
        "group_norm_swish_backward": 1,
    }
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


# ---- CPU autocast ---------------------------------------------------------------------------------


def test_roi_align_autocast_computes_in_float32_returns_input_dtype():
    x32, boxes = _randn((2, 3, 9, 11), seed=9).requires_grad_(), _boxes()
    for x, box_dtype in (
        (x32, torch.bfloat16),
        (x32.detach().bfloat16().requires_grad_(), torch.float32),
        (x32.detach().bfloat16().requires_grad_(), torch.bfloat16),
    ):
        rois = boxes.to(box_dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = ft.roi_align(x, rois, 3, 0.8, 2, True)
            y_list = ft.roi_align(x, _per_image(rois), 3, 0.8, 2, True)
        expected = ft.roi_align(x.detach().float(), rois.float(), 3, 0.8, 2, True).to(x.dtype)
        expected_list = ft.roi_align(x.detach().float(), _per_image(rois.float()), 3, 0.8, 2, True).to(x.dtype)
        assert y.dtype == y_list.dtype == x.dtype
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        torch.testing.assert_close(y_list, expected_list, rtol=0, atol=0)
        (grad,) = torch.autograd.grad(y.sum(), x)
        assert grad.dtype == x.dtype
    with pytest.raises(RuntimeError, match="dtype"):  # outside autocast: one dtype, as torchvision
        ft.roi_align(x32, boxes.bfloat16(), 3)


def test_group_norm_swish_autocast_as_nn_group_norm():
    fused = ft.GroupNormSwish(3, 6)
    plain = torch.nn.GroupNorm(3, 6)
    conv = torch.nn.Conv2d(6, 6, 1)
    with torch.no_grad():
        fused.weight.normal_(generator=torch.Generator().manual_seed(10))
        plain.load_state_dict(fused.state_dict())
    x = _randn((2, 6, 5, 4), seed=11)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for input in (x, x.bfloat16(), conv(x)):  # conv's output is bfloat16 under autocast
            y, expected = fused(input), F.silu(plain(input))
            assert y.dtype == expected.dtype
            torch.testing.assert_close(y, expected, rtol=2e-2, atol=2e-2)


# ---- GroupNormSwish is an nn.GroupNorm -----------------------------------------------------------


def test_group_norm_swish_takes_nn_group_norms_constructor():
    fused = ft.GroupNormSwish(3, 6, 1e-3, bias=False, dtype=torch.float64, swish_scale=0.5)
    plain = torch.nn.GroupNorm(3, 6, 1e-3, bias=False, dtype=torch.float64)
    assert fused.bias is None and fused.eps == 1e-3 and fused.weight.dtype == torch.float64
    assert fused.state_dict().keys() == plain.state_dict().keys()
    fused.load_state_dict(plain.state_dict())
    x = _randn((2, 6, 4, 4), torch.float64, 12)
    y = plain(x)
    torch.testing.assert_close(fused(x), y * torch.sigmoid(0.5 * y), rtol=1e-12, atol=1e-12)
    assert ft.GroupNormSwish(2, 4, 1e-5, False, "cpu").weight is None
    with pytest.raises(TypeError, match="pass swish_scale=0.5 as a keyword"):
        ft.GroupNormSwish(2, 4, 1e-5, True, 0.5)  # the old positional swish_scale


@pytest.mark.parametrize(
    "groups, channels, shape",
    [
        (10, 10, (1, 10, 1)),  # one value per group
        (2, 2, (1, 2)),  # one value per group, 2-D
        (3, 6, (2, 5, 3)),  # channel count not divisible by the groups
        (2, 6, (2, 4, 3)),  # divisible, but not the module's channel count
        (3, 6, (6,)),  # 1-D
    ],
)
def test_group_norm_swish_raises_what_nn_group_norm_raises(groups, channels, shape):
    x = torch.randn(shape)
    with pytest.raises(Exception) as expected:
        torch.nn.GroupNorm(groups, channels)(x)
    with pytest.raises(expected.type) as actual:
        ft.GroupNormSwish(groups, channels)(x)
    assert str(actual.value) == str(expected.value)
    with pytest.raises(ValueError, match="must be divisible"):
        ft.GroupNormSwish(4, 6)


# ---- double backward -----------------------------------------------------------------------------


def test_group_norm_swish_double_backward_is_exact(monkeypatch):
    x = _randn((2, 4, 3, 2), torch.float64, 13).requires_grad_()
    weight = _randn((4,), torch.float64, 14).requires_grad_()
    bias = _randn((4,), torch.float64, 15).requires_grad_()
    function = lambda x, w, b: ft.group_norm_swish(x, 2, w, b, 1e-5, -0.7)  # noqa: E731
    assert torch.autograd.gradgradcheck(function, (x, weight, bias))
    # without a graph of the backward, the gradient is fastbwd's fused kernel
    counter = _Counter(monkeypatch)
    torch.autograd.grad(function(x, weight, bias).sum(), (x, weight, bias))
    assert counter.calls == {"group_norm_swish": 1, "group_norm_swish_backward": 1}


def test_group_norm_swish_backward_operator_is_differentiable():
    x = _randn((2, 4, 5), torch.float64, 16)
    weight = _randn((4,), torch.float64, 17).requires_grad_()
    bias = _randn((4,), torch.float64, 18).requires_grad_()
    _, mean, rstd = OPS.group_norm_swish(x, weight, bias, 2, 1e-5, 1.3)
    inputs = [t.detach().requires_grad_() for t in (_randn(x.shape, torch.float64, 19), x, mean, rstd)]

    def backward(dy, x, mean, rstd, w, b):
        return OPS.group_norm_swish_backward(dy, x, mean, rstd, w, b, 2, 1.3, [True, True, True])

    assert torch.autograd.gradcheck(backward, (*inputs, weight, bias))


def test_roi_align_double_backward_is_the_forward():
    x = _randn((2, 2, 7, 6), torch.float64, 20).requires_grad_()
    boxes = _boxes(torch.float64)
    for ratio, aligned in ((2, True), (0, False)):
        function = lambda x, ratio=ratio, aligned=aligned: ft.roi_align(x, boxes, 2, 0.5, ratio, aligned)  # noqa: E731
        assert torch.autograd.gradgradcheck(function, (x,))


# ---- the eager path ------------------------------------------------------------------------------


def _numpy_group_norm_swish(x, weight, bias, groups, eps, swish_scale, dy):
    """The NumPy functions' results for the same call: ``(y, dx, dgamma, dbeta)`` as tensors."""
    channels = x.shape[1]
    gamma = np.ones(channels, np.float32) if weight is None else weight.detach().numpy()
    beta = np.zeros(channels, np.float32) if bias is None else bias.detach().numpy()
    data = x.detach().numpy()  # channels_last strides run the NHWC kernels, as in the bridge
    y, mean, rstd = fastbwd.group_norm_swish(data, gamma, beta, groups, eps=eps, swish_scale=swish_scale)
    dy = dy.contiguous(
        memory_format=torch.channels_last if ft._convert.is_channels_last(x) else torch.contiguous_format
    )
    grads = fastbwd.group_norm_swish_backward(dy.numpy(), mean, rstd, data, gamma, beta, groups, "NCHW", swish_scale)
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (y, *grads))


def test_group_norm_swish_backward_of_other_metadata():
    """A geometry's prepared backward is made for its first call's arrays; a later call whose
    arrays have other metadata runs the public function instead, with the same bits: the
    operator given flat or strided statistics after (N, G) contiguous ones, and a gradient whose
    size-1 axes have other strides than the first one's."""
    from fastbwd.torch import _ops

    _ops._GEOMETRIES.clear()
    x = _randn((2, 6, 5, 4), torch.float64, seed=60)
    weight, bias = _randn((6,), torch.float64, seed=61), _randn((6,), torch.float64, seed=62)
    dy = _randn(x.shape, torch.float64, seed=63)
    _, mean, rstd = torch.ops.fastbwd.group_norm_swish(x, weight, bias, 3, 1e-5, 1.0)
    arrays = (x.numpy(), weight.numpy(), bias.numpy())
    strided = tuple(s.t().contiguous().t() for s in (mean, rstd))
    assert strided[0].stride() != mean.stride()
    for statistics in ((mean, rstd), (mean.flatten(), rstd.flatten()), strided, (mean, rstd)):
        got = torch.ops.fastbwd.group_norm_swish_backward(dy, x, *statistics, weight, bias, 3, 1.0, [True, True, True])
        expected = fastbwd.group_norm_swish_backward(dy.numpy(), *(s.numpy() for s in statistics), *arrays, 3)
        for g, e in zip(got, expected):
            assert torch.equal(g, torch.from_numpy(e))

    x = _randn((2, 6, 1, 1), seed=64).requires_grad_()
    contiguous = _randn(x.shape, seed=65)
    odd = contiguous.as_strided(contiguous.shape, (6, 1, 7, 9))  # the same values, other size-1 strides
    assert odd.is_contiguous() and odd.stride() != contiguous.stride()
    expected = _numpy_group_norm_swish(x, None, None, 3, 1e-5, 1.0, contiguous)
    for grad in (contiguous, odd, contiguous):
        (dx,) = torch.autograd.grad(ft.group_norm_swish(x, 3), x, grad)
        assert torch.equal(dx, expected[1])


def test_group_norm_swish_validates_each_geometry_once(monkeypatch):
    """Calls repeating a geometry (each tensor's shape, strides and dtype; num_groups, eps,
    swish_scale) reuse what its first call worked out, its prepared calls: nothing is prepared,
    validated or looked up in the api's plan tables again, and each call gives the NumPy
    functions' bits. Another geometry gets its own, and a call fastbwd's kernels do not take is
    PyTorch's, the refusal remembered like a geometry."""
    from fastbwd.torch import _ops

    _ops._GEOMETRIES.clear()
    built = []  # the prepared calls made, and every plan lookup of the api (a direct call's)
    for function, name in ((gns_api.group_norm_swish, "forward"), (gns_api.group_norm_swish_backward, "backward")):
        original = function.prepare
        monkeypatch.setattr(function, "prepare", lambda *a, _f=original, _n=name, **k: built.append(_n) or _f(*a, **k))
        operation = function.operation
        monkeypatch.setattr(operation, "plan", lambda *a, _f=operation.plan: built.append("plan") or _f(*a))
    weight, bias = _randn((6,), seed=40).requires_grad_(), _randn((6,), seed=41).requires_grad_()
    geometries = [
        (_randn((2, 6, 5, 4), seed=42), weight, bias, 1e-5, 1.0),
        (_randn((2, 6, 5, 4), seed=43, memory_format=torch.channels_last), weight, bias, 1e-5, 1.0),
        (_randn((2, 6, 5, 4), seed=44), None, None, 1e-5, 1.0),
        (_randn((2, 6, 5, 4), seed=45), weight, bias, 1e-3, 1.0),
        (_randn((2, 6, 5, 4), seed=46), weight, bias, 1e-5, -0.5),
        (_randn((3, 6, 20), seed=47), weight, bias, 1e-5, 1.0),
    ]
    for index, (x, w, b, eps, scale) in enumerate(geometries):
        x.requires_grad_()
        dy = _randn(x.shape, seed=50 + index)
        params = tuple(t for t in (x, w, b) if t is not None)
        expected = _numpy_group_norm_swish(x, w, b, 3, eps, scale, dy)
        for call in range(3):
            built.clear()
            y = ft.group_norm_swish(x, 3, w, b, eps, scale)
            grads = torch.autograd.grad(y, params, dy)
            assert len(_ops._GEOMETRIES) == index + 1  # a geometry of its own, made once
            assert built == ([] if call else ["forward", "plan", "backward", "plan"]), (index, call, built)
            assert torch.equal(y.contiguous(), expected[0])
            for got, want in zip(grads, (expected[1],) + (expected[2:] if w is not None else ())):
                assert torch.equal(got.contiguous(), want)
    assert len(_ops._GEOMETRIES) == len(geometries)
    x = geometries[0][0]
    for _ in range(2):  # a call fastbwd's kernels refuse: PyTorch's own code, decided once
        built.clear()
        y = ft.group_norm_swish(x, 3, weight, bias, -1.0)
        assert built == [] and len(_ops._GEOMETRIES) == len(geometries) + 1
        expected = torch.nn.functional.silu(torch.nn.functional.group_norm(x, 3, weight, bias, -1.0))
        torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)


def test_eager_call_checks_a_geometry_the_operator_made_first():
    """A geometry first reached through the operator is decided once for both paths: one value
    per group is not fastbwd's (the operator runs PyTorch's kernels), and the eager call runs
    F.group_norm, which refuses it as nn.GroupNorm does."""
    x, weight, bias = _randn((1, 2, 1), seed=64), _randn((2,), seed=65), _randn((2,), seed=66)
    OPS.group_norm_swish(x, weight, bias, 2, 1e-5, 1.0)
    for _ in range(2):
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            ft.group_norm_swish(x, 2, weight, bias)


def test_backward_operator_takes_new_statistics_layouts():
    """The backward operator called directly with flat (N*G,) statistics after (N, G) ones:
    a new plan for the new metadata, the same gradients."""
    x, weight, bias = _randn((2, 6, 7), seed=60), _randn((6,), seed=61), _randn((6,), seed=62)
    _, mean, rstd = OPS.group_norm_swish(x, weight, bias, 3, 1e-5, 1.0)
    dy = _randn(x.shape, seed=63)
    grads = OPS.group_norm_swish_backward(dy, x, mean, rstd, weight, bias, 3, 1.0, [True, True, True])
    flat = OPS.group_norm_swish_backward(
        dy, x, mean.reshape(-1), rstd.reshape(-1), weight, bias, 3, 1.0, [True, True, True]
    )
    for a, b in zip(grads, flat):
        assert torch.equal(a, b)


def test_eager_calls_run_the_operators_code_bitwise():
    """Plain eager calls skip the dispatcher (an autograd.Function over the same kernels and
    formulas); their results and gradients are bitwise the operators'."""
    x = _randn((2, 6, 9, 11), seed=21).requires_grad_()
    weight, bias = _randn((6,), seed=22).requires_grad_(), _randn((6,), seed=23).requires_grad_()
    boxes, g = _boxes(), _randn((4, 6, 3, 4), seed=24)
    eager = ft.roi_align(ft.group_norm_swish(x, 3, weight, bias, 1e-5, 0.9), boxes, (3, 4), 0.8, 2, True)
    registered = OPS.roi_align(OPS.group_norm_swish(x, weight, bias, 3, 1e-5, 0.9)[0], boxes, 0.8, 3, 4, 2, True)
    assert type(eager.grad_fn).__name__ == "EagerRoIAlignBackward"
    assert type(eager.grad_fn.next_functions[0][0]).__name__ == "EagerGroupNormSwishBackward"
    assert torch.equal(eager, registered)
    for a, b in zip(
        torch.autograd.grad(eager, (x, weight, bias), g), torch.autograd.grad(registered, (x, weight, bias), g)
    ):
        assert torch.equal(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's rule lives on the operator
        assert "Eager" not in type(ft.roi_align(x, boxes, 3).grad_fn).__name__


# ---- what PyTorch refuses, the registered operators refuse with PyTorch's exception (issue 55) ------
# The operators' own validation is part of the one rule: each argument that refusal() does not
# read is tried too. A call PyTorch refuses raises PyTorch's exception type (its own error: the
# operator runs PyTorch's code on it); a call fastbwd's kernels do not take but PyTorch does runs
# PyTorch's code and gives its result.


def _outcome(call):
    """``(None, result)``, or ``(exception type, first line of its message)``."""
    try:
        return None, call()
    except Exception as error:  # noqa: BLE001 - compared below
        return type(error), str(error).splitlines()[0]


def _sizes(x):
    return x.shape[0], x.shape[1], x[0, 0].numel()


def _pytorch_group_norm_swish(x, weight, bias, groups, eps):
    """PyTorch's forward of the same call: its GroupNorm operator (F.group_norm refuses fewer than
    two dimensions first), then SiLU."""
    if x.dim() < 2:
        F.group_norm(x, groups, weight, bias, eps)
    y, mean, rstd = torch.ops.aten.native_group_norm(x, weight, bias, *_sizes(x), groups, eps)
    return F.silu(y), mean, rstd


def _pytorch_group_norm_swish_backward(dy, x, mean, rstd, weight, bias, groups, mask):
    """PyTorch's backward of the same call: its GroupNorm backward operator's checks of the
    arguments as given, then SiLU's backward and GroupNorm's from the forward's output."""
    if len(mask) == 3:
        mask = [mask[0], mask[1] and weight is not None, mask[2] and bias is not None]
    torch.ops.aten.native_group_norm_backward(dy, x, mean, rstd, weight, *_sizes(x), groups, mask)
    y = F.group_norm(x, groups, weight, bias)
    # (contiguous statistics: PyTorch's CPU kernel reads strided ones as if they were contiguous)
    return torch.ops.aten.native_group_norm_backward(
        torch.ops.aten.silu_backward(dy, y), x, mean.contiguous(), rstd.contiguous(), weight, *_sizes(x), groups, mask
    )


def _assert_as_pytorch(ours, pytorchs, case):
    (error, ours), (expected_error, pytorchs) = _outcome(ours), _outcome(pytorchs)
    if expected_error is not None:
        assert (error, ours) == (expected_error, pytorchs), case  # PyTorch's own error
        return
    assert error is None, f"{case}: {error.__name__}: {ours}"
    for a, e in zip(ours, pytorchs):
        if e is not None and e.numel():  # (a gradient not asked for: None there, empty here)
            tolerance = 1e-2 if a.dtype in (torch.float16, torch.bfloat16) else 1e-4
            torch.testing.assert_close(a, e, rtol=tolerance, atol=tolerance, equal_nan=True, msg=case)


_X, _W, _B = _randn((2, 6, 5, 4), seed=80), _randn((6,), seed=81), _randn((6,), seed=82)
_FORWARD_CASES = {
    "int input": (_X.int(), _W, _B, 3, 1e-5),
    "bool input": (_X > 0, None, None, 3, 1e-5),
    "complex input": (_X.to(torch.complex64), None, None, 3, 1e-5),
    "1-D input": (_X[0, 0, 0], None, None, 1, 1e-5),
    "weight of another size": (_X, _W[:3], _B, 3, 1e-5),
    "2-D bias": (_X, _W, _B[None], 3, 1e-5),
    "float64 weight, float32 input": (_X, _W.double(), _B, 3, 1e-5),
    "bfloat16 weight, float32 input": (_X, _W.bfloat16(), _B, 3, 1e-5),
    "int weight": (_X, _W.int(), _B, 3, 1e-5),
    "weight on another device": (_X, _W.to("meta"), _B, 3, 1e-5),
    "input on another device": (_X.to("meta"), _W, _B, 3, 1e-5),
    "no groups": (_X, _W, _B, 0, 1e-5),
    "-1 groups": (_X, _W, _B, -1, 1e-5),
    "groups not dividing the channels": (_X, _W, _B, 4, 1e-5),
    "negative eps": (_X, _W, _B, 3, -1.0),
    "one value per group": (_X[:1, :, :1, :1], _W, _B, 6, 1e-5),
    "float16 input, float32 parameters": (_X.half(), _W, _B, 3, 1e-5),
}


@pytest.mark.parametrize("case", list(_FORWARD_CASES))
def test_group_norm_swish_operator_refuses_what_pytorch_refuses(case):
    x, weight, bias, groups, eps = _FORWARD_CASES[case]
    _assert_as_pytorch(
        lambda: OPS.group_norm_swish(x, weight, bias, groups, eps, 1.0),
        lambda: _pytorch_group_norm_swish(x, weight, bias, groups, eps),
        case,
    )


def _backward_cases():
    x, weight, bias = _X, _W, _B
    _, mean, rstd = torch.ops.aten.native_group_norm(x, weight, bias, *_sizes(x), 3, 1e-5)
    dy, mask = _randn(x.shape, seed=83), [True, True, True]
    return {
        "the forward's statistics": (dy, x, mean, rstd, weight, bias, mask),
        "float64 statistics, float32 input": (dy, x, mean.double(), rstd.double(), weight, bias, mask),
        "bfloat16 statistics, float32 input": (dy, x, mean.bfloat16(), rstd.bfloat16(), weight, bias, mask),
        "int statistics": (dy, x, mean.int(), rstd.int(), weight, bias, mask),
        "float64 rstd only": (dy, x, mean, rstd.double(), weight, bias, mask),
        "statistics of another size": (dy, x, mean[:, :2], rstd[:, :2], weight, bias, mask),
        "rstd of another size": (dy, x, mean, torch.zeros(3, 3), weight, bias, mask),
        "statistics (N, G, 1)": (dy, x, mean[..., None], rstd[..., None], weight, bias, mask),
        "flat rstd, (N, G) mean": (dy, x, mean, rstd.flatten(), weight, bias, mask),
        "transposed statistics": (dy, x, mean.t().contiguous().t(), rstd.t().contiguous().t(), weight, bias, mask),
        "statistics on another device": (dy, x, mean.to("meta"), rstd, weight, bias, mask),
        "float64 grad_output": (dy.double(), x, mean, rstd, weight, bias, mask),
        "bfloat16 grad_output": (dy.bfloat16(), x, mean, rstd, weight, bias, mask),
        "grad_output of fewer values": (dy[..., :1], x, mean, rstd, weight, bias, mask),
        "grad_output of another shape": (dy.reshape(2, 6, 20), x, mean, rstd, weight, bias, mask),
        "grad_output on another device": (dy.to("meta"), x, mean, rstd, weight, bias, mask),
        "int input": (dy, x.int(), mean, rstd, weight, bias, mask),
        "weight of another size": (dy, x, mean, rstd, weight[:3], bias, mask),
        "output_mask of 2": (dy, x, mean, rstd, weight, bias, [True, True]),
        "output_mask of 4": (dy, x, mean, rstd, weight, bias, [True] * 4),
        "no parameter gradients": (dy, x, mean, rstd, weight, bias, [True, False, False]),
    }


@pytest.mark.parametrize("case", list(_backward_cases()))
def test_group_norm_swish_backward_operator_refuses_what_pytorch_refuses(case):
    """Every argument, the forward's statistics (which the operator takes from anyone) included:
    fastbwd::group_norm_swish_backward with float64 statistics for a float32 input raised
    fastbwd.ParamError before issue 55, where PyTorch's GroupNorm backward raises RuntimeError."""
    dy, x, mean, rstd, weight, bias, mask = _backward_cases()[case]
    _assert_as_pytorch(
        lambda: OPS.group_norm_swish_backward(dy, x, mean, rstd, weight, bias, 3, 1.0, mask),
        lambda: _pytorch_group_norm_swish_backward(dy, x, mean, rstd, weight, bias, 3, mask),
        case,
    )


def _roi_align_cases():
    """name -> (call of a registered operator, None (it runs) or the message it must raise as a
    RuntimeError): what torchvision's kernels refuse (their exception type is RuntimeError) and
    what they take (empty results), and fastbwd's one limit torchvision does not have."""
    x, rois = _randn((2, 3, 9, 11), seed=84), _boxes()
    grad = _randn((4, 3, 2, 3), seed=85)

    def forward(input=x, boxes=rois, scale=0.8, height=2, width=3):
        return lambda: OPS.roi_align(input, boxes, scale, height, width, 2, True)

    def backward(gradient=grad, boxes=rois, scale=0.8, sizes=(2, 3, 9, 11)):
        return lambda: OPS.roi_align_backward(gradient, boxes, scale, 2, 3, *sizes, 2, True)

    return {
        "float64 boxes": (forward(boxes=rois.double()), r"boxes.dtype must equal input.dtype \(float32\)"),
        "int boxes": (forward(boxes=rois.int()), r"boxes.dtype must equal input.dtype"),
        "(K, 4) boxes": (forward(boxes=rois[:, 1:]), r"boxes must have shape \(K, 5\)"),
        "1-D boxes": (forward(boxes=rois[0]), r"boxes must have shape \(K, 5\)"),
        "boxes on another device": (forward(boxes=rois.to("meta")), "boxes must be on input's device"),
        "3-D input": (forward(input=x[0]), "input must be 4-D"),
        "5-D input": (forward(input=x[None]), "input must be 4-D"),
        "negative pooled height": (forward(height=-1), "negative dimension"),
        "spatial_scale 0 (fastbwd's limit)": (forward(scale=0.0), "spatial_scale must be greater than FLT_MIN"),
        "spatial_scale NaN (fastbwd's limit)": (forward(scale=float("nan")), "spatial_scale must be greater"),
        "pooled height 0": (forward(height=0), None),
        "no boxes": (forward(boxes=rois[:0]), None),
        "backward, float64 boxes": (backward(boxes=rois.double()), r"boxes.dtype must equal grad.dtype"),
        "backward, (K, 4) boxes": (backward(boxes=rois[:, 1:]), r"boxes must have shape \(K, 5\)"),
        "backward, 3-D grad": (backward(gradient=grad[0]), "grad must be 4-D"),
        "backward, grad of another pooled size": (backward(gradient=grad[..., :2]), "pooled_width"),
        "backward, grad of other channels": (backward(sizes=(2, 4, 9, 11)), "input_shape"),
        "backward, grad of other boxes": (backward(gradient=grad[:3]), "boxes.shape"),
        "backward, negative input size": (backward(sizes=(2, 3, -9, 11)), "negative dimension"),
        "backward, spatial_scale NaN": (backward(scale=float("nan")), "spatial_scale must be greater"),
        "backward, no boxes": (backward(gradient=grad[:0], boxes=rois[:0]), None),
    }


@pytest.mark.parametrize("case", list(_roi_align_cases()))
def test_roi_align_operators_refuse_with_torchvisions_exception_type(case):
    """torchvision's roi_align kernels raise RuntimeError for what they refuse (the operators
    raised fastbwd.ParamError before issue 55) and compute what they take: a pooled size of 0 or
    no boxes gives an empty output, and no gradient."""
    call, message = _roi_align_cases()[case]
    if message is None:
        result = call()
        assert result.numel() == 0 or not result.any()
        return
    with pytest.raises(RuntimeError, match=message) as raised:
        call()
    assert not isinstance(raised.value, fastbwd.ParamError)
