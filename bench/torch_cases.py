"""The PyTorch-bridge benchmark cases T1-T9 (bench/bench_torch.py and ``python3 -m bench``).

Each case builds, at full size (or ``quick`` small size), a pair of zero-argument callables over
the same tensors: ``fastbwd`` (through :mod:`fastbwd.torch`) and ``torch`` (plain PyTorch), plus
``check()``, which runs both once and asserts that their gradients agree. Only imported where
torch is installed.
"""

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import fastbwd
import fastbwd.torch as ft
from fastbwd.torch import _routing

from .inputs import roi_boxes
from .roi_baselines import torch_roi_align


@dataclass
class TorchCase:
    id: str
    label: str
    fastbwd: Callable[[], object]
    torch: Callable[[], object]
    check: Callable[[], None]
    target: str
    #: What ``check()`` found wrong with the baseline (not with fastbwd, which it asserts), if anything.
    note: str = ""


def _randn(shape, seed, dtype=torch.float32, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=dtype).requires_grad_(requires_grad)


@contextlib.contextmanager
def enabled_beside_plain_graphs(**options):
    """``ft.enabled(**options)`` without enable()'s notice of frames torch.compile compiled while
    fastbwd was disabled: the cases compile their plain side so, on purpose (each side under a
    code object of its own, :func:`_compiled`)."""
    with warnings.catch_warnings():  # only around entering: the notice is enable()'s
        warnings.filterwarnings("ignore", "fastbwd.torch.enable", UserWarning)
        stack = contextlib.ExitStack()
        stack.enter_context(ft.enabled(**options))
    with stack:
        yield


def _routed(function):
    """``function`` run with the routing enabled (and left disabled afterwards)."""

    def run(*args):
        with enabled_beside_plain_graphs():
            return function(*args)

    return run


def _sgd_step(model, inputs, target, forward=None):
    """One training step of ``model``: the MSE of ``model(*inputs)`` (or of ``forward(*inputs)``,
    a compiled call of it) against ``target``, its backward, and a plain SGD update; returns the
    step's gradients."""
    forward = forward or model

    def run():
        model.zero_grad(set_to_none=True)
        F.mse_loss(forward(*inputs), target).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-1e-3)
        return [p.grad for p in model.parameters()]

    return run


def _largest_relative_error(actual, expected):
    """The largest ``max |a - e| / max |e|`` over the pairs of gradients."""
    return max(
        float((a.detach().double() - e.detach().double()).abs().max()) / max(float(e.detach().abs().max()), 1e-30)
        for a, e in zip(actual, expected)
    )


def _assert_close(actual, expected, rtol, atol, what):
    """Each gradient within ``rtol`` of its own largest value, or ``atol`` of the largest of all
    (a gradient that is zero in exact arithmetic, like a bias before a norm, is rounding noise)."""
    actual, expected = [a.detach() for a in actual], [e.detach() for e in expected]
    overall = max(float(e.abs().max()) for e in expected)
    for index, (a, e) in enumerate(zip(actual, expected)):
        scale = float(e.abs().max())
        error = float((a.double() - e.double()).abs().max())
        assert error <= max(rtol * scale, atol * overall), (
            f"{what}: gradient {index} max error {error:.3g} (its scale {scale:.3g}, overall {overall:.3g})"
        )


def _routed_backward(id, label, forward, input_shape, target, seed, name):
    """T1/T2: the autograd backward of one routed op (``name``, fastbwd's function), enabled vs
    plain PyTorch: the forward made while enabled (under "auto" a call is routed when it is
    made, and its backward is then fastbwd's; the aten backward of a graph made without fastbwd
    stays PyTorch's unless the policy is "always")."""
    x = _randn(input_shape, seed, requires_grad=True)
    y = forward(x)
    with ft.enabled():
        y_routed = forward(x)
    g = _randn(y.shape, seed + 1)

    def backward():
        return torch.autograd.grad(y, x, g, retain_graph=True)

    def routed_backward():
        return torch.autograd.grad(y_routed, x, g, retain_graph=True)

    def check():
        served = _routing.SERVED[name]
        ours = _routed(routed_backward)()
        assert _routing.SERVED[name] == served + 1, f"{id}: fastbwd did not serve the backward"
        _assert_close(ours, backward(), 2e-5, 2e-6, id)

    return TorchCase(id, label, _routed(routed_backward), backward, check, target)


def _group_norm_swish_case(shape, groups, target):
    x = _randn(shape, 31, requires_grad=True)
    fused = ft.GroupNormSwish(groups, shape[1])
    plain = nn.Sequential(nn.GroupNorm(groups, shape[1]), nn.SiLU())
    with torch.no_grad():
        fused.weight.normal_(generator=torch.Generator().manual_seed(32))
        fused.bias.normal_(generator=torch.Generator().manual_seed(33))
        plain[0].load_state_dict(fused.state_dict())
    g = _randn(shape, 34)
    y_fused, y_plain = fused(x), plain(x)

    def fastbwd_backward():
        return torch.autograd.grad(y_fused, (x, fused.weight, fused.bias), g, retain_graph=True)

    def torch_backward():
        return torch.autograd.grad(y_plain, (x, plain[0].weight, plain[0].bias), g, retain_graph=True)

    def check():
        _assert_close(fastbwd_backward(), torch_backward(), 1e-4, 1e-5, "T3")

    return TorchCase(
        "T3",
        f"GroupNormSwish vs GroupNorm+SiLU backward {shape}, {groups} groups",
        fastbwd_backward,
        torch_backward,
        check,
        target,
    )


#: T6/T6f's shapes (issue 29): diffusion and segmentation activations, (x shape, groups).
MODULE_SHAPES = [
    ((8, 64, 32, 32), 32),
    ((8, 128, 16, 16), 32),
    ((8, 256, 16, 16), 32),
    ((8, 64, 64, 64), 32),
    ((8, 32, 128, 128), 16),
    ((8, 512, 32, 32), 32),
]
#: small versions of the six (the same ids T6.1-T6.6 and T6f.1-T6f.6)
#: The same six shapes with a batch of 2 (the main job's small shapes: the kernels, not the
#: per-call cost, decide the larger ones; the main job sums up rows under 0.1 ms apart).
MODULE_SHAPES_QUICK = [((2, *shape[1:]), groups) for shape, groups in MODULE_SHAPES]


def _module_case(index, shape, groups, forward_only, target):
    """T6 (forward + backward) or T6f (forward alone, as in training: input requiring grad) of
    ``GroupNormSwish`` against ``nn.GroupNorm`` + ``nn.SiLU`` with the same parameters."""
    x = _randn(shape, 61, requires_grad=True)
    fused = ft.GroupNormSwish(groups, shape[1])
    plain = nn.Sequential(nn.GroupNorm(groups, shape[1]), nn.SiLU())
    with torch.no_grad():
        fused.weight.normal_(generator=torch.Generator().manual_seed(62))
        fused.bias.normal_(generator=torch.Generator().manual_seed(63))
        plain[0].load_state_dict(fused.state_dict())
    g = _randn(shape, 64)

    def step(model, parameters):
        def run():
            y = model(x)
            if forward_only:
                return (y,)
            return (y,) + torch.autograd.grad(y, (x,) + parameters, g)

        return run

    fastbwd_step = step(fused, (fused.weight, fused.bias))
    torch_step = step(plain, (plain[0].weight, plain[0].bias))
    id = f"T6f.{index}" if forward_only else f"T6.{index}"

    def check():
        _assert_close(fastbwd_step(), torch_step(), 1e-4, 1e-5, id)

    what = "forward" if forward_only else "forward + backward"
    return TorchCase(
        id, f"GroupNormSwish vs GroupNorm+SiLU {what} {shape}, {groups} groups", fastbwd_step, torch_step, check, target
    )


#: T6t's shape (issue 39): a module so small that the per-call cost of the bridge is all there is.
TINY_MODULE_SHAPE = ((2, 32, 4, 4), 8)


def tiny_module_case():
    """T6t: GroupNormSwish forward + backward at :data:`TINY_MODULE_SHAPE` against nn.GroupNorm +
    nn.SiLU (the same size in quick and full runs); issue 52's target (the policy "auto" leaves it to PyTorch)."""
    return dataclasses.replace(_module_case(None, *TINY_MODULE_SHAPE, False, ">= 0.97x"), id="T6t")


def module_cases(quick=False, forward_only=False):
    """T6 (or T6f with ``forward_only``) on each of issue 29's six shapes (``quick``: small ones);
    issue 53 asks 1.5x of every forward + backward row (the real models' micro rows)."""
    shapes = MODULE_SHAPES_QUICK if quick else MODULE_SHAPES
    big = (8, 512, 32, 32)
    return [
        _module_case(index, shape, groups, forward_only, ">= 1.5x" if shape == big or not forward_only else "report")
        for index, (shape, groups) in enumerate(shapes, 1)
    ]


#: Issue 53's table: UNet and VAE activations of batch 1-2, 32 groups, each in float32,
#: channels_last and bfloat16 (T9.1-T9.6, suffixes c and b).
ISSUE53_SHAPES = [
    (2, 512, 4, 4),
    (2, 512, 8, 8),
    (2, 256, 16, 16),
    (2, 128, 32, 32),
    (2, 320, 32, 32),
    (1, 128, 64, 64),
]
#: Its variants: (suffix, dtype, memory format, what the label says).
ISSUE53_VARIANTS = (
    ("", torch.float32, torch.contiguous_format, "float32"),
    ("c", torch.float32, torch.channels_last, "float32 channels_last"),
    ("b", torch.bfloat16, torch.contiguous_format, "bfloat16"),
)


def _issue53_target(shape, suffix):
    """Issue 53's target of a T9 row: 2x (bfloat16 1.5x) from 16 x 16 on; the 4 x 4 and 8 x 8
    shapes 1.0x through the bridge (their kernels alone: K9, 1.5x)."""
    if shape[2] < 16:
        return ">= 1.0x"
    return ">= 1.5x" if suffix == "b" else ">= 2x"


def _issue53_tensors(shape, dtype, memory_format, seed):
    x = _randn(shape, seed).to(dtype).contiguous(memory_format=memory_format)
    g = _randn(shape, seed + 1).to(dtype).contiguous(memory_format=memory_format)
    return x, g


def _issue53_module_case(index, shape, suffix, dtype, memory_format, what):
    """T9: GroupNormSwish forward + backward against nn.GroupNorm + nn.SiLU (issue 53's table)."""
    groups = 32
    x, g = _issue53_tensors(shape, dtype, memory_format, 65)
    x.requires_grad_(True)
    fused = ft.GroupNormSwish(groups, shape[1]).to(dtype)
    plain = nn.Sequential(nn.GroupNorm(groups, shape[1]), nn.SiLU()).to(dtype)
    with torch.no_grad():
        fused.weight.normal_(generator=torch.Generator().manual_seed(66))
        fused.bias.normal_(generator=torch.Generator().manual_seed(67))
        plain[0].load_state_dict(fused.state_dict())

    def step(model, parameters):
        def run():
            y = model(x)
            return (y,) + torch.autograd.grad(y, (x,) + parameters, g)

        return run

    fastbwd_step = step(fused, (fused.weight, fused.bias))
    torch_step = step(plain, (plain[0].weight, plain[0].bias))
    id = f"T9.{index}{suffix}"

    def check():
        tolerance = (2e-2, 2e-2) if dtype == torch.bfloat16 else (1e-4, 1e-5)
        ours = fastbwd_step()
        assert ours[0].is_contiguous(memory_format=memory_format), f"{id}: y not in the input's memory format"
        _assert_close([t.float() for t in ours], [t.float() for t in torch_step()], *tolerance, id)

    return TorchCase(
        id,
        f"GroupNormSwish vs GroupNorm+SiLU forward + backward {shape}, 32 groups, {what}",
        fastbwd_step,
        torch_step,
        check,
        _issue53_target(shape, suffix),
    )


def _issue53_rows(quick):
    """``(index, shape, variant)`` of T9's rows: every shape and variant of issue 53's table;
    ``quick``: (2, 512, 4, 4) and (2, 256, 16, 16) (the ids of the others exist only in the full run)."""
    shapes = [ISSUE53_SHAPES[0], ISSUE53_SHAPES[2]] if quick else ISSUE53_SHAPES
    return [(ISSUE53_SHAPES.index(shape) + 1, shape, variant) for shape in shapes for variant in ISSUE53_VARIANTS]


def issue53_module_ids(quick=False):
    """T9's ids (:func:`issue53_module_cases`), known without building a case."""
    return tuple(f"T9.{index}{variant[0]}" for index, _, variant in _issue53_rows(quick))


def issue53_module_cases(quick=False):
    """T9 (issue 53): GroupNormSwish against GroupNorm + SiLU on the rows of :func:`_issue53_rows`."""
    return [_issue53_module_case(index, shape, *variant) for index, shape, variant in _issue53_rows(quick)]


def _issue53_kernel_case(index, shape, suffix, dtype, memory_format, what):
    """K9: the kernels alone at the 4 x 4 and 8 x 8 shapes, with no bridge: fastbwd's prepared
    NumPy forward and backward against PyTorch's four aten ops on the same values and layout
    (``native_group_norm`` + ``silu``, ``silu_backward`` + ``native_group_norm_backward``)."""
    from fastbwd.torch import _convert

    A = torch.ops.aten
    groups = 32
    batch, channels = shape[:2]
    positions = shape[2] * shape[3]
    x, dy = _issue53_tensors(shape, dtype, memory_format, 95)
    gamma, beta = _randn((channels,), 96).to(dtype), _randn((channels,), 97).to(dtype)
    arrays = [_convert.as_array(t) for t in (x, dy, gamma, beta)]
    x_a, dy_a, gamma_a, beta_a = arrays
    forward = fastbwd.group_norm_swish.prepare(x_a, gamma_a, beta_a, groups)
    _, mean_a, rstd_a = forward(x_a, gamma_a, beta_a)
    backward = fastbwd.group_norm_swish_backward.prepare(dy_a, mean_a, rstd_a, x_a, gamma_a, beta_a, groups)

    def fastbwd_call():
        y, mean, rstd = forward(x_a, gamma_a, beta_a)
        return (y,) + backward(dy_a, mean, rstd, x_a, gamma_a, beta_a)

    def torch_call():
        normalised, mean, rstd = A.native_group_norm(x, gamma, beta, batch, channels, positions, groups, 1e-5)
        y = A.silu(normalised)
        grad = A.silu_backward(dy, normalised)
        return (y,) + tuple(
            A.native_group_norm_backward(
                grad, x, mean, rstd, gamma, batch, channels, positions, groups, [True, True, True]
            )
        )

    id = f"K9.{index}{suffix}"

    def check():
        tolerance = (2e-2, 2e-2) if dtype == torch.bfloat16 else (1e-4, 1e-5)
        ours = [_convert.as_tensor(a).float().reshape(t.shape) for a, t in zip(fastbwd_call(), torch_call())]
        _assert_close(ours, [t.float() for t in torch_call()], *tolerance, id)

    return TorchCase(
        id,
        f"group_norm_swish + backward, prepared, {shape}, 32 groups, {what} vs the 4 aten ops",
        fastbwd_call,
        torch_call,
        check,
        ">= 1.5x",
    )


def issue53_kernel_cases(quick=False):
    """K9 (issue 53): the kernels alone at the 4 x 4 and 8 x 8 shapes; ``quick``: 4 x 4."""
    shapes = ISSUE53_SHAPES[:1] if quick else ISSUE53_SHAPES[:2]
    return [
        _issue53_kernel_case(index, shape, *variant)
        for index, shape in enumerate(shapes, 1)
        for variant in ISSUE53_VARIANTS
    ]


def _roi_align_case(input_shape, num_boxes, target):
    """T4: forward + backward of fastbwd.torch.roi_align against the pure-PyTorch formulation."""
    spatial_scale, sampling_ratio, aligned, pooled = 0.25, 2, True, 7
    x = _randn(input_shape, 41, requires_grad=True)
    boxes = torch.from_numpy(roi_boxes(num_boxes, input_shape, spatial_scale))
    g = _randn((num_boxes, input_shape[1], pooled, pooled), 42)

    def fastbwd_step():
        y = ft.roi_align(x, boxes, pooled, spatial_scale, sampling_ratio, aligned)
        return (y,) + torch.autograd.grad(y, x, g)

    def torch_step():
        y = torch_roi_align(x, boxes, pooled, pooled, spatial_scale, sampling_ratio, aligned)
        return (y,) + torch.autograd.grad(y, x, g)

    def check():
        _assert_close(fastbwd_step(), torch_step(), 1e-4, 1e-5, "T4")

    return TorchCase(
        "T4",
        f"roi_align forward + backward, input {input_shape}, {num_boxes} boxes 7x7 vs pure PyTorch",
        fastbwd_step,
        torch_step,
        check,
        target,
    )


def _roi_align_channels_last_case(input_shape, num_boxes, target):
    """T4-NHWC (issue 40): T4 on a channels_last feature map (fastbwd's NHWC kernels both ways)
    against T4 on the same values in NCHW memory, both through fastbwd.torch.roi_align."""
    spatial_scale, sampling_ratio, aligned, pooled = 0.25, 2, True, 7
    x = _randn(input_shape, 41, requires_grad=True)
    x_cl = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    boxes = torch.from_numpy(roi_boxes(num_boxes, input_shape, spatial_scale))
    g = _randn((num_boxes, input_shape[1], pooled, pooled), 42)
    g_cl = g.contiguous(memory_format=torch.channels_last)

    def step(x, g):
        def run():
            y = ft.roi_align(x, boxes, pooled, spatial_scale, sampling_ratio, aligned)
            return (y,) + torch.autograd.grad(y, x, g)

        return run

    channels_last_step, nchw_step = step(x_cl, g_cl), step(x, g)

    def check():
        ours, theirs = channels_last_step(), nchw_step()
        assert ours[1].is_contiguous(memory_format=torch.channels_last), "T4-NHWC: gradient not channels_last"
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), "T4-NHWC: channels_last results differ from the NCHW ones"

    return TorchCase(
        "T4-NHWC",
        f"roi_align forward + backward, channels_last input {input_shape}, {num_boxes} boxes 7x7 vs T4 (NCHW)",
        channels_last_step,
        nchw_step,
        check,
        target,
    )


class DecoderBlock(nn.Module):
    """T5's block: conv3x3 -> GroupNorm+Swish -> bilinear x2 -> replication pad -> conv3x3 ->
    avg-pool. ``fused`` picks GroupNormSwish (else nn.GroupNorm + nn.SiLU)."""

    def __init__(self, channels, fused):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = ft.GroupNormSwish(32, channels) if fused else nn.Sequential(nn.GroupNorm(32, channels), nn.SiLU())
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.pad = nn.ReplicationPad2d(1)
        self.conv2 = nn.Conv2d(channels, channels, 3)
        self.pool = nn.AvgPool2d(2)

    def forward(self, x):
        return self.pool(self.conv2(self.pad(self.up(self.norm(self.conv1(x))))))


def _training_step_case(batch, channels, size, target):
    torch.manual_seed(35)
    fused, plain = DecoderBlock(channels, True), DecoderBlock(channels, False)
    plain.load_state_dict(fused.state_dict(), strict=False)
    plain.norm[0].load_state_dict(fused.norm.state_dict())
    x = _randn((batch, channels, size, size), 36)
    target_y = _randn((batch, channels, size, size), 37)

    fastbwd_step, torch_step = _routed(_sgd_step(fused, (x,), target_y)), _sgd_step(plain, (x,), target_y)

    def check():
        # Gradients of one step from the same parameters (the steps above also update them).
        plain.load_state_dict(fused.state_dict(), strict=False)
        plain.norm[0].load_state_dict(fused.norm.state_dict())
        _assert_close(fastbwd_step(), torch_step(), 1e-3, 1e-4, "T5")

    return TorchCase(
        "T5",
        f"training step, decoder block (batch {batch}, {channels} ch, {size}x{size})",
        fastbwd_step,
        torch_step,
        check,
        target,
    )


def cases(quick=False, ids=None):
    """T1-T5 (issue 11's table), T6/T6f (GroupNormSwish on six shapes), T7 and T8; ``quick``
    uses small shapes; ``ids``: only the cases of those ids, the others not built (:data:`CASE_IDS`
    lists them all, in order)."""
    wanted = [
        case for names, build in _case_builders(quick) if ids is None or set(names) & set(ids) for case in build()
    ]
    return [case for case in wanted if ids is None or case.id in ids]


def _case_builders(quick):
    """(the ids, a function building their cases) for each of :func:`cases`' groups, in order."""
    if quick:
        # about a million elements: the kernels, not Python's per-call cost, decide
        up, pool, norm, roi, block = (
            (4, 16, 64, 64),
            (4, 64, 56, 56),
            ((4, 128, 32, 32), 32),
            ((2, 64, 50, 76), 128),
            (2, 32, 32),
        )
    else:
        up, pool, norm, roi, block = (
            (8, 64, 64, 64),
            (32, 128, 56, 56),
            ((8, 512, 32, 32), 32),
            ((2, 256, 200, 304), 512),
            (8, 64, 64),
        )
    modules = tuple(f"T6.{index}" for index in range(1, len(MODULE_SHAPES) + 1))
    return [
        (
            ("T1",),
            lambda: [
                _routed_backward(
                    "T1",
                    f"F.interpolate bilinear x2 backward {up}",
                    lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
                    up,
                    ">= 5x",
                    21,
                    "upsample_bilinear2d_backward",
                )
            ],
        ),
        (
            ("T2",),
            lambda: [
                _routed_backward(
                    "T2",
                    f"F.avg_pool2d k3 s2 p1 backward {pool}",
                    lambda x: F.avg_pool2d(x, 3, 2, 1),
                    pool,
                    ">= 3x",
                    23,
                    "avg_pool2d_backward",
                )
            ],
        ),
        (("T3",), lambda: [_group_norm_swish_case(*norm, ">= 1.4x")]),
        (("T4",), lambda: [_roi_align_case(*roi, ">= 10x")]),
        (("T4-NHWC",), lambda: [_roi_align_channels_last_case(*roi, ">= 2.5x")]),
        (("T5",), lambda: [_training_step_case(*block, "report")]),
        (modules, lambda: module_cases(quick)),
        (issue53_module_ids(quick), lambda: issue53_module_cases(quick)),
        (("T6t",), lambda: [tiny_module_case()]),
        (tuple(name.replace("T6.", "T6f.") for name in modules), lambda: module_cases(quick, forward_only=True)),
        (
            ("T7",),
            lambda: [_unet_training_case(*((2, 32, (16, 32), 8) if quick else (4, 64, (32, 64, 128), 16)), ">= 1.0x")],
        ),
        (
            ("T8",),
            lambda: [
                _diffusion_unet_case(
                    *((2, 32, dict(block_out_channels=(8, 16, 32), norm_num_groups=4)) if quick else (8, 32, {})),
                    "every pair fused; >= 1.0x",
                )
            ],
        ),
    ]


#: Every id of :func:`cases` in a quick run, in order (a full run has more T9 rows): known without building a case.
CASE_IDS = tuple(name for names, _ in _case_builders(quick=True) for name in names)


@dataclass
class OverheadCase:
    """One routed operator on a tiny input: the aten ``.grad_input`` call (served by fastbwd
    while the routing is enabled, by PyTorch's own kernel while it is disabled) and the public
    fastbwd function with ``out=`` on the same memory."""

    id: str
    label: str
    aten: Callable[[], object]
    direct: Callable[[], object]


def overhead_cases():
    """The per-call overhead of the routing (issue 11): each routed operator on a tiny input
    (2 x 3 planes of about 10 x 10), where the kernels take a few microseconds."""
    arrays, aten = _tiny_inputs()
    calls = []
    for id, label, name in _TINY_CALLS:
        function, arguments = getattr(fastbwd, name), _tiny_arguments(id, arrays)

        def direct(function=function, arguments=arguments, out=arrays["out"]):
            return function(*arguments, out=out)

        calls.append(OverheadCase(id, label, aten[id], direct))
    return calls


def _group_norm_swish_tiny():
    """O4's and O5's inputs (:data:`TINY_MODULE_SHAPE`: NumPy arrays, as a NumPy caller has
    them, and the same values as tensors) and PyTorch's own ops on them: ``native_group_norm`` +
    ``silu``, and ``silu_backward`` + ``native_group_norm_backward`` from the forward's output,
    as autograd runs them (fastbwd's backward recomputes that output). All three gradients both
    ways. Returns ``(forward arrays, backward arrays, groups, torch_forward, torch_backward)``."""
    A = torch.ops.aten
    shape, groups = TINY_MODULE_SHAPE
    batch, channels, positions = shape[0], shape[1], shape[2] * shape[3]
    x, dy = _randn(shape, 91), _randn(shape, 92)
    gamma, beta = _randn((channels,), 93), _randn((channels,), 94)
    x_a, dy_a, gamma_a, beta_a = (t.numpy() for t in (x, dy, gamma, beta))
    _, mean_a, rstd_a = fastbwd.group_norm_swish(x_a, gamma_a, beta_a, groups)
    normalised, mean, rstd = A.native_group_norm(x, gamma, beta, batch, channels, positions, groups, 1e-5)

    def torch_forward():
        y, mean, rstd = A.native_group_norm(x, gamma, beta, batch, channels, positions, groups, 1e-5)
        return A.silu(y), mean, rstd

    def torch_backward():
        grad = A.silu_backward(dy, normalised)
        return A.native_group_norm_backward(
            grad, x, mean, rstd, gamma, batch, channels, positions, groups, [True, True, True]
        )

    return (x_a, gamma_a, beta_a), (dy_a, mean_a, rstd_a, x_a, gamma_a, beta_a), groups, torch_forward, torch_backward


def _checked(id, fastbwd_call, torch_call):
    def check():
        results = [torch.from_numpy(a).reshape(e.shape) for a, e in zip(fastbwd_call(), torch_call())]
        _assert_close(results, torch_call(), 1e-4, 1e-5, id)

    return check


def direct_cases():
    """O1-O3 (:func:`tiny_direct_cases`), and O4 and O5 (issue 39): a warm direct call of
    fastbwd's GroupNorm+Swish forward and backward on :data:`TINY_MODULE_SHAPE` against
    PyTorch's own ops on the same values (:func:`_group_norm_swish_tiny`)."""
    forward_arrays, backward_arrays, groups, torch_forward, torch_backward = _group_norm_swish_tiny()

    def fastbwd_forward():
        return fastbwd.group_norm_swish(*forward_arrays, groups)

    def fastbwd_backward():
        return fastbwd.group_norm_swish_backward(*backward_arrays, groups)

    where = f"{TINY_MODULE_SHAPE[0]}, {groups} groups"
    return (
        tiny_direct_cases()
        + issue53_kernel_cases()
        + [
            TorchCase(
                "O4",
                f"group_norm_swish {where} vs native_group_norm + silu",
                fastbwd_forward,
                torch_forward,
                _checked("O4", fastbwd_forward, torch_forward),
                ">= 1.0x",
            ),
            TorchCase(
                "O5",
                f"group_norm_swish_backward {where} vs silu_backward + native_group_norm_backward",
                fastbwd_backward,
                torch_backward,
                _checked("O5", fastbwd_backward, torch_backward),
                ">= 1.0x",
            ),
        ]
    )


def _tiny_inputs():
    """The tiny inputs of the O rows (issue 46's table): PyTorch tensors and, for fastbwd, NumPy
    arrays over the same memory (as a NumPy caller has them), and the aten calls of each."""
    from fastbwd.torch import _convert

    A = torch.ops.aten
    x = _randn((2, 3, 8, 10), 51)
    grad_input = torch.empty_like(x)
    up, pool, pad = _randn((2, 3, 16, 20), 52), _randn((2, 3, 4, 5), 53), _randn((2, 3, 10, 14), 54)
    arrays = dict(zip(("x", "out", "up", "pool", "pad"), map(_convert.as_array, (x, grad_input, up, pool, pad))))
    aten = {
        "O1": lambda: A.upsample_bilinear2d_backward.grad_input(
            up, [16, 20], [2, 3, 8, 10], False, None, None, grad_input=grad_input
        ),
        "O2": lambda: A.avg_pool2d_backward.grad_input(
            pool, x, [3, 3], [2, 2], [1, 1], False, True, None, grad_input=grad_input
        ),
        "O3": lambda: A.replication_pad2d_backward.grad_input(pad, x, [2, 2, 1, 1], grad_input=grad_input),
    }
    return arrays, aten


#: The O rows' fastbwd calls: (id, label, function, its arguments but ``out``), on _tiny_inputs' arrays.
_TINY_CALLS = (
    ("O1", "upsample_bilinear2d_backward (2,3,16,20) -> (2,3,8,10)", "upsample_bilinear2d_backward"),
    ("O2", "avg_pool2d_backward k3 s2 p1, input (2,3,8,10)", "avg_pool2d_backward"),
    ("O3", "replication_pad2d_backward pad (2,2,1,1), input (2,3,8,10)", "replication_pad2d_backward"),
)


def _tiny_arguments(id, a):
    return {
        "O1": (a["up"], [16, 20], [2, 3, 8, 10], False, None, None),
        "O2": (a["pool"], a["x"], [3, 3], [2, 2], [1, 1], False, True, 0),
        "O3": (a["pad"], a["x"], [2, 2, 1, 1]),
    }[id]


def tiny_direct_cases():
    """O1-O3 (issue 46): a warm direct call of each routed operator's fastbwd function on its
    tiny input, with ``out=`` (:func:`overhead_cases`' direct calls), against PyTorch's own
    ``.grad_input`` op on the same values (the routing disabled, as it is in the main job)."""
    result = []
    for case in overhead_cases():

        def check(case=case):
            assert not ft.is_enabled(), "the baseline must be PyTorch's own kernel"
            _assert_close([torch.from_numpy(case.direct().copy())], [case.aten()], 1e-5, 1e-6, case.id)

        label = f"{case.label} vs PyTorch's .grad_input op"
        result.append(TorchCase(case.id, label, case.direct, case.aten, check, ">= 1.0x"))
    return result


@dataclass
class PreparedCase:
    """A prepared call (``function.prepare``) on a tiny input against PyTorch's own op(s), and
    the bare kernel call it ends in (the kernels' plan's ``run`` on the kernel operands and
    result views it was last given): what the prepared call adds is their difference."""

    id: str
    label: str
    fastbwd: Callable[[], object]
    torch: Callable[[], object]
    kernel: Callable[[], object]
    check: Callable[[], None]
    target: str


def bare_kernel(prepared, *arrays, **kwargs):
    """A zero-argument call of ``prepared``'s kernels' plan on the arguments its ``run`` gave
    them in one call of ``prepared(*arrays, **kwargs)`` (the same operands, the same result
    memory): the kernel call alone, what no Python layer can avoid."""
    kernels = prepared.plan.kernels
    kind = type(kernels)
    original = kind.run
    captured = []

    def capture(self, *args):
        captured.append(args)
        return original(self, *args)

    kind.run = capture
    try:
        prepared(*arrays, **kwargs)
    finally:
        kind.run = original
    (args,) = captured
    return lambda: kernels.run(*args)


def prepared_cases():
    """O1p-O5p (issue 46): each O row's call prepared once (``function.prepare``, aclnn's
    two-phase call) and then run on its arrays, against the same PyTorch op(s); the target is
    2x PyTorch and at most 1 us over the bare kernel call."""
    arrays, aten = _tiny_inputs()
    result = []
    target = ">= 2x; overhead <= 1 us"
    for id, label, name in _TINY_CALLS:
        arguments = _tiny_arguments(id, arrays)
        prepared = getattr(fastbwd, name).prepare(*arguments, out=arrays["out"])
        taken = tuple(a for a in arguments if isinstance(a, type(arrays["out"])))

        def call(prepared=prepared, taken=taken, out=arrays["out"]):
            return prepared(*taken, out=out)

        def check(call=call, torch_call=aten[id], id=id):
            _assert_close([torch.from_numpy(call().copy())], [torch_call()], 1e-5, 1e-6, id + "p")

        kernel = bare_kernel(prepared, *taken, out=arrays["out"])
        result.append(PreparedCase(id + "p", f"{label}, prepared", call, aten[id], kernel, check, target))
    forward_arrays, backward_arrays, groups, torch_forward, torch_backward = _group_norm_swish_tiny()
    where = f"{TINY_MODULE_SHAPE[0]}, {groups} groups"
    for id, function, arrays, torch_call, label in (
        ("O4p", fastbwd.group_norm_swish, forward_arrays, torch_forward, "vs native_group_norm + silu"),
        (
            "O5p",
            fastbwd.group_norm_swish_backward,
            backward_arrays,
            torch_backward,
            "vs silu_backward + native_group_norm_backward",
        ),
    ):
        prepared = function.prepare(*arrays, groups)

        def call(prepared=prepared, arrays=arrays):
            return prepared(*arrays)

        label = f"{function.__name__} {where}, prepared, {label}"
        kernel = bare_kernel(prepared, *arrays)
        result.append(PreparedCase(id, label, call, torch_call, kernel, _checked(id, call, torch_call), target))
    return result


def measure_overhead(case, calls=2000):
    """Median microseconds of ``case``'s three ways, interleaved in rounds of 100 calls so that
    a noisy neighbour slows them alike: ``{"routed": ..., "direct": ..., "torch": ...}``, and
    under ``"rounds"`` each way's per-round medians (us; their spread is the measurement's
    noise). Checks first that the routed call is served and equals the direct one bitwise. The
    routed way is the aten kernels' of the policy ``"always"``; the routing and the policy are
    left as they were found."""
    import time

    import numpy as np

    from fastbwd.torch import _routing

    was_enabled, policy = ft.is_enabled(), ft.policy()
    timings = {"routed": [], "direct": [], "torch": []}
    rounds = {way: [] for way in timings}
    try:
        ft.enable(policy="always")  # the aten kernels' cost (the policy "auto" registers none)
        served = _routing.SERVED.copy()
        routed_result = case.aten().clone()
        assert _routing.SERVED - served, f"{case.id}: the routed call was not served by fastbwd"
        case.direct()
        assert torch.equal(routed_result, case.aten()), f"{case.id}: routed and direct results differ"
        for _ in range(max(1, calls // 100)):
            for way, enabled, function in (
                ("routed", True, case.aten),
                ("direct", True, case.direct),
                ("torch", False, case.aten),
            ):
                (ft.enable if enabled else ft.disable)()
                for _ in range(100):
                    start = time.perf_counter()
                    function()
                    timings[way].append(time.perf_counter() - start)
                rounds[way].append(float(np.median(timings[way][-100:])) * 1e6)
    finally:
        ft.set_policy(policy)
        (ft.enable if was_enabled else ft.disable)()
    return {way: float(np.median(values)) * 1e6 for way, values in timings.items()} | {"rounds": rounds}


def _unet_training_case(batch, size, channels, groups, target):
    """T7: a training step of the small UNet of bench/models/torch_unet.py (GroupNorm +
    SiLU inside its blocks' forward()), plain PyTorch vs ``fuse_group_norm_swish`` + ``enabled()``
    (bilinear upsampling and avg-pool backward routed to fastbwd)."""
    import copy

    from .models.torch_unet import SmallUNet

    torch.manual_seed(71)
    plain = SmallUNet(3, channels, 64, groups)
    fused = copy.deepcopy(plain)
    x, temb = _randn((batch, 3, size, size), 72), _randn((batch, 64), 73)
    report = ft.fuse_group_norm_swish(fused, (x, temb))
    norms = report.count + len(report.skipped)
    target_y = _randn((batch, 3, size, size), 74)

    fastbwd_step = _routed(_sgd_step(fused, (x, temb), target_y))
    torch_step = _sgd_step(plain, (x, temb), target_y)

    def check():
        # One step's gradients from the same parameters (the steps also update them); then the
        # fused model's output against the plain one's.
        plain.load_state_dict(fused.state_dict())
        with torch.no_grad():
            _assert_close([_routed(lambda: fused(x, temb))()], [plain(x, temb)], 1e-4, 1e-5, "T7 output")
        _assert_close(fastbwd_step(), torch_step(), 1e-3, 1e-4, "T7")

    return TorchCase(
        "T7",
        f"training step, small UNet (batch {batch}, {size}x{size}, {channels}): "
        f"{report.count} of {norms} GroupNorms fused",
        fastbwd_step,
        torch_step,
        check,
        target,
    )


def _diffusion_unet_case(batch, size, config, target):
    """T8 (issue 37): a training step of the UNet of bench/models/torch_diffusion.py, written as diffusion
    libraries write theirs (resnet blocks with ``*args, **kwargs``, one shared SiLU, a shape
    branch, attention, a top-level forward symbolic tracing cannot run), plain PyTorch vs
    ``fuse_group_norm_swish`` (one example forward) + ``enabled()``. Every GroupNorm -> SiLU pair
    must be fused (all but the attention's GroupNorm)."""
    import copy

    from .models import torch_diffusion as D

    config = {**D.T8_CONFIG, **config}
    plain = D.t8_model(81, **config)
    fused = copy.deepcopy(plain)
    sample, timestep = D.unet_inputs(batch, size, seed=82)
    target_y = _randn(sample.shape, 83)
    report = ft.fuse_group_norm_swish(fused, (sample, timestep))
    pairs, norms = D.count_pairs(config["block_out_channels"], config["layers_per_block"])
    assert report.count == pairs and len(report.skipped) == norms - pairs, report

    def prediction(model, sample, timestep):
        return model(sample, timestep).sample

    fastbwd_step = _routed(_sgd_step(fused, (sample, timestep), target_y, lambda *a: prediction(fused, *a)))
    torch_step = _sgd_step(plain, (sample, timestep), target_y, lambda *a: prediction(plain, *a))

    def check():
        # One step's gradients from the same parameters (the steps also update them), and the
        # fused model's output against the plain one's.
        plain.load_state_dict(fused.state_dict())
        with torch.no_grad():
            output = _routed(lambda: prediction(fused, sample, timestep))()
            _assert_close([output], [prediction(plain, sample, timestep)], 1e-4, 1e-5, "T8 output")
        _assert_close(fastbwd_step(), torch_step(), 1e-3, 1e-4, "T8")

    levels = len(config["block_out_channels"])
    return TorchCase(
        "T8",
        f"training step, diffusion UNet (batch {batch}, {size}x{size}, {levels} levels): "
        f"{report.count} of {norms} GroupNorms fused",
        fastbwd_step,
        torch_step,
        check,
        target,
    )


# ---- torch.compile: C1-C9 --------------------------------------------------------------------


def _compiled(function, name):
    """``torch.compile`` of a call of ``function`` through a code object of its own (named
    ``name``): Dynamo keeps compiled graphs per code object, so the graph compiled with fastbwd
    enabled and the one compiled without it never stand in for each other."""

    def call(*args):
        return function(*args)

    call.__code__ = call.__code__.replace(co_name=name)
    return torch.compile(call)


def _compiled_backward_case(id, label, module, input_shape, target, seed):
    """C1, C2, C4: forward + backward of ``module`` compiled with fastbwd (enabled before its first
    call, and while it runs) against ``module`` compiled without."""
    x = _randn(input_shape, seed, requires_grad=True)
    g = _randn(module(x).shape, seed + 1)
    parameters = [x, *module.parameters()]

    def step(forward):
        return lambda: torch.autograd.grad(forward(x), parameters, g)

    with_fastbwd = _routed(step(_compiled(module, f"{id}_fastbwd")))
    plain = step(_compiled(module, f"{id}_plain"))

    def check():
        expected = _routed(step(module))()
        _assert_close(with_fastbwd(), expected, 1e-4, 1e-5, f"{id} compiled with fastbwd")
        _assert_close(plain(), expected, 1e-4, 1e-5, f"{id} compiled")

    return TorchCase(id, label, with_fastbwd, plain, check, target)


class ConvUpsamplePad(nn.Module):
    """C3's decoder block: conv3x3 -> bilinear x2 -> replication pad -> conv3x3, the block plain
    Inductor cannot train (its layout optimisation hands the pad's backward a channels_last
    gradient that the aten meta function says is contiguous)."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.pad = nn.ReplicationPad2d(1)
        self.conv2 = nn.Conv2d(channels, channels, 3)

    def forward(self, x):
        return self.conv2(self.pad(self.up(self.conv1(x))))


def _compiled_training_case(id, label, model, inputs, target_shape, target, baseline="compiled"):
    """C3 and C6: one SGD step of ``model`` compiled with fastbwd against the same model compiled
    without it (``baseline="compiled"``) or run eagerly with fastbwd (``"eager"``)."""
    target_y = _randn(target_shape, 82)
    fastbwd_step = _routed(_sgd_step(model, inputs, target_y, _compiled(model, f"{id}_fastbwd")))
    if baseline == "eager":
        other_step = _routed(_sgd_step(model, inputs, target_y))
    else:
        other_step = _sgd_step(model, inputs, target_y, _compiled(model, f"{id}_plain"))

    def check():
        # One step's gradients from the same parameters (each step also updates them). The
        # baseline's are compared, not asserted: plain Inductor gets T7's UNet wrong (docs/history.md).
        state = {name: value.clone() for name, value in model.state_dict().items()}
        expected = _routed(_sgd_step(model, inputs, target_y))()
        model.load_state_dict(state)
        _assert_close(fastbwd_step(), expected, 1e-3, 1e-4, f"{id} compiled with fastbwd")
        model.load_state_dict(state)
        error = _largest_relative_error(other_step(), expected)
        if error > 1e-3:
            case.note = f"{baseline}: gradients up to {error:.0%} off eager's"
        model.load_state_dict(state)

    case = TorchCase(id, label, fastbwd_step, other_step, check, target)
    return case


def _compiled_roi_align_case(input_shape, num_boxes, target):
    """C5: ``fastbwd.torch.roi_align`` forward + backward compiled against the same eager calls."""
    spatial_scale, sampling_ratio, aligned, pooled = 0.25, 2, True, 7
    x = _randn(input_shape, 91, requires_grad=True)
    boxes = torch.from_numpy(roi_boxes(num_boxes, input_shape, spatial_scale))
    g = _randn((num_boxes, input_shape[1], pooled, pooled), 92)

    def forward(x):
        return ft.roi_align(x, boxes, pooled, spatial_scale, sampling_ratio, aligned)

    def step(forward):
        def run():
            y = forward(x)
            return (y,) + torch.autograd.grad(y, x, g)

        return run

    compiled, eager = step(_compiled(forward, "C5_compiled")), step(forward)

    def check():
        assert all(torch.equal(a, e) for a, e in zip(compiled(), eager())), "C5: compiled roi_align is not eager's"

    return TorchCase(
        "C5",
        f"ft.roi_align fwd + bwd {input_shape}, {num_boxes} boxes: compiled vs eager",
        compiled,
        eager,
        check,
        target,
    )


def _compiled_group_norm_swish_case(shape, groups, target):
    """C7: a ``GroupNormSwish`` module's forward + backward compiled against the same eager calls."""
    module = ft.GroupNormSwish(groups, shape[1])
    x = _randn(shape, 93, requires_grad=True)
    g = _randn(shape, 94)
    parameters = (x, module.weight, module.bias)

    def step(forward):
        return lambda: torch.autograd.grad(forward(x), parameters, g)

    compiled, eager = step(_compiled(module, "C7_compiled")), step(module)

    def check():
        assert all(torch.equal(a, e) for a, e in zip(compiled(), eager())), "C7: compiled GroupNormSwish is not eager's"

    return TorchCase(
        "C7",
        f"GroupNormSwish fwd + bwd {shape}, {groups} groups: compiled vs eager",
        compiled,
        eager,
        check,
        target,
    )


_PLAIN_OPERATORS = {}


def _plain_group_norm_swish_operators():
    """C8's custom op (registered once per process): ``fastbwd_bench::group_norm_swish``, PyTorch's
    own GroupNorm and SiLU kernels behind a ``torch.library`` custom op with a fake kernel and
    registered autograd (a backward custom op of PyTorch's own backward kernels), the way a
    user extends torch.compile; and an ``autograd.Function`` running the same kernels eagerly."""
    if _PLAIN_OPERATORS:
        return _PLAIN_OPERATORS["op"], _PLAIN_OPERATORS["function"]

    # PyTorch's own calls, as fastbwd's graph operators make them while disabled
    from fastbwd.torch._ops import native_backward, native_group_norm

    def forward_kernels(input, weight, bias, num_groups):
        y, mean, rstd = native_group_norm(input, weight, bias, num_groups, 1e-5)
        return F.silu(y), y, mean, rstd

    def backward_kernels(grad, input, y, mean, rstd, weight, num_groups):
        return native_backward(grad, y, input, mean, rstd, weight, num_groups, [True, True, True])

    @torch.library.custom_op("fastbwd_bench::group_norm_swish", mutates_args=())
    def op(input: Tensor, weight: Tensor, bias: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return forward_kernels(input, weight, bias, num_groups)

    @op.register_fake
    def _(input, weight, bias, num_groups):
        statistics = input.new_empty((input.shape[0], num_groups))
        return torch.empty_like(input), torch.empty_like(input), statistics, torch.empty_like(statistics)

    @torch.library.custom_op("fastbwd_bench::group_norm_swish_backward", mutates_args=())
    def op_backward(
        grad: Tensor, input: Tensor, y: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, num_groups: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        return backward_kernels(grad, input, y, mean, rstd, weight, num_groups)

    @op_backward.register_fake
    def _(grad, input, y, mean, rstd, weight, num_groups):
        return torch.empty_like(input), torch.empty_like(weight), torch.empty_like(weight)

    def setup_context(ctx, inputs, output):
        input, weight, _, ctx.num_groups = inputs
        _, y, mean, rstd = output
        ctx.save_for_backward(input, y, mean, rstd, weight)

    def backward(ctx, grad, *_):
        return (*op_backward(grad, *ctx.saved_tensors, ctx.num_groups), None)

    op.register_autograd(backward, setup_context=setup_context)

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input, weight, bias, num_groups):
            output, y, mean, rstd = forward_kernels(input, weight, bias, num_groups)
            ctx.save_for_backward(input, y, mean, rstd, weight)
            ctx.num_groups = num_groups
            return output

        @staticmethod
        def backward(ctx, grad):
            return (*backward_kernels(grad, *ctx.saved_tensors, ctx.num_groups), None)

    _PLAIN_OPERATORS.update(op=op, function=Function)
    return op, Function


def _compiled_plain_custom_op_case(shape, groups):
    """C8: what torch.compile costs around one custom op without fastbwd: C7's structure (an op
    whose kernels run the same compiled or eager) with PyTorch's own GroupNorm and SiLU kernels."""
    op, function = _plain_group_norm_swish_operators()
    weight, bias = nn.Parameter(torch.ones(shape[1])), nn.Parameter(torch.zeros(shape[1]))
    x = _randn(shape, 95, requires_grad=True)
    g = _randn(shape, 96)
    parameters = (x, weight, bias)
    compiled_forward = _compiled(lambda input: op(input, weight, bias, groups)[0], "C8_compiled")
    compiled = lambda: torch.autograd.grad(compiled_forward(x), parameters, g)  # noqa: E731
    eager = lambda: torch.autograd.grad(function.apply(x, weight, bias, groups), parameters, g)  # noqa: E731

    def check():
        assert all(torch.equal(a, e) for a, e in zip(compiled(), eager())), "C8: the compiled custom op is not eager's"

    return TorchCase(
        "C8",
        f"no fastbwd: a custom op of PyTorch's GroupNorm + SiLU kernels fwd + bwd {shape}, {groups} groups: "
        "compiled vs the same kernels eager",
        compiled,
        eager,
        check,
        "report (C7's floor)",
    )


class _Prediction(nn.Module):
    """A diffusion UNet whose forward returns its output's sample (a tensor, for the loss)."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep):
        return self.unet(sample, timestep).sample


def compile_cases(quick=False):
    """C1-C9: models under ``torch.compile`` (Inductor) with fastbwd enabled before their first
    compiled call, against the same models compiled without fastbwd (C3: run eagerly with
    fastbwd; C5 and C7: ``roi_align`` and ``GroupNormSwish`` compiled against eager; C8: C7's
    structure with PyTorch's own kernels, no fastbwd; C9: T8's diffusion UNet, issue 52);
    ``quick`` uses small shapes."""
    from .models import torch_diffusion as D
    from .models.torch_unet import SmallUNet

    if quick:
        up, pool, decoder, norm, roi, unet = (
            (2, 8, 16, 16),
            (2, 8, 14, 14),
            (2, 16, 16),
            ((2, 64, 8, 8), 32),
            ((2, 16, 25, 38), 32),
            (2, 16, (16, 32), 8),
        )
    else:
        up, pool, decoder, norm, roi, unet = (
            (8, 64, 64, 64),
            (32, 128, 56, 56),
            (8, 64, 64),
            ((8, 512, 32, 32), 32),
            ((2, 256, 50, 76), 256),
            (4, 64, (32, 64, 128), 16),
        )
    torch.manual_seed(81)
    (norm_shape, groups), (batch, channels, size) = norm, decoder
    unet_batch, unet_size, unet_channels, unet_groups = unet
    return [
        _compiled_backward_case(
            "C1",
            f"F.interpolate bilinear x2 fwd+bwd {up}: compiled + fastbwd vs compiled",
            nn.Upsample(scale_factor=2, mode="bilinear"),
            up,
            ">= 5x",
            83,
        ),
        _compiled_backward_case(
            "C2",
            f"F.avg_pool2d k3 s2 p1 fwd+bwd {pool}: compiled + fastbwd vs compiled",
            nn.AvgPool2d(3, 2, 1),
            pool,
            ">= 2x",
            85,
        ),
        _compiled_training_case(
            "C3",
            f"training step, conv + bilinear + replication pad + conv ({batch}, {channels}, {size}, {size}): "
            "compiled + fastbwd vs eager + fastbwd",
            ConvUpsamplePad(channels),
            (_randn((batch, channels, size, size), 87),),
            (batch, channels, 2 * size, 2 * size),
            "trains; report",
            baseline="eager",
        ),
        _compiled_backward_case(
            "C4",
            f"nn.GroupNorm + nn.SiLU fwd+bwd {norm_shape}, {groups} groups: compiled + fastbwd vs compiled",
            nn.Sequential(nn.GroupNorm(groups, norm_shape[1]), nn.SiLU()),
            norm_shape,
            ">= 1.4x",
            88,
        ),
        _compiled_roi_align_case(*roi, ">= 0.95x"),
        _compiled_group_norm_swish_case(*norm, ">= 0.95x"),
        _compiled_plain_custom_op_case(*norm),
        _compiled_training_case(
            "C6",
            f"training step, T7's UNet (batch {unet_batch}, {unet_size}x{unet_size}, {unet_channels}): "
            "compiled + fastbwd vs compiled",
            SmallUNet(3, unet_channels, 64, unet_groups),
            (_randn((unet_batch, 3, unet_size, unet_size), 89), _randn((unet_batch, 64), 90)),
            (unet_batch, 3, unet_size, unet_size),
            ">= 1.0x; report",
        ),
        _diffusion_compiled_case(D, quick),
    ]


def _diffusion_compiled_case(D, quick):
    """C9 (issue 52): a training step of T8's diffusion UNet (tests/test_fuse_real_models.py's
    model) compiled with fastbwd against compiled without, both with Inductor's layout
    optimisation off: with it PyTorch 2.13 gets this UNet's (nearest) upsampling gradients wrong,
    fastbwd enabled or not (docs/compile.md), and the check would fail on Inductor's error."""
    import torch._inductor.config as inductor_config

    batch, size, config = (2, 16, dict(block_out_channels=(8, 16, 32), norm_num_groups=4)) if quick else (8, 32, {})
    model = _Prediction(D.t8_model(84, **config))
    sample, timestep = D.unet_inputs(batch, size, seed=85)
    levels = len({**D.T8_CONFIG, **config}["block_out_channels"])
    case = _compiled_training_case(
        "C9",
        f"training step, T8's diffusion UNet (batch {batch}, {size}x{size}, {levels} levels): compiled + fastbwd "
        "vs compiled (Inductor's layout optimisation off)",
        model,
        (sample, timestep),
        tuple(sample.shape),
        ">= 1.0x",
    )

    def unoptimised(function):
        def run():
            with inductor_config.patch(layout_optimization=False):
                return function()

        return run

    case.fastbwd, case.torch, check = unoptimised(case.fastbwd), unoptimised(case.torch), case.check
    case.check = unoptimised(check)
    return case
