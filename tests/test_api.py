"""The public surface (docs/semantics.md §0.1): names, numpydoc docstrings that match the signatures,
ParamError's contract."""

import inspect
import pickle
import re

import pytest

import fastbwd

FUNCTIONS = [
    "upsample_bilinear2d_backward",
    "avg_pool2d_backward",
    "replication_pad2d_backward",
    "roi_align_backward",
    "group_norm_swish_backward",
    "group_norm_swish",
]


def test_public_names():
    assert set(fastbwd.__all__) == set(FUNCTIONS) | {"ParamError", "__version__", "precompile", "clear_result_cache"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", fastbwd.__version__)


def _documented_parameters(doc):
    section = re.search(r"^Parameters\n-+\n(.*?)(?:^\w[\w ]*\n-+\n|\Z)", doc, re.S | re.M)
    assert section, "no Parameters section"
    names = []
    for line in section.group(1).splitlines():
        match = re.match(r"^(\w+(?:, \w+)*)\s*(?::|$)", line)
        if match:
            names += [n.strip() for n in match.group(1).split(",")]
    return names


@pytest.mark.parametrize("name", FUNCTIONS)
def test_docstring_matches_signature(name):
    function = getattr(fastbwd, name)
    doc = inspect.getdoc(function)
    assert doc, f"{name} has no docstring"
    for section in ("Parameters", "Returns", "Raises"):
        assert re.search(rf"^{section}\n-+$", doc, re.M), f"{name}: no {section} section"
    signature = [p for p in inspect.signature(function).parameters]
    assert _documented_parameters(doc) == signature


def test_param_error_contract():
    error = fastbwd.ParamError("f: x must be 1, but got 2", status=161002, param="x")
    assert isinstance(error, ValueError) and isinstance(error, TypeError)
    again = pickle.loads(pickle.dumps(error))
    assert (str(again), again.status, again.param) == (str(error), 161002, "x")
