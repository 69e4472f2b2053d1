"""fastbwd.jax.reach touches nothing the user did not ask for (issue 55, docs/jax.md "What reach
installs"): it is a context of the calling thread (a thread tracing outside it gets the
libraries' own functions and programs, bit for bit, while another traces inside); what it
installs in the libraries is installed once, all or nothing, equals the original outside reach
and never undoes a user's own assignment; JAX's trace cache tells inside from outside; nested
reach enters once; and a model traced under ``reach(loss)`` stays the user's (its class, its
modules, its pytree structure, pickling, checkpoints, optimizer state). The programs are
tests/jax_reach_cases.py's, written as the libraries' users write them."""

import inspect
import io
import json
import pickle
import re
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import jax_reach_cases as cases  # noqa: E402

import fastbwd.jax as fj  # noqa: E402
from fastbwd.jax import _pad, _reach, _seams, _upsample  # noqa: E402

from conftest import child_environment, random  # noqa: E402

EDGE = cases.EDGE


def _run(code, timeout=600):
    """``code`` in a new Python process (the checkout and tests/ on its path): its stdout."""
    env = child_environment(tests=True)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _compiled_targets(function, *args):
    """The fastbwd FFI targets in ``jax.jit(function)``'s compiled program, in order."""
    text = jax.jit(function).lower(*args).compile().as_text()
    return re.findall(r'custom_call_target="fastbwd_(\w+)"', text)


def _pad_loss(x):
    return jnp.sum(jnp.pad(x, EDGE, mode="edge") ** 2)


# ---- a context of the calling thread -------------------------------------------------------------


@pytest.mark.slow
def test_a_thread_outside_reach_traces_the_libraries_own_programs():
    """While thread A is inside reach (and traces every case there: fastbwd's kernels), the
    programs this process traces outside it (jaxpr, lowered text with its source locations,
    compiled text, gradient bytes) are those of a process that never imported fastbwd.jax."""
    plain = json.loads(_run("import jax_reach_cases; jax_reach_cases.main()"))  # this file's path
    assert plain["fastbwd_imported"] is False
    inside, entered, release = {}, threading.Event(), threading.Event()

    def thread_a():
        with fj.reach():
            entered.set()
            inside.update(cases.fingerprints())
            release.wait()

    a = threading.Thread(target=thread_a)
    a.start()
    try:
        assert entered.wait(300)
        assert jnp.pad is not _pad._jnp_pad and jnp.pad.__wrapped__ is _pad._jnp_pad  # installed
        outside = cases.in_a_thread(cases.fingerprints)
    finally:
        release.set()
        a.join()
    assert outside == plain["fingerprints"]
    assert set(inside) == set(outside)  # thread A traced every case
    for name, parts in inside.items():
        if name != "jax.nn.silu":  # a swish alone is jax.nn.silu's, inside reach too
            assert parts["targets"] and parts["compiled"] != outside[name]["compiled"], name
    for name in ("linen", "nnx", "equinox"):
        if name in inside:  # GroupNorm + swish fused, each pair
            assert inside[name]["targets"].count("group_norm_swish_forward") >= 2, name


def test_threads_tracing_at_once_inside_and_outside():
    """Two threads trace the same function at the same moments, one inside reach and one
    outside, then swap: each gets its own program every time."""
    x = jnp.asarray(random((2, 5, 6, 3), np.float32, 1))
    barrier = threading.Barrier(2, timeout=300)
    seen = {}

    def worker(name, inside_first):
        for round_ in range(2):
            inside = inside_first == (round_ == 0)
            barrier.wait()
            if inside:
                with fj.reach():
                    barrier.wait()
                    seen[name, round_] = (inside, _compiled_targets(jax.grad(_pad_loss), x))
                    barrier.wait()
            else:
                barrier.wait()
                seen[name, round_] = (inside, _compiled_targets(jax.grad(_pad_loss), x))
                barrier.wait()

    threads = [threading.Thread(target=worker, args=(name, name == "a")) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 4
    for inside, targets in seen.values():
        assert targets == (["replication_pad2d_backward"] if inside else [])


def test_nested_reach_enters_once():
    """Nested reach enters nothing twice (the Flax interceptor once) and its inner exit leaves
    the outer one in place; another thread is outside meanwhile."""
    nn = pytest.importorskip("flax.linen")
    from flax.linen import module as linen_module

    stack = linen_module._global_interceptor_stack
    before = len(stack)
    with fj.reach():
        assert _seams.active() and len(stack) == before + 1
        with fj.reach(), fj.reach():
            assert len(stack) == before + 1
        assert _seams.active() and len(stack) == before + 1
        seen, other = [], []
        fj.reach(lambda: seen.append((_seams.active(), len(stack))))()

        def look():
            other.append((_seams.active(), len(linen_module._global_interceptor_stack)))

        thread = threading.Thread(target=look)
        thread.start()
        thread.join()
    assert seen == [(True, before + 1)] and other == [(False, 0)]
    assert not _seams.active() and len(stack) == before
    with pytest.raises(RuntimeError):
        with fj.reach():
            raise RuntimeError
    assert not _seams.active() and len(stack) == before
    assert nn.GroupNorm  # the library stays imported


# ---- what reach installs ---------------------------------------------------------------------------


def _entered_once():
    with fj.reach():
        pass


def _loss_of(function, args, kwargs):
    return lambda x: jnp.sum(function(x, *args, **kwargs) ** 2)


def test_the_installed_functions_are_the_originals_outside_reach():
    """Every attribute reach set holds a wrapper of the library's original: its name, docs,
    signature and ``__wrapped__``; outside reach each call is the original's, bit for bit and
    the same program; the wrapper pickles (by reference to where it is installed)."""
    _entered_once()
    installed = _seams.installed()
    owners = {(getattr(owner, "__name__", owner), name) for owner, name in installed}
    assert {("jax.numpy", "pad"), ("jax.image", "resize"), ("jax.nn", "silu"), ("jax.nn", "swish")} <= owners
    assert len(installed) == len({(id(owner), name) for owner, name in installed})  # each once
    for owner, name in installed:
        wrapper = vars(owner)[name]
        original = wrapper.__wrapped__
        assert _seams.wrapper_of(original) is wrapper
        assert wrapper.__doc__ == original.__doc__ and wrapper.__name__ == original.__name__
        assert inspect.signature(wrapper) == inspect.signature(original)
    assert jax.nn.silu is jax.nn.swish and callable(jax.nn.silu.lower)  # aliases stay one; jit's methods
    x = jnp.asarray(random((2, 5, 6, 4), np.float32, 2))
    calls = {
        "jnp.pad": (jnp.pad, _pad._jnp_pad, (x, EDGE), {"mode": "edge"}),
        "jax.image.resize": (jax.image.resize, _upsample._jax_resize, (x, (2, 9, 11, 4)), {"method": "linear"}),
        "jax.nn.silu": (jax.nn.silu, _reach.silu, (x,), {}),
    }
    for name, (wrapper, original, args, kwargs) in calls.items():
        assert wrapper is not original and wrapper.__wrapped__ is original, name
        programs = [cases.program(_loss_of(f, args[1:], kwargs), (x,)) for f in (wrapper, original)]
        assert programs[0][:4] == programs[1][:4], name  # jaxpr, lowered (with locations), compiled, bytes
        assert pickle.loads(pickle.dumps(wrapper)) is wrapper, name
    originals = [_upsample._jax_resize]  # held from before the install: still pickled by name
    if "flax.linen" in sys.modules:
        from flax.linen import pooling

        original = sys.modules["flax.linen"].avg_pool.__wrapped__  # Flax's own, as held before the install
        assert pooling.avg_pool is original  # its own module keeps it: pickled by that name
        originals.append(original)
    assert all(pickle.loads(pickle.dumps(original)) is original for original in originals)


def test_reach_installs_exactly_what_docs_jax_md_lists():
    """The attributes reach has set are docs/jax.md's table ("What reach installs") for the
    libraries this process imported, no more: a library's own modules (``flax.linen.pooling``)
    keep their functions."""
    _entered_once()
    expected = [(jnp, "pad"), (jax.image, "resize"), (jax.nn, "silu"), (jax.nn, "swish")]
    if "flax.linen" in sys.modules:
        from flax import linen
        from flax.linen import activation

        expected += [(owner, name) for owner in (linen, activation) for name in ("swish", "silu")]
        expected += [(linen, "avg_pool")]
    if "flax.nnx" in sys.modules:
        from flax import nnx
        from flax.nnx.nn import activations

        expected += [(owner, name) for owner in (nnx, activations) for name in ("swish", "silu")]
        expected += [(nnx, "avg_pool"), (nnx.GroupNorm, "__call__"), (nnx.Sequential, "__call__")]
    if "equinox" in sys.modules:
        import equinox as eqx

        expected += [(owner, "__call__") for owner in (eqx.nn.GroupNorm, eqx.nn.AvgPool2d, eqx.nn.Lambda)]
    installed = _seams.installed()
    assert sorted((id(owner), name) for owner, name in installed) == sorted((id(o), n) for o, n in expected), installed


def test_a_users_own_assignment_survives_reach():
    """``jnp.pad = mine``, made inside reach or outside it, is the user's after reach exits, and
    inside reach too (reach never sets an attribute again); so is the library's own function put
    back after the install."""
    _entered_once()
    installed, resize = jnp.pad, jax.image.resize

    def mine(*args, **kwargs):
        return installed(*args, **kwargs)

    try:
        with fj.reach():
            jnp.pad = mine
        assert jnp.pad is mine
        with fj.reach():
            assert jnp.pad is mine
        jax.image.resize = mine
        with fj.reach():
            assert jax.image.resize is mine
        assert jax.image.resize is mine
        jnp.pad = _pad._jnp_pad  # the library's own function put back (a saved original restored)
        with fj.reach():
            assert jnp.pad is _pad._jnp_pad  # not installed again
        assert jnp.pad is _pad._jnp_pad
    finally:
        jnp.pad = installed
        jax.image.resize = resize


@pytest.fixture
def fresh_registry(monkeypatch):
    """A registry of seams of this test's own (the real one is untouched)."""
    monkeypatch.setattr(_seams, "_seams", [])
    monkeypatch.setattr(_seams, "_wrappers", {})
    monkeypatch.setattr(_seams, "_installed", {})


def _fake_module(monkeypatch, name, refuse=False):
    class Module(types.ModuleType):
        def __setattr__(self, key, value):
            if refuse and key == "f":
                raise AttributeError(f"{name} refuses")
            super().__setattr__(key, value)

    module = Module(name)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _original(x):
    """The original."""
    return x + 1


def _negate(original, x):
    return -x


def test_install_is_all_or_nothing(fresh_registry, monkeypatch):
    first, second = _fake_module(monkeypatch, "fake_first"), _fake_module(monkeypatch, "fake_second", refuse=True)
    vars(first)["f"] = vars(second)["f"] = _original
    _seams.register("fake_first", ("f",), _original, _negate)
    _seams.register("fake_second", ("f",), _original, _negate)
    with pytest.raises(AttributeError, match="refuses"):
        _seams.install()
    assert first.f is _original and second.f is _original and _seams.installed() == []
    del sys.modules["fake_second"]  # the refusing module gone, the rest installs
    _seams.install()
    assert first.f is not _original and first.f.__wrapped__ is _original and first.f(1) == 2
    with _seams.entered():
        assert first.f(1) == -1
    wrapper = first.f
    _seams.install()
    assert first.f is wrapper and len(_seams.installed()) == 1  # once


def test_install_leaves_an_attribute_the_user_set_before(fresh_registry, monkeypatch):
    module = _fake_module(monkeypatch, "fake_user")
    module.f = mine = lambda x: x  # noqa: E731
    module.g = _original
    _seams.register("fake_user", ("f", "g"), _original, _negate)
    _seams.install()
    assert module.f is mine and module.g.__wrapped__ is _original


def test_the_first_install_under_threads_and_a_name_imported_before():
    """In a new process: eight threads enter reach at once (each attribute wraps the original,
    not a wrapper); a name imported before the install (``from jax.numpy import pad``) stays
    the library's, inside reach too; one imported after is reached inside and the library's
    outside."""
    code = """
import re, threading, jax, jax.numpy as jnp
from jax.numpy import pad as early
import fastbwd.jax as fj
from fastbwd.jax import _pad, _seams
barrier = threading.Barrier(8)
def enter():
    barrier.wait()
    with fj.reach():
        pass
threads = [threading.Thread(target=enter) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
assert early is _pad._jnp_pad and jnp.pad.__wrapped__ is early
assert all(not hasattr(vars(o)[n].__wrapped__, "__fastbwd_drop_in__") for o, n in _seams.installed())
from jax.numpy import pad as late
x = jnp.ones((2, 5, 6, 3))
def targets(f):
    text = jax.jit(jax.grad(lambda x: jnp.sum(f(x, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge") ** 2))).lower(x).compile().as_text()
    return re.findall(r'custom_call_target="fastbwd_(\\w+)"', text)
with fj.reach():
    print(targets(early), targets(late))
print(targets(late))
"""
    lines = _run(code).splitlines()
    assert lines == ["[] ['replication_pad2d_backward']", "[]"]


def test_install_never_sets_an_attribute_again(fresh_registry, monkeypatch):
    """An attribute reach installed, then set back to the library's own function by the user
    (``monkeypatch`` undone, a saved original restored), keeps it: each attribute is set once
    for the process, never again."""
    module = _fake_module(monkeypatch, "fake_restored")
    module.f = _original
    _seams.register("fake_restored", ("f",), _original, _negate)
    _seams.install()
    assert module.f.__wrapped__ is _original
    module.f = _original
    _seams.install()
    assert module.f is _original
    with _seams.entered():
        assert module.f(1) == 2  # the user's choice: not reached


def test_reach_without_jax_user_contexts_is_still_per_thread():
    """A JAX without ``jax.make_user_context``: reach still per thread (its trace cache does not
    tell inside from outside: docs/jax.md)."""
    code = """
import threading, jax
del jax.make_user_context
import fastbwd.jax as fj
from fastbwd.jax import _seams
seen = []
with fj.reach():
    seen.append(_seams.active())
    t = threading.Thread(target=lambda: seen.append(_seams.active())); t.start(); t.join()
    with fj.reach():
        seen.append(_seams.active())
seen.append(_seams.active())
print(type(_seams._STATE).__name__, seen)
"""
    assert _run(code).strip() == "_ThreadFlag [True, False, True, False]"


# ---- JAX's trace cache -----------------------------------------------------------------------------


def test_a_jitted_function_traced_outside_is_traced_again_inside():
    """reach is part of JAX's trace cache key: a jitted function traced outside is traced again
    inside (and reaches fastbwd), and the program traced inside is never reused outside."""
    x = jnp.asarray(random((2, 5, 6, 3), np.float32, 3))
    traces = []

    @jax.jit
    def step(x):
        traces.append(_seams.active())
        return jax.grad(_pad_loss)(x)

    plain = step(x)
    with fj.reach():
        reached = step(x)
        assert _compiled_targets(step, x) == ["replication_pad2d_backward"]
    again = step(x)
    assert traces == [False, True]  # outside, inside; then the outside program from the cache
    assert np.asarray(again).tobytes() == np.asarray(plain).tobytes()
    np.testing.assert_allclose(reached, plain, rtol=1e-6)
    assert _compiled_targets(step, x) == []
    function = fj.reach(step)
    assert function is not step and function.__wrapped__ is step and np.array_equal(function(x), reached)


# ---- the user's model stays the user's -------------------------------------------------------------


def _leaves_close(actual, expected):
    """Each leaf within float32 rounding of its own largest value (GroupNorm's centred variance
    against the libraries' E[x^2] - E[x]^2, docs/jax.md)."""
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype
        assert np.abs(a - e).max(initial=0) <= 2e-5 * max(np.abs(e).max(initial=0), 1.0)


@pytest.mark.slow  # the quick set's model that stays the user's: NNX's (below)
def test_an_equinox_model_stays_the_users():
    """An Equinox model, unchanged, traced under reach(loss): fastbwd's kernels (GroupNorm + swish
    fused), the plain gradients, and the model's class, modules and pytree structure untouched;
    it pickles, its leaves serialise (eqx.tree_serialise_leaves) and optax's state is built from
    it and updated by the reached gradients as by the plain ones."""
    eqx = pytest.importorskip("equinox")
    optax = pytest.importorskip("optax")
    model = cases.equinox_model()
    original = pickle.loads(pickle.dumps(model))

    def modules(model):
        return [model, model.norm, model.conv, model.pool, model.tail, *model.tail.layers]

    classes, objects = [type(m) for m in modules(model)], modules(model)
    x = cases._randn((3, 8, 5, 5), 5)
    loss = fj.reach(cases.equinox_loss)
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model, x)
    expected = eqx.filter_jit(eqx.filter_grad(cases.equinox_loss))(model, x)
    _leaves_close(grads, expected)
    params, static = eqx.partition(model, eqx.is_array)
    targets = _compiled_targets(lambda p, x: jax.grad(lambda p: loss(eqx.combine(p, static), x))(p), params, x)
    assert targets.count("group_norm_swish_forward") == 2 and "avg_pool2d_backward" in targets
    lowered = jax.jit(lambda p, x: jax.grad(lambda p: loss(eqx.combine(p, static), x))(p)).lower(params, x).as_text()
    assert re.findall(r"activate_swish[^a-z]*(true|false)", lowered) == ["true"] * 4  # both pairs fused
    assert type(model) is type(original) and type(model.norm) is eqx.nn.GroupNorm
    assert [type(m) for m in modules(model)] == classes and all(a is b for a, b in zip(modules(model), objects))
    assert jax.tree_util.tree_structure(model) == jax.tree_util.tree_structure(original)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(expected)
    jax.tree_util.tree_map(lambda a, b: a, model, original)
    assert pickle.loads(pickle.dumps(model)).norm.groups == 4
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, model)
    buffer.seek(0)
    restored = eqx.tree_deserialise_leaves(buffer, original)
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(model))
    )
    optimizer = optax.adam(1e-3)
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
    stepped = eqx.apply_updates(model, updates)
    plain_updates, _ = optimizer.update(expected, optimizer.init(eqx.filter(model, eqx.is_array)))
    assert type(stepped) is type(model) and jax.tree_util.tree_structure(stepped) == jax.tree_util.tree_structure(model)
    _leaves_close(eqx.filter(stepped, eqx.is_array), eqx.filter(eqx.apply_updates(model, plain_updates), eqx.is_array))


def test_an_nnx_model_stays_the_users():
    """An NNX model, unchanged, traced under reach(loss): fastbwd's kernels, the plain gradients,
    and nothing of the model changed in place (its classes, its layers, its state's structure);
    it pickles, and optax's state is the user's as before."""
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    model, x = cases.nnx_model(), cases._randn((2, 6, 6, 8), 6)
    classes = [type(node) for _, node in nnx.iter_graph(model)]
    layers = list(model.tail.layers)
    structure = jax.tree_util.tree_structure(nnx.state(model))

    def loss(model, x):
        return jnp.sum(model(x) ** 2)

    grads = nnx.jit(nnx.grad(fj.reach(loss)))(model, x)
    expected = nnx.jit(nnx.grad(loss))(model, x)
    _leaves_close(nnx.state(grads), nnx.state(expected))
    assert [type(node) for _, node in nnx.iter_graph(model)] == classes
    assert all(a is b for a, b in zip(model.tail.layers, layers, strict=True))
    assert jax.tree_util.tree_structure(nnx.state(model)) == structure
    assert jax.tree_util.tree_structure(nnx.state(grads)) == jax.tree_util.tree_structure(nnx.state(expected))
    assert type(pickle.loads(pickle.dumps(model))) is type(model)
    params = nnx.state(model, nnx.Param)
    optimizer = optax.sgd(1e-2)
    opt_state = optimizer.init(params)
    updates, _ = optimizer.update(nnx.state(grads, nnx.Param), opt_state)
    plain, _ = optimizer.update(nnx.state(expected, nnx.Param), opt_state)
    _leaves_close(optax.apply_updates(params, updates), optax.apply_updates(params, plain))


def test_a_linen_model_reached_equals_flax():
    pytest.importorskip("flax.linen")
    loss, args = cases.linen_case()
    reached = jax.jit(jax.grad(fj.reach(loss)))(*args)
    _leaves_close(reached, jax.jit(jax.grad(loss))(*args))
    assert jax.tree_util.tree_structure(reached) == jax.tree_util.tree_structure(args[0])


def test_a_swish_layer_holding_the_original_silu_is_fused():
    """A Sequential built before reach installed its wrapper holds jax.nn.silu itself: inside
    reach its GroupNorm + swish is still one fused call, in each library; the model unchanged."""
    nn = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    silu = _reach.silu  # the original, as a model built before the install holds it
    x = cases._randn((2, 5, 6, 8), 7)
    linen = nn.Sequential([nn.GroupNorm(num_groups=2), silu])
    linen_params = linen.init(jax.random.key(0), x)
    norm = nnx.Sequential(nnx.GroupNorm(8, num_groups=2, rngs=nnx.Rngs(0)), silu)
    graph, state = nnx.split(norm)
    equinox = eqx.nn.Sequential([eqx.nn.GroupNorm(2, 8), eqx.nn.Lambda(silu)])
    losses = {
        "linen": (lambda p, x: jnp.sum(linen.apply(p, x) ** 2), linen_params),
        "nnx": (lambda s, x: jnp.sum(nnx.merge(graph, s)(x) ** 2), state),
        "equinox": (lambda m, x: jnp.sum(jax.vmap(m)(x.transpose(0, 3, 1, 2)) ** 2), equinox),
    }
    for name, (loss, first) in losses.items():
        params, static = eqx.partition(first, eqx.is_array)

        def step(params, x, loss=loss, static=static):
            return jax.grad(lambda p: loss(eqx.combine(p, static), x))(params)

        reached = fj.reach(step)
        assert _compiled_targets(reached, params, x) == ["group_norm_swish_forward", "group_norm_swish_backward"], name
        lowered = jax.jit(reached).lower(params, x).as_text()
        assert re.findall(r"activate_swish[^a-z]*(true|false)", lowered) == ["true", "true"], name  # fused
        assert _compiled_targets(step, params, x) == [], name
        _leaves_close(jax.jit(reached)(params, x), jax.jit(step)(params, x))
    assert list(norm.layers)[1] is silu and equinox.layers[1].fn is silu and linen.layers[1] is silu


def test_an_equinox_lambda_of_another_function_is_that_function():
    """Inside reach an ``eqx.nn.Lambda`` is fastbwd's swish only when it holds ``jax.nn.silu``:
    holding another function (relu, tanh, the user's own) it runs that function, alone and after
    a GroupNorm, bit for bit as outside reach."""
    eqx = pytest.importorskip("equinox")
    x = cases._randn((8, 5, 6), 11)
    for function in (jax.nn.relu, jnp.tanh, lambda h: 2 * h):
        layer = eqx.nn.Lambda(function)
        block = eqx.nn.Sequential([eqx.nn.GroupNorm(2, 8), eqx.nn.Lambda(function)])
        expected = [np.asarray(layer(x)), np.asarray(block(x))]
        with fj.reach():
            assert np.asarray(layer(x)).tobytes() == expected[0].tobytes(), function
            np.testing.assert_allclose(block(x), expected[1], rtol=1e-5, atol=1e-5)
            lowered = jax.jit(lambda x, block=block: block(x)).lower(x).as_text()
            assert re.findall(r"activate_swish[^a-z]*(true|false)", lowered) == ["false"], function  # not fused


def test_the_modules_calls_in_every_form_inside_reach():
    """Inside reach a module's call keeps the library's signature: Equinox's ``state`` (positional
    or keyword) comes back as given, its ``key`` is ignored, a call of another form raises
    Equinox's own error; NNX's ``mask`` (not served) is NNX's own result, bit for bit."""
    eqx = pytest.importorskip("equinox")
    nnx = pytest.importorskip("flax.nnx")
    norm = eqx.nn.GroupNorm(2, 8)
    x, state = cases._randn((8, 5, 6), 8), object()
    plain = norm(x)
    with fj.reach():
        np.testing.assert_allclose(norm(x), plain, rtol=1e-5, atol=1e-5)
        for call in (lambda: norm(x, state), lambda: norm(x, state=state, key=jax.random.key(0))):
            out, back = call()
            assert back is state and out.shape == x.shape
        assert _compiled_targets(lambda x: norm(x, state=state)[0], x) == ["group_norm_swish_forward"]
        with pytest.raises(TypeError):
            norm(x, state, state)
        pool = eqx.nn.AvgPool2d(3, 1, 1)
        np.testing.assert_allclose(pool(x, key=None), eqx.nn.AvgPool2d.__call__.__wrapped__(pool, x), atol=1e-6)
    with pytest.raises(TypeError):
        norm(x, state, state)
    module = nnx.GroupNorm(8, num_groups=2, rngs=nnx.Rngs(0))
    images, mask = cases._randn((2, 5, 6, 8), 9), cases._randn((2, 5, 6, 8), 10) > 0
    expected = module(images, mask=mask)
    with fj.reach():
        assert np.asarray(module(images, mask=mask)).tobytes() == np.asarray(expected).tobytes()
        assert "group_norm_swish_forward" in _compiled_targets(lambda x: module(x), images)
