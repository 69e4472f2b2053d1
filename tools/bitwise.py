#!/usr/bin/env python3
"""Bitwise snapshot of fastbwd's results, to show that a refactor changes no result.

Runs every entry of the precompile table (every operator, dtype, layout and kernel path, on
tiny inputs) and every case of the case registry (its canonical and quick shapes, fastbwd's
call only), and records a SHA-256 of each result's bytes, dtype and shape.

Usage::

    python tools/bitwise.py save before.json     # on the old tree
    python tools/bitwise.py save after.json      # on the new tree
    python tools/bitwise.py compare before.json after.json

``compare`` exits 1 when a result present in both files differs, and lists results present in
only one of them (a renamed case), which a reviewer checks by hand.
"""

import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _digest(result):
    import numpy as np

    parts = result if isinstance(result, tuple) else (result,)
    h = hashlib.sha256()
    for part in parts:
        array = np.ascontiguousarray(np.asarray(part))
        h.update(f"{array.dtype.str}{array.shape}".encode())
        h.update(array.view(np.uint8).tobytes() if array.size else b"")
    return h.hexdigest()


def _registry():
    """The case registry (bench/cases.py, beside the package) and the precompile table."""
    sys.path.insert(0, ROOT)
    from bench import cases
    from fastbwd import _precompile

    return cases, _precompile


def snapshot():
    from fastbwd._dtypes import BY_NAME

    cases, precompile = _registry()
    results = {}
    for entry in precompile.TABLE:
        key = f"table/{entry.op}/{entry.dtype}/{entry.layout}/{entry.path}"
        results[key] = _digest(entry.call(BY_NAME[entry.dtype]))
    for spec in cases.OPS.values():
        for kind, case_list in (("case", spec.cases), ("quick", spec.quick_cases)):
            for case in case_list:
                key = f"{kind}/{spec.name}/{case.id}/{case.dtype}/{case.label}"
                results[key] = _digest(spec.prepare(case, False).run())
                print(key, flush=True, file=sys.stderr)
    return results


def main(argv):
    if len(argv) == 2 and argv[0] == "save":
        with open(argv[1], "w") as f:
            json.dump(snapshot(), f, indent=1, sort_keys=True)
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        with open(argv[1]) as f:
            before = json.load(f)
        with open(argv[2]) as f:
            after = json.load(f)
        differ = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
        for key in differ:
            print("DIFFERS", key)
        for key in sorted(before.keys() - after.keys()):
            print("only before", key)
        for key in sorted(after.keys() - before.keys()):
            print("only after", key)
        print(f"{len(before.keys() & after.keys())} results in both, {len(differ)} differ")
        return 1 if differ else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
