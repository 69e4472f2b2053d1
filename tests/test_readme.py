"""The README and the documentation's guides: every example runs as written, each block on its
own as a program that exits by itself; the README's two commands are the ones CI runs; its
numbers are the program's own; its headline table and the benchmarks page's full tables are
the saved run's."""

import json
import pathlib
import re

import pytest
from test_exit import warm_and_run

from bench import to_table
from fastbwd import _precompile

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

#: The pages whose Python blocks are programs a user runs as written (the reference pages'
#: examples are doctests: tests/test_docs.py).
PAGES = ["README.md"] + [f"docs/{name}.md" for name in ("getting-started", "numpy", "torch", "compile", "jax")]
BLOCKS = [
    (page, index, code)
    for page in PAGES
    for index, code in enumerate(re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S))
]


def test_readme_is_short():
    assert len(README.splitlines()) <= 250


def test_the_guides_have_examples():
    pages = {page for page, _, _ in BLOCKS}
    assert pages == set(PAGES)
    readme = [code for page, _, code in BLOCKS if page == "README.md"]
    # one minimal example per entry point
    for entry in ("import fastbwd\n", "import fastbwd.torch", "torch.compile(", "import fastbwd.jax"):
        assert any(entry in code for code in readme), entry


def _section_code(page, heading):
    """The first Python block after ``heading`` in ``page``."""
    text = (ROOT / page).read_text().split(heading, 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_numpy_guide_examples_run():
    namespace = {}
    code = _section_code("docs/numpy.md", "## Examples")
    exec(compile(code, "docs/numpy.md", "exec"), namespace)  # noqa: S102 - our own documentation
    dx, dgamma, dbeta = namespace["dx"], namespace["dgamma"], namespace["dbeta"]
    assert dx.shape == (2, 64, 16, 16) and dgamma.shape == dbeta.shape == (64,)


def test_pytorch_guide_example_runs():
    pytest.importorskip("torch")
    namespace = {}
    code = _section_code("docs/torch.md", "# PyTorch")
    exec(compile(code, "docs/torch.md", "exec"), namespace)  # noqa: S102 - our own documentation
    assert namespace["features"].grad.shape == (2, 256, 50, 76)
    assert namespace["ft"].is_enabled() is False  # the example's `with enabled():` block ended


def test_ci_runs_the_readme_test_command_and_the_slow_tests():
    commands = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    assert "python3 -m bench" in commands
    readme_set = re.search(r"&& python3 -m pytest(.*)$", commands, re.M).group(1).strip()
    assert readme_set == '-m "not slow"'
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install --quiet -e ".[test]"' in ci
    # the README's set, then its complement: every test runs in CI
    assert f"\npython -m pytest {readme_set}\npython -m pytest -m slow\n" in ci
    # the PyTorch releases CI installs are the ones the README says are tested
    releases = re.findall(r"pip install --quiet torch==(\S+)", ci)
    assert releases == ["2.13.0", "2.14.1"]
    assert f"tested with PyTorch {releases[0]} and {releases[1]}" in " ".join(README.split())


def test_ci_builds_the_site_as_the_readme_says():
    command = re.search(
        r"^(python3 -m pip install -e \"\.\[docs\]\" && python3 -m mkdocs build --strict)", README, re.M
    )
    assert command, "the README's command that builds the site"
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install --quiet -e ".[docs]"' in ci and "\npython -m mkdocs build --strict" in ci


def test_readme_counts_are_the_programs():
    """The kernel paths the README counts are those --precompile runs."""
    count = len(_precompile.TABLE)
    paths = int(re.search(r"compiles all (\d+) kernel paths", README).group(1))
    assert paths == count, f"README.md says {paths} kernel paths, --precompile runs {count}: say {count}"
    runtime = (ROOT / "docs" / "runtime.md").read_text()
    assert f"{count} kernel paths" in runtime, f"docs/runtime.md: say {count} kernel paths"


@pytest.mark.parametrize(
    "page, index",
    # a block that compiles with torch.compile takes a minute: the slow set's
    [
        pytest.param(page, index, marks=pytest.mark.slow) if "torch.compile(" in code else (page, index)
        for page, index, code in BLOCKS
    ],
)
def test_each_example_is_a_program_that_exits(page, index):
    """Each Python block, alone (its own imports), as a separate process with a time limit."""
    code = next(code for p, i, code in BLOCKS if (p, i) == (page, index))
    for framework in ("torch", "jax", "flax", "equinox"):
        if re.search(rf"^import .*\b{framework}\b", code, re.M):
            pytest.importorskip(framework)
    # torch.compile traces and loads its compiled code again in the child (Inductor's cache keeps
    # only the generated code): seconds, not the 30 s of a hang
    warm_and_run(code, limit=180 if "torch.compile(" in code else None)


def test_the_saved_run_carries_the_decided_targets():
    """Each operator row of bench/results.json carries its case's target in bench/cases.py, so a
    retired target is gone from the published tables rather than judged "missed" (the tables are
    regenerated from the saved rows: change a target there and in the saved run together)."""
    from bench.cases import OPS

    results = json.loads((ROOT / "bench" / "results.json").read_text())
    rows = [row for row in results["rows"] if row["op"] in OPS]
    assert rows
    for row in rows:
        (case,) = [c for c in OPS[row["op"]].cases if (c.id, c.dtype) == (row["case"], row["dtype"])]
        decided = case.targets.get(row["baseline"]) if row.get("baseline") else None
        assert row.get("target") == decided, (row["case"], row["variant"], row.get("target"), decided)


def test_benchmark_tables_are_the_saved_run():
    """The README's headline table and docs/benchmarks.md's full tables are exactly
    bench/to_table.py's of bench/results.json (regenerate them with `python bench/to_table.py
    bench/results.json --write README.md docs/benchmarks.md`, or rerun the whole benchmark with
    `python3 -m bench --full --publish`)."""
    results = json.loads((ROOT / "bench" / "results.json").read_text())
    assert not results["quick"], "the published tables come from a --full run"
    headline = to_table.region(README, to_table.HEADLINE_BEGIN, to_table.HEADLINE_END)
    assert headline == to_table.headline(results)
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert to_table.region(page, to_table.BEGIN, to_table.END) == to_table.table(results)
