"""Parallel ``@njit`` loop nests, one module per operator; no validation, no Python objects.

A kernel trusts its arguments completely (the api layer has checked every shape, value and
dtype); its docstring states which axis runs in parallel and what each iteration writes.
"""
