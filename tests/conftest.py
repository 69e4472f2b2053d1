"""What the test files share: the dtypes, random arrays and channels-last copies
(``from conftest import ...``)."""

import ml_dtypes
import numpy as np
import pytest

from fastbwd._registry import channels_last  # noqa: F401 - the one definition, shared with the tests
from fastbwd.api import _plans

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
