"""fastbwd.jax's decision (docs/semantics.md §8, "Never slower"; fastbwd/jax/_decide.py): every
function that would emit a fastbwd FFI call decides at trace time, from static shapes, between
fastbwd's kernels and JAX's own code. Below its threshold the program holds no fastbwd call: the
drop-ins and everything ``reach`` serves trace the library's own function (the same jaxpr, the
same compiled instructions, the same bits), the PyTorch-shaped functions plain JAX of their
semantics (fastbwd's results to float tolerance, JAX's own gradients, under jit, grad, vmap);
from the threshold on, fastbwd's program, the one the policy "always" traces at every size. The
policy: ``fj.policy()``, ``fj.set_policy()``, ``reach(policy=...)``, ``FASTBWD_POLICY``, each part
of JAX's cache key. (Two devices: tests/jax_two_devices.py.)"""

import contextlib
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import jax_reach_cases as cases  # noqa: E402

import fastbwd  # noqa: E402
import fastbwd.jax as fj  # noqa: E402
from fastbwd import _dispatch  # noqa: E402
from fastbwd.jax import _calibrate, _decide  # noqa: E402

from conftest import child_environment, random  # noqa: E402

EDGE = cases.EDGE
#: A size no call reaches: the decision goes to JAX's own code.
NEVER = 1 << 62


def _randn(shape, seed):
    return jnp.asarray(random(shape, np.float32, seed))


def key(path, op):
    return f"jax/{path}/{op}/{_dispatch.thread_class(_decide.threads())}"


@contextlib.contextmanager
def auto(thresholds=None, everything=None):
    """The calling thread under the policy "auto", deciding with ``thresholds`` (``{"path/op":
    elements}`` at this process's thread count) over ``everything`` (a threshold for every JAX
    key: None keeps the defaults)."""
    table = {}
    if everything is not None:
        table = {
            f"jax/{path}/{op}/{t}": everything for path in ("traced", "dropin") for op in _dispatch.OPS for t in (1, 2)
        }
    table.update({key(*name.split("/")): value for name, value in (thresholds or {}).items()})
    with _decide.policy_block("auto"), _dispatch.using(table):
        yield


def jit(function):
    """``jax.jit`` of a new function calling ``function``: traced afresh. JAX's caches see the
    policy and reach, not the thresholds ``_dispatch.using`` sets (a program keeps the decisions
    it was traced with), and these tests change them between traces of one function."""
    return jax.jit(lambda *args: function(*args))


def targets(function, *args):
    """The fastbwd FFI targets in ``function``'s program (jitted afresh, lowered), sorted."""
    return sorted(re.findall(r"custom_call @fastbwd_(\w+)", jit(function).lower(*args).as_text()))


def gradient(f, argnums=0):
    return jax.grad(lambda *args: jnp.sum(f(*args) ** 2), argnums=argnums)


def leaves(tree):
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(tree)]


def assert_close(actual, expected, rtol=2e-5):
    for a, e in zip(leaves(actual), leaves(expected), strict=True):
        scale = max(float(np.abs(e).max()), 1.0)
        assert float(np.abs(a.astype(np.float64) - e).max()) <= rtol * scale


def assert_bitwise(actual, expected):
    for a, e in zip(leaves(actual), leaves(expected), strict=True):
        assert a.dtype == e.dtype and a.tobytes() == e.tobytes()


def _instructions(text):
    """A compiled program's text without its metadata (source files and lines, op names, the
    table of stack frames)."""
    text = re.sub(r"\n(?:FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*", "\n", text)
    return re.sub(r", metadata=\{[^}]*\}", "", text)


# ---- the PyTorch-shaped functions ---------------------------------------------------------------

#: name -> (op, f, args, argnums): channels first and last, every operator.
EXPLICIT = {
    "upsample": ("upsample_bilinear2d", lambda x: fj.upsample_bilinear2d(x, (10, 14)), ((2, 3, 5, 7),), 0),
    "upsample NHWC corners": (
        "upsample_bilinear2d",
        lambda x: fj.upsample_bilinear2d(x, (9, 13), True, layout="NHWC"),
        ((2, 5, 7, 3),),
        0,
    ),
    "avg_pool": ("avg_pool2d", lambda x: fj.avg_pool2d(x, 3, 2, 1), ((2, 3, 9, 8),), 0),
    # stride 1, "SAME": fastbwd's forward is its kernel too
    "avg_pool self-adjoint NHWC": (
        "avg_pool2d",
        lambda x: fj.avg_pool2d(x, 3, 1, 1, count_include_pad=False, layout="NHWC"),
        ((2, 9, 8, 3),),
        0,
    ),
    "avg_pool 3-D ceil": ("avg_pool2d", lambda x: fj.avg_pool2d(x, 2, 2, 0, ceil_mode=True), ((3, 9, 7),), 0),
    "pad": ("replication_pad2d", lambda x: fj.replication_pad2d(x, (2, 2, 1, 1)), ((2, 3, 5, 6),), 0),
    "pad NHWC crop": (
        "replication_pad2d",
        lambda x: fj.replication_pad2d(x, (-1, 2, 1, 0), layout="NHWC"),
        ((2, 5, 6, 3),),
        0,
    ),
    "group_norm_swish": (
        "group_norm_swish",
        lambda x, w, b: fj.group_norm_swish(x, 4, w, b),
        ((2, 8, 5, 6), (8,), (8,)),
        (0, 1, 2),
    ),
    "group_norm NHWC": (
        "group_norm_swish",
        lambda x, w, b: fj.group_norm_swish(x, 2, w, b, 1e-3, layout="NHWC", activate_swish=False),
        ((2, 5, 6, 6), (6,), (6,)),
        (0, 1, 2),
    ),
}
BOXES = np.array(
    [
        [0, 1.0, 1.0, 30.0, 20.0],
        [1, 8.0, 4.0, 60.0, 40.0],
        [1, -6.0, -2.0, 12.0, 70.0],
        [2.0, 1, 1, 3, 3],
        [np.nan, 1, 1, 9, 9],
    ],
    np.float32,
)
for layout, shape in (("NCHW", (2, 3, 12, 16)), ("NHWC", (2, 12, 16, 3))):
    for aligned in (False, True):
        EXPLICIT[f"roi_align {layout} aligned={aligned}"] = (
            "roi_align",
            lambda x, b, layout=layout, aligned=aligned: fj.roi_align(x, b, (3, 4), 0.25, 2, aligned, layout=layout),
            (shape, BOXES),
            0,
        )


def _explicit(name):
    op, f, shapes, argnums = EXPLICIT[name]
    args = tuple(_randn(s, i + 1) if isinstance(s, tuple) else jnp.asarray(s) for i, s in enumerate(shapes))
    return op, f, args, argnums


def _operator_and_layout(name):
    """A case's features for the quick set's cover (tests/_covering.py): its operator and layout."""
    return EXPLICIT[name][0], "NHWC" if "NHWC" in name else "NCHW"


@pytest.mark.covering(key=_operator_and_layout, strength=1)  # each case traces and compiles its own programs
@pytest.mark.parametrize("name", list(EXPLICIT))
def test_explicit_functions_decide_at_their_threshold(name):
    """At its threshold (the input's size) a function's program holds its fastbwd calls (those
    of the policy "always"); one element short of it, none: plain JAX of the same semantics,
    whose values and JAX-made gradients equal fastbwd's to float tolerance."""
    op, f, args, argnums = _explicit(name)
    step = gradient(f, argnums)
    with _decide.policy_block("always"):
        always, expected = targets(step, *args), jit(step)(*args)
        forward = jit(f)(*args)
    assert always, name
    size = args[0].size
    with auto({f"traced/{op}": size}):
        assert targets(step, *args) == always
        assert_bitwise(jit(step)(*args), expected)
    with auto({f"traced/{op}": size + 1}):
        assert targets(step, *args) == []
        assert targets(f, *args) == []
        assert_close(jit(step)(*args), expected, 1e-5)
        assert_close(jit(f)(*args), forward, 1e-6)
        assert_close(f(*args), forward, 1e-6)  # eagerly too


@pytest.mark.parametrize("name", ["upsample", "avg_pool", "pad", "group_norm_swish", "roi_align NCHW aligned=True"])
def test_explicit_functions_below_the_threshold_under_every_transformation(name):
    """Plain JAX below the threshold: vmap (of a batch that stays below it), forward mode and
    second derivatives, all JAX's own, equal to fastbwd's within float tolerance."""
    op, f, args, argnums = _explicit(name)
    batched = (jnp.stack([args[0], -args[0]]),) + args[1:]
    in_axes = (0,) + (None,) * (len(args) - 1)
    with auto(everything=NEVER):
        mapped = jit(jax.vmap(gradient(f, argnums), in_axes=in_axes))(*batched)
        assert targets(jax.vmap(gradient(f, argnums), in_axes=in_axes), *batched) == []
        tangent = jax.jvp(lambda x: f(x, *args[1:]), (args[0],), (jnp.ones_like(args[0]),))[1]
        hvp = jax.jvp(jax.grad(lambda x: jnp.sum(f(x, *args[1:]) ** 3)), (args[0],), (args[0],))[1]
    with _decide.policy_block("always"):
        expected = jit(jax.vmap(gradient(f, argnums), in_axes=in_axes))(*batched)
        expected_tangent = jax.jvp(lambda x: f(x, *args[1:]), (args[0],), (jnp.ones_like(args[0]),))[1]
        if op != "group_norm_swish":  # fastbwd's GroupNorm kernels have no second derivative
            expected_hvp = jax.jvp(jax.grad(lambda x: jnp.sum(f(x, *args[1:]) ** 3)), (args[0],), (args[0],))[1]
            assert_close(hvp, expected_hvp, 1e-5)
    assert_close(mapped, expected, 1e-5)
    assert_close(tangent, expected_tangent, 1e-6)


def test_vmap_counts_the_whole_batch():
    """Under ``jax.vmap`` one FFI call serves the batch: the decision counts every vmapped axis
    (the trace shows one example)."""
    x = _randn((2, 3, 2, 3, 5, 7), 4)  # two vmaps over (2, 3, 5, 7) examples of 210 elements
    step = jax.vmap(jax.vmap(gradient(EXPLICIT["upsample"][1])))
    with auto({"traced/upsample_bilinear2d": x.size}):
        assert targets(step, x) == ["upsample_bilinear2d_backward"]
    with auto({"traced/upsample_bilinear2d": x.size + 1}):
        assert targets(step, x) == []


def test_vmap_counts_the_mapped_axis_wherever_it_is():
    """A vmap over an axis other than the first (``in_axes=1``) counts that axis's size."""
    x = _randn((2, 3, 3, 5, 7), 17)  # axis 1 mapped: 3 examples (2, 3, 5, 7) of 210 elements
    step = jax.vmap(gradient(EXPLICIT["upsample"][1]), in_axes=1, out_axes=1)
    with auto({"traced/upsample_bilinear2d": x.size}):
        assert targets(step, x) == ["upsample_bilinear2d_backward"]
    with auto({"traced/upsample_bilinear2d": x.size + 1}):
        assert targets(step, x) == []


def test_adaptive_roi_align_stays_fastbwds():
    """RoIAlign with an adaptive sampling ratio has a data-dependent sample count, which plain
    JAX's static shapes cannot follow: fastbwd's at every size."""
    x = _randn((2, 3, 12, 16), 5)
    step = jax.grad(lambda x: jnp.sum(fj.roi_align(x, jnp.asarray(BOXES), 3, 0.25, 0) ** 2))
    with auto(everything=NEVER):
        assert targets(step, x) == ["roi_align_backward", "roi_align_forward"]


def test_errors_are_the_same_under_both_policies():
    """Arguments are checked before the decision: a bad call raises the same ParamError."""
    x = _randn((2, 3, 5, 7), 6)
    messages = []
    for policy in ("always", "auto"):
        with _decide.policy_block(policy), pytest.raises(fastbwd.ParamError) as error:
            fj.replication_pad2d(x, (9, 0, 0, 0))
        messages.append(str(error.value))
    assert messages[0] == messages[1] and "padding" in messages[0]


# ---- the drop-ins and reach ----------------------------------------------------------------------


def _dropins():
    """name -> (op, ours, the library's, args): fastbwd's drop-ins and the calls they replace."""
    found = {
        "resize": (
            "upsample_bilinear2d",
            lambda x: fj.resize(x, (2, 12, 14, 4), "bilinear"),
            lambda x: jax.image.resize(x, (2, 12, 14, 4), "bilinear"),
            (_randn((2, 6, 7, 4), 7),),
        ),
        "pad": (
            "replication_pad2d",
            lambda x: fj.pad(x, EDGE, mode="edge"),
            lambda x: jnp.pad(x, EDGE, mode="edge"),
            (_randn((2, 6, 7, 4), 8),),
        ),
    }
    try:
        import flax.linen as nn

        from fastbwd.jax import linen
    except ImportError:
        return found
    x = _randn((2, 6, 7, 8), 9)
    found["avg_pool"] = (
        "avg_pool2d",
        lambda x: fj.avg_pool(x, (3, 3), (2, 2), ((1, 1), (1, 1))),
        lambda x: nn.avg_pool(x, (3, 3), (2, 2), ((1, 1), (1, 1))),
        (x,),
    )
    ours, theirs = linen.GroupNorm(num_groups=4, swish=True), nn.GroupNorm(num_groups=4)
    params = theirs.init(jax.random.key(0), x)
    found["linen.GroupNorm"] = (
        "group_norm_swish",
        ours.apply,
        lambda params, x: nn.swish(theirs.apply(params, x)),
        (params, x),
    )
    return found


DROPINS = _dropins()


@pytest.mark.parametrize("name", list(DROPINS))
def test_dropins_decide_at_their_threshold(name):
    """A drop-in from its threshold on: fastbwd's program (the policy "always"'s); one element
    short: the library's own call, the same jaxpr, compiled instructions and bits."""
    op, ours, theirs, args = DROPINS[name]
    x = args[-1]
    argnums = tuple(range(len(args)))
    with _decide.policy_block("always"):
        always = targets(gradient(ours, argnums), *args)
    assert always
    library = gradient(theirs, argnums)
    with auto({f"dropin/{op}": x.size}):
        assert targets(gradient(ours, argnums), *args) == always
    with auto({f"dropin/{op}": x.size + 1}):
        step = gradient(ours, argnums)
        assert str(jax.make_jaxpr(step)(*args)) == str(jax.make_jaxpr(library)(*args))
        compiled = jit(step).lower(*args).compile()
        assert _instructions(compiled.as_text()) == _instructions(jit(library).lower(*args).compile().as_text())
        assert_bitwise(compiled(*args), jit(library)(*args))
        assert_bitwise(jit(ours)(*args), jit(theirs)(*args))


def _library(name):
    """A reach case's library, for the quick set's cover: JAX's own functions, linen, NNX or Equinox."""
    return ("linen" if name.startswith("nn.") else name.split(".")[0].replace("jnp", "jax"),)


@pytest.mark.covering(key=_library, strength=1)  # each case compiles four programs
@pytest.mark.parametrize("name", cases.NAMES)
def test_reach_below_the_thresholds_is_the_libraries_program(name):
    """Each case of tests/jax_reach_cases.py (Flax linen and NNX blocks, an Equinox block under
    vmap, the library functions) traced inside reach with every call below its threshold is
    the program traced outside reach: the same jaxpr, compiled instructions and bits; with the
    thresholds at 0, fastbwd's (the policy "always"'s) program."""
    loss, args = cases.case(name)
    step = jax.grad(loss)
    outside = jit(step).lower(*args).compile()
    with auto(everything=NEVER), fj.reach():
        inside = jit(step).lower(*args).compile()
        jaxpr = str(jax.make_jaxpr(step)(*args))
    assert jaxpr == str(jax.make_jaxpr(step)(*args)), name
    assert _instructions(inside.as_text()) == _instructions(outside.as_text()), name
    assert_bitwise(inside(*args), outside(*args))
    with fj.reach(policy="always"):
        always = _instructions(jit(step).lower(*args).compile().as_text())
    with auto(everything=0), fj.reach():
        assert _instructions(jit(step).lower(*args).compile().as_text()) == always, name
    if name != "jax.nn.silu":
        assert 'custom_call_target="fastbwd_' in always, name


def test_every_reach_case_is_named():
    """The parametrised test above takes its cases by name: none of tests/jax_reach_cases.py's left out."""
    found = cases.cases()
    assert set(found) <= set(cases.NAMES)
    for name in found:
        loss, args = cases.case(name)
        assert loss.__code__ == found[name][0].__code__, name


def test_reach_decides_each_call_by_its_size():
    """One block, two sizes: each resize decides alone (the larger one on fastbwd)."""
    small, large = _randn((1, 4, 4, 2), 10), _randn((1, 8, 8, 2), 11)

    def loss(small, large):
        return jnp.sum(cases._up(small) ** 2) + jnp.sum(cases._up(large) ** 2)

    with auto({"dropin/upsample_bilinear2d": large.size}), fj.reach():
        assert targets(jax.grad(loss, argnums=(0, 1)), small, large) == ["upsample_bilinear2d_backward"]


def test_an_equinox_model_under_vmap_decides_on_the_batch():
    """An Equinox model sees one example (vmap makes the batch): its GroupNorm decides on the
    whole batch's size, as one FFI call serves it."""
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.GroupNorm(2, 4)
    x = _randn((3, 4, 5, 5), 12)
    step = jax.grad(lambda model, x: jnp.sum(jax.vmap(jax.nn.silu)(jax.vmap(model)(x)) ** 2), argnums=1)
    with auto({"dropin/group_norm_swish": x.size}), fj.reach():
        assert targets(step, model, x) == ["group_norm_swish_backward", "group_norm_swish_forward"]
    with auto({"dropin/group_norm_swish": x.size + 1}), fj.reach():
        assert targets(step, model, x) == []


def _one_task_calls():
    """``(name, program's fastbwd targets of x, one image, two images)``: GroupNorm+Swish calls
    whose one image is one task of fastbwd's kernels (one group channels first, a channels-last
    image of up to 320 channels): the explicit function, and Equinox's, linen's and NNX's where
    installed."""
    weight, bias = jnp.ones(8), jnp.zeros(8)
    nchw, nhwc = ((1, 8, 3, 5), (2, 8, 3, 5)), ((1, 3, 5, 8), (2, 3, 5, 8))
    explicit = gradient(lambda x: fj.group_norm_swish(x, 1, weight, bias))
    calls = [("explicit", lambda x: targets(explicit, x), nchw)]
    try:
        import equinox as eqx
    except ImportError:
        pass
    else:
        model = eqx.nn.GroupNorm(1, 8)
        step = jax.grad(lambda model, x: jnp.sum(jax.vmap(jax.nn.silu)(jax.vmap(model)(x)) ** 2), argnums=1)
        calls.append(("equinox", lambda x: targets(step, model, x), nchw))
    try:
        import flax.linen as nn

        from fastbwd.jax import linen
    except ImportError:
        pass
    else:
        norm = linen.GroupNorm(num_groups=4, swish=True)
        params = nn.GroupNorm(num_groups=4).init(jax.random.key(0), _randn(nhwc[0], 24))
        calls.append(("linen", lambda x: targets(gradient(norm.apply, 1), params, x), nhwc))
        from flax import nnx as flax_nnx

        from fastbwd.jax import nnx

        nnx_norm = nnx.GroupNorm(8, num_groups=4, swish=True, rngs=flax_nnx.Rngs(0))
        calls.append(("nnx", lambda x: targets(gradient(lambda x: nnx_norm(x)), x), nhwc))
    return [(name, found, _randn(one, 20), _randn(two, 21)) for name, found, (one, two) in calls]


def test_a_call_leaving_threads_idle_is_jaxs(monkeypatch):
    """A GroupNorm+Swish call of one image that fastbwd's kernels take as one task: on two
    threads JAX's, whatever its size; with two images, or on one thread, fastbwd's."""
    served = ["group_norm_swish_backward", "group_norm_swish_forward"]
    everything = {"dropin/group_norm_swish": 0, "traced/group_norm_swish": 0}
    calls = _one_task_calls()
    monkeypatch.setattr(_decide, "threads", lambda devices=1: 2)
    for name, found, one_image, two_images in calls:
        with auto(everything), fj.reach():
            assert found(one_image) == [], name
            assert found(two_images) == served, name
    monkeypatch.setattr(_decide, "threads", lambda devices=1: 1)
    for name, found, one_image, _ in calls:
        with auto(everything), fj.reach():
            assert found(one_image) == served, name


def test_the_equinox_drop_in_with_swish_below_its_threshold_is_the_librarys_pair():
    """fastbwd.jax.equinox.GroupNorm(swish=True) on a call JAX's code serves: Equinox's GroupNorm
    and then jax.nn.swish, the library's bits."""
    eqx = pytest.importorskip("equinox")
    from fastbwd.jax import equinox as fastbwd_equinox

    ours, theirs = fastbwd_equinox.GroupNorm(2, 8, swish=True), eqx.nn.GroupNorm(2, 8)
    x = _randn((8, 5, 5), 26)
    with auto(everything=NEVER):
        assert targets(lambda x: ours(x), x) == []
        assert_bitwise(jax.jit(lambda x: ours(x))(x), jax.jit(lambda x: jax.nn.swish(theirs(x)))(x))


def test_the_users_model_is_unchanged_below_the_thresholds():
    """An Equinox model reached below the thresholds: its class, pytree structure and leaves are
    the user's, and its gradients the library's bits."""
    eqx = pytest.importorskip("equinox")
    model = cases.equinox_model()
    before = (
        jax.tree_util.tree_structure(model),
        [np.asarray(leaf).tobytes() for leaf in leaves(eqx.filter(model, eqx.is_array))],
    )
    x = _randn((3, 8, 5, 5), 13)
    plain = eqx.filter_jit(eqx.filter_grad(cases.equinox_loss))(model, x)
    with auto(everything=NEVER):
        reached = eqx.filter_jit(eqx.filter_grad(fj.reach(cases.equinox_loss)))(model, x)
    assert type(model) is cases.EquinoxBlock and jax.tree_util.tree_structure(model) == before[0]
    assert [np.asarray(leaf).tobytes() for leaf in leaves(eqx.filter(model, eqx.is_array))] == before[1]
    assert_bitwise(reached, plain)


# ---- the policy ---------------------------------------------------------------------------------


@pytest.fixture
def policy_restored():
    saved = _decide._POLICY.get_global()
    yield
    _decide._POLICY.set_global(saved)


def test_the_policy_is_set_for_the_process_and_for_a_reach(policy_restored):
    assert fj.policy() == os.environ.get("FASTBWD_POLICY", "auto") == "always"  # tests/conftest.py
    fj.set_policy("auto")
    assert fj.policy() == "auto"
    seen = []
    with fj.reach(policy="always"):
        seen.append(fj.policy())
        thread = threading.Thread(target=lambda: seen.append(fj.policy()))
        thread.start()
        thread.join()
        with fj.reach():  # a nested reach keeps the outer one's
            seen.append(fj.policy())
        fj.reach(lambda: seen.append(fj.policy()), policy="auto")()
    seen.append(fj.policy())
    assert seen == ["always", "auto", "always", "auto", "auto"]
    for bad in ("never", None, "AUTO"):
        if bad is not None:
            with pytest.raises(ValueError, match="policy must be one of 'auto', 'always'"):
                fj.set_policy(bad)
            with pytest.raises(ValueError, match="policy must be one of"):
                fj.reach(policy=bad)
    assert fj.policy() == "auto"


def test_a_policy_change_retraces_a_jitted_function(policy_restored):
    """The policy is part of JAX's trace and compile caches: a jitted function traced under
    "auto" is traced again under "always" (and reaches fastbwd there), and each policy's
    program is reused when it comes back."""
    x = _randn((2, 3, 5, 7), 14)
    traces = []

    @jax.jit
    def step(x):
        traces.append(fj.policy())
        return gradient(EXPLICIT["upsample"][1])(x)

    with _dispatch.using({key("traced", "upsample_bilinear2d"): x.size + 1}):
        fj.set_policy("auto")
        plain = step(x)
        assert targets(step, x) == []
        fj.set_policy("always")
        served = step(x)
        assert targets(step, x) == ["upsample_bilinear2d_backward"]
        fj.set_policy("auto")
        assert_bitwise(step(x), plain)  # the program of "auto", from the cache
        fj.set_policy("always")
        assert_bitwise(step(x), served)  # the program of "always", from the cache
        fj.set_policy("auto")
        with fj.reach(policy="always"):  # reach is in the key too: traced again, under "always"
            assert_bitwise(step(x), served)
    assert traces == ["auto", "always", "always"]
    assert_close(plain, served, 1e-5)


def test_threads_trace_under_their_own_policy():
    """Thread A traces inside ``reach(policy="always")`` while thread B traces under "auto": each
    gets its own policy's program (B below the threshold: no fastbwd call)."""
    x = _randn((2, 3, 5, 7), 15)
    step = gradient(EXPLICIT["pad"][1])
    found, entered, release = {}, threading.Event(), threading.Event()

    def thread_a():
        with fj.reach(policy="always"):
            entered.set()
            found["a"] = targets(step, x)
            release.wait(60)
            found["a again"] = targets(step, x)

    a = threading.Thread(target=thread_a)
    with auto(everything=NEVER):
        a.start()
        try:
            assert entered.wait(60)
            found["b"] = targets(step, x)
        finally:
            release.set()
            a.join()
    assert found == {"a": ["replication_pad2d_backward"], "a again": ["replication_pad2d_backward"], "b": []}


def _run(code, **environment):
    env = child_environment(tests=True, **environment)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


@pytest.mark.parametrize(
    "value, expected", [("auto", "auto"), ("always", "always"), ("", "auto"), ("sometimes", "auto")]
)
def test_the_environment_variable_sets_the_starting_policy(value, expected):
    """FASTBWD_POLICY, read when fastbwd is imported, is the policy fastbwd.jax starts with
    (anything else warns and means "auto"); it decides what a tiny call traces."""
    code = """
import re, jax, jax.numpy as jnp
import fastbwd.jax as fj
x = jnp.ones((1, 1, 2, 2))
text = jax.jit(jax.grad(lambda x: jnp.sum(fj.upsample_bilinear2d(x, (4, 4)) ** 2))).lower(x).as_text()
print(fj.policy(), "custom_call @fastbwd_" in text)
"""
    out, err = _run(code, FASTBWD_POLICY=value)
    assert out.split() == [expected, str(expected == "always")]
    assert ("FASTBWD_POLICY='sometimes'" in err) == (value == "sometimes")


def test_a_jax_without_user_contexts_still_has_a_per_thread_policy():
    """Without ``jax.make_user_context`` the policy is still per process with a per-thread
    block (JAX's cache then does not see it: docs/jax.md)."""
    code = """
import threading, jax
del jax.make_user_context
import fastbwd.jax as fj
from fastbwd.jax import _decide
seen = [fj.policy()]
fj.set_policy("always")
with fj.reach(policy="auto"):
    seen.append(fj.policy())
    t = threading.Thread(target=lambda: seen.append(fj.policy())); t.start(); t.join()
seen.append(fj.policy())
print(type(_decide._POLICY).__name__, seen)
"""
    out, _ = _run(code, FASTBWD_POLICY="auto")
    assert out.strip() == "_Setting ['auto', 'auto', 'always', 'always']"


# ---- the thread count and the defaults ----------------------------------------------------------


def test_the_thread_count_is_numbas_pool_shared_by_the_devices(monkeypatch):
    """The handler runs the kernels on Numba's pool size (XLA's threads never change it),
    divided among the devices of the process that run a program at once; 1 when serial."""
    import numba

    from fastbwd.kernels import _jit

    pool = numba.config.NUMBA_NUM_THREADS
    assert _decide.threads() == pool and _decide.threads(2) == max(1, pool // 2) and _decide.threads(pool * 2) == 1
    monkeypatch.setattr(_jit, "_serial_only", True)
    assert _decide.threads() == 1


def test_every_measured_path_has_defaults_for_both_thread_counts():
    names = {name.rsplit("/", 1)[0] for name in _dispatch.DEFAULTS if name.startswith("jax/")}
    assert names == {f"jax/{name}" for name in _calibrate.MEASURED}
    for name in names:
        assert 0 < _dispatch.DEFAULTS[f"{name}/1"] and 0 < _dispatch.DEFAULTS[f"{name}/2"], name
    assert "traced" in _dispatch.PATHS and "dropin" in _dispatch.PATHS


def test_dtype_and_layout_refine_a_threshold():
    """A stored threshold refined by dtype and layout (".../bfloat16", ".../float32/NHWC") decides
    the calls of that dtype and layout only."""
    base = key("traced", "upsample_bilinear2d")
    x = _randn((2, 3, 5, 7), 16)
    nchw, nhwc = EXPLICIT["upsample"][1], EXPLICIT["upsample NHWC corners"][1]
    table = {base: 0, f"{base}/bfloat16": NEVER, f"{base}/float32/NHWC": NEVER}
    with _decide.policy_block("auto"), _dispatch.using(table):
        assert targets(gradient(nchw), x) == ["upsample_bilinear2d_backward"]
        assert targets(gradient(nchw), x.astype(jnp.bfloat16)) == []
        assert targets(gradient(nhwc), x) == []


# ---- calibration -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", _calibrate.MEASURED)
def test_calibration_times_fastbwd_against_jax_own_code(name):
    """Each measured path's two programs: fastbwd's calls in the first, none in the second."""
    made = _calibrate.programs(*name.split("/"), (1, 16, 6, 6), _decide.threads())
    if made is None:
        pytest.skip("its library is not installed")
    (ours, theirs), _ = made
    calls = [re.findall(r'custom_call_target="fastbwd_\w+"', program.as_text()) for program in (ours, theirs)]
    assert calls[0] and not calls[1]


@pytest.mark.slow
def test_calibrate_measures_each_thread_count_in_a_process_of_its_own():
    """``_calibrate.calibrate`` times fastbwd's side against JAX's on each ladder size, in a new
    process per thread count (started with that many Numba threads and CPUs), and returns each
    key's crossover."""
    lines = []
    ladder = [(1, 2, 3, 3), (2, 16, 48, 48)]
    found = _calibrate.calibrate(
        threads=(1,), seconds=0.05, say=lines.append, measured=("traced/replication_pad2d",), ladder=ladder
    )
    assert list(found) == ["jax/traced/replication_pad2d/1"]
    assert found["jax/traced/replication_pad2d/1"] in (18, 73728, 2 * 73728)  # a ladder size, or past it
    assert lines and lines[0].startswith("jax/traced/replication_pad2d/1: fastbwd from ")
    out, _ = _run(
        "import os, fastbwd.jax; from fastbwd.jax import _calibrate, _decide\n"
        "_calibrate.confine(sorted(os.sched_getaffinity(0))[:1])\n"
        "print(_decide.threads(), len(os.sched_getaffinity(0)))",
        NUMBA_NUM_THREADS="1",
    )
    assert out.split() == ["1", "1"]
    assert _calibrate.cpus_option(len(os.sched_getaffinity(0))) == []


def test_calibrate_stores_the_jax_thresholds(tmp_path, monkeypatch, capsys):
    """``python -m fastbwd --calibrate`` stores the JAX bridge's thresholds beside the kernel
    cache, where the decision reads them."""
    import fastbwd.__main__ as cli

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    _dispatch.forget()
    name = "jax/traced/replication_pad2d/1"
    monkeypatch.setattr(_calibrate, "calibrate", lambda say: {name: 4321})
    try:
        assert cli.main(["--calibrate", "jax"]) == 0
        assert _dispatch.threshold("jax", "traced", "replication_pad2d", threads=1) == 4321
        assert "fastbwd.jax" in capsys.readouterr().out
    finally:
        monkeypatch.undo()
        _dispatch.forget()


# ---- the sweep (bench/jax_sweep.py), as the main job runs it -------------------------------------


@pytest.mark.slow
def test_the_sweep_runs_its_rows_in_a_process_of_its_own():
    """``python -m bench.jax_sweep`` (what ``python3 -m bench --full`` starts per thread count)
    checks and times each row in a new process that exits by itself, under the policy "auto"
    whatever the environment's: a tiny explicit call and a tiny reached call both run JAX's own
    code, the reached one the library's very program."""
    from bench import jax_sweep
    from bench.timing import Settings

    settings = Settings(round_seconds=0.002, min_rounds=2, tolerance=1.0, budget=0.2, max_rounds=3)
    ops = ["up"] + (["reach-pad"] if "reach-pad" in jax_sweep.operations() else [])
    rows = jax_sweep.in_child(1, settings, sizes=[(1, 2, 4, 4)], ops=ops, timeout=600)
    assert [row["id"] for row in rows] == [f"SJ.{op}.1.1t" for op in ops]
    assert rows[0]["note"] == "JAX's own code"
    if len(rows) > 1:
        assert rows[1]["note"] == "JAX's own code, the same program"
    for row in rows:
        assert row["threads"] == 1 and row["shape"] == [1, 2, 4, 4] and row["seconds"] > 0 < row["base_seconds"]
