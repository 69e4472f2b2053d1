"""Helpers for bench/bench_*.py: the operator's cases as pytest parameters, prepared inputs."""

import pytest

from fastbwd.testing.cases import OPS


def case_id(case):
    return f"{case.id}-{case.dtype}"


def op_cases(name):
    """pytest parameters for every canonical case of the operator ``name``."""
    return [pytest.param(case, id=case_id(case)) for case in OPS[name].cases]


_PREPARED = {}


def prepared_case(case, with_torch=False):
    """The case's Prepared, built once per case and baseline set (the last few are kept)."""
    key = (case.op, case.id, case.dtype, case.label, with_torch)
    if key not in _PREPARED:
        while len(_PREPARED) >= 2:  # canonical inputs are large: keep memory bounded
            _PREPARED.pop(next(iter(_PREPARED)))
        _PREPARED[key] = OPS[case.op].prepare(case, with_torch)
    return _PREPARED[key]
