"""What the JAX functions share: placeholders for trace-time planning, static arguments."""

import math

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


def vmap_axes(arrays, ranks):
    """``(extra, batch)`` of the operands of an ``"expand"`` FFI target (``_ffi``): how many
    leading axes ``jax.vmap`` added to each operand, and their sizes over all operands (an
    operand that is not batched has size 1 there)."""
    extra = arrays[0].ndim - ranks[0]
    return extra, tuple(max(sizes) for sizes in zip(*(a.shape[:extra] for a in arrays))) if extra else ()


def element(array, extra, index):
    """The part of an operand of an ``"expand"`` target for one batch element ``index`` (its
    size-1 leading axes, where it is not batched, read at 0)."""
    return array[tuple(i if size > 1 else 0 for i, size in zip(index, array.shape[:extra]))]


def run_batched(run, inputs, outputs, ranks, shared=()):
    """``run(inputs, outputs)`` for the operands of an ``"expand"`` target: once when vmap added
    no axis; once on the whole batch, its axes merged with the leading axis of each operand,
    when the operands at the positions ``shared`` are not batched and every other one is
    batched on every axis; otherwise once per batch element."""
    extra, batch = vmap_axes(inputs, ranks)
    if not extra:
        return run(inputs, outputs)
    if shared and all(
        (math.prod(a.shape[:extra]) == 1) if i in shared else a.shape[:extra] == batch for i, a in enumerate(inputs)
    ):

        def merged(array):
            return array.reshape((-1,) + array.shape[extra + 1 :])

        inputs = [a[(0,) * extra] if i in shared else merged(a) for i, a in enumerate(inputs)]
        return run(inputs, [merged(a) for a in outputs])
    for index in np.ndindex(*batch):
        run([element(a, extra, index) for a in inputs], [element(a, extra, index) for a in outputs])
    return None


def channels_last_subjects(ndim, names=("input", "grad_output")):
    """For a function whose channels-last x (``(N, H, W, C)``, or ``(H, W, C)`` given a batch
    of 1) an api reads as NCHW: each ``name.shape[i]`` of the api's messages as x's own axis."""
    axes = (0, 3, 1, 2) if ndim == 4 else (None, 2, 0, 1)
    return {
        f"{name}.shape[{i}]": f"x.shape[{axis}]" for name in names for i, axis in enumerate(axes) if axis is not None
    }
