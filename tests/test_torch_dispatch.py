"""fastbwd.torch's decision (docs/semantics.md §7, "Never slower"): the policy and how it is set,
and every path (eager routing, the fusion, the drop-ins, the compiled graphs) taking fastbwd's
side from its threshold on and PyTorch's below it, with PyTorch's bits there; under "always",
fastbwd's as before."""

import contextlib
import inspect
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import fastbwd.torch as ft  # noqa: E402
from bench.sweep import torch_threads as _threads  # noqa: E402
from fastbwd import _dispatch  # noqa: E402
from fastbwd.torch import _compile, _functional, _fuse, _ops, _routing  # noqa: E402

from conftest import child_environment  # noqa: E402

F, nn = torch.nn.functional, torch.nn

#: The routed operations: (op, forward, its module).
ROUTED = {
    "upsample_bilinear2d": (
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
        nn.Upsample(scale_factor=2, mode="bilinear"),
    ),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 3, 2, 1), nn.AvgPool2d(3, 2, 1)),
    "replication_pad2d": (lambda x: F.pad(x, (2, 2, 1, 1), mode="replicate"), nn.ReplicationPad2d((2, 2, 1, 1))),
}
SHAPE = (2, 4, 6, 10)
ELEMENTS = 2 * 4 * 6 * 10


@contextlib.contextmanager
def auto(path, op, threshold):
    """fastbwd enabled under "auto", ``op`` on ``path`` from ``threshold`` elements on (every
    thread count), every other key at its default."""
    thresholds = {f"torch/{path}/{op}/{threads}": threshold for threads in (1, 2)}
    with _dispatch.using(thresholds), ft.enabled(policy="auto"):
        yield


def _input(shape=SHAPE, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).requires_grad_()


def _gradient(forward, x, seed=1):
    y = forward(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    return y, torch.autograd.grad(y, x, g)[0]


def _plain(forward, x):
    ft.disable()
    return _gradient(forward, x)


# ---- the policy --------------------------------------------------------------------------------


def test_the_tests_run_under_always_unless_told():
    assert ft.policy() == os.environ.get("FASTBWD_POLICY", "always")


def test_the_policy_is_set_by_set_policy_enable_and_enabled():
    before = ft.policy()
    try:
        ft.set_policy("auto")
        assert ft.policy() == "auto"
        with ft.enabled(policy="always"):
            assert ft.policy() == "always" and ft.is_enabled()
            with ft.enabled():  # keeps the policy it finds
                assert ft.policy() == "always"
        assert ft.policy() == "auto" and not ft.is_enabled()
        ft.enable(policy="always")
        assert ft.policy() == "always"
        ft.disable()
        assert ft.policy() == "always"  # disable() keeps it
        for bad in ("fast", None, 1):
            with pytest.raises(ValueError, match="policy must be one of 'auto', 'always'"):
                ft.set_policy(bad)
        with pytest.raises(ValueError):
            ft.enable(policy="sometimes")
        with pytest.raises(ValueError):
            with ft.enabled(policy="never"):
                pass
        assert ft.policy() == "always" and not ft.is_enabled()
    finally:
        ft.set_policy(before)
        ft.disable()


@pytest.mark.parametrize(
    "value, policy",
    [  # a process each: the default in the quick set (tests/test_dispatch.py reads the variable quick)
        pytest.param("auto", "auto", marks=pytest.mark.slow),
        pytest.param("always", "always", marks=pytest.mark.slow),
        (None, "auto"),
    ],
)
def test_fastbwd_policy_sets_the_policy_a_process_starts_with(value, policy):
    env = child_environment(without=["FASTBWD_POLICY"])
    if value is not None:
        env["FASTBWD_POLICY"] = value
    code = "import fastbwd.torch as ft; print(ft.policy())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == policy


# ---- eager routing -------------------------------------------------------------------------------


def _everything_served():
    return _dispatch.using({f"torch/routed/{op}/{t}": 0 for op in ROUTED for t in (1, 2)})


@pytest.mark.parametrize("op", list(ROUTED))
@pytest.mark.parametrize("module", [False, True])
def test_routing_takes_fastbwds_side_from_the_threshold_on(op, module):
    forward = ROUTED[op][1] if module else ROUTED[op][0]
    x = _input()
    name = f"{op}_backward"
    with auto("routed", op, ELEMENTS):  # at the threshold: fastbwd
        served = _routing.SERVED[name]
        y, ours = _gradient(forward, x)
        assert type(y.grad_fn).__name__ == "RoutedBackward"
        assert _routing.SERVED[name] == served + 1
    with ft.enabled(policy="always"):  # fastbwd's bits, as the aten kernels give them
        _, always = _gradient(forward, x)
    assert torch.equal(ours, always)
    with auto("routed", op, ELEMENTS + 1):  # one element short: PyTorch's own code, its bits
        served = _routing.SERVED[name]
        y, theirs = _gradient(forward, x)
        assert type(y.grad_fn).__name__ != "RoutedBackward"
        assert _routing.SERVED[name] == served
    _, plain = _plain(forward, x)
    assert torch.equal(theirs, plain)


def test_the_decision_takes_the_thread_count():
    forward = ROUTED["avg_pool2d"][0]
    x = _input()
    thresholds = {"torch/routed/avg_pool2d/1": ELEMENTS + 1, "torch/routed/avg_pool2d/2": ELEMENTS}
    with _dispatch.using(thresholds), ft.enabled(policy="auto"):
        with _threads(1):
            assert type(forward(x).grad_fn).__name__ != "RoutedBackward"
        with _threads(2):
            assert type(forward(x).grad_fn).__name__ == "RoutedBackward"


@pytest.mark.parametrize("path", ["routed", "fused", "dropin"])
def test_a_call_under_its_thread_counts_threshold_is_declined_by_its_size_alone(path, monkeypatch):
    """A call below the threshold of the thread count it runs on goes no further than one size
    comparison (a two-thread call between the one- and two-thread thresholds paid the whole
    decision: docs/history.md), whichever thread count's threshold is the larger."""
    decided = []
    if path == "routed":
        op, module, x = "avg_pool2d", ROUTED["avg_pool2d"][1], _input()
        elements, served = ELEMENTS, "RoutedBackward"
        real = _functional._bind
        monkeypatch.setattr(_functional, "_bind", lambda *args: decided.append(args) or real(*args))
    else:
        op, (plain, module), x = "group_norm_swish", _norm_modules(), _input(GN_SHAPE)
        elements, served = GN_ELEMENTS, "EagerGroupNormSwishBackward"
        if path == "fused":
            module = _Block(plain[0])
            with ft.enabled(policy="always"):
                assert ft.fuse_group_norm_swish(module, (x,)).count == 1
            real = _fuse.FusedGroupNorm._fused_forward
            monkeypatch.setattr(_fuse.FusedGroupNorm, "_fused_forward", lambda *a: decided.append(a) or real(*a))
        else:
            real = _ops.use_eager_path
            monkeypatch.setattr(_ops, "use_eager_path", lambda *args: decided.append(args) or real(*args))
    name = f"torch/{path}/{op}"
    for low, high in ((1, 2), (2, 1)):
        thresholds = {f"{name}/{low}": elements, f"{name}/{high}": elements + 1}
        with _dispatch.using(thresholds), ft.enabled(policy="auto"):
            with _threads(high):
                del decided[:]
                assert type(module(x).grad_fn).__name__ != served
                assert not decided
            with _threads(low):
                assert type(module(x).grad_fn).__name__ == served
                assert decided


@pytest.mark.parametrize("path", ["routed", "fused"])
def test_a_declined_call_reads_the_floor_its_bridge_holds(path, monkeypatch):
    """A call below the floor costs one dict read and a comparison: the bridge holds the floors'
    dict of its own operator (fastbwd._dispatch.floors_of), filled by the first call, and calls
    no function of fastbwd._dispatch after it."""
    with ft.enabled(policy="auto"):
        if path == "routed":
            for forward, _ in ROUTED.values():
                forward(_input())
            assert all(op in _dispatch.OPS for _, _, op in _dispatch.floors)  # the ops' own dicts
            for op in ROUTED:
                assert torch.get_num_threads() in _dispatch.floors_of("torch", "routed", op), op
        else:
            plain, _ = _norm_modules()
            block, x = _Block(plain[0]), _input(GN_SHAPE)
            with ft.enabled(policy="always"):
                assert ft.fuse_group_norm_swish(block, (x,)).count == 1
            block(x)  # declined, the floor filled
            calls = []
            real = _dispatch.floor
            monkeypatch.setattr(_dispatch, "floor", lambda *args: calls.append(args) or real(*args))
            assert type(block(x).grad_fn).__name__ == "SiluBackward0" and not calls


def test_every_path_decides_on_pytorchs_thread_count_when_numbas_pool_is_smaller():
    """With Numba's pool smaller than PyTorch's thread count (NUMBA_NUM_THREADS=1, PyTorch on
    two), the GroupNorm+Swish paths decide on PyTorch's count, as the routed calls and the size
    floors do: a call at the two-thread threshold (the one-thread one above it) is fastbwd's, and
    below it PyTorch's, even after the same call was fastbwd's on one thread."""
    code = """if True:
    import torch
    import fastbwd.torch as ft
    from fastbwd import _dispatch
    x = torch.randn(2, 16, 3, 5, requires_grad=True)
    key, norm = "torch/dropin/group_norm_swish", ft.GroupNormSwish(4, 16)
    with _dispatch.using({f"{key}/1": x.numel() + 1, f"{key}/2": x.numel()}), ft.enabled(policy="auto"):
        torch.set_num_threads(2)
        print(type(norm(x).grad_fn).__name__)
    # the other way round, the floor let through (a bfloat16 key): the geometry of the same
    # call on one thread does not decide for two
    x = torch.randn(2, 16, 3, 6, requires_grad=True)  # a geometry made first on one thread
    thresholds = {f"{key}/1": x.numel(), f"{key}/2": x.numel() + 1, f"{key}/2/bfloat16": 1}
    with _dispatch.using(thresholds), ft.enabled(policy="auto"):
        torch.set_num_threads(1)
        print(type(norm(x).grad_fn).__name__)
        torch.set_num_threads(2)
        print(type(norm(x).grad_fn).__name__)
"""
    env = child_environment(NUMBA_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["EagerGroupNormSwishBackward"] * 2 + ["SiluBackward0"]


@pytest.mark.parametrize(
    "forward",
    [
        lambda x: F.interpolate(x, size=(9, 13), mode="bilinear", align_corners=True),
        lambda x: F.interpolate(x, scale_factor=(1.5, 0.7), mode="bilinear"),
        lambda x: F.interpolate(x, scale_factor=1.7, mode="bilinear", recompute_scale_factor=True),
        lambda x: F.interpolate(input=x, scale_factor=2.5, mode="bilinear", align_corners=False),
        pytest.param(lambda x: F.upsample_bilinear(x, scale_factor=2), marks=pytest.mark.filterwarnings("ignore")),
        lambda x: F.avg_pool2d(x, (2, 3), (1, 2), (1, 1), True, False),
        lambda x: F.avg_pool2d(x, 3, stride=[], divisor_override=5),
        lambda x: F.avg_pool2d(x, kernel_size=2, padding=1, count_include_pad=False),
        lambda x: F.pad(x, [1, -1, 2, 0], "replicate"),
        lambda x: F.pad(input=x, pad=(1, 2, 1, 0), mode="replicate"),
        lambda x: F.pad(x, (1, 1, 0, 2), "replicate", None),
        lambda x: F.interpolate(x, None, 2.0, "bilinear", False, None, False),
        lambda x: F.pad(x.contiguous(memory_format=torch.channels_last), (1, 1, 1, 1), mode="replicate"),
        lambda x: F.interpolate(x.contiguous(memory_format=torch.channels_last), scale_factor=2, mode="bilinear"),
    ],
)
def test_a_routed_call_gives_what_the_aten_kernels_give(forward):
    """Served by the functional route ("auto"), every argument form PyTorch passes to its
    backward: bitwise the gradient of the aten route ("always"), in its layout."""
    x = _input(seed=3)
    with ft.enabled(policy="auto"), _everything_served():
        served = sum(_routing.SERVED.values())
        y, ours = _gradient(forward, x)
        assert type(y.grad_fn).__name__ == "RoutedBackward" and sum(_routing.SERVED.values()) == served + 1
    with ft.enabled(policy="always"):
        z, always = _gradient(forward, x)
    assert torch.equal(y, z) and torch.equal(ours, always) and ours.stride() == always.stride()


@pytest.mark.parametrize(
    "call",
    [
        lambda x: F.pad(x, (1, 1), mode="bogus"),
        lambda x: F.pad(x, (1, 1, 1), mode="replicate"),
        lambda x: F.pad(x, (30, 1, 1, 1), mode="replicate"),
        lambda x: F.interpolate(x, size=(4, 4), scale_factor=2.0, mode="bilinear"),
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", antialias=True),
        lambda x: F.interpolate(x, mode="bilinear"),
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=1),
        lambda x: F.avg_pool2d(x, 0),
        lambda x: F.avg_pool2d(x, 3, divisor_override=0),
        lambda x: F.avg_pool2d(x, 3, divisor_override=True),
        lambda x: F.avg_pool2d(x, 2.0),
        lambda x: F.avg_pool2d(x, 3, 2, 1, False, True, None, "extra"),
        lambda x: F.avg_pool2d(x, 3, 2, padding=1, bogus=1),
        # fastbwd's pad and interpolate take PyTorch's parameters: a wrong call's own message
        lambda x: F.pad(x, (1, 1), mode="replicate", bogus=1),
        lambda x: F.pad(x, (1, 1, 1, 1), "replicate", None, "extra"),
        lambda x: F.pad(x, pad=(1, 1, 1, 1), input=x, mode="replicate"),
        lambda x: F.pad(),
        lambda x: F.interpolate(x, None, 2.0, "bilinear", False, None, False, "extra"),
        lambda x: F.interpolate(input=x, scale_factor=2.0, mode="bilinear", bogus=1),
        # the last parameters reach PyTorch's function (antialias matters when downsampling)
        lambda x: F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True),
        lambda x: F.pad(x, (1, 1, 1, 1), "constant", 2.0),
        lambda x: F.pad(x, (1, 1, 1, 1), value=-3.0),
    ],
)
def test_the_functions_in_torch_nn_functional_behave_as_pytorchs(call):
    """Whatever fastbwd's functions decide, a call gives PyTorch's result or PyTorch's error."""
    x = _input(shape=(2, 3, 8, 8))

    def outcome():
        try:
            return _gradient(call, x)[1]
        except Exception as error:  # noqa: BLE001 - the type and message are compared
            return type(error), str(error)

    expected = _plain_outcome(call, x)
    with ft.enabled(policy="auto"), _everything_served():
        actual = outcome()
    if isinstance(expected, tuple):
        assert actual == expected
    else:
        assert not isinstance(actual, tuple) and torch.allclose(actual, expected, atol=1e-6)


def _plain_outcome(call, x):
    ft.disable()
    try:
        return _gradient(call, x)[1]
    except Exception as error:  # noqa: BLE001
        return type(error), str(error)


def test_disable_and_always_put_pytorchs_functions_back():
    originals = {name: getattr(F, name) for name in ("interpolate", "avg_pool2d", "pad")}
    assert not _functional.installed()
    with ft.enabled(policy="auto"):
        made = {name: getattr(F, name) for name in originals}
        assert all(made[name] is not originals[name] for name in originals)
        assert all(made[name].__wrapped__ is originals[name] for name in originals)
        ft.set_policy("always")  # the aten kernels route: PyTorch's functions are back
        assert all(getattr(F, name) is originals[name] for name in originals)
        ft.set_policy("auto")
        assert all(getattr(F, name) is made[name] for name in originals)  # the same functions again
    assert all(getattr(F, name) is originals[name] for name in originals)
    assert not _functional.installed()


def test_a_function_the_user_puts_in_torch_nn_functional_stays_theirs():
    """fastbwd's function wraps whatever the name holds at enable() (a user's own patch included,
    set after an earlier enable/disable), calls it for every call, and disable() leaves a function
    the user set while fastbwd was enabled."""
    original, calls = F.pad, []

    def users_pad(*args, **kwargs):
        calls.append(kwargs.get("mode", "constant"))
        return original(*args, **kwargs)

    def users_later(*args, **kwargs):
        return original(*args, **kwargs)

    try:
        with ft.enabled(policy="auto"):  # fastbwd makes its function for PyTorch's
            assert F.pad is not original
        assert F.pad is original
        F.pad = users_pad
        with ft.enabled(policy="auto"), _everything_served():
            assert F.pad is not users_pad and F.pad.__wrapped__ is users_pad
            x = _input()
            y, _ = _gradient(lambda x: F.pad(x, (2, 2, 1, 1), mode="replicate"), x)  # served
            assert type(y.grad_fn).__name__ == "RoutedBackward"
            F.pad(x, (1, 1, 1, 1))  # declined (constant mode)
            assert calls == ["replicate", "constant"]
            F.pad = users_later  # the user's, set while enabled
        assert F.pad is users_later
        assert not _functional.installed()
    finally:
        F.pad = original


def _own_parameters(function):
    """(name, kind, default) of each parameter of ``function`` itself (not of its __wrapped__)."""
    parameters = inspect.signature(function, follow_wrapped=False).parameters.values()
    return [(p.name, p.kind, p.default) for p in parameters]


def test_fastbwds_pad_and_interpolate_take_the_replaced_functions_own_parameters():
    """fastbwd's F.pad and F.interpolate are generated with PyTorch's parameters and defaults (a
    declined call is bound by name, not repacked); avg_pool2d, a builtin, takes *args, **kwargs."""
    originals = {name: getattr(F, name) for name in ("interpolate", "pad")}
    with ft.enabled(policy="auto"):
        for name, original in originals.items():
            made = getattr(F, name)
            assert made is not original and made.__wrapped__ is original
            assert _own_parameters(made) == _own_parameters(original)
            assert made.__defaults__ == original.__defaults__
        kinds = [kind for _, kind, _ in _own_parameters(F.avg_pool2d)]
        assert kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]


def _users_pad_keyword_only(original):
    def users_pad(input, pad, *, mode="constant", value=None):
        return original(input, pad, mode=mode, value=value)

    return users_pad


def _users_pad_named_as_fastbwds(original):
    def users_pad(input, pad, mode="constant", value=None, _fastbwd_replaced=None):
        return original(input, pad, mode, value)

    return users_pad


@pytest.mark.parametrize("users", [_users_pad_keyword_only, _users_pad_named_as_fastbwds])
def test_a_users_function_of_other_parameters_is_wrapped_generically(users):
    """A user's F.pad whose parameters a generated signature cannot take (keyword-only ones, a
    name of fastbwd's generated code) gets the ``*args, **kwargs`` function: calls, served and
    declined, behave as without fastbwd, and the user's own refusals stay theirs."""
    original = F.pad
    users_pad = users(original)
    x = _input()

    def forward(x):
        return F.pad(x, (2, 2, 1, 1), mode="replicate")

    try:
        F.pad = users_pad
        plain_y, plain_grad = _gradient(forward, x)
        with ft.enabled(policy="auto"), _everything_served():
            assert F.pad.__wrapped__ is users_pad
            y, grad = _gradient(forward, x)
            assert type(y.grad_fn).__name__ == "RoutedBackward"
            assert torch.equal(y, plain_y) and torch.allclose(grad, plain_grad, atol=1e-6)
            assert torch.equal(F.pad(x, (1, 1, 1, 1), value=2.0), original(x, (1, 1, 1, 1), value=2.0))
            if users is _users_pad_keyword_only:
                with pytest.raises(TypeError, match="positional"):
                    F.pad(x, (1, 1, 1, 1), "replicate")
    finally:
        F.pad = original
        ft.disable()


def test_fastbwds_function_held_after_disable_runs_pytorchs_code():
    """A reference to fastbwd's F.pad taken while enabled (a name bound then, a partial) and
    called after disable(), the policy still "auto", is PyTorch's: no Routed node, nothing
    served."""
    before = ft.policy()
    x = _input()

    def step(function):
        return _gradient(lambda x: function(x, (2, 2, 1, 1), mode="replicate"), x)[0]

    try:
        ft.set_policy("auto")
        with _everything_served():
            ft.enable()
            held = F.pad
            assert type(step(held).grad_fn).__name__ == "RoutedBackward"  # fastbwd's while enabled
            ft.disable()
            assert ft.policy() == "auto"
            served = sum(_routing.SERVED.values())
            assert type(step(held).grad_fn).__name__ != "RoutedBackward"
            assert sum(_routing.SERVED.values()) == served
    finally:
        ft.disable()
        ft.set_policy(before)


@pytest.mark.parametrize("name", ["no grad required", "no_grad", "inference_mode"])
def test_a_call_needing_no_gradient_is_declined_before_routing(name, monkeypatch):
    """A declined call costs a few reads: one whose input needs no gradient (or under no_grad or
    inference_mode) never reaches Routed, even where every size is fastbwd's."""
    entered, real = [], _functional.Routed.apply
    monkeypatch.setattr(_functional.Routed, "apply", lambda *args: entered.append(args) or real(*args))
    forward = ROUTED["avg_pool2d"][0]
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(name, contextlib.nullcontext)
    x = _input()
    with ft.enabled(policy="auto"), _everything_served():
        with context():
            y = forward(x.detach() if name == "no grad required" else x)
        assert not entered and y.grad_fn is None
        forward(x)  # the same call needing a gradient: routed
        assert len(entered) == 1


@pytest.mark.parametrize("op", list(ROUTED))
def test_cpu_autocast_takes_pytorchs_code(op):
    """Under CPU autocast a routed function's call is PyTorch's (the cast autocast registers on
    the operator runs): the same output and gradient as with fastbwd disabled."""
    forward = ROUTED[op][0]
    x = _input(dtype=torch.bfloat16)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _gradient(forward, x)

    with ft.enabled(policy="auto"), _everything_served():
        served = sum(_routing.SERVED.values())
        y, ours = step()
        assert type(y.grad_fn).__name__ != "RoutedBackward" and sum(_routing.SERVED.values()) == served
    ft.disable()
    z, plain = step()
    assert torch.equal(y, z) and torch.equal(ours, plain) and ours.dtype == plain.dtype


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning", "ignore:`torch.jit:FutureWarning")
def test_torchscript_fx_and_tracing_see_pytorchs_functions():
    x = torch.randn(2, 3, 8, 8)
    with ft.enabled(policy="auto"), _everything_served():
        for _, module in ROUTED.values():
            assert torch.equal(torch.jit.script(module)(x), module(x))
            traced = torch.fx.symbolic_trace(module)
            assert torch.equal(traced(x), module(x))

        def calls(x: torch.Tensor) -> torch.Tensor:
            y = F.interpolate(x, scale_factor=2.0, mode="bilinear")
            z = F.avg_pool2d(y, 2) + F.avg_pool2d(y, [2, 2], [2, 2], divisor_override=3)
            return F.pad(F.avg_pool2d(y, 3, 2, 1), (1, 1, 1, 1), mode="replicate") + z.sum()

        assert torch.equal(torch.jit.script(calls)(x), calls(x))
        traced = torch.jit.trace(calls, x.requires_grad_())
        y = traced(x)
        assert "Routed" not in type(y.grad_fn).__name__


def test_double_backward_and_gradcheck_of_a_routed_call():
    x = torch.randn((1, 2, 5, 6), dtype=torch.float64, requires_grad=True)
    with ft.enabled(policy="auto"), _everything_served():
        for forward, _ in ROUTED.values():
            assert type(forward(x).grad_fn).__name__ == "RoutedBackward"
            assert torch.autograd.gradcheck(forward, (x,))
            assert torch.autograd.gradgradcheck(forward, (x,))


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning", "ignore:`torch.jit:FutureWarning")
def test_forward_mode_and_transforms_take_pytorchs_code():
    x = torch.randn(SHAPE, requires_grad=True)
    forward = ROUTED["avg_pool2d"][0]
    with ft.enabled(policy="auto"), _everything_served():
        tangent = torch.ones(SHAPE)
        out, jvp = torch.func.jvp(forward, (x.detach(),), (tangent,))
        assert torch.allclose(out, forward(x.detach()))
        grad = torch.func.grad(lambda x: forward(x).sum())(x.detach())
        assert grad.shape == x.shape
        import torch.autograd.forward_ad as fwad

        with fwad.dual_level():
            dual = fwad.make_dual(x.detach().requires_grad_(), tangent)
            assert fwad.unpack_dual(forward(dual)).tangent is not None


# ---- GroupNorm + Swish: the drop-ins and the fusion -----------------------------------------------

GN_SHAPE = (2, 16, 3, 5)
GN_ELEMENTS = 2 * 16 * 3 * 5


def _norm_modules():
    plain = nn.Sequential(nn.GroupNorm(4, 16), nn.SiLU())
    with torch.no_grad():
        plain[0].weight.normal_(generator=torch.Generator().manual_seed(7))
        plain[0].bias.normal_(generator=torch.Generator().manual_seed(8))
    drop_in = ft.GroupNormSwish(4, 16)
    drop_in.load_state_dict(plain[0].state_dict())
    return plain, drop_in


def _grads(module, x):
    y = module(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
    return (y, *torch.autograd.grad(y, (x, *module.parameters()), g))


class _Block(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm, self.activation = norm, nn.SiLU()

    def forward(self, x):
        return self.activation(self.norm(x))


@pytest.mark.parametrize("spelling", ["module", "function"])
def test_the_drop_ins_take_fastbwds_side_from_the_threshold_on(spelling):
    plain, drop_in = _norm_modules()
    if spelling == "function":
        module = lambda x: ft.group_norm_swish(x, 4, drop_in.weight, drop_in.bias)  # noqa: E731
        module.parameters = drop_in.parameters
    else:
        module = drop_in
    x = _input(GN_SHAPE)
    with auto("dropin", "group_norm_swish", GN_ELEMENTS):
        ours = _grads(module, x)
        assert type(ours[0].grad_fn).__name__ == "EagerGroupNormSwishBackward"
    with ft.enabled(policy="always"):
        always = _grads(module, x)
    assert all(torch.equal(a, b) for a, b in zip(ours, always))
    with auto("dropin", "group_norm_swish", GN_ELEMENTS + 1):
        theirs = _grads(module, x)
        assert type(theirs[0].grad_fn).__name__ == "SiluBackward0"
    plain_grads = _grads(plain, x)
    assert all(torch.equal(a, b) for a, b in zip(theirs, plain_grads))  # PyTorch's bits


def test_the_fusion_takes_fastbwds_side_from_the_threshold_on():
    plain, _ = _norm_modules()
    block, reference = _Block(plain[0]), _Block(nn.GroupNorm(4, 16))
    reference.load_state_dict(block.state_dict())
    x = _input(GN_SHAPE)
    tiny = _input((1, 16, 1, 2))
    with ft.enabled(policy="auto"):  # a tiny example, PyTorch's side: still decides the structure
        report = ft.fuse_group_norm_swish(block, (tiny,))
    assert report.count == 1
    with auto("fused", "group_norm_swish", GN_ELEMENTS):
        assert type(block.norm(x)) is _fuse._LazyGroupNorm
        ours = _grads(block, x)
        assert type(ours[0].grad_fn).__name__ == "EagerGroupNormSwishBackward"
    with ft.enabled(policy="always"):
        always = _grads(block, x)
    assert all(torch.equal(a, b) for a, b in zip(ours, always))
    with auto("fused", "group_norm_swish", GN_ELEMENTS + 1):
        assert type(block.norm(x)) is torch.Tensor
        theirs = _grads(block, x)
    assert all(torch.equal(a, b) for a, b in zip(theirs, _grads(reference, x)))


def _served(path, x):
    """Whether fastbwd serves a GroupNorm(4, 16) + SiLU pair on ``x`` reached by ``path`` (under
    "auto", every GroupNorm+Swish threshold at 0)."""
    plain, drop_in = _norm_modules()
    thresholds = {f"torch/{p}/group_norm_swish/{t}": 0 for p in ("dropin", "fused", "compiled") for t in (1, 2)}
    with _dispatch.using(thresholds), ft.enabled(policy="auto"):
        if path == "fused":
            block = _Block(plain[0])
            with ft.enabled(policy="always"):
                assert ft.fuse_group_norm_swish(block, (x.detach(),)).count == 1
            return type(block.norm(x)) is _fuse._LazyGroupNorm
        if path == "dropin":
            return type(drop_in(x).grad_fn).__name__ == "EagerGroupNormSwishBackward"
        if path == "compiled pair":  # the graph pass's trace-time answer (a fused node decides again when it runs)
            answers, refused = [], _compile._refused
            _compile._refused = lambda *args: answers.append(refused(*args)) or answers[-1]
            try:
                _compiled_counts(_Block(plain[0]), x)
            finally:
                _compile._refused = refused
                torch._dynamo.reset()
            assert answers
            return not any(answers)
        graphs = []

        def backend(gm, inputs):
            graphs.append({str(node.target) for node in gm.graph.nodes})
            return gm.forward

        torch._dynamo.reset()
        try:
            torch.compile(drop_in, backend=backend)(x)
        finally:
            torch._dynamo.reset()
        return any("fastbwd.group_norm_swish" in target for target in graphs[-1])


@pytest.mark.parametrize("path", ["dropin", "fused", "compiled", "compiled pair"])
def test_a_call_leaving_threads_idle_is_pytorchs(path):
    """fastbwd's kernels take a channels-last image of up to 320 channels as one task: on two
    threads PyTorch's pair, which uses both, is the faster (docs/history.md), so "auto" declines
    it whatever its size; on one thread, with two images or channels first, fastbwd's."""
    one_image = torch.randn((1, 16, 3, 5), generator=torch.Generator().manual_seed(3))
    channels_last = one_image.contiguous(memory_format=torch.channels_last).requires_grad_()
    two_images = torch.cat([one_image, one_image]).contiguous(memory_format=torch.channels_last).requires_grad_()
    with _threads(2):
        assert not _served(path, channels_last)
        assert _served(path, two_images)
        assert _served(path, one_image.clone().requires_grad_())  # NCHW: a task per group
    with _threads(1):
        assert _served(path, channels_last)


def test_a_geometry_keeps_its_decision_per_path_and_policy():
    x = _input(GN_SHAPE)
    geometry = _ops.geometry_of(x, None, None, 4, 1e-5, 1.0)
    with (
        auto("dropin", "group_norm_swish", GN_ELEMENTS + 1),
        _dispatch.using(
            {"torch/dropin/group_norm_swish/1": GN_ELEMENTS + 1, "torch/dropin/group_norm_swish/2": GN_ELEMENTS + 1}
        ),
    ):
        assert not geometry.serves("dropin")
        assert geometry.serves("compiled") == (GN_ELEMENTS >= _dispatch.DEFAULTS["torch/compiled/group_norm_swish/1"])
        with ft.enabled(policy="always"):
            assert geometry.serves("dropin")


def test_a_geometry_decides_again_under_a_new_table():
    """A drop-in's geometry keeps its decision only while the table it was made from is the one
    read: after a new one (a calibration's store(), or using()) the same call follows it."""
    _, drop_in = _norm_modules()
    x = _input(GN_SHAPE)
    key = "torch/dropin/group_norm_swish"
    with ft.enabled(policy="auto"):
        with _dispatch.using({f"{key}/1": GN_ELEMENTS, f"{key}/2": GN_ELEMENTS}):
            assert type(drop_in(x).grad_fn).__name__ == "EagerGroupNormSwishBackward"
        # float32's threshold one above the call; bfloat16's keeps the floor at the call's size
        later = {f"{key}/1": GN_ELEMENTS + 1, f"{key}/2": GN_ELEMENTS + 1, f"{key}/1/bfloat16": GN_ELEMENTS}
        with _dispatch.using(later):
            assert _dispatch.floor("torch", "dropin", "group_norm_swish", 1) == GN_ELEMENTS
            assert type(drop_in(x).grad_fn).__name__ == "SiluBackward0"


# ---- compiled graphs ------------------------------------------------------------------------------


def _compiled_counts(forward, x, dynamic=False):
    torch._dynamo.reset()
    graph_calls, served = _routing.GRAPH_CALLS.copy(), _routing.SERVED.copy()
    compiled = torch.compile(forward, backend="aot_eager", dynamic=dynamic)
    y, grad = _gradient(compiled, x)
    return y, grad, _routing.GRAPH_CALLS - graph_calls, _routing.SERVED - served


@pytest.mark.parametrize(  # a graph each: one operator in the quick set
    "op", [op if i == 0 else pytest.param(op, marks=pytest.mark.slow) for i, op in enumerate(ROUTED)]
)
def test_a_compiled_graph_takes_fastbwds_side_from_the_threshold_on(op):
    forward = ROUTED[op][0]
    x = _input()
    name = f"{op}_backward"
    try:
        with auto("compiled", op, ELEMENTS):
            _, ours, calls, served = _compiled_counts(forward, x)
            assert calls[name] == 1 and served[name] == 1
        with auto("compiled", op, ELEMENTS + 1):  # PyTorch's own graph: no fastbwd node
            _, theirs, calls, served = _compiled_counts(forward, x)
            assert not calls and not served
        with ft.enabled(policy="always"):
            _, always, _, _ = _compiled_counts(forward, x)
        assert torch.equal(ours, always)
        ft.disable()
        _, plain, _, _ = _compiled_counts(forward, x)
        assert torch.equal(theirs, plain)
        # sizes known only when the graph runs: the graph operator decides then
        with auto("compiled", op, ELEMENTS + 1):
            _, _, calls, served = _compiled_counts(forward, x, dynamic=True)
            assert calls[name] == 1 and not served
        with auto("compiled", op, ELEMENTS):
            _, _, calls, served = _compiled_counts(forward, x, dynamic=True)
            assert calls[name] == 1 and served[name] == 1
    finally:
        torch._dynamo.reset()


def test_a_compiled_call_takes_the_compiled_decision_not_the_eager_one():
    """torch.compile traces PyTorch's function, not fastbwd's eager route: with every eager
    size fastbwd's and the compiled threshold above the call, the graph is PyTorch's alone."""
    forward = ROUTED["upsample_bilinear2d"][0]
    x = _input()
    thresholds = {f"torch/routed/upsample_bilinear2d/{t}": 0 for t in (1, 2)}
    thresholds |= {f"torch/compiled/upsample_bilinear2d/{t}": ELEMENTS + 1 for t in (1, 2)}
    try:
        with _dispatch.using(thresholds), ft.enabled(policy="auto"):
            y, theirs, calls, served = _compiled_counts(forward, x)
            assert not calls and not served and "Routed" not in type(y.grad_fn).__name__
        ft.disable()
        _, plain, _, _ = _compiled_counts(forward, x)
        assert torch.equal(theirs, plain)
    finally:
        torch._dynamo.reset()


def test_the_compiled_pairs_take_fastbwds_side_from_the_threshold_on():
    plain, _ = _norm_modules()
    block = _Block(plain[0])
    x = _input(GN_SHAPE)
    try:
        with auto("compiled", "group_norm_swish", GN_ELEMENTS):
            _, ours, calls, _ = _compiled_counts(block, x)
            assert calls["group_norm_swish"] == 1 and calls["group_norm_swish_backward"] == 1
        with auto("compiled", "group_norm_swish", GN_ELEMENTS + 1):
            _, theirs, calls, _ = _compiled_counts(block, x)
            assert not calls
        ft.disable()
        _, plain_grad, _, _ = _compiled_counts(block, x)
        assert torch.equal(theirs, plain_grad)
    finally:
        torch._dynamo.reset()


def test_a_compiled_drop_in_takes_the_decision_at_trace_time():
    _, drop_in = _norm_modules()
    x = _input(GN_SHAPE)
    graphs = []

    def backend(gm, inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes})
        return gm.forward

    try:
        for threshold, fused in ((GN_ELEMENTS, True), (GN_ELEMENTS + 1, False)):
            torch._dynamo.reset()
            with auto("compiled", "group_norm_swish", threshold):
                torch.compile(drop_in, backend=backend)(x)
            assert any("fastbwd.group_norm_swish" in target for target in graphs[-1]) == fused, graphs[-1]
    finally:
        torch._dynamo.reset()


# ---- the calibration ----------------------------------------------------------------------------


def test_the_crossover_is_the_smallest_size_from_which_fastbwd_wins():
    from fastbwd.torch._calibrate import crossover

    assert crossover([(1, 0.5), (2, 0.8), (4, 1.1), (8, 1.5), (16, 2.0)]) == 4
    # one disturbed point moves nothing: a high one does not pull the threshold down to it, a low
    # one among wins does not push it up
    assert crossover([(1, 0.5), (2, 0.6), (4, 0.7), (8, 3.0), (16, 0.8), (32, 1.5), (64, 2.0), (128, 1.8)]) == 16
    assert crossover([(1, 0.5), (2, 0.6), (4, 1.2), (8, 0.4), (16, 1.5), (32, 1.6)]) == 8
    assert crossover([(1, 0.5), (2, 0.6), (4, 0.7)]) == 8  # never: past the ladder
    assert crossover([(1, 1.2), (2, 1.3), (4, 1.4)]) == 1
    # "at least as fast": a ratio of exactly 1 is fastbwd's
    assert crossover([(1, 0.5), (2, 1.0), (4, 1.0), (8, 1.0)]) == 2


def test_calibrate_measures_and_stores_this_machines_thresholds(tmp_path, monkeypatch, capsys):
    from fastbwd import __main__ as cli
    from fastbwd.torch import _calibrate

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_calibrate, "LADDER", [(1, 8, 2, 2), (2, 16, 64, 64)])
    monkeypatch.setattr(_calibrate, "MEASURED", ("routed/replication_pad2d", "dropin/group_norm_swish"))
    real = _calibrate.calibrate
    monkeypatch.setattr(_calibrate, "calibrate", lambda say: real(threads=(1,), seconds=0.05, say=say))
    _dispatch.forget()
    try:
        assert cli.main(["--calibrate", "torch"]) == 0
        printed = capsys.readouterr().out
        assert "torch/routed/replication_pad2d/1: fastbwd from" in printed and "stored in" in printed
        assert _dispatch.status() == f"used: {tmp_path / 'fastbwd-dispatch.json'}"
        stored = _dispatch.stored()
        assert set(stored) == {"torch/routed/replication_pad2d/1", "torch/dropin/group_norm_swish/1"}
        assert all(value in (32, 131072, 262144) for value in stored.values())  # a ladder size, or past it
        assert (
            _dispatch.threshold("torch", "routed", "replication_pad2d", threads=1)
            == stored["torch/routed/replication_pad2d/1"]
        )
    finally:
        monkeypatch.undo()
        _dispatch.forget()


def test_calibrate_into_a_read_only_folder_fails_and_changes_nothing(monkeypatch, capsys):
    from fastbwd import __main__ as cli
    from fastbwd.torch import _calibrate

    monkeypatch.setenv("NUMBA_CACHE_DIR", "/proc/self")
    monkeypatch.setattr(_calibrate, "calibrate", lambda say: {"torch/routed/replication_pad2d/1": 5})
    _dispatch.forget()
    try:
        assert cli.main(["--calibrate", "torch"]) == 1
        assert "could not be stored" in capsys.readouterr().out
        assert _dispatch.status() == "none"
    finally:
        monkeypatch.undo()
        _dispatch.forget()


@pytest.mark.parametrize("policy", ["always", "auto"])
@pytest.mark.parametrize("padding", [(-2, 1, 0, 0), (1, -2, 0, 0), (0, 0, -3, 2), (0, 1, 1, -3)])
def test_a_pad_cropping_a_whole_side_gives_pytorchs_gradient(policy, padding):
    """A replicate pad whose negative size crops a whole side, then replicates the edge (found by
    the never-breaks property test: fastbwd's kernel gave zeros there): fastbwd's gradient is
    PyTorch's, on either policy, every call served: by fastbwd's kernel, none handed back to
    PyTorch's (the bridge once declined such pads)."""
    x = _input((1, 2, 3, 2), seed=5)
    forward = lambda x: F.pad(x, padding, mode="replicate")  # noqa: E731
    expected = _plain(forward, x)
    name = "replication_pad2d_backward"
    served, fallback = _routing.SERVED[name], _routing.FALLBACK[name]
    with ft.enabled(policy=policy), _everything_served():
        found = _gradient(forward, x)
    assert torch.equal(found[0], expected[0]) and torch.equal(found[1], expected[1])
    assert (_routing.SERVED[name], _routing.FALLBACK[name]) == (served + 1, fallback)
