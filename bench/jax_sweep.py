"""The never-slower sweep of the JAX bridge (issue 52): ``jax.jit(jax.grad(sum(f(...) ** 2)))``
of one call at the issue's sizes, on one and two threads, fastbwd (the policy ``"auto"``, the
decision as a user gets it) against plain JAX in the same process, alternating rounds.

* ``fastbwd.jax``'s PyTorch-shaped functions, channels first: against the same function traced
  with the decision forced to JAX's own code (plain JAX of the same semantics, the program
  ``"auto"`` traces below the crossover);
* ``reach`` on the calls Flax users write, channels last (``jax.image.resize``,
  ``flax.linen.avg_pool``, ``jnp.pad``, ``nn.GroupNorm`` + ``nn.swish``): ``reach(loss)`` against
  the loss itself;
* ``reach`` on small models: the Flax decoder block of J7 (channels last) and the Equinox ResNet
  block of J8 (under ``jax.vmap``), against the models alone.

A size (N, C, H, W) means the same numbers channels last, ``(N, H, W, C)``. Two threads: the
main job's own process; one thread: ``python -m bench.jax_sweep --threads 1`` in a process
started with ``NUMBA_NUM_THREADS=1`` on one CPU (XLA's threads and fastbwd's alike), as
``fastbwd/jax/_calibrate.py`` measures the one-thread thresholds. Only imported where jax is
installed.
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import fastbwd.jax as fj
from fastbwd import _dispatch
from fastbwd.jax import _calibrate, _decide

from .jax_cases import _assert_close
from .targets import JAX_SWEEP_OPERATIONS, SWEEP_SIZES

#: The sizes of the small models' rows (GroupNorm(32): 32 channels and more), as (N, C, H, W).
BLOCK_SIZES = [(2, 32, 8, 8), (2, 32, 16, 16), (4, 32, 32, 32)]
THREADS = (1, 2)
#: The operations of each kind (JAX_SWEEP_OPERATIONS' keys): fastbwd.jax's functions, reach on
#: the libraries' calls, reach on models.
EXPLICIT = {"up": "upsample_bilinear2d", "pool": "avg_pool2d", "pad": "replication_pad2d", "gn": "group_norm_swish"}
EXPLICIT["roi"] = "roi_align"
REACHED = ("reach-up", "reach-pool", "reach-pad", "reach-gn")
MODELS = ("flax", "eqx")
TARGET = ">= 0.97x"


@dataclass
class SweepCase:
    """One row: ``fastbwd`` and ``jax`` zero-argument steps (each waits for its result) and
    ``check()`` asserting that their gradients agree."""

    id: str
    label: str
    op: str
    shape: tuple
    threads: int
    fastbwd: Callable[[], object]
    jax: Callable[[], object]
    check: Callable[[], None]
    target: str = TARGET
    note: str = ""


def _randn(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _compiled(f, args, argnums, context):
    """``jax.jit(jax.grad(sum(f(*args) ** 2)))`` compiled under ``context`` (a context manager),
    as a step that waits, and the compiled program."""
    step = jax.jit(jax.grad(lambda *args: jnp.sum(f(*args) ** 2), argnums=argnums))
    with context:
        executable = step.lower(*args).compile()
    return lambda: jax.block_until_ready(executable(*args)), executable


def _instructions(text):
    """A compiled program's text without its metadata (source lines, op names, stack frames)."""
    text = re.sub(r"\n(?:FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*", "\n", text)
    return re.sub(r", metadata=\{[^}]*\}", "", text)


def _reached_call(op, shape):
    """``(f, args, argnums)`` of a Flax user's call of ``op`` at ``shape`` channels last."""
    import flax.linen as nn

    n, c, h, w = shape
    x = _randn((n, h, w, c), 1)
    if op == "reach-up":
        return (lambda x: jax.image.resize(x, (n, 2 * h, 2 * w, c), "bilinear")), (x,), (0,)
    if op == "reach-pool":
        return (lambda x: nn.avg_pool(x, (3, 3), (2, 2), ((1, 1), (1, 1)))), (x,), (0,)
    if op == "reach-pad":
        return (lambda x: jnp.pad(x, ((0, 0), (1, 1), (2, 2), (0, 0)), mode="edge")), (x,), (0,)
    norm = nn.GroupNorm(num_groups=8)
    return (lambda params, x: nn.swish(norm.apply(params, x))), (norm.init(jax.random.key(0), x), x), (0, 1)


def _model(op, shape):
    """``(f, args, argnums)`` of a small model's loss at ``shape``."""
    n, c, h, w = shape
    if op == "flax":
        from .models.flax_decoder import Decoder

        model, x = Decoder(c), _randn((n, h, w, c), 2)
        return model.apply, (model.init(jax.random.key(0), x), x), (0, 1)
    import equinox as eqx

    from .models.equinox_resnet import ResBlock

    params, static = eqx.partition(ResBlock(c, jax.random.key(4)), eqx.is_array)

    def apply(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    return apply, (params, _randn(shape, 3)), (0, 1)


def _case(op, index, shape, threads):
    if op in EXPLICIT:
        f, args, argnums = _calibrate.call("traced", EXPLICIT[op], shape)
        ours = _compiled(f, args, argnums, _decide.policy_block("auto"))
        forced = {f"jax/traced/{EXPLICIT[op]}/{_dispatch.thread_class(threads)}": _calibrate.NEVER}
        theirs = _compiled(f, args, argnums, _dispatch.using(forced))
    else:
        f, args, argnums = _reached_call(op, shape) if op in REACHED else _model(op, shape)
        ours = _compiled(fj.reach(f, policy="auto"), args, argnums, _decide.policy_block("auto"))
        theirs = _compiled(f, args, argnums, _decide.policy_block("auto"))
    text = ours[1].as_text()
    served = 'custom_call_target="fastbwd_' in text
    same = _instructions(text) == _instructions(theirs[1].as_text())
    id = f"SJ.{op}.{index}.{threads}t"

    def check():  # the J rows' tolerance: GroupNorm's sums differ by rounding
        _assert_close(ours[0](), theirs[0](), 1e-4, 1e-5, id)

    label = f"{JAX_SWEEP_OPERATIONS[op]} {shape}, {threads} thread{'s' if threads > 1 else ''}"
    note = "fastbwd's kernels" if served else "JAX's own code" + (", the same program" if same else "")
    return SweepCase(id, label, op, shape, threads, ours[0], theirs[0], check, note=note)


def operations():
    """The operations this process can run (reach's rows need Flax; the Equinox block, Equinox)."""
    ops = list(EXPLICIT)
    if importlib.util.find_spec("flax") is not None:
        ops += list(REACHED) + ["flax"]
    if importlib.util.find_spec("equinox") is not None:
        ops.append("eqx")
    return ops


def cases(threads, sizes=None, ops=None, block_sizes=None):
    """The sweep's rows on this process's ``threads`` (the thread count it was started with),
    built lazily (each compiles its two programs when built)."""
    for op in ops or operations():
        for index, shape in enumerate((block_sizes or BLOCK_SIZES) if op in MODELS else (sizes or SWEEP_SIZES), 1):
            yield _case(op, index, shape, threads)


#: How the child process prints each row (one JSON line each, as soon as it is timed).
ROW = "row: "


def in_child(threads, settings, sizes=None, ops=None, block_sizes=None, timeout=3600):
    """The rows of :func:`run` on ``threads`` Numba threads, in a new process on as many CPUs
    (``python -m bench.jax_sweep``), as JSON dictionaries. A failure raises RuntimeError, whose
    ``rows`` are those the process had timed."""
    arguments = ["--settings", json.dumps(dataclasses.asdict(settings))]
    if sizes:
        arguments += ["--sizes", json.dumps(sizes)]
    if ops:
        arguments += ["--ops", *ops]
    if block_sizes:
        arguments += ["--block-sizes", json.dumps(block_sizes)]
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    done = _calibrate.run_child("bench.jax_sweep", threads, arguments, env, timeout)
    rows = [json.loads(line[len(ROW) :]) for line in done.stdout.splitlines() if line.startswith(ROW)]
    if done.returncode != 0:
        error = RuntimeError(f"the JAX sweep on {threads} thread(s) failed:\n{done.stderr[-6000:]}")
        error.rows = rows
        raise error
    return rows


def run(threads, settings, sizes=None, ops=None, block_sizes=None, done=None):
    """Check and time every row on this process's threads: a list of dictionaries (the case's
    fields, the medians of both sides, the series of round ratios, whether the rounds settled,
    the parallel stall measured before the case), each given to ``done`` when timed."""
    from .timing import alternating_rounds, parallel_stall

    rows = []
    for case in cases(threads, sizes, ops, block_sizes):
        case.check()
        stall = parallel_stall()
        timing = alternating_rounds([case.fastbwd, case.jax], [(0, 1)], settings)
        fields = {name: getattr(case, name) for name in ("id", "label", "op", "threads", "target", "note")}
        rows.append(
            fields
            | dict(
                shape=list(case.shape),
                seconds=timing.median(0),
                base_seconds=timing.median(1),
                series=list(timing.series(0, 1)),
                settled=timing.settled,
                stall=stall,
            )
        )
        if done:
            done(rows[-1])
    return rows


def main(argv=None):
    from .timing import Settings

    parser = argparse.ArgumentParser(prog="python -m bench.jax_sweep")
    parser.add_argument("--threads", type=int, required=True, help="the NUMBA_NUM_THREADS this process runs on")
    parser.add_argument("--settings", type=json.loads, required=True)
    parser.add_argument("--sizes", type=json.loads)
    parser.add_argument("--ops", nargs="+")
    parser.add_argument("--block-sizes", type=json.loads)
    parser.add_argument("--cpus", type=json.loads)
    args = parser.parse_args(argv)
    _calibrate.confine(args.cpus)
    sizes = [tuple(s) for s in args.sizes] if args.sizes else None
    block_sizes = [tuple(s) for s in args.block_sizes] if args.block_sizes else None
    run(
        args.threads,
        Settings(**args.settings),
        sizes,
        args.ops,
        block_sizes,
        lambda row: print(ROW + json.dumps(row), flush=True),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
