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
end); the kernels here only translate tensors to arrays and back. The GroupNorm + Swish pair
serves every fused use (the drop-ins, the eager fusion, compiled graphs), with one rule for what
fastbwd's kernels take (:func:`refusal`).
"""

import contextlib
import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

import fastbwd
from fastbwd import _dispatch
from fastbwd import _validation as v
from fastbwd.api import _plans
from fastbwd.api import group_norm_swish as gns_api
from fastbwd.api import roi_align as roi_align_api

from . import _convert as c
from . import _private, _switch
from ._routing import GRAPH_CALLS


def fx_leaf(function, input, *args):
    """``function(input, *args)`` recorded as one node of the graph that ``input`` (a
    ``torch.fx.Proxy``) is being traced into: what ``torch.fx.wrap`` does, for calls through a
    name it did not patch (``torch.fx.wrap`` patches one module's global)."""
    return input.tracer.create_proxy("call_function", function, (input, *args), {})


def _eager(*tensors):
    """True when ``tensors`` are plain tensors and nothing traces or transforms the call, so an
    autograd formula may run a kernel directly instead of through its operator's dispatcher
    entry (which costs tens of microseconds per call in Python): ``_private.eager_tensors``."""
    return _private.eager_tensors(tensors)


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
            f"but got {_dtype_name(tensor.dtype)}"
        )


def _dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def _check_roi_align(tensor, rois, name):
    """Refuse, before anything is allocated, what torchvision's roi_align kernels refuse, with
    the exception type they raise (RuntimeError): ``tensor`` (the input, or the backward's
    ``grad``) of a dtype the kernels take and 4-D, the boxes ``rois`` a ``(K, 5)`` tensor of its
    dtype on its device. The real and the fake kernels both ask (a compiled call is refused when
    it is traced)."""
    _check_roi_align_dtype(tensor, name)
    if tensor.dim() != 4:
        raise RuntimeError(f"roi_align: {name} must be 4-D, but got {tensor.dim()}-D with shape {tuple(tensor.shape)}")
    if rois.dim() != 2 or rois.shape[1] != 5:
        raise RuntimeError(f"roi_align: boxes must have shape (K, 5), but got shape {tuple(rois.shape)}")
    if rois.dtype != tensor.dtype:
        raise RuntimeError(
            f"roi_align: boxes.dtype must equal {name}.dtype ({_dtype_name(tensor.dtype)}), "
            f"but got {_dtype_name(rois.dtype)}"
        )
    if rois.device != tensor.device:
        raise RuntimeError(f"roi_align: boxes must be on {name}'s device ({tensor.device}), but got {rois.device}")


@contextlib.contextmanager
def _torch_errors():
    """What fastbwd's api refuses in a RoIAlign call, as the exception type torchvision's kernels
    raise for the calls they refuse (RuntimeError), in the api's words. (No PyTorch code computes
    RoIAlign: torchvision's is not required.)"""
    try:
        yield
    except fastbwd.ParamError as error:
        raise RuntimeError(str(error)) from error


def _roi_align_kernel(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    """The forward; a channels_last input runs the NHWC layout, in place, and gives a
    channels_last result."""
    _check_roi_align(input, rois, "input")
    c.match_torch_threads()
    memory_format = c.memory_format(input)
    output = c.empty((rois.shape[0], input.shape[1], pooled_height, pooled_width), input.dtype, memory_format)
    if output.numel() == 0:
        return output  # nothing to compute (no box, no channel, or a pooled size of 0), as torchvision
    scalars = (spatial_scale, max(sampling_ratio, 0), aligned)
    if memory_format == torch.channels_last:
        layout, arrays, out = "NHWC", (_nhwc(input), c.as_array(rois)), _nhwc(output)
    else:
        layout, arrays, out = "NCHW", (c.as_array(input), c.as_array(rois)), c.as_array(output)
    with _torch_errors(), v.called_as("roi_align", _ROI_ALIGN_SUBJECTS):
        plan = roi_align_api.forward_plan(*arrays, pooled_height, pooled_width, *scalars, layout, out)
    roi_align_api.run_forward(plan, *arrays, out)
    return output


def custom_op(name, kernel, schema):
    """``fastbwd::<name>``, a CPU operator of ``schema`` that ``kernel`` runs (it mutates nothing)."""
    return torch.library.custom_op(f"fastbwd::{name}", kernel, mutates_args=(), device_types="cpu", schema=schema)


roi_align = custom_op(
    "roi_align",
    _roi_align_kernel,
    "(Tensor input, Tensor rois, float spatial_scale, int pooled_height, int pooled_width, int sampling_ratio, "
    "bool aligned) -> Tensor",
)


@roi_align.register_fake
def _(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    _check_roi_align(input, rois, "input")
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
    _check_roi_align(grad, rois, "grad")
    c.match_torch_threads()
    input_shape = (batch_size, channels, height, width)
    scalars = (spatial_scale, max(sampling_ratio, 0), aligned)
    if channels_last:
        grad_input = c.empty(input_shape, grad.dtype, torch.channels_last)
        layout, arrays, out = "NHWC", (_nhwc(grad), c.as_array(rois)), _nhwc(grad_input)
    else:
        grad_input = c.empty(input_shape, grad.dtype)
        layout, arrays, out = "NCHW", (c.as_array(grad.contiguous()), c.as_array(rois)), c.as_array(grad_input)
    with _torch_errors():
        plan = roi_align_api.plan(*arrays, input_shape, pooled_height, pooled_width, *scalars, layout, out)
    roi_align_api.run(plan, *arrays, out)
    return grad_input


roi_align_backward = custom_op(
    "roi_align_backward",
    _roi_align_backward_kernel,
    "(Tensor grad, Tensor rois, float spatial_scale, int pooled_height, int pooled_width, int batch_size, "
    "int channels, int height, int width, int sampling_ratio, bool aligned, bool channels_last=False) -> Tensor",
)


@roi_align_backward.register_fake
def _(grad, *arguments):  # rois, spatial_scale, pooled sizes, batch_size, channels, height, width, ..., channels_last
    _check_roi_align(grad, arguments[0], "grad")
    memory_format = torch.channels_last if arguments[10:] == (True,) else torch.contiguous_format
    return torch.empty(arguments[4:8], dtype=grad.dtype, device=grad.device, memory_format=memory_format)


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
    # torchvision's autocast kernel: compute in float32 (autocast off inside), return the input's
    # dtype. As autocast does, only floating-point tensors are cast: an integer input is refused
    # as outside autocast.
    input32, rois32 = (t.float() if t.is_floating_point() else t for t in (input, rois))
    with torch.autocast("cpu", enabled=False):
        output = roi_align(input32, rois32, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)
    return output.to(input.dtype)


# A registration lasts as long as its Library object: this one lives with the module.
_library = torch.library.Library("fastbwd", "FRAGMENT")
_library.impl("roi_align", _roi_align_autocast, "AutocastCPU", with_keyset=True)


# ---- GroupNorm + Swish ----------------------------------------------------------------------
# One operator family for every fused GroupNorm + Swish: the drop-ins, the eager fusion and the
# pairs the graph passes fuse (SiLU is swish_scale 1). ``follows_switch`` (the passes' calls)
# makes a call run PyTorch's own kernels while fastbwd is disabled; every call runs PyTorch's
# own kernels when :func:`refusal` refuses it.

#: The input dtypes fastbwd's GroupNorm+Swish kernels take, and those that may come with
#: float32 parameters (mixed precision, as ``native_group_norm`` allows on the CPU).
FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MIXED = (torch.float16, torch.bfloat16)


def _known(size):
    """``size`` as an int, or None when it is symbolic (known only at run time)."""
    return size if isinstance(size, int) else None


def settings_refusal(channels, num_groups, eps, swish_scale=1.0):
    """Why fastbwd's kernels do not take a GroupNorm + Swish of these settings, or None
    (``channels`` None: not known yet; ``eps`` None: not asked, as for the backward alone)."""
    if type(num_groups) is not int or num_groups <= 0:
        return f"num_groups={num_groups!r}"
    if eps is not None and not (type(eps) in (int, float) and 0 <= eps < math.inf):
        return f"eps={eps!r}: fastbwd's kernels take a finite eps >= 0"
    if not (type(swish_scale) in (int, float) and math.isfinite(swish_scale)):
        return f"swish_scale={swish_scale!r}: fastbwd's kernels take a finite one"
    if channels is not None and channels % num_groups:
        return f"{channels} channels do not split into {num_groups} groups"
    if channels is not None and channels // num_groups > gns_api.MAX_GROUP_SIZE:
        return f"{channels // num_groups} channels per group: fastbwd's kernels take at most {gns_api.MAX_GROUP_SIZE}"
    return None


def refusal(input, num_groups, weight, bias, eps, swish_scale=1.0):
    """Why fastbwd's fused GroupNorm + Swish does not stand in for ``F.group_norm(input,
    num_groups, weight, bias, eps)`` and the Swish after it, or None when it does: the one rule of
    the drop-ins, the eager fusion, both graph passes and the operators' kernels. A refused call
    runs PyTorch's own code, so a call PyTorch refuses raises PyTorch's error. The tensors may be
    fake; a size known only at run time refuses nothing here (the kernels decide again then)."""
    if not isinstance(input, torch.Tensor):
        return f"its input is a {type(input).__name__}"
    if input.device.type != "cpu" or input.layout != torch.strided:
        return f"its input is on {input.device.type}, not the CPU" if input.device.type != "cpu" else "a sparse input"
    if input.dtype not in FUSED_DTYPES or input.dim() < 2:
        return f"its input is {input.dim()}-D {input.dtype}"
    parameters = [p for p in (weight, bias) if p is not None]
    shape = [_known(size) for size in input.shape]
    for parameter in parameters:
        if not (isinstance(parameter, torch.Tensor) and parameter.device.type == "cpu" and parameter.dim() == 1):
            return "a parameter is not a vector on the CPU"
        size = _known(parameter.shape[0])
        if parameter.layout != torch.strided or None not in (size, shape[1]) and size != shape[1]:
            return "a parameter is not one value per channel"
    dtypes = {parameter.dtype for parameter in parameters}
    if dtypes - {input.dtype} and (dtypes != {torch.float32} or input.dtype not in _MIXED):
        return f"{input.dtype} input with {'/'.join(map(str, dtypes))} parameters"  # PyTorch's pairing rule
    reason = settings_refusal(shape[1], num_groups, eps, swish_scale)
    if reason is None and None not in shape:
        if math.prod(shape) == 0:
            reason = "its input is empty"  # PyTorch's own code decides (2.13 returns empty results, 2.14 raises)
        elif shape[0] * shape[1] // num_groups * math.prod(shape[2:]) == 1:
            reason = "one value per group"  # F.group_norm raises a ValueError
    return reason


def silu_functions():
    """``{function: works in place}`` of every spelling of SiLU the fusion recognises: ``F.silu``
    (which ``nn.SiLU`` calls) and its private aliases."""
    if not _SILUS:
        _SILUS.update({torch.nn.functional.silu: False, **_private.silu_aliases()})
    return _SILUS


_SILUS = {}


def stats_dtype(input, weight, bias):
    """The dtype of mean and rstd (and of the parameters' gradients): the parameters' (float32
    parameters with half input: mixed precision), else the input's, as ``native_group_norm``."""
    parameter = weight if weight is not None else bias
    return parameter.dtype if parameter is not None else input.dtype


class _Geometry:
    """What the tensors' metadata and the other arguments decide about a GroupNorm+Swish call,
    worked out once: the memory format, the constant parameters of a call without weight or
    bias, and fastbwd's prepared calls (``function.prepare``, docs/numpy.md): the forward's,
    made here (it validates the call), and the backward's for each pair of parameter gradients
    asked for, made by its first call. A later call of the same geometry (every step of a
    training loop) runs a prepared call, which checks only the arrays' metadata."""

    def __init__(self, input, weight, bias, num_groups, eps, swish_scale, threads):
        self.memory_format = c.memory_format(input)
        self.channels_last = self.memory_format != torch.contiguous_format
        self.data_format = "NHWC" if self.channels_last else "NCHW"
        self.shape = input.shape
        self.to_nhwc, self.to_nchw = c.channels_last_permutation(input.dim())
        # The kernels take rank 2 to 8; nn.GroupNorm any rank. A group's values do not depend
        # on how the spatial axes are split, so a higher-rank (contiguous) input is seen as
        # (N, C, HxW).
        self.flat = input.dim() > gns_api.MAX_RANK
        # Whether an input of this geometry is dense in its memory format already (the key holds
        # its strides): then its array views it without asking PyTorch on each call.
        self.input_dense = input.is_contiguous(memory_format=self.memory_format)
        self.num_groups = num_groups
        # Without affine parameters the normalisation is the identity map: gamma one and beta zero
        # (in stats_dtype), made here once (the kernels only read them).
        channels, dtype = input.shape[1], stats_dtype(input, weight, bias)
        self.gamma = None if weight is not None else c.as_array(torch.ones(channels, dtype=dtype))
        self.beta = None if bias is not None else c.as_array(torch.zeros(channels, dtype=dtype))
        self.eps, self.swish_scale = eps, swish_scale
        # the call's static description, for fastbwd._dispatch (serves), and its decisions
        tasks = gns_api.parallel_tasks(input.shape[0], channels, num_groups, self.data_format, threads)
        self.description = (math.prod(input.shape), c.ARRAY_DTYPES[input.dtype].name, self.data_format, threads, tasks)
        self._decisions = {}
        # the backward's prepared calls, by 2 * need_weight + need_bias (made by their first call)
        self._backward = [None] * 4
        if eps is not None:  # prepared with the thread count geometry_of set (a key of the geometry)
            x, (gamma, beta) = self.input_array(input), self.parameters(weight, bias)
            self._forward = gns_api.group_norm_swish.prepare(
                x, gamma, beta, num_groups, self.data_format, eps, True, swish_scale
            )

    def serves(self, path):
        """Whether fastbwd's kernels run this geometry's calls on ``path`` ("dropin", "fused",
        "compiled") under the bridge's policy: ``fastbwd._dispatch.decide``, once per path,
        policy and reading of the stored table."""
        memo = (path, _switch._policy, _dispatch.generation)
        found = self._decisions.get(memo)
        if found is None:
            elements, dtype, layout, threads, tasks = self.description
            found = _dispatch.decide(
                memo[1], "torch", path, "group_norm_swish", elements, dtype, layout, threads, tasks
            )
            self._decisions[memo] = found
        return found

    def x_array(self, tensor):
        """``tensor`` (a gradient shaped like the input) as the array the kernels take: dense in
        the memory format (a copy unless it is), channels-last as its (N, *spatial, C) view,
        above the kernels' rank as (N, C, HxW)."""
        if not self.channels_last or tensor.stride() != self.output_strides:
            # (PyTorch's contiguous() costs twice a strides comparison for channels_last)
            tensor = c.dense(tensor, self.memory_format)
        return self._array(tensor)

    def input_array(self, input):
        """:meth:`x_array` of an input of this geometry (its strides are the geometry's)."""
        return self._array(input if self.input_dense else c.dense(input, self.memory_format))

    def _array(self, tensor):
        array = c.as_array(tensor)
        if self.flat:
            return array.reshape(array.shape[0], array.shape[1], -1)
        return array.transpose(self.to_nhwc) if self.channels_last else array

    def forward(self, input, weight, bias):
        """The forward kernel on a non-empty ``input`` of this geometry: ``y`` as a tensor, and
        the arrays the backward kernel takes besides ``dy`` (:class:`_KernelArrays`, with
        ``mean`` and ``rstd``), which the eager path keeps so that its backward converts only
        ``dy``."""
        x = self.input_array(input)
        gamma, beta = self.parameters(weight, bias)
        try:
            y, mean, rstd = self._forward(x, gamma, beta)
        except fastbwd.ParamError:  # other metadata than the prepared call's: a misaligned tensor
            y, mean, rstd = gns_api.group_norm_swish(
                x, gamma, beta, self.num_groups, self.data_format, self.eps, True, self.swish_scale
            )
        return self.result(y), _KernelArrays(mean, rstd, x, gamma, beta)

    def parameters(self, weight, bias):
        """gamma and beta as the kernels take them (the geometry's own for a missing parameter)."""
        return self.gamma if weight is None else c.as_array(weight), self.beta if bias is None else c.as_array(bias)

    def backward(self, grad_output, arrays, need_weight, need_bias):
        """``(dx, dgamma or None, dbeta or None)`` from ``grad_output`` and the other inputs as
        arrays (:class:`_KernelArrays`): the prepared backward call made by the first call asking
        for these gradients, or the public function for arrays of other metadata (statistics the
        operator was given flat, a size-1 axis's stride). The results are new NumPy arrays wrapped
        without a copy (dx channels_last again for channels_last input). None when the api
        refuses the call: the caller then runs PyTorch's code."""
        dy = self.x_array(grad_output)
        c.match_torch_threads()
        index = 2 * need_weight + need_bias
        prepared = self._backward[index]
        if prepared is None:
            prepared = self._backward[index] = gns_api.group_norm_swish_backward.prepare(
                dy, *arrays, self.num_groups, self.data_format, self.swish_scale, need_weight, need_bias
            )
        try:
            grad_input, grad_weight, grad_bias = prepared(dy, *arrays)
        except fastbwd.ParamError:  # other metadata than the prepared call's (or a call it refuses)
            try:
                grad_input, grad_weight, grad_bias = gns_api.group_norm_swish_backward(
                    dy, *arrays, self.num_groups, self.data_format, self.swish_scale, need_weight, need_bias
                )
            except fastbwd.ParamError:  # not a call fastbwd's kernel takes: never an error PyTorch would not raise
                return None
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
        arrays come back in the (N, C, *spatial) shape, flattened ones in the input's. The
        array is reshaped before it is wrapped, so the tensor is no view (an autograd Function's
        output that is a view cannot be modified in place), and a NumPy transpose costs a third
        of ``Tensor.permute``."""
        if self.flat:
            array = array.reshape(self.shape)
        elif self.channels_last:
            array = array.transpose(self.to_nchw)
        return c.as_tensor(array)


_GEOMETRIES = _plans.Plans()


def geometry_of(input, weight, bias, num_groups, eps, swish_scale):
    """The :class:`_Geometry` of a call on CPU tensors (``eps`` None for the backward alone), made
    on its first call; None when :func:`refusal` (or the api's validation) refuses the call. The
    key holds everything both read: each tensor's metadata and the other arguments' values, with
    their types (``True`` and ``1`` differ), and PyTorch's thread count (Numba's is set here from
    it, which sizes the kernels' tasks: a geometry's prepared calls are made for it; the decision
    takes it, as every path's does)."""
    threads = c.match_torch_threads()
    key = (
        threads,
        input.shape,
        input.stride(),
        input.dtype,
        None if weight is None else (weight.shape, weight.stride(), weight.dtype),
        None if bias is None else (bias.shape, bias.stride(), bias.dtype),
        type(num_groups),
        num_groups,
        type(eps),
        eps,
        type(swish_scale),
        swish_scale,
    )
    geometry = _GEOMETRIES.get(key)
    if geometry is None:
        geometry = refusal(input, num_groups, weight, bias, eps, swish_scale)
        if geometry is None:
            try:
                geometry = _Geometry(input, weight, bias, num_groups, eps, swish_scale, threads)
            except fastbwd.ParamError as error:
                geometry = str(error)
        geometry = _GEOMETRIES.add(key, geometry)  # a refusal is remembered as its reason
    return geometry if type(geometry) is _Geometry else None


class _KernelArrays(NamedTuple):
    """What the backward kernel takes besides ``dy`` (in the api's order), as the forward's
    kernel saw it."""

    mean: object
    rstd: object
    x: object  # (N, C, *) array, or the (N, H, W, C) view of channels_last input
    gamma: object
    beta: object


def _fastbwd_geometry(input, weight, bias, num_groups, eps, swish_scale, follows_switch):
    """The call's :class:`_Geometry` when fastbwd's kernels run it, else None (PyTorch's do). A
    ``follows_switch`` call (a pair a graph pass fused) follows the switch and the decision of
    the path "compiled" for its real sizes (the pass decided already for sizes known when it
    ran); any other is a drop-in's, decided by its caller."""
    if not follows_switch:
        return geometry_of(input, weight, bias, num_groups, eps, swish_scale)
    if not _switch.is_enabled():
        return None
    geometry = geometry_of(input, weight, bias, num_groups, eps, swish_scale)
    return geometry if geometry is not None and geometry.serves("compiled") else None


def below_floor(path, input):
    """True when the decision for a GroupNorm + Swish call on ``path`` is the framework's code
    by its size alone (under ``"auto"``, fewer elements than any threshold of the path): one
    comparison, before anything else is looked at (the floor of the thread count the call runs
    on). ``input`` a plain tensor."""
    if _switch._policy != "auto":
        return False
    threads = torch.get_num_threads()
    least = _FLOORS[path].get(threads)
    return input.numel() < (_dispatch.floor(*FLOOR_KEYS[path], threads) if least is None else least)


FLOOR_KEYS = {path: ("torch", path, "group_norm_swish") for path in ("fused", "dropin")}
#: The floors' dicts of FLOOR_KEYS, held (fastbwd._dispatch.floors_of): a call reads one directly.
_FLOORS = {path: _dispatch.floors_of(*key) for path, key in FLOOR_KEYS.items()}


def _sizes(input):
    """``(N, C, HxW)`` of an ``(N, C, *)`` input, as PyTorch's GroupNorm kernels take them."""
    if input.dim() < 2:  # no such sizes: F.group_norm's own error
        torch.nn.functional.group_norm(input, 1)
    return input.shape[0], input.shape[1], math.prod(input.shape[2:])


def native_group_norm(input, weight, bias, num_groups, eps):
    """``(y, mean, rstd)`` by PyTorch's ``native_group_norm`` (``F.group_norm``'s kernel)."""
    return torch.native_group_norm(input, weight, bias, *_sizes(input), num_groups, eps)


def native_backward(grad_output, y, input, mean, rstd, weight, num_groups, output_mask, swish_scale=1.0):
    """``(dx, dgamma, dbeta)`` of the Swish of ``F.group_norm(...)`` by PyTorch's own kernels
    (``silu_backward`` for SiLU, the Swish's derivative in PyTorch ops otherwise, then
    ``native_group_norm_backward``), ``y`` being the GroupNorm's output."""
    if swish_scale == 1:
        grad_y = torch.ops.aten.silu_backward(grad_output, y)
    else:
        grad_y = _swish_backward(grad_output, y, swish_scale)
    return torch.ops.aten.native_group_norm_backward(
        grad_y, input, mean, rstd, weight, *_sizes(input), num_groups, output_mask
    )


def _swish(y, swish_scale):
    return torch.nn.functional.silu(y) if swish_scale == 1 else y * torch.sigmoid(swish_scale * y)


def _swish_backward(grad_output, y, swish_scale):
    """The Swish's derivative applied to ``grad_output`` (§5's ``gnew``), in PyTorch ops."""
    sig = torch.sigmoid(swish_scale * y)
    return grad_output * sig * (1 + swish_scale * y * (1 - sig))


def _forward(input, weight, bias, num_groups, eps, swish_scale, follows_switch=False):
    """``(y, mean, rstd)``, ``y`` in the memory format :func:`_convert.memory_format` gives
    ``input``: fastbwd's kernel (§5.1), or PyTorch's ``native_group_norm`` and Swish."""
    geometry = _fastbwd_geometry(input, weight, bias, num_groups, eps, swish_scale, follows_switch)
    if geometry is not None:
        y, arrays = geometry.forward(input, weight, bias)
        return y, c.as_tensor(arrays.mean), c.as_tensor(arrays.rstd)
    y, mean, rstd = native_group_norm(input, weight, bias, num_groups, eps)
    statistics = stats_dtype(input, weight, bias)
    y = _swish(y, swish_scale).contiguous(memory_format=c.memory_format(input))
    return y, mean.to(statistics), rstd.to(statistics)


def _backward(grad_output, input, mean, rstd, weight, bias, num_groups, swish_scale, needs, eps, follows_switch):
    """``(dx, dgamma or None, dbeta or None)``, ``dx`` in the memory format
    :func:`_convert.memory_format` gives ``input``, ``needs`` the (weight, bias) gradients asked
    for: fastbwd's kernel (§5), or PyTorch's (as :func:`_forward` chooses)."""
    need_weight, need_bias = needs
    geometry = _fastbwd_geometry(input, weight, bias, num_groups, eps, swish_scale, follows_switch)
    if geometry is not None:
        arrays = _KernelArrays(
            c.as_array(mean), c.as_array(rstd), geometry.input_array(input), *geometry.parameters(weight, bias)
        )
        grads = geometry.backward(grad_output, arrays, need_weight, need_bias)
        if grads is not None:
            return grads
    return _native_grads(grad_output, input, mean, rstd, weight, bias, num_groups, swish_scale, needs, eps)


def _native_grads(grad_output, input, mean, rstd, weight, bias, num_groups, swish_scale, needs, eps):
    """:func:`_backward` by PyTorch's own kernels."""
    try:
        y = _normalised(input, mean, rstd, weight, bias, num_groups, eps)
    except Exception:
        # arguments PyTorch's GroupNorm backward refuses (a weight of another size, no groups):
        # its own error rather than that of the normalisation written here
        _native_checks(grad_output, input, mean, rstd, weight, bias, num_groups, [True, *needs])
        raise
    grads = native_backward(grad_output, y, input, mean, rstd, weight, num_groups, [True, *needs], swish_scale)
    return grads[0].contiguous(memory_format=c.memory_format(input)), grads[1], grads[2]


def _normalised(input, mean, rstd, weight, bias, num_groups, eps):
    """The GroupNorm output the Swish saw: ``native_group_norm``'s again (its very bits, so the
    backward is PyTorch's) when ``mean`` and ``rstd`` are the statistics it computes, else
    normalised with the ``mean`` and ``rstd`` given (the formula of §5 takes them as given)."""
    if eps is not None:
        y, own_mean, own_rstd = native_group_norm(input, weight, bias, num_groups, eps)
        if torch.equal(own_mean, mean.to(own_mean.dtype)) and torch.equal(own_rstd, rstd.to(own_rstd.dtype)):
            return y
    return _normalise(input, mean, rstd, weight, bias, num_groups)[1].to(input.dtype)


def _normalise(input, mean, rstd, weight, bias, num_groups):
    """``(xhat, y)``: GroupNorm with the given ``mean`` and ``rstd`` in differentiable PyTorch ops
    (``y`` with the affine parameters that are given)."""
    batch, channels = input.shape[:2]
    broadcast = (1, channels) + (1,) * (input.dim() - 2)
    grouped = (batch, num_groups, math.prod(input.shape[1:]) // num_groups)  # no -1: empty inputs too
    xhat = ((input.reshape(grouped) - mean.reshape(batch, num_groups, 1)) * rstd.reshape(batch, num_groups, 1)).reshape(
        input.shape
    )
    y = xhat if weight is None else xhat * weight.reshape(broadcast)
    return xhat, y if bias is None else y + bias.reshape(broadcast)


@torch.library.custom_op("fastbwd::group_norm_swish", mutates_args=(), device_types="cpu")
def group_norm_swish(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    num_groups: int,
    eps: float,
    swish_scale: float,
    follows_switch: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` of GroupNorm then Swish; ``follows_switch``: PyTorch's own kernels
    while fastbwd is disabled (the fused pairs of compiled graphs)."""
    if follows_switch:
        GRAPH_CALLS["group_norm_swish"] += 1
    return _forward(input, weight, bias, num_groups, eps, swish_scale, follows_switch)


@group_norm_swish.register_fake
def _(input, weight, bias, num_groups, eps, swish_scale, follows_switch=False):
    # The real kernel runs PyTorch's own for an empty input (its refusal, from 2.14 on, is ours
    # too); tensors on several devices (a meta one among CPU ones dispatches here) are PyTorch's error.
    if input.numel() == 0 or not _one_device(input, weight, bias):
        native_group_norm(input, weight, bias, num_groups, eps)
    y = torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=c.memory_format(input))
    mean = input.new_empty((input.shape[0], num_groups), dtype=stats_dtype(input, weight, bias))
    return y, mean, torch.empty_like(mean)


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
    eps: float | None = None,
    follows_switch: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dgamma, dbeta)``; dgamma (dbeta) is an empty ``(0,)`` tensor unless ``weight``
    (``bias``) is given and ``output_mask[1]`` (``[2]``) asks for it. ``eps`` is the forward's
    (where PyTorch's own kernels compute the normalised output again), ``follows_switch`` as
    for the forward."""
    if follows_switch:
        GRAPH_CALLS["group_norm_swish_backward"] += 1
    arguments = (grad_output, input, mean, rstd, weight, bias, num_groups, swish_scale)
    if backward_refusal(grad_output, input, mean, rstd, weight, bias, num_groups, output_mask) is None:
        needs = _needs(output_mask, weight, bias)
        grads = _backward(*arguments, needs, eps, follows_switch)
    else:  # PyTorch's checks first (what they refuse raises PyTorch's own error), then its code
        needs = _native_checks(grad_output, input, mean, rstd, weight, bias, num_groups, output_mask)
        grads = _native_grads(*arguments, needs, eps)
    return _with_unrequested(grads, input, weight, bias, needs)


def backward_refusal(grad_output, input, mean, rstd, weight, bias, num_groups, output_mask):
    """Why fastbwd's backward kernel does not take the arguments of a
    ``fastbwd::group_norm_swish_backward`` call that :func:`refusal` does not read, or None: the
    rule's part for the backward operator, whose arguments need not come from its forward.
    ``grad_output`` a strided CPU tensor of the input's shape and dtype, ``mean`` and ``rstd``
    strided CPU tensors of the statistics' dtype (:func:`stats_dtype`), both ``(N, num_groups)``
    or both ``(N * num_groups,)``, ``output_mask`` three values. A call refused here runs
    PyTorch's own checks and code (``native_group_norm_backward`` takes statistics of any shape
    with N * num_groups values; it refuses another dtype, size or device)."""
    if len(output_mask) != 3:
        return f"output_mask has {len(output_mask)} values"
    if not (_strided_cpu(grad_output) and grad_output.dtype == input.dtype and grad_output.shape == input.shape):
        return "grad_output is not a CPU tensor of the input's shape and dtype"
    statistics = stats_dtype(input, weight, bias)
    shapes = ((input.shape[0], num_groups), (input.shape[0] * num_groups,))
    for tensor in (mean, rstd):
        if not (_strided_cpu(tensor) and tensor.dtype == statistics and tuple(tensor.shape) in shapes):
            return f"mean or rstd is not a CPU tensor of {statistics} shaped (N, num_groups) or (N * num_groups,)"
    if mean.shape != rstd.shape:
        return "mean and rstd have different shapes"
    return None


def _one_device(*tensors):
    """Whether the tensors given (None: not given) are all on one device."""
    return len({t.device for t in tensors if t is not None}) <= 1


def _strided_cpu(tensor):
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.layout == torch.strided


def _native_checks(grad_output, input, mean, rstd, weight, bias, num_groups, output_mask):
    """PyTorch's own checks of a GroupNorm backward's arguments: ``native_group_norm_backward``
    runs on them (and raises its error for what it refuses); returns the (weight, bias) gradients
    asked for."""
    needs = _needs(output_mask, weight, bias) if len(output_mask) == 3 else None
    mask = output_mask if needs is None else [output_mask[0], *needs]  # PyTorch's schema refuses another length
    torch.ops.aten.native_group_norm_backward(grad_output, input, mean, rstd, weight, *_sizes(input), num_groups, mask)
    return needs


def _needs(output_mask, weight, bias):
    """The (weight, bias) gradients ``output_mask`` asks for that exist."""
    return output_mask[1] and weight is not None, output_mask[2] and bias is not None


def _with_unrequested(grads, input, weight, bias, needs):
    """``grads`` with the empty tensors that stand for gradients nobody asked for (a custom op
    returns tensors)."""
    return (
        grads[0],
        grads[1] if needs[0] else input.new_empty((0,), dtype=weight.dtype if weight is not None else input.dtype),
        grads[2] if needs[1] else input.new_empty((0,), dtype=bias.dtype if bias is not None else input.dtype),
    )


@group_norm_swish_backward.register_fake
def _(
    grad_output, input, mean, rstd, weight, bias, num_groups, swish_scale, output_mask, eps=None, follows_switch=False
):
    if len(output_mask) != 3 or not _one_device(grad_output, input, mean, rstd, weight, bias):
        _native_checks(grad_output, input, mean, rstd, weight, bias, num_groups, output_mask)  # PyTorch's error
    needs = _needs(output_mask, weight, bias)
    grad_input = torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=c.memory_format(input))
    grads = (grad_input, needs[0] and torch.empty_like(weight), needs[1] and torch.empty_like(bias))
    return _with_unrequested(grads, input, weight, bias, needs)


def _group_norm_swish_setup(ctx, inputs, output):
    input, weight, bias, num_groups, eps, swish_scale, follows_switch = inputs
    _, mean, rstd = output
    ctx.save_for_backward(input, weight, bias, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)  # no zero gradients made for mean and rstd
    ctx.num_groups, ctx.eps, ctx.swish_scale, ctx.follows_switch = num_groups, eps, swish_scale, follows_switch


def _group_norm_swish_grad(ctx, grad_output, grad_mean, grad_rstd):
    if grad_output is None:
        return (None,) * 7
    input, weight, bias, mean, rstd = ctx.saved_tensors
    return _grad(ctx, grad_output, input, weight, bias, lambda: (mean, rstd)) + (None,)


def _grad(ctx, grad_output, input, weight, bias, statistics):
    """The operator's backward formula (for its first six inputs); ``statistics()`` gives the
    forward's mean and rstd tensors."""
    needs = ctx.needs_input_grad[:3]
    if torch.is_grad_enabled() and input.numel() != 0:
        # A graph of the backward was asked for (create_graph=True): the fused kernel has no
        # derivative, so differentiate PyTorch's composite instead (exact double backward). An
        # empty input's gradients are constant zeros (and group_norm's decomposition cannot
        # reshape an empty input under dynamic shapes).
        return _composite_grad(grad_output, input, weight, bias, needs, ctx) + (None,) * 3
    need_weight, need_bias = needs[1] and weight is not None, needs[2] and bias is not None
    arguments = (grad_output, input, *statistics(), weight, bias, ctx.num_groups, ctx.swish_scale)
    if _eager(grad_output, input):
        grads = _backward(*arguments, (need_weight, need_bias), ctx.eps, ctx.follows_switch)
    else:
        mask = [needs[0], need_weight, need_bias]
        grads = group_norm_swish_backward(*arguments, mask, ctx.eps, ctx.follows_switch)
    wanted = (needs[0], need_weight, need_bias)
    return tuple(grad if want else None for grad, want in zip(grads, wanted)) + (None,) * 3


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
    grouped = (batch, num_groups, math.prod(input.shape[1:]) // num_groups)
    xhat, y = _normalise(input, mean, rstd, weight, bias, num_groups)
    gnew = _swish_backward(grad_output, y, swish_scale)
    reduced = [0] + list(range(2, input.dim()))
    dgamma, dbeta = (gnew * xhat).sum(reduced), gnew.sum(reduced)
    scaled = (gnew if weight is None else gnew * weight.reshape(broadcast)).reshape(grouped)
    c1 = scaled.mean(-1, keepdim=True)
    c2 = (scaled * xhat.reshape(grouped)).mean(-1, keepdim=True)
    dx = rstd.reshape(batch, num_groups, 1) * (scaled - xhat.reshape(grouped) * c2 - c1)
    return dx.reshape(input.shape), dgamma, dbeta


def _group_norm_swish_backward_setup(ctx, inputs, output):
    grad_output, input, mean, rstd, weight, bias, num_groups, swish_scale = inputs[:8]
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
    return _partials(function, ctx.saved_tensors, ctx.needs_input_grad[:6], cotangents) + (None,) * 5


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
        ctx.follows_switch = False
        return y

    @staticmethod
    def backward(ctx, grad_output):
        geometry, arrays = ctx.kept
        input, weight, bias = ctx.saved_tensors  # raises, as PyTorch does, if one changed in place since
        if not torch.is_grad_enabled() and _eager(grad_output):
            # the kernel on the forward's own arrays, through the geometry's prepared call (a
            # gradient is asked for only of a tensor given, so needs says all)
            needs = ctx.needs_input_grad
            grads = geometry.backward(grad_output, arrays, needs[1], needs[2])
            if grads is not None:
                return grads[0] if needs[0] else None, grads[1], grads[2], None

        def statistics():
            return c.as_tensor(arrays.mean), c.as_tensor(arrays.rstd)

        return _grad(ctx, grad_output, input, weight, bias, statistics)[:4]
