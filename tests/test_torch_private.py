"""PyTorch's private interfaces (fastbwd/torch/_private.py, docs/semantics.md §7 "Never breaks"):
``import fastbwd.torch`` touches none of them, and a PyTorch without any one of them still
imports fastbwd.torch, routes eager calls and runs GroupNormSwish, roi_align, the fusion and
torch.compile (the feature that needs it off, with one warning, never an error)."""

import pathlib
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")
F, nn = torch.nn.functional, torch.nn

import fastbwd.torch as ft  # noqa: E402
from fastbwd.torch import _compile, _fuse, _ops, _private  # noqa: E402

from conftest import run_program  # noqa: E402


class _Gone:
    """Stands for a class attribute PyTorch does not let us delete (on a C type): reading it
    raises AttributeError, as reading a missing one does."""

    def __init__(self, name):
        self.name = name

    def __get__(self, instance, owner=None):
        raise AttributeError(self.name)


def remove(monkeypatch, path):
    """Take the interface at ``path`` away for the test: deleted where PyTorch allows, else
    shadowed by :class:`_Gone`. An interface read from PyTorch's objects while a graph compiles
    (a node's meta key, a fake tensor's attribute: ``_private.READS``) cannot be taken from
    PyTorch, which needs it itself: the bridge reads a name PyTorch does not set instead, as it
    would if PyTorch renamed it."""
    if path in _private.READS:
        monkeypatch.setitem(_private.READS, path, "removed " + _private.READS[path])
        return
    owner, _ = _private._resolve(path)
    name = path.rsplit(".", 1)[1]
    if isinstance(owner, type) and name not in vars(owner):
        monkeypatch.setattr(owner, name, _Gone(name), raising=False)  # inherited from a C base
    else:
        try:
            monkeypatch.delattr(owner, name)
        except (AttributeError, TypeError):
            monkeypatch.setattr(owner, name, _Gone(name))


def _forget():
    """Every lookup the bridge made, made again at the next use (the interface gone now)."""
    _private.forget()
    _ops._SILUS.clear()
    _fuse._PLUMBING.clear()


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up = nn.GroupNorm(2, 4), nn.Upsample(scale_factor=2, mode="bilinear")

    def forward(self, x):
        return F.avg_pool2d(F.pad(self.up(F.silu(self.norm(x))), (1, 1, 1, 1), mode="replicate"), 2)


def _gradients(function, *inputs):
    inputs = [t.detach().requires_grad_() for t in inputs]
    output = function(*inputs)
    return (output.detach(), *torch.autograd.grad(output, inputs, _randn(*output.shape, seed=9)))


def _pre_grad_then_aot_eager(gm, example_inputs):
    """A torch.compile backend: Inductor's pre-grad custom passes on the graph Dynamo captured,
    called as Inductor calls them, then ``aot_eager``; so the pre-grad pass runs on a real
    captured graph (its ``example_value``s) without Inductor's minutes of C++ compiling."""
    passes = getattr(torch._inductor.config, "pre_grad_custom_pass", None)  # (the removal test may take it)
    for graph_pass in passes if isinstance(passes, list) else [passes] if passes else []:
        graph_pass(gm.graph)
    gm.recompile()
    return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)


def workload(compiled):
    """``{what: tensors}``: what fastbwd.torch does with it enabled (fresh modules each time)."""
    ft.enable()
    torch.manual_seed(0)
    x, boxes = _randn(2, 4, 6, 5, seed=1), torch.tensor([[0, 0.5, 1.0, 4.0, 3.5], [1, 1.0, 0.0, 3.0, 5.0]])
    results = {
        "routed": _gradients(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear").sin(), x),
        "GroupNormSwish": _gradients(ft.GroupNormSwish(2, 4), x),
        "roi_align": _gradients(lambda x: ft.roi_align(x, boxes, (2, 3), 1.0, 2, True), x),
    }
    block = _Block()
    ft.fuse_group_norm_swish(block, (x,))
    results["fused"] = _gradients(block, x)
    if compiled:
        for name, backend in (("compiled", "aot_eager"), ("compiled, pre-grad pass", _pre_grad_then_aot_eager)):
            torch._dynamo.reset()
            results[name] = _gradients(torch.compile(_Block(), backend=backend), x)
        torch._dynamo.reset()
    return results


@torch.library.custom_op("fastbwd_tests::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_scaled.register_fake(lambda x: torch.empty_like(x))
_scaled.register_autograd(lambda ctx, grad: grad * 2)


def plain_pytorch(compiled):
    """The same kinds of calls in plain PyTorch (eager ops, nn.GroupNorm and SiLU, a custom op
    of its own, torch.compile): raises when PyTorch itself needs the interface."""
    ft.disable()
    x = _randn(2, 4, 6, 5, seed=1)
    _gradients(lambda x: _scaled(F.silu(nn.GroupNorm(2, 4)(F.interpolate(x, scale_factor=2, mode="bilinear")))), x)
    if compiled:
        torch._dynamo.reset()
        _gradients(torch.compile(_Block(), backend="aot_eager"), x)
        torch._dynamo.reset()


@pytest.fixture(scope="module")
def expected():
    ft.disable()
    _forget()
    try:
        return workload(compiled=True)
    finally:
        ft.disable()


def _kind(path):
    """An interface's kind, for the quick set's cover (tests/_covering.py): an operator's dispatch
    internals, the compiler's, or the core's."""
    if ".ops." in path:
        return ("operator",)
    compiler = ("torch._dynamo.", "torch._inductor.", "torch._functorch.", "torch._decomp.")
    return ("compiler",) if path.startswith(compiler) else ("core",)


@pytest.fixture
def always():
    """The policy "always" for the test (these inputs are small: "auto", which an earlier test of
    the process may have set, leaves them to PyTorch, and the graph passes read nothing)."""
    previous = ft.policy()
    ft.set_policy("always")
    yield
    ft.set_policy(previous)


@pytest.mark.covering(key=_kind, strength=1)
@pytest.mark.parametrize("path", sorted(_private.INTERFACES))
@pytest.mark.usefixtures("always")
def test_each_private_interface_can_be_missing(path, monkeypatch, expected):
    remove(monkeypatch, path)
    _forget()
    compiled = True
    try:
        plain_pytorch(compiled=False)
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"plain PyTorch itself needs {path} ({type(error).__name__}: {error})")
    try:
        plain_pytorch(compiled=True)
    except Exception:  # noqa: BLE001 - torch.compile itself needs it: the rest must still work
        compiled = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            actual = workload(compiled)
            actual_again = workload(compiled)  # ... and warned only once
        finally:
            ft.disable()
            _forget()
    for what, tensors in actual.items():
        for a, e, again in zip(tensors, expected[what], actual_again[what]):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=f"{path}: {what}")
            assert torch.equal(a, again)
    ours = [str(w.message) for w in caught if "fastbwd.torch: this PyTorch" in str(w.message)]
    assert len(ours) <= 1 and all(path in message for message in ours), ours
    if path in _private.READS:  # read at each compile: its absence is seen and said
        assert len(ours) == 1 and compiled, ours


def test_the_graph_passes_read_their_interfaces_through_the_list(monkeypatch, expected):
    """With the compiler's graph values gone, torch.compile runs PyTorch's code for the pairs (no
    fused node, PyTorch's results), the routed operators still fastbwd's, after one warning."""
    from fastbwd.torch import _routing

    remove(monkeypatch, _private.VAL)
    _forget()
    before = _routing.GRAPH_CALLS.copy()
    with pytest.warns(RuntimeWarning, match=r"meta\['val'\] is missing .* Off from now on: .* AOTAutograd's joint"):
        try:
            ft.enable()
            torch._dynamo.reset()
            x = _randn(2, 4, 6, 5, seed=1)
            actual = _gradients(torch.compile(_Block(), backend="aot_eager"), x)
        finally:
            ft.disable()
            torch._dynamo.reset()
            _forget()
    calls = {name: count for name, count in (_routing.GRAPH_CALLS - before).items() if count}
    assert calls == {"upsample_bilinear2d_backward": 1, "avg_pool2d_backward": 1, "replication_pad2d_backward": 1}
    for a, e in zip(actual, expected["compiled"]):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_the_pre_grad_pass_fuses_no_pair_without_graph_values(monkeypatch):
    """With Dynamo's graph values gone, Inductor's pre-grad pass fuses no pair (the rule never
    saw one), after one warning."""
    remove(monkeypatch, _private.EXAMPLE_VALUE)
    _forget()
    graphs, norm = [], nn.GroupNorm(2, 4)

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: F.silu(norm(x)), backend=capture, fullgraph=True)(_randn(2, 4, 3, 3, seed=2))
    (gm,) = graphs
    try:
        with pytest.warns(RuntimeWarning, match=r"meta\['example_value'\] is missing"):
            assert _compile.fuse_group_norm_swish_pre_grad(gm.graph) == 0
    finally:
        torch._dynamo.reset()
        _forget()


def test_every_private_interface_is_in_the_list():
    """The list the test above walks is the bridge's: no private name of PyTorch's is used
    elsewhere in fastbwd/torch/ (the tests' names aside)."""
    import re

    folder = pathlib.Path(_private.__file__).parent
    for source in folder.glob("*.py"):
        if source.name == "_private.py":
            continue
        code = source.read_text()
        uses = re.findall(r"\btorch(?:\.\w+)*\._[A-Za-z]\w*", code)
        uses += re.findall(r"from torch[\w.]* import .*\b_[a-z]\w*", code)
        uses += re.findall(
            r"\.(py_kernels|_dispatch_cache|_make_wrapper_subclass|_version|_destroy|_modules|_buffers|_parameters"
            r"|fake_mode)\b",
            code,
        )
        uses += re.findall(
            r"\.meta\s*\[|\.meta\.get\b|[\"'](?:example_value|val)[\"']", code
        )  # the compiler's graph values
        assert not uses, f"{source.name} uses PyTorch's private {uses}"


@pytest.mark.slow
def test_import_touches_no_private_interface(tmp_path):
    """In a fresh process with every private interface taken away first, ``import fastbwd.torch``
    works and has looked none up; with them back, the bridge works."""
    program = textwrap.dedent(
        f"""
        import torch, importlib
        paths = {sorted(_private.INTERFACES)!r}
        saved = []

        class Gone:
            def __get__(self, instance, owner=None):
                raise AttributeError("gone")

        owners = []
        for path in paths:  # every owner first: importing one may need what is taken away below
            if path in {sorted(_private.READS)!r}:
                continue  # read from PyTorch's objects while a graph compiles: nothing to take away here
            parts = path.split(".")
            owner = torch
            for index, name in enumerate(parts[1:-1], 2):
                try:
                    owner = getattr(owner, name)
                except AttributeError:
                    owner = importlib.import_module(".".join(parts[:index]))
            owners.append((owner, parts[-1]))
        for owner, name in owners:
            value = vars(owner).get(name, Gone) if isinstance(owner, type) else getattr(owner, name)
            saved.append((owner, name, value))
            if isinstance(owner, type):
                setattr(owner, name, Gone())
            else:
                delattr(owner, name)

        import fastbwd.torch as ft
        from fastbwd.torch import _private
        assert _private._found == {{}}, _private._found  # nothing looked up

        for owner, name, value in saved:
            if value is Gone:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        ft.enable()
        x = torch.randn(2, 4, 6, 5, requires_grad=True)
        ft.GroupNormSwish(2, 4)(torch.nn.functional.interpolate(x, scale_factor=2, mode="bilinear")).sum().backward()
        print(dict(ft._routing.SERVED))
        """
    )
    result = run_program(program, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "upsample_bilinear2d_backward" in result.stdout.strip().splitlines()[-1]


def test_a_broken_interface_warns_once_and_turns_its_feature_off(monkeypatch):
    """An interface that is there but raises when used (it changed) turns its feature off with
    one warning: the eager shortcut here, so the operators run through the dispatcher."""

    def changed():
        raise TypeError("changed")

    monkeypatch.setattr(torch._C, "_len_torch_dispatch_stack", changed)
    _forget()
    try:
        with pytest.warns(RuntimeWarning, match="Off from now on: the eager shortcut"):
            y = ft.GroupNormSwish(2, 4)(_randn(2, 4, 3, 3))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(ft.GroupNormSwish(2, 4)(_randn(2, 4, 3, 3)), y)
        assert not _ops.use_eager_path(_randn(2, 4, 3, 3))
    finally:
        _forget()
