"""upsample_bilinear2d_backward benchmarks (SPEC §6 U1-U6), with PyTorch rows when torch is installed.

Run: python -m pytest bench/bench_upsample_bilinear2d.py --benchmark-enable --benchmark-only
"""

import pytest

from benchutil import op_cases, prepared_case

CASES = op_cases("upsample_bilinear2d_backward")


@pytest.mark.parametrize("case", CASES)
def bench_fastbwd(case, measure):
    prepared = prepared_case(case)
    measure(case, prepared.run, prepared.nbytes, "fastbwd")


@pytest.mark.parametrize("case", CASES)
def bench_fastbwd_out(case, measure):
    prepared = prepared_case(case)
    measure(case, prepared.run_out, prepared.nbytes, "fastbwd out=")


@pytest.mark.parametrize("case", CASES)
def bench_torch(case, measure):
    pytest.importorskip("torch")
    prepared = prepared_case(case, with_torch=True)
    if "torch" not in prepared.torch:
        pytest.skip(f"no torch baseline for {case.dtype}")
    measure(case, prepared.torch["torch"], prepared.nbytes, "torch")
