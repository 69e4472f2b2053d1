"""The only place Numba options are spelled, and the safe call path every kernel goes through.

``@parallel_kernel`` turns a plain Python loop nest into a :class:`Kernel`:

* nothing compiles at import; each kernel compiles on its first call, once per argument types;
* compiled code is cached on disk (``cache=True``); when Numba finds no writable cache folder
  the kernel silently compiles without the disk cache instead of failing;
* ``nogil=True``; no fastmath flag (it would let LLVM assume away NaN and Inf);
  ``error_model="numpy"`` (IEEE division: no ZeroDivisionError check inside loops);
* a serial twin of every kernel (``prange`` runs as ``range``, identical arithmetic and order)
  is used where launching Numba's thread pool is unsafe (docs/semantics.md §0.3):

  - ``workqueue`` threading layer: it aborts the process when two Python threads enter parallel
    code at once, so calls into the pool are serialised with a lock;
  - a child process after ``fork`` of a parent that had started the ``omp`` (GNU OpenMP) or
    ``workqueue`` pool: the child runs the serial twin (GNU OpenMP would terminate it).

* a call whose work is small (``work=``, elements touched, below :data:`ONE_THREAD_BELOW`)
  runs its parallel code on the calling thread alone, as PyTorch does below its grain size.

Kernels are deterministic by construction (fixed partitions, fixed combination order), so the
serial twin and any thread count give bitwise identical results.
"""

import os
import sys
import threading
import types as pytypes
import warnings
from typing import NamedTuple

import numba
import numba.core.typing.typeof
import numba.extending
import numpy as np

from .. import _config
from . import _halfcalls

_OPTIONS = dict(nogil=True, fastmath=False, error_model="numpy", boundscheck=False)

#: Calls touching fewer elements than this (the ``work=`` of :meth:`Kernel.__call__`) run on the
#: calling thread only. Waking the pool costs more than such a call does, and on a loaded machine
#: a parallel region also waits for its workers to be scheduled (docs/design.md, "Threads, fork
#: and the threading layers"; the numbers in docs/history.md).
ONE_THREAD_BELOW = 1 << 15

# ---- thread-pool state, shared by all kernels ----------------------------------------------
_state_lock = threading.Lock()
_pool_lock = threading.Lock()  # held around parallel calls under the workqueue layer
_threading_layer = None  # known once the pool has been launched
_serial_only = _config.SERIAL


def _launch_pool():
    """Start Numba's thread pool (once) and learn which threading layer it picked."""
    global _threading_layer, _get_threads, _set_threads
    if _threading_layer is not None:  # the common case: no lock
        return _threading_layer
    with _state_lock:
        if _threading_layer is None:
            from numba.np.ufunc import parallel

            # Numba's OpenMP pool may share PyTorch's OpenMP runtime, and its launch sets that
            # runtime's thread count: keep the one the program gave PyTorch.
            torch = sys.modules.get("torch")
            torch_threads = torch.get_num_threads() if hasattr(torch, "set_num_threads") else None
            parallel._launch_threads()
            if torch_threads is not None and torch.get_num_threads() != torch_threads:
                torch.set_num_threads(torch_threads)
            # Numba's own entry points to the launched pool's per-thread count, without the two
            # locks numba.get/set_num_threads take on every call (four such calls in a small
            # call); kept public ones if a Numba version names them otherwise.
            getter = getattr(parallel, "_get_num_threads", None)
            setter = getattr(parallel, "_set_num_threads", None)
            if callable(getter) and callable(setter):
                _get_threads, _set_threads = getter, setter
            _threading_layer = numba.threading_layer()
    return _threading_layer


_get_threads = numba.get_num_threads
_set_threads = numba.set_num_threads


def get_num_threads():
    """``numba.get_num_threads()`` (the calling thread's count), launching the pool if needed."""
    _launch_pool()
    return _get_threads()


def set_num_threads(count):
    """``numba.set_num_threads(count)`` for the calling thread, launching the pool if needed."""
    _launch_pool()
    if not 1 <= count <= numba.config.NUMBA_NUM_THREADS:  # Numba's own check
        raise ValueError(f"thread count must be between 1 and {numba.config.NUMBA_NUM_THREADS}, but got {count}")
    _set_threads(count)


def _pool_started():
    try:
        from numba.np.ufunc import parallel

        return bool(parallel._is_initialized)
    except Exception:  # noqa: BLE001 - private API; assume the worst
        return True


def _after_fork_in_child():
    global _pool_lock, _state_lock, _serial_only
    _pool_lock = threading.Lock()
    _state_lock = threading.Lock()
    if _pool_started():
        try:
            layer = numba.threading_layer()
        except ValueError:
            layer = None
        if layer != "tbb":  # tbb is fork-safe; GNU OpenMP and workqueue are not
            _serial_only = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def threading_layer():
    """The Numba threading layer the kernels run on (launches the pool if needed)."""
    return _launch_pool()


def thread_count():
    """How many threads a kernel called now runs on: 1 when kernels run serially (after a fork,
    or ``FASTBWD_SERIAL``), else Numba's current count (launching the pool, as a kernel call
    would). For sizing tasks only: no kernel's result depends on it."""
    if _serial_only:
        return 1
    return get_num_threads()


# ---- kernels --------------------------------------------------------------------------------


def _dispatcher(py_func, parallel):
    """An njit dispatcher with the project's options; disk cache when a folder is writable."""
    options = dict(_OPTIONS, parallel=parallel)
    _halfcalls.provide_if_needed()  # before any kernel is built or loaded from the cache
    if _config.CACHE:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", numba.NumbaWarning)
                return numba.njit(cache=True, **options)(py_func)
        except (RuntimeError, OSError):
            pass  # no writable cache folder: compile in memory only
    return numba.njit(**options)(py_func)


def _serial_copy(py_func):
    """A copy of ``py_func`` under another qualified name, so its disk cache entry is its own."""
    copy = pytypes.FunctionType(
        py_func.__code__,
        py_func.__globals__,
        py_func.__name__ + "_serial",
        py_func.__defaults__,
        py_func.__closure__,
    )
    copy.__qualname__ = py_func.__qualname__ + "_serial"
    copy.__module__ = py_func.__module__
    copy.__doc__ = py_func.__doc__
    return copy


class Kernel:
    """A parallel loop nest compiled lazily, called through the safe path described above."""

    def __init__(self, py_func):
        self.py_func = py_func
        self.__name__ = py_func.__name__
        self.__qualname__ = py_func.__qualname__
        self.__doc__ = py_func.__doc__
        self.__module__ = py_func.__module__
        self._parallel = None
        self._serial = None
        self._make_lock = threading.Lock()

    @property
    def parallel(self):
        if self._parallel is None:
            with self._make_lock:
                if self._parallel is None:
                    self._parallel = _dispatcher(self.py_func, parallel=True)
        return self._parallel

    @property
    def serial(self):
        if self._serial is None:
            with self._make_lock:
                if self._serial is None:
                    self._serial = _dispatcher(_serial_copy(self.py_func), parallel=False)
        return self._serial

    def __call__(self, *args, work=None):
        """Run the kernel; ``work`` (elements the call touches), when given and below
        :data:`ONE_THREAD_BELOW`, keeps it on the calling thread (same code, same bits)."""
        if _serial_only or _forced == "serial":
            return self.serial(*args)
        layer = _threading_layer or _launch_pool()
        if work is not None and work < ONE_THREAD_BELOW and _forced is None:
            threads = _get_threads()  # the pool is launched: Numba's own entry points
            if threads > 1:
                _set_threads(1)  # for this Python thread only
                try:
                    return self._parallel_call(layer, args)
                finally:
                    _set_threads(threads)
        return self._parallel_call(layer, args)

    def _parallel_call(self, layer, args):
        parallel = self._parallel or self.parallel
        if layer == "workqueue":
            with _pool_lock:
                return parallel(*args)
        return parallel(*args)

    def __repr__(self):
        return f"<fastbwd kernel {self.__module__}.{self.__qualname__}>"


def parallel_kernel(py_func):
    """Decorate a loop nest (using ``numba.prange``) as a lazily compiled :class:`Kernel`."""
    return Kernel(py_func)


# ---- launches and plans (docs/design.md, "The one contract") ----------------------------------

#: None: a launch runs the serial twin below ONE_THREAD_BELOW elements of work and the parallel
#: kernel from there; "serial" or "parallel": every launch made meanwhile runs that way.
_forced = None


def force_launches(mode):
    """Make every :class:`Launch` made from now on (and every :class:`Kernel` call given a
    ``work``) run ``mode``: "serial", "parallel", or None for the choice by work; returns the
    mode it replaces. Plans already made keep their launches: ``api._plans.launching`` forgets
    them."""
    global _forced
    previous, _forced = _forced, mode
    return previous


class Launch:
    """One kernel call as a plan fixed it: the serial twin on the calling thread (``work``, the
    elements the call touches, below :data:`ONE_THREAD_BELOW`: waking the pool and setting up a
    parallel region cost more than such a call) or the parallel kernel on Numba's pool; the same
    code, the same bits.

    The first call resolves the kernel's compiled entry point for its arguments' types (the
    positions in ``read_only`` typed read-only: the kernel only reads them, and one compiled
    signature serves writeable and read-only arrays alike) and later calls call it directly,
    without typing their arguments again: a plan's calls all pass arrays of the metadata it was
    made for. Per call a parallel launch reads the process's safety switch (after ``fork``, or
    with ``FASTBWD_SERIAL``, the serial twin runs); a serial launch, whose twin is right in
    every state, offers its resolved entry point as :attr:`call`, which its callers call
    instead of the launch (the per-call cost of a small call: docs/design.md, "Per-call overhead").
    """

    __slots__ = ("kernel", "parallel", "read_only", "call", "_entry", "_serial_entry", "_locked")

    def __init__(self, kernel, work, read_only=(0,)):
        self.kernel = kernel
        # work None: always the serial twin (work that could never pay for the pool)
        self.parallel = work is not None and (_forced == "parallel" or (_forced is None and work >= ONE_THREAD_BELOW))
        self.read_only = read_only
        #: the compiled entry point to call instead of the launch, once a serial launch has
        #: resolved it; None before that and for a parallel launch (call the launch itself)
        self.call = None
        self._entry = None
        self._serial_entry = None
        self._locked = False

    def __call__(self, *args):
        if _serial_only:
            return (self._serial_entry or self._resolve_serial(args))(*args)
        entry = self._entry or self._resolve(args)
        if self._locked:
            with _pool_lock:
                return entry(*args)
        return entry(*args)

    def _resolve(self, args):
        if self.parallel:
            self._locked = (_threading_layer or _launch_pool()) == "workqueue"
            self._entry = _entry_point(self.kernel.parallel, args, self.read_only)
        else:
            self._entry = self._serial_entry or self._resolve_serial(args)
        return self._entry

    def _resolve_serial(self, args):
        self._serial_entry = _entry_point(self.kernel.serial, args, self.read_only)
        if not self.parallel:
            self.call = self._serial_entry
        return self._serial_entry

    def __repr__(self):
        return f"<launch of {self.kernel!r}: {'parallel' if self.parallel else 'serial twin'}>"


def _entry_point(dispatcher, args, read_only):
    """The compiled entry point of ``dispatcher`` for ``args``' types (compiled, or loaded from
    the disk cache, if needed); the dispatcher itself where Numba has no such entry points."""
    types = [numba.typeof(arg, numba.core.typing.typeof.Purpose.argument) for arg in args]
    for index in read_only:
        types[index] = types[index].copy(readonly=True)
    try:
        return dispatcher.compile(tuple(types))
    except AttributeError:  # pragma: no cover - a Numba without Dispatcher.compile's entry points
        return dispatcher


class Plan(NamedTuple):
    """The plan of one kernel for one geometry (what a kernels module's ``plan`` returns when a
    single kernel does the work): :meth:`run` reshapes each array to its kernel shape and launches
    the kernel with the plan's other arguments (tables, sizes, the storage format)."""

    launch: Launch
    shapes: tuple  # the kernel's shape of each array argument, in order
    arguments: tuple  # the kernel's arguments after the arrays

    def run(self, *arrays):
        launch = self.launch
        (launch.call or launch)(*map(np.ndarray.reshape, arrays, self.shapes), *self.arguments)


def helper(py_func):
    """An ``@njit`` helper called from kernels (inlined into them by LLVM; compiled with them)."""
    return numba.njit(**_OPTIONS)(py_func)


@numba.extending.intrinsic
def wide_vectors(typingctx):
    """Let LLVM vectorise the loops of the function this is called in with the widest vectors
    the CPU has (no-op elsewhere). On AVX-512 CPUs LLVM otherwise prefers 256-bit vectors for
    its own loops; the width changes no result (each lane does the same IEEE operations and no
    loop is reassociated), only the speed (docs/design.md, "Vector width"). A helper whose loop
    vectorises in its own module needs its own call."""
    signature = numba.core.types.none()

    def codegen(context, builder, signature, args):
        # a string attribute llvmlite's checked set does not know: added to the set directly
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return signature, codegen


@numba.extending.intrinsic
def always_inline(typingctx):
    """Mark the function this is called in for LLVM to inline into its callers."""
    signature = numba.core.types.none()

    def codegen(context, builder, signature, args):
        builder.function.attributes.add("alwaysinline")
        return context.get_dummy_value()

    return signature, codegen


def leaf_helper(py_func):
    """:func:`helper` for code that allocates nothing: compiled without reference counting, so
    the array views it takes cost no atomic operation. The arrays it passes on should go to
    leaf helpers too (an ordinary helper counts their references again)."""
    return numba.njit(_nrt=False, **_OPTIONS)(py_func)
