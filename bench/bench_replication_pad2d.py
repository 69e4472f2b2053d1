"""replication_pad2d_backward benchmarks (SPEC §6 P1), with PyTorch rows when torch is installed.

Run: python -m pytest bench/bench_replication_pad2d.py --benchmark-enable --benchmark-only
"""

import pytest

from benchutil import op_cases, prepared_case

CASES = op_cases("replication_pad2d_backward")


@pytest.mark.parametrize("case", CASES)
def bench_fastbwd(case, measure):
    prepared = prepared_case(case)
    measure(case, prepared.run, prepared.nbytes, "fastbwd")


@pytest.mark.parametrize("case", CASES)
def bench_fastbwd_out(case, measure):
    prepared = prepared_case(case)
    measure(case, prepared.run_out, prepared.nbytes, "fastbwd out=")


@pytest.mark.parametrize("baseline", ["torch", "torch out="])
@pytest.mark.parametrize("case", CASES)
def bench_torch(case, baseline, measure):
    pytest.importorskip("torch")
    prepared = prepared_case(case, with_torch=True)
    if baseline not in prepared.torch:
        pytest.skip(f"no {baseline} baseline for {case.dtype}")
    measure(case, prepared.torch[baseline], prepared.nbytes, baseline)
