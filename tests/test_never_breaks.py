"""fastbwd.torch never breaks what PyTorch runs (docs/semantics.md §7, "Never breaks").

A property test (hypothesis) draws calls of the operators fastbwd stands in for -- bilinear
``F.interpolate``, ``F.avg_pool2d``, ``F.pad(mode="replicate")``, and ``F.group_norm`` or
``nn.GroupNorm`` followed by SiLU -- over ranks 2 to 5, empty batches, eps edge values, groups
past the kernels' 4000-channel limit, every dtype, channels_last, non-contiguous views and
gradients, align_corners, scale factors, divisor_override and negative pads. Each fastbwd path
(eager routing, ``group_norm_swish``, ``GroupNormSwish``, ``fuse_group_norm_swish`` with and
without example inputs; ``torch.compile`` with fastbwd) runs the call and its backward on the
same inputs as plain PyTorch: where PyTorch gives a result, the path gives it within float
tolerance (same shape, dtype and layout, NaNs where PyTorch has them); where PyTorch raises, the
path raises the same exception type.

Every check runs under each policy (:data:`POLICIES`): ``"always"`` (fastbwd wherever it can
serve), ``"auto"`` with this machine's thresholds (these small calls then take PyTorch's code,
through fastbwd's functions that decide), and ``"auto"`` with every threshold 0 (fastbwd's side
of every decision: the functional routing's path, where ``"always"`` takes the aten kernels').

``FASTBWD_NEVER_BREAKS_SCALE=k`` multiplies every example count (docs/testing.md).
"""

import collections
import contextlib
import math
import os
import warnings
from typing import NamedTuple

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fastbwd.torch as ft  # noqa: E402
from fastbwd import _dispatch  # noqa: E402

F, nn = torch.nn.functional, torch.nn
SCALE = float(os.environ.get("FASTBWD_NEVER_BREAKS_SCALE", "1"))
#: Configurations checked in this process, per test (printed by each test: ``pytest -s``).
CHECKED = collections.Counter()

DTYPES = [torch.float32] * 4 + [torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.int64]
EPS = [1e-5, 1e-5, 0.0, -0.0, 5e-324, 1e-3, 10.0, 1e30, -1e-5, -1.0, math.nan, math.inf, -math.inf]
#: Normwise tolerance of each dtype: |actual - expected|_max <= TOLERANCE * (1 + |expected|_max).
TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 2e-4,
    torch.complex64: 2e-4,
    torch.float16: 2e-2,
    torch.bfloat16: 5e-2,
    torch.int64: 0,
}


class Call(NamedTuple):
    """One drawn call: the operator, its input and gradient, and its other arguments."""

    op: str  # "interpolate", "avg_pool", "pad" or "group_norm"
    shape: tuple
    dtype: torch.dtype
    layout: str  # of the input: "contiguous", "channels_last", "transposed" or "strided"
    grad_layout: str  # of the gradient fed to the backward: the same names
    seed: int
    arguments: dict


def _layouts(draw):
    return draw(st.sampled_from(["contiguous", "contiguous", "channels_last", "transposed", "strided"]))


@st.composite
def calls(draw, ops=("interpolate", "avg_pool", "pad", "group_norm")):
    op = draw(st.sampled_from(ops))
    rank = draw(st.sampled_from([2, 3, 4, 4, 4, 5]))
    batch = draw(st.sampled_from([0, 1, 2, 2, 3]))
    spatial = [draw(st.sampled_from([1, 2, 3, 5, 7, 8] + ([0] if op == "group_norm" else []))) for _ in range(rank - 2)]
    arguments = {}
    if op == "interpolate":
        channels = draw(st.integers(1, 4))
        if draw(st.booleans()):
            arguments["size"] = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
        else:
            factor = st.sampled_from([0.5, 1.0, 1.5, 1.7, 2.0, 3.0, 0.3])
            arguments["scale_factor"] = draw(st.one_of(factor, st.tuples(factor, factor)))
            arguments["recompute_scale_factor"] = draw(st.sampled_from([None, True, False]))
        arguments["align_corners"] = draw(st.sampled_from([None, True, False]))
        arguments["antialias"] = draw(st.sampled_from([False] * 5 + [True]))
    elif op == "avg_pool":
        channels = draw(st.integers(1, 4))
        kernel = draw(st.one_of(st.integers(1, 4), st.tuples(st.integers(1, 4), st.integers(1, 4))))
        arguments["kernel_size"] = kernel
        arguments["stride"] = draw(
            st.one_of(st.none(), st.integers(1, 3), st.tuples(st.integers(1, 3), st.integers(1, 3)))
        )
        arguments["padding"] = draw(st.one_of(st.integers(0, 2), st.tuples(st.integers(0, 2), st.integers(0, 2))))
        arguments["ceil_mode"] = draw(st.booleans())
        arguments["count_include_pad"] = draw(st.booleans())
        arguments["divisor_override"] = draw(st.sampled_from([None, None, None, 1, 2, 5, 0, -1]))
    elif op == "pad":
        channels = draw(st.integers(1, 4))
        length = draw(st.sampled_from([2, 4, 4, 4, 6]))
        arguments["pad"] = tuple(draw(st.integers(-3, 5)) for _ in range(length))
    else:
        groups = draw(st.sampled_from([1, 1, 2, 3, 4, 0]))
        group_size = draw(st.sampled_from([1, 2, 3, 4] * 4 + [3999, 4000, 4001, 8192]))
        channels = max(groups, 1) * group_size + draw(st.sampled_from([0] * 9 + [1]))  # sometimes not divisible
        if group_size > 8:  # wide groups: few values beside them
            batch, spatial = min(batch, 2), [min(size, 2) for size in spatial]
        arguments["num_groups"] = groups
        arguments["eps"] = draw(st.sampled_from(EPS))
        arguments["affine"] = draw(st.sampled_from([True, True, False]))
        arguments["parameter_dtype"] = draw(st.sampled_from(["same", "same", "float32", "float64"]))
    dtype = draw(st.sampled_from(DTYPES))
    shape = (batch, channels, *spatial)[:rank] if rank > 1 else (batch,)
    return Call(op, shape, dtype, _layouts(draw), _layouts(draw), draw(st.integers(0, 2**31 - 1)), arguments)


# ---- tensors ------------------------------------------------------------------------------------


def _random(shape, dtype, generator):
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.randint(-3, 4, shape, generator=generator, dtype=dtype)
    values = torch.randn(shape, generator=generator, dtype=torch.float64)
    if dtype.is_complex:
        values = torch.complex(values, torch.randn(shape, generator=generator, dtype=torch.float64))
    return values.to(dtype)


def _base_shape(shape, layout):
    """The shape of the tensor a ``layout`` view of ``shape`` is taken from."""
    if layout == "transposed" and len(shape) >= 2:
        return (*shape[:-2], shape[-1], shape[-2])
    if layout == "strided" and shape:
        return (*shape[:-1], 2 * shape[-1])
    return shape


def _view(base, layout):
    """``base`` seen in ``layout``: a transposed or strided view, or a channels_last copy."""
    if layout == "transposed" and base.dim() >= 2:
        return base.transpose(-1, -2)
    if layout == "strided" and base.dim() >= 1:
        return base[..., ::2]
    if layout == "channels_last" and base.dim() in (4, 5):
        return base.contiguous(memory_format=torch.channels_last if base.dim() == 4 else torch.channels_last_3d)
    return base


def _inputs(call):
    """``(leaf, x, weight, bias)``: the input ``x``, a view of ``leaf`` (which requires grad when
    its dtype allows), and the GroupNorm's parameters (None for the other ops, or no affine)."""
    generator = torch.Generator().manual_seed(call.seed)
    leaf = _random(_base_shape(call.shape, call.layout), call.dtype, generator)
    if call.layout == "channels_last":
        leaf = _view(leaf, call.layout)
    leaf.requires_grad_(call.dtype.is_floating_point or call.dtype.is_complex)
    x = _view(leaf, call.layout) if call.layout in ("transposed", "strided") else leaf
    weight = bias = None
    if call.op == "group_norm" and call.arguments["affine"]:
        kind = call.arguments["parameter_dtype"]
        dtype = {"same": call.dtype, "float32": torch.float32, "float64": torch.float64}[kind]
        weight = (1 + 0.3 * _random((call.shape[1],), torch.float64, generator)).to(dtype)
        bias = (0.3 * _random((call.shape[1],), torch.float64, generator)).to(dtype)
        for parameter in (weight, bias):
            parameter.requires_grad_(dtype.is_floating_point)
    return leaf, x, weight, bias


def _grad_output(output, call):
    generator = torch.Generator().manual_seed(call.seed + 1)
    return _view(_random(_base_shape(tuple(output.shape), call.grad_layout), output.dtype, generator), call.grad_layout)


# ---- what a call does ---------------------------------------------------------------------------


class Raised(NamedTuple):
    type: type
    message: str


class Gave(NamedTuple):
    tensors: tuple  # the output, then the gradients of the leaves that require grad


def outcome(call, make, backend=None, tangent_like_output=False):
    """What the program ``make(x, weight, bias) -> (function, parameters)`` does on the call's
    inputs, ``function`` compiled with ``backend`` when one is given: :class:`Gave` the output of
    ``function(x)`` and the gradients of the input and ``parameters``, or :class:`Raised` what was
    raised first. ``tangent_like_output``: the gradient fed to the backward has the output's
    layout (as a compiled graph receives it) rather than the call's ``grad_layout``."""
    leaf, x, weight, bias = _inputs(call)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PyTorch's own warnings are not what is checked here
            function, parameters = make(x, weight, bias)
            if backend is not None:
                function = torch.compile(function, backend=backend, dynamic=False)
            output = function(x)
            leaves = [t for t in (leaf, *parameters) if t is not None and t.requires_grad]
            if not (leaves and output.requires_grad):
                return Gave((output.detach(),))
            grad_output = _grad_output(output, call)
            if tangent_like_output:
                grad_output = torch.empty_like(output).copy_(grad_output)
            grads = torch.autograd.grad(output, leaves, grad_output, allow_unused=True)
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return Raised(type(error), str(error)[:300])
    return Gave((output.detach(), *grads))


def _layout(tensor):
    """The strides of the axes that hold more than one value (the others' strides carry no layout)."""
    return tuple(stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 1)


def _wide(tensor):
    return tensor.detach().to(torch.complex128 if tensor.is_complex() else torch.float64)


def difference(actual, expected, tolerance):
    """How ``actual`` differs from plain PyTorch's ``expected``, or None when it does not."""
    if isinstance(expected, Raised) or isinstance(actual, Raised):
        if isinstance(actual, Raised) and isinstance(expected, Raised) and actual.type is expected.type:
            return None
        if isinstance(expected, Raised):
            return f"PyTorch raises {expected.type.__name__} ({expected.message}); fastbwd: {actual}"
        return f"PyTorch runs; fastbwd raises {actual.type.__name__}: {actual.message}"
    if len(actual.tensors) != len(expected.tensors):
        return f"{len(actual.tensors)} tensors where PyTorch gives {len(expected.tensors)}"
    for index, (a, e) in enumerate(zip(actual.tensors, expected.tensors)):
        what = "the output" if index == 0 else f"gradient {index}"
        if a is None or e is None:
            if (a is None) != (e is None):
                return f"{what}: {'no gradient' if a is None else 'a gradient'} where PyTorch has the other"
            continue
        if a.shape != e.shape or a.dtype != e.dtype:
            return f"{what}: {a.dtype}{list(a.shape)} where PyTorch has {e.dtype}{list(e.shape)}"
        if a.numel() and _layout(a) != _layout(e):
            return f"{what}: strides {a.stride()} where PyTorch has {e.stride()}"
        a, e = _wide(a), _wide(e)
        if not (torch.equal(a.isnan(), e.isnan()) and torch.equal(a.isinf(), e.isinf())):
            return f"{what}: NaN or infinity where PyTorch has none (or the other way round)"
        if not torch.equal(a[a.isinf()], e[e.isinf()]):
            return f"{what}: infinities of another sign than PyTorch's"
        finite = a.isfinite()
        if finite.any():
            error, scale = (a[finite] - e[finite]).abs().max().item(), e[finite].abs().max().item()
            if error > tolerance * (1 + scale):
                return f"{what}: differs from PyTorch's by {error:.3g} (largest value {scale:.3g})"
    return None


# ---- the programs: plain PyTorch's, and what fastbwd puts in their place --------------------------


def _routed(call):
    """The call of interpolate, avg-pool or pad (routed while fastbwd is enabled)."""
    arguments = dict(call.arguments)
    if call.op == "interpolate":
        return lambda x: F.interpolate(x, mode="bilinear", **arguments)
    if call.op == "avg_pool":
        return lambda x: F.avg_pool2d(x, **arguments)
    return lambda x: F.pad(x, arguments["pad"], mode="replicate")


class Block(nn.Module):
    """A norm and a SiLU in a forward() (not an nn.Sequential, so the fusion arms a FusedGroupNorm)."""

    def __init__(self, norm):
        super().__init__()
        self.norm, self.activation = norm, nn.SiLU()

    def forward(self, x):
        return self.activation(self.norm(x))


def _norm(cls, call, weight, bias):
    """``cls`` (nn.GroupNorm or GroupNormSwish) of the call's settings, holding its parameters."""
    arguments = call.arguments
    norm = cls(arguments["num_groups"], call.shape[1], arguments["eps"], affine=arguments["affine"])
    if arguments["affine"]:
        norm.weight = nn.Parameter(weight.detach(), weight.requires_grad)
        norm.bias = nn.Parameter(bias.detach(), bias.requires_grad)
    return norm


def _module(cls, call, wrap=lambda norm: norm):
    """A program running ``wrap(norm)``, ``norm`` a ``cls`` of the call's settings."""

    def make(x, weight, bias):
        norm = _norm(cls, call, weight, bias)
        return wrap(norm), (norm.weight, norm.bias)

    return make


def _function(function):
    """A program calling ``function(x, weight, bias)``."""
    return lambda x, weight, bias: ((lambda x: function(x, weight, bias)), (weight, bias))


def _fused(call, example):
    """``fuse_group_norm_swish`` on a Block: with the call's input as the example, or deciding
    at run time (a first call under no_grad observes, the next runs as decided)."""

    def make(x, weight, bias):
        block, parameters = _module(nn.GroupNorm, call, Block)(x, weight, bias)
        ft.fuse_group_norm_swish(block, (x.detach(),) if example else None)
        if example:
            return block, parameters

        def run(x):
            with torch.no_grad():
                block(x)
            return block(x)

        return run, parameters

    return make


def group_norm_programs(call):
    """``{name: (fastbwd's program, plain PyTorch's program)}`` of a GroupNorm + SiLU call."""
    groups, eps = call.arguments["num_groups"], call.arguments["eps"]
    functional = _function(lambda x, weight, bias: F.silu(F.group_norm(x, groups, weight, bias, eps)))
    modules = _module(nn.GroupNorm, call, Block)
    return {
        "group_norm_swish": (_function(lambda x, w, b: ft.group_norm_swish(x, groups, w, b, eps)), functional),
        "GroupNormSwish": (_module(ft.GroupNormSwish, call), modules),
        "fused, example inputs": (_fused(call, True), modules),
        "fused, deciding at run time": (_fused(call, False), modules),
        "F.group_norm + F.silu": (functional, functional),
        "nn.GroupNorm + nn.SiLU": (modules, modules),
    }


def programs(call):
    """``{name: (fastbwd's program, plain PyTorch's program)}`` of the call."""
    if call.op == "group_norm":
        return group_norm_programs(call)
    routed = _function(lambda x, weight, bias: _routed(call)(x))
    return {"routed": (routed, routed)}


# ---- the policies ---------------------------------------------------------------------------------

#: name -> (policy, thresholds over the defaults): each check runs under one of them.
POLICIES = {
    "always": ("always", {}),
    "auto": ("auto", {}),
    "auto, fastbwd at every size": ("auto", {key: 0 for key in _dispatch.DEFAULTS if key.startswith("torch/")}),
}


def enabled_under(policy):
    """``ft.enable()`` under ``policy`` (a :data:`POLICIES` name) until :func:`disabled`."""
    name, thresholds = POLICIES[policy]
    stack = contextlib.ExitStack()
    stack.enter_context(_dispatch.using(thresholds))
    stack.callback(ft.set_policy, ft.policy())  # enable(policy=) sets the process's: the next tests' back
    ft.enable(policy=name)
    _ACTIVE.append(stack)


def disabled():
    ft.disable()
    while _ACTIVE:
        _ACTIVE.pop().close()


_ACTIVE = []


# ---- eager ------------------------------------------------------------------------------------------

HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
#: The programs compiled: the plain spellings (fastbwd's hooks and passes rewrite them) and the drop-in.
COMPILED = ("routed", "F.group_norm + F.silu", "nn.GroupNorm + nn.SiLU", "GroupNormSwish")


def check_eager(call, policy="always"):
    """Every eager program with fastbwd enabled under ``policy`` against plain PyTorch's
    (fastbwd disabled)."""
    tolerance = TOLERANCE[call.dtype]
    try:
        for name, (program, plain) in programs(call).items():
            disabled()
            expected = outcome(call, plain)
            enabled_under(policy)
            found = difference(outcome(call, program), expected, tolerance)
            assert found is None, f"{policy}, {name}: {found}\n{call}"
    finally:
        disabled()
    CHECKED[f"eager, {policy}"] += 1


def check_compiled(call, name, backend, policy="always"):
    """fastbwd enabled under ``policy`` before the first compiled call, against plain PyTorch,
    eager and compiled (the compiler may raise a type of its own, or, decomposing an operator,
    run a call eager PyTorch refuses)."""
    program, plain = programs(call)[name]
    try:
        disabled()
        eager = outcome(call, plain)
        torch._dynamo.reset()
        compiled_plain = outcome(call, plain, backend)
        torch._dynamo.reset()
        enabled_under(policy)
        actual = outcome(call, program, backend)
    finally:
        disabled()
        torch._dynamo.reset()
    refused = [outcome.type for outcome in (eager, compiled_plain) if isinstance(outcome, Raised)]
    if isinstance(actual, Raised) and actual.type in refused:
        found = None  # PyTorch refuses the call (eagerly, or compiled): fastbwd raises its type
    else:  # PyTorch's values: eager's, or compiled PyTorch's where only eager refuses the call
        found = difference(actual, eager if isinstance(eager, Gave) else compiled_plain, TOLERANCE[call.dtype])
        if found is not None and isinstance(eager, Gave):
            # A compiled graph receives the gradient in the forward output's layout (AOTAutograd
            # coerces tangents), so the user's own gradient layout is gone before any operator
            # runs: PyTorch's result for that gradient, or compiled PyTorch's own, is PyTorch's too.
            coerced = outcome(call, plain, tangent_like_output=True)
            candidates = [coerced] + ([compiled_plain] if isinstance(compiled_plain, Gave) else [])
            if any(difference(actual, other, TOLERANCE[call.dtype]) is None for other in candidates):
                found = None
    assert found is None, f"{backend}, {policy}, {name}: {found}\n{call}"
    CHECKED[f"{backend}, {policy}"] += 1


@st.composite
def compiled_calls(draw):
    call = draw(calls())
    return call, draw(st.sampled_from([name for name in COMPILED if name in programs(call)]))


def run(kind, examples, strategy, check, derandomize=True):
    """``check`` on ``examples`` drawn configurations (``derandomize``: the same ones every run);
    prints how many were checked (``pytest -s``)."""

    @settings(
        max_examples=int(examples * SCALE),
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=HEALTH,
    )
    @given(strategy)
    def each(drawn):
        check(drawn)

    before = CHECKED[kind]
    each()
    checked = CHECKED[kind] - before
    print(f"\nnever breaks, {kind}: {checked} configurations, 0 findings")
    assert checked >= int(examples * SCALE)


# The quick set's examples per policy; the slow set draws the rest of each policy's total afresh.
EAGER_EXAMPLES = {"always": (60, 2000), "auto": (30, 1900), "auto, fastbwd at every size": (60, 2000)}
COMPILED_EXAMPLES = {"always": (5, 170), "auto": (0, 150), "auto, fastbwd at every size": (5, 170)}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_eager_paths_give_pytorchs_results_and_errors(policy):
    run(f"eager, {policy}", EAGER_EXAMPLES[policy][0], calls(), lambda call: check_eager(call, policy))


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(POLICIES))
def test_eager_paths_more_examples(policy):
    quick, total = EAGER_EXAMPLES[policy]
    run(f"eager, {policy}", total - quick, calls(), lambda call: check_eager(call, policy), derandomize=False)


@pytest.mark.parametrize("policy", ["always", "auto, fastbwd at every size"])
def test_compiled_with_fastbwd_gives_pytorchs_results_and_errors(policy):
    examples = COMPILED_EXAMPLES[policy][0]
    run(f"aot_eager, {policy}", examples, compiled_calls(), lambda drawn: check_compiled(*drawn, "aot_eager", policy))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_compiled_more_examples(backend, policy):
    quick, total = COMPILED_EXAMPLES[policy]
    examples = total - quick if backend == "aot_eager" else 30
    run(
        f"{backend}, {policy}",
        examples,
        compiled_calls(),
        lambda drawn: check_compiled(*drawn, backend, policy),
        derandomize=False,
    )


#: Configurations the random draws found once (kept: each is checked every run).
FOUND = [
    # an empty complex bilinear upsample, compiled: PyTorch's trace refuses it (autograd of the
    # decomposition's round); fastbwd's Python-dispatcher kernel once let it through to the backend
    (
        Call(
            "interpolate",
            (0, 1, 1, 1),
            torch.complex64,
            "contiguous",
            "contiguous",
            0,
            {"scale_factor": 0.5, "recompute_scale_factor": None, "align_corners": None, "antialias": False},
        ),
        "routed",
        "aot_eager",
    ),
]


@pytest.mark.parametrize("policy", ["always", "auto, fastbwd at every size"])
@pytest.mark.parametrize(("call", "name", "backend"), FOUND)
def test_found_configurations(call, name, backend, policy):
    check_compiled(call, name, backend, policy)
