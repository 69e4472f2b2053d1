"""Fill Numba's disk cache with every kernel the public functions can dispatch to.

``fastbwd.precompile()`` and ``python -m fastbwd --precompile`` run the :data:`TABLE` below in
worker processes (one per core): each entry calls one public function on tiny inputs chosen to
reach one kernel path, for one dtype and one memory layout, so that the kernel behind that call
compiles (or loads) and lands in the disk cache. Driving the public functions, rather than
listing Numba signatures, keeps the table right when a kernel's arguments change: whatever the
api layer passes is what gets compiled.

Only the parallel kernels are compiled by default; ``serial=True`` adds the serial twins (which
run after ``fork`` or with ``FASTBWD_SERIAL=1``, see ``kernels/_jit.py``).

Extending the table: write a function ``call(dtype)`` that makes one public call (or a few that
reach the same kernel) on tiny inputs of that dtype, and :func:`add` it under its operator,
dtype, layout and path. Nothing here compiles at import.
"""

import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

#: dtype names accepted by :func:`precompile`, as the public functions' dtypes.
DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
}
HALVES_AND_FLOATS = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class Entry:
    """One kernel path: ``call(dtype)`` reaches it through the public function ``op``."""

    op: str  # public function name
    dtype: str  # key of DTYPES
    layout: str  # "NCHW" or "NHWC" (channels-last memory, however the function is asked for it)
    path: str  # which kernel of the operator the call reaches
    call: Callable[[np.dtype], object]
    #: a variant that may reach kernels other entries compile too: it runs after all the others
    #: (then it finds them in the cache instead of compiling them a second time in parallel)
    variant: bool = False

    @property
    def key(self):
        return f"{self.op} {self.dtype} {self.layout} {self.path}"


#: Every (operator, dtype, layout, path); :func:`precompile` runs them in :data:`SLOWEST_FIRST`
#: order, variants last.
TABLE = []


def add(op, dtypes, layout, path, call, *, variant=False):
    """Register ``call`` for each dtype name in ``dtypes`` (see :class:`Entry`)."""
    for dtype in dtypes:
        TABLE.append(Entry(op, dtype, layout, path, call, variant))


#: Operators in the order their entries start, the slowest to compile first (a short tail).
SLOWEST_FIRST = ("roi_align_backward", "roi_align_forward", "group_norm_swish_backward", "group_norm_swish",
                 "upsample_bilinear2d_backward", "avg_pool2d_backward", "replication_pad2d_backward")


# ---- tiny inputs -----------------------------------------------------------------------------

def _array(shape, dtype, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, shape).astype(dtype)


def _channels_last(array):
    """An NCHW-shaped view with channels-last strides (what PyTorch calls channels_last)."""
    return np.ascontiguousarray(array.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def _fastbwd():
    import fastbwd

    return fastbwd


# upsample_bilinear2d_backward: the separable engine's three kernels. Row blocks: grad rows at
# least 16 wide; planes as lanes: grad rows narrower than 16 and at least 128 small planes;
# NHWC: the layout="NHWC" call and an NCHW-shaped channels-last array reach the same kernel.

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


add("upsample_bilinear2d_backward", HALVES_AND_FLOATS, "NCHW", "row blocks", _upsample_row_blocks)
add("upsample_bilinear2d_backward", HALVES_AND_FLOATS, "NCHW", "planes as lanes", _upsample_plane_lanes)
add("upsample_bilinear2d_backward", HALVES_AND_FLOATS, "NHWC", "channel vectors", _upsample_nhwc)


# avg_pool2d_backward: whole rows (NCHW, grad rows of at least LANES; a kernel for width stride 2
# and one for the others), the engine's three kernels (narrower grad rows and NHWC), and the
# global-window broadcast kernels.

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


for _layout in ("NCHW", "NHWC"):
    if _layout == "NCHW":
        add("avg_pool2d_backward", HALVES_AND_FLOATS, _layout, "whole rows", _avg_pool((1, 2, 4, 40), 2, _layout))
        add("avg_pool2d_backward", HALVES_AND_FLOATS, _layout, "whole rows, other strides",
            _avg_pool((1, 2, 6, 60), 3, _layout))
        add("avg_pool2d_backward", HALVES_AND_FLOATS, _layout, "row blocks", _avg_pool((1, 2, 4, 20), 2, _layout))
        add("avg_pool2d_backward", HALVES_AND_FLOATS, _layout, "planes as lanes",
            _avg_pool((1, 128, 8, 8), 2, _layout))
    else:
        add("avg_pool2d_backward", HALVES_AND_FLOATS, _layout, "channel vectors", _avg_pool((1, 2, 4, 8), 2, _layout))
    add("avg_pool2d_backward", HALVES_AND_FLOATS, _layout, "global window", _avg_pool((2, 3, 5, 5), 5, _layout))


# replication_pad2d_backward: one kernel per layout, and NCHW's for results larger than the
# cache (streaming stores; reached only by a result of _memory.STREAM_MIN_BYTES, so its call makes one).

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


for _layout in ("NCHW", "NHWC"):
    add("replication_pad2d_backward", tuple(DTYPES), _layout, "gather", _pad(_layout))
add("replication_pad2d_backward", tuple(DTYPES), "NCHW", "gather, streaming stores", _pad_streaming)


# roi_align_backward: NCHW only; fixed and adaptive sampling, boxes inside and partly outside.

def _roi_align(dtype):
    f = _fastbwd()
    boxes = np.array([[0, 1, 1, 6, 5], [1, -2, 0, 3, 9], [0, 0, 0, 2, 2]], dtype)
    g = _array((3, 3, 2, 2), dtype)
    f.roi_align_backward(g, boxes, (2, 3, 8, 8), 2, 2, 1.0, 0, True)
    return f.roi_align_backward(g, boxes, (2, 3, 8, 8), 2, 2, 0.5, 2, False)


add("roi_align_backward", HALVES_AND_FLOATS, "NCHW", "backward", _roi_align)


# roi_align_forward (fastbwd.torch.roi_align's forward): one kernel for NCHW and channels-last
# input; the tables kernels are the backward's (a variant, run after the backward entries).

def _roi_align_forward(layout):
    def call(dtype):
        from .api.roi_align import roi_align_forward

        boxes = np.array([[0, 1, 1, 6, 5], [1, -2, 0, 3, 9], [0, 0, 0, 2, 2]], dtype)
        x = _array((2, 3, 8, 8), dtype)
        x = _channels_last(x) if layout == "NHWC" else x
        roi_align_forward(x, boxes, 2, 2, 1.0, 0, True)
        return roi_align_forward(x, boxes, 2, 2, 0.5, 2, False)

    return call


for _layout in ("NCHW", "NHWC"):
    add("roi_align_forward", HALVES_AND_FLOATS, _layout, "forward", _roi_align_forward(_layout),
        variant=True)


# group_norm_swish_backward: NCHW and NHWC kernels, parameters in the data's dtype or float32,
# and the parameter-gradient kernel (in gamma's dtype).

def _group_norm_swish(layout, params):
    def call(dtype):
        f = _fastbwd()
        param_dtype = np.float32 if params == "float32" else dtype
        x, dy = _array((2, 4, 3, 3), dtype, 1), _array((2, 4, 3, 3), dtype, 2)
        mean, rstd = np.zeros((2, 2), param_dtype), np.ones((2, 2), param_dtype)
        gamma, beta = np.ones(4, param_dtype), np.zeros(4, param_dtype)
        if layout == "NHWC":
            # data_format="NHWC", and NCHW-shaped arrays with channels-last strides
            f.group_norm_swish_backward(_channels_last(dy), mean, rstd, _channels_last(x), gamma, beta, 2)
            x, dy = x.transpose(0, 2, 3, 1).copy(), dy.transpose(0, 2, 3, 1).copy()
            return f.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, 2, "NHWC")
        return f.group_norm_swish_backward(dy, mean, rstd, x, gamma, beta, 2)

    return call


for _layout in ("NCHW", "NHWC"):
    add("group_norm_swish_backward", HALVES_AND_FLOATS, _layout, "params in the data dtype",
        _group_norm_swish(_layout, "same"))
    add("group_norm_swish_backward", ("float16", "bfloat16", "float64"), _layout, "float32 params",
        _group_norm_swish(_layout, "float32"), variant=True)



# group_norm_swish (the forward): NCHW and NHWC kernels, parameters in the data's dtype or
# float32 (the api converts them to the compute type: the same kernels, statistics rounded after).

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


for _layout in ("NCHW", "NHWC"):
    add("group_norm_swish", HALVES_AND_FLOATS, _layout, "params in the data dtype",
        _group_norm_swish_forward(_layout, "same"))
    add("group_norm_swish", ("float16", "bfloat16", "float64"), _layout, "float32 params",
        _group_norm_swish_forward(_layout, "float32"), variant=True)


# ---- running the table -----------------------------------------------------------------------

def select(ops=None, dtypes=None, layouts=None):
    """The table entries for these operators, dtype names and layouts (None: all)."""
    def names(values, known, what):
        if values is None:
            return None
        values = (values,) if isinstance(values, str) else tuple(values)
        unknown = [value for value in values if value not in known]
        if unknown:
            raise ValueError(f"precompile: unknown {what} {unknown}; known: {sorted(known)}")
        return set(values)

    ops = names(ops, {entry.op for entry in TABLE}, "operator(s)")
    dtypes = names(dtypes, set(DTYPES), "dtype(s)")
    layouts = names(layouts, {"NCHW", "NHWC"}, "layout(s)")
    return [entry for entry in TABLE
            if (ops is None or entry.op in ops) and (dtypes is None or entry.dtype in dtypes)
            and (layouts is None or entry.layout in layouts)]


def cache_folder():
    """Where the kernels' disk cache lives, or None when nothing can be cached (with the reason)."""
    from . import _config
    from .kernels import replication_pad2d

    if not _config.CACHE:
        return None, "the disk cache is disabled (FASTBWD_CACHE=0)"
    dispatcher = replication_pad2d.replication_pad2d_bwd_nchw.parallel
    path = getattr(getattr(dispatcher, "_cache", None), "_cache_path", None)
    if path is None:
        return None, "no writable cache folder (set NUMBA_CACHE_DIR to a writable folder)"
    requested = os.environ.get("NUMBA_CACHE_DIR")
    if requested and not os.path.abspath(path).startswith(os.path.abspath(requested)):
        print(f"fastbwd precompile: NUMBA_CACHE_DIR={requested} is not writable; Numba caches in {path} instead")
    return path, None


def _run_entry(index, serial):
    """Worker: run TABLE[index]; returns (index, seconds, compiled kernel names, error)."""
    from numba.core import event

    from .kernels import _jit

    _jit._serial_only = serial
    compiled = []

    class Listener(event.Listener):
        def on_start(self, ev):
            pass

        def on_end(self, ev):
            dispatcher = ev.data.get("dispatcher") if isinstance(ev.data, dict) else None
            cache = getattr(dispatcher, "_cache", None)
            # only the kernels (cached dispatchers), not their inlined helpers
            if cache is not None and getattr(cache, "_cache_path", None):
                compiled.append(dispatcher.py_func.__name__)

    listener = Listener()
    event.register("numba:compile", listener)
    start = time.perf_counter()
    try:
        entry = TABLE[index]
        entry.call(DTYPES[entry.dtype])
        error = None
    except Exception as exc:  # noqa: BLE001 - reported, never raised into the pool
        error = f"{type(exc).__name__}: {exc}"
    finally:
        event.unregister("numba:compile", listener)
    return index, time.perf_counter() - start, compiled, error


def precompile(ops=None, dtypes=None, layouts=None, *, serial=False, workers=None, verbose=True):
    """Compile every kernel the public functions can dispatch to into Numba's disk cache.

    Parameters
    ----------
    ops : str or sequence of str, optional
        Public function names (default: all five operators).
    dtypes : str or sequence of str, optional
        dtype names: "float32", "float16", "bfloat16", "float64", "complex64", "complex128"
        (default: every dtype each operator accepts).
    layouts : str or sequence of str, optional
        "NCHW" and/or "NHWC" (channels-last memory, however it is asked for; default: both).
    serial : bool, default False
        Also compile the serial twin of each kernel (used after ``fork`` and with
        ``FASTBWD_SERIAL=1``); by default only the parallel kernels are compiled.
    workers : int, optional
        Worker processes (default: one per core).
    verbose : bool, default True
        Print one line per table entry and a total.

    Returns
    -------
    dict
        ``{"entries": n, "compiled": kernels compiled, "seconds": wall time, "cache": folder,
        "errors": [...]}``. Idempotent: a second run finds everything in the cache. When no
        cache folder is writable (or ``FASTBWD_CACHE=0``) it says so and compiles nothing.
        Never changes any result.
    """
    say = print if verbose else (lambda *args, **kwargs: None)
    entries = select(ops, dtypes, layouts)
    folder, reason = cache_folder()
    if folder is None:
        say(f"fastbwd precompile: {reason}; nothing compiled")
        return dict(entries=0, compiled=0, seconds=0.0, cache=None, errors=[], skipped=reason)
    def order(entry):
        rank = SLOWEST_FIRST.index(entry.op) if entry.op in SLOWEST_FIRST else len(SLOWEST_FIRST)
        return entry.variant, rank

    indices = [TABLE.index(entry) for entry in sorted(entries, key=order)]
    runs = [(index, False) for index in indices] + ([(index, True) for index in indices] if serial else [])
    workers = max(1, min(workers or os.cpu_count() or 1, len(runs) or 1))
    say(f"fastbwd precompile: {len(runs)} kernel paths{' (parallel and serial twins)' if serial else ''} "
        f"with {workers} worker process(es) into {folder}")
    import multiprocessing

    start = time.perf_counter()
    compiled, errors = 0, []
    width = len(str(len(runs)))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_entry, index, twin): twin for index, twin in runs}
        for done, future in enumerate(as_completed(futures), 1):
            index, seconds, kernels, error = future.result()
            entry = TABLE[index]
            twin = " (serial twin)" if futures[future] else ""
            if error:
                errors.append(f"{entry.key}: {error}")
                status = f"FAILED: {error}"
            elif kernels:
                compiled += len(kernels)
                status = f"compiled {', '.join(kernels)} in {seconds:.1f} s"
            else:
                status = f"cached ({seconds:.2f} s)"
            say(f"[{done:>{width}}/{len(runs)}] {entry.key}{twin}: {status}", flush=True)
    seconds = time.perf_counter() - start
    say(f"fastbwd precompile: {len(runs)} kernel paths, {compiled} kernels compiled, {len(errors)} errors, "
        f"{seconds:.1f} s")
    return dict(entries=len(runs), compiled=compiled, seconds=seconds, cache=folder, errors=errors)
