"""Supported dtypes, kernel views of arrays, memory layouts and output allocation.

The one place that knows how a user's array becomes something a kernel can take:

* float16 and bfloat16 travel as ``uint16`` views with a :class:`StorageFormat` that tells the
  kernel how to decode and encode them (Numba rejects both dtypes outright);
* an NCHW-shaped array with channels-last strides is handed over as its C-contiguous NHWC view,
  without a copy (docs/semantics.md §0.1); any other strides are made C-contiguous NCHW;
* results are allocated here (:func:`empty`: uninitialised, since the kernels write every
  element; large ones reuse the memory of dropped results, see ``_result_cache``) or taken from
  ``out=`` after checking it.
"""

import ml_dtypes
import numpy as np

from . import _validation as v
from ._result_cache import empty
from .kernels import BFLOAT16, FLOAT16, NATIVE

float16 = np.dtype(np.float16)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)
complex64 = np.dtype(np.complex64)
complex128 = np.dtype(np.complex128)

#: Every supported dtype by its name (as ``fastbwd.precompile`` and the benchmark cases name them).
BY_NAME = {
    "float32": float32,
    "float16": float16,
    "bfloat16": bfloat16,
    "float64": float64,
    "complex64": complex64,
    "complex128": complex128,
}

#: The real floating dtypes every operator accepts.
FLOATING = (float32, float16, bfloat16, float64)
#: replication_pad2d_backward also takes complex gradients.
FLOATING_AND_COMPLEX = FLOATING + (complex64, complex128)

_FORMATS = {float16: FLOAT16, bfloat16: BFLOAT16}


def storage_format(dtype):
    """The StorageFormat a kernel uses for arrays of ``dtype``."""
    return _FORMATS.get(np.dtype(dtype), NATIVE)


def kernel_view(array):
    """The view of ``array`` a kernel takes: half formats as ``uint16``, others unchanged."""
    if array.dtype in _FORMATS:
        return array.view(np.uint16)
    return array


def compute_dtype(dtype):
    """The dtype kernels accumulate in for ``dtype`` data (opmath: float32 for the half formats)."""
    dtype = np.dtype(dtype)
    return float32 if dtype in _FORMATS else dtype


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def compute_scalar(value, compute):
    """The Python float ``value`` as a ``compute`` scalar; beyond float32's range it rounds to an
    infinity, silently (no overflow warning). ``np.errstate`` is only entered for such values:
    it costs a few microseconds, which a small call notices."""
    if compute == float64 or -_FLOAT32_MAX <= value <= _FLOAT32_MAX:
        return compute.type(value)
    with np.errstate(over="ignore"):
        return compute.type(value)


# --------------------------------------------------------------------------------------------
# memory layouts of 4-D (N, C, H, W) arrays
# --------------------------------------------------------------------------------------------

NCHW = "NCHW"
NHWC = "NHWC"


def is_channels_last(array):
    """True when a 4-D NCHW-shaped array is laid out channels-last (PyTorch's suggestion rule).

    Like ``torch.Tensor.suggest_memory_format``: an array that is C-contiguous stays NCHW
    (ambiguous cases such as C == 1 or H == W == 1 included); otherwise the strides decide, with
    channels innermost, then width, then height, then batch.
    """
    if array.ndim != 4 or array.flags.c_contiguous:
        return False
    n, c, h, w = (abs(s) for s in array.strides)
    return c <= w <= h <= n and array.shape[1] > 1


def physical(array, layout):
    """A C-contiguous array of the given physical layout holding ``array``'s (NCHW) values.

    ``layout == NHWC`` returns the (N, H, W, C) transposed view, a copy only when that view is
    not already C-contiguous; ``NCHW`` returns ``array`` itself when already C-contiguous.
    """
    if layout == NHWC:
        return np.ascontiguousarray(array.transpose(0, 2, 3, 1))
    return np.ascontiguousarray(array)


def logical(array, layout):
    """The NCHW view of a physical NHWC array (identity for NCHW)."""
    if layout == NHWC:
        return array.transpose(0, 3, 1, 2)
    return array


# --------------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------------


def _physical_shape(shape, layout):
    if layout == NHWC:
        n, c, h, w = shape
        return (n, h, w, c)
    return tuple(shape)


def output(func, out, shape, dtype, layout=NCHW, *, inputs=(), param="out", checked=False):
    """The result array (logical shape ``shape``) and its physical C-contiguous view for the kernel.

    Without ``out`` a new array is allocated (:func:`empty`: the kernel writes every element). With ``out``
    it must be a writeable ndarray of exactly that shape, dtype and layout (:func:`check_out`;
    ``checked=True`` when the caller's plan has checked exactly this metadata already) that
    does not overlap any of ``inputs``; it is checked completely before anything is written.
    Returns ``(result, physical_view)``.
    """
    if out is None:
        phys = empty(_physical_shape(shape, layout), dtype)
        return logical(phys, layout), phys
    if not checked:
        check_out(func, out, shape, dtype, layout, param=param)
    phys = out.transpose(0, 2, 3, 1) if layout == NHWC else out
    for name, array in inputs:
        if array is not None and _overlaps(out, array):
            v.fail(func, param, f"must not overlap {name}", "overlapping memory")
    return out, phys


def check_out(func, out, shape, dtype, layout=NCHW, *, param="out"):
    """An ``out=`` array (or None) must be a writeable ndarray of exactly the result's shape,
    dtype and memory layout. Depends on the array's metadata only (see api._plans)."""
    if out is None:
        return
    if not isinstance(out, np.ndarray):
        v.fail(func, param, "must be a numpy.ndarray", v.describe(out))
    if tuple(out.shape) != tuple(shape):
        v.fail(func, f"{param}.shape", f"must be {tuple(shape)}", tuple(out.shape))
    if out.dtype != np.dtype(dtype):
        v.fail(func, f"{param}.dtype", f"must be {np.dtype(dtype)}", out.dtype)
    if not out.flags.writeable:
        v.fail(func, param, "must be writeable", "a read-only array")
    phys = out.transpose(0, 2, 3, 1) if layout == NHWC else out
    if not phys.flags.c_contiguous:
        want = "channels-last (NHWC) contiguous" if layout == NHWC else "C-contiguous"
        v.fail(func, param, f"must be {want} like the result", f"strides {out.strides}")


def _overlaps(a, b):
    if not isinstance(b, np.ndarray) or not np.may_share_memory(a, b):
        return False
    try:
        return np.shares_memory(a, b, max_work=100_000)
    except np.exceptions.TooHardError:
        return True


def read_only(array):
    """A read-only view of ``array`` for a kernel input: kernels only read their inputs, and
    passing them read-only whatever the caller's flags keeps one compiled signature per kernel
    (Numba types read-only and writeable arrays apart), so a precompiled cache serves both."""
    view = array.view()
    view.setflags(write=False)
    return view
