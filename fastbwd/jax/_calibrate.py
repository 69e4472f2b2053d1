"""This machine's thresholds for the JAX bridge (``python -m fastbwd --calibrate``;
``fastbwd._dispatch`` stores them beside Numba's cache and decides with them).

For each path and operator (:data:`MEASURED`) and thread count, ``jax.jit(jax.grad(loss))`` of
one call (``loss = sum(f(x) ** 2)``) is timed on the sizes of ``_dispatch.LADDER``: the
function with the decision forced to fastbwd's kernels against the same function with the
decision forced to JAX's own code (what the policy ``"auto"`` traces below the crossover: plain
JAX of the same semantics for the PyTorch-shaped functions, the library's function for the
drop-ins), in alternating rounds, each side's program compiled once beforehand. The threshold is
``_dispatch.crossover`` of the ratios.

Each thread count is measured in a process of its own (``python -m fastbwd.jax._calibrate
--threads N``, printing its points as JSON): started with ``NUMBA_NUM_THREADS=N`` and confined
to N of the machine's CPUs, so that fastbwd's kernels and XLA's own threads have those cores
alike (the handler runs on Numba's pool size, fastbwd/jax/_decide.py).
"""

import argparse
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from .. import _dispatch
from . import _decide

#: "path/op" measured: the PyTorch-shaped functions channels first, the drop-ins channels last.
MEASURED = tuple(f"traced/{op}" for op in _dispatch.OPS) + tuple(
    f"dropin/{op}" for op in ("upsample_bilinear2d", "avg_pool2d", "replication_pad2d", "group_norm_swish")
)
#: A threshold no size reaches: the decision forced to JAX's own code.
NEVER = 1 << 62


def _randn(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def boxes(per_image, input_shape, spatial_scale, seed=0):
    """``(per_image * N, 5)`` boxes spread over the batch of an NCHW ``input_shape``, in image
    coordinates (a quarter to a half of the image each)."""
    rng = np.random.default_rng(seed)
    batch, _, height, width = input_shape
    count = per_image * batch
    image_h, image_w = height / spatial_scale, width / spatial_scale
    x1, y1 = rng.uniform(0, image_w / 2, count), rng.uniform(0, image_h / 2, count)
    x2 = x1 + rng.uniform(image_w / 4, image_w / 2, count)
    y2 = y1 + rng.uniform(image_h / 4, image_h / 2, count)
    return jnp.asarray(np.stack([np.arange(count) % batch, x1, y1, x2, y2], axis=1).astype(np.float32))


def call(path, op, shape):
    """``(f, args, argnums)``: one call of ``op`` on ``path`` at ``shape`` (N, C, H, W), as the
    sweep and the calibration time it (channels last for the drop-ins), and the arguments it is
    differentiated by; None for a drop-in whose library is not installed. Every array is an
    argument (a constant of the program is one XLA may fold)."""
    import fastbwd.jax as fj

    n, c, h, w = shape
    if path == "traced":
        x = _randn(shape, 1)
        if op == "upsample_bilinear2d":
            return (lambda x: fj.upsample_bilinear2d(x, (2 * h, 2 * w))), (x,), (0,)
        if op == "avg_pool2d":
            return (lambda x: fj.avg_pool2d(x, 3, 2, 1)), (x,), (0,)
        if op == "replication_pad2d":
            return (lambda x: fj.replication_pad2d(x, (2, 2, 1, 1))), (x,), (0,)
        if op == "group_norm_swish":
            weight, bias = _randn((c,), 2), _randn((c,), 3)
            return (lambda x, w, b: fj.group_norm_swish(x, 8, w, b)), (x, weight, bias), (0, 1, 2)
        return (lambda x, rois: fj.roi_align(x, rois, 7, 0.25, 2, True)), (x, boxes(4, shape, 0.25)), (0,)
    x = _randn((n, h, w, c), 1)
    if op == "upsample_bilinear2d":
        return (lambda x: fj.resize(x, (n, 2 * h, 2 * w, c), "bilinear")), (x,), (0,)
    if op == "avg_pool2d":
        return (lambda x: fj.avg_pool(x, (3, 3), (2, 2), ((1, 1), (1, 1)))), (x,), (0,)
    if op == "replication_pad2d":
        return (lambda x: fj.pad(x, ((0, 0), (1, 1), (2, 2), (0, 0)), mode="edge")), (x,), (0,)
    try:
        from . import linen
    except ImportError:
        return None
    norm = linen.GroupNorm(num_groups=8, swish=True)
    return norm.apply, (norm.init(jax.random.key(0), x), x), (0, 1)


def programs(path, op, shape, threads):
    """``((fastbwd's program, JAX's program), args)``: ``jax.jit(jax.grad(sum(f(*args) ** 2)))``
    of :func:`call`, compiled with the decision forced to each side; None where :func:`call` is."""
    made = call(path, op, shape)
    if made is None:
        return None
    f, args, argnums = made
    name = f"jax/{path}/{op}/{_dispatch.thread_class(threads)}"
    compiled = []
    # fastbwd's side under "always": the program "auto" traces for fastbwd (decided at trace
    # time, nothing at run time), whatever else the decision would count (a call's tasks)
    for policy, threshold in (("always", 0), ("auto", NEVER)):
        loss = jax.jit(jax.grad(lambda *args: jnp.sum(f(*args) ** 2), argnums=argnums))
        with _decide.policy_block(policy), _dispatch.using({name: threshold}):
            compiled.append(loss.lower(*args).compile())
    return tuple(compiled), args


def compiled_steps(path, op, shape, threads):
    """``(fastbwd's step, JAX's step)``: :func:`programs` as zero-argument callables that wait for
    their result; None where :func:`call` is."""
    made = programs(path, op, shape, threads)
    if made is None:
        return None
    compiled, args = made
    return tuple(lambda executable=executable: jax.block_until_ready(executable(*args)) for executable in compiled)


def ratio(path, op, shape, threads, seconds=1.0, rounds=7):
    """JAX's time over fastbwd's for one call's step (:func:`compiled_steps`): the median of
    alternating rounds' ratios (``_dispatch.alternating_ratio``); None where the call cannot be
    made here."""
    steps = compiled_steps(path, op, shape, threads)
    if steps is None:
        return None
    return _dispatch.alternating_ratio(steps, seconds=seconds, rounds=rounds)


def points(threads, measured=MEASURED, ladder=None, seconds=1.0):
    """``{"path/op": [(elements, ratio), ...]}`` on this process's threads (``threads``: what it
    was started with, the key's thread class)."""
    found = {}
    for name in measured:
        path, op = name.split("/")
        row = []
        for shape in ladder or _dispatch.LADDER:
            value = ratio(path, op, shape, threads, seconds)
            if value is None:
                break
            row.append((int(np.prod(shape)), value))
        if row:
            found[name] = row
    return found


def cpus_option(count):
    """The command-line option ``--cpus`` confining a child process to the first ``count`` CPUs
    this process may run on (none when it has no more; see :func:`confine`)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return ["--cpus", json.dumps(allowed[:count])] if len(allowed) > count else []


def confine(cpus):
    """Run this process on ``cpus`` (a list, or None: as it is), before JAX and Numba start their
    threads (which inherit it). The child does it itself: a ``preexec_fn`` would fork the
    parent, which JAX warns against."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))


def run_child(module, threads, arguments=(), env=None, timeout=3600):
    """``python -m module --threads N --cpus ... *arguments`` (a program whose main gives
    ``--cpus`` to :func:`confine`) in a new process on ``threads`` Numba threads and as many of
    this machine's CPUs, the environment ``env`` (default: this process's) but for
    ``NUMBA_NUM_THREADS``: the finished process, its output captured as text."""
    command = [sys.executable, "-m", module, "--threads", str(threads), *cpus_option(threads), *arguments]
    env = dict(os.environ if env is None else env, NUMBA_NUM_THREADS=str(threads))
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def measure_in_child(threads, seconds=1.0, measured=MEASURED, ladder=None, timeout=3600):
    """:func:`points` measured by a new process on ``threads`` Numba threads and as many CPUs."""
    arguments = ["--seconds", str(seconds), "--measured", *measured]
    if ladder:
        arguments += ["--ladder", json.dumps([list(shape) for shape in ladder])]
    done = run_child("fastbwd.jax._calibrate", threads, arguments, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the calibration on {threads} thread(s) failed:\n{done.stderr}")
    return {name: [tuple(point) for point in row] for name, row in json.loads(done.stdout.splitlines()[-1]).items()}


def calibrate(threads=(1, 2), seconds=1.0, say=print, measured=MEASURED, ladder=None):
    """Measure :data:`MEASURED` on the ladder for each thread count (up to this machine's CPUs),
    each in a process of its own; returns the thresholds ``{"jax/path/op/threads": elements}``."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    thresholds = {}
    for count in [count for count in threads if count <= max(1, available)] or [1]:
        for name, row in measure_in_child(count, seconds, measured, ladder).items():
            key = f"jax/{name}/{_dispatch.thread_class(count)}"
            thresholds[key] = _dispatch.crossover(row)
            say(
                f"{key}: fastbwd from {thresholds[key]} elements (JAX / fastbwd: "
                + ", ".join(f"{elements}: {value:.2f}" for elements, value in row)
                + ")"
            )
    return thresholds


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastbwd.jax._calibrate")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--measured", nargs="+", default=list(MEASURED))
    parser.add_argument("--ladder", type=json.loads)
    parser.add_argument("--cpus", type=json.loads)
    args = parser.parse_args(argv)
    confine(args.cpus)
    ladder = [tuple(shape) for shape in args.ladder] if args.ladder else None
    print(json.dumps(points(args.threads, args.measured, ladder, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
