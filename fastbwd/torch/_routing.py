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

The first call of each call geometry (:func:`_signature`) decides, and remembers, how every call
of that geometry is served (:class:`_Served`): PyTorch's kernel, or the api's validated plan
with the memory format and result buffer to use. A repeated call then goes straight to the api's
per-call work (``run``: the out= overlap check, the kernels), the way a repeated direct call
does after its plan lookup.

Only the CPU dispatch key is overridden: other devices, the autograd formulas (so double
backward) and every other operator are untouched. ``disable`` hands every call back to
PyTorch's own kernel (see the note above ``enable`` for why the registration itself stays).
"""

import collections
import contextlib
import threading
import warnings
from typing import Iterator, NamedTuple

import torch

import fastbwd
from fastbwd.api import _plans
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


class _Served(NamedTuple):
    """How every call of one signature is served (decided by its first call)."""

    run: object  # the api module's run(plan, *arrays, out)
    plan: object  # the api's validated plan for these arrays and this out=
    shape: tuple  # of the result
    dtype: torch.dtype
    memory_format: torch.memory_format  # of the result and of the grad_output handed over
    dense: bool  # grad_output is already dense in memory_format (no copy to make)
    in_place: bool  # the user's grad_input is written in place


#: What the first call of each call geometry decided, for the calls after it (a training loop
#: repeats a few geometries): a :class:`_Served`, or :data:`_FALLBACK` when PyTorch's own kernel
#: answers. Keyed by :func:`_signature`; the decision depends on nothing else (the api's
#: validation of these three operators reads only shapes, strides, dtypes and argument values).
_DECISIONS = _plans.Plans()
_FALLBACK = "fallback"


def _signature(route, arrays, arguments, grad_input):
    """The call's metadata: the shape, strides and dtype of the NumPy views of its input tensors
    (``arrays``: a view has its tensor's shape, its strides in bytes and a dtype of its own, so
    the view's metadata is the tensor's), every other argument by value (an ``int[]`` as a
    tuple), and the grad_input's shape, strides, dtype and lazy conj/neg bits, read from the
    tensor (a grad_input is viewed only when it is written in place: ``Tensor.numpy`` makes its
    storage unresizable, and one of another shape is resized).

    Values alone describe the other arguments because PyTorch's dispatcher hands a Python kernel
    every argument in its schema's type (``bool`` as a bool even when the caller wrote 1,
    ``int[]`` as a list of int even from a tuple or ``torch.Size``, ``float?`` as a float or
    None), so equal values at one position always mean the same thing (tests/test_torch.py
    checks it). A value that cannot be hashed makes the lookup raise TypeError: then the call
    is decided on its own."""
    parts = [route]
    for array in arrays:
        parts += (array.shape, array.strides, array.dtype)
    for value in arguments:
        parts.append(tuple(value) if type(value) is list else value)
    if grad_input is not None:
        parts += (grad_input.shape, grad_input.stride(), grad_input.dtype, grad_input.is_conj(), grad_input.is_neg())
    return tuple(parts)


def _decide(prepare, args, grad_input):
    """How calls with these tensors' metadata and these arguments are served (a
    :class:`_Served`), or None when PyTorch's own kernel must answer: a tensor not viewable as an
    array, a grad_input of another dtype, a call the api's validation refuses."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if grad_input is not None:
        tensors.append(grad_input)
    if not all(c.can_view(t) for t in tensors):
        return None
    # A user's grad_input is written in place when it is dense (in either layout) with the
    # result's shape and dtype; the grad_output then travels in its memory format.
    in_place = None
    if grad_input is not None and grad_input.numel() > 0:
        for memory_format in (torch.contiguous_format, torch.channels_last):
            if grad_input.is_contiguous(memory_format=memory_format):
                in_place = memory_format
                break
    call = prepare(in_place, *args)
    if call is None:
        return None
    if grad_input is not None and grad_input.dtype != call.dtype:
        return None  # PyTorch's kernel decides what a grad_input of another dtype gets
    in_place = (
        grad_input is not None
        and tuple(grad_input.shape) == call.shape
        and grad_input.is_contiguous(memory_format=call.memory_format)
    )
    # the result buffer every call of this geometry gets: same shape, strides and dtype
    out = grad_input if in_place else c.empty(call.shape, call.dtype, call.memory_format)
    try:
        plan = call.api.plan(*map(c.as_array, call.tensors), *call.arguments, c.as_array(out))
    except fastbwd.ParamError:
        return None
    return _Served(call.api.run, plan, call.shape, call.dtype, call.memory_format, call.tensors[0] is args[0], in_place)


def _served(name, route, args, grad_input):
    """The fastbwd result for these aten arguments (``name`` the operator with its overload), or
    None when PyTorch's own kernel must answer.

    The first call of a geometry decides (:func:`_decide`); later calls of the same geometry
    reuse that decision and go straight to the api's per-call work (``run``), which still checks
    what depends on the call (an out= overlapping an input: a ParamError hands that call alone
    to PyTorch's kernel)."""
    count = route.tensors
    try:
        arrays = [c.as_array(t) for t in args[:count]]
    except (RuntimeError, TypeError):
        return None  # not viewable as arrays (a lazy conj/neg bit, a dtype NumPy lacks)
    signature = _signature(name, arrays, args[count:], grad_input)
    try:
        served = _DECISIONS.get(signature)
    except TypeError:  # an unhashable argument: decided for this call alone
        signature, served = None, None
    if served is None:
        served = _decide(route.prepare, args, grad_input) or _FALLBACK
        if signature is not None:
            _DECISIONS.add(signature, served)
    if served is _FALLBACK:
        return None
    if not served.dense:
        arrays[0] = c.as_array(c.dense(args[0], served.memory_format))
    result = grad_input if served.in_place else c.empty(served.shape, served.dtype, served.memory_format)
    match_torch_threads()
    try:
        served.run(served.plan, *arrays, c.as_array(result))
    except fastbwd.ParamError:
        return None
    if grad_input is None or result is grad_input:
        return result
    if tuple(grad_input.shape) != served.shape:
        grad_input.resize_(served.shape)
    return grad_input.copy_(result)


def _kernel(name, overload):
    """fastbwd's CPU kernel for ``aten::name{overload}``, falling back to PyTorch's own."""
    original = torch.library.get_kernel(f"aten::{name}{overload}", "CPU")
    route = ROUTES[name]
    full_name = name + overload

    def kernel(keyset, *args, grad_input=None):
        if _active:
            result = _served(full_name, route, args, grad_input)
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
