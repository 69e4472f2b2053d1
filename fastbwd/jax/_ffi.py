"""The transport: XLA hands its buffers to fastbwd in place, through XLA's FFI (no C compiler).

Each fastbwd function the bridge needs is an FFI target (``jax.ffi.register_ffi_target``, typed
API) whose handler is a ``ctypes`` callback. XLA calls it with an ``XLA_FFI_CallFrame`` (the
stable C ABI of ``xla/ffi/api/c_api.h``); the handler reads each buffer's data pointer, dims and
dtype from the frame, wraps them as NumPy arrays over the same memory (no copy), and calls the
public fastbwd function with the results' buffers as ``out=``. The calling thread takes the GIL
for the Python part (tens of microseconds); the kernels release it while they run.

Static arguments travel as one string attribute, ``config``: a JSON object of the public
function's keyword arguments, so a compiled program carries everything its calls need (nothing
refers to state of the process that traced it). Arguments are validated at trace time by the
functions that build the calls, so the handler only sees arguments fastbwd accepts.

Batch axes added by ``jax.vmap``: the ``"fold"`` targets (every array's extra leading axes are
folded into the batch axis N, one call for the whole batch), the ``"loop"`` targets (XLA calls
the handler once per batch element, ``vmap_method="sequential"``) and the ``"expand"`` targets
(``vmap_method="expand_dims"``: every operand gets one leading axis per vmap level, of size 1 where
it is not batched, and the adapter gets them as they are, with each operand's own rank in
``config["ranks"]``, to fold or loop as its operator allows).
"""

import ctypes
import json
import math
import threading
import traceback

import jax
import ml_dtypes
import numpy as np

from .. import api
from ..api import _plans
from . import _gate, _sharding

# ---- the C structures read (x86-64 / aarch64 layout of c_api.h) ------------------------------

_EXTENSION_METADATA = 1
_STAGE_EXECUTE = 3
_ATTR_STRING = 4
_ERROR_INTERNAL = 13
_API_MAJOR, _API_MINOR = 0, 1  # the oldest typed-FFI version whose frame holds what is read here

# XLA_FFI_DataType codes of the dtypes fastbwd takes.
_DTYPES = {
    10: np.dtype(np.float16),
    11: np.dtype(np.float32),
    12: np.dtype(np.float64),
    16: np.dtype(ml_dtypes.bfloat16),
    15: np.dtype(np.complex64),
    18: np.dtype(np.complex128),
}


class _ExtensionBase(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int), ("next", ctypes.c_void_p)]


class _Buffer(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("dims", ctypes.POINTER(ctypes.c_int64)),
    ]


class _ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Operands(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets share this layout
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),
        ("buffers", ctypes.POINTER(ctypes.POINTER(_Buffer))),
    ]


class _Attrs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),
        ("names", ctypes.POINTER(ctypes.POINTER(_ByteSpan))),
        ("attrs", ctypes.POINTER(ctypes.c_void_p)),
    ]


class _CallFrame(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(_ExtensionBase)),
        ("api", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("stage", ctypes.c_int),
        ("args", _Operands),
        ("rets", _Operands),
        ("attrs", _Attrs),
        ("future", ctypes.c_void_p),
    ]


class _ApiVersion(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("major_version", ctypes.c_int),
        ("minor_version", ctypes.c_int),
    ]


class _Metadata(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("api_version", _ApiVersion),
        ("traits", ctypes.c_uint32),
        ("state_type_id", ctypes.c_int64),
    ]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", _ExtensionBase), ("metadata", ctypes.POINTER(_Metadata))]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("message", ctypes.c_char_p),
        ("errc", ctypes.c_int),
    ]


_ERROR_CREATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_ErrorCreateArgs))


class _Api(ctypes.Structure):  # the leading fields of XLA_FFI_Api, up to XLA_FFI_Error_Create
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("api_version", _ApiVersion),
        ("internal_api", ctypes.c_void_p),
        ("error_create", _ERROR_CREATE),
    ]


_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)

# ---- buffers as arrays -------------------------------------------------------------------------

_HUGE_PAGE = 2 << 20
_ADVISE_BYTES = 4 << 20
_MADV_HUGEPAGE = 14
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _madvise.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _madvise = None


def _advise_huge_pages(address, nbytes):
    """Ask for transparent huge pages on the 2 MiB-aligned interior of a large result buffer.

    XLA's CPU allocator hands out fresh 4 KiB pages for large buffers, and a kernel writing into
    them spends most of its time in page faults; NumPy gives its own large allocations the same
    advice (numbers in docs/history.md, "fastbwd.jax"). Advice only: contents and ownership are
    unchanged, and a kernel that ignores it (``THP`` disabled) is merely slower.
    """
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        _madvise(start, end - start, _MADV_HUGEPAGE)


def _array(buffer, writeable):
    """A NumPy array over an ``XLA_FFI_Buffer``'s memory (row-major, XLA's default layout)."""
    dtype = _DTYPES[buffer.dtype]
    shape = tuple(buffer.dims[axis] for axis in range(buffer.rank))
    size = math.prod(shape)
    if size == 0 or not buffer.data:
        return np.empty(shape, dtype)
    nbytes = size * dtype.itemsize
    if writeable and nbytes >= _ADVISE_BYTES and _madvise is not None:
        _advise_huge_pages(buffer.data, nbytes)
    raw = (ctypes.c_char * nbytes).from_address(buffer.data)
    array = np.frombuffer(raw, np.uint8).view(dtype).reshape(shape)
    if not writeable:
        array.flags.writeable = False
    return array


def _fold(array, rank, extra):
    """``array`` with its ``extra`` leading (vmap) axes folded into the batch axis: a rank-4
    operand merges them with N; a rank-3 one (unbatched ``(C, H, W)``) gets them as N."""
    if extra <= 0:
        return array
    leading = extra + 1 if rank == 4 else extra
    return array.reshape((math.prod(array.shape[:leading]),) + array.shape[leading:])


# ---- the handlers ------------------------------------------------------------------------------

_configs = {}
_configs_lock = threading.Lock()


def _config(frame):
    """The ``config`` attribute: ``(its text, the text decoded)`` (memoised: a training loop
    sends the same few)."""
    for index in range(frame.attrs.size):
        name = frame.attrs.names[index].contents
        if ctypes.string_at(name.ptr, name.len) == b"config" and frame.attrs.types[index] == _ATTR_STRING:
            span = ctypes.cast(frame.attrs.attrs[index], ctypes.POINTER(_ByteSpan)).contents
            text = ctypes.string_at(span.ptr, span.len)
            config = _configs.get(text)
            if config is None:
                config = json.loads(text)
                with _configs_lock:
                    _configs[text] = config
            return text, config
    raise RuntimeError("fastbwd.jax: FFI call without its config attribute")


def _error(frame, message):
    """An ``XLA_FFI_Error`` carrying ``message`` (XLA raises it in the caller)."""
    api = ctypes.cast(frame.api, ctypes.POINTER(_Api)).contents
    args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None, message.encode(), _ERROR_INTERNAL)
    return api.error_create(ctypes.byref(args))


def _on_its_share(function, config, *args):
    """``function(*args)`` (the adapter or its prepared call, on the buffers). A call one of
    several devices of this process make at once (``config["devices"]``, from _sharding) runs its
    kernels on its share of Numba's threads: the devices share the cores, and each kernel on all
    of them would oversubscribe them (docs/history.md, "Sharding")."""
    devices = config.pop("devices", 1)
    threads = api.get_num_threads() if devices > 1 else 1
    if threads <= 1:
        return function(*args)
    api.set_num_threads(max(1, threads // devices))  # for this thread (XLA's) only
    try:
        return function(*args)
    finally:
        api.set_num_threads(threads)


def _make_handler(adapter, fold):
    # the prepared calls the adapter returned, by the call's config and its buffers' shapes and
    # dtypes: a later call of the same (every step of a training loop) runs one directly
    prepared_calls = _plans.Plans()

    def handler(frame_address):
        frame = _CallFrame.from_address(frame_address)
        extension = frame.extension_start
        if extension and extension.contents.type == _EXTENSION_METADATA:
            metadata = ctypes.cast(extension, ctypes.POINTER(_MetadataExtension)).contents.metadata.contents
            metadata.api_version.struct_size = ctypes.sizeof(_ApiVersion)
            metadata.api_version.major_version = _API_MAJOR
            metadata.api_version.minor_version = _API_MINOR
            metadata.traits = 0
            return None
        if frame.stage != _STAGE_EXECUTE:
            return None
        try:
            text, config = _config(frame)
            config = dict(config)
            inputs = [_array(frame.args.buffers[i].contents, False) for i in range(frame.args.size)]
            outputs = [_array(frame.rets.buffers[i].contents, True) for i in range(frame.rets.size)]
            if fold is True:
                rank = config.pop("rank")
                extra = inputs[0].ndim - rank
                inputs = [_fold(a, rank, extra) for a in inputs]
                outputs = [_fold(a, rank, extra) for a in outputs]
            # the thread count too: a prepared call keeps the one it was made with (plans sized by it)
            key = (text, api.get_num_threads(), *[(a.shape, a.dtype) for a in inputs + outputs])
            prepared = prepared_calls.get(key)
            if prepared is not None:
                _on_its_share(prepared, config, inputs, outputs)
            else:
                prepared = _on_its_share(adapter, config, inputs, outputs, config)
                if prepared is not None:
                    prepared_calls.add(key, prepared)
            return None
        except BaseException:  # noqa: BLE001 - reported to XLA, which raises it in the caller
            return _error(frame, "fastbwd.jax: " + traceback.format_exc())

    return _HANDLER(handler)


_targets = {}  # name -> fold
_splits = {}  # name -> split (_sharding)
_register_lock = threading.Lock()


def target(name, adapter, fold, split=None):
    """Register the FFI target ``fastbwd_<name>`` (once per process) and return its name.

    ``adapter(inputs, outputs, config)`` calls the fastbwd function on the buffers, and may
    return the call prepared (``function.prepare``, as ``prepared(inputs, outputs)``): the
    handler then keeps it for the config and the buffers' shapes and dtypes, and calls it
    instead of the adapter when they repeat. ``fold`` (True, False or ``"expand"``) says how
    vmap batches it (see the module docstring).

    ``split(config, operands, results)`` returns the call's :class:`_sharding.Split`: how XLA
    may partition it over devices (without one XLA runs the whole call on every device).
    """
    full = f"fastbwd_{name}"
    with _register_lock:
        if full not in _targets:
            # XLA calls the exit gate, which calls the Python handler (see _gate.py)
            address = _gate.gate(
                _make_handler(adapter, fold), (_CallFrame.stage.offset, _CallFrame.api.offset), _Api.error_create.offset
            )
            jax.ffi.register_ffi_target(full, jax.ffi.pycapsule(_HANDLER(address)), platform="cpu", api_version=1)
            _targets[full] = fold
            _splits[full] = split
    return full


def call(name, operands, results, config):
    """Emit the FFI call of the registered target ``name`` on ``operands`` (JAX arrays), returning
    arrays shaped like ``results`` (``jax.ShapeDtypeStruct`` list). ``config`` (a JSON-able dict of
    keyword arguments) becomes the call's attribute; fold targets also get the per-example rank,
    expand targets every operand's. Returns a list of arrays, one per result."""
    fold = _targets[name]
    if fold == "expand":
        config = dict(config, ranks=[operand.ndim for operand in operands])
    elif fold:
        config = dict(config, rank=operands[0].ndim)
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    method = {True: "broadcast_all", False: "sequential", "expand": "expand_dims"}[fold]
    split = _splits[name]
    if split is not None:  # partitioned over devices (docs/design.md, "Sharding")
        return _sharding.call(name, text, method, split(config, operands, results), operands, results)
    return list(jax.ffi.ffi_call(name, list(results), vmap_method=method)(*operands, config=text))
