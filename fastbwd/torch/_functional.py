"""Eager routing under the policy ``"auto"`` (docs/semantics.md §7, docs/design.md "Never
slower"): ``torch.nn.functional.interpolate``, ``avg_pool2d`` and ``pad`` decided before
PyTorch's dispatcher.

A Python kernel behind the dispatcher (``_routing``, the policy ``"always"``) costs every call of
its operator a hop into Python, served or not: more than fastbwd saves on small calls. A
decision made while the call is still Python costs a declined call a few attribute reads. So
while fastbwd is enabled under ``"auto"``, each of these three names of ``torch.nn.functional``
holds a function of fastbwd's (:func:`install`); ``nn.Upsample``, ``nn.AvgPool2d``,
``nn.ReplicationPad2d`` and ``F.upsample_bilinear`` call them there. Each calls the function it
replaced, unchanged, unless

* fastbwd is enabled under ``"auto"``, nothing compiles, traces or transforms the call, and its
  input is a plain CPU tensor that requires grad with grad mode on;
* the call is one fastbwd serves: a bilinear 4-D ``interpolate`` without antialias, a 4-D
  ``avg_pool2d``, a 4-D ``pad`` of four sizes in replicate mode;
* ``fastbwd._dispatch`` says fastbwd's path is the faster at the call's size (path "routed");

and then runs :class:`Routed`: its forward is the replaced function itself (PyTorch's bits), its
backward fastbwd's kernel through ``_routing.serve`` (PyTorch's kernel for a call fastbwd
refuses; PyTorch's formula when a graph of the backward is asked for).

``disable()`` (or the policy ``"always"``) puts the replaced functions back. Each of fastbwd's
functions is made once and put in again at every ``enable()``: Dynamo guards a compiled frame
that calls one of these names on the function's identity, so a frame compiled with one is
compiled again with the other once, and then finds both in its cache. Each function's globals
are ``torch.nn.functional``'s and it names the function it replaced (``__wrapped__``, and what
TorchScript reads: ``torch.jit.script`` compiles the replaced function, as before).
"""

import functools
import inspect
import types
from typing import Optional

import torch
from torch.jit.annotations import BroadcastingList2
from torch.nn import functional as F

from fastbwd import _dispatch

from . import _convert as c
from . import _private, _routing, _switch

#: name in torch.nn.functional -> the operator fastbwd._dispatch decides for (its aten backward: _BACKWARD)
_NAMES = {
    "interpolate": "upsample_bilinear2d",
    "avg_pool2d": "avg_pool2d",
    "pad": "replication_pad2d",
}
_BACKWARD = {op: f"{op}_backward" for op in _NAMES.values()}

_made = {}  # name -> (fastbwd's function, the one it replaces): made once
_installed = {}  # name -> fastbwd's function, while it is in torch.nn.functional


class Routed(torch.autograd.Function):
    """A routed call: PyTorch's own function forward, fastbwd's kernel backward."""

    @staticmethod
    def forward(ctx, input, name, function, args, kwargs, arguments):
        output = function(*args, **kwargs)
        ctx.name, ctx.arguments = name, arguments
        if name == "upsample_bilinear2d_backward":  # the gradient needs the sizes alone
            ctx.sizes = (list(output.shape[2:]), list(input.shape))
        else:  # the pool's and the pad's need the input, as PyTorch's own node saves it
            ctx.save_for_backward(input)
        return output

    @staticmethod
    def backward(ctx, grad):
        name = ctx.name
        if name == "upsample_bilinear2d_backward":
            args = (grad, *ctx.sizes, *ctx.arguments)
        else:
            args = (grad, *ctx.saved_tensors, *ctx.arguments)
        result = None
        if not torch.is_grad_enabled():  # (a graph of the backward: PyTorch's own formula)
            result = _routing.serve(name, args)
        if result is None:
            result = getattr(torch.ops.aten, name).default(*args)
        return result, None, None, None, None, None


def _bind(names, args, kwargs):
    """``{parameter: value}`` of a call of a function of ``names``' parameters, or None for a
    call the replaced function would refuse (too many arguments, an unknown or repeated name)."""
    if len(args) > len(names):
        return None
    bound = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in names or name in bound:
            return None
        bound[name] = value
    return bound


def _int(value):
    """``value`` when it is an int (not a bool): the arguments fastbwd reads must be what
    PyTorch reads, or the call is left to PyTorch (a TypeError here declines it)."""
    if type(value) is not int:
        raise TypeError(value)
    return value


def _flag(value):
    if type(value) is not bool:
        raise TypeError(value)
    return value


def _pair(value):
    """``[a, b]`` of an int or a sequence of two ints."""
    if type(value) is int:
        return [value, value]
    first, second = value
    return [_int(first), _int(second)]


def _interpolate_arguments(bound):
    """``(align_corners, scales_h, scales_w)`` of aten's backward for a bilinear 4-D interpolate
    fastbwd serves, or None: the output size is the forward output's, the scales those PyTorch
    passes on (None when a size is given or the scale is recomputed)."""
    if bound.get("mode", "nearest") != "bilinear" or bound.get("antialias", False) is not False:
        return None
    size, scale = bound.get("size"), bound.get("scale_factor")
    align_corners = bound.get("align_corners")
    align_corners = False if align_corners is None else _flag(align_corners)
    if (size is None) == (scale is None):
        return None  # neither or both: F.interpolate raises its own error
    recompute = bound.get("recompute_scale_factor")
    if size is not None or (recompute is not None and _flag(recompute)):
        return align_corners, None, None
    scales = [scale, scale] if type(scale) in (int, float) else list(scale)
    if len(scales) != 2 or any(type(s) not in (int, float) for s in scales):
        return None
    return align_corners, float(scales[0]), float(scales[1])


def _avg_pool2d_arguments(bound):
    """aten's backward arguments (but grad_output and input) of an ``avg_pool2d`` call."""
    kernel = _pair(bound["kernel_size"])
    stride = bound.get("stride")
    empty = stride is not None and type(stride) is not int and len(stride) == 0
    stride = kernel if stride is None or empty else _pair(stride)
    divisor = bound.get("divisor_override")
    return (
        kernel,
        stride,
        _pair(bound.get("padding", 0)),
        _flag(bound.get("ceil_mode", False)),
        _flag(bound.get("count_include_pad", True)),
        None if divisor is None else _int(divisor),
    )


def _pad_arguments(bound):
    """aten's backward argument (the padding) of a replicate ``pad`` of a 4-D input, or None."""
    if bound.get("mode", "constant") != "replicate" or bound.get("value") is not None:
        return None
    padding = [_int(p) for p in bound["pad"]]
    return (padding,) if len(padding) == 4 else None


#: name -> (its parameters in order, the parser of a bound call into aten's backward arguments)
_CALLS = {
    "interpolate": (
        ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias"),
        _interpolate_arguments,
    ),
    "avg_pool2d": (
        ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
        _avg_pool2d_arguments,
    ),
    "pad": (("input", "pad", "mode", "value"), _pad_arguments),
}


def _route(name, function, input, args, kwargs):
    """``function(*args, **kwargs)`` (``function`` what ``name`` held before; ``input`` the call's
    input, a tensor that requires grad, at or above the size floor), through :class:`Routed` when
    fastbwd serves its backward (see the module's doc)."""
    op = _NAMES[name]
    if not input.is_cpu:
        return function(*args, **kwargs)
    names, parse = _CALLS[name]
    bound = _bind(names, args, kwargs)
    try:
        arguments = None if bound is None or input.dim() != 4 else parse(bound)
    except (TypeError, ValueError, KeyError):
        arguments = None  # an argument of another form: the function says what it makes of it
    if (
        arguments is None
        or not c.decide("auto", "routed", op, input)
        or torch.is_autocast_enabled("cpu")
        or not _private.eager_tensors((input,))
        or _private.forward_ad_open()
    ):
        return function(*args, **kwargs)
    return Routed.apply(input, _BACKWARD[op], function, args, kwargs, arguments)


def _function(name, replaced):
    """The function fastbwd puts in ``torch.nn.functional.<name>`` in place of ``replaced``."""
    parameters = _parameters(replaced)
    namespace = {}
    exec(_function_code(name, parameters and tuple((p.name, p.default is not p.empty) for p in parameters)), namespace)
    function = namespace["make"](
        replaced,
        _route,
        (
            torch.compiler.is_dynamo_compiling,
            torch.compiler.is_compiling,
            torch.jit.is_tracing,
            torch.is_grad_enabled,
            _switch,
            torch.Tensor,
            _dispatch.floors_of("torch", "routed", _NAMES[name]),
            _dispatch.floor,
            torch.get_num_threads,
            ("torch", "routed", _NAMES[name]),
        ),
        parameters and tuple(p.default for p in parameters if p.default is not p.empty),
    )
    # torch.nn.functional's globals: TorchScript resolves the replaced function's names in them
    made = types.FunctionType(function.__code__, vars(F), name, function.__defaults__, function.__closure__)
    functools.update_wrapper(made, replaced)  # (its __qualname__: a wrong call's TypeError reads as PyTorch's)
    # torch.jit.script compiles the replaced function (TorchScript's own mark of such a wrapper),
    # or for a builtin (avg_pool2d) a function of its signature calling it
    setattr(made, "__script_if_tracing_wrapper", True)
    scripted = replaced if type(replaced) is types.FunctionType else _SCRIPTED.get(name)
    setattr(made, "__original_fn", scripted)
    return made


def _parameters(replaced):
    """The replaced function's parameters, which fastbwd's then takes as its own (measured: a
    declined call bound by name costs a training step about 2 us less than through ``*args,
    **kwargs``), or None: fastbwd's takes ``*args, **kwargs`` (a builtin, whose wrong calls get
    its own messages, or a signature of other kinds of parameters)."""
    if type(replaced) is not types.FunctionType:
        return None
    try:
        parameters = tuple(inspect.signature(replaced, follow_wrapped=False).parameters.values())
    except (TypeError, ValueError):
        return None
    if not parameters or any(
        p.kind is not p.POSITIONAL_OR_KEYWORD or p.name.startswith("_fastbwd") for p in parameters
    ):
        return None
    return parameters


@functools.cache
def _function_code(name, parameters):
    """The compiled source of fastbwd's function for ``name`` taking ``parameters`` (``(name,
    has a default)`` of each, all positional-or-keyword) or, for None, ``*args, **kwargs``."""
    if parameters is None:
        signature = call = "*args, **kwargs"
        routed = "args, kwargs"
        input = '(args[0] if args else kwargs.get("input"))'
    else:
        defaults = iter(range(len(parameters)))
        signature = ", ".join(
            f"{parameter}=_fastbwd_defaults[{next(defaults)}]" if has_default else parameter
            for parameter, has_default in parameters
        )
        call = ", ".join(parameter for parameter, _ in parameters)
        routed = f"({call},), {{}}"
        input = parameters[0][0]
    source = f"""\
def make(_fastbwd_replaced, _fastbwd_route, _fastbwd_checks, _fastbwd_defaults):
    (
        _fastbwd_dynamo,
        _fastbwd_compiling,
        _fastbwd_tracing,
        _fastbwd_grad_enabled,
        _fastbwd_switch,
        _fastbwd_tensor,
        _fastbwd_floors,
        _fastbwd_floor,
        _fastbwd_threads,
        _fastbwd_key,
    ) = _fastbwd_checks

    def {name}({signature}):
        # Dynamo first: torch.compile folds it and traces the replaced function alone. Then what
        # declines most calls, cheapest first (a declined call pays these few reads); tracing
        # before the size: torch.jit.trace would record reading it.
        if _fastbwd_dynamo() or not _fastbwd_switch._active or _fastbwd_switch._policy != "auto":
            return _fastbwd_replaced({call})
        _fastbwd_input = {input}
        if type(_fastbwd_input) is not _fastbwd_tensor or not _fastbwd_input.requires_grad or _fastbwd_tracing():
            return _fastbwd_replaced({call})
        # the floor of the thread count the call runs on: below it the whole decision is PyTorch's
        _fastbwd_count = _fastbwd_threads()
        _fastbwd_least = _fastbwd_floors.get(_fastbwd_count)
        if _fastbwd_least is None:
            _fastbwd_least = _fastbwd_floor(*_fastbwd_key, _fastbwd_count)
        if (
            _fastbwd_input.numel() < _fastbwd_least
            or _fastbwd_compiling()
            or not _fastbwd_grad_enabled()
        ):
            return _fastbwd_replaced({call})
        return _fastbwd_route({name!r}, _fastbwd_replaced, _fastbwd_input, {routed})

    return {name}
"""
    return compile(source, f"<fastbwd's torch.nn.functional.{name}>", "exec")


_AVG_POOL2D = F.avg_pool2d  # PyTorch's builtin (this module is imported before any install)


# named as the function it stands for: TorchScript compiles it under that function's name
def avg_pool2d(
    input: torch.Tensor,
    kernel_size: BroadcastingList2[int],
    stride: Optional[BroadcastingList2[int]] = None,  # noqa: UP045 - TorchScript reads typing's spelling
    padding: BroadcastingList2[int] = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: Optional[int] = None,  # noqa: UP045
) -> torch.Tensor:
    """What TorchScript compiles for a call of fastbwd's ``avg_pool2d``: PyTorch's builtin, with
    its default stride (the kernel size, which aten's empty stride means)."""
    if stride is None:
        return _AVG_POOL2D(input, kernel_size, kernel_size, padding, ceil_mode, count_include_pad, divisor_override)
    return _AVG_POOL2D(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


#: The functions TorchScript compiles in place of the builtins replaced.
_SCRIPTED = {"avg_pool2d": avg_pool2d}


def install():
    """Put fastbwd's functions in torch.nn.functional (at ``enable()`` under ``"auto"``; under
    the switch's lock), or take them out under ``"always"``."""
    if _switch._policy != "auto":
        uninstall()
        return
    for name in _NAMES:
        if name in _installed:
            continue
        replaced = getattr(F, name)
        made, original = _made.get(name, (None, None))
        if made is None or original is not replaced:
            if type(replaced) is not types.FunctionType and (name not in _SCRIPTED or replaced is not _AVG_POOL2D):
                continue  # a builtin TorchScript could not compile through fastbwd's: it stays as it is
            made = _function(name, replaced)
            _made[name] = made, replaced
        _installed[name] = made
        setattr(F, name, made)


def uninstall():
    """Put the replaced functions back (at ``disable()``), each where fastbwd's still is (a name
    the user has set since is theirs)."""
    for name, made in list(_installed.items()):
        if getattr(F, name) is made:
            setattr(F, name, _made[name][1])
        del _installed[name]


def installed():
    """``{name: fastbwd's function}`` of those in torch.nn.functional now."""
    return dict(_installed)


_switch.follow(install, uninstall)
