"""Helpers for bench/bench_*.py: the operator's cases as pytest parameters, prepared inputs, and
the standard benchmark functions every operator has."""

import numba
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


def standard_benchmarks(name, baselines):
    """``(bench_fastbwd, bench_fastbwd_out, bench_baseline)`` for the operator ``name``: the
    allocating call, the ``out=`` call, and each named baseline of ``cases.py`` (skipped when torch
    is missing or the case has no such baseline), PyTorch on fastbwd's thread count."""
    cases = op_cases(name)

    @pytest.mark.parametrize("case", cases)
    def bench_fastbwd(case, measure):
        prepared = prepared_case(case)
        measure(case, prepared.run, prepared.nbytes, "fastbwd")

    @pytest.mark.parametrize("case", cases)
    def bench_fastbwd_out(case, measure):
        prepared = prepared_case(case)
        measure(case, prepared.run_out, prepared.nbytes, "fastbwd out=")

    @pytest.mark.parametrize("baseline", baselines)
    @pytest.mark.parametrize("case", cases)
    def bench_baseline(case, baseline, measure):
        torch = pytest.importorskip("torch")
        torch.set_num_threads(numba.get_num_threads())  # same thread count as fastbwd
        prepared = prepared_case(case, with_torch=True)
        if baseline not in prepared.baselines:
            pytest.skip(f"no {baseline!r} baseline for {case.id} {case.dtype}")
        measure(case, prepared.baselines[baseline], prepared.nbytes, baseline)

    return bench_fastbwd, bench_fastbwd_out, bench_baseline
