"""What the test files share: the dtypes, random arrays, channels-last copies, the thread-count
determinism check, the error matcher and child processes of this checkout (their environment, a
program run in one) (``from conftest import ...``); input builders shared with the benchmarks
come from ``bench/inputs.py``."""

import contextlib
import functools
import os
import re
import subprocess
import sys
import warnings

# The tests check fastbwd's paths on small inputs, which the policy "auto" leaves to PyTorch's and
# JAX's own code: they run under "always" (every call fastbwd can serve, as before issue 52)
# unless FASTBWD_POLICY says otherwise; the tests of the decision set "auto" themselves.
os.environ.setdefault("FASTBWD_POLICY", "always")

import ml_dtypes
import numba
import numpy as np
import pytest

from bench.inputs import channels_last  # noqa: F401 - the one definition, shared with the benchmarks
from fastbwd._errors import ACLNN_ERR_PARAM_INVALID, ParamError
from fastbwd.api import _plans
from fastbwd.testing.checks import bitwise_equal

from _covering import mark_outside_the_cover


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """The quick set of each test marked ``covering``: a cover of its cases, the others marked
    slow (tests/_covering.py), before ``-m "not slow"`` deselects them."""
    mark_outside_the_cover(items)


#: This checkout's root (the folder holding fastbwd/, tests/ and bench/).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_environment(*, tests=False, without=(), **variables):
    """The environment of a child Python process that must import this checkout's fastbwd, not
    an installed one (the mutation check runs copies of the tree): this process's, without the
    variables named in ``without``, with ``variables`` set, and this checkout first on
    PYTHONPATH (then tests/ when ``tests``, for the child's ``from conftest import ...``; then
    the entries already there). The child is not one of pytest-xdist's workers (CI runs the slow
    set in two): pytest-benchmark in a child pytest would take it for one."""
    without = {*without, *(name for name in os.environ if name.startswith("PYTEST_XDIST_"))}
    environment = {name: value for name, value in os.environ.items() if name not in without}
    environment.update(variables)
    first = [ROOT, os.path.join(ROOT, "tests")] if tests else [ROOT]
    rest = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    environment["PYTHONPATH"] = os.pathsep.join(first + rest)
    return environment


def run_program(program, folder, timeout=600):
    """``program`` (Python source) in a new process in ``folder``, importing this checkout's
    fastbwd (:func:`child_environment`): the finished process, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=folder,
        env=child_environment(),
    )


BF16 = np.dtype(ml_dtypes.bfloat16)
#: The real floating dtypes every operator accepts.
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16]
#: replication_pad2d_backward also takes complex gradients.
COMPLEX = [np.dtype(np.complex64), np.dtype(np.complex128)]


def random(shape, dtype, seed):
    """Standard-normal values in ``dtype`` from ``seed`` (complex: an imaginary part too)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        values = values + 1j * rng.standard_normal(shape)
    return values.astype(dtype)


def with_signed_nan(array, seed, where=None):
    """A copy of ``array`` with NaN of both signs and infinities in about one cell of 12 (of the
    cells ``where`` selects, if given; at least four of them): -NaN, NaN, -inf, inf in turn."""
    rng = np.random.default_rng(seed)
    values = np.array(array, np.float64)
    allowed = np.ones(values.shape, bool) if where is None else np.broadcast_to(where, values.shape)
    picked = np.flatnonzero(allowed & (rng.random(values.shape) < 1 / 12))
    if picked.size < 4:
        picked = np.flatnonzero(allowed)[:4]
    values.reshape(-1)[picked] = np.resize([-np.nan, np.nan, -np.inf, np.inf], picked.size)
    return values.astype(array.dtype)


def has_the_bits_of(values, number):
    """Elementwise: whether each of ``values`` has the bits of ``number`` in their dtype (a NaN's
    sign and payload included; ``np.nan`` is the quiet NaN of positive sign)."""
    values = np.asarray(values)
    bits = np.dtype(f"u{values.dtype.itemsize}")
    return values.view(bits) == np.array(number, values.dtype).view(bits)


def nan_cells_are_the_positive_nan(result):
    """Whether every NaN of ``result`` is the quiet NaN of positive sign (and there is one)."""
    nan = np.isnan(result.astype(np.float64))
    return bool(nan.any()) and bool(has_the_bits_of(result[nan], np.nan).all())


def to_nhwc(array):
    """An NCHW-family array's values as a C-contiguous NHWC array (channels moved last)."""
    return np.ascontiguousarray(np.moveaxis(array, 1, -1))


@pytest.fixture
def replan():
    """For a test that patches a constant the plans read (a streaming floor, a task size): call
    it after each patch, so that the next calls plan afresh; every plan is forgotten after the
    test too, so that none made under a patched value outlives it."""
    _plans.forget_all()
    yield _plans.forget_all
    _plans.forget_all()


def thread_counts():
    """The thread counts to compare: 1, 2, 3 (an odd count: uneven shares of the tasks) and the
    most this process may use (``NUMBA_NUM_THREADS``), as far as they are available.

    With ``NUMBA_NUM_THREADS=2`` (a 2-core machine) that is only 1 and 2: tests/test_runtime.py
    therefore also runs every operator in a subprocess with ``NUMBA_NUM_THREADS=4``, more
    threads than cores, comparing 1, 2, 3 and 4."""
    maximum = numba.config.NUMBA_NUM_THREADS
    return sorted({1, 2, 3, maximum} & set(range(1, maximum + 1)))


def assert_thread_invariant(call):
    """``call()`` gives bitwise identical results for every thread count (tuples allowed).

    Small calls normally run the serial twins on the calling thread; here every call runs the
    parallel kernels on the thread count being checked, however small its input."""
    previous = numba.get_num_threads()
    results = {}
    try:
        with _plans.launching("parallel"):
            for count in thread_counts():
                numba.set_num_threads(count)
                result = call()
                results[count] = result if isinstance(result, tuple) else (result,)
    finally:
        numba.set_num_threads(previous)
    first_count, first = next(iter(results.items()))
    for count, result in results.items():
        for index, (x, y) in enumerate(zip(first, result)):
            if x is None and y is None:
                continue
            assert bitwise_equal(x, y), f"result {index} differs between {first_count} and {count} threads"


@contextlib.contextmanager
def raises_param_error(match, *, status=ACLNN_ERR_PARAM_INVALID, param=None):
    """Expect a ParamError whose message matches ``match`` (a regex), with the given status/param."""
    try:
        yield
    except ParamError as error:
        message = str(error)
        assert re.search(match, message), f"message {message!r} does not match {match!r}"
        assert error.status == status, f"status {error.status} != {status} ({message})"
        if param is not None:
            assert error.param == param, f"param {error.param!r} != {param!r} ({message})"
        assert isinstance(error, ValueError) and isinstance(error, TypeError)
    else:
        raise AssertionError(f"no ParamError raised (expected one matching {match!r})")


def pytorch_deprecation(api):
    """What a test calling PyTorch's deprecated ``api`` (``"torch.jit.script"`` or
    ``"torch.jit.trace"``) expects: ``pytest.warns`` of the warning PyTorch gives each call, on
    the releases that give one (2.13: a DeprecationWarning, 2.14: a FutureWarning), nothing on
    older ones; the API's own parts too (tracing a module warns of ``torch.jit.trace_method``).
    Any other warning still fails the test."""
    category = _deprecation_category(api)
    if category is None:
        return contextlib.nullcontext()
    return pytest.warns(category, match=rf"^`{re.escape(api)}\w*` is")


@functools.cache
def _deprecation_category(api):
    """The category of the warning ``api`` gives on a trivial function, or None: asked of the
    installed PyTorch once (the release, not its version string, says whether it warns)."""
    import torch

    def trivial(x: torch.Tensor) -> torch.Tensor:
        return x

    calls = {
        "torch.jit.script": lambda: torch.jit.script(trivial),
        "torch.jit.trace": lambda: torch.jit.trace(trivial, torch.zeros(1)),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls[api]()
    categories = [w.category for w in caught if str(w.message).startswith(f"`{api}` is")]
    return categories[0] if categories else None
