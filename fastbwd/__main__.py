"""``python -m fastbwd``: a self-check of every operator; ``--precompile`` fills the cache.

The self-check runs each operator of this build once on a small case and compares the result
with the float64 oracle (``fastbwd.testing.reference``), one line per operator; the exit status
is 1 when one differs. The benchmark harness lives beside the package, in the checkout's
``bench/`` (``python3 -m bench``).

``python -m fastbwd --precompile [--ops ...] [--dtypes ...] [--layouts ...]`` instead
compiles the kernels (float32's unless ``--dtypes`` says more, or all) into Numba's disk cache
(``fastbwd.precompile``) and exits.
"""

import argparse
import json
import os
import sys
import time
import urllib.parse
import urllib.request

import fastbwd
from fastbwd._dtypes import BY_NAME
from fastbwd._registry import OPERATORS, ops_help
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


def installed_folder():
    """The folder of the fastbwd package that pip installed into this Python's site-packages (an
    editable install: the package folder of its checkout), or None when none is installed there.
    Only site-packages count: a checkout's own fastbwd.egg-info is no installation."""
    import site
    from importlib import metadata

    folders = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    distribution = next(iter(metadata.distributions(name="fastbwd", path=folders)), None)
    if distribution is None:
        return None
    direct_url = json.loads(distribution.read_text("direct_url.json") or "{}")
    if direct_url.get("dir_info", {}).get("editable"):
        checkout = urllib.request.url2pathname(urllib.parse.urlparse(direct_url["url"]).path)
        return os.path.join(checkout, "fastbwd")
    return str(distribution.locate_file("fastbwd"))


def shadowing_note():
    """A note when the fastbwd running is not the one installed into this Python (a folder
    earlier on ``sys.path``, such as the current one, holds another copy of the package): what
    shadows what, and what to do. None when they are the same, or nothing is installed."""
    running = os.path.dirname(os.path.abspath(fastbwd.__file__))
    installed = installed_folder()
    if installed is None or os.path.realpath(installed) == os.path.realpath(running):
        return None
    holder = os.path.dirname(running)
    where = "the current folder" if os.path.realpath(holder) == os.path.realpath(os.getcwd()) else holder
    return (
        f"note: this is the fastbwd package in {running}, found in {where} ahead of the fastbwd installed "
        f"in this Python ({installed}), which it shadows. To run the installed one, run from another "
        f"folder; to install this one, run: {sys.executable} -m pip install -e {holder}"
    )


def self_check(ops=None):
    """Check each operator (of ``ops``, default all) and print one line each; returns the exit status."""
    print(
        f"fastbwd {fastbwd.__version__} ({os.path.dirname(os.path.abspath(fastbwd.__file__))}): each operator "
        "on a small float32 case against the float64 reference (a first run compiles, which takes seconds "
        "per operator)",
        flush=True,
    )
    note = shadowing_note()
    if note:
        print(note, flush=True)
    failed = 0
    for name in SMALL_CHECKS:
        if ops and name not in ops:
            continue
        start = time.perf_counter()
        verdict = small_check(name)
        failed += verdict.startswith("MISMATCH")
        print(f"{name:<29} {verdict} ({time.perf_counter() - start:.1f} s)", flush=True)
    return 1 if failed else 0


#: The bridges ``--calibrate`` measures: (name, its calibration module, what it measures).
CALIBRATIONS = {
    "torch": ("fastbwd.torch._calibrate", "fastbwd.torch's eager paths against PyTorch's"),
    "jax": ("fastbwd.jax._calibrate", "fastbwd.jax's functions and drop-ins against JAX's own code"),
}


def calibrate(bridges=None):
    """``--calibrate``: this machine's thresholds for the bridges (``bridges``: names of
    :data:`CALIBRATIONS`, default every one whose framework is installed), stored
    (fastbwd._dispatch)."""
    import importlib

    from fastbwd import _dispatch

    modules = {}
    for name in bridges or CALIBRATIONS:
        try:
            modules[name] = importlib.import_module(CALIBRATIONS[name][0])
        except ImportError:
            if bridges:
                print(f"--calibrate {name}: fastbwd.{name} needs {name}, which is not installed")
                return 1
    if not modules:
        print(
            "--calibrate measures fastbwd.torch's and fastbwd.jax's paths: it needs torch or jax, neither is installed"
        )
        return 1
    print(
        f"calibrating on this machine ({_dispatch.cpu_name()}): "
        + "; ".join(CALIBRATIONS[name][1] for name in modules)
        + f". The stored table now: {_dispatch.status()}. A busy machine gives thresholds that are the load's: "
        "run it on a quiet one.",
        flush=True,
    )
    thresholds = {}
    for name, module in modules.items():
        print(f"fastbwd.{name}:", flush=True)
        thresholds.update(module.calibrate(say=lambda line: print(line, flush=True)))
    try:
        path = _dispatch.store(thresholds)
    except OSError as error:
        print(f"the thresholds could not be stored ({error}): calls keep the defaults")
        return 1
    print(f"stored in {path}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m fastbwd",
        description="A self-check of every operator against the float64 reference; --precompile instead "
        "compiles the kernels into the disk cache.",
    )
    parser.add_argument("--ops", nargs="+", metavar="OP", choices=list(OPERATORS), help=ops_help())
    group = parser.add_argument_group("precompiling", "fill the disk cache instead of checking")
    group.add_argument(
        "--precompile",
        action="store_true",
        help="compile the kernels of --ops, --dtypes (default: float32) and --layouts into the disk cache and exit",
    )
    group.add_argument(
        "--dtypes",
        nargs="+",
        metavar="DTYPE",
        choices=[*BY_NAME, "all"],
        help=f"these dtypes: {', '.join(BY_NAME)}, or all (default: float32)",
    )
    group.add_argument(
        "--layouts", nargs="+", metavar="LAYOUT", choices=["NCHW", "NHWC"], help="only these layouts: NCHW, NHWC"
    )
    group.add_argument("--workers", type=int, help="worker processes (default: one per core)")
    parser.add_argument(
        "--calibrate",
        nargs="*",
        metavar="BRIDGE",
        choices=list(CALIBRATIONS),
        help="measure where fastbwd's paths become faster than the framework's own code on this machine (minutes), "
        "for the bridges named (torch, jax; default: those installed), and store the thresholds beside the kernel "
        "cache, for the policy 'auto' (docs/semantics.md §7 and §8)",
    )
    args = parser.parse_args(argv)
    if args.calibrate is not None:
        return calibrate(args.calibrate)
    if args.precompile:
        try:
            result = fastbwd.precompile(args.ops, args.dtypes, args.layouts, workers=args.workers)
        except ValueError as error:
            parser.error(str(error))
        return 1 if result["errors"] else 0
    if args.dtypes or args.layouts or args.workers:
        parser.error("--dtypes, --layouts and --workers go with --precompile")
    return self_check(args.ops)


if __name__ == "__main__":
    sys.exit(main())
