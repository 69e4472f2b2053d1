"""avg_pool2d_backward benchmarks (SPEC §6 A1-A3, A1 in bfloat16 and channels-last), with PyTorch
rows when torch is installed.

Run: python -m pytest bench/bench_avg_pool2d.py --benchmark-enable --benchmark-only
"""

import numba
import pytest

from benchutil import op_cases, prepared_case

CASES = op_cases("avg_pool2d_backward")


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
    torch = pytest.importorskip("torch")
    torch.set_num_threads(numba.get_num_threads())  # same thread count as fastbwd
    prepared = prepared_case(case, with_torch=True)
    if baseline not in prepared.torch:
        pytest.skip(f"no {baseline} baseline for {case.dtype}")
    measure(case, prepared.torch[baseline], prepared.nbytes, baseline)
