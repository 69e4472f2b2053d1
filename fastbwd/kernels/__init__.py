"""Parallel ``@njit`` loop nests, one module per operator; no validation, no Python objects.

A kernel trusts its arguments completely (the api layer has checked every shape, value and
dtype); its docstring states which axis runs in parallel and what each iteration writes. Each
operator's module exposes ``Geometry`` and ``plan(geometry)`` (docs/design.md, "The one
contract"); what the rest of the package needs besides is named here.
"""

from ._halfbits import BFLOAT16, FLOAT16, NATIVE, StorageFormat
from ._jit import force_launches, get_num_threads, set_num_threads, thread_count, threading_layer

__all__ = [
    "StorageFormat",
    "NATIVE",
    "FLOAT16",
    "BFLOAT16",
    "force_launches",
    "get_num_threads",
    "set_num_threads",
    "thread_count",
    "threading_layer",
]
