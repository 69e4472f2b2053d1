"""group_norm_swish_backward and group_norm_swish (the forward) benchmarks (docs/semantics.md §6 G1, G3; G1 in bfloat16 and NHWC), with the
PyTorch autograd path (F.group_norm then silu, backward) as the baseline when torch is installed,
and for G1 in NHWC fastbwd's own call on the same values in NCHW (issue 14 asks NHWC for at least
0.8x the NCHW speed; same benchmark group, so the two compare directly).

Minimum bytes per call: read x and dy, write dx. Run:
python -m pytest bench/bench_group_norm_swish.py --benchmark-enable --benchmark-only
"""

import pytest

from .benchutil import op_cases, prepared_case, standard_benchmarks

NAME = "group_norm_swish_backward"

bench_fastbwd, bench_fastbwd_out, bench_baseline = standard_benchmarks(NAME, baselines=["torch autograd"])


@pytest.mark.parametrize("baseline", ["fastbwd NCHW", "fastbwd NCHW out="])
@pytest.mark.parametrize(
    "case", [param for param in op_cases(NAME) if param.values[0].params.get("data_format") == "NHWC"]
)
def bench_nchw_of_nhwc_case(case, baseline, measure, smoke):
    """fastbwd on an NHWC case's values in NCHW (allocating, and out=)."""
    prepared = prepared_case(case, smoke=smoke)
    measure(case, prepared.baselines[baseline], prepared.nbytes, baseline)


# ---- the forward, group_norm_swish (docs/semantics.md §5.1): G1f, G3f (float32, bfloat16, NHWC)
# against nn.GroupNorm then nn.SiLU without autograd. Minimum bytes per call: read x, write y.

bench_forward, bench_forward_out, bench_forward_baseline = standard_benchmarks(
    "group_norm_swish", baselines=["torch GroupNorm+SiLU"]
)
