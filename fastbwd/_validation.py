"""Shared argument checks (docs/semantics.md §0.1, §0.4).

Every public function validates all of its arguments with these helpers before any kernel runs:
compiled kernels do no bounds checking, so everything a kernel relies on is established here.
Every failure raises :class:`fastbwd.ParamError` with the message
``"<function>: <argument> <requirement>, but got <actual>"``.
"""

import contextlib
import operator
import re
import sys

import numpy as np

from ._errors import ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, ParamError

#: The documents' limit on any tensor dimension of the resize operators.
MAX_DIM_SIZE = 1 << 20


def fail(func, subject, requirement, actual, *, status=ACLNN_ERR_PARAM_INVALID):
    """Raise the ParamError of docs/semantics.md §0.4.

    ``subject`` is what the message talks about: an argument name, or a part of one such as
    ``"grad_output.shape[2]"`` or ``"padding[0]"``; the error's ``param`` is the argument's name.
    """
    raise _error(func, subject, requirement, actual, status)


def _error(func, subject, requirement, actual, status):
    return ParamError(
        f"{func}: {subject} {requirement}, but got {actual}",
        status=status,
        param=re.match(r"\w+", subject).group(0),
        parts=(func, subject, requirement, actual),
    )


@contextlib.contextmanager
def called_as(func, subjects=None):
    """Errors raised inside the block name ``func``, the function the user called, and the user's
    own arguments: a bridge function that validates through an api function's plan says, in
    each ParamError's message, ``func`` for the api function and ``subjects[s]`` for the subject
    ``s`` (an argument or a part of one: ``"input_size[2]"``, ``"grad_output.dtype"``). A
    subject found in ``subjects`` whole is replaced whole; otherwise its leading argument name is
    (``{"grad_output": "x"}`` turns ``grad_output.dtype`` into ``x.dtype``); any other subject
    keeps its name. The error keeps its status."""
    try:
        yield
    except ParamError as error:
        if error.parts is None:
            raise
        _, subject, requirement, actual = error.parts
        subjects = subjects or {}
        if subject in subjects:
            subject = subjects[subject]
        else:
            name = re.match(r"\w+", subject).group(0)
            subject = subjects.get(name, name) + subject[len(name) :]
        raise _error(func, subject, requirement, actual, error.status) from None


def describe(value):
    """A short, readable rendering of a bad value for an error message."""
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    if isinstance(value, (bool, np.bool_)):
        return f"{value!r} (a bool)"
    if isinstance(value, (float, np.floating)):
        return f"{value!r} (a float)"
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    if isinstance(value, (int, np.integer, str, tuple, list)) or value is None:
        return text
    return f"{text} (a {type(value).__name__})"


def require(func, param, value):
    """A required argument: ``None`` is ACLNN_ERR_PARAM_NULLPTR."""
    if value is None:
        fail(func, param, "is required", "None", status=ACLNN_ERR_PARAM_NULLPTR)
    return value


# --------------------------------------------------------------------------------------------
# arrays
# --------------------------------------------------------------------------------------------


def _from_torch(value):
    """A NumPy view of a CPU torch tensor (bfloat16 included), or None if ``value`` is not one.

    torch is never imported here: a tensor can only exist if the caller already imported it.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return None
    tensor = value.detach()
    if tensor.device.type != "cpu":
        return None
    tensor = tensor.resolve_conj().resolve_neg()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def as_array(func, param, value):
    """``value`` as a NumPy array of numbers (no copy where NumPy can avoid one)."""
    if type(value) is np.ndarray and value.dtype.kind in "biufc":  # the common case, first
        return value
    require(func, param, value)
    array = _from_torch(value)
    if array is None:
        try:
            array = np.asarray(value)
        except Exception as exc:  # noqa: BLE001 - anything NumPy cannot read is a bad argument
            fail(func, param, "must be convertible to a numeric numpy array", f"{type(value).__name__} ({exc})")
    if array.dtype.kind not in "biufcV" or array.dtype.kind == "V" and array.dtype.names is not None:
        fail(func, param, "must be a numeric array", describe(array))
    return array


def check_ndim(func, param, array, allowed):
    """``array.ndim`` must be one of ``allowed`` (a tuple of ints)."""
    if array.ndim not in allowed:
        need = " or ".join(f"{n}-D" for n in allowed)
        fail(func, param, f"must be {need}", f"{array.ndim}-D with shape {tuple(array.shape)}")


def check_dim(func, param, axis, actual, expected, why=""):
    """One dimension of an array must equal ``expected``; ``why`` explains where it comes from."""
    if actual != expected:
        reason = f" ({why})" if why else ""
        fail(func, f"{param}.shape[{axis}]", f"must be {expected}{reason}", actual)


def check_shape(func, param, actual, expected, why=""):
    """A whole shape must equal ``expected``."""
    actual, expected = tuple(actual), tuple(expected)
    if actual != expected:
        reason = f" ({why})" if why else ""
        fail(func, f"{param}.shape", f"must be {expected}{reason}", actual)


def check_dims_at_most(func, param, shape, limit=MAX_DIM_SIZE):
    """No dimension of ``shape`` may exceed ``limit`` (the documents' 2^20)."""
    for axis, size in enumerate(shape):
        if size > limit:
            fail(func, f"{param}.shape[{axis}]", f"must be at most {limit}", size)


def check_dtype(func, param, array, allowed):
    """``array.dtype`` must be in ``allowed`` (a tuple of NumPy dtypes)."""
    if array.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        fail(func, f"{param}.dtype", f"must be one of {names}", array.dtype)


def check_same_dtype(func, param, dtype, other_param, other_dtype):
    """``param``'s ``dtype`` must be ``other_dtype``, the dtype of ``other_param``."""
    if dtype != other_dtype:
        fail(func, f"{param}.dtype", f"must equal {other_param}.dtype ({other_dtype})", dtype)


def shape_or_array(func, param, value, allowed_ndim):
    """An argument that is either the forward input array or its shape.

    Returns ``(shape, dtype)``; ``dtype`` is None when a shape was given. A shape is told from a
    1-D integer array by type: tuples, lists and ``torch.Size`` are shapes; arrays are arrays.
    """
    require(func, param, value)
    if isinstance(value, (tuple, list)):
        shape = int_tuple(func, param, value, allowed_ndim)
        for axis, size in enumerate(shape):
            if size < 0:
                fail(func, f"{param}[{axis}]", "must be >= 0", size)
        return shape, None
    array = as_array(func, param, value)
    check_ndim(func, param, array, allowed_ndim)
    return tuple(int(s) for s in array.shape), array.dtype


def input_shape_like(func, input, grad_output, allowed_ndim):
    """The forward input's shape, from ``input`` given as that array or as its shape.

    Its rank must be in ``allowed_ndim`` and equal grad_output's; an array must also have
    grad_output's dtype (only its shape and dtype are used).
    """
    input_shape, input_dtype = shape_or_array(func, "input", input, allowed_ndim)
    ndim = len(input_shape)
    if grad_output.ndim != ndim:
        fail(
            func, "grad_output", f"must be {ndim}-D like input", f"{grad_output.ndim}-D with shape {grad_output.shape}"
        )
    if input_dtype is not None:
        check_same_dtype(func, "input", input_dtype, "grad_output", grad_output.dtype)
    return input_shape


# --------------------------------------------------------------------------------------------
# host-side scalars and sizes
# --------------------------------------------------------------------------------------------


def _is_integer(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def int_value(func, param, value):
    """A Python or NumPy integer (a bool, a float or anything else is an error)."""
    require(func, param, value)
    if not _is_integer(value):
        fail(func, param, "must be an integer", describe(value))
    return operator.index(value)


def int_tuple(func, param, value, lengths, *, scalar_repeats=None):
    """A sequence of integers whose length is in ``lengths``.

    With ``scalar_repeats=n`` a single integer is also accepted and repeated n times; a sequence
    of length 1 is repeated the same way.
    """
    require(func, param, value)
    if scalar_repeats is not None and _is_integer(value):
        return (operator.index(value),) * scalar_repeats
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            fail(func, param, "must be a sequence of integers", describe(value))
        value = value.tolist() if value.dtype.kind in "iu" else list(value)
    if not isinstance(value, (tuple, list)):
        fail(func, param, "must be a sequence of integers", describe(value))
    if len(value) not in lengths:
        need = " or ".join(str(n) for n in lengths)
        fail(func, param, f"must have length {need}", f"length {len(value)}: {describe(value)}")
    for index, item in enumerate(value):
        if not _is_integer(item):
            fail(func, f"{param}[{index}]", "must be an integer", describe(item))
    items = tuple(operator.index(item) for item in value)
    if scalar_repeats is not None and len(items) == 1:
        items = items * scalar_repeats
    return items


def float_value(func, param, value, *, none_is=None):
    """A real number (int or float, not a bool); ``None`` becomes ``none_is`` when given."""
    if value is None and none_is is not None:
        return float(none_is)
    require(func, param, value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        fail(func, param, "must be a real number", describe(value))
    return float(value)


def bool_value(func, param, value):
    """A bool (Python or NumPy); integers other than bools are rejected to catch swapped arguments."""
    require(func, param, value)
    if not isinstance(value, (bool, np.bool_)):
        fail(func, param, "must be a bool", describe(value))
    return bool(value)


def choice(func, param, value, options):
    """One of a fixed set of strings."""
    require(func, param, value)
    if not isinstance(value, str) or value not in options:
        fail(func, param, f"must be one of {', '.join(repr(o) for o in options)}", describe(value))
    return value


#: The ``layout=`` argument of every function (docs/semantics.md §0.1): the axis order of its
#: arrays, channels at axis 1 or last.
LAYOUTS = ("NCHW", "NHWC")


def layout(func, value, array=None, param="grad_output"):
    """A ``layout=`` argument: "NCHW" or "NHWC"; "NHWC" needs ``array`` (named ``param``) 4-D."""
    value = choice(func, "layout", value, LAYOUTS)
    if value == "NHWC" and array is not None and array.ndim != 4:
        fail(func, param, "must be 4-D with layout='NHWC'", f"{array.ndim}-D with shape {tuple(array.shape)}")
    return value


# --------------------------------------------------------------------------------------------
# pooling geometry (shared by avg_pool2d_backward; PyTorch's pooling_output_shape)
# --------------------------------------------------------------------------------------------


def pooling_output_size(input_size, kernel, stride, pad, ceil_mode):
    """Output length of one pooled axis (docs/semantics.md §2, PyTorch ``pooling_output_shape``, dilation 1)."""
    numerator = input_size + 2 * pad - kernel + ((stride - 1) if ceil_mode else 0)
    output_size = numerator // stride + 1
    # The last window must start inside the input or the left padding.
    if ceil_mode and (output_size - 1) * stride >= input_size + pad:
        output_size -= 1
    return output_size
