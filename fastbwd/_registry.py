"""The operators' registry, package side: for each public function, the kernel paths that
``fastbwd.precompile`` compiles and the small case ``python -m fastbwd`` checks against the
float64 oracle, with the input builders they share.

The benchmark harness beside the package (``bench/cases.py``) extends each :class:`Operator`
with its benchmark cases; the tests read both. One section per operator below.

A kernel path is a function ``call(dtype)`` that makes one public call (or a few that reach the
same kernel) on tiny inputs of that dtype: whatever the api layer passes is what gets compiled,
so the table stays right when a kernel's arguments change. Nothing here compiles at import.
"""

import types
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import _dtypes as d
from ._dtypes import BY_NAME

HALVES_AND_FLOATS = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class Path:
    """One kernel path: ``call(dtype)`` reaches it for each dtype name of ``dtypes``."""

    dtypes: tuple  # keys of _dtypes.BY_NAME
    layout: str  # "NCHW" or "NHWC" (channels-last memory, however the function is asked for it)
    name: str  # which kernel of the operator the call reaches
    call: Callable[[np.dtype], object]
    #: a variant that may reach kernels other paths compile too: precompile runs it after all the
    #: others (then it finds them in the cache instead of compiling them a second time in parallel)
    variant: bool = False


@dataclass(frozen=True)
class Operator:
    """One operator: its kernel paths (precompile) and its self-check."""

    name: str  # public function name (roi_align_forward: fastbwd.api.roi_align's, for the bridges)
    paths: tuple  # of Path
    #: () -> (result, float64 reference) on a small float32 case; None: no self-check
    check: Callable[[], tuple] | None = None


# ---- inputs ----------------------------------------------------------------------------------


def _array(shape, dtype, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, shape).astype(dtype)


def _rng_array(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _channels_last(array):
    """The same NCHW values with channels-last strides (a copy): how the NHWC kernels are reached."""
    return d.logical(d.physical(array, d.NHWC), d.NHWC)


def _fastbwd():
    """The public functions, from their api modules (the package imports this module: importing
    it here would be an import circle)."""
    from .api import avg_pool2d, group_norm_swish, replication_pad2d, roi_align, upsample_bilinear2d

    return types.SimpleNamespace(
        upsample_bilinear2d_backward=upsample_bilinear2d.upsample_bilinear2d_backward,
        avg_pool2d_backward=avg_pool2d.avg_pool2d_backward,
        replication_pad2d_backward=replication_pad2d.replication_pad2d_backward,
        roi_align_backward=roi_align.roi_align_backward,
        group_norm_swish_backward=group_norm_swish.group_norm_swish_backward,
        group_norm_swish=group_norm_swish.group_norm_swish,
    )


def _reference():
    from fastbwd.testing import reference

    return reference


# --------------------------------------------------------------------------------------------
# upsample_bilinear2d_backward (docs/semantics.md §1): the separable engine's three kernels.
# Row blocks: grad rows at least 16 wide; planes as lanes: grad rows narrower than 16 and at
# least 128 small planes; NHWC: the layout="NHWC" call and an NCHW-shaped channels-last array
# reach the same kernel.
# --------------------------------------------------------------------------------------------


def _upsample_row_blocks(dtype):
    g = _array((1, 2, 6, 20), dtype)
    return _fastbwd().upsample_bilinear2d_backward(g, (6, 20), (1, 2, 3, 10), False)


def _upsample_plane_lanes(dtype):
    g = _array((1, 128, 4, 6), dtype)
    return _fastbwd().upsample_bilinear2d_backward(g, (4, 6), (1, 128, 2, 3), False)


def _upsample_nhwc(dtype):
    f = _fastbwd()
    g = _array((1, 2, 6, 20), dtype)
    f.upsample_bilinear2d_backward(g.transpose(0, 2, 3, 1).copy(), (6, 20), (1, 2, 3, 10), False, layout="NHWC")
    return f.upsample_bilinear2d_backward(_channels_last(g), (6, 20), (1, 2, 3, 10), False)


def _check_upsample():
    g = _rng_array((2, 3, 9, 4))
    args = ((9, 4), (2, 3, 5, 7), False)
    return _fastbwd().upsample_bilinear2d_backward(g, *args), _reference().upsample_bilinear2d_backward(g, *args)


UPSAMPLE = Operator(
    "upsample_bilinear2d_backward",
    (
        Path(HALVES_AND_FLOATS, "NCHW", "row blocks", _upsample_row_blocks),
        Path(HALVES_AND_FLOATS, "NCHW", "planes as lanes", _upsample_plane_lanes),
        Path(HALVES_AND_FLOATS, "NHWC", "channel vectors", _upsample_nhwc),
    ),
    _check_upsample,
)


# --------------------------------------------------------------------------------------------
# avg_pool2d_backward (docs/semantics.md §2): whole rows (NCHW, grad rows of at least LANES; a
# kernel for width stride 2 and one for the others), the engine's three kernels (narrower grad
# rows and NHWC), and the global-window broadcast kernels.
# --------------------------------------------------------------------------------------------


def _avg_pool(shape, kernel, layout):
    def call(dtype):
        f = _fastbwd()
        out_shape = shape[:2] + tuple((size - kernel) // kernel + 1 for size in shape[2:])
        g, forward_input = _array(out_shape, dtype), shape
        if layout == "NHWC":
            # with a 1 x 1 output the input's memory format decides the layout
            g, forward_input = _channels_last(g), _channels_last(np.zeros(shape, dtype))
        return f.avg_pool2d_backward(g, forward_input, kernel)

    return call


def _check_avg_pool():
    g = _rng_array((2, 3, 5, 7))
    params = ((3, 2), (2, 1), (1, 0), True, False, 0)
    return (
        _fastbwd().avg_pool2d_backward(g, (2, 3, 9, 8), *params),
        _reference().avg_pool2d_backward(g, (2, 3, 9, 8), *params),
    )


AVG_POOL = Operator(
    "avg_pool2d_backward",
    (
        Path(HALVES_AND_FLOATS, "NCHW", "whole rows", _avg_pool((1, 2, 4, 40), 2, "NCHW")),
        Path(HALVES_AND_FLOATS, "NCHW", "whole rows, other strides", _avg_pool((1, 2, 6, 60), 3, "NCHW")),
        Path(HALVES_AND_FLOATS, "NCHW", "row blocks", _avg_pool((1, 2, 4, 20), 2, "NCHW")),
        Path(HALVES_AND_FLOATS, "NCHW", "planes as lanes", _avg_pool((1, 128, 8, 8), 2, "NCHW")),
        Path(HALVES_AND_FLOATS, "NCHW", "global window", _avg_pool((2, 3, 5, 5), 5, "NCHW")),
        Path(HALVES_AND_FLOATS, "NHWC", "channel vectors", _avg_pool((1, 2, 4, 8), 2, "NHWC")),
        Path(HALVES_AND_FLOATS, "NHWC", "global window", _avg_pool((2, 3, 5, 5), 5, "NHWC")),
    ),
    _check_avg_pool,
)


# --------------------------------------------------------------------------------------------
# replication_pad2d_backward (docs/semantics.md §3): one kernel per layout, and NCHW's for
# results larger than the cache (streaming stores; reached only by a result of
# _memory.STREAM_MIN_BYTES, so its call makes one).
# --------------------------------------------------------------------------------------------


def _pad(layout):
    def call(dtype):
        g = _array((1, 2, 7, 8), dtype)
        if layout == "NHWC":
            g = _channels_last(g)
        return _fastbwd().replication_pad2d_backward(g, (1, 2, 4, 5), (1, 2, 2, 1))

    return call


def _pad_streaming(dtype):
    from .kernels import _memory

    rows = -(-_memory.STREAM_MIN_BYTES // (64 * dtype.itemsize))
    g = np.zeros((1, 1, rows + 1, 65), dtype)
    return _fastbwd().replication_pad2d_backward(g, (1, 1, rows, 64), (1, 0, 0, 1))


def _check_pad():
    g = _rng_array((2, 3, 9, 7))
    shape, padding = (2, 3, 6, 5), (1, 1, 2, 1)
    return (
        _fastbwd().replication_pad2d_backward(g, shape, padding),
        _reference().replication_pad2d_backward(g, shape, padding),
    )


PAD = Operator(
    "replication_pad2d_backward",
    (
        Path(tuple(BY_NAME), "NCHW", "gather", _pad("NCHW")),
        Path(tuple(BY_NAME), "NHWC", "gather", _pad("NHWC")),
        Path(tuple(BY_NAME), "NCHW", "gather, streaming stores", _pad_streaming),
    ),
    _check_pad,
)


# --------------------------------------------------------------------------------------------
# roi_align_backward (docs/semantics.md §4): NCHW and NHWC (one kernel: a variant); fixed and
# adaptive sampling, boxes inside and partly outside. roi_align_forward (fastbwd.torch.roi_align's
# forward): one kernel for NCHW and channels-last input (channels-last strides or layout="NHWC");
# its tables kernels are the backward's (a variant).
# --------------------------------------------------------------------------------------------


def _roi_align(layout):
    def call(dtype):
        f = _fastbwd()
        boxes = np.array([[0, 1, 1, 6, 5], [1, -2, 0, 3, 9], [0, 0, 0, 2, 2]], dtype)
        g = _array((3, 3, 2, 2), dtype)
        g = np.ascontiguousarray(g.transpose(0, 2, 3, 1)) if layout == "NHWC" else g
        f.roi_align_backward(g, boxes, (2, 3, 8, 8), 2, 2, 1.0, 0, True, layout=layout)
        return f.roi_align_backward(g, boxes, (2, 3, 8, 8), 2, 2, 0.5, 2, False, layout=layout)

    return call


def _roi_align_forward(layout):
    def call(dtype):
        from .api.roi_align import roi_align_forward

        boxes = np.array([[0, 1, 1, 6, 5], [1, -2, 0, 3, 9], [0, 0, 0, 2, 2]], dtype)
        x = _array((2, 3, 8, 8), dtype)
        if layout == "NHWC":  # channels-last strides (an NCHW result), then the NHWC layout
            roi_align_forward(_channels_last(x), boxes, 2, 2, 1.0, 0, True)
            return roi_align_forward(
                np.ascontiguousarray(x.transpose(0, 2, 3, 1)), boxes, 2, 2, 0.5, 2, False, layout=layout
            )
        roi_align_forward(x, boxes, 2, 2, 1.0, 0, True)
        return roi_align_forward(x, boxes, 2, 2, 0.5, 2, False)

    return call


#: The self-check's boxes over two 10 x 12 images at spatial scale 0.5: inside, partly outside,
#: tiny, reversed, on either image.
_CHECK_BOXES = np.array(
    [
        [0, 1, 1, 15, 11],
        [1, -4, 2, 9, 25],
        [0, 10, 10, 11, 10.5],
        [1, 3, 3, 22, 19],
        [0, 18, 16, 6, 4],
        [1, 0, 0, 24, 20],
    ],
    np.float32,
)


def _check_roi_align():
    shape = (2, 3, 10, 12)
    boxes = _CHECK_BOXES
    g = _rng_array((6, 3, 3, 2))
    params = (3, 2, 0.5, 0, True)
    return (
        _fastbwd().roi_align_backward(g, boxes, shape, *params),
        _reference().roi_align_backward(g, boxes, shape, *params),
    )


def _check_roi_align_forward():
    from .api.roi_align import roi_align_forward

    shape = (2, 3, 10, 12)
    boxes = _CHECK_BOXES
    x = _rng_array(shape)
    params = (3, 2, 0.5, 0, True)
    return roi_align_forward(x, boxes, *params), _reference().roi_align_forward(x, boxes, *params)


ROI_ALIGN = Operator(
    "roi_align_backward",
    (
        Path(HALVES_AND_FLOATS, "NCHW", "backward", _roi_align("NCHW")),
        Path(HALVES_AND_FLOATS, "NHWC", "backward", _roi_align("NHWC"), variant=True),
    ),
    _check_roi_align,
)
ROI_ALIGN_FORWARD = Operator(
    "roi_align_forward",
    (
        Path(HALVES_AND_FLOATS, "NCHW", "forward", _roi_align_forward("NCHW"), variant=True),
        Path(HALVES_AND_FLOATS, "NHWC", "forward", _roi_align_forward("NHWC"), variant=True),
    ),
    _check_roi_align_forward,
)


# --------------------------------------------------------------------------------------------
# group_norm_swish_backward (docs/semantics.md §5): NCHW and NHWC kernels, parameters in the
# data's dtype or float32, and the parameter-gradient kernel (in gamma's dtype); each kernel
# also without Swish (activate_swish=False: compiled apart, the scale's type is None). The forward
# group_norm_swish (§5.1): NCHW and NHWC kernels, parameters in the data's dtype or float32
# (the api converts them to the compute type: the same kernels, statistics rounded after).
# --------------------------------------------------------------------------------------------


def _group_norm_swish(layout, params, activate_swish=True):
    def call(dtype):
        f = _fastbwd()
        param_dtype = np.float32 if params == "float32" else dtype
        x, dy = _array((2, 4, 3, 3), dtype, 1), _array((2, 4, 3, 3), dtype, 2)
        mean, rstd = np.zeros((2, 2), param_dtype), np.ones((2, 2), param_dtype)
        gamma, beta = np.ones(4, param_dtype), np.zeros(4, param_dtype)
        swish = {"activate_swish": activate_swish}
        if layout == "NHWC":
            # data_format="NHWC", and NCHW-shaped arrays with channels-last strides
            f.group_norm_swish_backward(_channels_last(dy), mean, rstd, _channels_last(x), gamma, beta, 2, **swish)
            x, dy = x.transpose(0, 2, 3, 1).copy(), dy.transpose(0, 2, 3, 1).copy()
            return f.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, 2, "NHWC", **swish)
        return f.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, 2, **swish)

    return call


def _group_norm(layout, params):
    """The backward without Swish (activate_swish=False), parameters in the data's dtype."""
    return _group_norm_swish(layout, params, activate_swish=False)


def _group_norm_swish_forward(layout, params):
    def call(dtype):
        f = _fastbwd()
        param_dtype = np.float32 if params == "float32" else dtype
        x = _array((2, 4, 3, 3), dtype, 1)
        gamma, beta = np.ones(4, param_dtype), np.zeros(4, param_dtype)
        if layout == "NHWC":
            f.group_norm_swish(_channels_last(x), gamma, beta, 2)
            return f.group_norm_swish(x.transpose(0, 2, 3, 1).copy(), gamma, beta, 2, "NHWC")
        return f.group_norm_swish(x, gamma, beta, 2)

    return call


def _check_group_norm_swish():
    ref = _reference()
    x = _rng_array((2, 6, 4, 5), 1)
    dy = _rng_array((2, 6, 4, 5), 2)
    gamma, beta = _rng_array((6,), 3), _rng_array((6,), 4)
    _, mean, rstd = ref.group_norm_swish_forward(x, gamma, beta, 3)
    mean, rstd = mean.astype(np.float32), rstd.astype(np.float32)
    return (
        _fastbwd().group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, 3),
        ref.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, 3),
    )


def _check_group_norm_swish_forward():
    x = _rng_array((2, 6, 4, 5), 1)
    gamma, beta = _rng_array((6,), 3), _rng_array((6,), 4)
    return _fastbwd().group_norm_swish(x, gamma, beta, 3), _reference().group_norm_swish_forward(x, gamma, beta, 3)


_HALVES_AND_FLOAT64 = ("float16", "bfloat16", "float64")


def _group_norm_swish_paths(call, without_swish=None):
    """A GroupNorm+Swish operator's paths: NCHW and NHWC, each with parameters in the data's
    dtype and (a variant) in float32, and ``without_swish``'s kernels when given;
    ``call(layout, params)`` (and ``without_swish(layout, params)``) makes each path's call."""
    return tuple(
        path
        for layout in ("NCHW", "NHWC")
        for path in (
            Path(HALVES_AND_FLOATS, layout, "params in the data dtype", call(layout, "same")),
            Path(_HALVES_AND_FLOAT64, layout, "float32 params", call(layout, "float32"), variant=True),
        )
        + ((Path(HALVES_AND_FLOATS, layout, "without Swish", without_swish(layout, "same")),) if without_swish else ())
    )


GROUP_NORM_SWISH = Operator(
    "group_norm_swish_backward", _group_norm_swish_paths(_group_norm_swish, _group_norm), _check_group_norm_swish
)
GROUP_NORM_SWISH_FORWARD = Operator(
    "group_norm_swish", _group_norm_swish_paths(_group_norm_swish_forward), _check_group_norm_swish_forward
)


#: Every operator, in the order of docs/semantics.md's table (each forward after its backward).
#: Its names are the one vocabulary of ``--ops`` in ``python -m fastbwd`` (the self-check and
#: ``--precompile``) and ``python3 -m bench``: the six public functions and roi_align_forward.
OPERATORS = {
    op.name: op
    for op in (UPSAMPLE, AVG_POOL, PAD, ROI_ALIGN, ROI_ALIGN_FORWARD, GROUP_NORM_SWISH, GROUP_NORM_SWISH_FORWARD)
}


def ops_help(extra=""):
    """The ``--ops`` help of every command: the operator names of :data:`OPERATORS` (and ``extra``)."""
    return (
        "only these operators (default: all): "
        + ", ".join(OPERATORS)
        + " (roi_align_forward: the forward kernel of fastbwd.torch.roi_align and fastbwd.jax.roi_align)"
        + extra
    )
