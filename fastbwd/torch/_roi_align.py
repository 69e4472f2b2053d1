"""``torchvision.ops.roi_align`` for PyTorch on fastbwd's kernels (docs/semantics.md §4 and §7).

torchvision's signature and semantics; the forward is fastbwd's parallel RoIAlign forward
kernel and the backward is ``fastbwd.roi_align_backward``, both from the same per-box weight
tables, deterministic for any thread count.
"""

import torch
from torch import nn
from torch.autograd.function import once_differentiable

import fastbwd
from fastbwd.api import roi_align as roi_align_api

from . import _convert as c
from ._threads import match_torch_threads


def _pair(size, name):
    if isinstance(size, int) and not isinstance(size, bool):
        return size, size
    size = tuple(size)
    if len(size) != 2:
        raise fastbwd.ParamError(f"roi_align: {name} must be an int or a pair of ints, but got {size}",
                                 param=name)
    return size


def boxes_to_rois(boxes, dtype=torch.float32):
    """torchvision's two forms of boxes as one ``(K, 5)`` tensor of ``(image, x1, y1, x2, y2)``.

    ``boxes`` is a ``Tensor[K, 5]`` (returned as it is) or a list/tuple of ``Tensor[L, 4]``, one
    per image of the batch, which become rows with their list index as the image (an empty
    list gives no rows, of ``dtype``)."""
    if isinstance(boxes, torch.Tensor):
        if boxes.dim() != 2 or boxes.shape[1] != 5:
            raise fastbwd.ParamError(
                f"roi_align: boxes must be a Tensor[K, 5] or a list of Tensor[L, 4], but got a "
                f"tensor of shape {tuple(boxes.shape)}", param="boxes")
        return boxes
    boxes = list(boxes)
    for index, per_image in enumerate(boxes):
        if not isinstance(per_image, torch.Tensor) or per_image.dim() != 2 or per_image.shape[1] != 4:
            shape = tuple(per_image.shape) if isinstance(per_image, torch.Tensor) else type(per_image).__name__
            raise fastbwd.ParamError(
                f"roi_align: boxes[{index}] must be a Tensor[L, 4], but got {shape}", param="boxes")
    if not boxes:
        return torch.zeros((0, 5), dtype=dtype)
    rows = torch.cat(boxes, dim=0)
    images = torch.cat([torch.full((len(b), 1), i, dtype=rows.dtype, device=rows.device)
                        for i, b in enumerate(boxes)], dim=0)
    return torch.cat([images, rows], dim=1)


class _RoIAlign(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, rois, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned):
        match_torch_threads()
        output = c.empty((rois.shape[0], input.shape[1], pooled_height, pooled_width), input.dtype)
        roi_align_api.roi_align_forward(c.as_array(input), c.as_array(rois), pooled_height, pooled_width,
                          spatial_scale, sampling_ratio, aligned, out=c.as_array(output))
        ctx.save_for_backward(rois)
        ctx.geometry = (tuple(input.shape), pooled_height, pooled_width, spatial_scale,
                        sampling_ratio, aligned)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        (rois,) = ctx.saved_tensors
        input_shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned = ctx.geometry
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        match_torch_threads()
        grad_input = c.empty(input_shape, grad_output.dtype)
        fastbwd.roi_align_backward(c.as_array(grad_output.contiguous()), c.as_array(rois),
                                   input_shape, pooled_height, pooled_width, spatial_scale,
                                   sampling_ratio, aligned, out=c.as_array(grad_input))
        return (grad_input,) + (None,) * 6


def roi_align(input, boxes, output_size, spatial_scale=1.0, sampling_ratio=-1, aligned=False):
    """``torchvision.ops.roi_align`` on fastbwd (forward and backward).

    Parameters
    ----------
    input : Tensor[N, C, H, W]
        float32, float64, float16 or bfloat16, on the CPU.
    boxes : Tensor[K, 5] or list of Tensor[L, 4]
        Rows ``(image, x1, y1, x2, y2)``, or one ``(x1, y1, x2, y2)`` tensor per image; the same
        dtype as ``input``. Boxes with NaN/Inf values or an image index outside the batch
        give zero rows (torchvision would read out of bounds).
    output_size : int or (int, int)
        ``(pooled_height, pooled_width)``.
    spatial_scale : float
        Scales the box coordinates into ``input``'s pixels (e.g. 1/16).
    sampling_ratio : int
        Samples per bin along each axis; ``<= 0`` is adaptive (``ceil(roi_size / output_size)``).
        Any size is affordable: the kernels cost per touched pixel, not per sample.
    aligned : bool
        Shift the boxes by -0.5 pixel (pixel-center alignment).

    Returns
    -------
    Tensor[K, C, pooled_height, pooled_width]
        In ``input``'s dtype. The gradient flows to ``input`` (not to ``boxes``, as in
        torchvision); the backward is not itself differentiable.
    """
    rois = boxes_to_rois(boxes, input.dtype)
    pooled_height, pooled_width = _pair(output_size, "output_size")
    sampling_ratio = max(int(sampling_ratio), 0)
    return _RoIAlign.apply(input, rois.detach(), pooled_height, pooled_width, float(spatial_scale),
                           sampling_ratio, bool(aligned))


class RoIAlign(nn.Module):
    """``torchvision.ops.RoIAlign`` on fastbwd: see :func:`roi_align`."""

    def __init__(self, output_size, spatial_scale, sampling_ratio, aligned=False):
        super().__init__()
        self.output_size = output_size
        self.spatial_scale = spatial_scale
        self.sampling_ratio = sampling_ratio
        self.aligned = aligned

    def forward(self, input, rois):
        return roi_align(input, rois, self.output_size, self.spatial_scale, self.sampling_ratio,
                         self.aligned)

    def __repr__(self):
        return (f"{self.__class__.__name__}(output_size={self.output_size}, "
                f"spatial_scale={self.spatial_scale}, sampling_ratio={self.sampling_ratio}, "
                f"aligned={self.aligned})")
