"""Fused GroupNorm + Swish for PyTorch: forward by ``native_group_norm``, backward by
``fastbwd.group_norm_swish_backward`` (docs/semantics.md §5 and §7)."""

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable

import fastbwd

from . import _convert as c
from ._threads import match_torch_threads


class _GroupNormSwish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, num_groups, weight, bias, eps, swish_scale):
        batch, channels = input.shape[:2]
        positions = math.prod(input.shape[2:])
        y, mean, rstd = torch.native_group_norm(input, weight, bias, batch, channels, positions,
                                                num_groups, eps)
        ctx.save_for_backward(input, mean, rstd, weight, bias)
        ctx.num_groups, ctx.swish_scale = num_groups, swish_scale
        return y * torch.sigmoid(swish_scale * y)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        input, mean, rstd, weight, bias = ctx.saved_tensors
        need_input, _, need_weight, need_bias = ctx.needs_input_grad[:4]
        need_weight = need_weight and weight is not None
        need_bias = need_bias and bias is not None
        channels = input.shape[1]
        # Without affine parameters the normalisation is the identity map on y.
        parameter_dtype = weight.dtype if weight is not None else (
            bias.dtype if bias is not None else mean.dtype)
        gamma = weight if weight is not None else torch.ones(channels, dtype=parameter_dtype)
        beta = bias if bias is not None else torch.zeros(channels, dtype=parameter_dtype)

        if input.numel() == 0:  # an empty batch: nothing to differentiate, nothing for fastbwd
            return (torch.zeros_like(input) if need_input else None, None,
                    torch.zeros_like(gamma) if need_weight else None,
                    torch.zeros_like(beta) if need_bias else None, None, None)

        # channels_last input runs the NHWC path on its (N, H, W, C) view; the results come
        # back as new NumPy arrays, wrapped without a copy (dx channels_last again)
        channels_last = c.is_channels_last(input)
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        arrays = [c.as_array(c.dense(t, memory_format)) for t in (grad_output, input)]
        if channels_last:
            arrays = [a.transpose(0, 2, 3, 1) for a in arrays]
        match_torch_threads()
        grad_input, grad_weight, grad_bias = fastbwd.group_norm_swish_backward(
            arrays[0], c.as_array(mean), c.as_array(rstd), arrays[1], c.as_array(gamma),
            c.as_array(beta), ctx.num_groups, "NHWC" if channels_last else "NCHW",
            ctx.swish_scale, need_weight, need_bias)
        grad_input = c.as_tensor(grad_input)
        if channels_last:
            grad_input = grad_input.permute(0, 3, 1, 2)
        return (grad_input if need_input else None, None,
                None if grad_weight is None else c.as_tensor(grad_weight),
                None if grad_bias is None else c.as_tensor(grad_bias), None, None)


def group_norm_swish(input, num_groups, weight=None, bias=None, eps=1e-5, swish_scale=1.0):
    """``F.group_norm(input, num_groups, weight, bias, eps)`` followed by
    ``y * torch.sigmoid(swish_scale * y)``, with fastbwd's fused backward.

    input is ``(N, C, *)`` (channels_last 4-D input runs fastbwd's NHWC path). float16 and
    bfloat16 input may come with float32 weight and bias (mixed precision). The backward computes
    the weight and bias gradients only when they require grad; it is not itself differentiable
    (double backward raises).
    """
    if input.dim() < 2:
        raise ValueError(f"group_norm_swish: input must have at least 2 dimensions, but got {input.dim()}")
    channels = input.shape[1]
    if num_groups <= 0 or channels % num_groups:
        raise ValueError(f"group_norm_swish: num_groups must divide the {channels} channels, "
                         f"but got {num_groups}")
    if input.device.type != "cpu":
        # fastbwd is a CPU library: other devices keep PyTorch's composite (same formula).
        y = torch.nn.functional.group_norm(input, num_groups, weight, bias, eps)
        return y * torch.sigmoid(swish_scale * y)
    return _GroupNormSwish.apply(input, num_groups, weight, bias, eps, float(swish_scale))


class GroupNormSwish(nn.GroupNorm):
    """``nn.GroupNorm`` followed by ``nn.SiLU`` (Swish with ``swish_scale``), in one module.

    Same parameters, buffers and state_dict as ``nn.GroupNorm(num_groups, num_channels, eps,
    affine)``, so a GroupNorm checkpoint loads into it; the backward is fastbwd's fused
    ``group_norm_swish_backward``. ``swish_scale=1.0`` is ``nn.SiLU``.
    """

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, swish_scale=1.0,
                 device=None, dtype=None):
        super().__init__(num_groups, num_channels, eps, affine, device=device, dtype=dtype)
        self.swish_scale = float(swish_scale)

    def forward(self, input):
        return group_norm_swish(input, self.num_groups, self.weight, self.bias, self.eps,
                                self.swish_scale)

    def extra_repr(self):
        return super().extra_repr() + f", swish_scale={self.swish_scale}"

