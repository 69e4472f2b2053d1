"""GroupNorm+Swish's kernels (docs/semantics.md §5, §5.1): their Geometry and plans here, the loop
nests in ``_group_norm_backward`` and ``_group_norm_forward``, their shared math in
``_group_norm_math`` (exp, Swish, the fixed-order lane sums); the names the rest of the package
and the tests use are all importable from here.

The backward:

One task per (n, group) (NCHW family) or per (n, run of whole groups) (NHWC) does both passes
while its data is still in cache:

1. recompute ``xhat``, ``y`` and the Swish derivative, and accumulate the per-(n, channel) sums
   of ``gnew`` and ``gnew * xhat`` into ``sum_g[n, c]`` and ``sum_gx[n, c]`` (its own slots);
2. form the group coefficients ``c1``, ``c2`` from those sums and write ``dx`` for the group.

Every per-(n, c) sum has the same fixed order in both layouts, so NCHW and NHWC agree bitwise
and no thread count changes a bit: spatial positions are cut into blocks of :data:`BLOCK`;
inside a block position ``i`` is added (in order) to lane ``i % PARTIAL_SUMS``, the lanes are folded
by halving (:func:`_fold_lanes`), and the block sums are added to the total in block order.
The lanes make the sums vectorise without fastmath (each lane is its own sequential sum): the
NCHW kernel keeps its PARTIAL_SUMS = 16 lanes in a vector register
(:func:`_channel_sums`, an intrinsic: accumulators in memory made the loop store-bound), while
the NHWC loop vectorises along channels with one row of lanes per channel. dgamma and dbeta
then add the per-(n, c) sums over n in order (``_parameter_grads``: the NCHW kernel in its own
launch, the NHWC path by :func:`group_norm_swish_param_grads`).

NHWC tasks read whole rows (all C channels of a position) wherever they can: a narrow channel
strip of an NHWC array streams from memory several times slower than whole rows, which ruled out
transposing L2-sized channel strips into NCHW-shaped scratch (docs/design.md). So an NHWC task's x and gnew span the whole image and its second pass
rereads them from L3 or memory. In both layouts, when dx has the compute type (float32,
float64) a task keeps gnew in its own dx elements, and the second pass overwrites each with its
dx: the dx lines are read for ownership once, in the first pass, and no separate scratch is
allocated or passes through the caches (in NHWC also faster than a scratch with streaming dx
stores). float16 and bfloat16 keep gnew (float32) in a scratch array; NHWC writes their dx with
streaming stores when the plan asks (large dx), so that the dx lines are neither read first nor
evict x and gnew.

The llvmlite wheel has no SVML, so ``math.exp`` is a scalar call that blocks vectorisation: the
float32 path uses :func:`exp_nonpositive_float32`, a Cephes-style polynomial built from float
and integer operations only (about 1e-7 relative error; subnormal results flushed to 0, which
is faster than scaling into the subnormal range). float64 data uses ``math.exp``.
"""

from typing import NamedTuple

import numpy as np

from ._group_norm_backward import (  # noqa: F401 - the kernels, named from here
    group_norm_swish_bwd_nchw,
    group_norm_swish_bwd_nhwc,
    group_norm_swish_param_grads,
    swish_gradient,
)
from ._group_norm_forward import group_norm_swish_fwd_nchw, group_norm_swish_fwd_nhwc  # noqa: F401
from ._group_norm_math import (  # noqa: F401 - the shared math, named from here
    _EXP_FLUSH,
    BLOCK,
    PARTIAL_SUMS,
    WHOLE_ROWS_MAX_CHANNELS,
    exp_nonpositive_float32,
    fma,
    swish,
    swish_derivative,
    swish_derivative_float32,
    swish_derivative_float64,
)
from ._halfbits import StorageFormat
from ._jit import Launch

# ---- plans (docs/design.md, "The one contract") ------------------------------------------------

#: Channels an NHWC task aims to span (its inner loops run along them, once per position):
#: narrow runs are slow, and keeping dy and x in cache matters less (docs/history.md).
NHWC_TASK_CHANNELS = 512
#: Tasks per thread the NHWC runs are split into at least, when the batch alone gives fewer.
NHWC_TASKS_PER_THREAD = 2
#: NCHW forward tasks take two groups each (:func:`nchw_groups_per_task`) only while that
#: leaves at least this many tasks per thread: fewer, larger tasks balance worse.
NCHW_PAIRED_TASKS_PER_THREAD = 4
#: An NHWC dx of float16 or bfloat16 (a float32 or float64 dx holds gnew between the kernel's
#: passes and is overwritten in place) of at least this many bytes is written with streaming
#: (non-temporal) stores. An NHWC task's x and gnew (a whole image's channels) outgrow L2 and are
#: reread from L3 in its second pass; a plain dx store first reads its line and then evicts
#: them. The floor is kept above the size where streaming starts to win, so that a smaller dx
#: stays in cache for whatever reads it next (docs/history.md).
NHWC_STREAM_MIN_BYTES = 4 << 20
#: The arguments each direction's kernel only reads (typed read-only: one compiled signature
#: serves read-only and writeable arrays): dy, x, mean, rstd, gamma, beta; x, gamma, beta.
BACKWARD_READ_ONLY = (0, 1, 2, 3, 4, 5)
FORWARD_READ_ONLY = (0, 1, 2)


class Geometry(NamedTuple):
    """A validated group_norm_swish_backward call, as its kernels see it."""

    nhwc: bool  # the kernels' layout is (N, HxW, C); else (N, C, HxW)
    batch: int
    channels: int
    positions: int  # HxW: the product of the spatial sizes
    groups: int
    itemsize: int  # of dy, x and dx
    fmt: StorageFormat  # of dy, x and dx
    compute: np.dtype  # the kernels' arithmetic: float64 for float64 data, else float32
    parameter_fmt: StorageFormat  # of dgamma and dbeta (gamma's dtype)
    want_dgamma: bool
    want_dbeta: bool
    threads: int  # the thread count a parallel launch runs on (it sizes the NHWC tasks)
    activate_swish: bool = True  # False: the plain GroupNorm backward (gnew = dy)


class ForwardGeometry(NamedTuple):
    """A validated group_norm_swish (forward) call, as its kernel sees it."""

    nhwc: bool  # the kernel's layout is (N, HxW, C); else (N, C, HxW)
    batch: int
    channels: int
    positions: int
    groups: int
    fmt: StorageFormat  # of x and y
    compute: np.dtype  # of the statistics, gamma, beta and the scalars
    activate_swish: bool
    threads: int


def plan(geometry):
    """The plan of a call of either direction: :class:`BackwardPlan` for a :class:`Geometry`,
    :class:`ForwardPlan` for a :class:`ForwardGeometry` (the task partition, the launches and
    the scratch each call allocates)."""
    if isinstance(geometry, ForwardGeometry):
        return _forward_plan(geometry)
    return _backward_plan(geometry)


def nhwc_groups_per_task(groups, group_size, batch, threads):
    """Consecutive groups one NHWC task handles: about :data:`NHWC_TASK_CHANNELS` channels, fewer
    only until there are :data:`NHWC_TASKS_PER_THREAD` tasks per thread, never fewer than one
    group. Any choice gives the same bits (every per-(n, c) sum has a fixed order)."""
    if groups * group_size <= WHOLE_ROWS_MAX_CHANNELS:
        # A whole image per task (steps of PARTIAL_SUMS positions), even with fewer images than
        # threads: runs of such narrow rows, read by several threads, are 2-7x slower (history.md)
        return groups
    by_width = -(-NHWC_TASK_CHANNELS // group_size)
    runs_per_image = -(-NHWC_TASKS_PER_THREAD * threads // batch)
    by_tasks = -(-groups // runs_per_image)
    return max(1, min(groups, by_width, by_tasks))


def nchw_groups_per_task(groups, batch, threads):
    """Groups one NCHW forward task handles: two (their sums interleaved, the same bits) while
    that leaves at least :data:`NCHW_PAIRED_TASKS_PER_THREAD` tasks per thread, else one."""
    return 2 if batch * (groups // 2) >= NCHW_PAIRED_TASKS_PER_THREAD * threads else 1


def parallel_tasks(nhwc, batch, channels, groups, threads):
    """The tasks the forward's and the backward's kernels split a call into on a pool of
    ``threads`` (the fewer of the two): NCHW an image's groups, one or two a task; NHWC its
    runs of :func:`nhwc_groups_per_task` groups, the whole image when C <= WHOLE_ROWS_MAX_CHANNELS.
    Fewer tasks than threads leave threads idle (the bridges' decision counts this:
    ``fastbwd._dispatch.decide``'s ``tasks``)."""
    if nhwc:
        per_task = nhwc_groups_per_task(groups, channels // groups, batch, threads)
    else:
        per_task = nchw_groups_per_task(groups, batch, threads)  # the forward's (the backward's: one group)
    return batch * -(-groups // per_task)


class BackwardPlan(NamedTuple):
    """The plan of a backward call: the dx kernel's launch, shape and last arguments, and, for
    the NHWC kernel, the launch of the parameter gradients' kernel (None when neither is wanted:
    the NCHW kernel adds them in its own launch) and the shape of the per-(n, c) sums it takes."""

    dx: Launch
    shape: tuple  # (N, C, HxW) or (N, HxW, C)
    arguments: tuple  # the dx kernel's arguments after dbeta (NCHW) or sum_gx (NHWC)
    parameter_grads: Launch
    wants: tuple  # (want_dgamma, want_dbeta, parameter_fmt): the last arguments of parameter_grads
    sums: tuple  # NHWC: the shape of the per-(n, c) sums; None for NCHW (the kernel's own)
    compute: np.dtype
    activate_swish: bool

    def run(self, dy, mean, rstd, x, gamma, beta, dx, dgamma, dbeta, swish_scale):
        """dx (and dgamma, dbeta when wanted) from the kernel views of dy, x and dx (C-contiguous
        in the plan's layout, any shape holding it); mean, rstd ``(N, G)``, gamma, beta ``(C,)``
        and ``swish_scale`` in the compute type, C-contiguous (ignored without Swish); dgamma,
        dbeta ``(C,)`` kernel views in the parameters' dtype (one that is not wanted is not
        written: an empty array of that dtype will do)."""
        dx_launch, shape, arguments, parameter_grads, wants, sums, compute, activate_swish = self  # one lookup
        swish_scale = swish_scale if activate_swish else None  # None: the kernels compiled without Swish
        # the dx kernel's two arrays after dx: dgamma and dbeta for NCHW (whose kernel keeps its
        # own sums), the per-(n, c) sums sum_g and sum_gx for NHWC
        if sums is None:
            first, second = dgamma, dbeta
        else:
            first, second = np.empty(sums, compute), np.empty(sums, compute)
        # a serial launch's resolved entry point, called directly (Launch.call)
        (dx_launch.call or dx_launch)(
            dy.reshape(shape),
            x.reshape(shape),
            mean,
            rstd,
            gamma,
            beta,
            swish_scale,
            dx.reshape(shape),
            first,
            second,
            *arguments,
        )
        if parameter_grads is not None:
            (parameter_grads.call or parameter_grads)(first, second, dgamma, dbeta, *wants)


def _backward_plan(g):
    work = g.batch * g.channels * g.positions
    dx = Launch(group_norm_swish_bwd_nhwc if g.nhwc else group_norm_swish_bwd_nchw, work, read_only=BACKWARD_READ_ONLY)
    wants = (g.want_dgamma, g.want_dbeta, g.parameter_fmt)
    if not g.nhwc:
        shape = (g.batch, g.channels, g.positions)
        return BackwardPlan(
            dx,
            shape,
            (g.want_dgamma, g.want_dbeta, g.fmt, g.parameter_fmt),
            None,
            wants,
            None,
            g.compute,
            g.activate_swish,
        )
    threads = g.threads if dx.parallel else 1
    streaming = work * g.itemsize >= NHWC_STREAM_MIN_BYTES  # only a half-format dx is streamed
    groups_per_task = nhwc_groups_per_task(g.groups, g.channels // g.groups, g.batch, threads)
    shape, arguments = (g.batch, g.positions, g.channels), (groups_per_task, streaming, g.fmt)
    # the serial twin: only N*C additions, and building the parallel one cost ~1.3 s (of
    # ~7.7 s CPU on a loaded machine) in the first call's compile
    parameter_grads = None
    if g.want_dgamma or g.want_dbeta:
        parameter_grads = Launch(group_norm_swish_param_grads, None, read_only=())
    return BackwardPlan(
        dx,
        shape,
        arguments,
        parameter_grads,
        wants,
        (g.batch, g.channels),
        g.compute,
        g.activate_swish,
    )


class ForwardPlan(NamedTuple):
    """The plan of a forward call: the kernel's launch, shape and partition."""

    launch: Launch
    shape: tuple  # (N, C, HxW) or (N, HxW, C)
    activate_swish: bool
    groups_per_task: int
    fmt: StorageFormat

    def run(self, x, gamma, beta, y, mean, rstd, eps, swish_scale):
        """y, mean and rstd from the kernel views of x and y (C-contiguous in the plan's layout,
        any shape holding it); gamma, beta ``(C,)``, ``eps`` and ``swish_scale`` in the compute
        type; mean and rstd ``(N, G)`` compute-type outputs, C-contiguous."""
        launch, shape, activate_swish, groups_per_task, fmt = self  # one lookup
        (launch.call or launch)(
            x.reshape(shape),
            gamma,
            beta,
            eps,
            activate_swish,
            swish_scale,
            y.reshape(shape),
            mean,
            rstd,
            groups_per_task,
            fmt,
        )


def _forward_plan(g):
    work = g.batch * g.channels * g.positions
    launch = Launch(
        group_norm_swish_fwd_nhwc if g.nhwc else group_norm_swish_fwd_nchw, work, read_only=FORWARD_READ_ONLY
    )
    threads = g.threads if launch.parallel else 1
    if g.nhwc:
        groups_per_task = nhwc_groups_per_task(g.groups, g.channels // g.groups, g.batch, threads)
        shape = (g.batch, g.positions, g.channels)
    else:
        groups_per_task = nchw_groups_per_task(g.groups, g.batch, threads)
        shape = (g.batch, g.channels, g.positions)
    return ForwardPlan(launch, shape, g.activate_swish, groups_per_task, g.fmt)
