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
backward) and every other operator are untouched. ``disable`` hands every call back to
PyTorch's own kernel (see the note above ``enable`` for why the registration itself stays).
"""

import collections
import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import NamedTuple

import torch

import fastbwd
from fastbwd.api import avg_pool2d, replication_pad2d, upsample_bilinear2d

from . import _convert as c
from ._threads import match_torch_threads

_DIVISOR_UNSET = 0  # fastbwd's avg_pool2d_backward spelling of PyTorch's divisor_override=None


class _Call(NamedTuple):
    """One aten call as the api layer takes it (what a route's ``prepare`` returns)."""

    api: object  # the api module: plan(*tensors (as arrays), *arguments, out), run(plan, *arrays, out)
    tensors: tuple  # grad_output, dense in memory_format, then the forward input if the op has one
    arguments: tuple  # the api's other arguments, in fastbwd's spelling
    shape: tuple  # of the result
    dtype: torch.dtype
    memory_format: torch.memory_format


def _upsample_bilinear2d(
    memory_format, grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None
):
    """aten::upsample_bilinear2d_backward: the result takes grad_output's memory format."""
    memory_format = memory_format or c.memory_format(grad_output)
    grad_output = c.dense(grad_output, memory_format)
    return _Call(
        upsample_bilinear2d,
        (grad_output,),
        (output_size, input_size, align_corners, scales_h, scales_w, "NCHW"),
        tuple(input_size),
        grad_output.dtype,
        memory_format,
    )


def _avg_pool2d(
    memory_format, grad_output, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    """aten::avg_pool2d_backward: the result takes the forward input's memory format."""
    if divisor_override == _DIVISOR_UNSET:
        return None  # PyTorch refuses a zero divisor; fastbwd would read it as unset
    memory_format = memory_format or c.memory_format(input)
    grad_output = c.dense(grad_output, memory_format)
    divisor = _DIVISOR_UNSET if divisor_override is None else divisor_override
    return _Call(
        avg_pool2d,
        (grad_output, input),
        (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor, 0),
        tuple(input.shape),
        grad_output.dtype,
        memory_format,
    )


def _replication_pad2d(memory_format, grad_output, input, padding):
    """aten::replication_pad2d_backward: the result takes the forward input's memory format."""
    memory_format = memory_format or c.memory_format(input)
    grad_output = c.dense(grad_output, memory_format)
    return _Call(
        replication_pad2d, (grad_output, input), (padding,), tuple(input.shape), grad_output.dtype, memory_format
    )


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

#: Calls served by fastbwd and calls handed to PyTorch's own kernel, per aten operator (for
#: tests and for users who want to see what the bridge does).
SERVED = collections.Counter()
FALLBACK = collections.Counter()


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
        match_torch_threads()
        call.api.run(plan, *arrays, out)
    except fastbwd.ParamError:
        return None
    if grad_input is None or result is grad_input:
        return result
    if tuple(grad_input.shape) != call.shape:
        grad_input.resize_(call.shape)
    return grad_input.copy_(result)


def _kernel(name, overload):
    """fastbwd's CPU kernel for ``aten::name{overload}``, falling back to PyTorch's own."""
    original = torch.library.get_kernel(f"aten::{name}{overload}", "CPU")
    route = ROUTES[name]

    def kernel(keyset, *args, grad_input=None):
        if _active:
            result = _served(route, args, grad_input)
            if result is not None:
                SERVED[name] += 1
                return result
            FALLBACK[name] += 1
        if grad_input is None:
            return original.call_boxed(keyset, *args)
        return original.call_boxed(keyset, *args, grad_input=grad_input)

    kernel.__name__ = f"fastbwd_{name}{overload.replace('.', '_')}"
    return kernel


# ---- the routed operators as graph nodes (torch.compile) -------------------------------------
# In a compiled graph the aten override above is not enough: AOTAutograd decomposes the bilinear
# upsample (its backward becomes scatters), Inductor generates its own avg-pool backward, and the
# aten meta functions do not give the memory formats the CPU kernels return. So while fastbwd is
# enabled, _compile makes the forward operators' autograd emit these operators instead: opaque
# custom ops whose fake kernels give exactly the strides their real kernels return.

#: Calls of the graph operators below, per aten operator (for tests and curious users).
GRAPH_CALLS = collections.Counter()

_GRAPH_SCHEMAS = {
    "upsample_bilinear2d_backward": "(Tensor grad_output, SymInt[2] output_size, SymInt[4] input_size, "
    "bool align_corners, float? scales_h=None, float? scales_w=None) -> Tensor",
    "avg_pool2d_backward": "(Tensor grad_output, Tensor input, int[2] kernel_size, int[2] stride, int[2] padding, "
    "bool ceil_mode, bool count_include_pad, int? divisor_override) -> Tensor",
    "replication_pad2d_backward": "(Tensor grad_output, Tensor input, SymInt[4] padding) -> Tensor",
}


def result_format(name, grad_output, input_or_size):
    """The memory format of ``name``'s gradient as the routed kernel writes it (what
    :data:`ROUTES` gives a functional call): the upsample's follows grad_output, the pool's and
    the pad's the forward input. Both kernels of a graph operator follow it, so its fake strides
    are its real strides."""
    return c.memory_format(input_or_size if ROUTES[name].tensors == 2 else grad_output)


def _result_shape(name, args):
    return args[2] if name == "upsample_bilinear2d_backward" else args[1].shape


def _graph_operator(name):
    """``fastbwd::<name>``: calls ``aten::<name>``, whose CPU kernel is fastbwd's while enabled
    and PyTorch's own while disabled (so a compiled graph follows the switch at run time), and
    returns the gradient in :func:`result_format`."""
    aten_operator = getattr(torch.ops.aten, name).default

    def real(*args):
        GRAPH_CALLS[name] += 1
        memory_format = result_format(name, args[0], args[1])
        return aten_operator(*args).contiguous(memory_format=memory_format)

    def fake(*args):
        memory_format = result_format(name, args[0], args[1])
        grad_output = args[0]
        shape = _result_shape(name, args)
        return torch.empty(shape, dtype=grad_output.dtype, device=grad_output.device, memory_format=memory_format)

    operator = torch.library.custom_op(
        f"fastbwd::{name}", real, mutates_args=(), device_types="cpu", schema=_GRAPH_SCHEMAS[name]
    )
    operator.register_fake(fake)
    return operator


GRAPH_OPERATORS = {name: _graph_operator(name) for name in ROUTES}


# Each gradient is linear in grad_output: its derivative there is the forward operator (as in
# PyTorch's derivatives.yaml), and none reaches the forward input, so double backward is exact.
def _setup(ctx, inputs, output):
    ctx.arguments = inputs[1:]


def _upsample_double_backward(ctx, grad):
    output_size, input_size, align_corners, scales_h, scales_w = ctx.arguments
    return (
        torch.ops.aten.upsample_bilinear2d(grad, output_size, align_corners, scales_h, scales_w),
        None,
        None,
        None,
        None,
        None,
    )


def _avg_pool_double_backward(ctx, grad):
    _, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override = ctx.arguments
    forward = torch.ops.aten.avg_pool2d(
        grad, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
    )
    return (forward,) + (None,) * 7


def _pad_double_backward(ctx, grad):
    _, padding = ctx.arguments
    return torch.ops.aten.replication_pad2d(grad, padding), None, None


for _name, _formula in (
    ("upsample_bilinear2d_backward", _upsample_double_backward),
    ("avg_pool2d_backward", _avg_pool_double_backward),
    ("replication_pad2d_backward", _pad_double_backward),
):
    GRAPH_OPERATORS[_name].register_autograd(_formula, setup_context=_setup)


# ---- enable / disable ------------------------------------------------------------------------
# PyTorch's dispatcher does not support changing a kernel registration while other threads may
# be calling that operator (a call can read a half-replaced table entry). So the kernels are
# registered once, by the first enable(), and stay: enable() and disable() only flip the switch
# they read. Disabled, each call goes straight to PyTorch's own kernel (the same bits as
# before enable(), for a few microseconds of Python dispatch per call).

_lock = threading.Lock()
_library = None
_active = False


def _register():
    """Register the six kernels (once; under ``_lock``)."""
    global _library
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            # PyTorch warns once that a kernel is overridden: that is the point here.
            warnings.filterwarnings("ignore", message=".*[Oo]verrid")
            for name in ROUTES:
                for overload in OVERLOADS:
                    library.impl(name + overload, _kernel(name, overload), "CPU", with_keyset=True)
    except BaseException:
        library._destroy()
        raise
    _library = library


def enable() -> None:
    """Serve PyTorch's CPU ``upsample_bilinear2d_backward``, ``avg_pool2d_backward`` and
    ``replication_pad2d_backward`` (and their ``.grad_input`` overloads) with fastbwd.

    Idempotent and thread-safe. Model code does not change: the backward of
    ``F.interpolate(mode="bilinear")``, ``nn.Upsample``, ``F.avg_pool2d``, ``nn.AvgPool2d``,
    ``F.pad(mode="replicate")`` and ``nn.ReplicationPad2d`` runs on fastbwd.
    """
    global _active
    from . import _compile

    with _lock:
        if _library is None:
            _register()
        _compile.install()
        _active = True


def disable() -> None:
    """Give these operators back to PyTorch's own CPU kernels (the same bits as before
    :func:`enable`). Idempotent and thread-safe, also while other threads run the operators."""
    global _active
    from . import _compile

    with _lock:
        _active = False
        _compile.uninstall()


def is_enabled() -> bool:
    """True while fastbwd serves PyTorch's backward kernels."""
    return _active


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """``with fastbwd.torch.enabled(): ...`` enables the routing for the block, then restores
    the state it found (a block inside an enabled region leaves it enabled)."""
    was_enabled = _active
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()
