"""The documentation site's API reference: every public name of fastbwd, fastbwd.torch and
fastbwd.jax has its page (generated from its docstring by mkdocstrings) in the site's nav; the
NumPy functions' docstrings have every section a reference page shows, and their examples run
(doctest). `.ci/run` builds the site itself with `mkdocs build --strict`."""

import doctest
import pathlib
import re

import pytest

import fastbwd

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"

#: The functions of the NumPy API, whose docstrings (fastbwd/api/) are the reference pages.
FUNCTIONS = [
    "upsample_bilinear2d_backward",
    "avg_pool2d_backward",
    "replication_pad2d_backward",
    "roi_align_backward",
    "group_norm_swish_backward",
    "group_norm_swish",
]


def public_names(module_name):
    """The names ``__all__`` of ``module_name`` exports (read from its source: torch and jax need
    not be installed), without ``__version__``."""
    path = ROOT / pathlib.Path(*module_name.split(".")) / "__init__.py"
    names = re.search(r"__all__ = \[(.*?)\]", path.read_text(), re.S).group(1)
    return [name for name in re.findall(r'"(\w+)"', names) if name != "__version__"]


@pytest.mark.parametrize("module_name", ["fastbwd", "fastbwd.torch", "fastbwd.jax"])
def test_every_public_name_has_a_reference_page_in_the_nav(module_name):
    nav = (ROOT / "mkdocs.yml").read_text()
    index = (REFERENCE / "index.md").read_text()
    for name in public_names(module_name):
        page = REFERENCE / f"{module_name}.{name}.md"
        assert page.exists(), f"add {page.relative_to(ROOT)} holding the line '::: {module_name}.{name}'"
        assert page.read_text().strip() == f"::: {module_name}.{name}"
        assert f"reference/{module_name}.{name}.md" in nav, f"add {page.name} to mkdocs.yml's nav"
        assert f"({module_name}.{name}.md)" in index, f"link {page.name} from docs/reference/index.md"
    pages = {page.stem for page in REFERENCE.glob(f"{module_name}.*.md") if page.stem.count(".") == module_name.count(".") + 1}  # fmt: skip
    assert pages == {f"{module_name}.{name}" for name in public_names(module_name)}, "a page of no public name"


@pytest.mark.parametrize("name", FUNCTIONS)
def test_the_numpy_functions_docstrings_have_every_section(name):
    doc = getattr(fastbwd, name).__doc__
    for section in ("Parameters", "Returns", "Raises", "Examples"):
        assert f"\n    {section}\n    {'-' * len(section)}\n" in doc, f"{name}: no {section} section"
    assert "docs/semantics.md §" in doc  # where the exact semantics are


@pytest.mark.parametrize("name", FUNCTIONS)
def test_the_docstring_examples_run(name):
    function = getattr(fastbwd, name)
    tests = doctest.DocTestFinder().find(function, name, globs={})
    assert tests and tests[0].examples
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{name}'s docstring example fails (run with -s to see the output)"
