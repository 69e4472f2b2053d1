"""upsample_bilinear2d_backward benchmarks (docs/semantics.md §6 U1-U6), with PyTorch rows when torch is installed.

Run: python -m pytest bench/bench_upsample_bilinear2d.py --benchmark-enable --benchmark-only
"""

from .benchutil import standard_benchmarks

bench_fastbwd, bench_fastbwd_out, bench_baseline = standard_benchmarks(
    "upsample_bilinear2d_backward", baselines=["torch"]
)
