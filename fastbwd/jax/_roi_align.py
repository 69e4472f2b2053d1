"""``torchvision.ops.roi_align`` for JAX: fastbwd's forward and backward kernels, both through
the FFI transport (JAX has no RoIAlign of its own)."""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from .. import _dtypes as d
from .. import _validation as v
from ..api import roi_align as api
from . import _common as c
from . import _decide, _ffi, _linear, _sharding

FUNC = "roi_align"
#: The api's arguments in the user's words (the backward's grad_output is shaped by the forward's).
_SUBJECTS = {"pooled_height": "output_size[0]", "pooled_width": "output_size[1]", "input_shape": "input.shape"}


def _forward_adapter(inputs, outputs, config):
    """The forward on the buffers, prepared (the handler keeps it for their metadata)."""
    (input, boxes), (pooled,) = inputs, outputs
    scalars = config["spatial_scale"], config["sampling_ratio"], config["aligned"]
    forward = api.roi_align_forward.prepare(
        input, boxes, *config["pooled_size"], *scalars, layout=config["layout"], out=pooled
    )
    return _prepared(forward, inputs, outputs)


def _backward_adapter(inputs, outputs, config):
    """The backward on the buffers, prepared (the handler keeps it for their metadata)."""
    (grad_output, boxes), (grad_input,) = inputs, outputs
    scalars = config["spatial_scale"], config["sampling_ratio"], config["aligned"]
    layout = config["layout"]
    input_shape = _nchw(grad_input.shape, layout)
    backward = api.roi_align_backward.prepare(
        grad_output, boxes, input_shape, *config["pooled_size"], *scalars, layout=layout, out=grad_input
    )
    return _prepared(backward, inputs, outputs)


def _prepared(call, inputs, outputs):
    """``call`` (of the two operands, one result) run on the buffers, as the handler keeps it."""

    def prepared(inputs, outputs):
        call(*inputs, out=outputs[0])

    prepared(inputs, outputs)
    return prepared


def _nchw(shape, layout):
    """``(B, C, H, W)`` of a feature map's shape in ``layout``."""
    return (shape[0], shape[3], shape[1], shape[2]) if layout == "NHWC" else tuple(shape)


_FORWARD = _ffi.target("roi_align_forward", _forward_adapter, fold=False, split=_sharding.boxes_forward)
_BACKWARD = _ffi.target("roi_align_backward", _backward_adapter, fold=False, split=_sharding.boxes_backward)


def _config(pooled_size, spatial_scale, sampling_ratio, aligned, layout):
    return dict(
        pooled_size=list(pooled_size),
        spatial_scale=spatial_scale,
        sampling_ratio=sampling_ratio,
        aligned=aligned,
        layout=layout,
    )


def _pooled_shape(input_shape, num_boxes, pooled_size, layout):
    channels = input_shape[3] if layout == "NHWC" else input_shape[1]
    if layout == "NHWC":
        return (num_boxes,) + tuple(pooled_size) + (channels,)
    return (num_boxes, channels) + tuple(pooled_size)


def _forward(input, boxes, pooled_size, spatial_scale, sampling_ratio, aligned, layout):
    result = jax.ShapeDtypeStruct(_pooled_shape(input.shape, boxes.shape[0], pooled_size, layout), input.dtype)
    (output,) = _ffi.call(
        _FORWARD, [input, boxes], [result], _config(pooled_size, spatial_scale, sampling_ratio, aligned, layout)
    )
    return output


def _backward(grad_output, boxes, input, pooled_size, spatial_scale, sampling_ratio, aligned, input_shape, layout):
    # sharded like input (its rows are images, which the boxes spread over every device)
    result = jax.ShapeDtypeStruct(input_shape, grad_output.dtype, sharding=jax.typeof(input).sharding)
    (grad_input,) = _ffi.call(
        _BACKWARD,
        [grad_output, boxes],
        [result],
        _config(pooled_size, spatial_scale, sampling_ratio, aligned, layout),
    )
    return _sharding.gradient_like(grad_input, input)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _roi_align(input, boxes, pooled_size, spatial_scale, sampling_ratio, aligned, input_shape, layout):
    return _forward(input, boxes, pooled_size, spatial_scale, sampling_ratio, aligned, layout)


@_roi_align.defjvp
def _roi_align_jvp(pooled_size, spatial_scale, sampling_ratio, aligned, input_shape, layout, primals, tangents):
    # Linear in the features; the boxes get no derivative (torchvision's roi_align does not
    # differentiate them either), so their tangent is not used.
    (input, boxes), (tangent, _) = primals, tangents
    arguments = pooled_size, spatial_scale, sampling_ratio, aligned

    def apply(residuals, linear):
        return [_forward(linear[0], residuals[0], *arguments, layout)]

    def transpose(residuals, cotangents):
        return [_backward(cotangents[0], *residuals, *arguments, input_shape, layout)]

    # the primal through the function itself (a second forward-mode derivative finds this rule)
    output = _roi_align(input, boxes, *arguments, input_shape, layout)
    # input, for its type only (the gradient is sharded like it): no derivative flows through it
    return output, _linear.call(FUNC, apply, transpose, [boxes, lax.stop_gradient(input)], [tangent])[0]


def _sample_taps(start, bin_size, pooled, samples, size, compute):
    """One axis of a fixed sampling grid (§4): per box, bin and sample, the two pixels read,
    their weights, and whether the sample lands in ``[-1, size]``; each ``(K, pooled, samples)``."""
    bins = jnp.arange(pooled, dtype=compute)[None, :, None]
    steps = jnp.arange(samples, dtype=compute)[None, None, :]
    start, bin_size = start[:, None, None], bin_size[:, None, None]
    position = start + bins * bin_size + (steps + 0.5) * bin_size / samples
    valid = (position >= -1) & (position <= size)  # NaN: not valid
    position = jnp.clip(jnp.where(valid, position, 0), 0, size)
    low = jnp.floor(position).astype(jnp.int32)
    edge = low >= size - 1
    low = jnp.where(edge, size - 1, low)
    high = jnp.where(edge, size - 1, low + 1)
    fraction = jnp.where(edge, 0, position - low.astype(compute))
    return low, high, jnp.where(valid, 1 - fraction, 0), jnp.where(valid, fraction, 0)


def _plain(input, rois, pooled_size, spatial_scale, sampling_ratio, aligned, layout):
    """RoIAlign of a fixed ``sampling_ratio`` (> 0) in plain JAX (gathers of each sample's four
    pixels; JAX's own gradient): §4's forward, computed in the compute type and rounded once. The
    boxes get no gradient, as in :func:`roi_align`."""
    compute = d.compute_dtype(input.dtype)
    images = (input if layout == "NHWC" else jnp.transpose(input, (0, 2, 3, 1))).astype(compute)
    count, height, width, _ = images.shape
    boxes = lax.stop_gradient(rois).astype(compute)
    finite = jnp.all(jnp.isfinite(boxes), axis=1)
    index = jnp.floor(jnp.where(finite, boxes[:, 0], -1))
    keep = finite & (index >= 0) & (index < count)
    batch = jnp.where(keep, index, 0).astype(jnp.int32)
    offset = 0.5 if aligned else 0.0
    x1, y1, x2, y2 = (jnp.where(finite, boxes[:, i], 0) * spatial_scale - offset for i in range(1, 5))
    roi_w, roi_h = x2 - x1, y2 - y1
    if not aligned:
        roi_w, roi_h = jnp.maximum(roi_w, 1), jnp.maximum(roi_h, 1)
    pooled_height, pooled_width = pooled_size
    rows = _sample_taps(y1, roi_h / pooled_height, pooled_height, sampling_ratio, height, compute)
    cols = _sample_taps(x1, roi_w / pooled_width, pooled_width, sampling_ratio, width, compute)
    keep = keep.astype(compute)[:, None, None] / (sampling_ratio * sampling_ratio)
    image = batch[:, None, None, None, None]
    pooled = 0
    for row, row_weight in ((rows[0], rows[2]), (rows[1], rows[3])):
        for col, col_weight in ((cols[0], cols[2]), (cols[1], cols[3])):
            pixels = images[image, row[:, :, :, None, None], col[:, None, None, :, :]]  # (K, PH, g, PW, g, C)
            pooled = pooled + jnp.einsum("kpi,kqj,kpiqjc->kpqc", row_weight * keep, col_weight, pixels)
    pooled = pooled.astype(input.dtype)
    return pooled if layout == "NHWC" else jnp.transpose(pooled, (0, 3, 1, 2))


def _rois(boxes, dtype):
    """torchvision's two forms of boxes as one ``(K, 5)`` array of ``(image, x1, y1, x2, y2)``."""
    if isinstance(boxes, (list, tuple)):
        parts = []
        for index, per_image in enumerate(boxes):
            per_image = jnp.asarray(per_image)
            if per_image.ndim != 2 or per_image.shape[1] != 4:
                v.fail(FUNC, f"boxes[{index}]", "must be an array of shape (L, 4)", f"shape {per_image.shape}")
            parts.append(
                jnp.concatenate([jnp.full((per_image.shape[0], 1), index, per_image.dtype), per_image], axis=1)
            )
        return jnp.concatenate(parts, axis=0) if parts else jnp.zeros((0, 5), dtype)
    return jnp.asarray(boxes)


def roi_align(
    input: jax.Array,
    boxes: jax.Array | Sequence[jax.Array],
    output_size: int | Sequence[int],
    spatial_scale: float = 1.0,
    sampling_ratio: int = -1,
    aligned: bool = False,
    *,
    layout: str = "NCHW",
) -> jax.Array:
    """``torchvision.ops.roi_align`` (docs/semantics.md §4) on fastbwd's kernels.

    Parameters
    ----------
    input : jax.Array
        ``(N, C, H, W)``, or ``(N, H, W, C)`` with ``layout="NHWC"``: float32, float64, float16
        or bfloat16.
    boxes : jax.Array or list of jax.Array
        ``(K, 5)`` rows ``(image, x1, y1, x2, y2)``, or one ``(L, 4)`` array of
        ``(x1, y1, x2, y2)`` per image; input's dtype. A box with NaN/Inf values or an image
        index outside the batch gives zeros.
    output_size : int or (int, int)
        ``(pooled_height, pooled_width)``.
    spatial_scale : float
        Scales the box coordinates into input's pixels.
    sampling_ratio : int
        Samples per bin along each axis; ``<= 0`` is adaptive.
    aligned : bool
        Shift the boxes by -0.5 pixel.
    layout : {"NCHW", "NHWC"}
        Layout of input, of the result and of the gradients: ``"NHWC"`` (channels-last) runs
        fastbwd's channels-last kernels in both directions, bitwise equal to the NCHW ones.

    Returns
    -------
    jax.Array
        ``(K, C, pooled_height, pooled_width)`` (``(K, pooled_height, pooled_width, C)`` with
        ``layout="NHWC"``) in input's dtype, from fastbwd's forward kernel.
        Differentiable with respect to input (``fastbwd.roi_align_backward``); the boxes get a
        zero gradient, as in torchvision. Under ``jax.vmap`` the kernels run once per batch
        element (a loop).

    Raises
    ------
    ParamError
        At trace time (the checks of fastbwd's RoIAlign forward and backward, said of this
        function's arguments).
    """
    input = jnp.asarray(input)
    rois = _rois(boxes, input.dtype)
    output_size = c.static_ints(output_size)
    if isinstance(output_size, (int,)) and not isinstance(output_size, bool):
        output_size = (output_size, output_size)
    if not isinstance(output_size, tuple) or len(output_size) != 2:
        v.fail(FUNC, "output_size", "must be an int or a pair of ints", v.describe(output_size))
    sampling_ratio = max(v.int_value(FUNC, "sampling_ratio", sampling_ratio), 0)
    boxes_placeholder = c.placeholder(rois.shape, rois.dtype)
    with v.called_as(FUNC, _SUBJECTS):
        api.forward_plan(  # validates layout too ("NCHW" or "NHWC")
            c.placeholder(input.shape, input.dtype),
            boxes_placeholder,
            *output_size,
            spatial_scale,
            sampling_ratio,
            aligned,
            layout,
            None,
        )
        pooled_size = c.ints(output_size)
        api.plan(
            c.placeholder(_pooled_shape(input.shape, rois.shape[0], pooled_size, layout), input.dtype),
            boxes_placeholder,
            _nchw(input.shape, layout),
            *pooled_size,
            spatial_scale,
            sampling_ratio,
            aligned,
            layout,
            None,
        )
    # plain JAX where it is the faster; an adaptive sampling_ratio has a sample count that
    # depends on the boxes' values, which plain JAX's static shapes cannot follow: fastbwd's
    if sampling_ratio > 0 and not _decide.serves("traced", FUNC, input, layout):
        return _plain(input, rois, pooled_size, float(spatial_scale), sampling_ratio, bool(aligned), layout)
    return _roi_align(
        input, rois, pooled_size, float(spatial_scale), sampling_ratio, bool(aligned), input.shape, layout
    )
