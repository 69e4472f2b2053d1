"""``python -m fastbwd``: a self-check of every operator; ``--precompile`` fills the cache.

The self-check runs each operator of this build once on a small case and compares the result
with the float64 oracle (``fastbwd.testing.reference``), one line per operator; the exit status
is 1 when one differs. The benchmark harness lives beside the package, in the checkout's
``bench/`` (``python3 -m bench``).

``python -m fastbwd --precompile [--ops ...] [--dtypes ...] [--layouts ...] [--serial]`` instead
compiles every kernel into Numba's disk cache (``fastbwd.precompile``) and exits.
"""

import argparse
import sys
import time

import fastbwd
from fastbwd._registry import OPERATORS
from fastbwd.testing.checks import assert_matches_reference

#: operator name -> () -> (result, float64 reference): the self-check's small cases.
SMALL_CHECKS = {op.name: op.check for op in OPERATORS.values() if op.check is not None}


def small_check(name):
    """ "matches the float64 reference", or "MISMATCH: ..." with the first line of the difference."""
    actual, expected = SMALL_CHECKS[name]()
    if not isinstance(actual, tuple):
        actual, expected = (actual,), (expected,)
    try:
        for a, e in zip(actual, expected):
            assert_matches_reference(a, e)
    except AssertionError as error:
        return f"MISMATCH: {str(error).splitlines()[0]}"
    return "matches the float64 reference"


def self_check(ops=None):
    """Check each operator (of ``ops``, default all) and print one line each; returns the exit status."""
    print(
        f"fastbwd {fastbwd.__version__}: each operator on a small float32 case against the float64 "
        "reference (a first run compiles, which takes seconds per operator)",
        flush=True,
    )
    failed = 0
    for name in SMALL_CHECKS:
        if ops and name not in ops:
            continue
        start = time.perf_counter()
        verdict = small_check(name)
        failed += verdict.startswith("MISMATCH")
        print(f"{name:<29} {verdict} ({time.perf_counter() - start:.1f} s)", flush=True)
    return 1 if failed else 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastbwd", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="*", help="only these operators (public names)")
    group = parser.add_argument_group("precompiling", "fill the disk cache instead of checking")
    group.add_argument(
        "--precompile",
        action="store_true",
        help="compile every kernel (of --ops, --dtypes, --layouts) into the disk cache and exit",
    )
    group.add_argument(
        "--dtypes", nargs="*", help="only these dtypes (float32 float16 bfloat16 float64 complex64 complex128)"
    )
    group.add_argument("--layouts", nargs="*", help="only these layouts (NCHW NHWC)")
    group.add_argument("--serial", action="store_true", help="also the serial twins (used after fork)")
    group.add_argument("--workers", type=int, help="worker processes (default: one per core)")
    args = parser.parse_args(argv)
    if args.precompile:
        try:
            result = fastbwd.precompile(
                args.ops or None, args.dtypes or None, args.layouts or None, serial=args.serial, workers=args.workers
            )
        except ValueError as error:
            parser.error(str(error))
        return 1 if result["errors"] else 0
    unknown = sorted(set(args.ops or ()) - set(SMALL_CHECKS))
    if unknown:
        parser.error(f"unknown operator(s) {unknown}; known: {sorted(SMALL_CHECKS)}")
    return self_check(args.ops)


if __name__ == "__main__":
    sys.exit(main())
