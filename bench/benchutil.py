"""Helpers for bench/bench_*.py: the operator's cases as pytest parameters, prepared inputs, and
the standard benchmark functions every operator has."""

import numba
import pytest

from .cases import OPS


def case_id(case):
    return f"{case.id}-{case.dtype}"


def _layout(case):
    return "channels-last" if case.id.endswith(("-NHWC", "-CL")) else "NCHW"


def op_cases(name):
    """pytest parameters for every canonical case of the operator ``name``; as a smoke run, the
    first float32 case of each layout in the quick set, the others in the slow set (each dtype
    compiles the kernels again, each case adds a path; docs/testing.md)."""
    quick = {}
    for case in OPS[name].cases:
        if case.dtype == "float32":
            quick.setdefault(_layout(case), case)
    return [
        pytest.param(case, id=case_id(case), marks=() if quick.get(_layout(case)) is case else pytest.mark.slow)
        for case in OPS[name].cases
    ]


_PREPARED = {}


def prepared_case(case, with_torch=False, smoke=False):
    """The case's Prepared (at the smoke run's size when ``smoke``), built once per case, size and
    baseline set (the last few are kept)."""
    key = (case.op, case.id, case.dtype, case.label, smoke, with_torch)
    if key not in _PREPARED:
        while len(_PREPARED) >= 2:  # canonical inputs are large: keep memory bounded
            _PREPARED.pop(next(iter(_PREPARED)))
        spec = OPS[case.op]
        _PREPARED[key] = spec.prepare(spec.smoke_case(case) if smoke else case, with_torch)
    return _PREPARED[key]


def standard_benchmarks(name, baselines):
    """``(bench_fastbwd, bench_fastbwd_out, bench_baseline)`` for the operator ``name``: the
    allocating call, the ``out=`` call, and each named baseline of ``cases.py`` (skipped when torch
    is missing or the case has no such baseline), PyTorch on fastbwd's thread count."""
    cases = op_cases(name)

    @pytest.mark.parametrize("case", cases)
    def bench_fastbwd(case, measure, smoke):
        prepared = prepared_case(case, smoke=smoke)
        measure(case, prepared.run, prepared.nbytes, "fastbwd")

    @pytest.mark.parametrize("case", cases)
    def bench_fastbwd_out(case, measure, smoke):
        prepared = prepared_case(case, smoke=smoke)
        measure(case, prepared.run_out, prepared.nbytes, "fastbwd out=")

    @pytest.mark.parametrize("baseline", baselines)
    @pytest.mark.parametrize("case", cases)
    def bench_baseline(case, baseline, measure, smoke):
        torch = pytest.importorskip("torch")
        torch.set_num_threads(numba.get_num_threads())  # same thread count as fastbwd
        prepared = prepared_case(case, with_torch=True, smoke=smoke)
        if baseline not in prepared.baselines:
            pytest.skip(f"no {baseline!r} baseline for {case.id} {case.dtype}")
        measure(case, prepared.baselines[baseline], prepared.nbytes, baseline)

    return bench_fastbwd, bench_fastbwd_out, bench_baseline
