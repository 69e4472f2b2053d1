"""avg_pool2d_backward benchmarks (docs/semantics.md §6 A1-A3, A1 in bfloat16 and channels-last), with PyTorch
rows when torch is installed.

Run: python -m pytest bench/bench_avg_pool2d.py --benchmark-enable --benchmark-only
"""

from .benchutil import standard_benchmarks

bench_fastbwd, bench_fastbwd_out, bench_baseline = standard_benchmarks(
    "avg_pool2d_backward", baselines=["torch", "torch out="]
)
