"""replication_pad2d_backward benchmarks (docs/semantics.md §6 P1), with PyTorch rows when torch is installed.

Run: python -m pytest bench/bench_replication_pad2d.py --benchmark-enable --benchmark-only
"""

from .benchutil import standard_benchmarks

bench_fastbwd, bench_fastbwd_out, bench_baseline = standard_benchmarks(
    "replication_pad2d_backward", baselines=["torch", "torch out="]
)
