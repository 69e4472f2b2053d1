"""fastbwd's PyTorch operators: ``torch.library.custom_op``s in the ``fastbwd`` namespace
(docs/semantics.md §7).

=======================================  ==================================================
``fastbwd::roi_align``                   RoIAlign forward (torchvision's schema order)
``fastbwd::roi_align_backward``          its input gradient (linear in ``grad``)
``fastbwd::group_norm_swish``            GroupNorm + Swish forward -> ``(y, mean, rstd)``
``fastbwd::group_norm_swish_backward``   its fused backward -> ``(dx, dgamma, dbeta)``
=======================================  ==================================================

Each has a fake kernel (the shapes, dtypes and strides the real kernel returns, so
``torch.compile`` and ``opcheck`` see the truth) and registered autograd. The public functions in
``_roi_align`` and ``_group_norm_swish`` validate and then call these, or, for plain eager calls,
the same kernels and formulas through an ``autograd.Function`` (:func:`use_eager_path`, at the
end); the kernels here only translate tensors to arrays and back.
"""

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

from fastbwd import _validation as v
from fastbwd.api import _plans
from fastbwd.api import group_norm_swish as gns_api
from fastbwd.api import roi_align as roi_align_api

from . import _convert as c
from . import _probes
from ._threads import match_torch_threads


def fx_leaf(function, input, *args):
    """``function(input, *args)`` recorded as one node of the graph that ``input`` (a
    ``torch.fx.Proxy``) is being traced into: what ``torch.fx.wrap`` does, for calls through a
    name it did not patch (``torch.fx.wrap`` patches one module's global)."""
    return input.tracer.create_proxy("call_function", function, (input, *args), {})


def _eager(*tensors):
    """True when ``tensors`` are plain tensors and nothing traces or transforms the call (no
    dispatch or function mode: fake tensors, make_fx, AOTAutograd; no functorch wrapper), so an
    autograd formula may run a kernel directly instead of through its operator's dispatcher
    entry (which costs tens of microseconds per call in Python)."""
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    return all(
        type(t) is torch.Tensor
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
        and not torch._is_functional_tensor(t)
        for t in tensors
    )


def use_eager_path(*tensors):
    """True when a public function may run its operator's kernel and autograd formula through
    an ``autograd.Function`` of the same code instead of the dispatcher: plain tensors (see
    :func:`_eager`), not under ``torch.compile`` or ``torch.jit.trace`` (which must record the
    operator) nor CPU autocast (whose rule is registered on the operator)."""
    # is_compiling first: torch.compile folds it to True and never traces the rest
    return (
        not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and _eager(*tensors)
        and not torch.is_autocast_enabled("cpu")
    )


# ---- RoIAlign -------------------------------------------------------------------------------


#: The RoIAlign forward's arguments as fastbwd.torch.roi_align names them.
_ROI_ALIGN_SUBJECTS = {"pooled_height": "output_size[0]", "pooled_width": "output_size[1]"}


def _nhwc(tensor):
    """The (N, H, W, C) array of a channels_last tensor's memory (a copy only if not dense)."""
    return c.as_array(tensor.permute(0, 2, 3, 1).contiguous())


#: The dtypes RoIAlign takes: torchvision's CPU kernels' (float32, float64, float16) and bfloat16.
_ROI_ALIGN_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _check_roi_align_dtype(tensor, name):
    """Refuse an integer, bool or complex ``tensor`` with the exception type torchvision's
    roi_align raises for it (RuntimeError), before anything is allocated in its dtype."""
    if tensor.dtype not in _ROI_ALIGN_DTYPES:
        raise RuntimeError(
            f"roi_align: {name}.dtype must be one of float32, float64, float16, bfloat16, "
            f"but got {str(tensor.dtype).removeprefix('torch.')}"
        )


def _roi_align_kernel(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    """The forward; a channels_last input runs the NHWC layout, in place, and gives a
    channels_last result."""
    _check_roi_align_dtype(input, "input")
    match_torch_threads()
    memory_format = c.memory_format(input)
    output = c.empty((rois.shape[0], input.shape[1], pooled_height, pooled_width), input.dtype, memory_format)
    scalars = (spatial_scale, max(sampling_ratio, 0), aligned)
    if memory_format == torch.channels_last:
        layout, arrays, out = "NHWC", (_nhwc(input), c.as_array(rois)), _nhwc(output)
    else:
        layout, arrays, out = "NCHW", (c.as_array(input), c.as_array(rois)), c.as_array(output)
    with v.called_as("roi_align", _ROI_ALIGN_SUBJECTS):
        plan = roi_align_api.forward_plan(*arrays, pooled_height, pooled_width, *scalars, layout, out)
    roi_align_api.run_forward(plan, *arrays, out)
    return output


@torch.library.custom_op("fastbwd::roi_align", mutates_args=(), device_types="cpu")
def roi_align(
    input: Tensor,
    rois: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    sampling_ratio: int,
    aligned: bool,
) -> Tensor:
    return _roi_align_kernel(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)


@roi_align.register_fake
def _(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    _check_roi_align_dtype(input, "input")
    torch._check(rois.dim() == 2 and rois.shape[1] == 5, lambda: "roi_align: rois must be (K, 5)")
    return torch.empty(
        (rois.shape[0], input.shape[1], pooled_height, pooled_width),
        dtype=input.dtype,
        device=input.device,
        memory_format=c.memory_format(input),
    )


def _roi_align_backward_kernel(
    grad,
    rois,
    spatial_scale,
    pooled_height,
    pooled_width,
    batch_size,
    channels,
    height,
    width,
    sampling_ratio,
    aligned,
    channels_last=False,
):
    """The input gradient; ``channels_last`` (the forward's input was) runs the NHWC layout and
    gives a channels_last gradient (``grad`` read in place when it is channels_last too)."""
    _check_roi_align_dtype(grad, "grad")
    match_torch_threads()
    input_shape = (batch_size, channels, height, width)
    scalars = (spatial_scale, max(sampling_ratio, 0), aligned)
    if channels_last:
        grad_input = c.empty(input_shape, grad.dtype, torch.channels_last)
        layout, arrays, out = "NHWC", (_nhwc(grad), c.as_array(rois)), _nhwc(grad_input)
    else:
        grad_input = c.empty(input_shape, grad.dtype)
        layout, arrays, out = "NCHW", (c.as_array(grad.contiguous()), c.as_array(rois)), c.as_array(grad_input)
    plan = roi_align_api.plan(*arrays, input_shape, pooled_height, pooled_width, *scalars, layout, out)
    roi_align_api.run(plan, *arrays, out)
    return grad_input


@torch.library.custom_op("fastbwd::roi_align_backward", mutates_args=(), device_types="cpu")
def roi_align_backward(
    grad: Tensor,
    rois: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    batch_size: int,
    channels: int,
    height: int,
    width: int,
    sampling_ratio: int,
    aligned: bool,
    channels_last: bool = False,
) -> Tensor:
    return _roi_align_backward_kernel(
        grad,
        rois,
        spatial_scale,
        pooled_height,
        pooled_width,
        batch_size,
        channels,
        height,
        width,
        sampling_ratio,
        aligned,
        channels_last,
    )


@roi_align_backward.register_fake
def _(
    grad,
    rois,
    spatial_scale,
    pooled_height,
    pooled_width,
    batch_size,
    channels,
    height,
    width,
    sampling_ratio,
    aligned,
    channels_last=False,
):
    _check_roi_align_dtype(grad, "grad")
    return torch.empty(
        (batch_size, channels, height, width),
        dtype=grad.dtype,
        device=grad.device,
        memory_format=torch.channels_last if channels_last else torch.contiguous_format,
    )


def _roi_align_setup(ctx, inputs, output):
    input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned = inputs
    ctx.save_for_backward(rois)
    # the gradient in the input's memory format (the layout the forward ran)
    channels_last = c.memory_format(input) == torch.channels_last
    ctx.geometry = (spatial_scale, pooled_height, pooled_width, *input.shape, sampling_ratio, aligned, channels_last)


def _roi_align_grad(ctx, grad):
    # The gradient reaches the input only (not the boxes), as in torchvision.
    if not ctx.needs_input_grad[0]:
        return (None,) * 7
    (rois,) = ctx.saved_tensors
    # Run as an operator wherever it may be traced or differentiated (create_graph=True).
    backward = _roi_align_backward_kernel if not torch.is_grad_enabled() and _eager(grad, rois) else roi_align_backward
    return (backward(grad, rois, *ctx.geometry),) + (None,) * 6


roi_align.register_autograd(_roi_align_grad, setup_context=_roi_align_setup)


def _roi_align_backward_setup(ctx, inputs, output):
    (_, rois, spatial_scale, pooled_height, pooled_width, _, _, _, _, sampling_ratio, aligned, _) = inputs
    ctx.save_for_backward(rois)
    ctx.geometry = (spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)


def _roi_align_backward_grad(ctx, grad_grad):
    # The backward is linear in grad: its derivative is the forward, applied to the incoming
    # gradient (so double backward through roi_align is exact).
    if not ctx.needs_input_grad[0]:
        return (None,) * 12
    (rois,) = ctx.saved_tensors
    return (roi_align(grad_grad, rois, *ctx.geometry),) + (None,) * 11


roi_align_backward.register_autograd(_roi_align_backward_grad, setup_context=_roi_align_backward_setup)


def _roi_align_autocast(keyset, input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    # torchvision's autocast kernel: compute in float32, return the input's dtype. As autocast
    # does, only floating-point tensors are cast: an integer input is refused as outside autocast.
    input32, rois32 = (t.float() if t.is_floating_point() else t for t in (input, rois))
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
        output = roi_align(input32, rois32, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)
    return output.to(input.dtype)


# A registration lasts as long as its Library object: this one lives with the module.
_library = torch.library.Library("fastbwd", "FRAGMENT")
_library.impl("roi_align", _roi_align_autocast, "AutocastCPU", with_keyset=True)


# ---- GroupNorm + Swish ----------------------------------------------------------------------


def stats_dtype(input, weight, bias):
    """The dtype of mean and rstd (and of the parameters' gradients): the parameters' (float32
    parameters with half input: mixed precision), else the input's, as ``native_group_norm``."""
    parameter = weight if weight is not None else bias
    return parameter.dtype if parameter is not None else input.dtype


def _parameters(input, weight, bias):
    """gamma and beta as the NumPy functions take them: without affine parameters the
    normalisation is the identity map (gamma one, beta zero), in :func:`stats_dtype`."""
    if weight is not None and bias is not None:
        return weight, bias
    channels, dtype = input.shape[1], stats_dtype(input, weight, bias)
    return (
        weight if weight is not None else torch.ones(channels, dtype=dtype),
        bias if bias is not None else torch.zeros(channels, dtype=dtype),
    )


def _forward_kernel(input, weight, bias, num_groups, eps, swish_scale):
    """``(y, mean, rstd)`` by ``fastbwd.group_norm_swish`` (§5.1), ``y`` in the memory format
    :func:`_convert.memory_format` gives ``input``."""
    if input.numel() == 0:  # fastbwd refuses empty groups; PyTorch returns empty results
        x = c.dense(input, c.memory_format(input))
        y, mean, rstd = torch.native_group_norm(
            x, weight, bias, x.shape[0], x.shape[1], math.prod(x.shape[2:]), num_groups, eps
        )
        return y * torch.sigmoid(swish_scale * y), mean, rstd
    y, arrays = geometry_of(input, weight, bias, num_groups, eps, swish_scale).forward(input, weight, bias)
    return y, c.as_tensor(arrays.mean), c.as_tensor(arrays.rstd)


class _Geometry:
    """What the tensors' metadata and the other arguments decide about a GroupNorm+Swish call,
    worked out and validated once (the memory format, the constant parameters of a call without
    weight or bias, and per thread count the api's plans), so that every later call of the same
    geometry (every step of a training loop) goes straight to the api's per-call work (its
    ``run``)."""

    def __init__(self, input, weight, bias, num_groups, eps, swish_scale):
        self.memory_format = c.memory_format(input)
        self.channels_last = self.memory_format != torch.contiguous_format
        self.data_format = "NHWC" if self.channels_last else "NCHW"
        self.shape = input.shape
        self.to_nhwc, self.to_nchw = c.channels_last_permutation(input.dim())
        # The kernels take rank 2 to 8; nn.GroupNorm any rank. A group's values do not depend
        # on how the spatial axes are split, so a higher-rank (contiguous) input is seen as
        # (N, C, HxW).
        self.flat = input.dim() > gns_api.MAX_RANK
        self.num_groups = num_groups
        gamma, beta = (c.as_array(t) for t in _parameters(input, weight, bias))
        # made here when the call has no such parameter: the kernels only read them
        self.gamma = None if weight is not None else gamma
        self.beta = None if bias is not None else beta
        self.swish_scale = swish_scale
        self.checked = False  # nn.GroupNorm's input checks passed (the eager path's own)
        self._forward = {}  # thread count -> the api's forward plan
        self._backward = {}  # (thread count, flags, arrays' metadata) -> the api's backward plan
        if eps is not None:  # the forward's scalars (validated here, ParamError)
            self.eps, _ = gns_api.forward_scalars(eps, swish_scale)
            # its plan too, so that a bad call fails before it is remembered
            self._forward_plan(self.x_array(input), gamma, beta, match_torch_threads())

    def x_array(self, tensor):
        """``tensor`` (the input, or a gradient shaped like it) as the array the kernels take:
        dense in the memory format, channels-last as its (N, *spatial, C) view, above the
        kernels' rank as (N, C, HxW)."""
        array = c.as_array(c.dense(tensor, self.memory_format))
        if self.flat:
            return array.reshape(array.shape[0], array.shape[1], -1)
        return array.transpose(self.to_nhwc) if self.channels_last else array

    def forward(self, input, weight, bias):
        """The forward kernel on a non-empty ``input`` of this geometry: ``y`` as a tensor, and
        the arrays the backward kernel takes besides ``dy`` (:class:`_KernelArrays`, with
        ``mean`` and ``rstd``), which the eager path keeps so that its backward converts only
        ``dy``."""
        x = self.x_array(input)
        gamma = self.gamma if weight is None else c.as_array(weight)
        beta = self.beta if bias is None else c.as_array(bias)
        threads = match_torch_threads()
        plan = self._forward.get(threads) or self._forward_plan(x, gamma, beta, threads)
        y, mean, rstd = gns_api.run_forward(plan, x, gamma, beta, self.eps, self.swish_scale, None)
        return self.result(y), _KernelArrays(mean, rstd, x, gamma, beta)

    def _forward_plan(self, x, gamma, beta, threads):
        plan = gns_api.forward_plan(x, gamma, beta, self.num_groups, self.data_format, True, None)
        self._forward[threads] = plan
        return plan

    def backward(self, grad_output, arrays, need_weight, need_bias, own_statistics):
        """``(dx, dgamma or None, dbeta or None)`` from ``grad_output`` and the other inputs as
        arrays (:class:`_KernelArrays`); ``own_statistics``: mean and rstd are the forward's own
        arrays (the eager path), whose metadata this geometry fixes (the custom op may be given
        any). The results are new NumPy arrays wrapped without a copy (dx channels_last again
        for channels_last input)."""
        dy = self.x_array(grad_output)
        key = (match_torch_threads(), need_weight, need_bias, dy.shape, dy.strides, dy.dtype)
        if not own_statistics:
            key += tuple((a.shape, a.strides, a.dtype) for a in (arrays.mean, arrays.rstd))
        plan = self._backward.get(key)
        if plan is None:
            plan = gns_api.plan(
                dy,
                arrays.mean,
                arrays.rstd,
                arrays.x,
                arrays.gamma,
                arrays.beta,
                self.num_groups,
                self.data_format,
                need_weight,
                need_bias,
                None,
            )
            self._backward[key] = plan
        grad_input, grad_weight, grad_bias = gns_api.run(plan, dy, *arrays, self.swish_scale, None)
        return (
            self.result(grad_input),
            None if grad_weight is None else c.as_tensor(grad_weight),
            None if grad_bias is None else c.as_tensor(grad_bias),
        )

    @functools.cached_property
    def output_strides(self):
        """The strides of ``F.group_norm``'s output (and of this geometry's y): dense in the
        input's suggested memory format."""
        return torch.empty(self.shape, device="meta", memory_format=self.memory_format).stride()

    def result(self, array):
        """A kernel's dx or y (an array from the api) as the tensor the caller gets: channels-last
        arrays come back in the (N, C, *spatial) shape, flattened ones in the input's."""
        tensor = c.as_tensor(array)
        if self.flat:
            return tensor.reshape(self.shape)
        return tensor.permute(self.to_nchw) if self.channels_last else tensor


_GEOMETRIES = _plans.Plans()


def geometry_of(input, weight, bias, num_groups, eps, swish_scale, check_input=None):
    """The :class:`_Geometry` of a call on CPU tensors (``eps`` and ``swish_scale`` floats, as
    the operators' schemas give them; ``eps`` None for the backward alone), made on its first
    call, after ``check_input(input, num_groups, weight, bias)`` when given (once per geometry).
    The key holds what it depends on: each tensor's metadata and the other arguments' values,
    with their types (``True`` and ``1`` differ)."""
    key = (
        input.shape,
        input.stride(),
        input.dtype,
        None if weight is None else (weight.shape, weight.stride(), weight.dtype),
        None if bias is None else (bias.shape, bias.stride(), bias.dtype),
        type(num_groups),
        num_groups,
        eps,
        swish_scale,
    )
    geometry = _GEOMETRIES.get(key)
    if check_input is not None and (geometry is None or not geometry.checked):
        check_input(input, num_groups, weight, bias)  # its errors before the api's
        geometry = geometry or _GEOMETRIES.add(key, _Geometry(input, weight, bias, num_groups, eps, swish_scale))
        geometry.checked = True
    elif geometry is None:
        geometry = _GEOMETRIES.add(key, _Geometry(input, weight, bias, num_groups, eps, swish_scale))
    return geometry


class _KernelArrays(NamedTuple):
    """What the backward kernel takes besides ``dy`` (in the api's order), as the forward's
    kernel saw it."""

    mean: object
    rstd: object
    x: object  # (N, C, *) array, or the (N, H, W, C) view of channels_last input
    gamma: object
    beta: object


@torch.library.custom_op("fastbwd::group_norm_swish", mutates_args=(), device_types="cpu")
def group_norm_swish(
    input: Tensor, weight: Tensor | None, bias: Tensor | None, num_groups: int, eps: float, swish_scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    return _forward_kernel(input, weight, bias, num_groups, eps, swish_scale)


@group_norm_swish.register_fake
def _(input, weight, bias, num_groups, eps, swish_scale):
    empty_error = _probes.group_norm_empty_error(input.shape)  # the real kernel's (PyTorch's) refusal
    if empty_error is not None:
        raise empty_error
    y = torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=c.memory_format(input))
    mean = input.new_empty((input.shape[0], num_groups), dtype=stats_dtype(input, weight, bias))
    return y, mean, torch.empty_like(mean)


def _backward_kernel(grad_output, input, mean, rstd, weight, bias, num_groups, swish_scale, need_weight, need_bias):
    """``(dx, dgamma or None, dbeta or None)`` by ``fastbwd.group_norm_swish_backward`` (§5),
    ``dx`` in the memory format :func:`_convert.memory_format` gives ``input``."""
    if input.numel() == 0:  # an empty batch: nothing to differentiate, nothing for fastbwd
        gamma, beta = _parameters(input, weight, bias)
        return (
            torch.empty(input.shape, dtype=input.dtype, memory_format=c.memory_format(input)).zero_(),
            torch.zeros_like(gamma) if need_weight else None,
            torch.zeros_like(beta) if need_bias else None,
        )
    geometry = geometry_of(input, weight, bias, num_groups, None, swish_scale)
    arrays = _KernelArrays(
        c.as_array(mean),
        c.as_array(rstd),
        geometry.x_array(input),
        geometry.gamma if weight is None else c.as_array(weight),
        geometry.beta if bias is None else c.as_array(bias),
    )
    return geometry.backward(grad_output, arrays, need_weight, need_bias, False)


@torch.library.custom_op("fastbwd::group_norm_swish_backward", mutates_args=(), device_types="cpu")
def group_norm_swish_backward(
    grad_output: Tensor,
    input: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    num_groups: int,
    swish_scale: float,
    output_mask: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dgamma, dbeta)``; dgamma (dbeta) is an empty ``(0,)`` tensor unless ``weight``
    (``bias``) is given and ``output_mask[1]`` (``[2]``) asks for it."""
    need_weight = output_mask[1] and weight is not None
    need_bias = output_mask[2] and bias is not None
    grad_input, grad_weight, grad_bias = _backward_kernel(
        grad_output, input, mean, rstd, weight, bias, num_groups, swish_scale, need_weight, need_bias
    )
    none_weight, none_bias = _unrequested(input, weight, bias)
    return (
        grad_input,
        none_weight if grad_weight is None else grad_weight,
        none_bias if grad_bias is None else grad_bias,
    )


def _unrequested(input, weight, bias):
    """The empty tensors standing for gradients nobody asked for (a custom op returns tensors)."""
    return (
        input.new_empty((0,), dtype=weight.dtype if weight is not None else input.dtype),
        input.new_empty((0,), dtype=bias.dtype if bias is not None else input.dtype),
    )


@group_norm_swish_backward.register_fake
def _(grad_output, input, mean, rstd, weight, bias, num_groups, swish_scale, output_mask):
    grad_input = torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=c.memory_format(input))
    need_weight = output_mask[1] and weight is not None
    need_bias = output_mask[2] and bias is not None
    none_weight, none_bias = _unrequested(input, weight, bias)
    return (
        grad_input,
        torch.empty_like(weight) if need_weight else none_weight,
        torch.empty_like(bias) if need_bias else none_bias,
    )


def _group_norm_swish_setup(ctx, inputs, output):
    input, weight, bias, num_groups, eps, swish_scale = inputs
    _, mean, rstd = output
    ctx.save_for_backward(input, weight, bias, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)  # no zero gradients made for mean and rstd
    ctx.num_groups, ctx.eps, ctx.swish_scale = num_groups, eps, swish_scale


def _group_norm_swish_grad(ctx, grad_output, grad_mean, grad_rstd):
    if grad_output is None:
        return (None,) * 6
    input, weight, bias, mean, rstd = ctx.saved_tensors
    return _grad(ctx, grad_output, input, weight, bias, lambda: (mean, rstd), None)


def _grad(ctx, grad_output, input, weight, bias, statistics, kept):
    """The operator's backward formula; ``statistics()`` gives the forward's mean and rstd
    tensors; ``kept`` is ``(geometry, arrays)``, the :class:`_Geometry` and
    :class:`_KernelArrays` the eager path's forward kept, or None."""
    needs = ctx.needs_input_grad[:3]
    if torch.is_grad_enabled() and input.numel() != 0:
        # A graph of the backward was asked for (create_graph=True): the fused kernel has no
        # derivative, so differentiate PyTorch's composite instead (exact double backward). An
        # empty input's gradients are constant zeros (and group_norm's decomposition cannot
        # reshape an empty input under dynamic shapes).
        return _composite_grad(grad_output, input, weight, bias, needs, ctx) + (None,) * 3
    need_weight, need_bias = needs[1] and weight is not None, needs[2] and bias is not None
    if kept is not None and _eager(grad_output, input):
        geometry, arrays = kept
        grads = geometry.backward(grad_output, arrays, need_weight, need_bias, True)
    else:
        arguments = (grad_output, input, *statistics(), weight, bias, ctx.num_groups, ctx.swish_scale)
        if _eager(grad_output, input):
            grads = _backward_kernel(*arguments, need_weight, need_bias)
        else:
            grads = group_norm_swish_backward(*arguments, [needs[0], need_weight, need_bias])
    return (
        grads[0] if needs[0] else None,
        grads[1] if need_weight else None,
        grads[2] if need_bias else None,
        None,
        None,
        None,
    )


def _composite_grad(grad_output, input, weight, bias, needs, ctx):
    def composite(input, weight, bias):
        y = torch.nn.functional.group_norm(input, ctx.num_groups, weight, bias, ctx.eps)
        return y * torch.sigmoid(ctx.swish_scale * y)

    return _partials(composite, (input, weight, bias), needs, lambda output: grad_output)


def _partials(function, inputs, needs, cotangents):
    """The vector-Jacobian products of ``function`` at ``inputs`` (some of them None) with the
    cotangents ``cotangents(outputs)``, for the inputs that ``needs`` asks for: partial
    derivatives (``torch.func.vjp``; ``autograd.grad`` would also follow paths between the
    inputs), differentiable in turn when grad mode is on."""
    present = [index for index, t in enumerate(inputs) if t is not None]

    def call(*tensors):
        full = list(inputs)
        for index, tensor in zip(present, tensors):
            full[index] = tensor
        return function(*full)

    outputs, vjp = torch.func.vjp(call, *[inputs[index] for index in present])
    grads = dict(zip(present, vjp(cotangents(outputs))))
    return tuple(grads[index] if need and index in grads else None for index, need in enumerate(needs))


group_norm_swish.register_autograd(_group_norm_swish_grad, setup_context=_group_norm_swish_setup)


def explicit_backward(grad_output, input, mean, rstd, weight, bias, num_groups, swish_scale):
    """The backward of docs/semantics.md §5 written with differentiable PyTorch ops, from the
    given ``mean`` and ``rstd``: the derivative of ``fastbwd::group_norm_swish_backward``."""
    batch, channels = input.shape[:2]
    broadcast = (1, channels) + (1,) * (input.dim() - 2)
    grouped = (batch, num_groups, math.prod(input.shape[1:]) // num_groups)  # no -1: empty inputs too
    gamma = weight if weight is not None else torch.ones(channels, dtype=mean.dtype)
    beta = bias if bias is not None else torch.zeros(channels, dtype=mean.dtype)
    xhat = ((input.reshape(grouped) - mean.reshape(batch, num_groups, 1)) * rstd.reshape(batch, num_groups, 1)).reshape(
        input.shape
    )
    y = xhat * gamma.reshape(broadcast) + beta.reshape(broadcast)
    sig = torch.sigmoid(swish_scale * y)
    gnew = grad_output * sig * (1 + swish_scale * y * (1 - sig))
    reduced = [0] + list(range(2, input.dim()))
    dgamma, dbeta = (gnew * xhat).sum(reduced), gnew.sum(reduced)
    scaled = (gnew * gamma.reshape(broadcast)).reshape(grouped)
    c1 = scaled.mean(-1, keepdim=True)
    c2 = (scaled * xhat.reshape(grouped)).mean(-1, keepdim=True)
    dx = rstd.reshape(batch, num_groups, 1) * (scaled - xhat.reshape(grouped) * c2 - c1)
    return dx.reshape(input.shape), dgamma, dbeta


def _group_norm_swish_backward_setup(ctx, inputs, output):
    grad_output, input, mean, rstd, weight, bias, num_groups, swish_scale, _ = inputs
    ctx.save_for_backward(grad_output, input, mean, rstd, weight, bias)
    ctx.num_groups, ctx.swish_scale = num_groups, swish_scale


def _group_norm_swish_backward_grad(ctx, grad_dx, grad_dgamma, grad_dbeta):
    def cotangents(outputs):
        # Gradients of outputs nobody asked for (empty, or unused) count as zero.
        return tuple(
            g.to(o.dtype) if g is not None and g.shape == o.shape else torch.zeros_like(o)
            for o, g in zip(outputs, (grad_dx, grad_dgamma, grad_dbeta))
        )

    function = lambda *tensors: explicit_backward(*tensors, ctx.num_groups, ctx.swish_scale)  # noqa: E731
    return _partials(function, ctx.saved_tensors, ctx.needs_input_grad[:6], cotangents) + (None,) * 3


group_norm_swish_backward.register_autograd(
    _group_norm_swish_backward_grad, setup_context=_group_norm_swish_backward_setup
)


# ---- the eager path: the operators' own kernels and formulas, without the dispatcher ---------
# A Python custom operator costs tens of microseconds per call in dispatch (docs/history.md);
# eager calls on plain tensors skip that, with the same code as the operator.


# forward(ctx, ...) rather than a setup_context staticmethod: Function.apply binds the
# arguments of the latter by inspect.signature, which costs more than the rest of the call.
class EagerRoIAlign(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *inputs):
        output = _roi_align_kernel(*inputs)
        _roi_align_setup(ctx, inputs, output)
        return output

    backward = staticmethod(_roi_align_grad)


class EagerGroupNormSwish(torch.autograd.Function):
    """The operator's forward and backward for ``y`` alone, on a call's :class:`_Geometry` (mean
    and rstd stay inside as arrays: the public function returns ``y`` only, and each extra
    output costs autograd bookkeeping)."""

    @staticmethod
    def forward(ctx, input, weight, bias, geometry):
        y, arrays = geometry.forward(input, weight, bias)
        ctx.kept = geometry, arrays
        ctx.save_for_backward(input, weight, bias)
        ctx.num_groups, ctx.eps, ctx.swish_scale = geometry.num_groups, geometry.eps, geometry.swish_scale
        return y

    @staticmethod
    def backward(ctx, grad_output):
        kept = ctx.kept

        def statistics():
            arrays = kept[1]
            return c.as_tensor(arrays.mean), c.as_tensor(arrays.rstd)

        return _grad(ctx, grad_output, *ctx.saved_tensors, statistics, kept)[:4]
