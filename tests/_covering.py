"""The quick set's cases, chosen by a covering design (docs/testing.md, "The quick set and the
slow set").

A parametrised test's full list of cases runs in CI (the quick set and the slow set together);
the quick set runs a subset of it in which **every pair of values of any two parameters that
occur together in some case also occur together in a quick case** (pairwise coverage: most
failures need one value, or two values meeting, to show). The other cases are marked ``slow``.
The choice is greedy and deterministic: the same cases every run, in the full list's order.

``interactions`` narrows which pairs of parameters must meet. A check whose cost is a compiled
kernel per (kernel path, dtype), for instance, covers (path, layout) and (operator, dtype)
without every (path, dtype): what can break together stays in the quick set, which compiles a
fraction of the kernels; the slow set still runs every case.
"""

import itertools

import numpy as np
import pytest


def cover(cases, interactions=None):
    """The indices (ascending) of a subset of ``cases`` (tuples of hashable values, all of one
    length) in which every pair of values occurring together in ``cases`` at the positions of a
    pair of ``interactions`` (default: every pair of positions) occurs together in a chosen case;
    with one position, every value once. Greedy: the case covering the most pairs not covered yet,
    the first such case on a tie."""
    cases = [tuple(case) for case in cases]
    if not cases:
        return []
    width = len(cases[0])
    if any(len(case) != width for case in cases):
        raise ValueError("cover: every case needs the same number of values")
    if interactions is None:
        interactions = list(itertools.combinations(range(width), 2)) or [(0, 0)]
    pairs = [{(i, j, case[i], case[j]) for i, j in interactions} for case in cases]
    uncovered = set().union(*pairs)
    chosen = []
    while uncovered:
        best = max(range(len(cases)), key=lambda index: (len(pairs[index] & uncovered), -index))
        chosen.append(best)
        uncovered -= pairs[best]
    return sorted(chosen)


_PARAM = type(pytest.param())


def _values(param, one_argument):
    """A parametrize entry's values, as a tuple."""
    if isinstance(param, _PARAM):
        return param.values
    return (param,) if one_argument else tuple(param)


def quick_and_slow(params, key=None, interactions=None, one_argument=False):
    """``params`` (a parametrize list: tuples of values, or ``pytest.param``s; single values with
    ``one_argument``, for a test of one argument) with the ``slow`` mark on each one outside a
    pairwise cover of them (:func:`cover`); ``key(*values)`` gives the tuple to cover for an
    entry's values (default: the values themselves). Entries marked slow already stay slow and
    count for nothing in the cover."""
    params = list(params)
    slow = [any(mark.name == "slow" for mark in getattr(param, "marks", ())) for param in params]
    candidates = [index for index, already in enumerate(slow) if not already]
    values = [_values(params[index], one_argument) for index in candidates]
    keys = [tuple(key(*v)) if key else v for v in values]
    quick = {candidates[index] for index in cover(keys, interactions)}
    marked = []
    for index, param in enumerate(params):
        if index in quick or slow[index]:
            marked.append(param)
        elif isinstance(param, _PARAM):
            marked.append(pytest.param(*param.values, id=param.id, marks=[*param.marks, pytest.mark.slow]))
        else:
            marked.append(pytest.param(*_values(param, one_argument), marks=pytest.mark.slow))
    return marked


def pairwise(*axes, interactions=None):
    """The product of ``axes`` (lists of values) as parametrize params, the slow mark on each case
    outside a pairwise cover: for a test parametrised by several independent lists."""
    return quick_and_slow(list(itertools.product(*axes)), interactions=interactions)


# ---- the covering marker: a parametrised test's own cases, covered ------------------------


def _hashable(value):
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def mark_outside_the_cover(items):
    """For each test marked ``@pytest.mark.covering`` (its cases from ``parametrize``), the
    ``slow`` mark on each case outside a cover of its parameters' values: with ``strength=2``
    (the default) every pair of values of two parameters that meet in some case meet in a quick
    case; with ``strength=1`` every value of each parameter appears in a quick case (for a check
    whose every case compiles a program of its own: an XLA or Inductor graph). The marker's
    arguments name the parameters to cover (default: all of them; a parameter left out, such as
    a list of library options, takes whatever values the cover's cases have), or ``key`` maps a
    case's parameters (by name) to the features to cover instead (an operator and a layout read
    from a case's name, say). Cases marked slow already stay slow and count for nothing. For pytest's ``pytest_collection_modifyitems``,
    before ``-m`` deselects."""
    tests = {}
    for item in items:
        marker = item.get_closest_marker("covering")
        if marker is not None and hasattr(item, "callspec"):
            tests.setdefault((item.module.__name__, item.originalname), (marker, []))[1].append(item)
    for marker, cases in tests.values():
        candidates = [item for item in cases if item.get_closest_marker("slow") is None]
        if not candidates:
            continue
        names = list(marker.args) or list(candidates[0].callspec.params)
        key = marker.kwargs.get("key")
        if key is not None:  # the features of a case, from its parameters
            keys = [tuple(map(_hashable, key(**item.callspec.params))) for item in candidates]
        else:
            keys = [tuple(_hashable(item.callspec.params[name]) for name in names) for item in candidates]
        strength = marker.kwargs.get("strength", 2)
        if strength not in (1, 2):
            raise ValueError(f"covering: strength must be 1 or 2, but got {strength!r}")
        positions = range(len(keys[0]))
        interactions = itertools.combinations(positions, 2) if strength == 2 and len(names) > 1 else None
        quick = set(cover(keys, list(interactions) if interactions else [(i, i) for i in positions]))
        for index, item in enumerate(candidates):
            if index not in quick:
                item.add_marker(pytest.mark.slow)


def float32_quick(dtypes, quick=np.float32):
    """``dtypes`` as parametrize values: float32 (or ``quick``: bfloat16 for a test of the half
    formats) in the quick set, the others in the slow set. For an operator's own tests, whose
    dtypes the contract matrix's quick cover already meets each operator in
    (tests/test_contract.py): every other dtype there compiles kernels of its own, which is most
    of a cold quick run's time."""
    return [
        dtype
        if np.dtype(dtype) == np.dtype(quick)
        else pytest.param(dtype, marks=pytest.mark.slow, id=str(np.dtype(dtype)))
        for dtype in dtypes
    ]
