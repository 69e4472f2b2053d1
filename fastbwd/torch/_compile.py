"""fastbwd inside ``torch.compile`` (docs/semantics.md §7): the graph operators compiled graphs
call, and the compiler hooks installed while the switch is on (``enable()``, ``enabled()``) and
removed when it turns off. The hooks are read only while a graph is captured or compiled, never
by eager code:

* **Autograd kernels for the Python dispatcher.** AOTAutograd traces with PyTorch's Python
  dispatcher, where ``aten.upsample_bilinear2d`` has a Python autograd kernel that decomposes it
  (its backward becomes scatters), and Inductor lowers ``aten.avg_pool2d_backward`` to its own
  code. While enabled, the three routed forward operators get autograd kernels whose forward is
  the aten call as before (Inductor still generates it) and whose backward is fastbwd's graph
  operator (``fastbwd::<name>``, below): one opaque node with honest fake strides, on every backend.
* **GroupNorm -> SiLU passes.** A GroupNorm whose output feeds only a SiLU becomes the fused
  operator ``fastbwd::group_norm_swish`` (swish_scale 1, ``follows_switch``) in the Dynamo graph
  (Inductor's pre-grad pass: Dynamo has resolved the model's Python, so this reaches pairs in any
  ``forward()``) or, for backends without Inductor's passes, in AOTAutograd's joint graph; each
  beside the user's passes. ``_ops.refusal`` decides at trace time which pairs fastbwd takes.

The hooks use PyTorch's private compiler interfaces (``_private``): outside the releases they were
written for, or with one missing, ``enable()`` warns once and torch.compile stays PyTorch's.
"""

import functools
import math
import operator
import pathlib
import threading

import torch
from torch.nn import functional as F

import fastbwd

from . import _convert as c
from . import _ops, _private, _routing, _switch
from ._routing import GRAPH_CALLS, ROUTES

#: aten backward operator -> the operator fastbwd._dispatch decides for
ROUTED_OPS = {name: name.removesuffix("_backward") for name in ROUTES}

aten = torch.ops.aten

#: The PyTorch releases (major, minor) whose private interfaces have the shape used here (tested
#: with 2.13 and 2.14; ``_private`` also checks each one): outside them the hooks stay out.
SUPPORTED_RANGE = ((2, 10), (2, 14))

_lock = threading.Lock()
_installed = {}  # (OpOverload, dispatch key name) -> the Python kernel it had before (None: none)
_passes_before = None  # Inductor's pre_grad_custom_pass before install()
_passes_set = None  # the value install() gave it
_joint_before = None  # AOTAutograd's joint_custom_pass before install()


def _torch_version():
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


# ---- the routed operators as graph nodes ----------------------------------------------------------
# In a compiled graph the aten override of ``_routing`` is not enough: AOTAutograd decomposes the
# bilinear upsample (its backward becomes scatters), Inductor generates its own avg-pool backward,
# and the aten meta functions do not give the memory formats the CPU kernels return. So while
# fastbwd is enabled, the forward operators' autograd emits these operators instead: opaque custom
# ops whose fake kernels give exactly the strides their real kernels return.

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


def _decide_at_run_time(name, args):
    """The decision (path "compiled") for a graph operator's call, from its real arguments."""
    if name == "upsample_bilinear2d_backward":  # the input's size; grad_output's dtype and layout
        return c.decide("auto", "compiled", ROUTED_OPS[name], args[0], math.prod(args[2]))
    return c.decide("auto", "compiled", ROUTED_OPS[name], args[1])


def decides_fastbwd(name, input):
    """Whether a routed operator's gradient is fastbwd's in a graph being traced (path
    "compiled", the policy now): its input's sizes known, the decision; some known only at run
    time, True (the graph operator decides when it runs)."""
    return input.device.type == "cpu" and c.decide(_switch._policy, "compiled", ROUTED_OPS[name], input)


def _graph_operator(name):
    """``fastbwd::<name>``: calls ``aten::<name>``, whose CPU kernel is fastbwd's while enabled
    and PyTorch's own while disabled (so a compiled graph follows the switch at run time), and
    returns the gradient in :func:`result_format`."""
    aten_operator = getattr(torch.ops.aten, name).default

    def real(*args):
        GRAPH_CALLS[name] += 1
        memory_format = result_format(name, args[0], args[1])
        if args[0].numel() == 0:  # an empty output (which a compiled forward may make): no gradient
            return torch.empty(_result_shape(name, args), dtype=args[0].dtype, memory_format=memory_format).zero_()
        # "always": the aten kernel serves it (fastbwd's while enabled). "auto": fastbwd's when the
        # decision says so for the real sizes (a graph traced with known sizes decided already)
        if _switch._active and _switch._policy == "auto" and _decide_at_run_time(name, args):
            result = _routing.serve(name, args)
            if result is not None:
                return result.contiguous(memory_format=memory_format)
        return aten_operator(*args).contiguous(memory_format=memory_format)

    def fake(*args):
        memory_format = result_format(name, args[0], args[1])
        grad_output = args[0]
        shape = _result_shape(name, args)
        return torch.empty(shape, dtype=grad_output.dtype, device=grad_output.device, memory_format=memory_format)

    operator = _ops.custom_op(name, real, _GRAPH_SCHEMAS[name])
    operator.register_fake(fake)
    return operator


GRAPH_OPERATORS = {name: _graph_operator(name) for name in ROUTES}


# Each gradient is linear in grad_output: its derivative there is the forward operator (as in
# PyTorch's derivatives.yaml), on the backward's arguments but the one the forward does not take
# (the upsample's input_size, the others' input), and none reaches the forward input, so double
# backward is exact.
def _setup(ctx, inputs, output):
    ctx.arguments = inputs[1:]


def _double_backward(forward, unused):
    def formula(ctx, grad):
        arguments = ctx.arguments[:unused] + ctx.arguments[unused + 1 :]
        return (forward(grad, *arguments),) + (None,) * len(ctx.arguments)

    return formula


for _name, _forward, _unused in (
    ("upsample_bilinear2d_backward", aten.upsample_bilinear2d.default, 1),
    ("avg_pool2d_backward", aten.avg_pool2d.default, 0),
    ("replication_pad2d_backward", aten.replication_pad2d.default, 0),
):
    GRAPH_OPERATORS[_name].register_autograd(_double_backward(_forward, _unused), setup_context=_setup)


# ---- autograd kernels for the Python dispatcher ------------------------------------------------


def _below_autograd(overload, *arguments):
    """``overload(*arguments)`` without recording autograd: what an autograd kernel does when no
    input needs a gradient."""
    with _private.below_autograd():
        return overload(*arguments)


class _RoutedForward(torch.autograd.Function):
    """A forward operator whose backward is one node: fastbwd's graph operator on CPU, the aten
    backward operator elsewhere (what PyTorch's own autograd formula calls). The forward is what
    PyTorch would trace without fastbwd (``forward(input, *arguments)``: the aten call, or PyTorch's
    own decomposition), so the compiler generates it as before."""

    @staticmethod
    def forward(ctx, name, forward, backward_arguments, input, *arguments):
        ctx.name, ctx.backward_arguments = name, backward_arguments
        # decided at trace time: fastbwd's graph operator, or aten's (what Inductor alone traces)
        ctx.fastbwd = decides_fastbwd(name, input)
        if ROUTES[name].tensors == 2:
            ctx.save_for_backward(input)
        return forward(input, *arguments)

    @staticmethod
    def backward(ctx, grad):
        if ctx.fastbwd:
            backward = GRAPH_OPERATORS[ctx.name]
        else:
            backward = getattr(aten, ctx.name).default
        tensors = (grad, *ctx.saved_tensors)
        return (None, None, None, backward(*tensors, *ctx.backward_arguments)) + (None,) * 6


def _wants_gradient(input):
    return torch.is_grad_enabled() and input.requires_grad


def _pair(value):
    return [value, value] if isinstance(value, int) else list(value)


def _upsample_bilinear2d(input, output_size, align_corners, scales_h=None, scales_w=None):
    overload = aten.upsample_bilinear2d.default
    arguments = (input, output_size, align_corners, scales_h, scales_w)
    if not _wants_gradient(input):
        return _below_autograd(overload, *arguments)
    # PyTorch's own kernel here decomposes the upsample: its forward (which Inductor generates and
    # fuses) stays, its backward becomes fastbwd's
    previous = _installed.get((overload, "Autograd"))
    if previous is None:
        previous = functools.partial(_below_autograd, overload)
    elif not (input.is_floating_point() and decides_fastbwd("upsample_bilinear2d_backward", input)):
        # other devices, complex inputs, and calls PyTorch's own code runs faster: PyTorch's kernel, both ways
        return previous(*arguments)
    backward_arguments = (list(output_size), list(input.shape), align_corners, scales_h, scales_w)
    return _RoutedForward.apply("upsample_bilinear2d_backward", previous, backward_arguments, *arguments)


def _upsample_bilinear2d_vec(key):
    """The ``.vec`` overload's kernel at ``key``: for a call that wants a gradient, as its C++
    composite kernel has it (the output size from the scale factors, then the ``.default``
    overload, whose autograd kernel :func:`_upsample_bilinear2d` decides between fastbwd's
    gradient and PyTorch's kernel, where PyTorch's Python kernel would decompose the call
    instead); for a call that wants none, PyTorch's Python kernel, so the trace is PyTorch's."""
    overload = aten.upsample_bilinear2d.vec

    def kernel(input, output_size, align_corners, scale_factors):
        previous = _installed.get((overload, key))
        if previous is not None and not _wants_gradient(input):
            return previous(input, output_size, align_corners, scale_factors)
        size = _private.upsample_output_size(input.size(), output_size, scale_factors)
        scales = scale_factors if scale_factors else [None, None]
        return aten.upsample_bilinear2d.default(input, size, align_corners, scales[0], scales[1])

    return kernel


def _avg_pool2d(
    input, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None
):
    overload = aten.avg_pool2d.default
    arguments = (input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    if not _wants_gradient(input):
        return _below_autograd(overload, *arguments)
    kernel_size = _pair(kernel_size)
    stride = _pair(stride) if stride else kernel_size  # an empty stride means the kernel size
    backward_arguments = (kernel_size, stride, _pair(padding), ceil_mode, count_include_pad, divisor_override)
    forward = functools.partial(_below_autograd, overload)
    return _RoutedForward.apply("avg_pool2d_backward", forward, backward_arguments, *arguments)


def _replication_pad2d(input, padding):
    overload = aten.replication_pad2d.default
    if not _wants_gradient(input):
        return _below_autograd(overload, input, padding)
    forward = functools.partial(_below_autograd, overload)
    return _RoutedForward.apply("replication_pad2d_backward", forward, (list(padding),), input, padding)


#: (overload, dispatch key) -> the Python-dispatcher kernel fastbwd puts there while enabled.
_KERNELS = {
    (aten.upsample_bilinear2d.vec, "Autograd"): _upsample_bilinear2d_vec("Autograd"),
    (aten.upsample_bilinear2d.vec, "CompositeImplicitAutograd"): _upsample_bilinear2d_vec("CompositeImplicitAutograd"),
    (aten.upsample_bilinear2d.default, "Autograd"): _upsample_bilinear2d,
    (aten.avg_pool2d.default, "Autograd"): _avg_pool2d,
    (aten.replication_pad2d.default, "Autograd"): _replication_pad2d,
}


# ---- GroupNorm -> SiLU in the captured graph -----------------------------------------------------

_GROUP_NORMS = (F.group_norm, torch.group_norm)


def _group_norm_arguments(node):
    """``(input, num_groups, weight, bias, eps)`` of an ``F.group_norm``/``torch.group_norm`` node,
    or None when an argument is not one the fused operator takes."""
    names = ("input", "num_groups", "weight", "bias", "eps")
    values = dict(zip(names, (None, None, None, None, 1e-5)))
    values.update(zip(names, node.args))
    for name, value in node.kwargs.items():
        if name not in values:
            return None  # cudnn_enabled of torch.group_norm: irrelevant on the CPU, but unusual
        values[name] = value
    return tuple(values[name] for name in names)


def _refused(path, input, num_groups, weight, bias, eps):
    """Whether fastbwd's fused operator does not take this pair, or is not the faster:
    ``_ops.refusal`` and the decision (path "compiled"), at trace time, on the fake values the
    compiler records for the graph's nodes (``_private.graph_values`` of ``path``; without them,
    every pair is refused)."""
    tensors = (input, weight, bias)
    values = _private.graph_values([a for a in tensors if isinstance(a, torch.fx.Node)], path)
    if values is None:
        return True
    values = iter(values)
    input, weight, bias = (next(values) if isinstance(a, torch.fx.Node) else a for a in tensors)
    if _ops.refusal(input, num_groups, weight, bias, eps) is not None:
        return True
    return not c.decide(_switch._policy, "compiled", "group_norm_swish", input, groups=num_groups)


def _fusable(node):
    """The fused operator's arguments when ``node`` is a GroupNorm whose output feeds only a SiLU
    and fastbwd takes the pair (else None), with that SiLU node."""
    if node.op != "call_function" or node.target not in _GROUP_NORMS or len(node.users) != 1:
        return None
    (silu,) = node.users
    if silu.op != "call_function" or silu.target not in _ops.silu_functions() or silu.args != (node,):
        return None
    if set(silu.kwargs) - {"inplace"}:
        return None
    arguments = _group_norm_arguments(node)
    if arguments is None or _refused(_private.EXAMPLE_VALUE, *arguments):
        return None
    return arguments, silu


def fuse_group_norm_swish_pre_grad(graph):
    """Rewrite every GroupNorm -> SiLU pair of a captured (pre-grad) graph into one
    ``fastbwd::group_norm_swish`` node; returns how many. The SiLU's ``inplace`` does not matter:
    the GroupNorm's output had no other user."""
    count = 0
    for node in list(graph.nodes):
        found = _fusable(node)
        if found is None:
            continue
        (input, num_groups, weight, bias, eps), silu = found
        with graph.inserting_before(silu):
            fused = graph.call_function(
                torch.ops.fastbwd.group_norm_swish.default, (input, weight, bias, num_groups, float(eps), 1.0, True)
            )
            result = graph.call_function(operator.getitem, (fused, 0))
        result.meta.update(silu.meta)
        silu.replace_all_uses_with(result)
        graph.erase_node(silu)
        graph.erase_node(node)
        count += 1
    return count


def _getitems(node):
    """``{index: getitem node}`` of a node returning a tuple, or None if anything else uses it."""
    items = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[1] in items:
            return None
        items[user.args[1]] = user
    return items


def _through_detaches(node):
    """The node ``node`` is, seen through the ``aten.detach`` chain AOTAutograd puts between a
    saved statistic and its use in the backward."""
    while node.op == "call_function" and node.target is aten.detach.default:
        node = node.args[0]
    return node


def _call(graph, target, arguments, value):
    """A new ``call_function`` node with its fake value (what AOTAutograd's partitioner reads)."""
    node = graph.call_function(target, arguments)
    _private.set_graph_value(node, _private.VAL, value)
    return node


def _fake_values(forward_arguments, backward_arguments):
    """The fake values of the fused pair's forward and backward nodes, computed from their
    arguments' in the graph's fake mode before the graph changes (the backward's mean and rstd are
    the forward's outputs, given as None here); None (after one warning, the fusion off) when the
    graph does not give what that needs."""
    nodes = [a for a in (*forward_arguments, backward_arguments[0]) if isinstance(a, torch.fx.Node)]
    values = _private.graph_values(nodes, _private.VAL)
    mode = values and _private.fake_mode_of(values[0])
    if not mode:
        return None
    value_of = dict(zip(nodes, values))

    def fake(argument):
        return value_of[argument] if isinstance(argument, torch.fx.Node) else argument

    try:
        with mode:
            forward = torch.ops.fastbwd.group_norm_swish.default(*map(fake, forward_arguments))
            grad, input, _, _, *rest = map(fake, backward_arguments)
            backward = torch.ops.fastbwd.group_norm_swish_backward.default(grad, input, *forward[1:], *rest)
    except Exception as error:  # noqa: BLE001 - the fake mode is not what it was: no fusion, one warning
        return _private.broken(_private.JOINT, error)
    return forward, backward


def _silu_and_its_backward(normalised):
    """``(silu, silu_backward)`` when the GroupNorm output ``normalised`` has exactly two uses: the
    SiLU, and its backward's saved input (directly, or a clone of it that an in-place SiLU
    needs); else ``(None, None)``."""
    silu = _single_user_of(normalised, aten.silu.default)
    others = [user for user in normalised.users if user is not silu]
    if silu is None or silu.args != (normalised,) or len(others) != 1:
        return None, None
    saved = others[0]
    if saved.op == "call_function" and saved.target is aten.clone.default and len(saved.users) == 1:
        saved_input, (backward,) = saved, saved.users
    else:
        saved_input, backward = normalised, saved
    if backward.op != "call_function" or backward.target is not aten.silu_backward.default:
        return None, None
    if backward.args[1] is not saved_input:
        return None, None
    return silu, backward


def _single_user_of(node, target):
    """The one user of ``node`` that calls ``target`` (None if none or several)."""
    calls = [user for user in node.users if user.op == "call_function" and user.target is target]
    return calls[0] if len(calls) == 1 else None


def fuse_group_norm_swish_joint(graph):
    """The GroupNorm -> SiLU pairs of an AOTAutograd joint graph (``aot_eager`` and other backends
    that keep ``native_group_norm``; Inductor has decomposed it by then, and its pre-grad pass
    fused the pairs already) as ``fastbwd::group_norm_swish`` and its backward: the forward
    ``native_group_norm -> silu`` and the backward ``silu_backward -> native_group_norm_backward``
    of the same pair are replaced together. Returns how many pairs."""
    count = 0
    for norm in list(graph.nodes):
        if norm.op != "call_function" or norm.target is not aten.native_group_norm.default:
            continue
        input, weight, bias, _, _, _, num_groups, eps = norm.args
        items = _getitems(norm)
        if items is None or 0 not in items or _refused(_private.VAL, input, num_groups, weight, bias, eps):
            continue
        eps = float(eps)
        silu, silu_backward = _silu_and_its_backward(items[0])
        if silu is None or len(silu_backward.users) != 1:
            continue
        backward = _single_user_of(silu_backward, aten.native_group_norm_backward.default)
        if backward is None or backward.args[0] is not silu_backward:
            continue
        _, saved_input, mean, rstd, saved_weight, _, _, _, _, mask = backward.args
        if saved_input is not input or saved_weight is not weight:
            continue
        if _through_detaches(mean) is not items.get(1) or _through_detaches(rstd) is not items.get(2):
            continue
        gradients = _getitems(backward)
        if gradients is None:
            continue
        mask = [mask[0], mask[1] and weight is not None, mask[2] and bias is not None]
        forward_arguments = (input, weight, bias, num_groups, eps, 1.0, True)
        grad = silu_backward.args[0]
        backward_arguments = (grad, input, None, None, weight, bias, num_groups, 1.0, mask, eps, True)
        values = _fake_values(forward_arguments, backward_arguments)
        if values is None:
            return count
        forward_value, backward_value = values
        with graph.inserting_before(silu):
            fused = _call(graph, torch.ops.fastbwd.group_norm_swish.default, forward_arguments, forward_value)
            outputs = [_call(graph, operator.getitem, (fused, i), forward_value[i]) for i in range(3)]
        silu.replace_all_uses_with(outputs[0])
        with graph.inserting_before(backward):
            arguments = (grad, input, outputs[1], outputs[2], *backward_arguments[4:])
            fused_backward = _call(
                graph, torch.ops.fastbwd.group_norm_swish_backward.default, arguments, backward_value
            )
            for index, item in gradients.items():
                item.replace_all_uses_with(
                    _call(graph, operator.getitem, (fused_backward, index), backward_value[index])
                )
        for node in (*gradients.values(), backward, silu_backward, silu):
            graph.erase_node(node)
        graph.eliminate_dead_code()  # native_group_norm, its items and the detaches, now unused
        count += 1
    return count


def _joint_pass(previous):
    """AOTAutograd's joint-graph hook: the user's pass first (if any), then the pair fusion while
    the hooks are installed (a hook left in the config after ``disable()``, by code that put an
    old config value back, fuses nothing)."""

    def joint_pass(gm, inputs):
        if previous is not None:
            gm = previous(gm, inputs)
        if _installed and fuse_group_norm_swish_joint(gm.graph):
            gm.recompile()
        return gm

    joint_pass.fastbwd = True
    return joint_pass


#: The bridge's sources, which shape what a compiled graph holds (this module's passes and kernels,
#: the graph operators' schemas and fake kernels in _routing and _ops, _convert's layout rule):
#: the pass's uuid hashes them all, so editing any of them never reuses a stale compiled graph.
_GRAPH_SOURCES = tuple(sorted(str(path) for path in pathlib.Path(__file__).parent.glob("*.py")))


@functools.cache
def _graph_pass():
    """The pre-grad pass object (made on first use: importing Inductor takes a while). Its uuid
    keys Inductor's caches, so a graph compiled with fastbwd and one without never share an entry."""
    custom_graph_pass, hash_for_files = _private.custom_graph_pass()

    class GroupNormSwishPass(custom_graph_pass):
        def __call__(self, graph):
            if _installed:  # (a pass left in the config after disable(): nothing, as the joint hook)
                fuse_group_norm_swish_pre_grad(graph)

        def uuid(self):
            state = "on" if _installed else "off"  # a graph compiled while it fuses nothing is another entry
            return hash_for_files(_GRAPH_SOURCES, extra=f"fastbwd {fastbwd.__version__} {state}")

        def __repr__(self):
            return "fastbwd.torch GroupNorm -> SiLU pass"

    return GroupNormSwishPass()


# ---- install / uninstall (enable / disable) ------------------------------------------------------


def install():
    """Put the hooks in place (at ``enable()``); True when they are, False (after one warning
    per process) when this PyTorch's compiler interfaces are not the ones fastbwd knows."""
    global _passes_before, _passes_set, _joint_before
    with _lock:
        if _installed:
            return True
        low, high = SUPPORTED_RANGE
        if not low <= _torch_version() <= high:
            _private.broken(_private.COMPILER, f"torch {torch.__version__} is outside the releases {low} to {high}")
            return False
        if not _private.compiler_available():
            return False
        try:
            for (overload, key), kernel in _KERNELS.items():
                _installed[overload, key] = _private.set_python_kernel(overload, _private.dispatch_key(key), kernel)
            inductor, functorch = _private.configs()
            _passes_before = inductor.pre_grad_custom_pass
            _passes_set = _as_list(_passes_before) + [_graph_pass()]
            inductor.pre_grad_custom_pass = _passes_set
            _joint_before = functorch.joint_custom_pass
            functorch.joint_custom_pass = _joint_pass(_joint_before)
        except Exception as error:  # noqa: BLE001 - an interface changed: no hooks, one warning
            _uninstall()
            _private.broken(_private.COMPILER, error)
            return False
        return True


def uninstall():
    """Take the hooks out again (at ``disable()``): graphs captured from now on are PyTorch's own."""
    with _lock:
        try:
            _uninstall()
        except Exception as error:  # noqa: BLE001
            _private.broken(_private.COMPILER, error)


def _uninstall():
    global _passes_set
    while _installed:
        (overload, key), previous = _installed.popitem()
        _private.set_python_kernel(overload, _private.dispatch_key(key), previous)
    if _passes_set is None:
        return
    passes_set, _passes_set = _passes_set, None
    inductor, functorch = _private.configs()
    if getattr(functorch.joint_custom_pass, "fastbwd", False):
        functorch.joint_custom_pass = _joint_before
    if inductor.pre_grad_custom_pass is passes_set:
        inductor.pre_grad_custom_pass = _passes_before
    else:  # changed since install (by the user): take only fastbwd's pass out
        passes = [p for p in _as_list(inductor.pre_grad_custom_pass) if p is not _graph_pass()]
        inductor.pre_grad_custom_pass = passes or None


def is_installed():
    """True while the compiler hooks are in place."""
    return bool(_installed)


def _as_list(passes):
    if passes is None:
        return []
    return list(passes) if isinstance(passes, (list, tuple)) else [passes]


_switch.follow(install, uninstall)
