"""fastbwd.torch.fuse_group_norm_swish's mechanism (docs/semantics.md §7, docs/design.md
"Fusion"): nn.Sequential pairs, FusedGroupNorm's lazy output (what reads its metadata, what
runs fused, what gets nn.GroupNorm's exact result, what never computes silently), how a
GroupNorm is armed (one example forward, or its own first calls), the run-time safety nets,
the report, and every path that must stay plain nn.GroupNorm (compile, tracing, scripting,
autocast, functorch, fake tensors, forward AD). Models written as libraries write them:
tests/test_fuse_real_models.py."""

import copy
import io
import pickle
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fastbwd.torch as ft  # noqa: E402
from fastbwd.kernels import group_norm_swish as gns_kernels  # noqa: E402
from fastbwd.torch import _fuse  # noqa: E402

from conftest import pytorch_deprecation  # noqa: E402


def _randn(*shape, dtype=torch.float32, seed=0, memory_format=torch.contiguous_format):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).contiguous(memory_format=memory_format)
    )


class Counter:
    """Counts F.group_norm calls and fastbwd's fused forward kernel runs."""

    def __init__(self, monkeypatch):
        self.group_norm = self.fused = 0
        group_norm, run_forward = F.group_norm, gns_kernels.ForwardPlan.run

        def counted_group_norm(*args, **kwargs):
            self.group_norm += 1
            return group_norm(*args, **kwargs)

        def counted_run_forward(*args, **kwargs):
            self.fused += 1
            return run_forward(*args, **kwargs)

        monkeypatch.setattr(F, "group_norm", counted_group_norm)
        monkeypatch.setattr(gns_kernels.ForwardPlan, "run", counted_run_forward)

    def __call__(self):
        return self.group_norm, self.fused


class Block(nn.Module):
    """norm -> act -> conv, the activation a module attribute."""

    def __init__(self, channels=4, groups=2, act=None):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        self.act = act if act is not None else nn.SiLU()
        self.conv = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        return self.conv(self.act(self.norm(x)))


def armed(channels=4, groups=2, seed=0, dtype=torch.float32):
    """A fused GroupNorm (armed from an example forward) and a plain copy of it."""
    torch.manual_seed(seed)
    block = Block(channels, groups).to(dtype)
    with torch.no_grad():
        block.norm.weight.normal_()
        block.norm.bias.normal_()
    plain = copy.deepcopy(block.norm)
    report = ft.fuse_group_norm_swish(block, (_randn(2, channels, 3, 3, dtype=dtype),))
    assert report == 1 and type(block.norm) is ft.FusedGroupNorm and block.norm.fusion_state == "fused"
    return block.norm, plain


# ---- nn.Sequential ---------------------------------------------------------------------------


def test_sequential_pairs_become_group_norm_swish_with_the_same_parameters():
    class ScaledSiLU(nn.SiLU):
        def forward(self, x):
            return F.silu(x) * 2

    model = nn.Sequential(
        nn.GroupNorm(2, 4),
        nn.SiLU(),
        nn.GroupNorm(2, 4),
        ScaledSiLU(),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.GroupNorm(1, 4),
    )
    reference = copy.deepcopy(model)
    parameters = list(model.parameters())
    keys = list(model.state_dict())
    report = ft.fuse_group_norm_swish(model, (_randn(2, 4, 3, 3),))
    assert type(model[0]) is ft.GroupNormSwish and type(model[1]) is nn.Identity
    assert [type(m) for m in model[2:]] == [nn.GroupNorm, ScaledSiLU, nn.GroupNorm, nn.ReLU, nn.GroupNorm]
    assert list(model.parameters()) == parameters and list(model.state_dict()) == keys
    assert [f.name for f in report.fused] == ["0"] and "followed by nn.SiLU" in report.fused[0].where
    reasons = dict(report.skipped)
    assert "ScaledSiLU, a subclass of nn.SiLU" in reasons["2"]
    assert "F.relu" in reasons["4"] and "returned from the model's forward unconsumed" in reasons["6"]
    x = _randn(2, 4, 3, 3)
    torch.testing.assert_close(model(x), reference(x))


def test_a_silu_module_shared_in_a_sequential_fuses_at_each_of_its_places():
    """One nn.SiLU object after two GroupNorms of a Sequential (named, as an OrderedDict builds
    it): both pairs fuse, the module order and names stay, and a failing example forward puts
    every slot back."""
    import collections

    act = nn.SiLU()
    layers = [("norm_in", nn.GroupNorm(2, 4)), ("act_in", act), ("conv", nn.Conv2d(4, 4, 1))]
    model = nn.Sequential(collections.OrderedDict(layers + [("norm_out", nn.GroupNorm(2, 4)), ("act_out", act)]))
    reference, x = copy.deepcopy(model), _randn(2, 4, 3, 3)
    report = ft.fuse_group_norm_swish(model, (x,))
    assert [f.name for f in report.fused] == ["norm_in", "norm_out"]
    assert [name for name, _ in model.named_children()] == ["norm_in", "act_in", "conv", "norm_out", "act_out"]
    assert [type(m) for m in model] == [ft.GroupNormSwish, nn.Identity, nn.Conv2d, ft.GroupNormSwish, nn.Identity]
    torch.testing.assert_close(model(x), reference(x))

    model = nn.Sequential(collections.OrderedDict(layers + [("norm_out", nn.GroupNorm(2, 4)), ("act_out", act)]))
    with pytest.raises(RuntimeError):
        ft.fuse_group_norm_swish(model, (_randn(2, 3, 3, 3),))  # 3 channels: the first GroupNorm refuses them
    assert [m for m in model] == [layers[0][1], act, layers[2][1], model.norm_out, act]


# ---- the lazy output -------------------------------------------------------------------------


def test_metadata_is_read_without_computing_and_silu_runs_fused(monkeypatch):
    norm, plain = armed()
    count = Counter(monkeypatch)
    x = _randn(2, 4, 3, 3).requires_grad_()
    h = norm(x)
    expected = plain(x)
    assert count() == (1, 0)  # only the plain one computed
    assert type(h) is _fuse._LazyGroupNorm and isinstance(h, torch.Tensor)
    assert h.shape == expected.shape and h.size() == expected.size() and h.size(1) == 4
    assert h.stride() == expected.stride() and h.dim() == h.ndim == 4 and len(h) == 2
    assert h.dtype == expected.dtype and h.device == expected.device and h.layout == torch.strided
    assert h.requires_grad and h.is_contiguous() and not h.is_contiguous(memory_format=torch.channels_last)
    assert h.numel() == h.nelement() == torch.numel(h) == 72 and h.element_size() == 4 and h.is_floating_point()
    branch = "big" if h.shape[0] >= 64 else "small"  # a branch on a shape, as real blocks take
    assert branch == "small" and hash(h) == hash(h) and count() == (1, 0)
    y = F.silu(h)
    assert count() == (1, 1)  # the fused kernel, no F.group_norm
    torch.testing.assert_close(y, F.silu(expected), rtol=1e-6, atol=1e-6)
    y.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    F.silu(plain(x)).sum().backward()
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "layout", ["contiguous", "channels_last", "channels_last_3d", "sliced", "nwc", "rank6", "channels_last_1x1"]
)
@pytest.mark.parametrize("grad", ["input", "parameters", "none", "no_grad"])
def test_lazy_metadata_is_nn_group_norms(layout, grad):
    shapes = {
        "contiguous": (2, 4, 3, 5),
        "channels_last": (2, 4, 3, 5),
        "channels_last_3d": (2, 4, 3, 5, 2),
        "sliced": (2, 4, 6, 5),
        "nwc": (2, 5, 4),
        "rank6": (2, 4, 2, 1, 3, 2),
        "channels_last_1x1": (3, 4, 1, 1),
    }
    x = _randn(*shapes[layout])
    x = {
        "channels_last": lambda: x.contiguous(memory_format=torch.channels_last),
        "channels_last_3d": lambda: x.contiguous(memory_format=torch.channels_last_3d),
        "sliced": lambda: x[:, :, ::2],
        "nwc": lambda: x.transpose(1, 2),
        "channels_last_1x1": lambda: x.contiguous(memory_format=torch.channels_last),
    }.get(layout, lambda: x)()
    norm, plain = armed()
    for module in (norm, plain):
        module.requires_grad_(grad == "parameters")
    x.requires_grad_(grad == "input")
    with torch.set_grad_enabled(grad != "no_grad"):
        h, expected = norm(x), plain(x)
        assert type(h) is _fuse._LazyGroupNorm
        for read in ("shape", "dtype", "device", "requires_grad", "stride", "is_contiguous"):
            value, reference = getattr(h, read), getattr(expected, read)
            if callable(value):
                value, reference = value(), reference()
            assert value == reference, read
        for memory_format in (torch.channels_last, torch.channels_last_3d):
            if x.dim() == {torch.channels_last: 4, torch.channels_last_3d: 5}[memory_format]:
                assert h.is_contiguous(memory_format=memory_format) == expected.is_contiguous(
                    memory_format=memory_format
                )
        y = F.silu(h)
        assert (y.shape, y.stride(), y.dtype, y.requires_grad) == (
            expected.shape,
            expected.stride(),
            expected.dtype,
            expected.requires_grad,
        )
        torch.testing.assert_close(y, F.silu(expected), rtol=1e-6, atol=1e-6)


def test_any_other_use_gets_nn_group_norms_exact_result_once(monkeypatch):
    norm, plain = armed()
    x = _randn(2, 4, 3, 3).requires_grad_()
    count = Counter(monkeypatch)
    h = norm(x)
    doubled = h * 2  # first use: not a SiLU
    assert count() == (1, 0)
    expected = plain(x)
    assert torch.equal(doubled, expected * 2)
    assert torch.equal(h + 1, expected + 1) and torch.equal(F.silu(h), F.silu(expected))  # the same result, reused
    assert count() == (2, 0) and norm.fusion_state == "fused"  # still armed: that call was simply exact
    grads = torch.autograd.grad((doubled + F.silu(h)).sum(), x)[0]
    reference = torch.autograd.grad((expected * 2 + F.silu(expected)).sum(), x)[0]
    assert torch.equal(grads, reference)


def test_common_operations_on_a_lazy_output(tmp_path):
    norm, plain = armed()
    x = _randn(2, 4, 3, 3)
    expected = plain(x).detach()
    with torch.no_grad():
        assert repr(norm(x)) == repr(expected) and str(norm(x)) == str(expected)
        assert (norm(x).numpy() == expected.numpy()).all()
        assert norm(x).tolist() == expected.tolist() and float(norm(x)[0, 0, 0, 0]) == float(expected[0, 0, 0, 0])
        assert torch.equal(torch.cat([norm(x), x]), torch.cat([expected, x]))
        assert torch.equal(torch.stack([norm(x), norm(x)]), torch.stack([expected, expected]))
        copied = copy.deepcopy(norm(x))
        assert type(copied) is torch.Tensor and torch.equal(copied, expected)
        torch.save(norm(x), tmp_path / "h.pt")
        loaded = torch.load(tmp_path / "h.pt")
        assert type(loaded) is torch.Tensor and torch.equal(loaded, expected)
        unpickled = pickle.loads(pickle.dumps(norm(x)))
        assert type(unpickled) is torch.Tensor and torch.equal(unpickled, expected)
        assert bool((norm(x) == expected).all()) and f"{norm(x).sum():.4f}" == f"{expected.sum():.4f}"
    # backward and hooks on the lazy output itself (it is returned unconsumed, say)
    xs = x.clone().requires_grad_()
    seen = []
    h = norm(xs)
    h.register_hook(lambda grad: seen.append(grad.shape))
    h.backward(torch.ones_like(x))
    reference = x.clone().requires_grad_()
    plain(reference).backward(torch.ones_like(x))
    assert torch.equal(xs.grad, reference.grad) and seen == [x.shape]
    with pytest.raises(RuntimeError, match="graph leaves"):  # as for nn.GroupNorm's output
        copy.deepcopy(norm(xs))
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(plain(xs))


def test_nothing_computes_below_torch_function():
    """An operation that reached the lazy output's __torch_dispatch__ would have to compute
    without knowing its use: it raises, naming the problem."""
    norm, plain = armed()
    x = _randn(2, 4, 3, 3)
    h = norm(x)
    with torch._C.DisableTorchFunctionSubclass(), pytest.raises(RuntimeError, match="below __torch_function__"):
        h + 1
    torch.testing.assert_close(F.silu(h), F.silu(plain(x)), rtol=1e-6, atol=1e-6)  # still usable above it


@pytest.mark.parametrize("spelling", ["F.silu inplace", "nn.SiLU(inplace=True)", "torch._C._nn.silu_"])
def test_in_place_silu_runs_fused_and_later_uses_see_its_output(spelling, monkeypatch):
    norm, plain = armed()
    x = _randn(2, 4, 3, 3)
    count = Counter(monkeypatch)
    h = norm(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no disarm warning: the tensor holds the SiLU's output now
        y = {
            "F.silu inplace": lambda: F.silu(h, inplace=True),
            "nn.SiLU(inplace=True)": lambda: nn.SiLU(inplace=True)(h),
            "torch._C._nn.silu_": lambda: torch._C._nn.silu_(h),
        }[spelling]()
        assert count() == (0, 1)
        assert torch.equal(h + 0, y) and norm.fusion_state == "fused"
    torch.testing.assert_close(y, F.silu(plain(x)), rtol=1e-6, atol=1e-6)


def test_an_in_place_silu_ends_what_is_observed():
    """After ``nn.SiLU(inplace=True)`` the tensor holds the SiLU's output: its later uses are not
    uses of the GroupNorm's output."""

    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(2, 4)
            self.act = nn.SiLU(inplace=True)
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            h = self.norm(x)
            self.act(h)
            return self.conv(h) + h

    model = InPlace()
    reference = copy.deepcopy(model)
    x = _randn(2, 4, 3, 3)
    report = ft.fuse_group_norm_swish(model, (x,))
    assert [f.name for f in report.fused] == ["norm"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(model(x), reference(x), rtol=1e-6, atol=1e-6)


def test_the_c_spelling_of_silu_runs_fused(monkeypatch):
    norm, plain = armed()
    count = Counter(monkeypatch)
    y = torch._C._nn.silu(norm(_randn(2, 4, 3, 3)))
    assert count() == (0, 1)
    torch.testing.assert_close(y, F.silu(plain(_randn(2, 4, 3, 3))), rtol=1e-6, atol=1e-6)


def test_a_use_after_the_silu_warns_once_gets_the_exact_value_and_disarms(monkeypatch):
    norm, plain = armed()
    x = _randn(2, 4, 3, 3)
    count = Counter(monkeypatch)
    h = norm(x)
    y = F.silu(h)
    with pytest.warns(UserWarning, match="'norm' was used again after its SiLU"):
        again = h * 3
    assert torch.equal(again, plain(x) * 3) and count() == (2, 1)
    torch.testing.assert_close(y, F.silu(plain(x)), rtol=1e-6, atol=1e-6)
    assert norm.fusion_state == "skipped" and "used again after its SiLU" in norm.fusion_reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z = F.silu(norm(x))  # plain nn.GroupNorm from now on: no lazy output, no warning
    assert type(z) is torch.Tensor and torch.equal(z, F.silu(plain(x)))
    assert "not fused (its output was used again" in repr(norm)


def test_an_input_modified_before_the_output_is_used_is_refused():
    norm, _ = armed()
    x = _randn(2, 4, 3, 3)
    h = norm(x)
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified in place between its call and the first use"):
        F.silu(h)


def test_grad_and_inference_modes_are_those_of_the_calls():
    norm, plain = armed()
    x = _randn(2, 4, 3, 3).requires_grad_()
    with torch.no_grad():
        h = norm(x)
    assert not h.requires_grad and not F.silu(h).requires_grad  # made under no_grad
    h = norm(x)
    with torch.no_grad():
        assert not F.silu(h).requires_grad
    with torch.no_grad():
        h = norm(x)
    assert not (h * 1).requires_grad  # materialised as made: under no_grad
    with torch.inference_mode():
        h = norm(x)
        y = F.silu(h)
        assert not y.requires_grad
    torch.testing.assert_close(y, F.silu(plain(x)).detach(), rtol=1e-6, atol=1e-6)
    with torch.inference_mode():
        h = norm(x)
        expected = plain(x)
    assert h.is_inference() and expected.is_inference()  # materialised as made: in inference mode
    assert torch.equal(h + 0, expected + 0)


def test_a_silu_subclass_is_not_a_silu_at_run_time(monkeypatch):
    class LeakySiLU(nn.SiLU):
        def forward(self, x):
            return F.silu(x) + 0.1 * x

    norm, plain = armed()
    count = Counter(monkeypatch)
    x = _randn(2, 4, 3, 3)
    y = LeakySiLU()(norm(x))
    assert count() == (1, 0) and torch.equal(y, LeakySiLU()(plain(x)))


# ---- paths that stay nn.GroupNorm --------------------------------------------------------------


def _fused_block():
    block = Block()
    reference = copy.deepcopy(block)
    ft.fuse_group_norm_swish(block, (_randn(2, 4, 3, 3),))
    assert block.norm.fusion_state == "fused"
    return block, reference


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # nn.GroupNorm's own checks, traced
def test_fx_tracing_scripting_and_jit_tracing_see_nn_group_norm():
    block, reference = _fused_block()
    x = _randn(2, 4, 3, 3)
    graph = torch.fx.symbolic_trace(block)
    assert F.group_norm in [node.target for node in graph.graph.nodes]
    assert torch.equal(graph(x), reference(x))
    with pytorch_deprecation("torch.jit.script"):  # deprecated: PyTorch's warning where it gives one
        scripted = torch.jit.script(block)
    assert torch.equal(scripted(x), reference(x))
    with pytorch_deprecation("torch.jit.trace"):
        traced = torch.jit.trace(block, x)
    assert torch.equal(traced(x), reference(x))
    assert "aten::group_norm" in str(traced.inlined_graph) and "fastbwd::" not in str(traced.inlined_graph)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_sees_nn_group_norm(backend):
    block, reference = _fused_block()
    x = _randn(2, 4, 3, 3)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), reference(x), rtol=1e-6, atol=1e-6)
    assert type(compiled(x)) is torch.Tensor


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_with_fastbwd_enabled_the_compilers_pass_fuses_the_pair(backend):
    """Compiled, a FusedGroupNorm is nn.GroupNorm, so the compiler's own GroupNorm -> SiLU pass
    (fastbwd enabled) fuses the pair in the captured graph: the eager fused results (bitwise
    where the same kernels run: aot_eager)."""
    from fastbwd.torch import _routing

    block, _ = _fused_block()
    x = _randn(2, 4, 3, 3).requires_grad_()
    grad = _randn(2, 4, 3, 3, seed=1)
    parameters = (x, block.norm.weight, block.norm.bias)
    try:
        ft.enable()
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=backend, fullgraph=True)
        before = _routing.GRAPH_CALLS.copy()
        output = compiled(x)
        actual = (output, *torch.autograd.grad(output, parameters, grad))
        calls = {name: count for name, count in (_routing.GRAPH_CALLS - before).items() if count}
        output = block(x)
        expected = (output, *torch.autograd.grad(output, parameters, grad))
    finally:
        ft.disable()
        torch._dynamo.reset()
    assert calls == {"group_norm_swish": 1, "group_norm_swish_backward": 1}
    for a, e in zip(actual, expected):
        if backend == "aot_eager":
            assert torch.equal(a, e)
        else:  # Inductor generates the conv's bias and its gradient's sums: its own rounding
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


# forward AD's first use loads PyTorch's own decompositions, which call the deprecated torch.jit.script
# (2.13 warns with a DeprecationWarning, 2.14 with a FutureWarning): PyTorch's code, not ours
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_autocast_functorch_fake_tensors_and_forward_ad_see_nn_group_norm(monkeypatch):
    block, reference = _fused_block()
    x = _randn(2, 4, 3, 3)
    count = Counter(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(block(x), reference(x))
    batch = torch.stack([x, -x])
    assert torch.equal(torch.vmap(block)(batch), torch.vmap(reference)(batch))
    assert torch.equal(torch.func.grad(lambda t: block(t).sum())(x), torch.func.grad(lambda t: reference(t).sum())(x))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        assert block(mode.from_tensor(x)).shape == x.shape
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        tangent = fwAD.unpack_dual(block(dual)).tangent
        assert torch.equal(tangent, fwAD.unpack_dual(reference(dual)).tangent)
    assert count()[1] == 0  # none of them ran the fused kernel


# ---- deciding: one example forward -----------------------------------------------------------


class Reasons(nn.Module):
    """One GroupNorm per way of not being a pair, and one pair."""

    def __init__(self):
        super().__init__()
        self.pair = nn.GroupNorm(2, 4)
        self.before_mul = nn.GroupNorm(2, 4)
        self.twice = nn.GroupNorm(2, 4)
        self.returned = nn.GroupNorm(2, 4)
        self.unused = nn.GroupNorm(2, 4)
        self.never_called = nn.GroupNorm(2, 4)
        self.kept = nn.GroupNorm(2, 4)
        self.relu = nn.GroupNorm(2, 4)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.SiLU()

    def forward(self, x):
        a = self.act(self.pair(x))
        b = self.act(self.before_mul(x) * 2)
        t = self.twice(x)
        c = F.silu(t) + t
        self.unused(x)
        self.last = self.kept(x)
        d = F.silu(self.last)
        e = torch.relu(self.relu(x))
        return self.bn(a + b + c + d + e + torch.randn_like(x)), self.returned(x)


def test_example_forward_arms_the_pairs_and_says_why_not_the_others():
    model = Reasons()
    rng = torch.random.get_rng_state()
    bn_state = {k: v.clone() for k, v in model.bn.state_dict().items()}
    report = ft.fuse_group_norm_swish(model, (_randn(2, 4, 3, 3),))
    assert torch.equal(torch.random.get_rng_state(), rng)  # forked
    for key, value in model.bn.state_dict().items():
        assert torch.equal(value, bn_state[key]), key  # running statistics and counter put back
    assert [f.name for f in report.fused] == ["pair"] and report.fused[0].where == "nn.SiLU act"
    reasons = dict(report.skipped)
    assert list(reasons) == ["before_mul", "twice", "returned", "unused", "never_called", "kept", "relu"]
    assert reasons["before_mul"] == "its output goes to Tensor.mul in (the model) (Reasons.forward) before any SiLU"
    assert reasons["twice"].startswith("its output is used 2 times (F.silu in (the model) (Reasons.forward); ")
    assert reasons["returned"] == "its output is returned from the model's forward unconsumed"
    assert reasons["unused"] == "its output is not used"
    assert reasons["never_called"] == "not called in the example forward"
    assert reasons["kept"].startswith("its output is still referenced after the call")
    assert reasons["relu"].startswith("its output goes to torch.relu")
    assert type(model.pair) is ft.FusedGroupNorm
    assert all(type(getattr(model, name)) is nn.GroupNorm for name in reasons)  # plain again
    assert report == 1 and int(report) == report.count == 1 and bool(report)
    assert "fused 1 GroupNorm + SiLU pair(s), skipped 7 GroupNorm(s)" in str(report)
    assert "pending" not in str(report) and report.pending == ()


def test_a_failing_example_forward_leaves_the_model_as_it_was():
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = nn.Sequential(nn.GroupNorm(2, 4), nn.SiLU())
            self.norm = nn.GroupNorm(2, 4)

        def forward(self, x, flag):
            F.silu(self.norm(x))
            raise ValueError(f"bad flag {flag}")

    model = Fails()
    norm, seq = model.norm, list(model.seq)
    with pytest.raises(ValueError, match="bad flag 3"):
        ft.fuse_group_norm_swish(model, (_randn(2, 4, 3, 3),), {"flag": 3})
    assert type(model.norm) is nn.GroupNorm and model.norm is norm and list(model.seq) == seq


def test_subclasses_shared_norms_hooks_and_refused_settings():
    class MyNorm(nn.GroupNorm):
        pass

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(2, 4)
            self.alias = self.norm  # registered twice: both names reach one module
            self.mine = MyNorm(2, 4)
            self.negative = nn.GroupNorm(2, 4, eps=-1e-3)
            self.wide = nn.GroupNorm(1, 4001)

        def forward(self, x):
            a = F.silu(self.norm(x)) + F.silu(self.alias(x))
            b = F.silu(self.mine(x)) + F.silu(self.negative(x))
            return a + b, F.silu(self.wide(torch.zeros(1, 4001, 2)))

    model = Model()
    calls = []
    model.norm.register_forward_hook(lambda module, args, output: calls.append(type(output).__name__))
    report = ft.fuse_group_norm_swish(model, (_randn(2, 4, 3, 3),))
    assert [f.name for f in report.fused] == ["norm"] and model.alias is model.norm
    assert type(model.norm) is ft.FusedGroupNorm and calls == ["_LazyGroupNorm", "_LazyGroupNorm"]  # hook kept
    reasons = dict(report.skipped)
    assert "subclass of nn.GroupNorm (" in reasons["mine"] and "MyNorm" in reasons["mine"]
    assert "eps=-0.001" in reasons["negative"] and "4001 channels per group" in reasons["wide"]
    assert set(reasons) == {"mine", "negative", "wide"}


def test_calls_the_kernel_does_not_take_are_reported():
    model = Block()
    report = ft.fuse_group_norm_swish(model, (torch.zeros(0, 4, 3, 3),))
    assert dict(report.skipped)["norm"] == "its input is empty"
    model = Block().to("meta")
    report = ft.fuse_group_norm_swish(model, (torch.zeros(2, 4, 3, 3, device="meta"),))
    assert dict(report.skipped)["norm"] == "its input is on meta, not the CPU"
    model = Block()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = ft.fuse_group_norm_swish(model, (_randn(2, 4, 3, 3),))
    assert "not plain eager CPU calls" in dict(report.skipped)["norm"]


def _same_error(module, reference, input):
    """``module(input)`` raises what ``reference(input)`` raises: type and message."""
    with pytest.raises(Exception) as expected:
        reference(input)
    with pytest.raises(expected.type) as raised:
        module(input)
    assert str(raised.value) == str(expected.value)


def test_an_armed_norm_is_nn_group_norm_for_calls_it_cannot_fuse(monkeypatch):
    norm, plain = armed()
    count = Counter(monkeypatch)
    empty = torch.zeros(0, 4, 3, 3)
    assert type(norm(empty)) is torch.Tensor and torch.equal(norm(empty), plain(empty))
    for bad in (_randn(2, 4, 3, 3, dtype=torch.float64), _randn(2, 3, 3, 3), _randn(2, 6, 3), _randn(4)):
        _same_error(norm, plain, bad)
    assert count()[1] == 0
    mixed = _randn(2, 4, 3, 3).to(torch.bfloat16)  # bfloat16 input, float32 parameters: fused
    torch.testing.assert_close(F.silu(norm(mixed)), F.silu(plain(mixed)), rtol=0.02, atol=0.02)
    assert count()[1] == 1


# ---- deciding: at the first calls -------------------------------------------------------------


def test_without_example_inputs_the_first_call_observes_and_the_next_decides(monkeypatch):
    model = Reasons()
    reference = copy.deepcopy(model)
    report = ft.fuse_group_norm_swish(model)
    names = ["pair", "before_mul", "twice", "returned", "unused", "never_called", "kept", "relu"]
    assert report == 0 and report.pending == tuple(names) and "8 pending" in str(report)
    assert all(type(getattr(model, name)) is ft.FusedGroupNorm for name in names)
    assert "fusion pending" in repr(model.pair)
    x = _randn(2, 4, 3, 3)
    count = Counter(monkeypatch)
    torch.manual_seed(0)
    first, returned = model(x)  # `returned`, the returned GroupNorm's output, stays referenced
    torch.manual_seed(0)
    expected, _ = reference(x)
    assert torch.equal(first, expected) and count()[1] == 0  # observing: nn.GroupNorm's results
    model(x)
    assert count()[1] == 1 and model.pair.fusion_state == "fused"  # decided at the second call
    reasons = dict(report.skipped)  # live: the report reads the modules
    assert [f.name for f in report.fused] == ["pair"]
    assert report.pending == ("never_called",)
    by_example = dict(ft.fuse_group_norm_swish(Reasons(), (x,)).skipped)
    for name in ("before_mul", "twice", "unused", "relu"):
        assert reasons[name] == by_example[name]
    assert reasons["kept"].startswith("its output is still referenced")
    assert reasons["returned"].startswith("its output is still referenced")  # kept by the caller
    assert all(type(getattr(model, name)) is ft.FusedGroupNorm for name in names)  # plain behaviour, inspectable


def test_a_live_report_decides_as_soon_as_it_is_read():
    model = Block()
    report = ft.fuse_group_norm_swish(model)
    model(_randn(2, 4, 3, 3))
    assert report.pending == () and report == 1 and model.norm.fusion_state == "fused"


def test_calling_again_re_decides_and_reports_every_group_norm():
    model = nn.Sequential(Block(), nn.GroupNorm(2, 4), nn.SiLU(), nn.GroupNorm(2, 4))
    x = _randn(2, 4, 3, 3)
    first = ft.fuse_group_norm_swish(model, (x,))
    second = ft.fuse_group_norm_swish(model, (x,))
    assert first == 2 and second == 2
    assert [f.name for f in second.fused] == ["0.norm", "1"]
    assert second.fused[1].where.startswith("already a GroupNormSwish")
    assert [s.name for s in second.skipped] == ["3"]
    live = ft.fuse_group_norm_swish(model)
    assert live.pending == ("0.norm", "3") and live == 1


# ---- the fused model as an object -----------------------------------------------------------


def test_fused_modules_pickle_deepcopy_load_state_dicts_and_print(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    keys = list(model.state_dict())
    ft.fuse_group_norm_swish(model, (_randn(2, 4, 3, 3),))
    assert list(model.state_dict()) == keys
    x = _randn(2, 4, 3, 3)
    expected = model(x)
    for twin in (
        copy.deepcopy(model),
        pickle.loads(pickle.dumps(model)),
        torch.load(_saved(model, tmp_path / "model.pt"), weights_only=False),
    ):
        assert type(twin[0].norm) is ft.FusedGroupNorm and twin[0].norm.fusion_state == "fused"
        assert twin[0].norm.weight is not model[0].norm.weight
        assert torch.equal(twin(x), expected)
    # checkpoints load either way
    fresh = nn.Sequential(Block(), Block())
    fresh.load_state_dict(model.state_dict())
    model.load_state_dict(reference.state_dict())
    torch.testing.assert_close(fresh(x), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-6, atol=1e-6)
    # an optimizer built before fusing still steps the module's parameters
    model(x).sum().backward()
    before = model[0].norm.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(model[0].norm.weight, before)
    text = repr(model)
    assert text.count("FusedGroupNorm(2, 4, eps=1e-05, affine=True") == 2
    assert "fused: runs as fastbwd's GroupNorm+Swish with the SiLU applied to its output" in text


def test_a_pending_module_pickles_as_pending():
    model = Block()
    ft.fuse_group_norm_swish(model)
    model(_randn(2, 4, 3, 3))  # observing now
    twin = pickle.loads(pickle.dumps(model))
    assert twin.norm.fusion_state == "pending" and twin.norm._fusion_records == []
    twin(_randn(2, 4, 3, 3))
    twin(_randn(2, 4, 3, 3))
    assert twin.norm.fusion_state == "fused"


def _saved(model, path):
    torch.save(model, path)
    return path


def test_report_interface():
    report = _fuse.FusionReport([_fuse.Fused("a", "x")], [_fuse.Skipped("b", "y")])
    assert report == 1 and report != 2 and int(report) == 1 and report.count == 1 and report
    assert report == _fuse.FusionReport([_fuse.Fused("a", "x")], [_fuse.Skipped("b", "y")])
    assert report.fused == (_fuse.Fused("a", "x"),) and report.skipped == (_fuse.Skipped("b", "y"),)
    assert not _fuse.FusionReport([], []) and [0, 1][report] == 1
    assert "fused   a: x" in str(report) and "skipped b: y" in str(report) and "Fused(name='a'" in repr(report)
    with pytest.raises(TypeError):
        hash(report)


def test_an_io_buffer_round_trip_of_a_fused_model():
    model = Block()
    ft.fuse_group_norm_swish(model, (_randn(2, 4, 3, 3),))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(_randn(2, 4, 3, 3)), model(_randn(2, 4, 3, 3)))
