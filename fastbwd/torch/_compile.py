"""fastbwd inside ``torch.compile`` (docs/semantics.md §7): the one module that uses the
compiler's private interfaces, installed by ``enable()`` and removed by ``disable()``.

Two hooks, both read only while a graph is being captured or compiled (never by eager code):

* **Autograd kernels for the Python dispatcher.** AOTAutograd traces a model's forward and
  backward with PyTorch's Python dispatcher, where ``aten.upsample_bilinear2d`` has a Python
  autograd kernel that decomposes it (its backward becomes scatters), and Inductor lowers
  ``aten.avg_pool2d_backward`` to its own code. While enabled, the forward operators of the
  three routed backward ops get autograd kernels here (``OpOverload.py_kernels``) whose forward
  is the same aten call as before (Inductor still generates the forward) and whose backward is
  fastbwd's graph operator (``fastbwd::<name>``, see ``_routing``): one opaque node with honest
  fake strides, for every backend (Inductor, ``aot_eager``, ...).
* **A pre-grad graph pass (Inductor).** ``F.group_norm`` whose output feeds only ``F.silu`` (an
  ``nn.SiLU`` module traces to it) becomes ``fastbwd::group_norm_silu``: the fused forward and
  backward kernels. Dynamo has already resolved the model's Python, so this reaches pairs in any
  ``forward()``. Added to ``torch._inductor.config.pre_grad_custom_pass`` beside any pass the
  user set there.

Both interfaces are private to PyTorch: :func:`install` checks the version and the attributes it
needs and, on any mismatch, warns once and leaves ``torch.compile`` as PyTorch ships it (eager
routing is unaffected).
"""

import functools
import operator
import pathlib
import threading
import warnings

import torch
import torch._functorch.config as functorch_config
from torch import Tensor
from torch.nn import functional as F

import fastbwd

from . import _convert as c
from . import _ops, _routing

aten = torch.ops.aten

#: The PyTorch releases (major, minor) whose private interfaces have the shape used here (tested
#: with 2.13; :func:`unavailable_reason` also checks each attribute): outside them the hooks stay out.
SUPPORTED_RANGE = ((2, 10), (2, 14))

_lock = threading.Lock()
_installed = {}  # (OpOverload, DispatchKey) -> the py_kernel it had before (None: none)
_warned = False
_passes_before = None  # Inductor's pre_grad_custom_pass before install()
_passes_set = None  # the value install() gave it
_joint_before = None  # AOTAutograd's joint_custom_pass before install()


def _torch_version():
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def unavailable_reason():
    """Why the compiler hooks cannot be installed with this PyTorch, or None when they can."""
    version = _torch_version()
    low, high = SUPPORTED_RANGE
    if not low <= version <= high:
        return f"torch {torch.__version__} is outside the releases fastbwd's compiler hooks support ({low} to {high})"
    try:
        import torch._inductor.config as inductor_config
        from torch._decomp.decompositions import upsample_compute_output_size  # noqa: F401
        from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: F401
    except ImportError as error:
        return f"a compiler interface is missing ({error})"
    if not hasattr(inductor_config, "pre_grad_custom_pass"):
        return "torch._inductor.config has no pre_grad_custom_pass"
    if not hasattr(functorch_config, "joint_custom_pass"):
        return "torch._functorch.config has no joint_custom_pass"
    for overload, _ in _KERNELS:
        if not isinstance(getattr(overload, "py_kernels", None), dict) or not hasattr(overload, "_dispatch_cache"):
            return f"{overload} has no Python-dispatcher kernel table"
    return None


# ---- autograd kernels for the Python dispatcher ------------------------------------------------


def _below_autograd(overload, arguments):
    """``overload(*arguments)`` without recording autograd: what an autograd kernel does when no
    input needs a gradient."""
    with torch._C._AutoDispatchBelowAutograd():
        return overload(*arguments)


def _below_autograd_call(overload, *arguments):
    return _below_autograd(overload, arguments)


class _RoutedForward(torch.autograd.Function):
    """A forward operator whose backward is one node: fastbwd's graph operator on CPU, the aten
    backward operator elsewhere (what PyTorch's own autograd formula calls). The forward is what
    PyTorch would trace without fastbwd (``forward(input, *arguments)``: the aten call, or PyTorch's
    own decomposition), so the compiler generates it as before."""

    @staticmethod
    def forward(ctx, name, forward, backward_arguments, input, *arguments):
        ctx.name, ctx.backward_arguments = name, backward_arguments
        ctx.on_cpu = input.device.type == "cpu"
        if _routing.ROUTES[name].tensors == 2:
            ctx.save_for_backward(input)
        return forward(input, *arguments)

    @staticmethod
    def backward(ctx, grad):
        if ctx.on_cpu:
            backward = _routing.GRAPH_OPERATORS[ctx.name]
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
        return _below_autograd(overload, arguments)
    # PyTorch's own kernel here decomposes the upsample: its forward (which Inductor generates and
    # fuses) stays, its backward becomes fastbwd's
    previous = _installed.get((overload, _AUTOGRAD))
    if previous is None:
        previous = functools.partial(_below_autograd_call, overload)
    elif input.device.type != "cpu":  # other devices: PyTorch's own kernel, forward and backward
        return previous(*arguments)
    backward_arguments = (list(output_size), list(input.shape), align_corners, scales_h, scales_w)
    return _RoutedForward.apply("upsample_bilinear2d_backward", previous, backward_arguments, *arguments)


def _upsample_bilinear2d_vec(input, output_size, align_corners, scale_factors):
    """The ``.vec`` overload as its C++ composite kernel has it: the output size from the scale
    factors, then the overload with an autograd formula (where PyTorch's Python kernel would
    decompose it instead)."""
    from torch._decomp.decompositions import upsample_compute_output_size

    size = upsample_compute_output_size(input.size(), output_size, scale_factors)
    scales = scale_factors if scale_factors else [None, None]
    return aten.upsample_bilinear2d.default(input, size, align_corners, scales[0], scales[1])


def _avg_pool2d(
    input, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None
):
    overload = aten.avg_pool2d.default
    arguments = (input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    if not _wants_gradient(input):
        return _below_autograd(overload, arguments)
    kernel_size = _pair(kernel_size)
    stride = _pair(stride) if stride else kernel_size  # an empty stride means the kernel size
    backward_arguments = (kernel_size, stride, _pair(padding), ceil_mode, count_include_pad, divisor_override)
    forward = functools.partial(_below_autograd_call, overload)
    return _RoutedForward.apply("avg_pool2d_backward", forward, backward_arguments, *arguments)


def _replication_pad2d(input, padding):
    overload = aten.replication_pad2d.default
    if not _wants_gradient(input):
        return _below_autograd(overload, (input, padding))
    forward = functools.partial(_below_autograd_call, overload)
    return _RoutedForward.apply("replication_pad2d_backward", forward, (list(padding),), input, padding)


_AUTOGRAD = torch._C.DispatchKey.Autograd
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd

#: (overload, dispatch key) -> the kernel fastbwd puts there while enabled.
_KERNELS = {
    (aten.upsample_bilinear2d.vec, _AUTOGRAD): _upsample_bilinear2d_vec,
    (aten.upsample_bilinear2d.vec, _COMPOSITE): _upsample_bilinear2d_vec,
    (aten.upsample_bilinear2d.default, _AUTOGRAD): _upsample_bilinear2d,
    (aten.avg_pool2d.default, _AUTOGRAD): _avg_pool2d,
    (aten.replication_pad2d.default, _AUTOGRAD): _replication_pad2d,
}


# ---- GroupNorm -> SiLU in the captured graph -----------------------------------------------------
# The fused pair is its own operator (not fastbwd::group_norm_swish, which a GroupNormSwish module
# calls and which always runs fastbwd): like the routed backward operators it follows the switch
# at run time, running PyTorch's native_group_norm and silu while fastbwd is disabled.


def _statistics_dtype(input, weight, bias):
    return _ops.stats_dtype(input, weight, bias)


def _native_group_norm(input, weight, bias, num_groups, eps):
    batch, channels = input.shape[:2]
    return torch.native_group_norm(
        input, weight, bias, batch, channels, input.numel() // max(batch * channels, 1), num_groups, eps
    )


def native_group_norm_silu_backward(grad_output, y, input, mean, rstd, weight, num_groups, output_mask):
    """``(dx, dgamma, dbeta)`` of ``F.silu(F.group_norm(...))`` by PyTorch's own kernels
    (``silu_backward``, then ``native_group_norm_backward``), ``y`` being the GroupNorm's output."""
    batch, channels = input.shape[:2]
    return torch.ops.aten.native_group_norm_backward(
        torch.ops.aten.silu_backward(grad_output, y),
        input,
        mean,
        rstd,
        weight,
        batch,
        channels,
        input.numel() // max(batch * channels, 1),
        num_groups,
        output_mask,
    )


@torch.library.custom_op("fastbwd::group_norm_silu", mutates_args=(), device_types="cpu")
def group_norm_silu(
    input: Tensor, weight: Tensor | None, bias: Tensor | None, num_groups: int, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``F.silu(F.group_norm(input, num_groups, weight, bias, eps))`` with mean and rstd: fastbwd's
    fused kernel while enabled, PyTorch's ``native_group_norm`` then ``silu`` while disabled."""
    _routing.GRAPH_CALLS["group_norm_silu"] += 1
    if _routing.is_enabled():
        return _ops._forward_kernel(input, weight, bias, num_groups, eps, 1.0)
    y, mean, rstd = _native_group_norm(input, weight, bias, num_groups, eps)
    statistics = _statistics_dtype(input, weight, bias)
    memory_format = c.memory_format(input)
    return F.silu(y).contiguous(memory_format=memory_format), mean.to(statistics), rstd.to(statistics)


@group_norm_silu.register_fake
def _(input, weight, bias, num_groups, eps):
    y = torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=c.memory_format(input))
    mean = input.new_empty((input.shape[0], num_groups), dtype=_statistics_dtype(input, weight, bias))
    return y, mean, torch.empty_like(mean)


@torch.library.custom_op("fastbwd::group_norm_silu_backward", mutates_args=(), device_types="cpu")
def group_norm_silu_backward(
    grad_output: Tensor,
    input: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    num_groups: int,
    eps: float,
    output_mask: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dgamma, dbeta)`` of :func:`group_norm_silu` (an empty ``(0,)`` tensor for a gradient
    ``output_mask`` does not ask for): fastbwd's fused backward while enabled; while disabled,
    PyTorch's ``silu_backward`` and ``native_group_norm_backward`` (on the normalised output
    computed again, as the forward computed it)."""
    _routing.GRAPH_CALLS["group_norm_silu_backward"] += 1
    need_weight = output_mask[1] and weight is not None
    need_bias = output_mask[2] and bias is not None
    if _routing.is_enabled():
        grads = _ops._backward_kernel(
            grad_output, input, mean, rstd, weight, bias, num_groups, 1.0, need_weight, need_bias
        )
    else:
        y = _normalised(input, mean, rstd, weight, bias, num_groups, eps)
        grads = native_group_norm_silu_backward(
            grad_output, y, input, mean, rstd, weight, num_groups, [True, need_weight, need_bias]
        )
        grads = (grads[0].contiguous(memory_format=c.memory_format(input)), grads[1], grads[2])
    none_weight, none_bias = _ops._unrequested(input, weight, bias)
    return (
        grads[0],
        grads[1] if need_weight else none_weight,
        grads[2] if need_bias else none_bias,
    )


def _normalised(input, mean, rstd, weight, bias, num_groups, eps):
    """The GroupNorm output the SiLU saw: ``native_group_norm``'s again (its very bits, so the
    backward is PyTorch's) when ``mean`` and ``rstd`` are the statistics it computes, else
    normalised with the ``mean`` and ``rstd`` given (the formula of §5 takes them as given)."""
    y, own_mean, own_rstd = _native_group_norm(input, weight, bias, num_groups, eps)
    if torch.equal(own_mean, mean.to(own_mean.dtype)) and torch.equal(own_rstd, rstd.to(own_rstd.dtype)):
        return y
    batch, channels = input.shape[:2]
    shape = (batch, num_groups, -1)
    normalised = (input.reshape(shape) - mean.reshape(batch, num_groups, 1)) * rstd.reshape(batch, num_groups, 1)
    broadcast = (1, channels) + (1,) * (input.dim() - 2)
    normalised = normalised.reshape(input.shape)
    if weight is not None:
        normalised = normalised * weight.reshape(broadcast)
    if bias is not None:
        normalised = normalised + bias.reshape(broadcast)
    return normalised.to(input.dtype)


@group_norm_silu_backward.register_fake
def _(grad_output, input, mean, rstd, weight, bias, num_groups, eps, output_mask):
    need_weight = output_mask[1] and weight is not None
    need_bias = output_mask[2] and bias is not None
    none_weight, none_bias = _ops._unrequested(input, weight, bias)
    return (
        torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=c.memory_format(input)),
        torch.empty_like(weight) if need_weight else none_weight,
        torch.empty_like(bias) if need_bias else none_bias,
    )


def _group_norm_silu_setup(ctx, inputs, output):
    input, weight, bias, num_groups, eps = inputs
    _, mean, rstd = output
    ctx.save_for_backward(input, weight, bias, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)
    ctx.num_groups, ctx.eps, ctx.swish_scale = num_groups, eps, 1.0


def _group_norm_silu_grad(ctx, grad_output, grad_mean, grad_rstd):
    if grad_output is None:
        return (None,) * 5
    input, weight, bias, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    if torch.is_grad_enabled():  # a graph of the backward: PyTorch's composite (exact double backward)
        return _ops._composite_grad(grad_output, input, weight, bias, needs, ctx) + (None, None)
    mask = [needs[0], needs[1] and weight is not None, needs[2] and bias is not None]
    grads = group_norm_silu_backward(grad_output, input, mean, rstd, weight, bias, ctx.num_groups, ctx.eps, mask)
    return tuple(grad if need else None for grad, need in zip(grads, mask)) + (None, None)


group_norm_silu.register_autograd(_group_norm_silu_grad, setup_context=_group_norm_silu_setup)


def _group_norm_silu_backward_setup(ctx, inputs, output):
    grad_output, input, mean, rstd, weight, bias, num_groups, eps, _ = inputs
    ctx.save_for_backward(grad_output, input, mean, rstd, weight, bias)
    ctx.num_groups, ctx.swish_scale = num_groups, 1.0


# Its derivative is group_norm_swish_backward's (§5's formula in PyTorch ops, mean and rstd as given).
group_norm_silu_backward.register_autograd(
    _ops._group_norm_swish_backward_grad, setup_context=_group_norm_silu_backward_setup
)


_GROUP_NORMS = (F.group_norm, torch.group_norm)
_SILUS = (F.silu, torch._C._nn.silu)
#: The dtypes fastbwd's GroupNorm+Swish kernels take.
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _group_norm_arguments(node):
    """``(input, num_groups, weight, bias, eps)`` of an ``F.group_norm``/``torch.group_norm`` node,
    or None when they are not the constants and nodes the fused operator takes."""
    names = ("input", "num_groups", "weight", "bias", "eps")
    values = dict(zip(names, (None, None, None, None, 1e-5)))
    values.update(zip(names, node.args))
    for name, value in node.kwargs.items():
        if name not in values:
            return None  # cudnn_enabled of torch.group_norm: irrelevant on the CPU, but unusual
        values[name] = value
    if not isinstance(values["num_groups"], int) or isinstance(values["num_groups"], bool):
        return None
    if type(values["eps"]) not in (float, int):
        return None
    return tuple(values[name] for name in names)


def _fusable(node):
    """The fused operator's arguments when ``node`` is a GroupNorm whose output feeds only a SiLU
    on a CPU tensor of a dtype fastbwd takes (else None), with that SiLU node."""
    if node.op != "call_function" or node.target not in _GROUP_NORMS or len(node.users) != 1:
        return None
    (silu,) = node.users
    if silu.op != "call_function" or silu.target not in _SILUS or silu.args != (node,):
        return None
    if set(silu.kwargs) - {"inplace"}:
        return None
    arguments = _group_norm_arguments(node)
    value = node.meta.get("example_value")
    if arguments is None or not isinstance(value, torch.Tensor):
        return None
    if value.device.type != "cpu" or value.dtype not in _FUSED_DTYPES or value.dim() < 2:
        return None
    return arguments, silu


def fuse_group_norm_silu(graph):
    """Rewrite every GroupNorm -> SiLU pair of a captured (pre-grad) graph into one
    ``fastbwd::group_norm_silu`` node; returns how many. The SiLU's ``inplace`` does not matter:
    the GroupNorm's output had no other user."""
    count = 0
    for node in list(graph.nodes):
        found = _fusable(node)
        if found is None:
            continue
        (input, num_groups, weight, bias, eps), silu = found
        with graph.inserting_before(silu):
            fused = graph.call_function(
                torch.ops.fastbwd.group_norm_silu.default, (input, weight, bias, num_groups, float(eps))
            )
            result = graph.call_function(operator.getitem, (fused, 0))
        result.meta.update(silu.meta)
        silu.replace_all_uses_with(result)
        graph.erase_node(silu)
        graph.erase_node(node)
        count += 1
    return count


def _single_user(node, target):
    """``node``'s one user when it is a call of ``target``, else None."""
    users = list(node.users)
    if len(users) == 1 and users[0].op == "call_function" and users[0].target is target:
        return users[0]
    return None


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


def _call(graph, fake_mode, target, *arguments):
    """A new ``call_function`` node with its ``meta["val"]`` (what AOTAutograd's partitioner reads),
    computed by running ``target`` on the arguments' fake values."""
    node = graph.call_function(target, arguments)
    values = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in arguments]
    with fake_mode:
        node.meta["val"] = target(*values)
    return node


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


def fuse_group_norm_silu_joint(graph):
    """The GroupNorm -> SiLU pairs of an AOTAutograd joint graph (``aot_eager`` and other backends
    that keep ``native_group_norm``; Inductor has decomposed it by then, and its pre-grad pass
    fused the pairs already) as ``fastbwd::group_norm_silu`` and its backward: the forward
    ``native_group_norm -> silu`` and the backward ``silu_backward -> native_group_norm_backward``
    of the same pair are replaced together. Returns how many pairs."""
    count = 0
    for norm in list(graph.nodes):
        if norm.op != "call_function" or norm.target is not aten.native_group_norm.default:
            continue
        input, weight, bias, _, _, _, num_groups, eps = norm.args
        eps = float(eps)
        items = _getitems(norm)
        value = input.meta.get("val") if hasattr(input, "meta") else None
        if items is None or 0 not in items or not isinstance(value, torch.Tensor):
            continue
        if value.device.type != "cpu" or value.dtype not in _FUSED_DTYPES:
            continue
        silu, silu_backward = _silu_and_its_backward(items[0])
        if silu is None:
            continue
        backward = _single_user(silu_backward, aten.native_group_norm_backward.default)
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
        with graph.inserting_before(silu):
            fused = _call(
                graph, value.fake_mode, torch.ops.fastbwd.group_norm_silu.default, input, weight, bias, num_groups, eps
            )
            outputs = [_call(graph, value.fake_mode, operator.getitem, fused, index) for index in range(3)]
        silu.replace_all_uses_with(outputs[0])
        with graph.inserting_before(backward):
            fused_backward = _call(
                graph,
                value.fake_mode,
                torch.ops.fastbwd.group_norm_silu_backward.default,
                silu_backward.args[0],
                input,
                outputs[1],
                outputs[2],
                weight,
                bias,
                num_groups,
                eps,
                mask,
            )
            for index, item in gradients.items():
                item.replace_all_uses_with(_call(graph, value.fake_mode, operator.getitem, fused_backward, index))
        for node in (*gradients.values(), backward, silu_backward, silu):
            graph.erase_node(node)
        graph.eliminate_dead_code()  # native_group_norm, its items and the detaches, now unused
        count += 1
    return count


def _joint_pass(previous):
    """AOTAutograd's joint-graph hook: the user's pass first (if any), then the pair fusion."""

    def joint_pass(gm, inputs):
        if previous is not None:
            gm = previous(gm, inputs)
        if fuse_group_norm_silu_joint(gm.graph):
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
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class GroupNormSiLUPass(CustomGraphPass):
        def __call__(self, graph):
            fuse_group_norm_silu(graph)

        def uuid(self):
            return get_hash_for_files(_GRAPH_SOURCES, extra=f"fastbwd {fastbwd.__version__}")

        def __repr__(self):
            return "fastbwd.torch GroupNorm -> SiLU pass"

    return GroupNormSiLUPass()


# ---- enable / disable ----------------------------------------------------------------------------


def install():
    """Put the hooks in place (``enable()``); True when they are, False (after one warning per
    process) when this PyTorch's compiler interfaces are not the ones fastbwd knows."""
    global _warned, _passes_before, _passes_set, _joint_before
    with _lock:
        if _installed:
            return True
        reason = unavailable_reason()
        if reason is not None:
            if not _warned:
                _warned = True
                warnings.warn(
                    f"fastbwd.torch: {reason}; torch.compile keeps PyTorch's own kernels (eager calls still "
                    "run on fastbwd)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return False
        for (overload, key), kernel in _KERNELS.items():
            _installed[overload, key] = overload.py_kernels.get(key)
            overload.py_kernels[key] = kernel
            overload._dispatch_cache.clear()
        import torch._inductor.config as inductor_config

        _passes_before = inductor_config.pre_grad_custom_pass
        _passes_set = _as_list(_passes_before) + [_graph_pass()]
        inductor_config.pre_grad_custom_pass = _passes_set
        _joint_before = functorch_config.joint_custom_pass
        functorch_config.joint_custom_pass = _joint_pass(_joint_before)
        return True


def uninstall():
    """Take the hooks out again (``disable()``): graphs captured from now on are PyTorch's own."""
    with _lock:
        if not _installed:
            return
        for (overload, key), previous in _installed.items():
            if previous is None:
                overload.py_kernels.pop(key, None)
            else:
                overload.py_kernels[key] = previous
            overload._dispatch_cache.clear()
        _installed.clear()
        import torch._inductor.config as inductor_config

        if getattr(functorch_config.joint_custom_pass, "fastbwd", False):
            functorch_config.joint_custom_pass = _joint_before
        if inductor_config.pre_grad_custom_pass is _passes_set:
            inductor_config.pre_grad_custom_pass = _passes_before
        else:  # changed since install (by the user): take only fastbwd's pass out
            passes = [p for p in _as_list(inductor_config.pre_grad_custom_pass) if p is not _graph_pass()]
            inductor_config.pre_grad_custom_pass = passes or None


def is_installed():
    """True while the compiler hooks are in place."""
    return bool(_installed)


def _as_list(passes):
    if passes is None:
        return []
    return list(passes) if isinstance(passes, (list, tuple)) else [passes]
