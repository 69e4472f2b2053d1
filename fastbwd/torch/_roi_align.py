"""``torchvision.ops.roi_align`` for PyTorch on fastbwd's kernels (docs/semantics.md §4 and §7).

torchvision's signature and semantics; the forward is fastbwd's parallel RoIAlign forward
kernel and the backward is ``fastbwd.roi_align_backward``, both from the same per-box weight
tables, deterministic for any thread count.
"""

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.jit.annotations import BroadcastingList2

import fastbwd

from . import _ops


def _check_boxes(boxes):
    """Eager-mode checks of the two box forms, as ParamError (scripted code asserts instead)."""
    if isinstance(boxes, torch.Tensor):
        if boxes.dim() != 2 or boxes.shape[1] != 5:
            raise fastbwd.ParamError(
                f"roi_align: boxes must be a Tensor[K, 5] or a list of Tensor[L, 4], but got a "
                f"tensor of shape {tuple(boxes.shape)}",
                param="boxes",
            )
        return
    if not isinstance(boxes, (list, tuple)):
        raise fastbwd.ParamError(
            f"roi_align: boxes must be a Tensor[K, 5] or a list of Tensor[L, 4], but got {type(boxes).__name__}",
            param="boxes",
        )
    for index, per_image in enumerate(boxes):
        if not isinstance(per_image, torch.Tensor) or per_image.dim() != 2 or per_image.shape[1] != 4:
            shape = tuple(per_image.shape) if isinstance(per_image, torch.Tensor) else type(per_image).__name__
            raise fastbwd.ParamError(
                f"roi_align: boxes[{index}] must be a Tensor[L, 4], but got {shape}", param="boxes"
            )


def boxes_to_rois(boxes: list[Tensor], like: Tensor) -> Tensor:
    """One tensor per image of ``(x1, y1, x2, y2)`` rows -> one ``(K, 5)`` tensor of ``(image,
    x1, y1, x2, y2)`` rows, the list index as the image (an empty list: no rows, of ``like``'s
    dtype). Written so that TorchScript compiles it (no size it cannot infer)."""
    if len(boxes) == 0:
        return torch.zeros((0, 5), dtype=like.dtype, device=like.device)
    images = [torch.full_like(per_image[:, :1], index) for index, per_image in enumerate(boxes)]
    return torch.cat([torch.cat(images, dim=0), torch.cat(boxes, dim=0)], dim=1)


# A leaf of torch.fx.symbolic_trace (as torchvision's roi_align): the boxes list cannot be
# iterated as a Proxy, and the registered operator is what a graph should hold.
@torch.fx.wrap
def roi_align(
    input: Tensor,
    boxes: Tensor | list[Tensor],
    output_size: BroadcastingList2[int],
    spatial_scale: float = 1.0,
    sampling_ratio: int = -1,
    aligned: bool = False,
) -> Tensor:
    """``torchvision.ops.roi_align`` on fastbwd (forward and backward).

    Parameters
    ----------
    input : Tensor[N, C, H, W]
        float32, float64, float16 or bfloat16, on the CPU.
    boxes : Tensor[K, 5] or list of Tensor[L, 4]
        Rows ``(image, x1, y1, x2, y2)``, or one ``(x1, y1, x2, y2)`` tensor per image; the same
        dtype as ``input`` (under CPU autocast any float dtypes: both are computed in float32
        and the result comes back in ``input``'s dtype, as torchvision's autocast kernel does).
        Boxes with NaN/Inf values or an image index outside the batch give zero rows
        (torchvision would read out of bounds).
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
        In ``input``'s dtype: the registered operator ``fastbwd::roi_align``. The gradient flows
        to ``input`` (not to ``boxes``, as in torchvision) through ``fastbwd::roi_align_backward``,
        which is linear in its gradient: its own derivative is this forward (double backward
        is exact). An output size of 0, or no boxes, gives an empty result.

    Raises
    ------
    fastbwd.ParamError
        ``boxes`` in neither form, or ``output_size`` not an int or a pair (eager calls).
    RuntimeError
        What torchvision's roi_align kernels refuse, as they do: an input that is not a 4-D
        float tensor, boxes of another dtype or device, a negative output size; and
        ``spatial_scale`` not greater than FLT_MIN (fastbwd's kernels' limit).
    """
    if not torch.jit.is_scripting():
        if isinstance(input, torch.fx.Proxy):  # reached by a name fx.wrap did not patch
            return _ops.fx_leaf(roi_align, input, boxes, output_size, spatial_scale, sampling_ratio, aligned)
        _check_boxes(boxes)
        # an int or a pair (scripted, BroadcastingList2 has made a pair of an int already)
        output_size = tuple(output_size) if isinstance(output_size, Iterable) else (output_size, output_size)
        if len(output_size) != 2:
            message = f"roi_align: output_size must be an int or a pair of ints, but got {output_size}"
            raise fastbwd.ParamError(message, param="output_size")
    if isinstance(boxes, torch.Tensor):
        rois = boxes
    else:
        rois = boxes_to_rois(boxes, input)
    if not torch.jit.is_scripting():
        if _ops.use_eager_path(input, rois):
            return _ops.EagerRoIAlign.apply(
                input, rois, float(spatial_scale), output_size[0], output_size[1], int(sampling_ratio), bool(aligned)
            )
    return torch.ops.fastbwd.roi_align(
        input, rois, float(spatial_scale), output_size[0], output_size[1], int(sampling_ratio), bool(aligned)
    )


class RoIAlign(nn.Module):
    """``torchvision.ops.RoIAlign`` on fastbwd: see :func:`roi_align`."""

    def __init__(self, output_size, spatial_scale, sampling_ratio, aligned=False):
        super().__init__()
        self.output_size = output_size
        self.spatial_scale = spatial_scale
        self.sampling_ratio = sampling_ratio
        self.aligned = aligned

    def forward(self, input: Tensor, rois: Tensor | list[Tensor]) -> Tensor:
        return roi_align(input, rois, self.output_size, self.spatial_scale, self.sampling_ratio, self.aligned)

    def __repr__(self):
        return (
            f"{self.__class__.__name__}(output_size={self.output_size}, "
            f"spatial_scale={self.spatial_scale}, sampling_ratio={self.sampling_ratio}, "
            f"aligned={self.aligned})"
        )
