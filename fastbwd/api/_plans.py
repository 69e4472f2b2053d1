"""Validated call geometries, remembered (the api layer's per-call fast path).

A public function validates its arguments and derives what its kernels need (the physical
layout, shapes, tables, result layout) from the arrays' metadata (shape, strides, dtype) and its
discrete arguments (integers, flags, strings). None of that depends on the values in the arrays,
so each function keeps the outcome, its *plan*, in a :class:`Plans` table keyed by exactly those
inputs (:func:`key`). A repeated call, as in every step of a training loop, finds its plan and
goes straight to the per-call work: the checks that do depend on the call (``out=`` not
overlapping the inputs, real-valued scalars), the output allocation and the kernels.

A key captures the type of every value as well as the value (``True`` and ``1``, ``2`` and
``2.0`` are different keys), so a cached plan is only ever used for arguments the full
validation accepted with the same meaning. Arguments that cannot be keyed (an unusual type)
simply skip the table: the full validation runs every time. Failed validations are never
stored: every error is raised by the same code, with the same message, on every call.
"""

import contextlib
import threading
import weakref

import numpy as np

from .. import kernels

#: Plans kept per public function (the oldest is dropped first): a training loop uses a handful
#: of geometries per operator; a sweep over shapes only pays the validation it always paid.
PLANS_PER_FUNCTION = 256

_SCALAR_TYPES = (bool, int, float, str, type(None), np.integer, np.floating, np.bool_)
_PLAIN_TYPES = frozenset((bool, int, float, str, type(None)))


class Unkeyable(Exception):
    """An argument :func:`key` cannot describe: the call is validated in full, uncached."""


def key(*values):
    """A hashable description of ``values`` for a :class:`Plans` table, built in one pass.

    Arrays are described by shape, strides, dtype, writeability and alignment (not by address
    or contents), scalars by type and value, sequences element by element. Raises
    :class:`Unkeyable` for anything else.
    """
    parts = []
    append = parts.append
    for value in values:
        kind = type(value)
        # the common kinds by their exact type first, inline (keying is part of every call's
        # cost); subclasses, NumPy scalars and nested sequences through _key
        if kind is _ndarray:
            flags = value.flags
            # alignment too: a plan's launches call the entry points compiled for their first arrays
            append((value.shape, value.strides, value.dtype, flags.writeable, flags.aligned))
        elif kind in _PLAIN_TYPES:
            append((kind, value))
        elif kind is list or kind is tuple:
            types = tuple(map(type, value))
            if _PLAIN_TYPES.issuperset(types):  # sizes and flags: keyed without recursion
                append((kind, tuple(value), types))
            else:
                append(_key(value))
        else:
            append(_key(value))
    return tuple(parts)


_ndarray = np.ndarray


def _key(value):
    kind = type(value)
    if kind in _PLAIN_TYPES:
        return kind, value
    if kind is list or kind is tuple or isinstance(value, (tuple, list)):
        types = tuple(map(type, value))
        if _PLAIN_TYPES.issuperset(types):  # the common case, keyed without recursion
            return (kind, tuple(value), types)
        return (kind,) + tuple(map(_key, value))
    if isinstance(value, np.ndarray):
        flags = value.flags
        return (kind, value.shape, value.strides, value.dtype, flags.writeable, flags.aligned)
    if isinstance(value, _SCALAR_TYPES):
        return kind, value
    raise Unkeyable(kind.__name__)


class Plans:
    """A bounded table of plans for one public function; safe to use from several threads
    (a plan is immutable once built; two threads building the same plan is harmless)."""

    def __init__(self, size=PLANS_PER_FUNCTION):
        self._size = size
        self._plans = {}
        self._lock = threading.Lock()
        _TABLES.add(self)
        #: ``get(plan_key)``: the plan stored under ``plan_key``, or None (the table's own
        #: ``dict.get``, so a lookup costs no Python call of its own).
        self.get = self._plans.get

    def __call__(self, build, *args):
        """The plan for ``args``: the stored one, or ``build(*args)`` (which validates them:
        its errors propagate and nothing is stored). ``args`` must be everything the plan
        depends on, and only metadata-like values (see :func:`key`)."""
        try:
            plan_key = key(*args)
        except Unkeyable:
            return build(*args)
        plan = self._plans.get(plan_key)
        if plan is None:
            plan = self.add(plan_key, build(*args))
        return plan

    def add(self, plan_key, plan):
        """Store ``plan`` (dropping the oldest when full) and return it."""
        with self._lock:
            self._plans[plan_key] = plan
            while len(self._plans) > self._size:
                self._plans.pop(next(iter(self._plans)))
        return plan

    def clear(self):
        with self._lock:
            self._plans.clear()

    def __len__(self):
        return len(self._plans)


#: Every table of plans (for :func:`launching`).
_TABLES = weakref.WeakSet()


@contextlib.contextmanager
def launching(mode):
    """Make every kernel launch planned inside the block run ``mode``: ``"serial"`` (the serial
    twins, on the calling thread) or ``"parallel"`` (the parallel kernels on Numba's pool, however
    small the call), instead of choosing by the work of each call. Every table forgets its plans
    on entry and on exit, so no plan made one way is used the other way. For ``precompile``
    (both twins of every kernel path) and the thread-count tests (tiny inputs on the pool); not
    thread-safe: nothing else may call fastbwd meanwhile."""
    if mode not in ("serial", "parallel"):
        raise ValueError(f"launching: mode must be 'serial' or 'parallel', but got {mode!r}")
    forget_all()
    previous = kernels.force_launches(mode)
    try:
        yield
    finally:
        kernels.force_launches(previous)
        forget_all()


def forget_all():
    """Empty every table of plans (the next call of each geometry plans afresh)."""
    for table in list(_TABLES):
        table.clear()
