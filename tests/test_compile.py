"""fastbwd inside torch.compile (docs/semantics.md §7, "torch.compile"): with fastbwd enabled
before a model's first compiled call, compiled graphs run the routed backward operators and
GroupNorm -> SiLU pairs on fastbwd's kernels, with fake strides equal to the real ones."""

import contextlib
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
nn = torch.nn

import fastbwd.torch as ft  # noqa: E402
from fastbwd import _dispatch  # noqa: E402
from fastbwd.torch import _compile, _private, _routing, _switch  # noqa: E402

from conftest import run_program  # noqa: E402

BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]


@pytest.fixture(autouse=True)
def _fresh_compiler():
    ft.disable()
    torch._dynamo.reset()
    yield
    ft.disable()
    torch._dynamo.reset()


def _randn(shape, seed, dtype=torch.float32, memory_format=torch.contiguous_format):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    return values.contiguous(memory_format=memory_format)


def _counts(counter, before):
    return {name: count for name, count in (counter - before).items() if count}


def _gradients(function, inputs, grad_output):
    inputs = [t.detach().requires_grad_() for t in inputs]
    output = function(*inputs)
    return (output.detach(), *torch.autograd.grad(output, inputs, grad_output))


# ---- the routed backward operators inside compiled graphs -----------------------------------------

ROUTED = {
    "upsample": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), "upsample_bilinear2d_backward"),
    "upsample-size-aligned": (
        lambda x: F.interpolate(x, size=(13, 7), mode="bilinear", align_corners=True),
        "upsample_bilinear2d_backward",
    ),
    "upsample-module": (nn.Upsample(scale_factor=(1.5, 2.25), mode="bilinear"), "upsample_bilinear2d_backward"),
    "avg-pool": (lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False), "avg_pool2d_backward"),
    "avg-pool-ceil-divisor": (
        lambda x: F.avg_pool2d(x, (3, 2), (2, 1), (1, 0), ceil_mode=True, divisor_override=5),
        "avg_pool2d_backward",
    ),
    "avg-pool-module": (nn.AvgPool2d(2), "avg_pool2d_backward"),
    "pad": (lambda x: F.pad(x, (3, 1, 2, 0), mode="replicate"), "replication_pad2d_backward"),
    "pad-module": (nn.ReplicationPad2d(1), "replication_pad2d_backward"),
}


@pytest.mark.covering(strength=1)  # each case compiles a graph of its own
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(ROUTED))
def test_compiled_backward_runs_fastbwd_with_eager_fastbwds_bits(case, dtype, memory_format, backend):
    function, operator = ROUTED[case]
    x = _randn((2, 5, 11, 9), 1, dtype, memory_format)
    grad_output = _randn(function(x).shape, 2, dtype, memory_format)
    ft.enable()
    eager = _gradients(function, [x], grad_output)
    graph_calls, served = _routing.GRAPH_CALLS.copy(), _routing.SERVED.copy()
    compiled = _gradients(torch.compile(function, backend=backend, fullgraph=True), [x], grad_output)
    assert _counts(_routing.GRAPH_CALLS, graph_calls) == {operator: 1}  # a node of the compiled graph
    assert _counts(_routing.SERVED, served) == {operator: 1}  # ... whose kernel was fastbwd's
    # the gradient is the same kernel on the same grad_output: bitwise eager fastbwd's, same strides
    assert torch.equal(compiled[1], eager[1]) and compiled[1].stride() == eager[1].stride()
    torch.testing.assert_close(compiled[0], eager[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_compiled_roi_align_has_eagers_bits_and_layout(memory_format, backend):
    """fastbwd.torch.roi_align compiled (fullgraph): its operators in the graph, the pooled values
    and the input gradient bitwise eager's, channels_last kept (Inductor plans the buffers by the
    fakes' strides, and checks them)."""
    x = _randn((2, 16, 10, 12), 61, memory_format=memory_format)
    rois = torch.tensor([[0, 1.0, 1.0, 8.0, 7.0], [1, 0.0, 2.0, 9.0, 9.0], [0, 3.0, 0.5, 11.0, 6.0]])
    grad_output = _randn((3, 16, 3, 4), 62, memory_format=memory_format)

    def pool(t):
        return ft.roi_align(t, rois, (3, 4), 1.0, 2, True)

    want = _gradients(pool, [x], grad_output)
    got = _gradients(torch.compile(pool, backend=backend, fullgraph=True), [x], grad_output)
    for g, w in zip(got, want):
        assert torch.equal(g, w) and g.stride() == w.stride()
    assert got[1].is_contiguous(memory_format=memory_format)


@pytest.mark.parametrize(
    "upsample",
    [
        lambda x: torch.ops.aten.upsample_bilinear2d.default(x, [4, 6], False, None, None),
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
    ],
    ids=["default", "vec"],
)
def test_a_complex_upsample_traced_without_dynamo_raises_pytorchs_error(upsample):
    """A complex bilinear upsample that wants a gradient, traced by AOTAutograd alone (no Dynamo
    fake run refuses it first), through either overload's autograd kernel: fastbwd's hands it to
    PyTorch's own, so the trace raises PyTorch's error (its decomposition's round has no complex
    autograd), never a graph with fastbwd's gradient."""
    from functorch.compile import aot_function, nop

    x = _randn((1, 2, 2, 3), 63).to(torch.complex64).requires_grad_()
    with pytest.raises(RuntimeError, match="round does not support automatic differentiation") as plain:
        aot_function(upsample, nop)(x)
    with ft.enabled(policy="always"):
        with pytest.raises(RuntimeError) as ours:
            aot_function(upsample, nop)(x)
    assert str(ours.value) == str(plain.value)


def _traced_forward(function, x):
    """The call_function targets of ``function``'s forward graph as AOTAutograd traces it."""
    from functorch.compile import aot_function

    graphs = []

    def capture(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm

    aot_function(function, capture)(x)
    return graphs[0]


@pytest.mark.parametrize("call", ["no-gradient-wanted", "under-no-grad", "declined"])
def test_an_upsample_whose_gradient_fastbwd_does_not_take_is_traced_as_pytorchs(call):
    """A bilinear upsample (``.vec``) whose gradient fastbwd does not take (its input wants none,
    gradients off, the decision declines it) is traced by PyTorch's own Python kernel: the graph
    plain PyTorch traces (its decomposition), not the aten call fastbwd's kernel makes for the
    calls it takes."""
    x = _randn((1, 2, 3, 4), 64).requires_grad_(call != "no-gradient-wanted")
    upsample = lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")  # noqa: E731
    context = torch.no_grad if call == "under-no-grad" else contextlib.nullcontext
    with context():
        plain = _traced_forward(upsample, x)
    declined = {f"torch/compiled/upsample_bilinear2d/{t}": 10**12 for t in {1, 2, torch.get_num_threads()}}
    with _dispatch.using(declined if call == "declined" else {}):
        with ft.enabled(policy="auto" if call == "declined" else "always"), context():
            assert _compile.is_installed()
            ours = _traced_forward(upsample, x)
    assert ours == plain


def test_the_upsample_vec_kernel_keeps_calls_where_pytorch_had_no_python_kernel():
    """Where PyTorch has no Python kernel of its own at a ``.vec`` key (a release without one),
    fastbwd's kernel has none to hand a call to: it keeps even a call whose gradient fastbwd does
    not take, as the C++ composite kernel has it (the aten call), and never calls a missing one."""
    overload = torch.ops.aten.upsample_bilinear2d.vec
    x = _randn((1, 2, 3, 4), 65)  # wants no gradient: handed over where PyTorch's kernel exists
    upsample = lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")  # noqa: E731
    with ft.enabled(policy="always"):
        saved = dict(_compile._installed)
        try:
            for key in ("Autograd", "CompositeImplicitAutograd"):
                _compile._installed[overload, key] = None
            graph = _traced_forward(upsample, x)
        finally:
            _compile._installed.update(saved)
    assert "aten.upsample_bilinear2d.default" in graph


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_shapes_compile_once_and_run_fastbwd_for_every_shape(backend):
    def model(x):
        y = F.interpolate(x, scale_factor=2, mode="bilinear")
        return F.avg_pool2d(F.pad(y, (1, 1, 1, 1), mode="replicate"), 3, 2, 1)

    ft.enable()
    frames = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=frames, fullgraph=True, dynamic=True)
    shapes = [(2, 3, 6, 5), (3, 4, 9, 7), (5, 2, 8, 13), (4, 6, 17, 10)]  # no size 1, no repeated sizes
    for index, shape in enumerate(shapes):
        x = _randn(shape, 10 + index)
        grad_output = _randn(model(x).shape, 20 + index)
        before = _routing.GRAPH_CALLS.copy()
        actual = _gradients(compiled, [x], grad_output)
        assert _counts(_routing.GRAPH_CALLS, before) == {name: 1 for name in _routing.ROUTES}
        assert torch.equal(actual[1], _gradients(model, [x], grad_output)[1])
    assert frames.frame_count == 1  # one graph for every shape: no recompile per shape


@pytest.mark.slow
def test_recompiles_are_no_more_than_plain_pytorchs():
    """Shapes that force PyTorch to specialise (a size 1, sizes equal then different) recompile as
    often with fastbwd as without it."""
    shapes = [(2, 3, 8, 8), (1, 3, 9, 7), (4, 3, 5, 5), (2, 3, 6, 11)]

    def frame_count(enabled):
        torch._dynamo.reset()
        (ft.enable if enabled else ft.disable)()
        frames = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), backend=frames)
        for shape in shapes:
            compiled(_randn(shape, 3).requires_grad_()).sum().backward()
        return frames.frame_count

    assert frame_count(True) == frame_count(False) <= len(shapes)


# ---- layouts that agree: fake strides are the real strides ----------------------------------------


def _graph_operator_samples():
    for memory_format in (torch.contiguous_format, torch.channels_last):
        x = _randn((2, 5, 7, 6), 4, memory_format=memory_format)
        up = _randn((2, 5, 14, 12), 5, memory_format=memory_format)
        pooled = _randn((2, 5, 4, 3), 6, memory_format=memory_format)
        padded = _randn((2, 5, 10, 9), 7, memory_format=memory_format)
        yield "upsample_bilinear2d_backward", (up, [14, 12], [2, 5, 7, 6], False, None, None)
        yield "upsample_bilinear2d_backward", (up, [14, 12], [2, 5, 7, 6], True, 2.0, 2.0)
        yield "avg_pool2d_backward", (pooled, x, [3, 3], [2, 2], [1, 1], False, True, None)
        yield "avg_pool2d_backward", (pooled, x, [2, 2], [2, 2], [0, 0], True, False, 3)
        yield "replication_pad2d_backward", (padded, x, [1, 2, 3, 0])
    # the mixed cases Inductor's layout optimisation produces: a grad and an input in different formats
    x, last = _randn((2, 5, 7, 6), 4), torch.channels_last
    padded, pooled = _randn((2, 5, 10, 9), 7, memory_format=last), _randn((2, 5, 4, 3), 6)
    yield "replication_pad2d_backward", (padded, x, [1, 2, 3, 0])
    yield "replication_pad2d_backward", (padded.contiguous(), x.contiguous(memory_format=last), [1, 2, 3, 0])
    yield "avg_pool2d_backward", (pooled, x.contiguous(memory_format=last), [3, 3], [2, 2], [1, 1], False, True, None)
    yield "avg_pool2d_backward", (pooled.contiguous(memory_format=last), x, [3, 3], [2, 2], [1, 1], False, True, None)


@pytest.mark.slow
@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_graph_operators_fake_kernels_match_the_real_ones(enabled):
    (ft.enable if enabled else ft.disable)()
    for name, arguments in _graph_operator_samples():
        operator = getattr(torch.ops.fastbwd, name).default
        torch.library.opcheck(operator, arguments)  # fake vs real shapes, dtypes and strides, schema, autograd
        real = operator(*arguments)
        # ... and the strides are those PyTorch's own kernel returns (grad_output's format for the
        # upsample, the forward input's for the pool and the pad)
        assert real.stride() == getattr(torch.ops.aten, name).default(*arguments).stride(), name
        with torch._subclasses.FakeTensorMode() as mode:
            fake = operator(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in arguments])
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype), name


@pytest.mark.slow
@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_fused_pair_operators_pass_opcheck(enabled):
    """The fused pairs' nodes (fastbwd::group_norm_swish with follows_switch) pass opcheck on
    contiguous and channels_last samples, with fastbwd's kernels (enabled) and PyTorch's
    (disabled, or a pair fastbwd's kernels refuse: 4001 channels in one group)."""
    (ft.enable if enabled else ft.disable)()
    for memory_format in (torch.contiguous_format, torch.channels_last):
        for shape, groups in (((2, 6, 5, 4), 3), ((1, 4001, 2, 1), 1)):
            x = _randn(shape, 40, memory_format=memory_format)
            weight, bias = _randn(shape[1:2], 41), _randn(shape[1:2], 42)
            torch.library.opcheck(
                torch.ops.fastbwd.group_norm_swish.default, (x, weight, bias, groups, 1e-5, 1.0, True)
            )
            _, mean, rstd = torch.ops.fastbwd.group_norm_swish(x, weight, bias, groups, 1e-5, 1.0, True)
            arguments = (_randn(shape, 43, memory_format=memory_format), x, mean, rstd, weight, bias, groups, 1.0)
            backward = torch.ops.fastbwd.group_norm_swish_backward.default
            torch.library.opcheck(backward, (*arguments, [True, True, True], 1e-5, True))
            torch.library.opcheck(backward, (*arguments, [True, False, True], 1e-5, True))


@pytest.mark.slow
def test_graph_operators_double_backward():
    """Each graph operator is linear in grad_output: its derivative there is the forward
    operator (gradcheck), and that derivative's own derivative too (gradgradcheck)."""
    ft.enable()
    for name, arguments in _graph_operator_samples():
        operator = getattr(torch.ops.fastbwd, name).default
        rest = [a.double() if isinstance(a, torch.Tensor) else a for a in arguments[1:]]

        def function(grad_output, operator=operator, rest=rest):
            return operator(grad_output, *rest)

        grad_output = arguments[0].double().requires_grad_()
        assert torch.autograd.gradcheck(function, (grad_output,))
        assert torch.autograd.gradgradcheck(function, (grad_output,))


@pytest.mark.slow
@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_fused_pair_operators_are_differentiable_twice(enabled):
    """A graph of the fused pair's backward (create_graph=True) is exact: its derivative is
    PyTorch's composite, and the backward operator's own derivative is §5's formula."""
    (ft.enable if enabled else ft.disable)()
    x = _randn((2, 6, 4, 4), 30, torch.float64).requires_grad_()
    weight = _randn((6,), 31, torch.float64).requires_grad_()
    bias = _randn((6,), 32, torch.float64).requires_grad_()

    def pair(x, weight, bias):
        return torch.ops.fastbwd.group_norm_swish(x, weight, bias, 3, 1e-5, 1.0, True)[0]

    assert torch.autograd.gradcheck(pair, (x, weight, bias))
    assert torch.autograd.gradgradcheck(pair, (x, weight, bias))
    _, mean, rstd = torch.ops.fastbwd.group_norm_swish(x, weight, bias, 3, 1e-5, 1.0, True)
    grad_output = _randn((2, 6, 4, 4), 33, torch.float64).requires_grad_()

    def backward(grad_output, x, weight, bias):
        mask = [True, True, True]
        return torch.ops.fastbwd.group_norm_swish_backward(
            grad_output, x, mean, rstd, weight, bias, 3, 1.0, mask, 1e-5, True
        )

    assert torch.autograd.gradcheck(backward, (grad_output, x, weight, bias))


def _decoder_block(channels):
    """The block plain Inductor cannot train (issue 36): conv, bilinear x2, replication pad, conv."""
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1),
        nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.ReplicationPad2d(1),
        nn.Conv2d(channels, channels, 3),
    )


def _train(model, forward, steps, x, target):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(forward(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_decoder_block_trains_under_compile_with_eagers_losses(backend):
    torch.manual_seed(0)
    model = _decoder_block(16)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    x, target = _randn((2, 16, 12, 12), 9), _randn((2, 16, 24, 24), 10)
    ft.enable()
    eager = _train(model, model, 3, x, target)
    model.load_state_dict(state)
    graph_calls = _routing.GRAPH_CALLS.copy()
    compiled = _train(model, torch.compile(model, backend=backend, fullgraph=True), 3, x, target)
    assert _counts(_routing.GRAPH_CALLS, graph_calls) == {
        "upsample_bilinear2d_backward": 3,
        "replication_pad2d_backward": 3,
    }
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert eager[-1] < eager[0]


# ---- GroupNorm -> SiLU pairs in the captured graph (Inductor) ------------------------------------


class _Block(nn.Module):
    """A block written as diffusion models write theirs: norm and a shared activation in
    forward(), *args/**kwargs, a branch on a shape; one pair is not a pair (scale/shift between)."""

    def __init__(self, channels):
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(4, channels), nn.GroupNorm(4, channels, affine=False)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.nonlinearity = nn.SiLU()

    def forward(self, x, scale=None, *args, **kwargs):
        h = self.nonlinearity(self.norm1(x))
        if h.shape[0] >= 64:
            h = h.contiguous()
        h = self.conv(h)
        if scale is not None:
            h = self.norm2(h) * (1 + scale)  # not a pair: the output goes through a product first
        else:
            h = F.silu(self.norm2(h))
        return self.nonlinearity(x) + h


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_norm_swish_pairs_fuse_in_a_compiled_block(backend):
    torch.manual_seed(1)
    block = _Block(8)
    with torch.no_grad():
        block.norm1.weight.normal_()
        block.norm1.bias.normal_()
    x, scale = _randn((2, 8, 6, 5), 11), _randn((2, 8, 1, 1), 13)
    grad_output = _randn((2, 8, 6, 5), 12)
    parameters = (block.norm1.weight, block.norm1.bias, block.conv.weight)
    ft.enable()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    for arguments, pairs in (((), 2), ((scale,), 1)):  # scale=: norm2's output is multiplied first
        before = _routing.GRAPH_CALLS.copy()
        output = compiled(x.requires_grad_(), *arguments)
        actual = (output, *torch.autograd.grad(output, (x, *parameters), grad_output))
        assert _counts(_routing.GRAPH_CALLS, before) == {"group_norm_swish": pairs, "group_norm_swish_backward": pairs}
        output = block(x, *arguments)
        expected = (output, *torch.autograd.grad(output, (x, *parameters), grad_output))
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_the_counters_old_keys_read_the_new_ones_with_a_deprecation_warning():
    """The fused pairs' counters are named after the operators (``group_norm_swish``); the keys
    they had before issue 55 read the same counts, with a DeprecationWarning, for one release."""
    calls = _routing.GRAPH_CALLS.copy()
    calls["group_norm_swish"] += 3
    calls["group_norm_swish_backward"] += 2
    for old, new in (
        ("group_norm_silu", "group_norm_swish"),
        ("group_norm_silu_backward", "group_norm_swish_backward"),
    ):
        with pytest.warns(DeprecationWarning, match=rf"GRAPH_CALLS\['{old}'\] is deprecated .* GRAPH_CALLS\['{new}'\]"):
            assert calls[old] == calls[new] > 0
        assert old not in calls  # a read, never a key of its own
    assert calls["anything else"] == 0


def _pair_programs():
    """name -> (program, pairs in it): a GroupNorm whose output feeds only a SiLU is a pair; one
    whose output is used twice, goes through another op first, or feeds a SiLU subclass is not."""

    class Tanh(nn.SiLU):  # a SiLU subclass that changes the activation
        def forward(self, input):
            return torch.tanh(input)

    def used_twice(x):
        h = F.group_norm(x, 2)
        return F.silu(h) * h

    norm, silu, tanh = nn.GroupNorm(2, 4), nn.SiLU(), Tanh()
    programs = {
        "pair": (lambda x: F.silu(norm(x)), 1),
        "inplace": (lambda x: F.silu(F.group_norm(x, 2), inplace=True), 1),
        "module": (lambda x: silu(torch.group_norm(x, 2, None, None, 1e-3)), 1),
        "separate calls": (lambda x: F.silu(norm(x)) + norm(x).sum() + F.silu(x) * F.group_norm(x, 2), 1),
        "op between": (lambda x: F.silu(norm(x) * 2), 0),
        "subclass": (lambda x: tanh(norm(x)), 0),
        "used twice": (used_twice, 0),
    }
    return programs


@pytest.mark.slow
def test_pre_grad_pass_fuses_only_pairs():
    """Inductor's pass, on the graphs Dynamo captures."""
    for name, (program, pairs) in _pair_programs().items():
        graphs = []

        def capture(gm, example_inputs, graphs=graphs):
            graphs.append((gm, example_inputs))
            return gm.forward

        torch._dynamo.reset()
        x = _randn((2, 4, 3, 3), 14)
        torch.compile(program, backend=capture, fullgraph=True)(x)
        ((gm, example_inputs),) = graphs
        assert _compile.fuse_group_norm_swish_pre_grad(gm.graph) == pairs, name
        gm.recompile()
        torch.testing.assert_close(gm(*example_inputs)[0], program(x), rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_graphs_fuse_only_pairs(backend):
    """Compiled with fastbwd: pairs run fused (the joint-graph pass under aot_eager, the pre-grad
    pass under Inductor), everything else as PyTorch; outputs and gradients as eager PyTorch's."""
    ft.enable()
    for name, (program, pairs) in _pair_programs().items():
        torch._dynamo.reset()
        x, grad_output = _randn((2, 4, 3, 3), 24), _randn((2, 4, 3, 3), 25)
        before = _routing.GRAPH_CALLS.copy()
        actual = _gradients(torch.compile(program, backend=backend, fullgraph=True), [x], grad_output)
        expected = {"group_norm_swish": pairs, "group_norm_swish_backward": pairs} if pairs else {}
        assert _counts(_routing.GRAPH_CALLS, before) == expected, name
        for a, e in zip(actual, _gradients(program, [x], grad_output)):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_pair_dtypes_layouts_and_parameters(backend):
    ft.enable()
    for dtype, parameters in (
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
    ):
        for memory_format in (torch.contiguous_format, torch.channels_last):
            torch._dynamo.reset()
            norm = nn.GroupNorm(3, 6, dtype=parameters)
            x = _randn((2, 6, 5, 4), 16, dtype, memory_format)
            grad_output = _randn((2, 6, 5, 4), 17, dtype, memory_format)
            before = _routing.GRAPH_CALLS.copy()
            compiled = torch.compile(lambda x, norm=norm: F.silu(norm(x)), backend=backend, fullgraph=True)
            actual = _gradients(compiled, [x], grad_output)
            assert _counts(_routing.GRAPH_CALLS, before) == {"group_norm_swish": 1, "group_norm_swish_backward": 1}
            expected = _gradients(lambda x, n=norm: ft.group_norm_swish(x, 3, n.weight, n.bias), [x], grad_output)
            for a, e in zip(actual, expected):
                assert a.dtype == e.dtype and a.stride() == e.stride()
                assert torch.equal(a, e), (dtype, memory_format)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_shapes_decide_at_run_time_what_fastbwd_takes(backend):
    """With dynamic shapes the channel count is not known when the pair is fused: the fused
    operator decides on the real tensors, so 8192 channels in one group (past the kernels' limit)
    run PyTorch's kernels inside the same graph instead of failing."""
    import torch._dynamo.testing

    ft.enable()
    frames = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(lambda x: F.silu(F.group_norm(x, 1)), backend=frames, dynamic=True)
    for index, shape in enumerate([(2, 8, 3, 5), (3, 8192, 2, 3), (2, 12, 5, 3)]):
        x, grad_output = _randn(shape, 70 + index), _randn(shape, 80 + index)
        before = _routing.GRAPH_CALLS.copy()
        actual = _gradients(compiled, [x], grad_output)
        assert _counts(_routing.GRAPH_CALLS, before) == {"group_norm_swish": 1, "group_norm_swish_backward": 1}
        for a, e in zip(actual, _gradients(lambda x: F.silu(F.group_norm(x, 1)), [x], grad_output)):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    assert frames.frame_count == 1
    norm = nn.GroupNorm(2, 6)  # affine: the parameters' size is known, the input's sizes are not
    compiled = torch.compile(lambda x: F.silu(norm(x)), backend=backend, dynamic=True)
    for index, shape in enumerate([(2, 6, 3, 5), (3, 6, 4, 2)]):
        x, before = _randn(shape, 90 + index), _routing.GRAPH_CALLS.copy()
        torch.testing.assert_close(compiled(x), F.silu(norm(x)), rtol=1e-4, atol=1e-5)
        assert _counts(_routing.GRAPH_CALLS, before) == {"group_norm_swish": 1}


# ---- the switch: graphs compiled while enabled follow it at run time -----------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_compiled_while_enabled_runs_pytorchs_kernels_after_disable(backend):
    def model(x):
        y = F.interpolate(x, scale_factor=2, mode="bilinear")
        return F.avg_pool2d(F.pad(y, (1, 1, 1, 1), mode="replicate"), 3, 2, 1)

    x = _randn((2, 3, 6, 5), 18)
    grad_output = _randn(model(x).shape, 19)
    ft.enable()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    enabled = _gradients(compiled, [x], grad_output)
    ft.disable()
    graph_calls, served = _routing.GRAPH_CALLS.copy(), _routing.SERVED.copy()
    disabled = _gradients(compiled, [x], grad_output)
    assert _counts(_routing.GRAPH_CALLS, graph_calls) == {name: 1 for name in _routing.ROUTES}
    assert not _counts(_routing.SERVED, served)  # the nodes ran PyTorch's own kernels
    eager = _gradients(model, [x], grad_output)  # disabled: PyTorch's kernels
    assert torch.equal(disabled[1], eager[1])
    torch.testing.assert_close(enabled[1], eager[1], rtol=2e-5, atol=1e-6)
    ft.enable()
    assert torch.equal(_gradients(compiled, [x], grad_output)[1], enabled[1])  # and back


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_pair_disabled_runs_pytorchs_kernels_bitwise(backend):
    norm = nn.GroupNorm(2, 4)
    x, grad_output = _randn((2, 4, 5, 5), 20), _randn((2, 4, 5, 5), 21)

    def gradients(function):
        input = x.detach().requires_grad_()
        output = function(input)
        return (output, *torch.autograd.grad(output, (input, norm.weight, norm.bias), grad_output))

    ft.enable()
    compiled = torch.compile(lambda x: F.silu(norm(x)), backend=backend, fullgraph=True)
    gradients(compiled)
    ft.disable()
    before = _routing.GRAPH_CALLS.copy()
    actual = gradients(compiled)
    assert _counts(_routing.GRAPH_CALLS, before) == {"group_norm_swish": 1, "group_norm_swish_backward": 1}
    expected = gradients(lambda x: F.silu(norm(x)))  # PyTorch's native_group_norm and silu, eagerly
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))


@pytest.mark.slow
def test_graph_compiled_while_disabled_keeps_pytorchs_code_and_enable_says_so_once(monkeypatch):
    """Dynamo does not guard on the switch: a frame compiled while disabled keeps PyTorch's code
    after enable(), which says so once per process (with what to do); torch.compiler.reset()
    then compiles it with fastbwd."""
    monkeypatch.setattr(_switch, "_noticed", False)

    def model(x):
        return F.interpolate(x, scale_factor=2, mode="bilinear")

    x = _randn((2, 3, 6, 5), 22).requires_grad_()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled(x).sum().backward()  # compiled while disabled: the upsample is decomposed, its backward a scatter
    with pytest.warns(UserWarning, match=r"compiled frames while fastbwd was disabled.*torch.compiler.reset\(\)"):
        ft.enable()
    before = _routing.GRAPH_CALLS.copy(), _routing.SERVED.copy()
    compiled(x).sum().backward()
    assert not _counts(_routing.GRAPH_CALLS, before[0]) and not _counts(_routing.SERVED, before[1])
    ft.disable()
    torch.compile(lambda x: x * 2, backend="aot_eager")(x)  # another frame compiled while disabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ft.enable()  # said once per process: silent now
    torch.compiler.reset()
    compiled(x).sum().backward()
    assert _counts(_routing.GRAPH_CALLS, before[0]) == {"upsample_bilinear2d_backward": 1}


@pytest.mark.slow
def test_enable_says_nothing_when_no_frame_was_compiled_while_disabled(monkeypatch):
    monkeypatch.setattr(_switch, "_noticed", False)
    x = _randn((2, 3, 6, 5), 22).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ft.enable()  # nothing compiled yet (the fixture reset Dynamo)
        torch.compile(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), backend="aot_eager")(x)
        ft.disable()
        ft.enable()  # the frame was compiled while enabled: its graph follows the switch
    torch.compiler.reset()
    ft.disable()
    torch.compile(lambda x: x * 3, backend="aot_eager")(x)
    torch.compiler.reset()  # ... and forgotten
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ft.enable()


def test_enable_and_disable_install_and_remove_the_hooks_keeping_users_passes():
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    calls = []

    def users_pass(graph):
        calls.append("pre-grad")

    def users_joint_pass(gm, inputs):
        calls.append("joint")
        return gm

    inductor_config.pre_grad_custom_pass = users_pass
    functorch_config.joint_custom_pass = users_joint_pass

    def python_kernel(key):
        overload, dispatch_key = key
        return overload.py_kernels.get(getattr(torch._C.DispatchKey, dispatch_key))

    try:
        kernels = {key: python_kernel(key) for key in _compile._KERNELS}
        ft.enable()
        assert _compile.is_installed()
        assert inductor_config.pre_grad_custom_pass[0] is users_pass
        assert all(python_kernel(key) is kernel for key, kernel in _compile._KERNELS.items())
        ft.enable()  # idempotent
        assert len(inductor_config.pre_grad_custom_pass) == 2
        norm = nn.GroupNorm(2, 4)
        before = _routing.GRAPH_CALLS.copy()
        torch.compile(lambda x: F.silu(norm(x)), backend="aot_eager")(_randn((2, 4, 3, 3), 26)).sum().backward()
        assert calls == ["joint"]  # the user's pass ran, and then fastbwd's
        assert _counts(_routing.GRAPH_CALLS, before) == {"group_norm_swish": 1, "group_norm_swish_backward": 1}
        ft.disable()
        assert not _compile.is_installed()
        assert inductor_config.pre_grad_custom_pass is users_pass
        assert functorch_config.joint_custom_pass is users_joint_pass
        assert {key: python_kernel(key) for key in _compile._KERNELS} == kernels
    finally:
        inductor_config.pre_grad_custom_pass = None
        functorch_config.joint_custom_pass = None


def test_hooks_left_in_the_config_after_disable_fuse_nothing():
    """Code that puts an old compiler config value back (monkeypatch's undo, a config.patch block
    opened while fastbwd was enabled) may leave fastbwd's hooks there after ``disable()``: a
    graph compiled then is PyTorch's (found by CI: such a hook made the private-interface test's
    plain compile use up its one warning). The test puts the config back itself: a pytest
    monkeypatch of a config entry deletes it on undo, which hides it from later tests."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    ft.enable()
    joint_pass, pre_grad_passes = functorch_config.joint_custom_pass, list(inductor_config.pre_grad_custom_pass)
    ft.disable()
    before = functorch_config.joint_custom_pass, inductor_config.pre_grad_custom_pass
    functorch_config.joint_custom_pass, inductor_config.pre_grad_custom_pass = joint_pass, pre_grad_passes

    def pre_grad_then_aot_eager(gm, example_inputs):  # Inductor's pre-grad passes, without its C++
        for graph_pass in inductor_config.pre_grad_custom_pass:
            graph_pass(gm.graph)
        gm.recompile()
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    x = _randn((2, 4, 3, 3), 27).requires_grad_()
    try:
        for backend in ("aot_eager", pre_grad_then_aot_eager):
            calls = _routing.GRAPH_CALLS.copy()
            torch.compiler.reset()
            torch.compile(nn.Sequential(nn.GroupNorm(2, 4), nn.SiLU()), backend=backend)(x).sum().backward()
            assert _counts(_routing.GRAPH_CALLS, calls) == {}, backend
    finally:
        functorch_config.joint_custom_pass, inductor_config.pre_grad_custom_pass = before
        torch.compiler.reset()


def test_the_pre_grad_pass_keys_inductors_caches_by_whether_it_fuses():
    """The pre-grad pass's uuid (Inductor's cache key) differs while the hooks are out (a pass
    left in the config fuses nothing): a graph compiled then, unfused, is never reused for one
    compiled with fastbwd on, nor the other way round; it is the same again once back on."""
    ft.enable()
    on = _compile._graph_pass().uuid()
    ft.disable()
    off = _compile._graph_pass().uuid()
    ft.enable()
    assert on != off and _compile._graph_pass().uuid() == on


def test_unknown_pytorch_warns_once_and_compiles_as_pytorch(monkeypatch):
    monkeypatch.setattr(_compile, "SUPPORTED_RANGE", ((1, 0), (1, 1)))
    monkeypatch.setattr(_private, "_found", {})
    monkeypatch.setattr(_private, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ft.enable()
        ft.disable()
        ft.enable()
    assert [str(w.message) for w in caught if "torch.compile keeps" in str(w.message)] == [
        next(str(w.message) for w in caught if "torch.compile keeps" in str(w.message))
    ]
    assert not _compile.is_installed()
    x = _randn((2, 3, 6, 5), 23).requires_grad_()
    before = _routing.SERVED.copy()
    torch.compile(lambda x: F.pad(x, (1, 1, 1, 1), mode="replicate"), backend="aot_eager")(x).sum().backward()
    assert _counts(_routing.SERVED, before) == {"replication_pad2d_backward": 1}  # eager routing still works


@pytest.mark.slow
def test_a_program_that_compiles_with_fastbwd_exits_by_itself(tmp_path):
    program = textwrap.dedent(
        """
        import torch, torch.nn as nn, torch.nn.functional as F
        import fastbwd.torch as ft

        ft.enable()
        model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(),
                              nn.Upsample(scale_factor=2, mode="bilinear"), nn.ReplicationPad2d(1),
                              nn.Conv2d(8, 4, 3), nn.AvgPool2d(2))
        compiled = torch.compile(model)
        compiled(torch.randn(2, 4, 8, 8)).square().mean().backward()
        print(dict(ft._routing.GRAPH_CALLS))
        """
    )
    result = run_program(program, tmp_path)
    assert result.returncode == 0, result.stderr
    calls = eval(result.stdout.strip().splitlines()[-1])  # noqa: S307 - our own program's output
    assert set(calls) == set(_routing.ROUTES) | {"group_norm_swish", "group_norm_swish_backward"}


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_unet_compiled_with_fastbwd_has_eagers_gradients(backend):
    """T7's UNet (bench/models/torch_unet.py: GroupNorm + SiLU in its blocks' forward(), avg-pool down,
    bilinear up, a time embedding). Plain Inductor in torch 2.13 gets these gradients wrong by up
    to half their size (its decomposed bilinear backward under layout optimisation,
    docs/history.md); with fastbwd enabled every pair fuses and every gradient is eager's."""
    from bench.models.torch_unet import SmallUNet

    torch.manual_seed(2)
    model = SmallUNet(3, (16, 32), 32, 8)
    x, temb, target = _randn((2, 3, 16, 16), 27), _randn((2, 32), 28), _randn((2, 3, 16, 16), 29)

    def gradients(forward):
        model.zero_grad()
        F.mse_loss(forward(x, temb), target).backward()
        return [p.grad.clone() for p in model.parameters()]

    ft.enable()
    expected = gradients(model)
    before = _routing.GRAPH_CALLS.copy()
    actual = gradients(torch.compile(model, backend=backend, fullgraph=True))
    pairs = sum(isinstance(m, nn.GroupNorm) for m in model.modules())
    assert _counts(_routing.GRAPH_CALLS, before) == {
        "group_norm_swish": pairs,
        "group_norm_swish_backward": pairs,
        "avg_pool2d_backward": 2,
        "upsample_bilinear2d_backward": 2,
    }
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)
