"""The covering design that chooses the quick set's cases (tests/_covering.py)."""

import itertools

import pytest

from _covering import cover, pairwise, quick_and_slow


def _pairs(cases, interactions):
    return {(i, j, case[i], case[j]) for case in cases for i, j in interactions}


def test_every_pair_of_values_meets_in_a_chosen_case():
    axes = [range(4), "abc", [False, True], [0.5, 1.0, 2.0]]
    cases = list(itertools.product(*axes))
    chosen = cover(cases)
    every = list(itertools.combinations(range(4), 2))
    assert _pairs([cases[i] for i in chosen], every) == _pairs(cases, every)
    # 4 x 3 values need at least 12 cases; far fewer than the product's 72
    assert 12 <= len(chosen) <= 16 and chosen == sorted(chosen) and cover(cases) == chosen


def test_only_the_pairs_that_occur_are_asked_for():
    """A constrained list (a value of one parameter only with some of another's): the pairs it
    holds, no more."""
    cases = [("pad", dtype, layout) for dtype in ("f32", "c64") for layout in "NC"]
    cases += [("gn", dtype, layout) for dtype in ("f32", "bf16") for layout in "NC"]
    chosen = [cases[i] for i in cover(cases)]
    assert _pairs(chosen, [(0, 1), (0, 2), (1, 2)]) == _pairs(cases, [(0, 1), (0, 2), (1, 2)])


def test_interactions_narrow_what_must_meet():
    cases = list(itertools.product(range(5), range(5), "xy"))
    narrow = [cases[i] for i in cover(cases, interactions=[(0, 2), (1, 2)])]
    assert len(narrow) == 10 < 25 <= len(cover(cases))  # each case meets two of the 20 pairs asked for
    assert _pairs(narrow, [(0, 2), (1, 2)]) == _pairs(cases, [(0, 2), (1, 2)])
    assert cover([(1,), (2,), (2,), (3,)]) == [0, 1, 3]  # one parameter: each value once


def test_quick_and_slow_marks_the_cases_outside_the_cover():
    params = [(a, b) for a in range(3) for b in range(3)] + [pytest.param(9, 9, marks=pytest.mark.slow, id="nine")]
    marked = quick_and_slow(params)
    slow = [p for p in marked if isinstance(p, type(pytest.param())) and any(m.name == "slow" for m in p.marks)]
    assert len(marked) == 10 and len(slow) == 1 and slow[0].id == "nine"  # 3 x 3: every case is a pair
    marked = quick_and_slow(params[:9], key=lambda a, b: (a % 2, b % 2))
    quick = [p for p in marked if not isinstance(p, type(pytest.param()))]  # a ParameterSet is a tuple too
    assert {(a % 2, b % 2) for a, b in quick} == {(0, 0), (0, 1), (1, 0), (1, 1)} and len(quick) == 4
    one = quick_and_slow([(1, 2), (1, 2), (3, 4)], one_argument=True)
    assert one[0] == (1, 2) and one[1].values == ((1, 2),) and one[2] == (3, 4)
    product = pairwise([1, 2], "ab", [True, False])
    assert len(product) == 8 and sum(not isinstance(p, type(pytest.param())) for p in product) == 4
