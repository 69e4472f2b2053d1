"""The never-slower sweep (issue 52): every operation the PyTorch bridge decides for, at six sizes
and one and two threads, fastbwd enabled (``enabled()`` around each round's loop of steps, the
policy ``"auto"``) against plain PyTorch in the same process, eager and under ``torch.compile``.

A row is one forward + backward step of one module-sized call at one size and thread count. The
ratio is plain's time over fastbwd's: where the decision (``fastbwd._dispatch``) leaves a call
to PyTorch, it measures what declining costs (the mechanism's floor); where it sends it to
fastbwd, what fastbwd's path gains. Only imported where torch is installed.
"""

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

import fastbwd.torch as ft

from .inputs import roi_boxes
from .roi_baselines import torch_roi_align
from .targets import SWEEP_OPERATIONS, SWEEP_SIZES
from .torch_cases import enabled_beside_plain_graphs

#: The issue's six sizes (N, C, H, W), smallest first.
SIZES = SWEEP_SIZES
#: The first size from which the routed operations' target is 0.97x (below it: 0.9x).
ROUTED_FROM = (2, 32, 16, 16)
THREADS = (1, 2)


@dataclass
class SweepCase:
    """One row: ``fastbwd`` and ``torch`` zero-argument steps, ``check()`` asserting they agree,
    and the context each side's rounds run in (``fastbwd_context``: fastbwd enabled)."""

    id: str
    label: str
    op: str  # the operation's key in OPERATIONS
    shape: tuple
    threads: int
    fastbwd: Callable[[], object]
    torch: Callable[[], object]
    check: Callable[[], None]
    target: str
    fastbwd_context: Callable[[], object] = None
    torch_context: Callable[[], object] = None
    note: str = ""


class Block(nn.Module):
    """GroupNorm then SiLU in a forward() (fuse_group_norm_swish arms a FusedGroupNorm)."""

    def __init__(self, channels):
        super().__init__()
        self.norm, self.activation = nn.GroupNorm(8, channels), nn.SiLU()

    def forward(self, x):
        return self.activation(self.norm(x))


def _roi_align(x):
    boxes = torch.from_numpy(roi_boxes(4 * x.shape[0], tuple(x.shape), 0.25))
    return (
        boxes,
        (lambda x: ft.roi_align(x, boxes, 7, 0.25, 2, True)),
        (lambda x: torch_roi_align(x, boxes, 7, 7, 0.25, 2, True)),
    )


#: The operations, by key (the tables' names: bench/targets.py, which needs no torch).
OPERATIONS = SWEEP_OPERATIONS
#: The operations compiled (RoIAlign has no code of its own in PyTorch for Inductor to compile).
COMPILED = ("up", "pool", "pad", "gn")


def _forwards(op, x):
    """``(fastbwd's forward, PyTorch's, the parameters of each)`` of operation ``op`` at ``x``."""
    if op == "up":
        f = lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")  # noqa: E731
        return f, f, (), ()
    if op == "pool":
        f = lambda x: F.avg_pool2d(x, 3, 2, 1)  # noqa: E731
        return f, f, (), ()
    if op == "pad":
        f = lambda x: F.pad(x, (2, 2, 1, 1), mode="replicate")  # noqa: E731
        return f, f, (), ()
    if op == "gn":
        plain = Block(x.shape[1])
        with torch.no_grad():
            plain.norm.weight.normal_(generator=torch.Generator().manual_seed(5))
            plain.norm.bias.normal_(generator=torch.Generator().manual_seed(6))
        fused = copy.deepcopy(plain)
        ft.fuse_group_norm_swish(fused, (x.detach(),))
        return fused, plain, tuple(fused.parameters()), tuple(plain.parameters())
    _, ours, theirs = _roi_align(x)
    return ours, theirs, (), ()


def _target(op, shape, compiled):
    if op == "roi":
        return "report"
    if compiled or op == "gn":
        return ">= 0.97x"
    return ">= 0.97x" if _elements(shape) >= _elements(ROUTED_FROM) else ">= 0.9x"


def _elements(shape):
    count = 1
    for size in shape:
        count *= size
    return count


def _step(forward, x, parameters, g):
    inputs = (x, *parameters)

    def run():
        return torch.autograd.grad(forward(x), inputs, g)

    return run


@contextlib.contextmanager
def torch_threads(count):
    """PyTorch on ``count`` threads for the block, its thread count put back after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _enabled(count):
    """fastbwd enabled under the policy "auto" on ``count`` threads (a round's context)."""

    @contextlib.contextmanager
    def context():
        with torch_threads(count), enabled_beside_plain_graphs(policy="auto"):
            yield

    return context


def _plain(count):
    return lambda: torch_threads(count)


def _case(op, index, shape, threads, compiled):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(index), requires_grad=True)
    ours, theirs, our_parameters, their_parameters = _forwards(op, x)
    with torch.no_grad():  # (before compiling: a case compiles at its first timed call, not here)
        g = torch.randn(theirs(x).shape, generator=torch.Generator().manual_seed(index + 100))
    if compiled:  # the same plain module both ways: the compiler hooks are what is measured
        from .torch_cases import _compiled

        where = f"SC_{op}_{index}_{threads}"
        our_parameters = their_parameters
        ours, theirs = _compiled(theirs, f"{where}_fastbwd"), _compiled(theirs, f"{where}_plain")
    fastbwd_step, torch_step = _step(ours, x, our_parameters, g), _step(theirs, x, their_parameters, g)
    fastbwd_context, torch_context = _enabled(threads), _plain(threads)
    id = f"S{'C' if compiled else 'E'}.{op}.{index}.{threads}t"

    def check():
        with fastbwd_context():
            mine = fastbwd_step()
        with torch_context():
            expected = torch_step()
        for a, e in zip(mine, expected):
            scale = float(e.abs().max())
            error = float((a - e).abs().max())
            assert error <= 1e-4 * max(scale, 1.0), f"{id}: gradient off by {error:.3g} (scale {scale:.3g})"

    label = f"{OPERATIONS[op]} {shape}, {threads} thread{'s' if threads > 1 else ''}"
    return SweepCase(
        id,
        label,
        op,
        shape,
        threads,
        fastbwd_step,
        torch_step,
        check,
        _target(op, shape, compiled),
        fastbwd_context,
        torch_context,
    )


def cases(compiled=False, sizes=None, threads=THREADS, ops=None):
    """The sweep's rows: every operation (``COMPILED`` ones when ``compiled``) at each size and
    thread count, built lazily (a compiled row compiles on its first call)."""
    ops = ops or (COMPILED if compiled else tuple(OPERATIONS))
    for op in ops:
        for index, shape in enumerate(sizes or SIZES, 1):
            for count in threads:
                yield _case(op, index, shape, count, compiled)
