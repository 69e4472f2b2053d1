"""The main job, from the checkout: ``python3 -m bench [--full] [--json FILE]``.

For every operator implemented in this build it checks a small case against the float64
reference (``python -m fastbwd``'s self-check), then runs the benchmark cases of
``bench/cases.py`` (small shapes; ``--full``: the docs/semantics.md §6 shapes, as in the README's
table) and prints, per case:
median time, GB/s (minimum bytes read + written / time), % of this machine's memory bandwidth
(measured on the spot with a large parallel copy) and the speed-up over each baseline timed in
the same alternating rounds: PyTorch's calls when torch is importable (the same thread count for
both), and for the NHWC GroupNorm+Swish case fastbwd's own NCHW call on the same values (the
speed-up is then the NHWC/NCHW speed ratio). When jax is importable, the
``fastbwd.jax`` section times ``jax.jit(jax.grad(loss))`` through the bridge against JAX's own
gradient of the same forward.
"""

import argparse
import json
import platform
import sys
import time

import numba
import numpy as np

import fastbwd
from fastbwd.__main__ import small_check
from fastbwd.kernels._jit import threading_layer

from .bandwidth import parallel_copy, parallel_stream_fill
from .cases import implemented_ops


def say(text="", end="\n"):
    print(text, end=end, flush=True)


def median_seconds(function, min_repeats, min_seconds):
    """Median wall time of ``function()`` over at least ``min_repeats`` calls and ``min_seconds``."""
    times = []
    start = time.perf_counter()
    while len(times) < min_repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        function()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return float(np.median(times))


#: The second copy the main job times: the size of the large cases' results (A1 51 MB, P1 67 MB).
CASE_SIZE_COPY_BYTES = 64 << 20


def copy_bandwidth(nbytes):
    """GB/s of a parallel copy of ``nbytes`` (read + write counted), best of several."""
    source = np.ones(nbytes // 4, np.float32)
    destination = np.empty_like(source)
    parallel_copy(source, destination)
    best = min(median_seconds(lambda: parallel_copy(source, destination), 5, 0.2) for _ in range(3))
    return 2 * source.nbytes / best / 1e9


def stream_write_bandwidth(nbytes):
    """GB/s of a parallel streamed write of ``nbytes`` (bytes written only), best of several:
    the floor of a kernel whose traffic is mostly its result (A1 writes 51 MB and reads 13 MB).
    On the AMD EPYC machines the copy reads and writes about this many GB/s each, at once, so
    writing alone does not go faster and a kernel writing 80% of its bytes, as A1 does, tops out
    near 62% of the copy's GB/s; on the Intel Xeon ones writing alone ran at 0.65-1.1x the copy's
    whole rate (docs/design.md). The values written are random: lines of zeros are written more
    than twice as fast as any other data on the AMD machines (a 512 MB copy of zeros: 100 GB/s,
    of ones: 44)."""
    pattern = np.random.default_rng(0).standard_normal(1024).astype(np.float32)  # 4 KB, in the cache
    destination = np.empty(nbytes // 4, np.float32)
    parallel_stream_fill(destination, pattern)
    best = min(median_seconds(lambda: parallel_stream_fill(destination, pattern), 5, 0.2) for _ in range(3))
    return destination.nbytes / best / 1e9


def run(args):
    quick = not args.full
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            torch = None
    if torch is not None:
        torch.set_num_threads(numba.get_num_threads())

    machine = dict(
        fastbwd=fastbwd.__version__,
        numba=numba.__version__,
        numpy=np.__version__,
        python=platform.python_version(),
        cpu=_cpu_name(),
        threads=numba.get_num_threads(),
        threading_layer=threading_layer(),
        torch=getattr(torch, "__version__", None),
    )
    say(
        f"fastbwd {machine['fastbwd']} | numba {machine['numba']} | {machine['threads']} threads "
        f"({machine['threading_layer']}) | {machine['cpu']} | torch {machine['torch'] or 'not installed'}"
    )
    say("measuring memory bandwidth (parallel copy) ... ", end="")
    yardstick_bytes = CASE_SIZE_COPY_BYTES if quick else 512 << 20
    bandwidth = copy_bandwidth(yardstick_bytes)
    # The large copy's halves are above glibc's non-temporal threshold (192 MB per memcpy on
    # these machines), so it stores without reading the destination first; a copy the size of
    # the cases' results takes plain stores, as a kernel writing its result does (the small
    # shapes' yardstick is already that copy).
    case_size_bandwidth = bandwidth if quick else copy_bandwidth(CASE_SIZE_COPY_BYTES)
    write_bandwidth = stream_write_bandwidth(CASE_SIZE_COPY_BYTES)
    say(
        f"{bandwidth:.1f} GB/s ({yardstick_bytes >> 20} MB); a 64 MB copy: {case_size_bandwidth:.1f} GB/s; "
        f"a 64 MB streamed write: {write_bandwidth:.1f} GB/s written"
    )

    rows = []
    header = (
        f"{'operator':<29} {'case':<8} {'dtype':<9} {'variant':<8} {'ms':>8} {'GB/s':>6} {'%bw':>5}"
        f"  {'baseline':<18} {'ms':>8} {'speed-up':>8}"
    )
    for spec in implemented_ops():
        if args.ops and spec.name not in args.ops:
            continue
        say(
            f"\n{spec.name}: compiling and checking a small case (a first run compiles, which takes seconds; "
            "python -m fastbwd --precompile compiles everything ahead) ... ",
            end="",
        )
        t0 = time.perf_counter()
        verdict = small_check(spec.name)
        say(f"{verdict} ({time.perf_counter() - t0:.1f} s)")
        say(header)
        for case in spec.quick_cases if quick else spec.cases:
            t0 = time.perf_counter()
            prepared = spec.prepare(case, torch is not None)
            setup = time.perf_counter() - t0
            variants = [("alloc", prepared.run)] + ([("out=", prepared.run_out)] if prepared.run_out else [])
            # fastbwd's variants and the baselines in alternating rounds: the load of a shared
            # machine moves within a case, and sequential medians put a change on one side
            named = variants + list(prepared.baselines.items())
            seconds_of = dict(
                zip(
                    [name for name, _ in named],
                    _alternating_medians([fn for _, fn in named], args.repeats, args.seconds),
                )
            )
            timings = {name: seconds_of[name] for name, _ in variants}
            baselines = {name: seconds_of[name] for name in prepared.baselines}
            for variant, seconds in timings.items():
                gbps = prepared.nbytes / seconds / 1e9
                # out= variants are compared with the out= baseline, everything else with the rest
                matching = {k: v for k, v in baselines.items() if (k.endswith("out=")) == (variant == "out=")}
                if not matching:
                    matching = {"": None}
                for index, (baseline, base_seconds) in enumerate(matching.items()):
                    first = index == 0
                    row = dict(
                        op=spec.name,
                        case=case.id,
                        label=case.label,
                        dtype=case.dtype,
                        variant=variant,
                        ms=seconds * 1e3,
                        gbps=gbps,
                        pct_bandwidth=100 * gbps / bandwidth,
                        baseline=baseline or None,
                        baseline_ms=None if base_seconds is None else base_seconds * 1e3,
                        speedup=None if base_seconds is None else base_seconds / seconds,
                        setup_s=setup,
                    )
                    rows.append(row)
                    left = (
                        (
                            f"{spec.name:<29} {case.id:<8} {case.dtype:<9} {variant:<8} {seconds * 1e3:8.2f} "
                            f"{gbps:6.1f} {row['pct_bandwidth']:4.0f}%"
                        )
                        if first
                        else " " * 78
                    )
                    # two decimals below 1 (the NHWC/NCHW ratio has a target of 0.8)
                    right = (
                        f"  {baseline:<18} {row['baseline_ms']:8.2f} "
                        f"{row['speedup']:7.{2 if row['speedup'] < 1 else 1}f}x"
                        if base_seconds is not None
                        else ""
                    )
                    say(left + right)
            del prepared
    if torch is not None and (not args.ops or "torch" in args.ops):
        rows.extend(torch_bridge(args))
    if not args.no_jax and (not args.ops or "jax" in args.ops):
        machine["jax"], jax_rows = jax_bridge(args)
        rows.extend(jax_rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                dict(
                    machine=machine,
                    bandwidth_gbps=bandwidth,
                    case_size_copy_gbps=case_size_bandwidth,
                    stream_write_gbps=write_bandwidth,
                    quick=quick,
                    rows=rows,
                ),
                handle,
                indent=1,
            )
        say(f"\nresults saved to {args.json}")
    return 0


def _target_heading(args):
    """The targets are set for the full-size cases: on small shapes fixed per-call costs dominate."""
    return "target" if args.full else "target (for the --full shapes)"


def _compile_cases(args):
    """C1-C7 (models under torch.compile, ``bench/torch_cases.py``): with ``--full`` only, since
    Inductor compiles each model twice (a minute or more on two cores)."""
    from .torch_cases import compile_cases

    return compile_cases() if args.full else []


def torch_bridge(args):
    """The PyTorch bridge's cases T1-T7 (``bench/torch_cases.py``): each checks its
    gradients against plain PyTorch, then both are timed; returns the rows."""
    from .torch_cases import cases

    say(
        "\nfastbwd.torch (PyTorch models on fastbwd's backward): checking each case's gradients "
        "against plain PyTorch, then timing both in alternating rounds"
    )
    say(f"{'case':<5} {'what':<76} {'fastbwd ms':>10} {'torch ms':>9} {'speed-up':>8}  {_target_heading(args)}")
    rows = []
    for case in cases(quick=not args.full) + _compile_cases(args):
        case.check()
        fastbwd_seconds, torch_seconds = _alternating_medians((case.fastbwd, case.torch), args.repeats, args.seconds)
        speedup = torch_seconds / fastbwd_seconds
        say(
            f"{case.id:<5} {case.label:<76} {fastbwd_seconds * 1e3:10.2f} {torch_seconds * 1e3:9.2f} "
            f"{speedup:7.2f}x  {case.target}" + (f"  ({case.note})" if case.note else "")
        )
        rows.append(
            dict(
                op="fastbwd.torch",
                case=case.id,
                label=case.label,
                dtype="float32",
                variant="autograd",
                ms=fastbwd_seconds * 1e3,
                gbps=None,
                pct_bandwidth=None,
                baseline="torch",
                baseline_ms=torch_seconds * 1e3,
                speedup=speedup,
                target=case.target,
                note=case.note,
            )
        )
    from .torch_cases import measure_overhead, overhead_cases

    say("\nper-call overhead of the routing, tiny inputs (median us of 2000 calls each way, interleaved)")
    say(f"{'case':<5} {'what':<62} {'routed':>7} {'direct':>7} {'adds':>6} {'PyTorch':>8}")
    for case in overhead_cases():
        us = measure_overhead(case)
        say(
            f"{case.id:<5} {case.label:<62} {us['routed']:7.1f} {us['direct']:7.1f} "
            f"{us['routed'] - us['direct']:6.1f} {us['torch']:8.1f}"
        )
        rows.append(
            dict(
                op="fastbwd.torch overhead",
                case=case.id,
                label=case.label,
                dtype="float32",
                variant="routed",
                routed_us=us["routed"],
                direct_us=us["direct"],
                torch_us=us["torch"],
            )
        )
    return rows


def _alternating_medians(functions, min_repeats, min_seconds, rounds=4):
    """Median seconds of each of ``functions`` (None: not timed), timed in alternating rounds
    so that a change in the machine's load lands on all of them alike."""
    times = [[] for _ in functions]
    for _ in range(rounds):
        for function, samples in zip(functions, times):
            if function is None:
                continue
            start, count = time.perf_counter(), 0
            while count < max(1, min_repeats // rounds) or time.perf_counter() - start < min_seconds / rounds:
                t0 = time.perf_counter()
                function()
                samples.append(time.perf_counter() - t0)
                count += 1
                if count >= 50:
                    break
    return [float(np.median(samples)) if samples else None for samples in times]


def jax_bridge(args):
    """The JAX bridge's cases J1-J5 (``bench/jax_cases.py``) and its per-call transport
    cost; each case checks its gradients first. Returns ``(jax version, rows)``, ``(None, [])``
    without jax."""
    try:
        import jax
    except ImportError:
        return None, []
    from .jax_cases import cases, transport_overhead

    say(
        f"\nfastbwd.jax (JAX {jax.__version__}, CPU: jax.jit(jax.grad(loss)) on fastbwd's backward): checking "
        "each case's gradients against JAX's own, then timing both"
    )
    say(f"{'case':<5} {'what':<76} {'fastbwd ms':>10} {'jax ms':>9} {'speed-up':>8}  {_target_heading(args)}")
    rows = []
    for case in cases(quick=not args.full):
        case.check()
        fastbwd_seconds, jax_seconds = _alternating_medians((case.fastbwd, case.jax), args.repeats, args.seconds)
        speedup = None if jax_seconds is None else jax_seconds / fastbwd_seconds
        say(
            f"{case.id:<5} {case.label:<76} {fastbwd_seconds * 1e3:10.2f} "
            + (f"{jax_seconds * 1e3:9.2f} {speedup:7.2f}x" if speedup else f"{'-':>9} {'-':>8}")
            + f"  {case.target}"
        )
        rows.append(
            dict(
                op="fastbwd.jax",
                case=case.id,
                label=case.label,
                dtype="float32",
                variant="jit(grad)",
                ms=fastbwd_seconds * 1e3,
                gbps=None,
                pct_bandwidth=None,
                baseline="jax" if jax_seconds else None,
                baseline_ms=jax_seconds and jax_seconds * 1e3,
                speedup=speedup,
                target=case.target,
            )
        )
    one, many = _alternating_medians(tuple(transport_overhead().values()), 200, 0.4)
    per_call = (many - one) / 10
    say(
        f"transport: {per_call * 1e6:.0f} us per FFI call (jitted programs of 1 and 11 chained calls on 4 KB "
        f"whose handler does nothing: {one * 1e6:.0f} and {many * 1e6:.0f} us)"
    )
    rows.append(
        dict(
            op="fastbwd.jax",
            case="overhead",
            label="per FFI call (11 vs 1 chained no-op calls, 4 KB)",
            dtype="float32",
            variant="ffi call",
            ms=per_call * 1e3,
            gbps=None,
            pct_bandwidth=None,
            baseline="1-call program",
            baseline_ms=one * 1e3,
            speedup=None,
            target="report",
        )
    )
    return jax.__version__, rows


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--full",
        action="store_true",
        help="the full-size docs/semantics.md §6 shapes (the README's table; minutes per operator)",
    )
    parser.add_argument("--json", metavar="FILE", help="save the results as JSON")
    parser.add_argument(
        "--ops",
        nargs="*",
        help="only these operators (public names; 'torch' for the PyTorch bridge's cases, 'jax' for the JAX bridge's)",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baselines")
    parser.add_argument("--no-jax", action="store_true", help="skip the fastbwd.jax section")
    parser.add_argument("--repeats", type=int, default=10, help="minimum timed calls per row (default 10)")
    parser.add_argument("--seconds", type=float, default=0.5, help="minimum seconds per row (default 0.5)")
    args = parser.parse_args(argv)
    if not args.full:
        args.repeats, args.seconds = min(args.repeats, 3), min(args.seconds, 0.05)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
