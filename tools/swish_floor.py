"""The arithmetic floor of GroupNorm+Swish on this machine, against PyTorch's GroupNorm + SiLU.

    python3 tools/swish_floor.py [--threads N] [SHAPE ...]     (SHAPE: N,C,H,W; float32, 32 groups)

Prints (1) what the Swish stages alone cost per element with their operands in L1: the
forward's ``swish_rows`` and the backward's ``swish_gradient_rows`` over one 512-element chunk,
the same compiled loops the kernels run (one exp and one division per element each way); (2)
per shape, PyTorch's four aten ops one by one and fastbwd's forward and backward kernels (their
plans' ``run``, no Python around them), in ns per element, alternating rounds in one process;
and the **bound**: PyTorch's four ops over the Swish floor, the speed-up of a fused kernel whose
every other operation (statistics, normalising, the parameter sums, dx) were free. A target above
the bound cannot be met on this machine by any kernel that computes Swish as these do
(docs/history.md, "The arithmetic floor"). Needs PyTorch for part (2).
"""

import argparse
import os
import sys
import time

import numba
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench, beside the package

from bench.timing import Settings, alternating_rounds  # noqa: E402
from fastbwd.kernels._group_norm_math import STAGE_CHUNK, STAGE_ROWS, swish_gradient_rows, swish_rows  # noqa: E402
from fastbwd.kernels._halfbits import NATIVE  # noqa: E402
from fastbwd.kernels._jit import wide_vectors  # noqa: E402
from fastbwd.kernels._memory import stack_array  # noqa: E402

#: The main job's full-run timing (bench/__main__.py's FULL): rounds until every median is known
#: within 2%, or 12 s a shape.
SETTINGS = Settings(round_seconds=0.05, min_rounds=7, tolerance=0.02, budget=12.0)

#: issue 53's shapes with at least 16 x 16 positions
SHAPES = ((2, 256, 16, 16), (2, 128, 32, 32), (2, 320, 32, 32), (1, 128, 64, 64))


@numba.njit(error_model="numpy")
def _stages(z, dy, out, repeats, derivative):
    """The Swish stages over one STAGE_CHUNK chunk, ``repeats`` times (``derivative``: the
    backward's, else the forward's); each round changes one input element (nothing hoisted)."""
    wide_vectors()
    scratch = stack_array(STAGE_ROWS, STAGE_CHUNK, z)
    for i in range(STAGE_CHUNK):
        scratch[0][i] = z[i]
        scratch[3][i] = dy[i]
    for r in range(repeats):
        if derivative:
            swish_gradient_rows(scratch, out, STAGE_CHUNK)
        else:
            swish_rows(scratch, np.float32(1), out, STAGE_CHUNK, NATIVE)
        scratch[0][r % STAGE_CHUNK] = out[(7 * r) % STAGE_CHUNK] * np.float32(1e-30) + z[r % STAGE_CHUNK]


def swish_floor(rounds=5, repeats=100_000):
    """``(forward, backward)``: ns per element of the Swish stages in L1 (the least of ``rounds``)."""
    rng = np.random.default_rng(0)
    z = (3 * rng.standard_normal(STAGE_CHUNK)).astype(np.float32)
    dy = rng.standard_normal(STAGE_CHUNK).astype(np.float32)
    out = np.empty(STAGE_CHUNK, np.float32)
    best = {False: float("inf"), True: float("inf")}
    for derivative in best:
        _stages(z, dy, out, 10, derivative)
    for _ in range(rounds):
        for derivative in best:
            start = time.perf_counter()
            _stages(z, dy, out, repeats, derivative)
            best[derivative] = min(best[derivative], (time.perf_counter() - start) / (repeats * STAGE_CHUNK) * 1e9)
    return best[False], best[True]


def _per_element(calls, elements):
    """Median ns per element of each call, in the main job's alternating rounds
    (``bench.timing.alternating_rounds``)."""
    timing = alternating_rounds(list(calls.values()), [(index, None) for index in range(len(calls))], SETTINGS)
    return {name: timing.median(index) / elements * 1e9 for index, name in enumerate(calls)}


def compare(shape, groups=32):
    """ns per element of PyTorch's four ops and of fastbwd's two kernels at ``shape``, float32."""
    import torch

    import fastbwd

    A = torch.ops.aten
    batch, channels, height, width = shape
    positions = height * width
    generator = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(shape, generator=generator) for _ in range(2))
    gamma, beta = (torch.randn(channels, generator=generator) for _ in range(2))
    normalised, mean, rstd = A.native_group_norm(x, gamma, beta, batch, channels, positions, groups, 1e-5)
    grad = A.silu_backward(dy, normalised)
    x_a, dy_a, gamma_a, beta_a = (t.numpy() for t in (x, dy, gamma, beta))
    forward = fastbwd.group_norm_swish.prepare(x_a, gamma_a, beta_a, groups)
    y_a, mean_a, rstd_a = forward(x_a, gamma_a, beta_a)
    backward = fastbwd.group_norm_swish_backward.prepare(dy_a, mean_a, rstd_a, x_a, gamma_a, beta_a, groups)
    grads = backward(dy_a, mean_a, rstd_a, x_a, gamma_a, beta_a)
    forward_plan, backward_plan = forward.plan.kernels, backward.plan.kernels
    eps, scale = np.float32(1e-5), np.float32(1)
    calls = {
        "native_group_norm": lambda: A.native_group_norm(x, gamma, beta, batch, channels, positions, groups, 1e-5),
        "silu": lambda: A.silu(normalised),
        "silu_backward": lambda: A.silu_backward(dy, normalised),
        "native_group_norm_backward": lambda: A.native_group_norm_backward(
            grad, x, mean, rstd, gamma, batch, channels, positions, groups, [True, True, True]
        ),
        "fastbwd forward kernel": lambda: forward_plan.run(x_a, gamma_a, beta_a, y_a, mean_a, rstd_a, eps, scale),
        "fastbwd backward kernel": lambda: backward_plan.run(dy_a, mean_a, rstd_a, x_a, gamma_a, beta_a, *grads, scale),
    }
    return _per_element(calls, x.numel())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="*", help="N,C,H,W (default: issue 53's shapes of 16 x 16 and more)")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch's and Numba's thread count (default 1)")
    args = parser.parse_args()
    numba.set_num_threads(args.threads)
    forward, backward = swish_floor()
    floor = forward + backward
    print(f"Swish stages in L1, one thread: forward {forward:.3f} ns/element, backward {backward:.3f}")
    try:
        import torch
    except ImportError:
        print("(no PyTorch: the comparison is skipped)")
        return
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(s) for s in text.split(",")) for text in args.shapes] or SHAPES
    for shape in shapes:
        times = compare(shape)
        torch_total = sum(value for name, value in times.items() if not name.startswith("fastbwd"))
        ours = times["fastbwd forward kernel"] + times["fastbwd backward kernel"]
        print(
            f"{shape}: "
            + ", ".join(f"{name} {value:.3f}" for name, value in times.items())
            + f" ns/element; PyTorch's four {torch_total:.3f}, fastbwd's kernels {ours:.3f}"
            f" ({torch_total / ours:.2f}x); bound {torch_total / (floor / args.threads):.2f}x"
        )


if __name__ == "__main__":
    main()
