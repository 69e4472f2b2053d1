"""Routing PyTorch's own CPU backward kernels to fastbwd (docs/semantics.md §7).

While enabled, a ``torch.library.Library("aten", "IMPL")`` holds fastbwd's implementations of
the CPU kernels of three aten backward operators and of their ``.grad_input`` (out=) overloads.
Each implementation:

1. takes the tensors as arrays without copying (a tensor that is neither contiguous nor
   channels_last is made dense first, in the memory format PyTorch's own kernel returns);
2. allocates the result with PyTorch's allocator in that memory format and lets the public
   fastbwd function, which validates everything, write into it (``out=``);
3. when the public function refuses the call (``ParamError``: a replicate pad wider than the
   input, a size above the documents' limits, a dtype it does not take, ...) or the tensors
   cannot be viewed as arrays, calls PyTorch's own kernel instead, fetched with
   ``torch.library.get_kernel`` before the override was registered: enabling never adds an
   error and never changes a result PyTorch would give other than by fastbwd's own rounding.

Only the CPU dispatch key is overridden: other devices, the autograd formulas (so double
backward) and every other operator are untouched. ``disable`` hands every call back to
PyTorch's own kernel (see the note above ``enable`` for why the registration itself stays).
"""

import collections
import contextlib
import threading
import warnings

import torch

import fastbwd
from fastbwd.api import _plans

from . import _convert as c
from ._threads import match_torch_threads

_DIVISOR_UNSET = 0  # fastbwd's avg_pool2d_backward spelling of PyTorch's divisor_override=None


def _upsample_bilinear2d(memory_format, grad_output, output_size, input_size, align_corners,
                         scales_h=None, scales_w=None):
    """aten::upsample_bilinear2d_backward: the result takes grad_output's memory format."""
    memory_format = memory_format or c.memory_format(grad_output)
    grad_output = c.dense(grad_output, memory_format)
    return (fastbwd.upsample_bilinear2d_backward,
            (c.as_array(grad_output), output_size, input_size, align_corners, scales_h, scales_w),
            tuple(input_size), grad_output.dtype, memory_format)


def _avg_pool2d(memory_format, grad_output, input, kernel_size, stride, padding, ceil_mode,
                count_include_pad, divisor_override):
    """aten::avg_pool2d_backward: the result takes the forward input's memory format."""
    if divisor_override == _DIVISOR_UNSET:
        return None  # PyTorch refuses a zero divisor; fastbwd would read it as unset
    memory_format = memory_format or c.memory_format(input)
    grad_output = c.dense(grad_output, memory_format)
    divisor = _DIVISOR_UNSET if divisor_override is None else divisor_override
    return (fastbwd.avg_pool2d_backward,
            (c.as_array(grad_output), c.as_array(input), kernel_size, stride, padding, ceil_mode,
             count_include_pad, divisor),
            tuple(input.shape), grad_output.dtype, memory_format)


def _replication_pad2d(memory_format, grad_output, input, padding):
    """aten::replication_pad2d_backward: the result takes the forward input's memory format."""
    memory_format = memory_format or c.memory_format(input)
    grad_output = c.dense(grad_output, memory_format)
    return (fastbwd.replication_pad2d_backward,
            (c.as_array(grad_output), c.as_array(input), padding),
            tuple(input.shape), grad_output.dtype, memory_format)


#: aten operator -> how its arguments become a fastbwd call: ``prepare(memory_format, *args)``
#: returns ``(function, arguments, result shape, dtype, memory format)`` or None
#: (PyTorch's kernel answers). ``memory_format`` None means the one PyTorch's kernel returns; the
#: grad_output is made dense in that format, so the fastbwd function writes that layout.
ROUTES = {
    "upsample_bilinear2d_backward": _upsample_bilinear2d,
    "avg_pool2d_backward": _avg_pool2d,
    "replication_pad2d_backward": _replication_pad2d,
}
OVERLOADS = ("", ".grad_input")

#: Calls served by fastbwd and calls handed to PyTorch's own kernel, per aten operator (for
#: tests and for users who want to see what the bridge does).
SERVED = collections.Counter()
FALLBACK = collections.Counter()

#: What the first call of each call geometry decided, for the calls after it (a training loop
#: repeats a few geometries): the memory format to serve it in (the in-place grad_input's or
#: PyTorch's rule), or :data:`_FALLBACK` when PyTorch's own kernel answers. Keyed by
#: :func:`_signature`; the decision depends on nothing else (fastbwd's validation of these three
#: operators reads only shapes, strides, dtypes and argument values).
_DECISIONS = _plans.Plans()
_FALLBACK = "fallback"
_UNDECIDED = object()


def _signature(name, args, grad_input):
    """The call's metadata: every tensor's shape, strides, dtype and lazy conj/neg bits, every
    other argument by type and value (:func:`fastbwd.api._plans.key`)."""
    parts = [name]
    for value in args + (grad_input,):
        if isinstance(value, torch.Tensor):
            parts.append((value.shape, value.stride(), value.dtype, value.is_conj(), value.is_neg()))
        else:
            parts.append(_plans.key(value))
    return tuple(parts)


def _decide(prepare, args, grad_input):
    """The memory format this call is served in, or None when PyTorch's own kernel must answer
    (a tensor not viewable as an array, a grad_input of another dtype, a call fastbwd does
    not take)."""
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
    plan = prepare(in_place, *args)
    if plan is None:
        return None
    _, _, _, dtype, memory_format = plan
    if grad_input is not None and grad_input.dtype != dtype:
        return None  # PyTorch's kernel decides what a grad_input of another dtype gets
    return memory_format


def _serve(prepare, args, grad_input, memory_format):
    """The fastbwd result of a call decided to be served in ``memory_format``, or None when
    fastbwd refuses it (ParamError): then PyTorch's kernel answers."""
    function, arguments, shape, dtype, memory_format = prepare(memory_format, *args)
    in_place = (grad_input is not None and tuple(grad_input.shape) == shape
                and grad_input.is_contiguous(memory_format=memory_format))
    result = grad_input if in_place else c.empty(shape, dtype, memory_format)
    match_torch_threads()
    try:
        function(*arguments, out=c.as_array(result))
    except fastbwd.ParamError:
        return None
    if grad_input is None or result is grad_input:
        return result
    if tuple(grad_input.shape) != shape:
        grad_input.resize_(shape)
    return grad_input.copy_(result)


def _served(name, prepare, args, grad_input):
    """The fastbwd result for these aten arguments, or None when PyTorch's own kernel must
    answer. The first call of a geometry decides (:func:`_decide`, and whether fastbwd accepts
    it); later calls of the same geometry reuse that decision."""
    try:
        signature = _signature(name, args, grad_input)
    except _plans.Unkeyable:
        signature = None
    decision = _UNDECIDED if signature is None else _DECISIONS.get(signature) or _UNDECIDED
    if decision is _UNDECIDED:
        decision = _decide(prepare, args, grad_input)
        result = None if decision is None else _serve(prepare, args, grad_input, decision)
        if signature is not None:
            _DECISIONS.add(signature, decision if result is not None else _FALLBACK)
        return result
    if decision is _FALLBACK:
        return None
    return _serve(prepare, args, grad_input, decision)


def _kernel(name, overload):
    """fastbwd's CPU kernel for ``aten::name{overload}``, falling back to PyTorch's own."""
    original = torch.library.get_kernel(f"aten::{name}{overload}", "CPU")
    prepare = ROUTES[name]
    route = name + overload

    def kernel(keyset, *args, grad_input=None):
        if _active:
            result = _served(route, prepare, args, grad_input)
            if result is not None:
                SERVED[name] += 1
                return result
            FALLBACK[name] += 1
        if grad_input is None:
            return original.call_boxed(keyset, *args)
        return original.call_boxed(keyset, *args, grad_input=grad_input)

    kernel.__name__ = f"fastbwd_{name}{overload.replace('.', '_')}"
    return kernel


# ---- enable / disable ------------------------------------------------------------------------
# PyTorch's dispatcher does not support changing a kernel registration while other threads may
# be calling that operator (a call can read a half-replaced table entry). So the kernels are
# registered once, by the first enable(), and stay: enable() and disable() only flip the switch
# they read. Disabled, each call goes straight to PyTorch's own kernel (the same bits as
# before enable(), for about 6 us of Python dispatch per call).

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


def enable():
    """Serve PyTorch's CPU ``upsample_bilinear2d_backward``, ``avg_pool2d_backward`` and
    ``replication_pad2d_backward`` (and their ``.grad_input`` overloads) with fastbwd.

    Idempotent and thread-safe. Model code does not change: the backward of
    ``F.interpolate(mode="bilinear")``, ``nn.Upsample``, ``F.avg_pool2d``, ``nn.AvgPool2d``,
    ``F.pad(mode="replicate")`` and ``nn.ReplicationPad2d`` runs on fastbwd.
    """
    global _active
    with _lock:
        if _library is None:
            _register()
        _active = True


def disable():
    """Give these operators back to PyTorch's own CPU kernels (the same bits as before
    :func:`enable`). Idempotent and thread-safe, also while other threads run the operators."""
    global _active
    with _lock:
        _active = False


def is_enabled():
    """True while fastbwd serves PyTorch's backward kernels."""
    return _active


@contextlib.contextmanager
def enabled():
    """``with fastbwd.torch.enabled(): ...`` enables the routing for the block, then restores
    the state it found (a block inside an enabled region leaves it enabled)."""
    was_enabled = _active
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()
