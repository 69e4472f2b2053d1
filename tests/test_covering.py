"""The covering design that chooses the quick set's cases (tests/_covering.py)."""

import itertools

import pytest

from _covering import cover, mark_outside_the_cover, pairwise, quick_and_slow


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


class _Item:
    """What mark_outside_the_cover reads of a pytest item."""

    def __init__(self, params, marks, name="test_it"):
        self.callspec = type("CallSpec", (), {"params": params})()
        self.module = type("Module", (), {"__name__": "test_module"})()
        self.originalname = name
        self.marks = {mark.name: mark for mark in marks}

    def get_closest_marker(self, name):
        return self.marks.get(name)

    def add_marker(self, mark):
        self.marks[mark.name] = mark.mark


def test_the_covering_marker_marks_the_cases_outside_the_cover_slow():
    covering = pytest.mark.covering.mark
    items = [
        _Item({"a": a, "b": b, "c": c}, [covering])
        for a, b, c in itertools.product(range(3), "xyz", [{"k": 1}, {"k": 2}])  # a dict: unhashable
    ]
    items.append(_Item({"a": 9, "b": "x", "c": {"k": 1}}, [covering, pytest.mark.slow.mark]))
    items.append(_Item({"n": 1}, [], name="test_other"))  # no marker: untouched
    mark_outside_the_cover(items)
    quick = [item.callspec.params for item in items if item.get_closest_marker("slow") is None]
    assert {"n": 1} in quick and len(quick) == 9 + 1  # 3 x 3 pairs of a and b: 9 of the 18 cases
    pairs = {(p["a"], p["b"]) for p in quick if "a" in p} | {(p["a"], p["c"]["k"]) for p in quick if "a" in p}
    assert len(pairs) == 9 + 6
    # each value once, of the parameters named
    each = [_Item({"a": a, "b": b, "c": c}, [pytest.mark.covering("a", "b", strength=1).mark])
            for a in range(3) for b in "xy" for c in range(4)]  # fmt: skip
    mark_outside_the_cover(each)
    quick = [item.callspec.params for item in each if item.get_closest_marker("slow") is None]
    assert len(quick) == 3 and {p["a"] for p in quick} == {0, 1, 2} and {p["b"] for p in quick} == {"x", "y"}
    # features read from the parameters
    named = [_Item({"name": f"{op}-{variant}", "d": d}, [pytest.mark.covering(key=lambda name, d: (name[0], d)).mark])
             for op in "ab" for variant in range(3) for d in (16, 32)]  # fmt: skip
    mark_outside_the_cover(named)
    quick = [item.callspec.params for item in named if item.get_closest_marker("slow") is None]
    assert sorted((p["name"][0], p["d"]) for p in quick) == [("a", 16), ("a", 32), ("b", 16), ("b", 32)]
    with pytest.raises(ValueError, match="strength must be 1 or 2"):
        mark_outside_the_cover([_Item({"a": 1}, [pytest.mark.covering(strength=3).mark])])
