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

import functools
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
        return Prepared(self, self.plan(*plan_args), arguments, tuple(given), scalars).call

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
    """A call validated and planned once (``function.prepare(...)``) and its per-call checks.

    ``prepare`` returns :attr:`call`, a plain function (calling an instance of a Python class
    costs 0.1-0.26 us more, with a keyword the most): calling it with arrays of the example's
    metadata (class, shape, strides, dtype, alignment) runs the same plan, with the same bits as
    the direct call. ``out=`` is checked on each call (its metadata and writeability, and, as in
    every call, that it overlaps no input). An array of other metadata gets the direct call's
    ParamError where the direct call would refuse it, and otherwise a ParamError saying it
    differs from the prepared one. A plan sized by the thread count keeps the count of the
    ``prepare`` call (any count gives the same bits). Safe to call from several threads: a call
    changes nothing here."""

    __slots__ = ("operation", "plan", "arrays", "call", "_run", "_arguments", "_scalars", "_expected", "_slots")

    def __init__(self, operation, plan, arguments, given, scalars):
        self.operation = operation
        self.plan = plan
        #: the names of the arrays a call takes, in order
        self.arrays = given
        self._run = plan.run
        self._arguments = arguments
        # the per-call scalars as the kernels take them (compute_scalar returns them as they are)
        compute = getattr(plan, "compute", None)
        self._scalars = tuple(d.compute_scalar(value, compute) for value in scalars) if compute else scalars
        self._expected = tuple(_metadata(arguments[name]) for name in given)
        # where each given array goes among the run's arrays (the others: None)
        positions = {name: index for index, name in enumerate(operation.arrays)}
        self._slots = tuple(positions[name] for name in given)
        self.call = self._function()

    def _function(self):
        """The prepared call: a function compiled from :func:`_prepared_source` for this call's
        arity, its constants the example's metadata (measured: one tuple comparison of every
        array's metadata costs about two thirds of a loop over the arrays)."""
        results = self.plan.results
        single = len(results) == 1
        namespace = {
            "EXPECTED": tuple(
                item for (metadata, aligned) in self._expected for item in (np.ndarray, *metadata, aligned)
            ),
            "OUT": (np.ndarray, *results[0].metadata, True, True) if single else None,
            "differs": self._differs,
            "check_out": self._check_out,
            "run": self._run,
            "SCALARS": self._scalars,
        }
        code = _prepared_code(len(self.arrays), self._slots, len(self.operation.arrays), len(self._scalars), single)
        exec(code, namespace)
        function = namespace["prepared"]
        function.__name__ = function.__qualname__ = f"{self.operation.name}_prepared"
        function.__doc__ = (
            f"{self.operation.name} prepared for its arrays ({', '.join(self.arrays)}) and out=: "
            "see fastbwd.api._contract.Prepared."
        )
        function.operation, function.plan, function.arrays, function.prepared = (
            self.operation,
            self.plan,
            self.arrays,
            self,
        )
        return function

    def _count(self, arrays):
        v.fail(
            self.operation.name,
            "arrays",
            f"must be the {len(self.arrays)} prepared ({', '.join(self.arrays)})",
            f"{len(arrays)} arrays",
        )

    def _check_out(self, out):
        """``out=`` of other metadata than the result's, or of several results: the direct
        call's checks and messages (metadata they accept, a size-1 axis's stride, passes)."""
        entries = self.plan.out_entries(out)
        for entry, result in zip(entries, self.plan.results):
            if entry is None:
                continue
            if type(entry) is np.ndarray and (entry.shape, entry.strides, entry.dtype) == result.metadata:
                flags = entry.flags
                if flags.writeable and flags.aligned:
                    continue
            d.check_out(self.operation.name, entry, result.shape, result.dtype, result.layout, param=result.param)
            if not entry.flags.aligned:  # the plan's kernels were compiled for aligned arrays
                v.fail(
                    self.operation.name, result.param, "must be aligned for this prepared call", "a misaligned array"
                )

    def _differs(self, arrays, out):
        """Arrays whose metadata is not the example's (or another count of them): converted as
        the direct call converts them; the same metadata after all (a tensor over such memory)
        runs, anything else is validated as the direct call validates it (its error) and refused
        if it passes."""
        operation = self.operation
        if len(arrays) != len(self.arrays):
            self._count(arrays)
        arrays = [v.as_array(operation.name, label, array) for label, array in zip(self.arrays, arrays)]
        if all(_metadata(array) == metadata for array, metadata in zip(arrays, self._expected)):
            if out is not None:
                self._check_out(out)
            full = [None] * len(operation.arrays)
            for slot, array in zip(self._slots, arrays):
                full[slot] = array
            return self._run(*full, *self._scalars, out)
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


@functools.cache
def _prepared_code(count, slots, width, scalars, single):
    """The compiled :func:`_prepared_source` (a handful of distinct arities in a process)."""
    return compile(_prepared_source(count, slots, width, scalars, single), "<fastbwd prepared call>", "exec")


def _prepared_source(count, slots, width, scalars, single):
    """The source of a prepared call taking ``count`` arrays (``slots``: their places among the
    ``width`` arrays its run takes), ``scalars`` per-call scalars, ``single``: one result (its
    ``out=`` checked inline). The names it reads: EXPECTED (per array its class, shape,
    strides, dtype and alignment, flat), OUT (the same of out, and writeable), differs,
    check_out, run, SCALARS."""
    names = [f"a{index}" for index in range(count)]
    described = ", ".join(f"{a}.__class__, {a}.shape, {a}.strides, {a}.dtype, {a}.flags.aligned" for a in names)
    run_arrays = ["None"] * width
    for slot, name in zip(slots, names):
        run_arrays[slot] = name
    run_arguments = ", ".join(run_arrays + [f"SCALARS[{index}]" for index in range(scalars)] + ["out"])
    lines = [
        "def prepared(*arrays, out=None):",
        "    try:",
        f"        {', '.join(names)}, = arrays",
        f"        same = ({described}) == EXPECTED",
        "    except Exception:  # another count, or not arrays: the slow path says what",
        "        same = False",
        "    if not same:",
        "        return differs(arrays, out)",
        "    if out is not None:",
    ]
    if single:
        lines += [
            "        flags = out.flags",
            "        if (out.__class__, out.shape, out.strides, out.dtype, flags.writeable, flags.aligned) != OUT:",
            "            check_out(out)",
        ]
    else:
        lines.append("        check_out(out)")
    lines.append(f"    return run({run_arguments})")
    return "\n".join(lines) + "\n"


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
        out = arrays_and_out[-1]
        if out is None:
            result, view = d.new(self.results[0])
        else:  # allocate looks at the arrays alone (as many as names), not at out itself
            result, view = d.allocate(self.func, self.results[0], out, self.names, arrays_and_out)
        kernels = self.kernels
        if kernels is not None:  # None: an empty result
            source = arrays_and_out[0]
            if self.source is not None:
                source = d.kernel_operand(source, self.source)
            if self.passed == 1:
                kernels.run(source, view)
            else:
                kernels.run(source, *arrays_and_out[1 : self.passed], view)
        return result


def run(plan, *arrays_scalars_and_out):
    """The call ``plan`` (an operation's, from its module's ``plan``: the bridges' entry points)
    describes, on NumPy arrays with the metadata it was made for: ``plan.run(...)``."""
    return plan.run(*arrays_scalars_and_out)


def _metadata(array):
    return (array.shape, array.strides, array.dtype), array.flags.aligned
