"""Every program that uses fastbwd ends by itself (issue 27; docs/design.md, "fastbwd.jax").

Each program runs as its own Python process with a time limit: a jitted fastbwd.jax gradient
still running when the program ends once left the interpreter waiting forever at exit. The
kernels are compiled into the disk cache first (the same code, run in this process), so the time
a child takes is its own start-up and its exit, not the compiler's. Where this process has the
disk cache off (``FASTBWD_CACHE=0``, as the mutation check runs), the children use it anyway and
each program first runs once without the limit to fill it.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest

import fastbwd._config

#: Each test runs whole programs in processes of their own: the full run's (.ci/run), not the quick one's.
pytestmark = pytest.mark.slow

#: A program that ends well has exited in a few seconds; a hang runs into this.
LIMIT = 30


#: The children's environment: the disk cache on (see the module docstring).
CHILD_ENV = {name: value for name, value in os.environ.items() if name != "FASTBWD_CACHE"}


def run_program(code, expect_status=0, limit=LIMIT):
    """Run ``code`` as ``python -c``, require it to exit by itself with ``expect_status`` within
    ``limit`` seconds, and return the finished process."""
    start = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=limit,
            stdin=subprocess.DEVNULL,
            env=CHILD_ENV,
        )
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"the program did not exit within {limit} s (stderr: {timeout.stderr!r})")
    elapsed = time.monotonic() - start
    assert result.returncode == expect_status, (result.returncode, result.stdout, result.stderr)
    assert elapsed < limit
    return result


def warm(code):
    """Compile what ``code`` calls into the disk cache: by running it here, or, where this
    process has no disk cache, once as a child with no tight limit."""
    if fastbwd._config.CACHE:
        exec(compile(code, "<program>", "exec"), {})  # noqa: S102 - the test's own program
    else:
        run_program(code, limit=300)


def warm_and_run(code, limit=None):
    """Run ``code`` as its own process, with the compiler's work done beforehand, within ``limit``
    seconds (default :data:`LIMIT`)."""
    warm(code)
    return run_program(code, limit=limit or LIMIT)


# ---- fastbwd.jax: jitted gradients dispatched, never waited for -------------------------------

JAX_SETUP = """
import jax, jax.numpy as jnp
import fastbwd.jax as fj

x = jax.random.normal(jax.random.key(0), (2, 64, 32, 32))
weight, bias = jnp.ones(64), jnp.zeros(64)
boxes = jnp.array([[0, 4.0, 4.0, 40.0, 30.0], [1, 10.0, 0.0, 64.0, 64.0]])
"""

# The README's sizes; each loss ends in a sum of squares so every gradient is a real one.
JAX_LOSSES = {
    "upsample_bilinear2d": "fj.upsample_bilinear2d(x, (64, 64))",
    "avg_pool2d": "fj.avg_pool2d(x, 2)",
    "replication_pad2d": "fj.replication_pad2d(x, (1, 1, 1, 1))",
    "roi_align": "fj.roi_align(x, boxes, 7, spatial_scale=0.5, sampling_ratio=2, aligned=True)",
    "group_norm_swish": "fj.group_norm_swish(x, 32, weight, bias)",
    "all five": (
        "fj.roi_align(fj.avg_pool2d(fj.replication_pad2d(fj.upsample_bilinear2d("
        "fj.group_norm_swish(x, 32, weight, bias), (64, 64)), (1, 1, 1, 1)), 2), boxes, 7, "
        "spatial_scale=0.5, sampling_ratio=2, aligned=True)"
    ),
}


def jax_program(expression, keep_result=True):
    target = "grads = " if keep_result else ""
    return JAX_SETUP + textwrap.dedent(f"""
        def loss(x, weight, bias, boxes):
            return jnp.sum(({expression}) ** 2)

        {target}jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, weight, bias, boxes)
        """)


@pytest.mark.parametrize("name", list(JAX_LOSSES))
def test_a_jitted_gradient_left_running_at_exit_does_not_hang(name):
    pytest.importorskip("jax")
    warm_and_run(jax_program(JAX_LOSSES[name]))


def test_a_jitted_gradient_whose_result_is_dropped_does_not_hang():
    pytest.importorskip("jax")
    warm_and_run(jax_program(JAX_LOSSES["all five"], keep_result=False))


def test_an_exception_after_a_jitted_call_exits_with_its_traceback():
    pytest.importorskip("jax")
    code = jax_program(JAX_LOSSES["all five"])
    warm(code)
    result = run_program(code + "raise RuntimeError('the program failed after the call')\n", 1)
    assert "Traceback (most recent call last)" in result.stderr
    assert "RuntimeError: the program failed after the call" in result.stderr


def test_the_users_atexit_handlers_still_run_and_see_the_results():
    """The gate closes before JAX's clean-up, after waiting for the arrays the program holds: an
    atexit handler registered before the bridge was imported still reads a finished gradient."""
    pytest.importorskip("jax")
    program = jax_program(JAX_LOSSES["avg_pool2d"])
    warm(program)
    code = (
        textwrap.dedent("""
        import atexit
        import numpy as np

        def report():
            print("atexit handler:", np.asarray(grads[0]).shape, flush=True)

        atexit.register(report)
        """)
        + program
    )
    result = run_program(code)
    assert "atexit handler: (2, 64, 32, 32)" in result.stdout


def test_a_call_inside_the_handler_at_exit_finishes_first():
    """The exit hook waits for a call already inside the gate: its handler runs to its end while
    the interpreter can still give it the GIL (its result is dropped, so nothing else waits for
    it, and an array held to the end keeps JAX's client alive into finalisation, as in the
    programs that hung)."""
    pytest.importorskip("jax")
    code = textwrap.dedent("""
        import threading, time
        import jax, jax.numpy as jnp
        from fastbwd.jax import _ffi

        entered = threading.Event()

        def adapter(inputs, outputs, config):
            entered.set()
            time.sleep(3)  # the main thread reaches the end, and JAX its clean-up, meanwhile
            outputs[0][...] = inputs[0]
            print("the handler finished", flush=True)

        name = _ffi.target("exit_probe", adapter, fold=False)
        # enough work before the call that XLA runs it on its own threads, not inline in call()
        call = jax.jit(lambda x: _ffi.call(name, [jnp.sin(x) * 2], [jax.ShapeDtypeStruct(x.shape, x.dtype)], {})[0])
        x = jnp.ones(1 << 22)  # held to the end: JAX's client then outlives JAX's atexit clean-up
        call(x)
        assert entered.wait(20)
        """)
    result = run_program(code)
    assert "the handler finished" in result.stdout


def test_a_call_after_the_gate_closed_raises_instead_of_entering_python():
    """What a fastbwd call dispatched after the exit hook gets: XLA's error, raised in the
    caller, without the handler running."""
    pytest.importorskip("jax")
    code = JAX_SETUP + textwrap.dedent("""
        from fastbwd.jax import _gate
        grad = jax.jit(jax.grad(lambda x: jnp.sum(fj.avg_pool2d(x, 2) ** 2)))
        grad(x).block_until_ready()
        _gate._close()
        try:
            grad(x + 1).block_until_ready()
        except Exception as error:
            print("refused:", "the Python interpreter is exiting" in str(error))
        assert _gate.in_flight() == 0
        """)
    result = run_program(code)
    assert "refused: True" in result.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_with_no_calls_in_flight():
    """A call in flight in another thread at fork time is not the child's: its exit hook would
    otherwise wait for it forever."""
    pytest.importorskip("jax")
    code = textwrap.dedent("""
        import os, sys, warnings
        import fastbwd.jax
        from fastbwd.jax import _gate
        warnings.simplefilter("ignore")  # os.fork() in a process with JAX's threads
        _gate._state[0] = 1  # as if a call were inside the gate on another thread
        pid = os.fork()
        if pid == 0:
            sys.exit(0 if _gate.in_flight() == 0 else 3)  # the child's exit hook runs here
        _gate._state[0] = 0
        _, status = os.waitpid(pid, 0)
        print("child exit status", os.waitstatus_to_exitcode(status))
        """)
    result = run_program(code)
    assert "child exit status 0" in result.stdout


# ---- the other ways in ---------------------------------------------------------------------


def test_the_torch_bridge_with_enabled_exits():
    pytest.importorskip("torch")
    warm_and_run(
        textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F
        import fastbwd.torch as ft

        model = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear"), nn.ReplicationPad2d(1),
                              nn.AvgPool2d(2))
        x = torch.randn(2, 8, 16, 16, requires_grad=True)
        with ft.enabled():
            model(x).square().sum().backward()
        assert x.grad.shape == x.shape
        """)
    )


def test_a_plain_numpy_call_exits():
    warm_and_run(
        textwrap.dedent("""
        import numpy as np, fastbwd
        g = fastbwd.replication_pad2d_backward(np.ones((1, 1, 7), np.float32), (1, 1, 5), (1, 1, 0, 0))
        assert g.tolist() == [[[2, 1, 1, 1, 2]]]
        """)
    )
