"""The README's examples run as written, each block on its own as a program that exits by
itself, its two commands are the ones CI runs, and its benchmark tables are the saved run's."""

import json
import pathlib
import re

import pytest
from test_exit import warm_and_run

from bench import to_table

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_examples_run():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Examples", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own documentation
    dx, dgamma, dbeta = namespace["dx"], namespace["dgamma"], namespace["dbeta"]
    assert dx.shape == (2, 64, 16, 16) and dgamma.shape == dbeta.shape == (64,)


def test_readme_pytorch_example_runs():
    pytest.importorskip("torch")
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## PyTorch", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own documentation
    assert namespace["features"].grad.shape == (2, 256, 50, 76)
    assert namespace["ft"].is_enabled() is False  # the example's `with enabled():` block ended


def test_ci_runs_the_readme_test_command_and_the_slow_tests():
    readme = (ROOT / "README.md").read_text()
    commands = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    assert "python3 -m bench" in commands
    readme_set = re.search(r"&& python3 -m pytest(.*)$", commands, re.M).group(1).strip()
    assert readme_set == '-m "not slow"'
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install --quiet -e ".[test]"' in ci
    # the README's set, then its complement: every test runs in CI
    assert f"\npython -m pytest {readme_set}\npython -m pytest -m slow\n" in ci


@pytest.mark.parametrize(
    "index",
    # a block that compiles with torch.compile takes a minute: the slow set's
    [pytest.param(i, marks=pytest.mark.slow) if "torch.compile" in b else i for i, b in enumerate(BLOCKS)],
)
def test_each_readme_block_is_a_program_that_exits(index):
    """Each Python block, alone (its own imports), as a separate process with a time limit."""
    code = BLOCKS[index]
    for framework in ("torch", "jax", "flax", "equinox"):
        if re.search(rf"^import .*\b{framework}\b", code, re.M):
            pytest.importorskip(framework)
    # torch.compile traces and loads its compiled code again in the child (Inductor's cache keeps
    # only the generated code): seconds, not the 30 s of a hang
    warm_and_run(code, limit=180 if "torch.compile" in code else None)


def test_readme_benchmark_tables_are_the_saved_run():
    """The README's tables are exactly bench/to_table.py's of bench/results.json (regenerate them
    with `python bench/to_table.py bench/results.json --readme README.md`, or rerun the whole
    benchmark with `python3 -m bench --full --publish`)."""
    results = json.loads((ROOT / "bench" / "results.json").read_text())
    assert to_table.tables_in((ROOT / "README.md").read_text()) == to_table.table(results)
    assert not results["quick"], "the README's tables come from a --full run"
