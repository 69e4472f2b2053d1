"""Routing PyTorch's own CPU backward kernels to fastbwd (docs/semantics.md §7).

While enabled, a ``torch.library.Library("aten", "IMPL")`` holds fastbwd's implementations of
the CPU kernels of three aten backward operators and of their ``.grad_input`` (out=) overloads.
Each implementation:

1. takes the tensors as arrays without copying (a tensor that is neither contiguous nor
   channels_last is made dense first, in the memory format PyTorch's own kernel returns);
2. allocates the result with PyTorch's allocator in that memory format and lets the api
   function, which validates everything, write into it (``out=``);
3. when the api function refuses the call (``ParamError``: a replicate pad wider than the
   input, a size above the documents' limits, a dtype it does not take, ...) or the tensors
   cannot be viewed as arrays, calls PyTorch's own kernel instead, fetched with
   ``torch.library.get_kernel`` before the override was registered: enabling never adds an
   error and never changes a result PyTorch would give other than by fastbwd's own rounding.

Each call plans through the api (``api.<op>.plan`` with the arrays and the result buffer the call
will use, then ``run``): the api's table remembers each geometry's plan (docs/design.md, "The
one contract"), so a repeated call pays the lookup, as a repeated direct call does.

Only the CPU dispatch key is overridden: other devices, the autograd formulas (so double
backward) and every other operator are untouched. The kernels follow the switch (``_switch``):
disabled, every call goes to PyTorch's own kernel (see "registration" for why the registration
itself stays).

This is the routing of the policy ``"always"``. A Python kernel behind PyTorch's dispatcher
costs every call of the operator its hop into Python, served or not (docs/history.md, "Never
slower: the mechanisms"), so under ``"auto"`` nothing is registered here: ``_functional``
decides before the dispatcher, and a kernel registered by an earlier ``"always"`` hands every
call to PyTorch's own. :func:`serve` is the one way a call becomes fastbwd's, for every path.
"""

import collections
import warnings
from typing import NamedTuple

import torch

import fastbwd
from fastbwd.api import avg_pool2d, replication_pad2d, upsample_bilinear2d

from . import _convert as c
from . import _switch

_DIVISOR_UNSET = 0  # fastbwd's avg_pool2d_backward spelling of PyTorch's divisor_override=None


class _Call(NamedTuple):
    """One aten call as the api layer takes it (what a route's ``prepare`` returns)."""

    api: object  # the api module: plan(*tensors (as arrays), *arguments, out), run(plan, *arrays, out)
    tensors: tuple  # grad_output, dense in memory_format, then the forward input if the op has one
    arguments: tuple  # the api's other arguments, in fastbwd's spelling
    shape: tuple  # of the result
    dtype: torch.dtype
    memory_format: torch.memory_format


def _api_call(api, memory_format, tensors, arguments, shape):
    """The :class:`_Call` of ``api`` on ``tensors`` (grad_output, made dense in ``memory_format``,
    then the forward input if the op has one)."""
    grad_output = c.dense(tensors[0], memory_format)
    return _Call(api, (grad_output, *tensors[1:]), arguments, tuple(shape), grad_output.dtype, memory_format)


def _upsample_bilinear2d(
    memory_format, grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None
):
    """aten::upsample_bilinear2d_backward: the result takes grad_output's memory format."""
    arguments = (output_size, input_size, align_corners, scales_h, scales_w, "NCHW")
    return _api_call(
        upsample_bilinear2d, memory_format or c.memory_format(grad_output), (grad_output,), arguments, input_size
    )


def _avg_pool2d(
    memory_format, grad_output, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    """aten::avg_pool2d_backward: the result takes the forward input's memory format."""
    if divisor_override == _DIVISOR_UNSET:
        return None  # PyTorch refuses a zero divisor; fastbwd would read it as unset
    memory_format = memory_format or c.memory_format(input)
    divisor = _DIVISOR_UNSET if divisor_override is None else divisor_override
    arguments = (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor, 0)
    return _api_call(avg_pool2d, memory_format, (grad_output, input), arguments, input.shape)


def _replication_pad2d(memory_format, grad_output, input, padding):
    """aten::replication_pad2d_backward: the result takes the forward input's memory format."""
    memory_format = memory_format or c.memory_format(input)
    return _api_call(replication_pad2d, memory_format, (grad_output, input), (padding,), input.shape)


class _Route(NamedTuple):
    """How the arguments of one aten operator become an api call."""

    prepare: object  # prepare(memory_format, *args) -> a _Call, or None (PyTorch's kernel answers)
    tensors: int  # how many leading arguments are tensors: grad_output, then the forward input


#: aten operator -> its :class:`_Route`. ``memory_format`` None means the one PyTorch's kernel
#: returns; the grad_output is made dense in that format, so the api function writes that layout.
ROUTES = {
    "upsample_bilinear2d_backward": _Route(_upsample_bilinear2d, 1),
    "avg_pool2d_backward": _Route(_avg_pool2d, 2),
    "replication_pad2d_backward": _Route(_replication_pad2d, 2),
}
OVERLOADS = ("", ".grad_input")


class _GraphCalls(collections.Counter):
    """A Counter whose keys of before the GroupNorm + Swish family got one name (``"group_norm_silu"``,
    ``"group_norm_silu_backward"``) still read, with a DeprecationWarning, the counts of
    ``"group_norm_swish"`` and ``"group_norm_swish_backward"`` (deprecated: kept for one release)."""

    RENAMED = {"group_norm_silu": "group_norm_swish", "group_norm_silu_backward": "group_norm_swish_backward"}

    def __missing__(self, key):
        new = self.RENAMED.get(key)
        if new is None:
            return 0
        warnings.warn(
            f"fastbwd.torch: GRAPH_CALLS[{key!r}] is deprecated (kept for one release): read GRAPH_CALLS[{new!r}]",
            DeprecationWarning,
            stacklevel=2,
        )
        return self[new]


#: Calls served by fastbwd and calls handed to PyTorch's own kernel, per aten operator, and calls
#: of the graph operators (compiled graphs' fastbwd nodes: the routed backward operators, and the
#: GroupNorm -> SiLU pairs fused as ``group_norm_swish`` and ``group_norm_swish_backward``): for
#: tests and for users who want to see what the bridge does.
SERVED = collections.Counter()
FALLBACK = collections.Counter()
GRAPH_CALLS = _GraphCalls()


def _served(route, args, grad_input):
    """The fastbwd result for these aten arguments, or None when PyTorch's own kernel must
    answer: a tensor not viewable as an array, a grad_input of another dtype, a call the api's
    validation refuses, or a result buffer that overlaps an input (checked on every call)."""
    if grad_input is not None and not c.can_view(grad_input):
        return None
    # A user's grad_input is written in place when it is dense (in either layout) with the
    # result's shape and dtype; the grad_output then travels in its memory format.
    in_place = None
    if grad_input is not None and grad_input.numel() > 0:
        for memory_format in (torch.contiguous_format, torch.channels_last):
            if grad_input.is_contiguous(memory_format=memory_format):
                in_place = memory_format
                break
    call = route.prepare(in_place, *args)
    if call is None:
        return None
    if grad_input is not None and grad_input.dtype != call.dtype:
        return None  # PyTorch's kernel decides what a grad_input of another dtype gets
    in_place = (
        grad_input is not None
        and tuple(grad_input.shape) == call.shape
        and grad_input.is_contiguous(memory_format=call.memory_format)
    )
    # a grad_input is viewed as an array only when it is written in place: Tensor.numpy makes
    # its storage unresizable, and one of another shape is resized below
    result = grad_input if in_place else c.empty(call.shape, call.dtype, call.memory_format)
    try:
        arrays = [c.as_array(t) for t in call.tensors]
        out = c.as_array(result)
    except (RuntimeError, TypeError):
        return None  # not viewable as arrays (a lazy conj/neg bit, a dtype NumPy lacks)
    try:
        plan = call.api.plan(*arrays, *call.arguments, out)
        c.match_torch_threads()
        call.api.run(plan, *arrays, out)
    except fastbwd.ParamError:
        return None
    if grad_input is None or result is grad_input:
        return result
    if tuple(grad_input.shape) != call.shape:
        grad_input.resize_(call.shape)
    return grad_input.copy_(result)


def serve(name, args, grad_input=None):
    """fastbwd's result of ``aten::name(*args, grad_input=grad_input)``, or None when PyTorch's
    own kernel must answer (:func:`_served`); counted in :data:`SERVED` or :data:`FALLBACK`."""
    result = _served(ROUTES[name], args, grad_input)
    (SERVED if result is not None else FALLBACK)[name] += 1
    return result


def _kernel(name, overload):
    """fastbwd's CPU kernel for ``aten::name{overload}``, falling back to PyTorch's own."""
    original = torch.library.get_kernel(f"aten::{name}{overload}", "CPU")

    def kernel(keyset, *args, grad_input=None):
        if _switch._active and _switch._policy == "always":
            result = serve(name, args, grad_input)
            if result is not None:
                return result
        if grad_input is None:
            return original.call_boxed(keyset, *args)
        return original.call_boxed(keyset, *args, grad_input=grad_input)

    kernel.__name__ = f"fastbwd_{name}{overload.replace('.', '_')}"
    return kernel


# ---- registration --------------------------------------------------------------------------
# PyTorch's dispatcher does not support changing a kernel registration while other threads may
# be calling that operator (a call can read a half-replaced table entry). So the kernels are
# registered once, by the first enable(), and stay: enable() and disable() only flip the switch
# they read. Disabled, each call goes straight to PyTorch's own kernel (the same bits as
# before enable(), for a few microseconds of Python dispatch per call).

_library = None
_registered = set()  # the aten operators (with overload) whose CPU kernel is fastbwd's


def _register():
    """Register the six kernels (at enable() under the policy "always", under the switch's lock;
    once each). An operator this PyTorch lacks, or will not let us override, stays PyTorch's,
    with one warning."""
    global _library
    if _switch._policy != "always":
        return  # "auto" decides before the dispatcher (_functional): no hop into Python here
    if _library is None:
        _library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # PyTorch warns once that a kernel is overridden: that is the point here.
        warnings.filterwarnings("ignore", message=".*[Oo]verrid")
        for name in ROUTES:
            for overload in OVERLOADS:
                if name + overload in _registered:
                    continue
                try:
                    _library.impl(name + overload, _kernel(name, overload), "CPU", with_keyset=True)
                except Exception as error:  # noqa: BLE001 - enabling never raises: that operator stays PyTorch's
                    warnings.warn(
                        f"fastbwd.torch: aten::{name}{overload} stays PyTorch's ({error})", RuntimeWarning, stacklevel=4
                    )
                _registered.add(name + overload)


_switch.follow(_register)
