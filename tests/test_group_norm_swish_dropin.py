"""GroupNormSwish as a drop-in nn.GroupNorm + nn.SiLU (docs/semantics.md §7, issue 37): on every
input nn.GroupNorm takes (every rank, channels_last and channels_last_3d, views, empty batches,
every dtype and float32 parameters with half inputs) the same shape, dtype and strides, forward
and backward, and values as close to the float64 truth as PyTorch's own. PyTorch's own GroupNorm
tests (test/test_nn.py: general, one value per group, empty, NHWC/NDHWC, memory formats, CPU
mixed dtypes, numerics) ported, facts not code; the fake (meta) kernels' strides against the real
kernels'; and the behaviours the mutation audit found unpinned."""

import copy
import itertools
import math
import re

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fastbwd.torch as ft  # noqa: E402

OPS = torch.ops.fastbwd
HALF = (torch.float16, torch.bfloat16)


def _randn(shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def _pair(groups, channels, dtype=torch.float32, param_dtype=None, affine=True, seed=1):
    """GroupNormSwish and nn.GroupNorm + nn.SiLU with the same (non-trivial) parameters."""
    fused = ft.GroupNormSwish(groups, channels, affine=affine).to(param_dtype or dtype)
    if affine:
        with torch.no_grad():
            fused.weight.copy_(_randn((channels,), seed=seed).abs() + 0.5)
            fused.bias.copy_(_randn((channels,), seed=seed + 1))
    plain = nn.Sequential(nn.GroupNorm(groups, channels, affine=affine), nn.SiLU()).to(param_dtype or dtype)
    plain[0].load_state_dict(fused.state_dict())
    return fused, plain


def _oracle(x, groups, weight, bias, eps=1e-5):
    """nn.GroupNorm + SiLU in float64 (the parameters as given, the input's values)."""
    w = None if weight is None else weight.detach().double()
    b = None if bias is None else bias.detach().double()
    return F.silu(F.group_norm(x.detach().double(), groups, w, b, eps))


def _run(module, x, grad, parameters):
    """Output, and gradients of input and parameters (torch.autograd.grad: no accumulation)."""
    x = x.detach().requires_grad_()
    y = module(x)
    inputs = [x] + [p for p in parameters if p is not None and p.requires_grad]
    grads = torch.autograd.grad(y, inputs, grad) if y.numel() else [torch.zeros_like(t) for t in inputs]
    return y, grads


def _meta(t):
    return (t.shape, t.stride(), t.dtype)


def _close_as_pytorch(actual, pytorch, truth, what):
    """``actual`` is as close to ``truth`` as PyTorch's ``pytorch`` is: within twice its error,
    plus a rounding of the result's dtype at the values' scale (float32: a few; float64, whose
    truth is PyTorch's own arithmetic: 1e-12 relative)."""
    truth, actual, pytorch = truth.detach(), actual.detach(), pytorch.detach()
    scale = float(truth.abs().max()) if truth.numel() else 0.0
    ours = float((actual.double() - truth).abs().max()) if truth.numel() else 0.0
    theirs = float((pytorch.double() - truth).abs().max()) if truth.numel() else 0.0
    unit = torch.finfo(actual.dtype).eps
    slack = {torch.float64: 1e-12 * max(scale, 1.0), torch.float32: 8 * unit * max(scale, 1.0)}.get(
        actual.dtype, unit * scale
    )
    assert ours <= 2 * theirs + slack, f"{what}: error {ours:.3g}, PyTorch's {theirs:.3g} (scale {scale:.3g})"


def _compare(x, groups, dtype, param_dtype=None, affine=True, grad_memory_format=None):
    """GroupNormSwish against nn.GroupNorm + nn.SiLU on ``x`` (already in its layout):
    metadata equal; values as close to the float64 truth as PyTorch's."""
    x = x.to(dtype)
    fused, plain = _pair(groups, x.shape[1], dtype, param_dtype, affine)
    grad = _randn(x.shape, dtype, seed=7)
    if grad_memory_format is not None:
        grad = grad.contiguous(memory_format=grad_memory_format)
    y, grads = _run(fused, x, grad, [fused.weight, fused.bias])
    y_ref, grads_ref = _run(plain, x, grad, [plain[0].weight, plain[0].bias])
    assert _meta(y) == _meta(y_ref)
    assert [_meta(g) for g in grads] == [_meta(g) for g in grads_ref]
    if not x.numel():
        assert all(not g.any() for g in grads)
        return
    # the float64 truth: autograd of the composite from the same (rounded) values
    x64 = x.detach().double().requires_grad_()
    w64 = None if fused.weight is None else fused.weight.detach().double().requires_grad_()
    b64 = None if fused.bias is None else fused.bias.detach().double().requires_grad_()
    truth = F.silu(F.group_norm(x64, groups, w64, b64, 1e-5))
    truths = torch.autograd.grad(truth, [t for t in (x64, w64, b64) if t is not None], grad.double())
    _close_as_pytorch(y, y_ref, truth, "output")
    for name, ours, theirs, exact in zip(("dx", "dweight", "dbias"), grads, grads_ref, truths):
        _close_as_pytorch(ours, theirs, exact, name)


# ---- every input nn.GroupNorm takes ------------------------------------------------------------

LAYOUTS = {
    "rank2": lambda: _randn((3, 6)),
    "rank3": lambda: _randn((2, 6, 5)),
    "rank4": lambda: _randn((2, 6, 5, 7)),
    "rank5": lambda: _randn((2, 6, 3, 4, 5)),
    "rank6": lambda: _randn((2, 6, 2, 3, 2, 3)),
    "rank7": lambda: _randn((2, 6, 2, 1, 3, 2, 2)),
    "rank8": lambda: _randn((2, 6, 2, 1, 2, 2, 1, 3)),
    "rank9": lambda: _randn((2, 6, 2, 1, 2, 2, 1, 3, 2)),
    "channels_last": lambda: _randn((2, 6, 5, 7)).contiguous(memory_format=torch.channels_last),
    "channels_last_3d": lambda: _randn((2, 6, 3, 4, 5)).contiguous(memory_format=torch.channels_last_3d),
    "channels_last_1x1": lambda: _randn((3, 6, 1, 1)).contiguous(memory_format=torch.channels_last),
    "channels_last_3d_1x1x7": lambda: _randn((1, 6, 1, 1, 7)).contiguous(memory_format=torch.channels_last_3d),
    "sliced": lambda: _randn((2, 6, 10, 7))[:, :, ::2],
    "nwc": lambda: _randn((2, 5, 6)).transpose(1, 2),
    "permuted_5d": lambda: _randn((2, 6, 3, 5, 4)).permute(0, 1, 2, 4, 3),
    "expanded": lambda: _randn((1, 6, 3, 3)).expand(3, 6, 3, 3),
}
DTYPES = [
    (torch.float32, None),
    (torch.float64, None),
    (torch.float16, None),
    (torch.bfloat16, None),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
]


def _layout_dtype_cases():
    """Every layout with every dtype pair; a half format on a channels-last layout in the slow
    set: those compile the channels-last kernels' float16 and bfloat16 twins for this test alone
    (about 17 s of a cold quick run), while the quick set meets the half formats on the other
    layouts and the channels-last kernels in them through the operator's own tests."""
    for layout in LAYOUTS:
        for dtype, param_dtype in DTYPES:
            half_channels_last = dtype in (torch.float16, torch.bfloat16) and layout.startswith(
                ("channels_last", "nwc")
            )
            ids = "-".join(str(value).replace("torch.", "") for value in (layout, dtype, param_dtype))
            yield pytest.param(
                layout, dtype, param_dtype, id=ids, marks=[pytest.mark.slow] if half_channels_last else []
            )


@pytest.mark.covering
@pytest.mark.parametrize("layout, dtype, param_dtype", list(_layout_dtype_cases()))
def test_every_layout_and_dtype(layout, dtype, param_dtype):
    _compare(LAYOUTS[layout](), 3, dtype, param_dtype)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, memory_format",
    [
        ((0, 4, 2, 2), torch.contiguous_format),
        ((0, 4, 2, 2), torch.channels_last),
        ((2, 4, 0, 2), torch.contiguous_format),
        ((0, 4), torch.contiguous_format),
        ((0, 4, 3, 2, 2), torch.channels_last_3d),
        ((3, 4, 2, 0, 1), torch.contiguous_format),
    ],
)
def test_empty_inputs(shape, memory_format, dtype, affine):
    """An empty batch gives empty results; no values per channel, empty results on PyTorch 2.13
    and its RuntimeError on 2.14 and later, from both modules alike."""
    x = torch.zeros(shape).contiguous(memory_format=memory_format)
    if _refused_by_pytorch(shape):
        _compare_refusal(x.to(dtype), 2, affine=affine)
    else:
        _compare(x, 2, dtype, affine=affine)


#: PyTorch 2.14 refuses GroupNorm on an input with no channels or no values per channel; 2.13
#: returned empty results (the two releases CI runs; fastbwd asks PyTorch, not its version).
REFUSES_EMPTY = torch.__version__ >= "2.14"


def _refused_by_pytorch(shape):
    return REFUSES_EMPTY and (shape[1] == 0 or 0 in shape[2:])


def _compare_refusal(x, groups, affine=True):
    """nn.GroupNorm + nn.SiLU and GroupNormSwish raise the same exception type and message on
    ``x`` (also under no_grad), GroupNormSwish before any fastbwd kernel runs."""
    fused, plain = _pair(groups, x.shape[1], x.dtype, affine=affine)
    for grad_mode in (torch.enable_grad, torch.no_grad):
        with grad_mode(), pytest.raises(Exception) as expected:
            plain(x)
        with grad_mode(), pytest.raises(expected.type, match=f"^{re.escape(str(expected.value))}$"):
            fused(x)


@pytest.mark.parametrize(
    "shape", [(2, 4, 0, 2), (0, 4, 0, 2), (2, 0, 3, 3), (2, 0, 0, 3), (0, 0, 2), (3, 4, 2, 0, 1), (2, 4), (0, 4, 2)]
)
def test_the_empty_input_rule_is_the_installed_pytorchs(shape, monkeypatch):
    """What PyTorch does on an input with no channels or no values per channel (the one place
    2.13 and 2.14 differ for GroupNorm) the drop-ins do too, eager and compiled: refused by both
    with PyTorch's exception and message (compiled: when the graph is traced, before any
    kernel), or empty results from both. fastbwd asks PyTorch once; here the releases' facts."""
    from fastbwd.torch import _ops

    groups = 2 if shape[1] else 1
    x = torch.zeros(shape)
    try:
        F.group_norm(x, groups)
        error = None
    except Exception as raised:
        error = raised
    assert (error is not None) == _refused_by_pytorch(shape)
    if error is None:
        torch.testing.assert_close(ft.group_norm_swish(x, groups), F.silu(F.group_norm(x, groups)))
        return
    monkeypatch.setattr(_ops._Geometry, "forward", _no_kernel)
    torch._dynamo.reset()
    with pytest.raises(type(error), match=f"^{re.escape(str(error))}$"):
        ft.group_norm_swish(x, groups)
    # compiled, PyTorch's own refusal when the graph is traced (Dynamo wraps it in its own error)
    with pytest.raises(type(error), match=re.escape(str(error))):
        torch.compile(ft.group_norm_swish, backend="aot_eager")(x, groups)
    torch._dynamo.reset()


def _no_kernel(*args):
    raise AssertionError("a kernel ran on an input PyTorch refuses")


def test_issue_37_cases():
    """The two inputs the issue found: channels_last_3d (2, 9, 7, 11, 15) with 3 groups, and an
    empty batch (0, 4, 2, 2) (whose backward raised a TypeError)."""
    for dtype, param_dtype in DTYPES:
        _compare(_randn((2, 9, 7, 11, 15)).contiguous(memory_format=torch.channels_last_3d), 3, dtype, param_dtype)
    _compare(torch.zeros(0, 4, 2, 2), 2, torch.float32)


# ---- PyTorch's GroupNorm tests, ported ------------------------------------------------------------


@pytest.mark.parametrize("requires_grad", [True, False])
def test_general(requires_grad):
    """test_nn.py's _test_GroupNorm_general: with unit weight and zero bias the normalised groups
    have mean 0 and variance 1; with scale and bias the affine part undoes to them; the backward
    runs; channels not divisible by the groups are refused at construction. The normalised
    values are read through swish_scale=0, where Swish is y / 2; swish_scale=1 is SiLU of them."""
    good = {(1, 2, 3, 4): 2, (2, 3, 10): 3, (3, 1, 1, 1, 2): 1, (2, 6, 4, 2, 2): 3, (1, 256, 1, 1): 32}
    for shape, groups in good.items():
        x = torch.empty(*shape).uniform_(0, 10).requires_grad_(requires_grad)
        batch, channels = shape[:2]
        halved = ft.GroupNormSwish(groups, channels, eps=0, swish_scale=0.0)
        module = ft.GroupNormSwish(groups, channels, eps=0)
        output = 2 * halved(x)
        normalised = output.detach().view(batch, groups, -1)
        assert float(normalised.mean(-1).abs().mean()) < 1e-5
        assert abs(float(normalised.var(-1, unbiased=False).mean()) - 1) < 1e-5
        torch.testing.assert_close(module(x), F.silu(output), rtol=1e-5, atol=1e-5)
        module(x).backward(torch.randn(shape))
        scale, shift = torch.empty(channels).uniform_(0.2, 2), torch.empty(channels).uniform_(0.2, 2)
        with torch.no_grad():
            for m in (halved, module):
                m.weight.copy_(scale)
                m.bias.copy_(shift)
        output = 2 * halved(x)
        undone = (output.detach().view(batch, channels, -1) - shift.view(channels, 1)) / scale.view(channels, 1)
        undone = undone.view(batch, groups, -1)
        assert float(undone.mean(-1).abs().mean()) < 1e-5
        assert abs(float(undone.var(-1, unbiased=False).mean()) - 1) < 1e-5
        torch.testing.assert_close(module(x), F.silu(output), rtol=1e-5, atol=1e-5)
    bad = {(1, 2, 3, 4): 3, (2, 3, 10): 2, (3, 1, 1, 1, 2): 10, (2, 6, 4, 2, 2): 4}
    for shape, groups in bad.items():
        with pytest.raises(ValueError):
            nn.GroupNorm(groups, shape[1])
        with pytest.raises(ValueError):
            ft.GroupNormSwish(groups, shape[1])


def test_raises_error_if_one_value_per_group():
    x = torch.rand(10)[None, :, None]
    with pytest.raises(ValueError):
        nn.GroupNorm(10, 10)(x)
    with pytest.raises(ValueError):
        ft.GroupNormSwish(10, 10)(x)


def test_empty_module_input():
    """test_nn.py's test_GroupNorm_empty (common_nn's _test_module_empty_input): an empty batch
    runs forward and backward; every gradient is zero."""
    module = ft.GroupNormSwish(2, 4)
    x = torch.randn(0, 4, 2, 2, requires_grad=True)
    out = module(x)
    assert out.shape == x.shape
    out.backward(torch.rand_like(out))
    assert torch.equal(x.grad, torch.zeros_like(x))
    for parameter in module.parameters():
        assert torch.equal(parameter.grad, torch.zeros_like(parameter))


NHWC_SHAPES = [
    ((4, 8, 10, 10), 4, torch.channels_last),
    ((2, 30, 9, 9), 3, torch.channels_last),
    ((4, 8, 40, 40), 4, torch.channels_last),
    ((4, 40, 40, 40), 2, torch.channels_last),
    ((2, 30, 50, 50), 3, torch.channels_last),
    ((2, 60, 50, 50), 3, torch.channels_last),
    ((2, 9, 7, 11, 15), 3, torch.channels_last_3d),
    ((2, 9, 7, 200, 15), 3, torch.channels_last_3d),
    ((2, 60, 7, 200, 15), 3, torch.channels_last_3d),
]


@pytest.mark.parametrize("shapes", ["quick", pytest.param("all", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "dtype, mixed",
    [(dtype, False) for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)]
    + [(dtype, True) for dtype in HALF],
    ids=lambda value: {True: "float32-parameters", False: "same"}.get(value, str(value)),
)
def test_nhwc(dtype, mixed, shapes):
    """test_nn.py's test_groupnorm_nhwc: channels_last / channels_last_3d input and gradient give
    a result in that format, equal to the contiguous run's (weight and bias gradients too); and
    each to nn.GroupNorm + nn.SiLU's in the same layout."""
    for shape, groups, memory_format in NHWC_SHAPES if shapes == "all" else NHWC_SHAPES[:2] + NHWC_SHAPES[6:7]:
        x = _randn(shape, dtype, seed=11).contiguous(memory_format=memory_format)
        grad = _randn(shape, dtype, seed=12).contiguous(memory_format=memory_format)
        module, _ = _pair(groups, shape[1], dtype, torch.float32 if mixed else None)
        reference = copy.deepcopy(module)
        out, grads = _run(module, x, grad, [module.weight, module.bias])
        ref_out, ref_grads = _run(reference, x.contiguous(), grad.contiguous(), [reference.weight, reference.bias])
        assert out.is_contiguous(memory_format=memory_format) and ref_out.is_contiguous()
        assert grads[0].is_contiguous(memory_format=memory_format)
        tolerance = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2)
        torch.testing.assert_close(out, ref_out, rtol=tolerance, atol=tolerance)
        for ours, theirs in zip(grads, ref_grads):
            scale = float(theirs.abs().max())
            torch.testing.assert_close(ours, theirs, rtol=8e-3, atol=max(5e-4, tolerance) * max(scale, 1))
        _compare(x, groups, dtype, torch.float32 if mixed else None, grad_memory_format=memory_format)


@pytest.mark.parametrize("input_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("grad_format", [torch.contiguous_format, torch.channels_last])
def test_memory_format(input_format, grad_format):
    """test_nn.py's test_GroupNorm_memory_format (PyTorch issue 92166): input and gradient in
    either layout give the contiguous run's output and input gradient."""
    net_orig = ft.GroupNormSwish(2, 4)
    net = copy.deepcopy(net_orig)
    x_orig = torch.rand(2, 4, 4, 4, requires_grad=True)
    grad_orig = torch.rand(2, 4, 4, 4)
    x = x_orig.detach().clone().to(memory_format=input_format).requires_grad_(True)
    grad = grad_orig.detach().to(memory_format=grad_format)
    y = net(x)
    y.backward(grad)
    y_orig = net_orig(x_orig)
    y_orig.backward(grad_orig)
    torch.testing.assert_close(y, y_orig, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_orig.grad, rtol=1e-5, atol=1e-6)
    _compare(x.detach(), 2, torch.float32, grad_memory_format=grad_format)


@pytest.mark.parametrize(
    "shape, memory_format",
    [
        ((2, 8, 4, 4), torch.channels_last),
        ((1, 4, 2, 2, 3), torch.channels_last_3d),
        ((1, 4, 2, 1, 2, 1, 2, 1, 2, 2), torch.contiguous_format),  # above the kernels' rank: seen flat
    ],
    ids=["channels_last", "channels_last_3d", "rank_10"],
)
def test_the_output_may_be_modified_in_place_as_nn_group_norms(shape, memory_format):
    """The output is no view of the kernels' (N, *spatial, C) or flat result (autograd refuses
    an in-place op on a custom Function's output that is a view): an in-place op after the
    module works as after nn.GroupNorm + nn.SiLU, with PyTorch's gradients."""
    fused, plain = _pair(2, shape[1])
    x = _randn(shape).contiguous(memory_format=memory_format)
    grad = _randn(shape, seed=3).contiguous(memory_format=memory_format)
    results = []
    for module in (fused, plain):
        leaf = x.detach().requires_grad_()
        y = module(leaf)
        assert y.is_contiguous(memory_format=memory_format)
        y.mul_(2)
        y.backward(grad)
        results.append([y.detach(), leaf.grad, *(p.grad for p in module.parameters())])
    assert fused(x)._base is None
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def _misaligned(tensor):
    """A copy of ``tensor`` whose data starts 2 bytes off its dtype's alignment."""
    memory = bytearray(tensor.numel() * tensor.element_size() + 2)
    copy = torch.frombuffer(memory, dtype=tensor.dtype, offset=2, count=tensor.numel()).view(tensor.shape)
    copy.copy_(tensor)
    assert copy.data_ptr() % tensor.element_size() != 0
    return copy


@pytest.mark.parametrize("aligned_first", [True, False], ids=["after_an_aligned_call", "first"])
def test_a_misaligned_input_runs_as_nn_group_norms(aligned_first):
    """A tensor over misaligned memory (``torch.frombuffer`` at an odd offset) of a geometry
    whose prepared call was made for aligned ones, or the other way round: PyTorch's results
    (it once raised fastbwd's ParamError from the prepared forward)."""
    fused, plain = _pair(2, 8)
    x, grad = _randn((2, 8, 4, 4)), _randn((2, 8, 4, 4), seed=3)
    inputs = [x, _misaligned(x)] if aligned_first else [_misaligned(x), x]
    expected = _run(plain, x, grad, list(plain.parameters()))
    for input in inputs:
        for gradient in (grad, _misaligned(grad)):
            actual = _run(fused, input, gradient, list(fused.parameters()))
            for ours, theirs in zip([actual[0], *actual[1]], [expected[0], *expected[1]]):
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


MIXED_SHAPES = [
    ((1, 8, 4, 3), 2),
    ((1, 8, 3, 4), 4),
    ((4, 40, 40, 40), 2),
    ((4, 8, 40, 40), 4),
    ((1, 8, 40, 40), 4),
    ((1, 8, 40, 40), 2),
    ((1, 8, 50, 50), 2),
    ((1, 8, 50, 50), 4),
    ((1, 40, 50, 50), 2),
    ((1, 9, 3, 4, 5), 3),
    ((1, 60, 10, 10, 10), 3),
    ((1, 9, 10, 50, 50), 3),
    ((1, 60, 10, 50, 50), 3),
    ((1, 8, 65, 55), 2),
    ((1, 3, 65, 55), 1),
    ((1, 3, 20, 20), 1),
]


@pytest.mark.parametrize("shapes", ["quick", pytest.param("all", marks=pytest.mark.slow)])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_cpu_mixed_dtype(dtype, channels_last, shapes):
    """test_nn.py's _test_GroupNorm_cpu_mixed_dtype: half input with half parameters, half input
    with float32 parameters, float32 input with float32 parameters agree within the same bounds
    (outputs 5e-3; float32 parameters' gradients 1e-4 / 1e-5; the half runs' input gradients);
    each run also against nn.GroupNorm + nn.SiLU in its own configuration."""
    for shape, groups in MIXED_SHAPES if shapes == "all" else MIXED_SHAPES[:2] + MIXED_SHAPES[9:10]:
        memory_format = {4: torch.channels_last, 5: torch.channels_last_3d}[len(shape)]
        x = _randn(shape, dtype, seed=21)
        if channels_last:
            x = x.contiguous(memory_format=memory_format)
        half_module, _ = _pair(groups, shape[1], dtype, seed=22)
        mixed_module = copy.deepcopy(half_module).float()
        float_module = copy.deepcopy(mixed_module)
        grad = _randn(shape, dtype, seed=23)
        if channels_last:
            grad = grad.contiguous(memory_format=memory_format)
        out, (dx, dw, db) = _run(half_module, x, grad, [half_module.weight, half_module.bias])
        out2, (dx2, dw2, db2) = _run(mixed_module, x, grad, [mixed_module.weight, mixed_module.bias])
        out3, (dx3, dw3, db3) = _run(float_module, x.float(), grad.float(), [float_module.weight, float_module.bias])
        torch.testing.assert_close(out, out2, atol=5e-3, rtol=5e-3)
        torch.testing.assert_close(out2.float(), out3, atol=5e-3, rtol=5e-3)
        torch.testing.assert_close(dw2, dw3, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(db2, db3, atol=1e-5 * max(1, float(db3.abs().max())), rtol=1e-5)
        torch.testing.assert_close(dx2.float(), dx3, atol=5e-5 * max(1, float(dx3.abs().max())), rtol=5e-3)
        atol, rtol = (1e-2, 1.2e-1) if dtype == torch.bfloat16 else (5e-3, 1.5e-2)
        scale = max(1, float(dw2.abs().max()), float(db2.abs().max()))
        torch.testing.assert_close(dw, dw2.to(dtype), atol=atol * scale, rtol=rtol)
        torch.testing.assert_close(db, db2.to(dtype), atol=atol * scale, rtol=rtol)
        torch.testing.assert_close(dx, dx2, atol=atol, rtol=rtol)
    _compare(x, groups, dtype)
    _compare(x, groups, dtype, torch.float32)


def test_numeric():
    """test_nn.py's test_GroupNorm_numeric, at a tenth of its size (slow: the full one below):
    a rank-5 input against the formula, to 1e-5."""
    _numeric((1, 8, 64, 64, 18))


@pytest.mark.slow
def test_numeric_full_size():
    _numeric((1, 8, 256, 256, 72))


def _numeric(shape):
    batch, channels = shape[:2]
    groups = 2
    module = ft.GroupNormSwish(groups, channels)
    x = torch.rand(shape, generator=torch.Generator().manual_seed(31))
    y = module(x)
    view = x.view(batch, groups, -1)
    mean = view.mean(dim=-1, keepdim=True)
    var = view.var(dim=-1, unbiased=False, keepdim=True)
    expected = ((view - mean) / torch.sqrt(var + module.eps)).view(batch, channels, -1)
    expected = expected * module.weight.detach().view(channels, 1) + module.bias.detach().view(channels, 1)
    torch.testing.assert_close(y, F.silu(expected.view(shape)), rtol=0, atol=1e-5)


# ---- the fake kernels: the real kernels' strides -----------------------------------------------

FAKE_CASES = {
    "channels_last": ((2, 6, 4, 5), torch.channels_last, 3),
    "channels_last_3d": ((2, 6, 4, 5, 3), torch.channels_last_3d, 3),
    "channels_last_1x1": ((3, 4, 1, 1), torch.channels_last, 2),
    "empty": ((0, 4, 2, 2), torch.contiguous_format, 2),
    "empty_channels_last": ((0, 4, 2, 2), torch.channels_last, 2),
    "empty_spatial": ((2, 4, 0, 2), torch.contiguous_format, 2),
    "rank2": ((3, 4), torch.contiguous_format, 2),
    "rank9": ((2, 4, 1, 2, 1, 2, 1, 2, 1), torch.contiguous_format, 2),
    "sliced": ((2, 4, 6, 5), "sliced", 2),
    "nwc": ((2, 5, 4), "nwc", 2),
}


def _fake_case(name, dtype):
    shape, layout, groups = FAKE_CASES[name]
    if layout == "sliced":
        x = _randn((2, 4, 12, 5), dtype)[:, :, ::2]
    elif layout == "nwc":
        x = _randn((2, 5, 4), dtype).transpose(1, 2)
    else:
        x = _randn(shape, dtype).contiguous(memory_format=layout)
    return x, groups


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("dtype, param_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("case", list(FAKE_CASES))
def test_fake_kernels_give_the_real_kernels_strides(case, dtype, param_dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, groups = _fake_case(case, dtype)
    channels = x.shape[1]
    if _refused_by_pytorch(x.shape):  # the real kernel raises PyTorch's error: the fake one too
        refusal = "^Expected HxW to be greater than 0, got 0$"
        with pytest.raises(RuntimeError, match=refusal):
            OPS.group_norm_swish(x, None, None, groups, 1e-5, 1.0)
        with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=refusal):
            OPS.group_norm_swish(mode.from_tensor(x), None, None, groups, 1e-5, 1.0)
        return
    for weight, bias in ((_randn((channels,), param_dtype), _randn((channels,), param_dtype, 1)), (None, None)):
        dy = _randn(x.shape, dtype, 2)
        real = OPS.group_norm_swish(x, weight, bias, groups, 1e-5, 1.0)
        for mask in ([True, True, True], [True, False, True], [True, False, False]):
            real_grads = OPS.group_norm_swish_backward(dy, x, real[1], real[2], weight, bias, groups, 1.0, mask)
            with FakeTensorMode() as mode:
                fake_inputs = [None if t is None else mode.from_tensor(t) for t in (x, weight, bias, dy)]
                fx, fw, fb, fdy = fake_inputs
                fake = OPS.group_norm_swish(fx, fw, fb, groups, 1e-5, 1.0)
                fake_grads = OPS.group_norm_swish_backward(fdy, fx, fake[1], fake[2], fw, fb, groups, 1.0, mask)
            assert [_meta(t) for t in real + real_grads] == [_meta(t) for t in fake + fake_grads]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["channels_last_3d", "empty", "empty_channels_last", "rank9", "nwc"])
def test_opcheck(case):
    x, groups = _fake_case(case, torch.bfloat16)
    x = x.requires_grad_()
    weight = _randn((x.shape[1],), torch.float32).requires_grad_()
    bias = _randn((x.shape[1],), torch.float32, 1).requires_grad_()
    torch.library.opcheck(OPS.group_norm_swish, (x, weight, bias, groups, 1e-5, 1.0))
    _, mean, rstd = OPS.group_norm_swish(x, weight, bias, groups, 1e-5, 1.0)
    dy = _randn(x.shape, torch.bfloat16, 2).requires_grad_()
    torch.library.opcheck(OPS.group_norm_swish_backward, (dy, x, mean, rstd, weight, bias, groups, 1.0, [True] * 3))


# ---- what the mutation audit found unpinned --------------------------------------------------------


def test_no_weight_and_a_float32_bias_on_bfloat16_input():
    """weight=None with a float32 bias on bfloat16 input is mixed precision, as for F.group_norm:
    float32 statistics, and a float32 bias gradient as precise as PyTorch's (not rounded to
    bfloat16), from the function and from the module."""
    x = _randn((2, 6, 5, 5), torch.bfloat16, 41)
    bias = _randn((6,), torch.float32, 42).requires_grad_()
    _, mean, rstd = OPS.group_norm_swish(x, None, bias, 3, 1e-5, 1.0)
    _, mean_ref, rstd_ref = torch.native_group_norm(x, None, bias, 2, 6, 25, 3, 1e-5)
    assert mean.dtype == rstd.dtype == mean_ref.dtype == torch.float32
    torch.testing.assert_close(mean, mean_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-5, atol=1e-5)
    grad = _randn(x.shape, torch.bfloat16, 43)
    (dbias,) = torch.autograd.grad(ft.group_norm_swish(x, 3, None, bias), bias, grad)
    # PyTorch's own backward with weight=None and a bias requiring grad raises ("tensor does not
    # have a device", torch 2.13): its reference and the truth take an explicit unit weight
    ones = torch.ones(6)
    (dbias_ref,) = torch.autograd.grad(F.silu(F.group_norm(x, 3, ones, bias)), bias, grad)
    b64 = bias.detach().double().requires_grad_()
    truth = F.silu(F.group_norm(x.double(), 3, ones.double(), b64))
    (dbias_truth,) = torch.autograd.grad(truth, b64, grad.double())
    assert dbias.dtype == dbias_ref.dtype == torch.float32
    _close_as_pytorch(dbias, dbias_ref, dbias_truth, "dbias")
    assert not torch.equal(dbias, dbias.bfloat16().float())  # float32 precision, not bfloat16's
    module = ft.GroupNormSwish(3, 6, bias=True)
    module.weight = None
    module.bias = nn.Parameter(bias.detach().clone())
    (dbias_module,) = torch.autograd.grad(module(x), module.bias, grad)
    assert torch.equal(dbias_module, dbias)


def test_requires_grad_flipped_between_calls_of_one_geometry():
    fused, plain = _pair(3, 6)
    x = _randn((2, 6, 4, 4), seed=51)
    grad = _randn(x.shape, seed=52)
    for weight_grad, bias_grad in ((True, True), (True, False), (False, True), (False, False), (True, True)):
        for module in (fused, plain[0]):
            module.weight.requires_grad_(weight_grad)
            module.bias.requires_grad_(bias_grad)
            module.zero_grad(set_to_none=True)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        fused(xs[0]).backward(grad)
        plain(xs[1]).backward(grad)
        for p, q in zip(fused.parameters(), plain[0].parameters()):
            assert (p.grad is None) == (q.grad is None) == (not p.requires_grad)
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eps", [0.1, 1e-3, 0.0])
def test_double_backward_with_another_eps_is_pytorchs(eps):
    """create_graph=True differentiates PyTorch's composite with the module's own eps: the first
    derivatives (and the second) equal the composite's."""
    x = _randn((2, 6, 3, 3), torch.float64, 61).requires_grad_()
    weight = _randn((6,), torch.float64, 62).requires_grad_()
    bias = _randn((6,), torch.float64, 63).requires_grad_()
    grad = _randn(x.shape, torch.float64, 64)

    def first(function):
        y = function(x, 3, weight, bias, eps)
        return torch.autograd.grad(y, (x, weight, bias), grad, create_graph=True)

    def composite(x, groups, weight, bias, eps):
        return F.silu(F.group_norm(x, groups, weight, bias, eps))

    ours, theirs = first(lambda *a: ft.group_norm_swish(*a)), first(composite)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    second = torch.autograd.grad(sum(g.square().sum() for g in ours), (x, weight, bias))
    second_ref = torch.autograd.grad(sum(g.square().sum() for g in theirs), (x, weight, bias))
    for a, b in zip(second, second_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(
    "mean_shape", [(2, 4), (7,), (3, 3), (2, 3, 1)], ids=lambda s: "x".join(map(str, s)) or "scalar"
)
def test_other_statistics_after_a_good_call_of_the_same_geometry_are_pytorchs(mean_shape):
    """The prepared backward of a geometry never takes statistics of another shape for its own:
    those of another number of values raise PyTorch's own error (native_group_norm_backward's),
    those of N * G values in another shape give PyTorch's result, as PyTorch's operator does."""
    x = _randn((2, 6, 4, 4), seed=71)
    weight, bias = _randn((6,), seed=72), _randn((6,), seed=73)
    dy = _randn(x.shape, seed=74)
    _, mean, rstd = OPS.group_norm_swish(x, weight, bias, 3, 1e-5, 1.0)
    mask = [True, True, True]
    good = OPS.group_norm_swish_backward(dy, x, mean, rstd, weight, bias, 3, 1.0, mask)
    OPS.group_norm_swish_backward(dy, x, mean.flatten(), rstd.flatten(), weight, bias, 3, 1.0, mask)
    y = F.group_norm(x, 3, weight, bias)
    fits = math.prod(mean_shape) == mean.numel()
    other = (lambda s: s.reshape(mean_shape)) if fits else (lambda s: torch.zeros(mean_shape))
    for name, statistics in (("mean", (other(mean), rstd)), ("rstd", (mean, other(rstd)))):
        if not fits:
            with pytest.raises(RuntimeError, match=rf"^Expected {name}.numel\(\) == N \* group"):
                OPS.group_norm_swish_backward(dy, x, *statistics, weight, bias, 3, 1.0, mask)
            continue
        got = OPS.group_norm_swish_backward(dy, x, *statistics, weight, bias, 3, 1.0, mask)
        pytorchs = torch.ops.aten.native_group_norm_backward(
            torch.ops.aten.silu_backward(dy, y), x, *statistics, weight, 2, 6, 16, 3, mask
        )
        for g, p, first in zip(got, pytorchs, good):
            torch.testing.assert_close(g, p)  # PyTorch's kernels, on the output normalised with the statistics given
            torch.testing.assert_close(g, first)


# ---- errors, as nn.GroupNorm's ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "x_dtype, weight_dtype, bias_dtype",
    list(itertools.product(*[[torch.float32, torch.float64, torch.float16, torch.bfloat16]] * 3))
    + [
        (torch.bfloat16, None, torch.float32),
        (torch.float64, None, torch.float32),
        (torch.float16, torch.float32, None),
    ],
    ids=str,
)
def test_dtype_pairings_are_accepted_or_refused_as_nn_group_norm(x_dtype, weight_dtype, bias_dtype):
    x = _randn((2, 4, 3, 3), x_dtype)
    weight = None if weight_dtype is None else _randn((4,), weight_dtype, 1)
    bias = None if bias_dtype is None else _randn((4,), bias_dtype, 2)
    try:
        expected = F.silu(F.group_norm(x, 2, weight, bias))
    except RuntimeError as error:
        with pytest.raises(RuntimeError) as raised:
            ft.group_norm_swish(x, 2, weight, bias)
        assert str(raised.value) == str(error)
        return
    y = ft.group_norm_swish(x, 2, weight, bias)
    assert y.dtype == expected.dtype and y.stride() == expected.stride()
    tolerance = 2e-2 if x_dtype in HALF else 1e-5
    torch.testing.assert_close(y, expected, rtol=tolerance, atol=tolerance)
    assert math.isfinite(float(y.float().sum()))
