"""``torchvision.ops.roi_align`` for JAX: fastbwd's forward and backward kernels, both through
the FFI transport (JAX has no RoIAlign of its own)."""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .. import _validation as v
from ..api import roi_align as api
from . import _common as c
from . import _ffi

FUNC = "roi_align"
#: The api's arguments in the user's words (the backward's grad_output is shaped by the forward's).
_SUBJECTS = {"pooled_height": "output_size[0]", "pooled_width": "output_size[1]", "input_shape": "input.shape"}


def _forward_adapter(inputs, outputs, config):
    (input, boxes), (pooled,) = inputs, outputs
    scalars = config["spatial_scale"], config["sampling_ratio"], config["aligned"]
    plan = api.forward_plan(input, boxes, *config["pooled_size"], *scalars, pooled)
    api.run_forward(plan, input, boxes, pooled)


def _backward_adapter(inputs, outputs, config):
    (grad_output, boxes), (grad_input,) = inputs, outputs
    scalars = config["spatial_scale"], config["sampling_ratio"], config["aligned"]
    plan = api.plan(grad_output, boxes, grad_input.shape, *config["pooled_size"], *scalars, grad_input)
    api.run(plan, grad_output, boxes, grad_input)


_FORWARD = _ffi.target("roi_align_forward", _forward_adapter, fold=False)
_BACKWARD = _ffi.target("roi_align_backward", _backward_adapter, fold=False)


def _config(pooled_size, spatial_scale, sampling_ratio, aligned):
    return dict(
        pooled_size=list(pooled_size), spatial_scale=spatial_scale, sampling_ratio=sampling_ratio, aligned=aligned
    )


def _forward(input, boxes, pooled_size, spatial_scale, sampling_ratio, aligned):
    result = jax.ShapeDtypeStruct((boxes.shape[0], input.shape[1]) + tuple(pooled_size), input.dtype)
    (output,) = _ffi.call(
        _FORWARD, [input, boxes], [result], _config(pooled_size, spatial_scale, sampling_ratio, aligned)
    )
    return output


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _roi_align(input, boxes, pooled_size, spatial_scale, sampling_ratio, aligned, input_shape):
    return _forward(input, boxes, pooled_size, spatial_scale, sampling_ratio, aligned)


def _roi_align_fwd(input, boxes, pooled_size, spatial_scale, sampling_ratio, aligned, input_shape):
    return _forward(input, boxes, pooled_size, spatial_scale, sampling_ratio, aligned), boxes


def _roi_align_bwd(pooled_size, spatial_scale, sampling_ratio, aligned, input_shape, boxes, grad_output):
    result = jax.ShapeDtypeStruct(input_shape, grad_output.dtype)
    (grad_input,) = _ffi.call(
        _BACKWARD, [grad_output, boxes], [result], _config(pooled_size, spatial_scale, sampling_ratio, aligned)
    )
    # The boxes get no gradient (torchvision's roi_align does not differentiate them either).
    return grad_input, jnp.zeros_like(boxes)


_roi_align.defvjp(_roi_align_fwd, _roi_align_bwd)


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
) -> jax.Array:
    """``torchvision.ops.roi_align`` (docs/semantics.md §4) on fastbwd's kernels.

    Parameters
    ----------
    input : jax.Array
        ``(N, C, H, W)``: float32, float64, float16 or bfloat16.
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

    Returns
    -------
    jax.Array
        ``(K, C, pooled_height, pooled_width)`` in input's dtype, from fastbwd's forward kernel.
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
        api.forward_plan(
            c.placeholder(input.shape, input.dtype),
            boxes_placeholder,
            *output_size,
            spatial_scale,
            sampling_ratio,
            aligned,
            None,
        )
        pooled_size = c.ints(output_size)
        api.plan(
            c.placeholder((rois.shape[0], input.shape[1]) + pooled_size, input.dtype),
            boxes_placeholder,
            input.shape,
            *pooled_size,
            spatial_scale,
            sampling_ratio,
            aligned,
            None,
        )
    return _roi_align(input, rois, pooled_size, float(spatial_scale), sampling_ratio, bool(aligned), input.shape)
