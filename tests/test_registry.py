"""The operators' registry is one registry: the package side (``fastbwd/_registry.py``: kernel
paths to precompile, the self-check) and the benchmark side (``bench/cases.py``) that extends
it; and ``python -m fastbwd`` is the self-check built from it."""

import subprocess
import sys

from bench.cases import OPS
from fastbwd import _precompile
from fastbwd.__main__ import SMALL_CHECKS
from fastbwd._registry import OPERATORS

from conftest import ROOT, child_environment


def test_the_benchmark_side_extends_every_checked_operator():
    assert set(OPS) == set(SMALL_CHECKS)
    for name, spec in OPS.items():
        assert spec.paths is OPERATORS[name].paths and spec.check is OPERATORS[name].check
        assert spec.paths and spec.cases and spec.quick_cases
        for case in spec.cases + spec.quick_cases:
            assert case.op == name
            smoke = spec.smoke_case(case)
            assert (smoke.id, smoke.dtype, smoke.label) == (case.id, case.dtype, case.label)


def test_the_precompile_table_is_the_registrys_paths():
    assert [(e.op, e.layout, e.path) for e in _precompile.TABLE] == [
        (op.name, path.layout, path.name) for op in OPERATORS.values() for path in op.paths for _ in path.dtypes
    ]


def test_self_check_prints_one_line_per_operator():
    done = subprocess.run(
        [sys.executable, "-m", "fastbwd"],
        capture_output=True,
        text=True,
        env=child_environment(),
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()[1:]
    assert [line.split()[0] for line in lines] == list(SMALL_CHECKS)
    assert all("matches the float64 reference" in line for line in lines)
