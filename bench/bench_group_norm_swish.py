"""group_norm_swish_backward benchmarks (SPEC §6 G1, G3; G1 in bfloat16 and NHWC), with the
PyTorch autograd path (F.group_norm then silu, backward) as the baseline when torch is installed.

Minimum bytes per call: read x and dy, write dx. Run:
python -m pytest bench/bench_group_norm_swish.py --benchmark-enable --benchmark-only
"""

import numba
import pytest

from benchutil import op_cases, prepared_case

CASES = op_cases("group_norm_swish_backward")


@pytest.mark.parametrize("case", CASES)
def bench_fastbwd(case, measure):
    prepared = prepared_case(case)
    measure(case, prepared.run, prepared.nbytes, "fastbwd")


@pytest.mark.parametrize("case", CASES)
def bench_fastbwd_out(case, measure):
    prepared = prepared_case(case)
    measure(case, prepared.run_out, prepared.nbytes, "fastbwd out=")


@pytest.mark.parametrize("case", CASES)
def bench_torch_autograd(case, measure):
    torch = pytest.importorskip("torch")
    prepared = prepared_case(case, with_torch=True)
    if "torch autograd" not in prepared.torch:
        pytest.skip(f"no PyTorch baseline for {case.label}")
    torch.set_num_threads(numba.get_num_threads())  # same thread count as fastbwd
    measure(case, prepared.torch["torch autograd"], prepared.nbytes, "torch autograd")
