"""What the JAX functions share: placeholders for trace-time planning, static arguments."""

import numpy as np


def placeholder(shape, dtype):
    """An array of ``shape`` and ``dtype`` standing for a traced value when a JAX function plans
    its fastbwd call at trace time (the api's ``plan`` validates every argument and reads only
    metadata): ``np.empty``, whose large allocations are mapped lazily, so no memory is touched."""
    return np.empty(shape, dtype)


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
