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

import math
from typing import NamedTuple

import ml_dtypes
import numpy as np

from . import _result_cache
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
    it costs a few microseconds, which a small call notices. A ``compute`` scalar is returned
    as it is (a prepared call converts its scalars once)."""
    kind = compute.type
    if type(value) is kind:
        return value
    if compute == float64 or -_FLOAT32_MAX <= value <= _FLOAT32_MAX:
        return kind(value)
    with np.errstate(over="ignore"):
        return kind(value)


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


def layout_views(func, layout, grad_output, input, out):
    """A ``layout=`` argument of avg-pool's and pad's kind (arrays NHWC-ordered or not):
    ``(nhwc, grad_output, input, out)``, NHWC-ordered arguments as their NCHW views, which the
    checks then read as any channels-last NCHW call's."""
    nhwc = v.layout(func, layout, grad_output) == NHWC
    if nhwc:
        grad_output, input, out = nchw_views(grad_output, input, out)
    return nhwc, grad_output, input, out


def grad_input(nhwc, input_shape, dtype, layout, user_grad_output, grad_output):
    """``(results, source)`` of avg-pool's and pad's plans: the grad_input :class:`Result` (a
    C-contiguous ``(N, H, W, C)`` array for a ``layout="NHWC"`` call) and the :class:`Operand`
    of grad_output (``user_grad_output``: as given; ``grad_output``: its NCHW view)."""
    if nhwc:
        return (nhwc_result(input_shape, dtype),), operand(user_grad_output)
    return (result(input_shape, dtype, layout),), operand(grad_output, layout)


def nchw_views(*arrays):
    """NHWC-ordered arguments (``layout="NHWC"``: arrays ``(N, H, W, C)`` or shapes) as their NCHW
    views (channels-last strides) or shapes; anything else (None, an array of another rank: the
    checks refuse it) as it is."""
    views = []
    for value in arrays:
        if isinstance(value, np.ndarray) and value.ndim == 4:
            value = value.transpose(0, 3, 1, 2)
        elif isinstance(value, (tuple, list)) and len(value) == 4:
            value = type(value)((value[0], value[3], value[1], value[2]))
        views.append(value)
    return views


def logical(array, layout):
    """The NCHW view of a physical NHWC array (identity for NCHW)."""
    if layout == NHWC:
        return array.transpose(0, 3, 1, 2)
    return array


# --------------------------------------------------------------------------------------------
# kernel operands: how an input array becomes what a kernel takes (decided by its metadata)
# --------------------------------------------------------------------------------------------


class Operand(NamedTuple):
    """How a plan hands an input array to its kernels: transposed to the physical layout, copied
    when that view is not C-contiguous (or to another dtype), reshaped, and half formats viewed
    as ``uint16``. Decided from the array's metadata, which the plan's key holds."""

    axes: tuple  # the transpose to the physical layout (channels-last NCHW -> NHWC), or None
    copy: bool  # a C-contiguous copy is made (after the transpose)
    dtype: np.dtype  # the copy's dtype (a parameter converted to the compute type), or None
    shape: tuple  # the shape the kernels take it in, or None
    half: bool  # float16 or bfloat16: passed as uint16


def operand(array, layout=NCHW, dtype=None, shape=None):
    """The :class:`Operand` of ``array`` for kernels reading it in ``layout`` (``dtype``: converted
    to it when it differs; ``shape``: reshaped to it), or None when it is taken as it is."""
    axes = (0, 2, 3, 1) if layout == NHWC else None
    view = array if axes is None else array.transpose(axes)
    if dtype is not None and array.dtype == dtype:
        dtype = None
    copy = dtype is not None or not view.flags.c_contiguous
    if shape is not None and tuple(shape) == array.shape:
        shape = None
    half = (dtype or array.dtype) in _FORMATS
    if axes is None and not copy and shape is None and not half:
        return None
    return Operand(axes, copy, dtype, shape, half)


def kernel_operand(array, how):
    """``array`` as the kernels take it (``how``: its :class:`Operand`, or None: as it is)."""
    if how is None:
        return array
    if how.axes is not None:
        array = array.transpose(how.axes)
    if how.copy:
        array = np.ascontiguousarray(array, dtype=how.dtype)
    if how.shape is not None:
        array = array.reshape(how.shape)
    return array.view(np.uint16) if how.half else array


def operands(*each):
    """The :class:`Operand` (or None) of each of several arrays, or None when every one is None
    (the arrays are then taken as they are, without a call per array)."""
    return None if all(how is None for how in each) else each


def kernel_operands(arrays, hows):
    """:func:`kernel_operand` of each of ``arrays`` (``hows``: from :func:`operands`)."""
    return arrays if hows is None else tuple(map(kernel_operand, arrays, hows))


# --------------------------------------------------------------------------------------------
# results: the one allocation path
# --------------------------------------------------------------------------------------------


def _physical_shape(shape, layout):
    if layout == NHWC:
        n, c, h, w = shape
        return (n, h, w, c)
    return tuple(shape)


def _contiguous_strides(shape, itemsize):
    """NumPy's strides of a new C-contiguous array of ``shape``."""
    strides = []
    step = itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= size or 1
    return tuple(reversed(strides))


class Result(NamedTuple):
    """One result of a call as its plan decided it: allocated C-contiguous in its physical layout
    (or taken from ``out=``) and handed to the kernels as that physical array."""

    shape: tuple  # the result's shape
    dtype: np.dtype
    layout: str  # NCHW, or NHWC: a 4-D NCHW-shaped result with channels-last strides
    param: str  # the ``out=`` entry's name in messages
    physical: tuple  # the C-contiguous shape allocated
    metadata: tuple  # ``(shape, strides, dtype)`` of such an array: what an ``out=`` entry has
    half: bool  # the kernels take it as uint16
    small: bool  # below the result cache's floor: ``np.empty`` directly


def result(shape, dtype, layout=NCHW, param="out"):
    """The :class:`Result` of a ``shape`` and ``dtype`` result in ``layout``."""
    dtype = np.dtype(dtype)
    shape = tuple(shape)
    physical = _physical_shape(shape, layout)
    strides = _contiguous_strides(physical, dtype.itemsize)
    if layout == NHWC:
        strides = (strides[0], strides[3], strides[1], strides[2])
    small = math.prod(physical) * dtype.itemsize < _result_cache.SMALLEST
    return Result(shape, dtype, layout, param, physical, (shape, strides, dtype), dtype in _FORMATS, small)


def nhwc_result(shape, dtype):
    """The :class:`Result` of a ``layout="NHWC"`` call whose result has the NCHW ``shape``: a
    C-contiguous ``(N, H, W, C)`` array (the kernels' physical NHWC array itself)."""
    n, c, h, w = shape
    return result((n, h, w, c), dtype)


def new(spec):
    """``(result, kernel view)`` of a new array for one :class:`Result` (:func:`empty` from the
    result cache's floor, ``np.empty`` below it: uninitialised, the kernels write every element)."""
    _, dtype, layout, _, physical, _, half, small = spec  # one unpacking: a small call notices each lookup
    phys = np.empty(physical, dtype) if small else empty(physical, dtype)
    return (phys if layout == NCHW else phys.transpose(0, 3, 1, 2)), (phys.view(np.uint16) if half else phys)


def allocate(func, spec, out, names, inputs):
    """``(result, kernel view)`` of one :class:`Result`: a new array (:func:`new`), or ``out``
    (its metadata already checked, by the plan's key or a prepared call) after checking that it
    overlaps none of ``inputs`` (arrays or None; those past the end of ``names`` are not looked
    at), whose names are ``names``."""
    if out is None:
        return new(spec)
    for name, other in zip(names, inputs):
        if other is not None and _overlaps(out, other):
            v.fail(func, spec.param, f"must not overlap {name}", "overlapping memory")
    phys = out if spec.layout == NCHW else out.transpose(0, 2, 3, 1)
    return out, (phys.view(np.uint16) if spec.half else phys)


def allocate_all(func, specs, entries, names, inputs):
    """:func:`allocate` of several results (``entries``: the ``out=`` array or None of each);
    each given one must not overlap ``inputs`` nor an earlier result either."""
    arrays, views = [], []
    names, inputs = list(names), list(inputs)
    for spec, entry in zip(specs, entries):
        array, view = allocate(func, spec, entry, names, inputs)
        names.append(spec.param)
        inputs.append(array)
        arrays.append(array)
        views.append(view)
    return arrays, views


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
    """Whether ``a`` and ``b`` share memory, exactly: the bounds test first (most pairs end
    there), the exact test only for arrays whose bounds intersect (too hard to tell: True)."""
    if type(b) is not np.ndarray and not isinstance(b, np.ndarray):
        return False
    if not _may_share_memory(a, b):
        return False
    try:
        return np.shares_memory(a, b, max_work=100_000)
    except np.exceptions.TooHardError:
        return True


# NumPy's C function itself: ``np.may_share_memory`` is its ``__array_function__`` dispatcher,
# which costs 0.1 us a call for arrays that need no dispatch (ndarrays)
_may_share_memory = getattr(np.may_share_memory, "_implementation", np.may_share_memory)


def read_only(array):
    """A read-only view of ``array`` for a kernel input: kernels only read their inputs, and
    passing them read-only whatever the caller's flags keeps one compiled signature per kernel
    (Numba types read-only and writeable arrays apart), so a precompiled cache serves both."""
    view = array.view()
    view.setflags(write=False)
    return view
