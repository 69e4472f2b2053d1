"""fastbwd's benchmark harness, beside the package (not installed): the main job
(``python3 -m bench`` from the checkout), the case registry the benchmarks and tests share
(``bench/cases.py``, which extends the package's ``fastbwd/_registry.py``), PyTorch and JAX
baselines, and the pytest-benchmark files ``bench_*.py``."""
