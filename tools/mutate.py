#!/usr/bin/env python3
"""Mutation check: do the tests catch one-line semantic changes?

Each mutant is an exact-string replacement in one file of the package (a kernel, the api layer,
a bridge or the oracle) that changes results, paired with the tests that must catch it. The
records are data, one TOML file per area (``tools/mutants/<area>.toml``), each naming a test set
defined once in ``tools/mutants/test_sets.toml``; ``tests/test_mutants.py`` fails when a record's
snippet no longer matches its file. For each mutant this script copies the working tree (tracked
and untracked-but-not-ignored files, so uncommitted edits are included) into a temporary
directory, applies the replacement THERE (the real tree is never written), and runs the test set
with ``FASTBWD_CACHE=0``, an Inductor cache folder of its own (``TORCHINDUCTOR_CACHE_DIR``) and
``-x -q -p no:cacheprovider``. Outcomes:

* killed        the test run failed (the mutant was caught);
* killed (timeout)  the run exceeded ``--timeout``: a hang counts as caught, reported apart;
* survived      the test run passed: the tests do not see the change;
* stale         the snippet is not found exactly once in the file: the list needs refreshing
                (counted as a failure of the mutant list, never as killed).

The score, printed per area and in all, is killed / (killed + survived + stale). Retired records
(``retired = "why"``) stay on file and never run. Before the mutants, each test set involved
runs once unmutated in a clean copy (``--no-baseline`` skips this): a set that fails there would
"kill" every mutant and prove nothing, so its mutants are reported as "baseline-failed".

Usage::

    python tools/mutate.py --list                 # the mutants
    python tools/mutate.py                        # all of them, one at a time (minutes to an hour)
    python tools/mutate.py --only up- ap-global   # names starting with these, or areas
    python tools/mutate.py -j 2 --timeout 900 --results mutants.jsonl

Not run in CI. Run it before resolving any issue that touches a kernel (docs/testing.md).
"""

import argparse
import collections
import concurrent.futures
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The records: one TOML file per area (tools/mutants/<area>.toml), the test sets they name in
#: tools/mutants/test_sets.toml. docs/testing.md section 6 describes both.
MUTANTS_DIR = os.path.join(ROOT, "tools", "mutants")
TEST_SETS = "test_sets.toml"
REQUIRED = ("name", "file", "test_set", "description", "original", "replacement")
OPTIONAL = ("retired",)  # retired = "why": kept on record, never run, its snippet not checked

Mutant = collections.namedtuple("Mutant", "name area file original replacement test_set test description retired")


def test_command(test_set):
    """pytest's arguments (split with shlex) for one test set: its files, and for a set with a
    ``contract`` the operator's rows of the contract matrix, selected by the module's name and
    the contract expression in their ids."""
    files = test_set["files"]
    if "contract" not in test_set:
        return " ".join(files)
    module = os.path.basename(files[0])[: -len(".py")]
    return f"{files[0]} tests/test_contract.py -k '{module} or {test_set['contract']}'"


def load(folder=MUTANTS_DIR):
    """``(mutants, test_sets, errors)``: every record of every area file, in file order, the
    test sets, and what is malformed (an unknown or missing key, an unknown test set)."""
    errors = []
    with open(os.path.join(folder, TEST_SETS), "rb") as handle:
        test_sets = tomllib.load(handle)
    for name, test_set in test_sets.items():
        if set(test_set) - {"files", "contract"} or not test_set.get("files"):
            errors.append(f"{TEST_SETS} [{name}]: needs files = [...] and at most a contract")
        elif "contract" in test_set and len(test_set["files"]) != 1:
            errors.append(f"{TEST_SETS} [{name}]: a set with a contract has one file")
    mutants = []
    for filename in sorted(os.listdir(folder)):
        if not filename.endswith(".toml") or filename == TEST_SETS:
            continue
        area = filename[: -len(".toml")]
        with open(os.path.join(folder, filename), "rb") as handle:
            records = tomllib.load(handle)
        if set(records) != {"mutant"}:
            errors.append(f"{filename}: holds [[mutant]] records only (found {sorted(records)})")
        for index, record in enumerate(records.get("mutant", [])):
            where = f"{filename} record {index + 1} ({record.get('name', 'unnamed')})"
            missing = [key for key in REQUIRED if not isinstance(record.get(key), str)]
            unknown = sorted(set(record) - set(REQUIRED) - set(OPTIONAL))
            if missing or unknown:
                errors.append(f"{where}: missing or not a string: {missing}; unknown keys: {unknown}")
                continue
            if record["test_set"] not in test_sets:
                errors.append(f"{where}: test_set {record['test_set']!r} is not defined in {TEST_SETS}")
                continue
            command = test_command(test_sets[record["test_set"]])
            fields = {key: record[key] for key in REQUIRED if key != "test_set"}
            mutants.append(
                Mutant(area=area, test_set=record["test_set"], test=command, retired=record.get("retired"), **fields)
            )
    return mutants, test_sets, errors


def snippet_count(mutant, root=ROOT):
    """How many times the mutant's original snippet occurs in its file (None: no such file)."""
    path = os.path.join(root, mutant.file)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return handle.read().count(mutant.original)


def check(mutants, test_sets, root=ROOT):
    """What is wrong with the records against the tree at ``root``: duplicate names, a
    replacement equal to its original, a retirement without a reason, a missing file or test
    file, an unused test set, and (for records not retired) a snippet not found exactly once."""
    problems = []
    names = collections.Counter(m.name for m in mutants)
    problems += [f"{name}: the name is used {count} times" for name, count in names.items() if count > 1]
    for name, test_set in test_sets.items():
        problems += [
            f"{TEST_SETS} [{name}]: {path} does not exist"
            for path in test_set.get("files", [])
            if not os.path.isfile(os.path.join(root, path))
        ]
    unused = sorted(set(test_sets) - {m.test_set for m in mutants})
    problems += [f"{TEST_SETS} [{name}]: no record uses this test set (remove it)" for name in unused]
    for m in mutants:
        where = f"{m.name} (tools/mutants/{m.area}.toml)"
        if m.replacement == m.original:
            problems.append(f"{where}: the replacement equals the original")
        if m.retired is not None:
            if not m.retired.strip():
                problems.append(f"{where}: retired needs a reason")
            continue
        found = snippet_count(m, root)
        if found is None:
            problems.append(
                f"{where}: {m.file} does not exist: point the record at the file its code moved to, "
                'or retire it on purpose (retired = "why")'
            )
        elif found != 1:
            problems.append(
                f"{where}: the original snippet is found {found} times in {m.file} (exactly once needed): "
                "move the record with its code (the same semantic change, re-anchored), "
                'or retire it on purpose (retired = "why")'
            )
    return problems


def tree_files(root):
    """The files of the working tree: tracked (as they are on disk, uncommitted edits included)
    plus untracked ones that are not ignored; deleted files are skipped."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    return sorted({name for name in listed if name and os.path.isfile(os.path.join(root, name))})


def copy_tree(root, files, destination):
    for name in files:
        target = os.path.join(destination, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(root, name), target)


def apply(mutant, tree):
    """Apply ``mutant`` to the copy at ``tree``; None on success, else why it is stale."""
    path = os.path.join(tree, mutant.file)
    if not os.path.isfile(path):
        return f"{mutant.file} does not exist"
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    count = text.count(mutant.original)
    if count != 1:
        return f"snippet found {count} times in {mutant.file}"
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text.replace(mutant.original, mutant.replacement))
    return None


def run_tests(tree, test, timeout):
    """Run ``test`` in ``tree``: ``(passed, timed_out, seconds, tail of the output)``."""
    with tempfile.TemporaryDirectory(prefix="fastbwd-inductor-") as inductor_cache:
        # Inductor's caches key fastbwd's pass by _compile.py alone: with the shared default folder
        # a mutant elsewhere (a fake kernel, a schema) would load the graphs compiled unmutated
        env = dict(os.environ, FASTBWD_CACHE="0", PYTHONDONTWRITEBYTECODE="1", TORCHINDUCTOR_CACHE_DIR=inductor_cache)
        env.pop("PYTHONPATH", None)
        return _run_pytest(tree, test, timeout, env)


def _run_pytest(tree, test, timeout, env):
    start = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", *shlex.split(test), "-x", "-q", "-p", "no:cacheprovider"],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the test run and any subprocess it started
        output, _ = process.communicate()
        timed_out = True
    seconds = time.monotonic() - start
    lines = [line for line in (output or "").splitlines() if line.strip()]
    return process.returncode == 0 and not timed_out, timed_out, seconds, "\n".join(lines[-3:])


def evaluate(mutant, snapshot, files, timeout, baseline_failed):
    if mutant.test in baseline_failed:
        return {"outcome": "baseline-failed", "seconds": 0.0, "detail": f"{mutant.test} fails unmutated"}
    with tempfile.TemporaryDirectory(prefix="fastbwd-mutant-") as tree:
        copy_tree(snapshot, files, tree)
        stale = apply(mutant, tree)
        if stale:
            return {"outcome": "stale", "seconds": 0.0, "detail": stale}
        passed, timed_out, seconds, tail = run_tests(tree, mutant.test, timeout)
    if timed_out:
        outcome = "killed (timeout)"
    else:
        outcome = "survived" if passed else "killed"
    return {"outcome": outcome, "seconds": round(seconds, 1), "detail": tail.splitlines()[-1] if tail else ""}


def baseline(tests, snapshot, files, timeout, jobs):
    """Each test file once, unmutated: the set of files that fail."""

    def one(test):
        with tempfile.TemporaryDirectory(prefix="fastbwd-baseline-") as tree:
            copy_tree(snapshot, files, tree)
            passed, timed_out, seconds, tail = run_tests(tree, test, timeout)
        print(
            f"baseline {test}: {'ok' if passed else 'FAILED'} ({seconds:.0f} s)" + ("" if passed else f"\n    {tail}"),
            flush=True,
        )
        return test, passed

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        return {test for test, passed in pool.map(one, sorted(tests)) if not passed}


def matching(mutants, names):
    """The records whose name starts with one of ``names`` or whose area is one of them (all
    records when ``names`` is empty)."""
    if not names:
        return list(mutants)
    chosen = [m for m in mutants if any(m.name.startswith(n) or m.area == n for n in names)]
    if not chosen:
        sys.exit(f"no mutant matches {names}")
    return chosen


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="mutant name prefixes or areas")
    parser.add_argument("--list", action="store_true", help="list the mutants (marking stale ones) and exit")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per test run (default 1200)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs")
    parser.add_argument("--results", metavar="FILE", help="append one JSON line per mutant to FILE")
    args = parser.parse_args(argv)

    everything, test_sets, errors = load()
    names = collections.Counter(m.name for m in everything)
    errors += [f"{name}: the name is used {count} times" for name, count in names.items() if count > 1]
    if errors:
        sys.exit("the mutant records are malformed:\n  " + "\n  ".join(errors))
    if args.list:
        stale = 0
        listed = matching(everything, args.only)
        for m in listed:
            if m.retired is not None:
                mark = f"  [retired: {m.retired}]"
            else:
                found = snippet_count(m)
                mark = "" if found == 1 else f"  [STALE: found {found or 0} times]"
                stale += found != 1
            print(f"{m.name:38} {m.area:17} {m.file:40} {m.test_set:26} {m.description}{mark}")
        print(f"{len(listed)} mutants, {sum(m.retired is not None for m in listed)} retired, {stale} stale")
        return 1 if stale else 0

    mutants = [m for m in matching(everything, args.only) if m.retired is None]
    if not mutants:
        sys.exit("every matching mutant is retired")
    # One snapshot of the working tree for the whole run: edits made while it runs do not leak in.
    snapshot = tempfile.mkdtemp(prefix="fastbwd-snapshot-")
    try:
        copy_tree(ROOT, tree_files(ROOT), snapshot)
        return _run(args, mutants, snapshot, _listed(snapshot))
    finally:
        shutil.rmtree(snapshot, ignore_errors=True)


def _listed(tree):
    return sorted(
        os.path.relpath(os.path.join(folder, name), tree) for folder, _, names in os.walk(tree) for name in names
    )


def _score(results):
    """``(killed, scored)``: a timeout counts as killed, a stale record against the list."""
    counts = collections.Counter(r["outcome"] for r in results)
    killed = counts["killed"] + counts["killed (timeout)"]
    return killed, killed + counts["survived"] + counts["stale"]


def _run(args, mutants, snapshot, files):
    baseline_failed = (
        set() if args.no_baseline else baseline({m.test for m in mutants}, snapshot, files, args.timeout, args.jobs)
    )
    results = {}
    started = time.monotonic()

    def one(mutant):
        return mutant, evaluate(mutant, snapshot, files, args.timeout, baseline_failed)

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for mutant, result in pool.map(one, mutants):
            results[mutant] = result
            print(
                f"{result['outcome']:17} {mutant.name:38} {result['seconds']:7.1f} s  {mutant.description}"
                + (f"\n{'':19}{result['detail']}" if result["outcome"] in ("stale", "baseline-failed") else ""),
                flush=True,
            )
            if args.results:
                with open(args.results, "a", encoding="utf-8") as handle:
                    record = {"name": mutant.name, "area": mutant.area, "file": mutant.file, "test": mutant.test}
                    handle.write(json.dumps({**record, **result}) + "\n")

    counts = collections.Counter(r["outcome"] for r in results.values())
    print(
        f"\n{len(results)} mutants in {time.monotonic() - started:.0f} s: killed {counts['killed']}, "
        f"killed by timeout {counts['killed (timeout)']}, survived {counts['survived']}, "
        f"stale {counts['stale']}, baseline-failed {counts['baseline-failed']}"
    )
    print("score by area (killed / killed + survived + stale):")
    for area in sorted({m.area for m in results}):
        outcomes = [r for m, r in results.items() if m.area == area]
        killed, scored = _score(outcomes)
        unscored = sum(r["outcome"] == "baseline-failed" for r in outcomes)
        print(
            f"  {area:17} {killed:3}/{scored:<3}"
            + (f" = {100 * killed / scored:5.1f}%" if scored else "")
            + (f"  ({unscored} baseline-failed, unscored)" if unscored else "")
        )
    killed, scored = _score(results.values())
    if scored:
        print(f"score {killed}/{scored} = {100 * killed / scored:.1f}%")
    for outcome in ("survived", "stale", "baseline-failed"):
        names = [m.name for m, r in results.items() if r["outcome"] == outcome]
        if names:
            print(f"{outcome}: {', '.join(names)}")
    return 0 if killed == scored and not counts["baseline-failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
