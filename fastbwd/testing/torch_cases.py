"""The PyTorch-bridge benchmark cases T1-T5 (bench/bench_torch.py and ``python -m fastbwd``).

Each case builds, at full size (or ``quick`` small size), a pair of zero-argument callables over
the same tensors: ``fastbwd`` (through :mod:`fastbwd.torch`) and ``torch`` (plain PyTorch), plus
``check()``, which runs both once and asserts that their gradients agree. Only imported where
torch is installed.
"""

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

import fastbwd.torch as ft
from fastbwd.testing.cases import roi_boxes
from fastbwd.testing.roi_baselines import torch_roi_align


@dataclass
class TorchCase:
    id: str
    label: str
    fastbwd: Callable[[], object]
    torch: Callable[[], object]
    check: Callable[[], None]
    target: str


def _randn(shape, seed, dtype=torch.float32, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=dtype).requires_grad_(requires_grad)


def _routed(function):
    """``function`` run with the routing enabled (and left disabled afterwards)."""
    def run():
        with ft.enabled():
            return function()
    return run


def _assert_close(actual, expected, rtol, atol, what):
    """Each gradient within ``rtol`` of its own largest value, or ``atol`` of the largest of all
    (a gradient that is zero in exact arithmetic, like a bias before a norm, is rounding noise)."""
    actual, expected = [a.detach() for a in actual], [e.detach() for e in expected]
    overall = max(float(e.abs().max()) for e in expected)
    for index, (a, e) in enumerate(zip(actual, expected)):
        scale = float(e.abs().max())
        error = float((a.double() - e.double()).abs().max())
        assert error <= max(rtol * scale, atol * overall), (
            f"{what}: gradient {index} max error {error:.3g} (its scale {scale:.3g}, overall {overall:.3g})")


def _routed_backward(id, label, forward, input_shape, target, seed):
    """T1/T2: the autograd backward of one routed op, enabled vs plain PyTorch."""
    x = _randn(input_shape, seed, requires_grad=True)
    y = forward(x)
    g = _randn(y.shape, seed + 1)

    def backward():
        return torch.autograd.grad(y, x, g, retain_graph=True)

    def check():
        _assert_close(_routed(backward)(), backward(), 2e-5, 2e-6, id)

    return TorchCase(id, label, _routed(backward), backward, check, target)


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

    return TorchCase("T3", f"GroupNormSwish vs GroupNorm+SiLU backward {shape}, {groups} groups",
                     fastbwd_backward, torch_backward, check, target)


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

    return TorchCase("T4", f"roi_align forward + backward, input {input_shape}, {num_boxes} boxes 7x7 "
                     "vs pure PyTorch", fastbwd_step, torch_step, check, target)


class DecoderBlock(nn.Module):
    """T5's block: conv3x3 -> GroupNorm+Swish -> bilinear x2 -> replication pad -> conv3x3 ->
    avg-pool. ``fused`` picks GroupNormSwish (else nn.GroupNorm + nn.SiLU)."""

    def __init__(self, channels, fused):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = (ft.GroupNormSwish(32, channels) if fused
                     else nn.Sequential(nn.GroupNorm(32, channels), nn.SiLU()))
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

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), target_y)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-1e-3)
            return [p.grad for p in model.parameters()]
        return run

    fastbwd_step, torch_step = _routed(step(fused)), step(plain)

    def check():
        # Gradients of one step from the same parameters (the steps above also update them).
        plain.load_state_dict(fused.state_dict(), strict=False)
        plain.norm[0].load_state_dict(fused.norm.state_dict())
        _assert_close(fastbwd_step(), torch_step(), 1e-3, 1e-4, "T5")

    return TorchCase("T5", f"training step, decoder block (batch {batch}, {channels} ch, {size}x{size})",
                     fastbwd_step, torch_step, check, target)


def cases(quick=False):
    """T1-T5 (issue 11's table); ``quick`` uses small shapes."""
    if quick:
        up, pool, norm, roi, block = ((2, 8, 16, 16), (2, 8, 14, 14), ((2, 64, 8, 8), 32),
                                      ((2, 16, 25, 38), 32), (2, 32, 16))
    else:
        up, pool, norm, roi, block = ((8, 64, 64, 64), (32, 128, 56, 56), ((8, 512, 32, 32), 32),
                                      ((2, 256, 200, 304), 512), (8, 64, 64))
    return [
        _routed_backward("T1", f"F.interpolate bilinear x2 backward {up}",
                         lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), up, ">= 5x", 21),
        _routed_backward("T2", f"F.avg_pool2d k3 s2 p1 backward {pool}",
                         lambda x: F.avg_pool2d(x, 3, 2, 1), pool, ">= 3x", 23),
        _group_norm_swish_case(*norm, ">= 1.4x"),
        _roi_align_case(*roi, ">= 10x"),
        _training_step_case(*block, "report"),
    ]
