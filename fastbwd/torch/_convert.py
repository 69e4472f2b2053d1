"""Tensors in, arrays out, and back: the bridge's zero-copy conversions (no kernels here), and
the thread count every call of the bridge runs fastbwd on.

A CPU tensor becomes a NumPy array over the same memory (``Tensor.numpy``), bfloat16 through an
``int16`` view reinterpreted as ``ml_dtypes.bfloat16`` (the way ``fastbwd._dtypes`` hands half
formats to kernels). Results are written by the public functions (``out=``) into tensors made
here over NumPy-allocated memory (see :func:`empty`), so nothing is copied on the way back either.
"""

import ml_dtypes
import numba
import numpy as np
import torch

from fastbwd import _dispatch, api
from fastbwd import _dtypes as d

#: The tensor dtypes the bridge can hand to fastbwd as arrays (complex for the pad only).
ARRAY_DTYPES = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}
_BFLOAT16 = torch.bfloat16  # torch dtypes are singletons
_BFLOAT16_ARRAY = ARRAY_DTYPES[_BFLOAT16]


def can_view(tensor):
    """True when ``tensor`` can be read as a NumPy array without a copy: a dense strided CPU tensor
    of a dtype fastbwd takes, with no lazy conjugate or negative bit."""
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and tensor.dtype in ARRAY_DTYPES
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def as_array(tensor):
    """A NumPy array sharing ``tensor``'s memory (detached from autograd: ``Tensor.numpy``
    refuses a tensor that requires grad). Such a tensor (an input: an output never requires
    grad) goes through ``numpy(force=True)``, one call instead of ``detach`` and ``numpy``: the
    same memory, or for a lazy negative or conjugate bit a resolved copy of the values."""
    if tensor.dtype is _BFLOAT16:
        if tensor.requires_grad:
            tensor = tensor.detach()
        return tensor.view(torch.int16).numpy().view(ARRAY_DTYPES[_BFLOAT16])
    return tensor.numpy(force=True) if tensor.requires_grad else tensor.numpy()


def as_tensor(array):
    """A tensor sharing ``array``'s memory (``torch.from_numpy``, bfloat16 included)."""
    if array.dtype == _BFLOAT16_ARRAY:
        return torch.from_numpy(array.view(np.int16)).view(_BFLOAT16)
    return torch.from_numpy(array)


#: The axis order, innermost first, of a channels-last tensor of each rank PyTorch has a
#: channels-last memory format for (4-D ``channels_last``, 5-D ``channels_last_3d``).
_CHANNELS_LAST_ORDER = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}
_CHANNELS_LAST_FORMAT = {4: torch.channels_last, 5: torch.channels_last_3d}


def is_channels_last(tensor):
    """PyTorch's rule for a 4-D or 5-D tensor suggesting ``torch.channels_last`` or
    ``torch.channels_last_3d`` (as ``Tensor.suggest_memory_format`` decides it from the strides):
    channels innermost, then the spatial axes from the last to the first, then batch, with the
    ambiguous cases (sizes 0 or 1, zero channel stride) left contiguous."""
    order = _CHANNELS_LAST_ORDER.get(tensor.dim())
    if order is None or tensor.layout != torch.strided:
        return False
    sizes, strides = tensor.shape, tensor.stride()
    if strides[1] == 0:
        return False
    smallest = 0
    for axis in order:
        if sizes[axis] == 0 or strides[axis] < smallest:
            return False
        if axis == 0 and smallest == strides[1]:
            return False
        smallest = strides[axis] * (sizes[axis] if sizes[axis] > 1 else 1)
    return True


def memory_format(tensor):
    """``torch.channels_last`` (4-D), ``torch.channels_last_3d`` (5-D) or
    ``torch.contiguous_format``, as PyTorch suggests for ``tensor``."""
    return _CHANNELS_LAST_FORMAT[tensor.dim()] if is_channels_last(tensor) else torch.contiguous_format


def channels_last_permutation(rank):
    """The axes of an (N, C, *spatial) tensor of ``rank`` in the order of its (N, *spatial, C)
    view, and the inverse (which takes that view back to (N, C, *spatial))."""
    return (0, *range(2, rank), 1), (0, rank - 1, *range(1, rank - 1))


def dense(tensor, memory_format):
    """``tensor`` contiguous in ``memory_format``: itself when it already is (no copy)."""
    return tensor.contiguous(memory_format=memory_format)


def empty(shape, dtype, memory_format=torch.contiguous_format):
    """A new CPU tensor for fastbwd to write into, in ``memory_format`` (contiguous, or the
    channels-last format of its rank).

    Its memory is a NumPy result's (``fastbwd._dtypes.empty``, wrapped without a copy): a large
    ``torch.empty`` is several times slower to first touch than ``np.empty`` (NumPy asks for huge
    pages), and fastbwd's results reuse the memory of dropped ones (docs/history.md). The tensor
    behaves like any other CPU tensor.
    """
    channels_last = memory_format != torch.contiguous_format and _CHANNELS_LAST_FORMAT.get(len(shape)) == memory_format
    try:
        if not channels_last:
            return as_tensor(d.empty(tuple(shape), ARRAY_DTYPES[dtype]))
        to_physical, to_logical = channels_last_permutation(len(shape))
        physical = tuple(shape[axis] for axis in to_physical)
        return as_tensor(d.empty(physical, ARRAY_DTYPES[dtype])).permute(*to_logical)
    except (ValueError, MemoryError):
        # a negative size, or more memory than there is: PyTorch's allocator says so in its own
        # words and exception type (RuntimeError), as for any tensor PyTorch would make here
        return torch.empty(shape, dtype=dtype, memory_format=memory_format)


def match_torch_threads():
    """Set Numba's thread count (for the calling thread) to PyTorch's, within Numba's pool, and
    return PyTorch's (the count the decisions take, as :func:`decide`). In a training step
    PyTorch's ops and fastbwd's kernels alternate on the same cores, each with its own pool: sized
    alike (``torch.set_num_threads`` sizes both), neither pool oversubscribes the cores the other
    was given."""
    threads = torch.get_num_threads()
    wanted = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
    if api.get_num_threads() != wanted:
        api.set_num_threads(wanted)
    return threads


def decide(policy, path, op, tensor, elements=None, groups=None):
    """``fastbwd._dispatch.decide`` for a call of ``op`` on ``path`` whose forward input is
    ``tensor`` (real, or fake at trace time; ``elements`` its size when ``tensor`` is another of
    the call's tensors, of the same dtype and layout), on PyTorch's thread count: True when
    fastbwd's path runs it. ``groups``: a GroupNorm+Swish call's, whose kernels' tasks the
    decision counts. A size known only at run time (symbolic) decides nothing: True, and the
    call decides again when it runs."""
    if policy == "always":
        return True
    if elements is None:
        elements = 1
        for size in tensor.shape:
            if not isinstance(size, int):
                return True
            elements *= size
    dtype = ARRAY_DTYPES.get(tensor.dtype)
    dtype = dtype.name if dtype is not None else str(tensor.dtype)
    layout = "NHWC" if is_channels_last(tensor) else "NCHW"
    threads = torch.get_num_threads()
    tasks = None
    if groups is not None and all(isinstance(size, int) for size in tensor.shape[:2]):
        tasks = api.group_norm_swish.parallel_tasks(*tensor.shape[:2], groups, layout, threads)
    return _dispatch.decide(policy, "torch", path, op, elements, dtype, layout, threads, tasks)
