"""fastbwd.group_norm_swish_backward (aclnnGroupNormSwishGrad, docs/semantics.md §5) and its forward
fastbwd.group_norm_swish (aclnnGroupNormSwish, §5.1), which share their validation.

Each direction is validate, look up the plan, allocate, run (docs/design.md, "The one contract"):
:func:`plan` and :func:`forward_plan` validate a call's arguments and hold the kernels' plan
(``kernels.group_norm_swish.plan``) with what the per-call work needs; :func:`run` and
:func:`run_forward` allocate the results and run it. The PyTorch bridge calls these four.
"""

# annotations kept as strings: help() shows `ArrayLike`, not numpy's 2,000-character expansion of it
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from .. import _dtypes as d
from .. import _validation as v
from ..kernels import group_norm_swish as kernels
from . import _contract

FUNC = "group_norm_swish_backward"
FORWARD = "group_norm_swish"

#: data_format strings meaning "channels at axis 1" (docs/semantics.md §5), and the channels-last one.
CHANNELS_FIRST_FORMATS = ("NCHW", "ND", "NCL", "NCDHW")
CHANNELS_LAST_FORMAT = "NHWC"
#: The documents' limit on channels per group.
MAX_GROUP_SIZE = 4000
MAX_RANK = 8


def data_format_of(func, data_format, layout):
    """``data_format`` as the plans take it, given ``layout=`` too (the one layout argument of
    every function): None leaves ``data_format`` to decide; "NCHW" or "NHWC" decides, and a
    ``data_format`` other than its default must then agree with it."""
    if layout is None:
        return data_format
    if data_format != "NCHW":
        v.choice(func, "data_format", data_format, CHANNELS_FIRST_FORMATS + (CHANNELS_LAST_FORMAT,))
    layout = v.layout(func, layout)
    if data_format != "NCHW" and (data_format == CHANNELS_LAST_FORMAT) != (layout == CHANNELS_LAST_FORMAT):
        v.fail(func, "layout", f"must agree with data_format ({data_format!r})", repr(layout))
    return layout


def group_norm_swish_backward(
    dy: ArrayLike,
    mean: ArrayLike,
    rstd: ArrayLike,
    x: ArrayLike,
    gamma: ArrayLike,
    beta: ArrayLike,
    num_groups: int,
    data_format: str = "NCHW",
    swish_scale: float = 1.0,
    dgamma_is_require: bool = True,
    dbeta_is_require: bool = True,
    *,
    activate_swish: bool = True,
    layout: str | None = None,
    out: tuple | None = None,
) -> tuple[np.ndarray | None, ...]:
    """Gradients of ``out = y * sigmoid(swish_scale * y)``, ``y = GroupNorm(x) * gamma + beta``.

    With ``s = swish_scale`` in the compute type, ``xhat = (x - mean[n,g]) * rstd[n,g]``,
    ``sig = sigmoid(s*y)``, ``gnew = dy * sig * (1 + s*y*(1 - sig))`` (docs/semantics.md §5;
    ``gnew = dy`` with ``activate_swish=False``, the plain GroupNorm backward)::

        dbeta[c]  = sum over n, spatial of gnew
        dgamma[c] = sum over n, spatial of gnew * xhat
        c1[n,g] = sum_{c in g} gamma[c] * sum_spatial(gnew) / (D * HxW)     (c2: with gnew * xhat)
        dx = rstd[n,g] * (gnew * gamma[c] - xhat * c2[n,g] - c1[n,g])

    The same as PyTorch autograd through ``F.group_norm(x, G, gamma, beta, eps)`` then
    ``y * torch.sigmoid(s * y)``, given that forward's mean and rstd.

    Parameters
    ----------
    dy : array_like
        Gradient of the Swish output, shaped like ``x``. float32, float16, bfloat16 or float64.
    mean, rstd : array_like
        Per-(sample, group) mean and reciprocal standard deviation of the forward, shape
        ``(N, G)`` or flat ``(N*G,)`` (both arrays the same shape); used as given, never
        recomputed. dtype: dy's or float32.
    x : array_like
        The forward input, rank 2 to 8: ``(N, C, *spatial)``, or ``(N, *spatial, C)`` with
        ``data_format="NHWC"``. Same dtype as dy. Any strides; a 4-D NCHW array with
        channels-last strides (PyTorch ``channels_last``) is read in place and gives a
        channels-last dx.
    gamma, beta : array_like
        Per-channel scale and shift, shape ``(C,)``. dtype: dy's or float32 (each).
    num_groups : int
        G > 0, dividing C, with at most 4000 channels per group.
    data_format : str, optional
        ``"NCHW"`` (default), ``"ND"``, ``"NCL"`` or ``"NCDHW"``: channels at axis 1, for any
        rank (the names are synonyms). ``"NHWC"``: channels on the last axis.
    swish_scale : float, optional
        ``s``, any real value (0, negatives, infinities and NaN included), used in the compute
        type: as given for float64 data, rounded to float32 otherwise (a magnitude beyond the
        float32 range becomes an infinity, silently: an infinite scale makes the Swish
        derivative a step function, 1 for y > 0 and 0 for y < 0, and NaN at y = 0 where
        ``s*y`` is NaN). For ``|s*y|`` beyond 104 (750 for float64 data) the Swish derivative
        takes its limit value (1 above, 0 below), which is what float32 (float64) evaluation
        of the formula gives there to the last bit; infinities in ``s*y`` therefore give
        finite derivatives. A NaN scale gives NaN everywhere.
    dgamma_is_require, dbeta_is_require : bool, optional
        When False that gradient is not returned (None in its place).
    activate_swish : bool, optional, keyword-only
        True (default): the gradient of GroupNorm followed by Swish, as the forward's
        ``activate_swish``. False: of GroupNorm alone (``out = y``, so ``gnew = dy``;
        ``swish_scale`` is then checked but not used), PyTorch's ``native_group_norm_backward``.
    layout : {"NCHW", "NHWC"}, optional, keyword-only
        The layout argument every function takes: channels at axis 1 or last. None (default):
        ``data_format`` decides (its older name, kept); given, it decides, and a
        ``data_format`` other than "NCHW" must agree with it.
    out : tuple of 3 (numpy.ndarray or None), optional
        ``(dx, dgamma, dbeta)``; each given array must have exactly its result's shape, dtype
        and memory layout and is written completely and returned. An array given for a
        gradient that is not required is zero-filled (and None is returned in its place). On
        any error nothing is written.

    Returns
    -------
    dx : numpy.ndarray
        Shaped like ``x``, in x's dtype, C-contiguous (channels-last for a channels-last 4-D
        NCHW input).
    dgamma, dbeta : numpy.ndarray or None
        Shape ``(C,)`` in gamma's dtype, or None when not required.

    Notes
    -----
    Computed in float32 for float32, float16 and bfloat16 data (parameters are converted
    exactly), in float64 for float64 data; half-format results are rounded once. The Swish
    derivative uses a polynomial exp with about 1e-7 relative error for float32 and ``exp``
    for float64. Sums run in a fixed order (blocks of 4096 spatial positions, 16 interleaved
    partial sums each, folded pairwise), identical for NCHW and NHWC and for any thread
    count, so results are bitwise reproducible. Each task keeps its groups' ``gnew`` between
    its two passes, in dx itself for float32 and float64 data, in a float32 scratch array for
    the half formats, so the Swish derivative is evaluated once per element.

    Raises
    ------
    ParamError
        Status 161001 when dy, mean, rstd, x, gamma, beta or num_groups is None; 161002 for:
        x of rank < 2 or > 8; dy.shape != x.shape; N, C or HxW == 0; mean or rstd not of shape
        (N, G) or (N*G,), or of different shapes; gamma or beta shape != (C,); num_groups not an
        integer or <= 0, C % G != 0, C/G > 4000; unsupported dtypes (dy and x not the same
        float dtype, a parameter neither dy's dtype nor float32); a bad data_format,
        swish_scale, flag (activate_swish included) or ``out``.

    Examples
    --------
    The forward's mean and rstd feed the backward; ``dgamma`` and ``dbeta`` are per channel.

    >>> import numpy as np, fastbwd
    >>> x = np.arange(2 * 4 * 3 * 3, dtype=np.float32).reshape(2, 4, 3, 3)
    >>> gamma, beta = np.ones(4, np.float32), np.zeros(4, np.float32)
    >>> y, mean, rstd = fastbwd.group_norm_swish(x, gamma, beta, 2)
    >>> dx, dgamma, dbeta = fastbwd.group_norm_swish_backward(np.ones_like(x), mean, rstd, x, gamma, beta, 2)
    >>> dx.shape, dgamma.shape, dbeta.shape
    ((2, 4, 3, 3), (4,), (4,))
    """
    dy = v.as_array(FUNC, "dy", dy)
    mean = v.as_array(FUNC, "mean", mean)
    rstd = v.as_array(FUNC, "rstd", rstd)
    x = v.as_array(FUNC, "x", x)
    gamma = v.as_array(FUNC, "gamma", gamma)
    beta = v.as_array(FUNC, "beta", beta)
    swish_scale = v.float_value(FUNC, "swish_scale", swish_scale)
    if layout is not None:
        data_format = data_format_of(FUNC, data_format, layout)
    call = OPERATION.plan(
        dy,
        mean,
        rstd,
        x,
        gamma,
        beta,
        num_groups,
        data_format,
        dgamma_is_require,
        dbeta_is_require,
        out,
        activate_swish,
    )
    return call.run(dy, mean, rstd, x, gamma, beta, swish_scale, out)


_INPUT_NAMES = ("dy", "mean", "rstd", "x", "gamma", "beta")


class _Plan(NamedTuple):
    """What a backward call's metadata decided (see :mod:`fastbwd.api._contract`)."""

    kernels: kernels.BackwardPlan
    results: tuple  # the _dtypes.Result of dx, dgamma and dbeta
    operands: tuple  # the _dtypes.Operand of dy, mean, rstd, x, gamma and beta (_dtypes.operands)
    compute: np.dtype
    want_dgamma: bool
    want_dbeta: bool
    unwanted: np.ndarray  # an empty kernel view of gamma's dtype: the kernels' dgamma or dbeta when not wanted

    def out_entries(self, out):
        return _out_entries(out)

    def run(self, dy, mean, rstd, x, gamma, beta, swish_scale, out):
        """The backward call on NumPy arrays with the metadata the plan was made for
        (``swish_scale`` a float, ``out`` as the public function takes it): the outputs
        (``out`` entries checked to overlap no input), then the kernels. Returns
        ``(dx, dgamma, dbeta)``."""
        kernel_plan, results, operands, compute, want_dgamma, want_dbeta, unwanted = self  # one lookup
        if out is None:
            dx, dx_phys = d.new(results[0])
            dgamma, dgamma_phys = d.new(results[1]) if want_dgamma else (None, unwanted)
            dbeta, dbeta_phys = d.new(results[2]) if want_dbeta else (None, unwanted)
        else:
            (dx, dgamma, dbeta), (dx_phys, dgamma_phys, dbeta_phys) = d.allocate_all(
                FUNC, results, _out_entries(out), _INPUT_NAMES, (dy, mean, rstd, x, gamma, beta)
            )
        if operands is not None:
            dy, mean, rstd, x, gamma, beta = d.kernel_operands((dy, mean, rstd, x, gamma, beta), operands)
        kernel_plan.run(
            dy,
            mean,
            rstd,
            x,
            gamma,
            beta,
            dx_phys,
            dgamma_phys,
            dbeta_phys,
            d.compute_scalar(swish_scale, compute),  # a huge scale: an infinity, a valid step
        )
        # A gradient that is not required: None, and an out= array given for it is zero-filled.
        if not want_dgamma:
            if out is not None:
                dgamma_phys.fill(0)
            dgamma = None
        if not want_dbeta:
            if out is not None:
                dbeta_phys.fill(0)
            dbeta = None
        return dx, dgamma, dbeta


def _plan(
    threads,
    dy,
    mean,
    rstd,
    x,
    gamma,
    beta,
    num_groups,
    data_format,
    dgamma_is_require,
    dbeta_is_require,
    out,
    activate=True,
):
    """Validate every argument (errors in the documented order) and plan the kernels."""
    groups = v.int_value(FUNC, "num_groups", num_groups)
    data_format = v.choice(FUNC, "data_format", data_format, CHANNELS_FIRST_FORMATS + (CHANNELS_LAST_FORMAT,))
    want_dgamma = v.bool_value(FUNC, "dgamma_is_require", dgamma_is_require)
    want_dbeta = v.bool_value(FUNC, "dbeta_is_require", dbeta_is_require)
    activate = v.bool_value(FUNC, "activate_swish", activate)

    v.check_dtype(FUNC, "x", x, d.FLOATING)
    v.check_same_dtype(FUNC, "dy", dy.dtype, "x", x.dtype)
    dtype = x.dtype
    for name, param in (("mean", mean), ("rstd", rstd), ("gamma", gamma), ("beta", beta)):
        _check_parameter_dtype(FUNC, name, param, dtype)
    _check_rank(FUNC, x)
    v.check_shape(FUNC, "dy", dy.shape, x.shape, "as x")
    channels_last = data_format == CHANNELS_LAST_FORMAT
    batch, channels, hw = _geometry(FUNC, x, groups, channels_last)
    if mean.shape not in ((batch, groups), (batch * groups,)):
        v.fail(FUNC, "mean.shape", f"must be {(batch, groups)} or {(batch * groups,)} (N, G)", mean.shape)
    v.check_shape(FUNC, "rstd", rstd.shape, mean.shape, "as mean")
    _check_parameter_shapes(FUNC, gamma, beta, channels)

    # The physical layout the kernels see: (N, C, HxW) or (N, HxW, C).
    layout = d.NHWC if not channels_last and d.is_channels_last(x) else d.NCHW
    results = _results(FUNC, out, x, layout, (channels,), gamma.dtype, _BACKWARD_OUT_NAMES)
    compute = d.compute_dtype(dtype)
    geometry = kernels.Geometry(
        channels_last or layout == d.NHWC,
        batch,
        channels,
        hw,
        groups,
        dtype.itemsize,
        d.storage_format(dtype),
        compute,
        d.storage_format(gamma.dtype),
        want_dgamma,
        want_dbeta,
        threads,
        activate,
    )
    statistics = (batch, groups)
    operands = d.operands(
        d.operand(dy, layout),
        d.operand(mean, dtype=compute, shape=statistics),
        d.operand(rstd, dtype=compute, shape=statistics),
        d.operand(x, layout),
        d.operand(gamma, dtype=compute),
        d.operand(beta, dtype=compute),
    )
    unwanted = d.new(d.result((0,), gamma.dtype))[1]  # never written: safe to share between calls
    return _Plan(kernels.plan(geometry), results, operands, compute, want_dgamma, want_dbeta, unwanted)


def _results(func, out, x, layout, parameter_shape, parameter_dtype, names):
    """The :class:`~fastbwd._dtypes.Result` of the x-shaped result and of the two results of
    ``parameter_shape``, after checking ``out``'s entries against them (ParamError)."""
    results = (
        d.result(x.shape, x.dtype, layout, "out[0]"),
        d.result(parameter_shape, parameter_dtype, param="out[1]"),
        d.result(parameter_shape, parameter_dtype, param="out[2]"),
    )
    for entry, spec in zip(_out_entries(out, func, names), results):
        d.check_out(func, entry, spec.shape, spec.dtype, spec.layout, param=spec.param)
    return results


def _check_parameter_dtype(func, name, param, dtype):
    """A parameter array (mean, rstd, gamma, beta) must have the data's dtype or float32."""
    if param.dtype not in (dtype, d.float32):
        v.fail(func, f"{name}.dtype", f"must be x's dtype ({dtype}) or float32", param.dtype)


def _check_rank(func, x):
    if not 2 <= x.ndim <= MAX_RANK:
        v.fail(func, "x", f"must have rank 2 to {MAX_RANK}", f"{x.ndim}-D with shape {x.shape}")


def _geometry(func, x, groups, channels_last):
    """``(N, C, HxW)`` of x (channels at axis 1, or last when ``channels_last``), after checking
    that none is 0 and that ``groups`` suits C (docs/semantics.md §5)."""
    channel_axis = x.ndim - 1 if channels_last else 1
    spatial_axes = [axis for axis in range(1, x.ndim) if axis != channel_axis]
    batch, channels = x.shape[0], x.shape[channel_axis]
    for axis, what in [(0, "N"), (channel_axis, "C")] + [(axis, "spatial") for axis in spatial_axes]:
        if x.shape[axis] == 0:
            v.fail(func, f"x.shape[{axis}]", f"({what}) must be > 0 (empty tensors are not supported)", 0)
    hw = int(np.prod([x.shape[axis] for axis in spatial_axes], dtype=np.int64))
    if groups <= 0:
        v.fail(func, "num_groups", "must be > 0", groups)
    if channels % groups != 0:
        v.fail(func, "num_groups", f"must divide the channel count C = {channels}", groups)
    if channels // groups > MAX_GROUP_SIZE:
        v.fail(
            func,
            "num_groups",
            f"must leave at most {MAX_GROUP_SIZE} channels per group (C = {channels})",
            f"{groups} ({channels // groups} channels per group)",
        )
    return batch, channels, hw


def _check_parameter_shapes(func, gamma, beta, channels):
    v.check_shape(func, "gamma", gamma.shape, (channels,), "one per channel")
    v.check_shape(func, "beta", beta.shape, (channels,), "one per channel")


_BACKWARD_OUT_NAMES = "dx, dgamma, dbeta"


def _out_entries(out, func=FUNC, names=_BACKWARD_OUT_NAMES):
    """``out=`` as three entries (array or None); None means allocate all three."""
    if out is None:
        return None, None, None
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        v.fail(func, "out", f"must be a tuple ({names}) of arrays or None", v.describe(out))
    return tuple(out)


# ---- the forward (docs/semantics.md §5.1) -----------------------------------------------------


def group_norm_swish(
    x: ArrayLike,
    gamma: ArrayLike,
    beta: ArrayLike,
    num_groups: int,
    data_format: str = "NCHW",
    eps: float = 1e-5,
    activate_swish: bool = True,
    swish_scale: float = 1.0,
    *,
    layout: str | None = None,
    out: Sequence[np.ndarray | None] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GroupNorm followed by Swish: ``y * sigmoid(swish_scale * y)``, ``y = GroupNorm(x)*gamma + beta``.

    Per sample n and group g of ``D = C/G`` channels (``M = D * HxW`` elements)::

        mean[n,g] = sum(x) / M;   var[n,g] = sum((x - mean)^2) / M      (biased)
        rstd[n,g] = 1 / sqrt(var + eps)
        y = (x - mean[n,g]) * rstd[n,g] * gamma[c] + beta[c]
        out = y * sigmoid(swish_scale * y)  if activate_swish, else y

    The forward of :func:`group_norm_swish_backward`, which takes the mean and rstd returned
    here; the same as PyTorch's ``torch.native_group_norm(x, gamma, beta, N, C, HxW, G, eps)``
    followed by ``y * torch.sigmoid(swish_scale * y)`` (docs/semantics.md §5.1).

    Parameters
    ----------
    x : array_like
        Rank 2 to 8: ``(N, C, *spatial)``, or ``(N, *spatial, C)`` with ``data_format="NHWC"``.
        float32, float16, bfloat16 or float64. Any strides; a 4-D NCHW array with
        channels-last strides (PyTorch ``channels_last``) is read in place and gives a
        channels-last result.
    gamma, beta : array_like
        Per-channel scale and shift, shape ``(C,)``. dtype: x's or float32 (each).
    num_groups : int
        G > 0, dividing C, with at most 4000 channels per group.
    data_format : str, optional
        ``"NCHW"`` (default), ``"ND"``, ``"NCL"`` or ``"NCDHW"``: channels at axis 1, for any
        rank (synonyms). ``"NHWC"``: channels on the last axis.
    eps : float, optional
        Added to the variance: a finite number >= 0 (default 1e-5), used in the compute type.
        A group whose variance and eps are both 0 gets rstd = inf (and y NaN), as in PyTorch.
    activate_swish : bool, optional
        Apply Swish (default True); False returns the GroupNorm output ``y`` itself.
    swish_scale : float, optional
        ``s``, any real value (0 and negatives included), used in the compute type (float64
        for float64 data, float32 otherwise).
    layout : {"NCHW", "NHWC"}, optional, keyword-only
        As :func:`group_norm_swish_backward`'s: None leaves ``data_format`` to decide.
    out : tuple of 3 (numpy.ndarray or None), optional
        ``(y, mean, rstd)``; each given array must have exactly its result's shape, dtype and
        memory layout and is written completely and returned. On any error nothing is written.

    Returns
    -------
    y : numpy.ndarray
        Shaped like ``x``, in x's dtype, C-contiguous (channels-last for a channels-last 4-D
        NCHW input).
    mean, rstd : numpy.ndarray
        Shape ``(N, G)``, in gamma's dtype (float32 for half-precision x with float32 gamma).

    Notes
    -----
    Computed in float32 for float32, float16 and bfloat16 data, in float64 for float64 data;
    every result is rounded once. The statistics take two passes over each group (the mean,
    then centred sums), so a constant group has variance exactly 0. Sums run in an order fixed
    by the shape (blocks of 4096 elements, 16 interleaved partial sums each, folded pairwise,
    for NCHW; per channel in position order for NHWC), so results are bitwise the same for any
    thread count; NCHW and NHWC agree to rounding.

    Raises
    ------
    ParamError
        Status 161001 when x, gamma, beta or num_groups is None; 161002 for: x of rank < 2 or
        > 8; N, C or HxW == 0; gamma or beta shape != (C,); num_groups not an integer or <= 0,
        C % G != 0, C/G > 4000; unsupported dtypes (x not a float dtype, a parameter neither
        x's dtype nor float32); eps not finite or < 0; a bad data_format, swish_scale, flag or
        ``out``.

    Examples
    --------
    Two groups of two channels: ``mean`` and ``rstd`` are ``(N, num_groups)``.

    >>> import numpy as np, fastbwd
    >>> x = np.arange(2 * 4 * 3 * 3, dtype=np.float32).reshape(2, 4, 3, 3)
    >>> y, mean, rstd = fastbwd.group_norm_swish(x, np.ones(4, np.float32), np.zeros(4, np.float32), 2)
    >>> y.shape, mean
    ((2, 4, 3, 3), array([[ 8.5, 26.5],
           [44.5, 62.5]], dtype=float32))
    """
    x = v.as_array(FORWARD, "x", x)
    gamma = v.as_array(FORWARD, "gamma", gamma)
    beta = v.as_array(FORWARD, "beta", beta)
    eps, swish_scale = forward_scalars(eps, swish_scale)
    if layout is not None:
        data_format = data_format_of(FORWARD, data_format, layout)
    call = FORWARD_OPERATION.plan(x, gamma, beta, num_groups, data_format, activate_swish, out)
    return call.run(x, gamma, beta, eps, swish_scale, out)


def forward_scalars(eps, swish_scale):
    """``eps`` and ``swish_scale`` of a forward call as the floats :func:`run_forward` takes,
    after the public function's checks (ParamError)."""
    eps = v.float_value(FORWARD, "eps", eps)
    if not 0 <= eps < math.inf:
        v.fail(FORWARD, "eps", "must be a finite number >= 0", repr(eps))
    return eps, v.float_value(FORWARD, "swish_scale", swish_scale)


def parallel_tasks(batch, channels, num_groups, data_format, threads):
    """The parallel tasks the kernels split a call of ``batch`` images of ``channels`` channels
    in ``num_groups`` groups into, on ``threads`` threads, in ``data_format`` ("NCHW" or
    "NHWC"; a rank above 4 as its flattened NCHW or NHWC): what the bridges tell their decision
    (``fastbwd._dispatch.decide``'s ``tasks``). None for groups the kernels refuse."""
    if num_groups < 1 or channels % num_groups:
        return None
    return kernels.parallel_tasks(data_format == "NHWC", batch, channels, num_groups, max(1, threads))


_FORWARD_OUT_NAMES = "y, mean, rstd"


class _ForwardPlan(NamedTuple):
    """What the forward's arguments' metadata decided (see :mod:`fastbwd.api._contract`)."""

    kernels: kernels.ForwardPlan
    results: tuple  # the _dtypes.Result of y, mean and rstd
    operands: tuple  # the _dtypes.Operand of x, gamma and beta (_dtypes.operands)
    compute: np.dtype
    statistics: tuple  # (N, G) when mean and rstd are rounded from compute-type ones, else None

    def out_entries(self, out):
        return _out_entries(out, FORWARD, _FORWARD_OUT_NAMES)

    def run(self, x, gamma, beta, eps, swish_scale, out):
        """The forward call on NumPy arrays with the metadata the plan was made for (``eps`` and
        ``swish_scale`` as :func:`forward_scalars` returns them, ``out`` as the public function
        takes it). Returns ``(y, mean, rstd)``."""
        kernel_plan, results, operands, compute, statistics = self  # one lookup
        if out is None:
            y, y_phys = d.new(results[0])
            mean = d.new(results[1])[0]
            rstd = d.new(results[2])[0]
        else:
            (y, mean, rstd), (y_phys, _, _) = d.allocate_all(
                FORWARD, results, self.out_entries(out), ("x", "gamma", "beta"), (x, gamma, beta)
            )
        if operands is not None:
            x, gamma, beta = d.kernel_operands((x, gamma, beta), operands)
        # the kernel writes the statistics in the compute type; other dtypes are rounded once here
        mean_c = mean if statistics is None else np.empty(statistics, compute)
        rstd_c = rstd if statistics is None else np.empty(statistics, compute)
        kernel_plan.run(
            x,
            gamma,
            beta,
            y_phys,
            mean_c,
            rstd_c,
            d.compute_scalar(eps, compute),
            d.compute_scalar(swish_scale, compute),  # beyond float32's range: an infinity
        )
        if statistics is not None:
            mean[...] = mean_c
            rstd[...] = rstd_c
        return y, mean, rstd


def _forward_plan(threads, x, gamma, beta, num_groups, data_format, activate_swish, out):
    """Validate the forward's arguments (in the backward's order) and plan the kernel."""
    groups = v.int_value(FORWARD, "num_groups", num_groups)
    data_format = v.choice(FORWARD, "data_format", data_format, CHANNELS_FIRST_FORMATS + (CHANNELS_LAST_FORMAT,))
    activate_swish = v.bool_value(FORWARD, "activate_swish", activate_swish)
    v.check_dtype(FORWARD, "x", x, d.FLOATING)
    for name, param in (("gamma", gamma), ("beta", beta)):
        _check_parameter_dtype(FORWARD, name, param, x.dtype)
    _check_rank(FORWARD, x)
    channels_last = data_format == CHANNELS_LAST_FORMAT
    batch, channels, hw = _geometry(FORWARD, x, groups, channels_last)
    _check_parameter_shapes(FORWARD, gamma, beta, channels)
    layout = d.NHWC if not channels_last and d.is_channels_last(x) else d.NCHW
    results = _results(FORWARD, out, x, layout, (batch, groups), gamma.dtype, _FORWARD_OUT_NAMES)
    compute = d.compute_dtype(x.dtype)
    geometry = kernels.ForwardGeometry(
        channels_last or layout == d.NHWC,
        batch,
        channels,
        hw,
        groups,
        d.storage_format(x.dtype),
        compute,
        activate_swish,
        threads,
    )
    operands = d.operands(d.operand(x, layout), d.operand(gamma, dtype=compute), d.operand(beta, dtype=compute))
    statistics = None if gamma.dtype == compute else (batch, groups)
    return _ForwardPlan(kernels.plan(geometry), results, operands, compute, statistics)


def _bind(arguments):
    """A prepared backward call's plan arguments and scalars (see _contract.Operation)."""
    a = arguments
    data_format = data_format_of(FUNC, a["data_format"], a["layout"])
    flags = (a["dgamma_is_require"], a["dbeta_is_require"], a["out"], a["activate_swish"])
    plan_args = (*(a[n] for n in _INPUT_NAMES), a["num_groups"], data_format, *flags)
    return plan_args, (v.float_value(FUNC, "swish_scale", a["swish_scale"]),)


def _bind_forward(arguments):
    """A prepared forward call's plan arguments and scalars."""
    a = arguments
    data_format = data_format_of(FORWARD, a["data_format"], a["layout"])
    plan_args = (a["x"], a["gamma"], a["beta"], a["num_groups"], data_format, a["activate_swish"], a["out"])
    return plan_args, forward_scalars(a["eps"], a["swish_scale"])


_BACKWARD_PARAMETERS = (*_INPUT_NAMES, "num_groups", "data_format", "dgamma_is_require", "dbeta_is_require", "out")
# the NHWC task partition is sized by the thread count: the plans are "threaded"
OPERATION = _contract.Operation(
    group_norm_swish_backward,
    _plan,
    _BACKWARD_PARAMETERS + ("activate_swish",),
    scalars=("swish_scale",),
    threaded=True,
    bind=_bind,
)
FORWARD_OPERATION = _contract.Operation(
    group_norm_swish,
    _forward_plan,
    ("x", "gamma", "beta", "num_groups", "data_format", "activate_swish", "out"),
    scalars=("eps", "swish_scale"),
    threaded=True,
    bind=_bind_forward,
)
#: The validated plans of a backward and a forward call (the bridges'): the function's arguments
#: but the scalars, in this order, the arrays as NumPy arrays (ParamError as the function raises
#: it), ``activate_swish`` last and optional for the backward (True).
plan = OPERATION.plan
forward_plan = FORWARD_OPERATION.plan
run = run_forward = _contract.run
