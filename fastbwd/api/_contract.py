"""The one contract of every public function, in code (docs/design.md, "The one contract").

Each public function is an :class:`Operation`: **key -> plan -> allocate -> run**.

* ``key(*args)``: a hashable description of what a plan depends on, built in one pass from the
  arguments that can vary (the arrays' metadata, the other arguments by type and value, the
  thread count where a plan depends on it); :class:`fastbwd.api._plans.Unkeyable` for an
  argument it cannot describe (then the call is validated in full, uncached).
* ``validate(*args)``: every check, in the documented order (ParamError), the kernels' Geometry
  and ``kernels.<op>.plan(geometry)``; returns the api's plan. Remembered per key in the
  operation's table: the only place a geometry is remembered.
* the api's plan's ``run(*arrays, *scalars, out)``: allocates the results (``_dtypes.allocate``,
  the one allocation path) and runs the kernels' plan on the kernel operands of the arrays.

The public function converts its arrays, finds its plan (:meth:`Operation.plan`) and returns its
run; its ``Operation`` is made beside it and gives it ``prepare``. Its two-phase form, aclnn's
``aclnnXxxGetWorkspaceSize`` then ``aclnnXxx``, is ``function.prepare(...)``: the same arguments once (arrays, or shapes and dtypes), validated and
planned then; the :class:`Prepared` callable it returns takes the arrays alone, checks only what
can differ from the example, and runs the same plan.
"""

import inspect
from typing import NamedTuple

import numpy as np

from .. import _dtypes as d
from .. import _validation as v
from ..kernels import thread_count
from . import _plans

#: Every operation by its public function's name (tests/test_contract_code.py walks them).
OPERATIONS = {}


class Operation:
    """A public function's contract (see the module doc): made once per function, beside it."""

    def __init__(
        self, function, validate, parameters, *, scalars=(), threaded=False, arrays=None, shapes=(), bind=None
    ):
        #: the public function's name: every error names it
        self.name = function.__name__
        self.function = function
        #: every check in the documented order, then the plan (the api's: holds the kernels')
        self.validate = validate
        #: the public function's parameters that :meth:`plan` takes, in its order
        self.parameters = parameters
        #: the per-call scalars its run takes after the arrays (real numbers not part of a plan)
        self.scalars = scalars
        #: a plan depends on the thread count (a task partition sized by it): then it is in the key
        self.threaded = threaded
        #: its array arguments, in order: what it converts with ``as_array`` and a prepared call takes
        self.arrays = arrays or tuple(p for p in parameters if p in _ARRAY_NAMES)
        #: the array arguments that may be given as a shape instead (a tuple or list)
        self.shapes = shapes
        self._bind = bind
        self.plans = _plans.Plans()
        #: ``key(*args)``: the plan key of :meth:`plan`'s arguments, built in one pass
        self.key = _plans.key
        function.operation = self
        function.prepare = self.prepare
        OPERATIONS[self.name] = self

    def plan(self, *args):
        """The plan of a call: the remembered one for its key, or a new one from :meth:`validate`
        (whose ParamError propagates; a failed validation stores nothing)."""
        if self.threaded:  # first, so that validate's last arguments may have defaults
            args = (thread_count(),) + args
        try:
            plan_key = self.key(*args)
        except _plans.Unkeyable:
            return self.validate(*args)
        plan = self.plans.get(plan_key)
        if plan is None:
            plan = self.plans.add(plan_key, self.validate(*args))
        return plan

    def prepare_arguments(self, arguments):
        """``(plan arguments, scalars)`` from a call's bound arguments (a dict by parameter name,
        arrays already arrays): :meth:`plan`'s arguments and the per-call scalars its run takes
        (checked as the public function checks them)."""
        if self._bind is not None:
            return self._bind(arguments)
        return tuple(arguments[name] for name in self.parameters), ()

    def prepare(self, *args, **kwargs):
        """Validate and plan the call of these arguments once (arrays, or objects with ``shape``
        and ``dtype``: C-contiguous arrays of them), aclnn's ``GetWorkspaceSize``: returns a
        :class:`Prepared` callable that takes the arrays given as arrays here, in order, and
        ``out=``, and runs the call (docs/semantics.md §0.1, prepared calls)."""
        bound = inspect.signature(self.function).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        given = []  # the array arguments given as arrays: what the prepared call takes
        for name in self.arrays:
            value = arguments[name]
            if name in self.shapes and isinstance(value, (tuple, list)):  # a shape (avg-pool's, pad's input)
                continue
            arguments[name] = _example(self.name, name, value)
            given.append(name)
        plan_args, scalars = self.prepare_arguments(arguments)
        return Prepared(self, self.plan(*plan_args), arguments, tuple(given), scalars)

    def __repr__(self):
        return f"<operation {self.name}>"


#: Parameter names that are arrays, in any function.
_ARRAY_NAMES = frozenset(("grad_output", "input", "boxes", "dy", "mean", "rstd", "x", "gamma", "beta"))


def _example(func, name, value):
    """An example array argument as a NumPy array: an array (anything ``as_array`` takes), or
    an object with ``shape`` and ``dtype`` (``jax.ShapeDtypeStruct``, ``np.empty(...)``'s
    metadata), which stands for a C-contiguous array of that shape and dtype."""
    if value is not None and not hasattr(value, "__array__") and hasattr(value, "shape") and hasattr(value, "dtype"):
        try:
            return np.empty(tuple(value.shape), np.dtype(value.dtype))
        except TypeError as exc:
            v.fail(func, name, "must be an array or have an integer shape and a NumPy dtype", f"{value!r} ({exc})")
    return v.as_array(func, name, value)


class Prepared:
    """A call validated and planned once (``function.prepare(...)``): calling it with arrays of
    the example's metadata (shape, strides, dtype, alignment) runs the same plan, with the same
    bits as the direct call. ``out=`` is checked on each call (its metadata and writeability,
    and, as in every call, that it overlaps no input). An array of other metadata gets the
    direct call's ParamError where the direct call would refuse it, and otherwise a ParamError
    saying it differs from the prepared one. A plan sized by the thread count keeps the count
    of the ``prepare`` call (any count gives the same bits). Safe to call from several threads."""

    __slots__ = ("operation", "plan", "arrays", "_run", "_arguments", "_scalars", "_expected", "_outputs", "_slots")

    def __init__(self, operation, plan, arguments, given, scalars):
        self.operation = operation
        self.plan = plan
        #: the names of the arrays a call takes, in order
        self.arrays = given
        self._run = plan.run
        self._arguments = arguments
        self._scalars = scalars
        self._expected = tuple(_metadata(arguments[name]) for name in given)
        # where each given array goes among the run's arrays (None: all of them, in order)
        positions = {name: index for index, name in enumerate(operation.arrays)}
        self._slots = None if len(given) == len(operation.arrays) else tuple(positions[name] for name in given)
        self._outputs = plan.results  # what an out= entry must be

    def __call__(self, *arrays, out=None):
        expected = self._expected
        if len(arrays) != len(expected):
            self._count(arrays)
        for array, (metadata, aligned) in zip(arrays, expected):
            if (
                type(array) is not np.ndarray
                or (array.shape, array.strides, array.dtype) != metadata
                or array.flags.aligned is not aligned
            ):
                return self._differs(arrays, out)
        if out is not None:
            outputs = self._outputs
            if len(outputs) == 1:  # one result: out itself, checked inline
                metadata = outputs[0].metadata
                if type(out) is not np.ndarray or (out.shape, out.strides, out.dtype) != metadata:
                    self._check_out(out)
                else:
                    flags = out.flags
                    if not (flags.writeable and flags.aligned):
                        self._check_out(out)
            else:
                self._check_out(out)
        if self._slots is not None:
            arrays = self._fill(arrays)
        return self._run(*arrays, *self._scalars, out)

    def _count(self, arrays):
        v.fail(
            self.operation.name,
            "arrays",
            f"must be the {len(self.arrays)} prepared ({', '.join(self.arrays)})",
            f"{len(arrays)} arrays",
        )

    def _fill(self, arrays):
        full = [None] * len(self.operation.arrays)
        for slot, array in zip(self._slots, arrays):
            full[slot] = array
        return full

    def _check_out(self, out):
        entries = self.plan.out_entries(out)
        for entry, result in zip(entries, self._outputs):
            if entry is None:
                continue
            if type(entry) is np.ndarray and (entry.shape, entry.strides, entry.dtype) == result.metadata:
                flags = entry.flags
                if flags.writeable and flags.aligned:
                    continue
            # the direct call's checks and messages; metadata they accept (a size-1 axis's stride) passes
            d.check_out(self.operation.name, entry, result.shape, result.dtype, result.layout, param=result.param)
            if not entry.flags.aligned:  # the plan's kernels were compiled for aligned arrays
                v.fail(
                    self.operation.name, result.param, "must be aligned for this prepared call", "a misaligned array"
                )

    def _differs(self, arrays, out):
        """Arrays whose metadata is not the example's: converted as the direct call converts
        them; the same metadata after all (a tensor over such memory) runs, anything else is
        validated as the direct call validates it (its error) and refused if it passes."""
        operation = self.operation
        arrays = [v.as_array(operation.name, label, array) for label, array in zip(self.arrays, arrays)]
        if all(_metadata(array) == metadata for array, metadata in zip(arrays, self._expected)):
            return self(*arrays, out=out)
        arguments = dict(self._arguments, out=out)
        arguments.update(zip(self.arrays, arrays))
        operation.plan(*operation.prepare_arguments(arguments)[0])  # the direct call's ParamError, if any
        for label, array, ((shape, strides, dtype), _) in zip(self.arrays, arrays, self._expected):
            if (array.shape, array.strides, array.dtype) != (shape, strides, dtype):
                v.fail(
                    operation.name,
                    label,
                    f"must have the prepared shape {shape}, strides {strides} and dtype {dtype}",
                    f"shape {array.shape}, strides {array.strides} and dtype {array.dtype}",
                )
        v.fail(operation.name, self.arrays[0], "must be aligned as the prepared arrays", "another alignment")

    def __repr__(self):
        return f"<prepared {self.operation.name}({', '.join(self.arrays)})>"


class OneResultPlan(NamedTuple):
    """The api plan of an operation with one result (upsample, avg-pool, pad, RoIAlign's two
    directions): ``run(*arrays, out)`` allocates the result (``out`` checked to overlap none of
    the arrays) and runs the kernels on the first array's operand, the next ``passed - 1``
    arrays as they are (RoIAlign's boxes) and the result's kernel view."""

    func: str  # the public function's name
    names: tuple  # of the arrays run takes, in order
    passed: int  # how many of them the kernels take
    results: tuple  # the result's _dtypes.Result
    source: d.Operand  # how the first array becomes the kernels' operand
    kernels: object  # the kernels' plan (kernels.<op>.plan); None for an empty result

    def out_entries(self, out):
        return (out,)

    def run(self, *arrays_and_out):
        *arrays, out = arrays_and_out
        result, view = d.allocate(self.func, self.results[0], out, self.names, arrays)
        if self.kernels is not None:  # None: an empty result
            self.kernels.run(d.kernel_operand(arrays[0], self.source), *arrays[1 : self.passed], view)
        return result


def run(plan, *arrays_scalars_and_out):
    """The call ``plan`` (an operation's, from its module's ``plan``: the bridges' entry points)
    describes, on NumPy arrays with the metadata it was made for: ``plan.run(...)``."""
    return plan.run(*arrays_scalars_and_out)


def _metadata(array):
    return (array.shape, array.strides, array.dtype), array.flags.aligned
