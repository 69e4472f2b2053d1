"""Baselines for the roi_align benchmarks and an independent cross-check for the tests
(torchvision is not installable here). Written from torchvision's semantics alone: nothing here
comes from fastbwd's kernels.

* ``"torch (pure PyTorch)"``: the RoIAlign forward written with torch ops -- every bilinear
  sample gathers its four pixels with ``index_select`` and the samples of a bin are summed with
  ``index_add`` -- and differentiated by autograd (whose backward scatters through
  ``index_add``). The graph is built once; the callable only runs ``torch.autograd.grad``.
* ``"serial loop"``: a faithful transcription of torchvision's CPU backward
  (``roi_align_backward_kernel_impl`` in ``torchvision/csrc/ops/cpu/roi_align_kernel.cpp``: per
  box, channel and bin, ``bilinear_interpolate_gradient`` per sample, then four adds), compiled as
  a serial ``@numba.njit`` function: what torchvision ships, single-threaded native code. Like
  the original it truncates the batch index and trusts the boxes (benchmark boxes are valid).
* :func:`torch_forward`: the same pure-PyTorch formulation evaluated forward (the roi_align
  output for an input), a cross-check for ``roi_align_forward``.
"""

import numba
import numpy as np
from numba import types
from numba.extending import overload


def like(value, template):
    """``value`` as the floating type of ``template``: torchvision's ``T`` (njit only)."""
    raise NotImplementedError("like() is only callable from @njit code")


@overload(like, inline="always")
def _like(value, template):
    if template == types.float32:
        return lambda value, template: np.float32(value)
    return lambda value, template: np.float64(value)


#: The pure-PyTorch formulation materialises C values per sample corner; above this many bytes
#: of gathered values it is left out (adaptive sampling of large boxes would need many GB).
_TORCH_MAX_BYTES = 3 << 30


@numba.njit(cache=True, nogil=True)
def _bilinear_interpolate_gradient(height, width, y, x):
    """torchvision's bilinear_interpolate_gradient: (w1..w4, x_low, x_high, y_low, y_high)."""
    zero = like(0.0, y)
    if y < -1.0 or y > height or x < -1.0 or x > width:
        return zero, zero, zero, zero, -1, -1, -1, -1
    if y <= 0:
        y = zero
    if x <= 0:
        x = zero
    y_low = int(y)
    x_low = int(x)
    if y_low >= height - 1:
        y_high = y_low = height - 1
        y = like(y_low, y)
    else:
        y_high = y_low + 1
    if x_low >= width - 1:
        x_high = x_low = width - 1
        x = like(x_low, x)
    else:
        x_high = x_low + 1
    ly = y - like(y_low, y)
    lx = x - like(x_low, x)
    hy = like(1.0, y) - ly
    hx = like(1.0, x) - lx
    return hy * hx, hy * lx, ly * hx, ly * lx, x_low, x_high, y_low, y_high


@numba.njit(cache=True, nogil=True)
def torchvision_serial_backward(grad_output, rois, spatial_scale, sampling_ratio, aligned, grad_input):
    """torchvision ``roi_align_backward_kernel_impl``, one element of grad_output at a time."""
    num_rois, channels, pooled_height, pooled_width = grad_output.shape
    height, width = grad_input.shape[2], grad_input.shape[3]
    zero = like(0.0, rois[0, 0])
    scale = like(spatial_scale, zero)
    for n in range(num_rois):
        for c in range(channels):
            for ph in range(pooled_height):
                for pw in range(pooled_width):
                    roi_batch_ind = int(rois[n, 0])
                    offset = like(0.5, zero) if aligned else zero
                    roi_start_w = rois[n, 1] * scale - offset
                    roi_start_h = rois[n, 2] * scale - offset
                    roi_end_w = rois[n, 3] * scale - offset
                    roi_end_h = rois[n, 4] * scale - offset
                    roi_width = roi_end_w - roi_start_w
                    roi_height = roi_end_h - roi_start_h
                    if not aligned:
                        roi_width = max(roi_width, like(1.0, zero))
                        roi_height = max(roi_height, like(1.0, zero))
                    bin_size_h = roi_height / like(pooled_height, zero)
                    bin_size_w = roi_width / like(pooled_width, zero)
                    grad_output_this_bin = grad_output[n, c, ph, pw]
                    grid_h = (
                        sampling_ratio if sampling_ratio > 0 else int(np.ceil(roi_height / like(pooled_height, zero)))
                    )
                    grid_w = (
                        sampling_ratio if sampling_ratio > 0 else int(np.ceil(roi_width / like(pooled_width, zero)))
                    )
                    count = like(grid_h * grid_w, zero)
                    plane = grad_input[roi_batch_ind, c]
                    for iy in range(grid_h):
                        y = (
                            roi_start_h
                            + like(ph, zero) * bin_size_h
                            + (like(iy, zero) + like(0.5, zero)) * bin_size_h / like(grid_h, zero)
                        )
                        for ix in range(grid_w):
                            x = (
                                roi_start_w
                                + like(pw, zero) * bin_size_w
                                + (like(ix, zero) + like(0.5, zero)) * bin_size_w / like(grid_w, zero)
                            )
                            w1, w2, w3, w4, x_low, x_high, y_low, y_high = _bilinear_interpolate_gradient(
                                height, width, y, x
                            )
                            g1 = grad_output_this_bin * w1 / count
                            g2 = grad_output_this_bin * w2 / count
                            g3 = grad_output_this_bin * w3 / count
                            g4 = grad_output_this_bin * w4 / count
                            if x_low >= 0 and x_high >= 0 and y_low >= 0 and y_high >= 0:
                                plane[y_low, x_low] += g1
                                plane[y_low, x_high] += g2
                                plane[y_high, x_low] += g3
                                plane[y_high, x_high] += g4


def _torch_samples(
    torch, boxes, input_shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned, dtype=None
):
    """Every sample of every box as flat tensors, built with torch ops (coordinates in ``dtype``,
    float32 by default): ``(bin_id, corner_index (4, S), corner_weight (4, S))`` where ``bin_id``
    is ``k * PH * PW + ph * PW + pw`` and the weights are already divided by the bin's count."""
    dtype = dtype or torch.float32
    batch, _, height, width = input_shape
    rois = torch.as_tensor(np.asarray(boxes)).to(dtype)
    offset = 0.5 if aligned else 0.0
    bins, indices, weights = [], [], []
    for k in range(rois.shape[0]):
        b = int(rois[k, 0])
        x1, y1, x2, y2 = (rois[k, 1:] * spatial_scale - offset).unbind()
        roi_w, roi_h = x2 - x1, y2 - y1
        if not aligned:
            roi_w, roi_h = roi_w.clamp(min=1.0), roi_h.clamp(min=1.0)
        bin_h, bin_w = roi_h / pooled_height, roi_w / pooled_width
        gh = sampling_ratio if sampling_ratio > 0 else int(torch.ceil(roi_h / pooled_height))
        gw = sampling_ratio if sampling_ratio > 0 else int(torch.ceil(roi_w / pooled_width))
        if gh <= 0 or gw <= 0:
            continue
        ph = torch.arange(pooled_height, dtype=dtype)[:, None]
        pw = torch.arange(pooled_width, dtype=dtype)[:, None]
        y = (y1 + ph * bin_h + (torch.arange(gh, dtype=dtype) + 0.5) * bin_h / gh).reshape(-1)
        x = (x1 + pw * bin_w + (torch.arange(gw, dtype=dtype) + 0.5) * bin_w / gw).reshape(-1)
        y, x = torch.broadcast_tensors(y[:, None], x[None, :])  # (PH*gh, PW*gw)
        inside = (y >= -1) & (y <= height) & (x >= -1) & (x <= width)
        y, x = y.clamp(min=0), x.clamp(min=0)
        y_low, x_low = y.long().clamp(max=height - 1), x.long().clamp(max=width - 1)
        y = torch.where(y.long() >= height - 1, y_low.to(dtype), y)
        x = torch.where(x.long() >= width - 1, x_low.to(dtype), x)
        y_high, x_high = (y_low + 1).clamp(max=height - 1), (x_low + 1).clamp(max=width - 1)
        ly, lx = y - y_low, x - x_low
        hy, hx = 1 - ly, 1 - lx
        base = b * height * width
        corner = torch.stack(
            [
                base + y_low * width + x_low,
                base + y_low * width + x_high,
                base + y_high * width + x_low,
                base + y_high * width + x_high,
            ]
        )
        weight = torch.stack([hy * hx, hy * lx, ly * hx, ly * lx]) / (gh * gw)
        rows = torch.arange(pooled_height).repeat_interleave(gh)[:, None]
        cols = torch.arange(pooled_width).repeat_interleave(gw)[None, :]
        bin_id = (k * pooled_height + rows) * pooled_width + cols
        bins.append(torch.broadcast_to(bin_id, inside.shape)[inside])
        indices.append(corner[:, inside])
        weights.append(weight[:, inside])
    return torch.cat(bins), torch.cat(indices, 1), torch.cat(weights, 1)


def _torch_baseline(
    torch, grad_output, boxes, input_shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned
):
    """The autograd callable of the pure-PyTorch formulation, or None if it would not fit."""
    batch, channels, height, width = input_shape
    bin_id, corner_index, corner_weight = _torch_samples(
        torch, boxes, input_shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned
    )
    if 4 * corner_index.shape[1] * channels * 4 > _TORCH_MAX_BYTES:
        return None
    g = torch.from_numpy(np.ascontiguousarray(grad_output, np.float32))
    x = torch.zeros((channels, batch * height * width), requires_grad=True)  # values do not matter
    sampled = sum(x.index_select(1, corner_index[i]) * corner_weight[i] for i in range(4))
    pooled = torch.zeros((channels, g.shape[0] * pooled_height * pooled_width)).index_add(1, bin_id, sampled)
    output = pooled.reshape(channels, g.shape[0], pooled_height, pooled_width).transpose(0, 1)

    def run():
        (grad_x,) = torch.autograd.grad(output, x, g, retain_graph=True)
        return grad_x.reshape(channels, batch, height, width).transpose(0, 1)

    return run


def torch_roi_align(input, boxes, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned):
    """torchvision's ``roi_align`` written with torch ops in ``input``'s dtype (gathers and
    ``index_add``), differentiable with respect to ``input``: the baseline of the PyTorch bridge's
    benchmark and an independent cross-check of ``fastbwd.torch.roi_align``. ``boxes`` is a
    ``(K, 5)`` array or tensor of valid boxes (finite, batch index in range)."""
    import torch

    batch, channels, height, width = input.shape
    boxes = boxes.detach().cpu().numpy() if isinstance(boxes, torch.Tensor) else np.asarray(boxes)
    bin_id, corner_index, corner_weight = _torch_samples(
        torch, boxes, input.shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned, input.dtype
    )
    planes = input.transpose(0, 1).reshape(channels, batch * height * width)
    sampled = sum(planes.index_select(1, corner_index[i]) * corner_weight[i] for i in range(4))
    pooled = torch.zeros((channels, boxes.shape[0] * pooled_height * pooled_width), dtype=input.dtype).index_add(
        1, bin_id, sampled
    )
    return pooled.reshape(channels, boxes.shape[0], pooled_height, pooled_width).transpose(0, 1)


def torch_forward(x, boxes, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned):
    """roi_align's output for the float32 input ``x`` (B, C, H, W) by :func:`torch_roi_align`
    (float32), as a NumPy array (K, C, PH, PW)."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    return torch_roi_align(
        x, np.asarray(boxes, np.float32), pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned
    ).numpy()


def baselines(grad_output, boxes, input_shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned):
    """name -> zero-argument callable computing grad_input, for the cases of ``cases.py``.

    The pure-PyTorch row needs float32 data and torch; the serial loop takes float32/float64.
    """
    grad_output = np.asarray(grad_output)
    rois = np.ascontiguousarray(boxes)
    grad_input_shape = tuple(input_shape)
    result = {}
    if grad_output.dtype in (np.float32, np.float64):
        g = np.ascontiguousarray(grad_output)

        def serial():
            grad_input = np.zeros(grad_input_shape, g.dtype)  # torchvision allocates zeros too
            torchvision_serial_backward(g, rois, spatial_scale, sampling_ratio, aligned, grad_input)
            return grad_input

        result["serial loop"] = serial
    try:
        import torch
    except ImportError:
        return result
    if grad_output.dtype == np.float32:
        run = _torch_baseline(
            torch, grad_output, boxes, input_shape, pooled_height, pooled_width, spatial_scale, sampling_ratio, aligned
        )
        if run is not None:
            result["torch (pure PyTorch)"] = run
    return result
