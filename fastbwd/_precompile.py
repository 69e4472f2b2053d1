"""Fill Numba's disk cache with the kernels the public functions can dispatch to.

``fastbwd.precompile()`` and ``python -m fastbwd --precompile`` run the :data:`TABLE` below (its
float32 entries unless other dtypes, or all, are asked for) in
worker processes (one per core): each entry calls one public function on tiny inputs chosen to
reach one kernel path, for one dtype and one memory layout, so that the kernel behind that call
compiles (or loads) and lands in the disk cache. The calls are the kernel paths of the
operators' registry (``fastbwd/_registry.py``), where a new path is added.

A worker runs a whole group at a time: every entry of one dtype of operators whose kernels share
their helpers (:data:`SHARING`), both twins. Numba compiles an ``@njit`` helper once per process
and signature, so a group compiles its helpers once, where runs spread over the workers one by
one compiled them in each (docs/history.md, "Where precompile's time goes"), and no two workers
compile the same kernel at once.

Each entry runs twice, its launches forced each way (``api._plans.launching``): the serial twin
of each kernel (small calls run it on the calling thread; so do a child process after ``fork``
and ``FASTBWD_SERIAL=1``, see ``kernels/_jit.py``) and its parallel kernel. Nothing here
compiles at import.
"""

import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np

from ._dtypes import BY_NAME
from ._registry import OPERATORS


@dataclass(frozen=True)
class Entry:
    """One kernel path: ``call(dtype)`` reaches it through the public function ``op``."""

    op: str  # public function name
    dtype: str  # key of _dtypes.BY_NAME
    layout: str  # "NCHW" or "NHWC" (channels-last memory, however the function is asked for it)
    path: str  # which kernel of the operator the call reaches
    call: Callable[[np.dtype], object]
    #: a variant that may reach kernels other entries compile too: it runs after all the others
    #: (then it finds them in the cache instead of compiling them a second time in parallel)
    variant: bool = False

    @property
    def key(self):
        return f"{self.op} {self.dtype} {self.layout} {self.path}"


#: Every (operator, dtype, layout, path) of the registry; :func:`precompile` runs them in
#: :data:`SLOWEST_FIRST` order, variants last.
TABLE = [
    Entry(op.name, dtype, path.layout, path.name, path.call, path.variant)
    for op in OPERATORS.values()
    for path in op.paths
    for dtype in path.dtypes
]


#: Operators in the order their entries start, the slowest to compile first (a short tail).
SLOWEST_FIRST = (
    "roi_align_backward",
    "roi_align_forward",
    "group_norm_swish_backward",
    "group_norm_swish",
    "upsample_bilinear2d_backward",
    "avg_pool2d_backward",
    "replication_pad2d_backward",
)

#: Operators whose kernels share helpers (or kernels: RoIAlign's tables, the separable engine's),
#: grouped so that one worker compiles them: an operator not named is a group of its own.
SHARING = {
    "roi_align_forward": "roi_align_backward",
    "group_norm_swish": "group_norm_swish_backward",
    "avg_pool2d_backward": "upsample_bilinear2d_backward",
}

#: CPU seconds one run of each operator's entries takes to compile, about (measured on the 2-core
#: AMD EPYC VM, docs/history.md): the groups start the costliest first, so the workers end together.
COST = {
    "roi_align_backward": 6.0,
    "roi_align_forward": 4.0,
    "group_norm_swish_backward": 3.0,
    "group_norm_swish": 2.0,
    "upsample_bilinear2d_backward": 3.0,
    "avg_pool2d_backward": 2.5,
    "replication_pad2d_backward": 1.5,
}


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
    dtypes = names(dtypes, set(BY_NAME), "dtype(s)")
    layouts = names(layouts, {"NCHW", "NHWC"}, "layout(s)")
    return [
        entry
        for entry in TABLE
        if (ops is None or entry.op in ops)
        and (dtypes is None or entry.dtype in dtypes)
        and (layouts is None or entry.layout in layouts)
    ]


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


#: What :func:`precompile` compiles when no dtypes are named: the dtype models train and infer
#: in by default in both frameworks. The whole table (every dtype) costs about five times its CPU
#: (docs/runtime.md); ``dtypes="all"`` asks for it.
DEFAULT_DTYPES = ("float32",)


def precompile_dtypes(dtypes):
    """The dtype names :func:`select` gets for ``precompile(dtypes=...)``: :data:`DEFAULT_DTYPES`
    for None, every dtype (None) for "all" (alone or in a list), else ``dtypes`` as given."""
    if dtypes is None:
        return DEFAULT_DTYPES
    if dtypes == "all" or (not isinstance(dtypes, str) and "all" in tuple(dtypes)):
        return None
    return dtypes


#: The two ways every entry runs (``api._plans.launching``'s modes).
TWINS = ("parallel", "serial")


def _run_group(runs):
    """Worker: :func:`_run_entry` for each ``(index, twin)`` of ``runs``, in order, in this process."""
    return [_run_entry(index, twin) for index, twin in runs]


def groups(entries):
    """The runs of ``entries`` (both twins of each), in groups a worker runs whole: one dtype of
    the operators of one :data:`SHARING` group each, its variants last; the groups ordered by
    their estimated cost (:data:`COST`), the costliest first."""
    grouped = {}
    for entry in sorted(entries, key=lambda entry: (entry.variant, SLOWEST_FIRST.index(entry.op))):
        key = (SHARING.get(entry.op, entry.op), entry.dtype)
        grouped.setdefault(key, []).extend((TABLE.index(entry), twin) for twin in TWINS)
    cost = {key: sum(COST.get(TABLE[index].op, 3.0) for index, _ in runs) for key, runs in grouped.items()}
    return [grouped[key] for key in sorted(grouped, key=lambda key: -cost[key])]


def _run_entry(index, twin):
    """Worker: run TABLE[index] with its launches forced to ``twin`` (one of :data:`TWINS`);
    returns (index, wall seconds, CPU seconds of this worker, compiled kernel names, error).
    Compiling is single-threaded and in-process, so the worker's CPU time is the run's cost
    whatever else holds the machine's cores (its wall time is not, on a busy machine)."""
    from numba.core import event

    from .api._plans import launching

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
    start, cpu = time.perf_counter(), time.process_time()
    try:
        entry = TABLE[index]
        with launching(twin):
            entry.call(BY_NAME[entry.dtype])
        error = None
    except Exception as exc:  # noqa: BLE001 - reported, never raised into the pool
        error = f"{type(exc).__name__}: {exc}"
    finally:
        event.unregister("numba:compile", listener)
    return index, time.perf_counter() - start, time.process_time() - cpu, compiled, error


def precompile(ops=None, dtypes=None, layouts=None, *, workers=None, verbose=True):
    """Compile the kernels the public functions can dispatch to into Numba's disk cache, float32's
    unless ``dtypes`` says more: the parallel kernel and the serial twin (small calls run it) of each.

    Parameters
    ----------
    ops : str or sequence of str, optional
        Operator names (default: all seven): the six public functions
        (``upsample_bilinear2d_backward``, ``avg_pool2d_backward``, ``replication_pad2d_backward``,
        ``roi_align_backward``, ``group_norm_swish_backward``, ``group_norm_swish``) and
        ``roi_align_forward`` (the forward kernel of ``fastbwd.torch.roi_align`` and
        ``fastbwd.jax.roi_align``); the same names as ``--ops`` in ``python -m fastbwd`` and
        ``python3 -m bench``.
    dtypes : str or sequence of str, optional
        dtype names: "float32", "float16", "bfloat16", "float64", "complex64", "complex128",
        or "all": every dtype each operator accepts (default: float32, :data:`DEFAULT_DTYPES`;
        a dtype not precompiled compiles on its first call, as without a precompile).
    layouts : str or sequence of str, optional
        "NCHW" and/or "NHWC" (channels-last memory, however it is asked for; default: both).
    workers : int, optional
        Worker processes (default: one per core).
    verbose : bool, default True
        Print one line per table entry and a total.

    Returns
    -------
    dict
        ``{"entries": runs (kernel paths times the two twins), "compiled": kernels compiled,
        "seconds": wall time, "cpu_seconds": the workers' CPU time (what compiling costs,
        whatever else holds the cores), "cache": folder, "errors": [...]}``. Idempotent: a second run finds everything in the cache. When no
        cache folder is writable (or ``FASTBWD_CACHE=0``) it says so and compiles nothing.
        Never changes any result.
    """
    say = print if verbose else (lambda *args, **kwargs: None)
    default, dtypes = dtypes is None, precompile_dtypes(dtypes)
    entries = select(ops, dtypes, layouts)
    folder, reason = cache_folder()
    if folder is None:
        say(f"fastbwd precompile: {reason}; nothing compiled")
        return dict(entries=0, compiled=0, seconds=0.0, cpu_seconds=0.0, cache=None, errors=[], skipped=reason)

    batches = groups(entries)
    runs = [run for batch in batches for run in batch]
    workers = max(1, min(workers or os.cpu_count() or 1, len(batches) or 1))
    say(
        f"fastbwd precompile: {len(entries)} kernel paths, each parallel and as its serial twin ({len(runs)} runs "
        f"in {len(batches)} groups), with {workers} worker process(es) into {folder}"
    )
    others = sorted({entry.dtype for entry in select(ops, None, layouts)} - set(DEFAULT_DTYPES)) if default else []
    if others:
        say(
            f"  {', '.join(DEFAULT_DTYPES)} only (the default): {', '.join(others)} compile on their first call, "
            "or here with --dtypes (a list, or all)"
        )
    import multiprocessing

    start = time.perf_counter()
    compiled, errors, cpu, done = 0, [], 0.0, 0
    width = len(str(len(runs)))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_run_group, batch) for batch in batches]
        for future in as_completed(futures):
            for (index, seconds, cpu_seconds, kernels, error), (_, twin) in zip(
                future.result(), batches[futures.index(future)]
            ):
                done += 1
                cpu += cpu_seconds
                entry = TABLE[index]
                twin = " (serial twin)" if twin == "serial" else ""
                if error:
                    errors.append(f"{entry.key}: {error}")
                    status = f"FAILED: {error}"
                elif kernels:
                    compiled += len(kernels)
                    status = f"compiled {', '.join(kernels)} in {seconds:.1f} s ({cpu_seconds:.1f} s CPU)"
                else:
                    status = f"cached ({seconds:.2f} s)"
                say(f"[{done:>{width}}/{len(runs)}] {entry.key}{twin}: {status}", flush=True)
    seconds = time.perf_counter() - start
    say(
        f"fastbwd precompile: {len(runs)} runs, {compiled} kernels compiled, {len(errors)} errors, {seconds:.1f} s "
        f"({cpu:.1f} s of CPU in {workers} worker(s))"
    )
    return dict(entries=len(runs), compiled=compiled, seconds=seconds, cpu_seconds=cpu, cache=folder, errors=errors)
