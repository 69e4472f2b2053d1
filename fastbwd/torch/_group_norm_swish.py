"""Fused GroupNorm + Swish for PyTorch on the registered operators ``fastbwd::group_norm_swish``
and ``fastbwd::group_norm_swish_backward`` (docs/semantics.md §5 and §7)."""

import torch
from torch import Tensor, nn

from . import _ops, _probes


def _check_input(input, num_groups, weight, bias):
    """nn.GroupNorm's forward checks, with its exception types and messages (F.group_norm's
    own, then those of the aten kernel; on empty inputs, those of the installed PyTorch), so the
    module fails as nn.GroupNorm does."""
    if input.dim() < 2:
        raise RuntimeError(f"Expected at least 2 dimensions for input tensor but received {input.dim()}")
    shape = list(input.shape)
    values = shape[0] * shape[1] // num_groups
    for size in shape[2:]:
        values *= size
    if values == 1:
        raise ValueError(
            "Expected more than 1 value per channel when training, got input size "
            f"{[shape[0] * shape[1] // num_groups, num_groups] + shape[2:]}"
        )
    empty_error = _probes.group_norm_empty_error(shape)
    if empty_error is not None:
        raise empty_error
    if shape[1] % num_groups:
        raise RuntimeError(
            "Expected number of channels in input to be divisible by num_groups, but "
            f"got input of shape {shape} and num_groups={num_groups}"
        )
    for name, parameter in (("weight", weight), ("bias", bias)):
        if parameter is not None and (parameter.dim() != 1 or parameter.shape[0] != shape[1]):
            raise RuntimeError(
                f"Expected {name} to be a vector of size equal to the number of channels in input, "
                f"but got {name} of shape {list(parameter.shape)} and input of shape {shape}"
            )
    _check_dtypes(input, weight, bias)


#: PyTorch's names of the dtypes in its "expected scalar type" messages.
_SCALAR_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16"}


def _check_dtypes(input, weight, bias):
    """native_group_norm's dtype rules on the CPU, with its messages: parameters of another
    dtype than the input's must all be float32, with a float16 or bfloat16 input (mixed
    precision); otherwise every parameter has the input's dtype."""
    parameters = [p for p in (weight, bias) if p is not None]
    if not parameters:
        return
    if parameters[0].dtype != input.dtype:  # what PyTorch calls mixed
        if any(p.dtype != torch.float32 for p in parameters):
            raise RuntimeError("mixed dtype (CPU): expect parameter to have scalar type of Float")
        if input.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("mixed dtype (CPU): all inputs must share same datatype.")
        return
    for parameter in parameters[1:]:
        if parameter.dtype != input.dtype:
            expected = _SCALAR_NAMES.get(input.dtype, str(input.dtype))
            found = _SCALAR_NAMES.get(parameter.dtype, str(parameter.dtype))
            raise RuntimeError(f"expected scalar type {expected} but found {found}")


# A leaf of torch.fx.symbolic_trace: the checks above read sizes a Proxy does not have.
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
    bfloat16 input may come with float32 weight and bias (mixed precision). Bad input raises
    what ``F.group_norm`` raises. The backward computes the weight and bias gradients only when
    they require grad. Double backward is exact: when a graph of the backward is asked for
    (``create_graph=True``), the gradients come from PyTorch's composite instead.
    """
    if isinstance(input, torch.fx.Proxy):  # reached by a name fx.wrap did not patch
        return _ops.fx_leaf(group_norm_swish, input, num_groups, weight, bias, eps, swish_scale)
    if input.is_cpu and input.numel() and _ops.use_eager_path(input):
        # nn.GroupNorm's checks run on the first call of each geometry (its later calls repeat it)
        geometry = _ops.geometry_of(input, weight, bias, num_groups, float(eps), float(swish_scale), _check_input)
        return _ops.EagerGroupNormSwish.apply(input, weight, bias, geometry)
    _check_input(input, num_groups, weight, bias)
    if input.device.type != "cpu":
        # fastbwd is a CPU library: other devices keep PyTorch's composite (same formula).
        y = torch.nn.functional.group_norm(input, num_groups, weight, bias, eps)
        return y * torch.sigmoid(swish_scale * y)
    return torch.ops.fastbwd.group_norm_swish(input, weight, bias, num_groups, float(eps), float(swish_scale))[0]


class GroupNormSwish(nn.GroupNorm):
    """``nn.GroupNorm`` followed by ``nn.SiLU`` (Swish with ``swish_scale``), in one module.

    ``nn.GroupNorm``'s whole constructor (``bias=`` keyword-only, as there) plus the keyword
    ``swish_scale`` (``1.0`` is
    ``nn.SiLU``); the same parameters, buffers and state_dict, so a GroupNorm checkpoint loads
    into it; the same input errors. Forward and backward are fastbwd's registered operators.
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
