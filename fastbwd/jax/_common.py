"""What the JAX functions share: trace-time validation by the public functions, static arguments."""

import numpy as np

from .._errors import ParamError

#: An ``out=`` that is not an array: see :func:`validate`.
_CHECK_ONLY = object()


def placeholder(shape, dtype):
    """An array of ``shape`` and ``dtype`` standing for a traced value in :func:`validate`:
    ``np.empty`` (large ones are mapped lazily: no memory is touched)."""
    return np.empty(shape, dtype)


def validate(function, *arrays, **arguments):
    """Run every argument check of the public ``function`` at trace time, without running it.

    ``arrays`` are placeholders with the traced values' shapes and dtypes. The public functions
    check all their arguments before ``out=``, and refuse an ``out`` that is not an array; so a
    call with such an ``out`` raises the ParamError of the first bad argument, or the ``out``
    error when all are good, which means the arguments are valid (no kernel ran).
    """
    out = (_CHECK_ONLY, None, None) if arguments.pop("out_is_tuple", False) else _CHECK_ONLY
    try:
        function(*arrays, **arguments, out=out)
    except ParamError as error:
        if error.param == "out":
            return
        raise
    raise AssertionError(f"{function.__name__} accepted an out= that is not an array")  # pragma: no cover


def shape_or(default, build):
    """``build()``, or ``default`` when the arguments it reads are malformed (their validation,
    which follows, then reports them)."""
    try:
        return build()
    except Exception:  # noqa: BLE001 - only a placeholder shape; validation raises the real error
        return default


def static_ints(value):
    """A hashable form of a size argument (a tuple for a sequence or array), left as it is
    otherwise for the validation to judge."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list):
        return tuple(value)
    return value


def ints(value, repeats=None):
    """A validated size argument as a tuple of Python ints (``repeats`` copies of a single one)."""
    if isinstance(value, (int, np.integer)):
        return (int(value),) * (repeats or 1)
    value = tuple(int(v) for v in value)
    return value * repeats if repeats and len(value) == 1 else value
