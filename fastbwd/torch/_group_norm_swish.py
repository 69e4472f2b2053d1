"""Fused GroupNorm + Swish for PyTorch on the registered operators ``fastbwd::group_norm_swish``
and ``fastbwd::group_norm_swish_backward`` (docs/semantics.md §5 and §7), and PyTorch's own
``F.group_norm`` and Swish for every call fastbwd's kernels do not take (``_ops.refusal``)."""

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from . import _convert as c
from . import _ops, _switch


# A leaf of torch.fx.symbolic_trace: choosing fastbwd or PyTorch reads sizes a Proxy does not have.
@torch.fx.wrap
def group_norm_swish(
    input: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    swish_scale: float = 1.0,
) -> Tensor:
    """``F.group_norm(input, num_groups, weight, bias, eps)`` followed by
    ``y * torch.sigmoid(swish_scale * y)``, as the registered operator
    ``fastbwd::group_norm_swish`` with fastbwd's fused backward.

    input is ``(N, C, *)`` (channels_last 4-D input runs fastbwd's NHWC path). float16 and
    bfloat16 input may come with float32 weight and bias (mixed precision). A call fastbwd's
    kernels do not take runs ``F.group_norm`` and the Swish in PyTorch (so bad input raises what
    ``F.group_norm`` raises). The backward computes the weight and bias gradients only when
    they require grad. Double backward is exact: when a graph of the backward is asked for
    (``create_graph=True``), the gradients come from PyTorch's composite instead.
    """
    if isinstance(input, torch.fx.Proxy):  # reached by a name fx.wrap did not patch
        return _ops.fx_leaf(group_norm_swish, input, num_groups, weight, bias, eps, swish_scale)
    compiling = torch.compiler.is_compiling()
    if compiling or type(input) is not torch.Tensor or not _ops.below_floor("dropin", input):
        if _ops.use_eager_path(input, weight, bias) and input.is_cpu:
            geometry = _ops.geometry_of(input, weight, bias, num_groups, eps, swish_scale)  # once per geometry
            if geometry is not None and geometry.serves("dropin"):
                return _ops.EagerGroupNormSwish.apply(input, weight, bias, geometry)
        elif _ops.refusal(input, num_groups, weight, bias, eps, swish_scale) is None and c.decide(
            _switch.policy(), "compiled" if compiling else "dropin", "group_norm_swish", input, groups=num_groups
        ):  # at trace time when compiled
            return torch.ops.fastbwd.group_norm_swish(input, weight, bias, num_groups, float(eps), float(swish_scale))[
                0
            ]
    # What fastbwd's kernels do not take (another device, an empty input, 8192 channels in one
    # group, a negative eps, ...), what PyTorch refuses (with its own error), and what PyTorch's
    # own code runs faster (fastbwd._dispatch): PyTorch's code.
    y = F.group_norm(input, num_groups, weight, bias, eps)
    return F.silu(y) if swish_scale == 1 else y * torch.sigmoid(swish_scale * y)


class GroupNormSwish(nn.GroupNorm):
    """``nn.GroupNorm`` followed by ``nn.SiLU`` (Swish with ``swish_scale``), in one module.

    ``nn.GroupNorm``'s whole constructor (``bias=`` keyword-only, as there) plus the keyword
    ``swish_scale`` (``1.0`` is ``nn.SiLU``); the same parameters, buffers and state_dict, so a
    GroupNorm checkpoint loads into it. Forward and backward are fastbwd's registered operators,
    or PyTorch's own code for an input they do not take (so the same errors as nn.GroupNorm).
    """

    def __init__(
        self, num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None, *, bias=True, swish_scale=1.0
    ):
        if isinstance(device, float):
            # swish_scale was the fifth positional argument before nn.GroupNorm's device took it.
            raise TypeError(
                f"GroupNormSwish: the fifth argument is nn.GroupNorm's device, but got "
                f"{device!r}; pass swish_scale={device!r} as a keyword"
            )
        super().__init__(num_groups, num_channels, eps, affine, device, dtype, bias=bias)
        self.swish_scale = float(swish_scale)

    def forward(self, input: Tensor) -> Tensor:
        return group_norm_swish(input, self.num_groups, self.weight, self.bias, self.eps, self.swish_scale)

    def extra_repr(self):
        return super().extra_repr() + f", swish_scale={self.swish_scale}"
