"""The README and the documentation's guides: every example runs as written, each block on its
own as a program that exits by itself; the README's two commands are the ones CI runs; its
numbers are the program's own; its headline table and the benchmarks page's full tables are
the saved run's."""

import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

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


def test_the_readme_names_every_extra_and_the_examples_say_which_they_need():
    """Each extra of pyproject.toml is named in the README with what it adds; an example that
    imports a library the README's install line leaves out says which extra brings it."""
    extras = re.search(r"\[project\.optional-dependencies\]\n(.*?)\n\[", (ROOT / "pyproject.toml").read_text(), re.S)
    names = re.findall(r"^(\w+) = \[", extras.group(1), re.M)
    assert set(names) == {"test", "torch", "jax", "flax", "equinox", "docs"}, names
    for name in names:
        assert f"`[{name}]`" in README, f"README.md: name the [{name}] extra and what it adds"
    installed = _readme_commands().command("test")
    for code in re.findall(r"```python\n(.*?)```", README, re.S):
        before = README[: README.index(code)][-400:]
        for library in ("torch", "jax", "flax", "equinox"):
            if re.search(rf"^import .*\b{library}\b", code, re.M) and f"{library}==" not in installed:
                assert f"`[{library}]`" in before, f"README.md: say which extra the example importing {library} needs"


def test_pytorch_guide_example_runs():
    pytest.importorskip("torch")
    namespace = {}
    code = _section_code("docs/torch.md", "# PyTorch")
    exec(compile(code, "docs/torch.md", "exec"), namespace)  # noqa: S102 - our own documentation
    assert namespace["features"].grad.shape == (2, 256, 50, 76)
    assert namespace["ft"].is_enabled() is False  # the example's `with enabled():` block ended


def _readme_commands():
    """.ci/readme_commands.py, the module CI reads the README's commands with."""
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / ".ci" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_commands_ci_reads_are_the_readmes_lines():
    """The lines .ci/readme_commands.py prints are lines of the README's bash blocks, whole
    (their comments aside): the install line and the test command, and the docs site's build."""
    commands = _readme_commands()
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", README, re.S)).splitlines()
    for name in ("test", "main", "docs"):
        line = commands.command(name)
        assert any(whole.split("  #", 1)[0].strip() == line for whole in blocks), (name, line)
    install, test = commands.command("test").split(" && ")
    assert install.startswith('python3 -m pip install -e ".[test]" ') and test == 'python3 -m pytest -m "not slow"'
    with pytest.raises(LookupError, match="no test command"):
        commands.command("test", "```bash\npython3 -m pytest\n```\n")


def test_ci_runs_the_readme_as_written_first_then_every_test():
    """.ci/run's first steps are a fresh virtual environment and the README's install line and
    test command, read from the README (not copied: they cannot drift), before anything else is
    installed into it; then the extras and every test the README's run did not pass (no marker
    chosen: the slow set and the quick tests an extra enables), so every test runs in CI."""
    ci = (ROOT / ".ci" / "run").read_text()
    steps = [line for line in ci.splitlines() if line and not line.startswith((" ", "#", "}"))]
    venv = steps.index("python3 -m venv .venv")
    readme_run = 'PYTHONPATH="$PWD/.ci" PYTEST_ADDOPTS="-p ran_tests --record-ran=$RAN" readme test'
    assert steps[venv + 1 : venv + 4] == [". .venv/bin/activate", 'phase "the README\'s test command"', readme_run]
    assert 'line="$(python3 .ci/readme_commands.py "$1")"' in ci and 'bash -euo pipefail -c "$line"' in ci
    # before it only the second PyTorch's environment, in the background, into a venv of its own
    before = [step for step in steps[:venv] if "pip install" in step or "activate" in step]
    assert before == [], before
    assert ci.index(". .venv-torch2.14/bin/activate") < ci.index("python3 -m venv .venv\n")
    after_docs = steps[steps.index("readme docs") :]
    rest = 'PYTHONPATH="$PWD/.ci" python -m pytest -p ran_tests --skip-ran="$RAN" -n 2'
    assert rest in after_docs  # no marker chosen: every test the README's run did not pass
    # the extras the README's install leaves out, into the same environment, after its test command
    extras = next(step for step in steps if "[flax,equinox]" in step)
    assert venv + 3 < steps.index(extras) < steps.index(rest)
    # the PyTorch releases CI installs (the README's line, then the second environment's) are the
    # ones the README says are tested
    releases = re.findall(r"torch==(\d\S*)", _readme_commands().command("test") + "\n" + ci)
    assert releases == ["2.13.0", "2.14.1"], releases
    assert f"tested with PyTorch {releases[0]} and {releases[1]}" in " ".join(README.split())


def test_ci_runs_each_test_once(tmp_path):
    """.ci/ran_tests.py, with the options as .ci/run writes them: the README's run (the option
    through the environment) lists the tests that passed, with the node ids of a run from the
    project's root (a path among the options would move pytest's rootdir), and hides the option
    from the tests' own child processes; the run with every extra deselects exactly those."""
    ci = (ROOT / ".ci" / "run").read_text()
    record = re.search(r'PYTEST_ADDOPTS="([^"]*)" readme test', ci).group(1)
    skip = re.search(r"python -m pytest (-p ran_tests [^\n]*) -n 2", ci).group(1)
    project, ran = tmp_path / "project", tmp_path / "ci" / "ran.txt"
    project.mkdir()
    ran.parent.mkdir()
    ran.write_text("")  # .ci/run's mktemp: the file exists from the start
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "test_cases.py").write_text(
        "import os, subprocess, sys\n"
        "import pytest\n"
        "def test_passes():\n"
        '    child = \'import os; print(os.environ.get("PYTEST_ADDOPTS"), os.environ.get("PYTHONPATH"))\'\n'
        "    assert subprocess.run([sys.executable, '-c', child], capture_output=True, text=True).stdout == 'None None\\n'\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_needs_an_extra(n):\n"
        "    if 'EXTRA' not in os.environ:\n"
        "        pytest.skip('the extra is not installed')\n"
        "def test_fails_first():\n"
        "    assert 'EXTRA' in os.environ\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT / ".ci")

    def pytest_run(args=(), **variables):
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
        return subprocess.run(command, cwd=project, env={**env, **variables}, capture_output=True, text=True)

    first = pytest_run(PYTEST_ADDOPTS=record.replace("$RAN", str(ran)))
    assert "1 failed, 1 passed, 2 skipped" in first.stdout, first.stdout + first.stderr
    assert f"rootdir: {project}" in first.stdout
    assert ran.read_text() == "test_cases.py::test_passes\n"
    second = pytest_run(shlex.split(skip.replace("$RAN", str(ran))), EXTRA="1")
    assert "3 passed, 1 deselected" in second.stdout, second.stdout + second.stderr
    assert f"rootdir: {project}" in second.stdout
    assert ran.read_text() == "test_cases.py::test_passes\n"  # recorded only when asked


def test_ci_builds_the_site_as_the_readme_says():
    command = re.search(
        r"^(python3 -m pip install -e \"\.\[docs\]\" && python3 -m mkdocs build --strict)", README, re.M
    )
    assert command, "the README's command that builds the site"
    assert _readme_commands().command("docs") == command.group(1)
    assert "\nreadme docs\n" in (ROOT / ".ci" / "run").read_text()


def test_readme_counts_are_the_programs():
    """The kernel paths the README and docs/runtime.md count are those --precompile runs: by
    default (float32) and with --dtypes all."""
    count = len(_precompile.TABLE)
    default = len(_precompile.select(dtypes=_precompile.DEFAULT_DTYPES))
    paths = int(re.search(r"`--dtypes all`:\s+all (\d+) kernel paths", README).group(1))
    assert paths == count, f"README.md says {paths} kernel paths, --precompile runs {count}: say {count}"
    runtime = (ROOT / "docs" / "runtime.md").read_text()
    assert f"{count} kernel paths" in runtime, f"docs/runtime.md: say {count} kernel paths"
    assert f"float32 kernel path\nof every operator and layout into the cache: {default} kernel paths" in runtime


@pytest.mark.parametrize(
    "page, index",
    # the README's blocks, what a newcomer runs first, are the quick set's (a block that compiles with
    # torch.compile takes a minute: the slow set's); the guides' are the slow set's
    [
        pytest.param(page, index, marks=pytest.mark.slow)
        if "torch.compile(" in code or page != "README.md"
        else (page, index)
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
        decided = case.targets.get(row.get("baseline"))  # the key None: a %-of-copy target without a baseline
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
