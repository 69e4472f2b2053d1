"""This machine's thresholds for the PyTorch bridge's eager paths (``python -m fastbwd
--calibrate``; ``fastbwd._dispatch`` stores them beside Numba's cache and decides with them).

For each eager path and operator (:data:`MEASURED`) and thread count, a forward + backward step
of one call is timed on a ladder of sizes (:data:`LADDER`), fastbwd's path (the decision forced
to fastbwd) against plain PyTorch's, in alternating rounds; the threshold is the smallest size
from which fastbwd's path is at least as fast at every larger size of the ladder (past the
ladder, if it never is). The compiled path keeps its defaults: measuring it compiles each size
twice, minutes on two cores (``python3 -m bench --full`` measures it, in its sweep).
"""

import contextlib
import copy

import torch
from torch import nn
from torch.nn import functional as F

from fastbwd import _dispatch
from fastbwd._dispatch import crossover

from . import _fuse, _group_norm_swish, _switch

__all__ = ["LADDER", "MEASURED", "calibrate", "crossover", "ratio"]

#: The sizes measured (the JAX bridge's calibration measures the same ones).
LADDER = _dispatch.LADDER

#: (path, op) -> the forward of one call at an input, (fastbwd's side, PyTorch's side) and parameters.
MEASURED = ("routed/upsample_bilinear2d", "routed/avg_pool2d", "routed/replication_pad2d")
MEASURED += ("fused/group_norm_swish", "dropin/group_norm_swish")


class _Block(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.norm, self.activation = nn.GroupNorm(8, channels), nn.SiLU()

    def forward(self, x):
        return self.activation(self.norm(x))


def _forwards(path, op, x):
    """``(fastbwd's forward, PyTorch's, fastbwd's parameters, PyTorch's)`` of one call at ``x``."""
    if op == "upsample_bilinear2d":
        f = lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")  # noqa: E731
    elif op == "avg_pool2d":
        f = lambda x: F.avg_pool2d(x, 3, 2, 1)  # noqa: E731
    elif op == "replication_pad2d":
        f = lambda x: F.pad(x, (2, 2, 1, 1), mode="replicate")  # noqa: E731
    if op != "group_norm_swish":
        return f, f, (), ()
    plain = _Block(x.shape[1])
    if path == "fused":
        fused = copy.deepcopy(plain)
        _fuse.fuse_group_norm_swish(fused, (x.detach(),))
    else:
        fused = _group_norm_swish.GroupNormSwish(8, x.shape[1])
        fused.load_state_dict(plain.norm.state_dict())
    return fused, plain, tuple(fused.parameters()), tuple(plain.parameters())


def _step(forward, x, parameters, g):
    inputs = (x, *parameters)
    return lambda: torch.autograd.grad(forward(x), inputs, g)


def ratio(path, op, shape, threads, seconds=1.0, rounds=7):
    """PyTorch's time over fastbwd's path's (the decision forced to fastbwd) for a forward +
    backward step of ``op`` on ``path`` at ``shape`` on ``threads`` threads: the median of
    alternating rounds' ratios (``_dispatch.alternating_ratio``)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0), requires_grad=True)
    ours, theirs, our_parameters, their_parameters = _forwards(path, op, x)
    with torch.no_grad():
        g = torch.randn(theirs(x).shape, generator=torch.Generator().manual_seed(1))
    fastbwd_step, plain_step = _step(ours, x, our_parameters, g), _step(theirs, x, their_parameters, g)
    forced = {f"torch/{path}/{op}/{_dispatch.thread_class(threads)}": 0}

    @contextlib.contextmanager
    def fastbwd_side():
        with _dispatch.using(forced), _switch.enabled(policy="auto"):
            yield

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _dispatch.alternating_ratio((fastbwd_step, plain_step), (fastbwd_side, None), seconds, rounds)
    finally:
        torch.set_num_threads(previous)


def calibrate(threads=(1, 2), seconds=1.0, say=print):
    """Measure :data:`MEASURED` on :data:`LADDER` for each thread count (those this process can
    run) and store the thresholds as this machine's table; returns them."""
    threads = [count for count in threads if count <= max(1, torch.get_num_threads())] or [1]
    thresholds = {}
    for measured in MEASURED:
        path, op = measured.split("/")
        for count in threads:
            points = []
            for shape in LADDER:
                elements = shape[0] * shape[1] * shape[2] * shape[3]
                points.append((elements, ratio(path, op, shape, count, seconds)))
            key = f"torch/{path}/{op}/{_dispatch.thread_class(count)}"
            thresholds[key] = crossover(points)
            say(
                f"{key}: fastbwd from {thresholds[key]} elements (PyTorch / fastbwd: "
                + ", ".join(f"{elements}: {value:.2f}" for elements, value in points)
                + ")"
            )
    return thresholds
