"""group_norm_swish_backward benchmarks (docs/semantics.md §6 G1, G3; G1 in bfloat16 and NHWC), with the
PyTorch autograd path (F.group_norm then silu, backward) as the baseline when torch is installed.

Minimum bytes per call: read x and dy, write dx. Run:
python -m pytest bench/bench_group_norm_swish.py --benchmark-enable --benchmark-only
"""

from benchutil import standard_benchmarks

bench_fastbwd, bench_fastbwd_out, bench_baseline = standard_benchmarks(
    "group_norm_swish_backward", baselines=["torch autograd"])
