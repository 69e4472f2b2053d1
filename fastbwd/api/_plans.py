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

import threading

import numpy as np

#: Plans kept per public function (the oldest is dropped first): a training loop uses a handful
#: of geometries per operator; a sweep over shapes only pays the validation it always paid.
PLANS_PER_FUNCTION = 256

_SCALAR_TYPES = (bool, int, float, str, type(None), np.integer, np.floating, np.bool_)
_PLAIN_TYPES = frozenset((bool, int, float, str, type(None)))


class Unkeyable(Exception):
    """An argument :func:`key` cannot describe: the call is validated in full, uncached."""


def key(*values):
    """A hashable description of ``values`` for a :class:`Plans` table.

    Arrays are described by type, shape, strides, dtype and writeability (not by address or
    contents), scalars by type and value, sequences element by element. Raises
    :class:`Unkeyable` for anything else.
    """
    return tuple(map(_key, values))


def _key(value):
    if isinstance(value, np.ndarray):
        return (np.ndarray, value.shape, value.strides, value.dtype, value.flags.writeable)
    if isinstance(value, _SCALAR_TYPES):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        types = tuple(map(type, value))
        if _PLAIN_TYPES.issuperset(types):  # the common case, keyed without recursion
            return (type(value), tuple(value), types)
        return (type(value),) + tuple(map(_key, value))
    raise Unkeyable(type(value).__name__)


class Plans:
    """A bounded table of plans for one public function; safe to use from several threads
    (a plan is immutable once built; two threads building the same plan is harmless)."""

    def __init__(self, size=PLANS_PER_FUNCTION):
        self._size = size
        self._plans = {}
        self._lock = threading.Lock()
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
