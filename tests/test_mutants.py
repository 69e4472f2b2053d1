"""The mutation check's records (tools/mutants/*.toml) match the code they mutate.

A record whose snippet is not found exactly once in its file would be reported "stale" only when
someone runs tools/mutate.py (not in CI): here it fails at once, so a change that moves code moves
its mutants with it, or retires them on purpose (``retired = "why"``).
"""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mutate():
    # loaded from its path: tools/ is not a package, and the tests need not be run from the root
    spec = importlib.util.spec_from_file_location("fastbwd_tools_mutate", os.path.join(ROOT, "tools", "mutate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mutate = _mutate()


def test_every_record_is_well_formed_and_matches_its_code():
    mutants, test_sets, errors = mutate.load()
    problems = errors + mutate.check(mutants, test_sets)
    assert not problems, "tools/mutants/ needs an update:\n  " + "\n  ".join(problems)
    assert len(mutants) >= 269  # the records as of issue 48: retire on purpose, never drop
    assert {m.area for m in mutants} >= {"upsample", "avg_pool", "pad", "roi_align", "group_norm_swish", "torch"}


def _write(folder, name, text):
    with open(os.path.join(folder, name), "w", encoding="utf-8") as handle:
        handle.write(text)


def test_the_check_names_each_kind_of_broken_record(tmp_path):
    """The check itself can fail: a stale, a doubled and a missing-file snippet, a duplicate
    name, a no-op replacement, a retirement without a reason and an unused or missing test set
    are each reported by name; a retired record's snippet is not checked."""
    root = tmp_path / "tree"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    _write(root / "pkg", "code.py", "a = 1\nb = 2\nb = 2\n")
    _write(root / "tests", "test_code.py", "")
    folder = tmp_path / "mutants"
    folder.mkdir()
    _write(
        folder,
        "test_sets.toml",
        '[code]\nfiles = ["tests/test_code.py"]\n\n[unused]\nfiles = ["tests/test_gone.py"]\n',
    )

    def record(name, original, replacement, file="pkg/code.py", extra=""):
        return (
            f'[[mutant]]\nname = "{name}"\nfile = "{file}"\ntest_set = "code"\ndescription = "d"\n'
            f"original = '''\n{original}'''\nreplacement = '''\n{replacement}'''\n{extra}\n"
        )

    _write(
        folder,
        "area.toml",
        record("good", "a = 1\n", "a = 2\n")
        + record("dup", "a = 1", "a = 3")
        + record("dup", "a = 1", "a = 4")
        + record("stale", "c = 3", "c = 4")
        + record("twice", "b = 2", "b = 3")
        + record("gone", "a = 1", "a = 5", file="pkg/moved.py")
        + record("same", "a = 1", "a = 1")
        + record("unexplained", "x", "y", extra='retired = " "')
        + record("retired-stale", "no longer here", "z", extra='retired = "the code was removed in issue 99"'),
    )
    _write(folder, "typo.toml", record("typo", "a = 1", "a = 6", extra='retire = "misspelt"'))

    mutants, test_sets, errors = mutate.load(str(folder))
    assert [m.name for m in mutants if m.area == "area"][:2] == ["good", "dup"]
    assert mutants[0].original == "a = 1\n"  # the newline after ''' is not part of the snippet
    assert mutants[0].test == "tests/test_code.py"
    assert len(errors) == 1 and "typo" in errors[0] and "retire" in errors[0]

    problems = mutate.check(mutants, test_sets, root=str(root))
    by_name = {}
    for problem in problems:
        by_name.setdefault(problem.split(":")[0].split(" ")[0], []).append(problem)
    assert "used 2 times" in by_name["dup"][0]
    assert "found 0 times" in by_name["stale"][0] and "retire it on purpose" in by_name["stale"][0]
    assert "found 2 times" in by_name["twice"][0] and "move the record with its code" in by_name["twice"][0]
    assert "pkg/moved.py does not exist" in by_name["gone"][0]
    assert "replacement equals the original" in by_name["same"][0]
    assert "needs a reason" in by_name["unexplained"][0]
    assert any("[unused]" in p and "test_gone.py does not exist" in p for p in problems)
    assert any("[unused]" in p and "no record uses" in p for p in problems)
    assert "good" not in by_name and "retired-stale" not in by_name


def test_contract_sets_select_the_operators_rows():
    _, test_sets, _ = mutate.load()
    assert mutate.test_command(test_sets["upsample"]) == (
        "tests/test_upsample_bilinear2d.py tests/test_contract.py "
        "-k 'test_upsample_bilinear2d or upsample_bilinear2d_backward'"
    )
    assert mutate.test_command(test_sets["result_cache_and_torch"]) == "tests/test_result_cache.py tests/test_torch.py"
