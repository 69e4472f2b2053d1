"""The main job, from the checkout: ``python3 -m bench [--full] [--json FILE] [--publish]``.

For every operator it checks a small case against the float64 reference (``python -m
fastbwd``'s self-check), then runs the benchmark cases of ``bench/cases.py`` (small shapes;
``--full``: the docs/semantics.md §6 shapes, as in docs/benchmarks.md) and prints, per row:
median time, GB/s (minimum bytes read + written / time), % of this machine's memory bandwidth
(measured on the spot with a large parallel copy), the speed-up over each baseline timed in the
same alternating rounds, the row's spread, and its target with a verdict (``--full``). The
baselines: PyTorch's calls when torch is importable (the same thread count for both), and for
the NHWC GroupNorm+Swish case fastbwd's own NCHW call on the same values (the speed-up is then
the NHWC/NCHW speed ratio). Then the PyTorch bridge's cases (``bench/torch_cases.py``) and,
when jax is importable, the JAX bridge's (``bench/jax_cases.py``): each row is fastbwd's way
against the plain framework's, timed the same way.

The run measures its own noise (``bench/timing.py``): a case's callables run in alternating
rounds until the median of the rounds' paired speed-ups is known (its distribution-free 95%
interval) or the case's time budget runs out; a row whose median is not known to within
``--max-spread`` (neither its rounds' spread nor that interval's half-width within it: a busy
machine widens the spread, more rounds narrow the interval) is marked noisy and gets no
verdict. From the first case timed while parallel calls stall on (other processes hold the
cores), or whose two-thread rows come out noisy (a load that came after the check; that case is
timed again), both sides run on one thread, kernel against kernel, each case for three times its
budget (``--threads``: a fixed count instead, and rows timed while parallel calls stall are
marked stalled, without a verdict). The report prints when the run ends (progress goes
to stderr meanwhile): the machine, what its load did in one line, a summary per operator and
bridge (``bench/targets.py``'s ``group_summaries``), then the rows, then the targets met, missed
and not trustworthy (docs/design.md, "The main job on a shared machine").

``--publish`` (with ``--full``) saves the results to ``bench/results.json`` and regenerates the
README's headline table and the full tables of ``docs/benchmarks.md`` from them
(``bench/to_table.py``): the one command behind the published numbers.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numba
import numpy as np

import fastbwd
from fastbwd.__main__ import shadowing_note, small_check
from fastbwd._dispatch import cpu_name
from fastbwd._registry import OPERATORS, ops_help
from fastbwd.api import _plans
from fastbwd.kernels._jit import threading_layer

from . import targets, to_table
from .bandwidth import parallel_copy, parallel_stream_fill
from .cases import OPS
from .timing import Settings, alternating_rounds, median_error, parallel_stall, spread

#: The checkout's root: where --publish writes bench/results.json, README.md and docs/benchmarks.md.
ROOT = Path(__file__).resolve().parents[1]
#: The files whose generated tables --publish regenerates.
PUBLISHED = ("README.md", "docs/benchmarks.md")

#: The second copy the main job times: the size of the large cases' results (A1 51 MB, P1 67 MB).
CASE_SIZE_COPY_BYTES = 64 << 20

#: A 1-minute load average above this, before the run starts, means other processes ran; this
#: many other runnable processes on average, sampled over half a second, mean they run now.
BUSY_LOAD = 0.75
BUSY_RUNNING = 0.5
#: Two readings of the copy bandwidth further apart than this (relative to the larger) mean the
#: machine's speed is moving.
BANDWIDTH_DISAGREEMENT = 0.2

#: XLA's flags for one thread (the main job's JAX section when parallel calls stall): its CPU
#: client's Eigen pool off and one thread for an operation.
XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"

#: The main job's timing settings, per size (``--budget``, ``--tolerance`` override theirs).
FULL = Settings(round_seconds=0.05, min_rounds=7, tolerance=0.02, budget=12.0)
QUICK = Settings(round_seconds=0.01, min_rounds=5, tolerance=0.03, budget=1.0)
#: From the case that finds parallel calls stalling on (a busy machine) each case gets this many
#: times its budget, unless ``--budget`` set one: the noise widens the rounds' spread, and more
#: rounds narrow the interval of their median all the same (``targets.uncertainty``).
BUSY_BUDGET = 3


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


def running_elsewhere(samples=10, interval=0.05):
    """How many other processes are running, on average over ``samples`` readings of
    /proc/loadavg's runnable count (this process is one of them); None where it cannot be read."""
    counts = []
    for _ in range(samples):
        try:
            with open("/proc/loadavg") as handle:
                counts.append(int(handle.read().split()[3].split("/")[0]) - 1)
        except (OSError, IndexError, ValueError):
            return None
        time.sleep(interval)
    return sum(counts) / len(counts)


def _disagree(first, second):
    return abs(first - second) > BANDWIDTH_DISAGREEMENT * max(first, second)


class Run:
    """One main-job run: its settings, the rows it collects and its printing."""

    def __init__(self, args):
        self.args = args
        self.full = args.full
        base = FULL if args.full else QUICK
        self.settings = Settings(
            round_seconds=base.round_seconds,
            min_rounds=base.min_rounds,
            tolerance=args.tolerance if args.tolerance is not None else base.tolerance,
            budget=args.budget if args.budget is not None else base.budget,
        )
        self.max_spread = args.max_spread
        self.header = []
        self.bridge_checks = 0
        self.rows = []
        self.warnings = []
        #: The per-row detail, printed after the summary when the run ends.
        self.details = []
        self._partial = ""
        self.checks = []
        #: PyTorch when it is timed against (its thread count follows the run's)
        self.torch = None
        #: The thread count both sides run on: Numba's own and PyTorch's (``--threads`` fixes it);
        #: with --threads auto, from the first case timed while parallel calls stall on, 1.
        #: --threads auto: switch to one thread at the first stall
        self.auto_threads = getattr(args, "threads", "auto") in (None, "auto")
        self.threads = numba.get_num_threads() if self.auto_threads else int(args.threads)
        #: The case from which on the run timed one thread against one thread (None: it did not).
        self.one_thread_since = None
        #: Why it did: "stalled" or "noisy" (:meth:`switch_to_one_thread`).
        self.one_thread_why = None
        #: Every parallel stall measured (timing.parallel_stall), before the cases.
        self.stalls = []

    def say(self, text="", end="\n"):
        """Add to the per-row detail (printed after the summary, at the end of the run)."""
        *lines, self._partial = (self._partial + text + end).split("\n")
        self.details += lines

    def progress(self, text):
        """What the run is timing now, on stderr: one line rewritten in place in a terminal (the
        report on stdout starts with the summary, so it waits for the end of the run); elsewhere
        only the sections' starts."""
        if sys.stderr.isatty():
            sys.stderr.write(f"\r\x1b[K{text}"[: 8 + shutil.get_terminal_size().columns])
            sys.stderr.flush()
        elif not text.startswith(" "):
            print(text, file=sys.stderr, flush=True)

    def selected(self, name):
        return not self.args.ops or name in self.args.ops

    def wanted(self, cases):
        """The bridge cases ``--cases`` selects (all without it)."""
        prefixes = self.args.cases
        return [case for case in cases if not prefixes or case.id.startswith(tuple(prefixes))]

    # ---- the rows' spread, target and verdict ---------------------------------------------

    def finish_row(self, row, series, timing, stall, threads):
        """Add the spread of ``series`` (the row's per-round values), the half-width of their
        median's 95% interval relative to it (``error``; :func:`targets.uncertainty`), its round
        count, whether the case's rounds settled, the case's parallel stall, the thread count both
        sides ran on, and (``--full``) the verdict; store and return the row."""
        row.update(
            spread=spread(series),
            error=median_error(series),
            rounds=len(series),
            settled=timing.settled,
            stall=stall,
            threads=threads,
        )
        row.setdefault("target", None)
        if self.full:
            row["verdict"] = targets.verdict(row, self.max_spread)
        self.rows.append(row)
        return row

    def verdict_text(self, row):
        """The printed target column: the target, and its verdict in a --full run."""
        if not row.get("target"):
            return ""
        if not self.full:
            return row["target"]
        outcome = row.get("verdict")
        return (
            f"{row['target']}: {outcome.upper() if outcome == targets.MISSED else outcome}"
            if outcome
            else row["target"]
        )

    def spread_text(self, row):
        return f"{targets.spread_text(row.get('spread'))} {targets.trust_text(row, self.max_spread)}".strip()

    # ---- the thread count: one thread on both sides when parallel calls stall -------------------

    def case_threads(self, case_id):
        """Before a case: ``(stall, threads)``, whether parallel calls stall now
        (``timing.parallel_stall``; None once the run times on one thread) and the thread count
        both sides run the case on. With ``--threads auto`` (the default) the first stall above
        ``targets.STALL_LIMIT`` switches the rest of the run to one thread on both sides, fastbwd's
        kernels against PyTorch's or JAX's (a parallel call then waits for descheduled worker
        threads, so two-thread times would be the scheduler's); ``--threads N`` keeps N whatever
        happens, and rows timed while parallel calls stall are marked."""
        if self.threads == 1:
            return None, 1
        return self.stall_now(case_id), self.threads

    def stall_now(self, case_id):
        """Measure the parallel stall now; with --threads auto, switch to one thread from
        ``case_id`` on when it is above the limit. Returns the stall."""
        stall = parallel_stall()
        self.stalls.append(stall)
        if stall > targets.STALL_LIMIT and self.auto_threads and self.threads > 1:
            self.switch_to_one_thread(case_id, "stalled")
        return stall

    def switch_to_one_thread(self, case_id, why):
        """From ``case_id`` on, one thread on both sides, each case with ``BUSY_BUDGET`` times its
        budget unless ``--budget`` set one; ``why``: "stalled" (a parallel copy waited) or "noisy"
        (a case's two-thread rounds disagreed, the load having come after the stall check)."""
        self.threads, self.one_thread_since, self.one_thread_why = 1, case_id, why
        if self.args.budget is None:
            self.settings = dataclasses.replace(self.settings, budget=self.settings.budget * BUSY_BUDGET)

    def timed(self, case_id, functions, series, rows=None):
        """``(timing, stall, threads)``: ``alternating_rounds(functions, series)`` on the case's
        thread count (:meth:`case_threads`). With --threads auto, a case whose two-thread rows (the
        pairs ``rows``, by default all of ``series``) come out untrustworthy (a load that started
        after the stall check) switches the run to one thread, and is timed again there: its rows
        are the one-thread ones."""
        stall, threads = self.case_threads(case_id)
        with self.on_threads(threads):
            timing = alternating_rounds(functions, series, self.settings)
        if threads > 1 and self.auto_threads and self.unsure_rounds(timing, series if rows is None else rows):
            self.switch_to_one_thread(case_id, "noisy")
            stall, threads = None, 1
            with self.on_threads(threads):
                timing = alternating_rounds(functions, series, self.settings)
        return timing, stall, threads

    def unsure_rounds(self, timing, series):
        """Any of ``series``' rows (pairs as :func:`alternating_rounds` takes them) whose median is
        not known to within the run's ``max_spread`` (:func:`targets.noisy`)."""
        return any(
            targets.noisy({"spread": spread(values), "error": median_error(values)}, self.max_spread)
            for values in (timing.series(index, baseline) for index, baseline in series)
        )

    @contextlib.contextmanager
    def on_threads(self, threads):
        """Numba's and PyTorch's thread counts (this thread's) set to ``threads`` for the block."""
        numba_threads = numba.get_num_threads()
        torch_threads = self.torch.get_num_threads() if self.torch is not None else None
        numba.set_num_threads(threads)
        if self.torch is not None:
            self.torch.set_num_threads(threads)
        try:
            yield
        finally:
            numba.set_num_threads(numba_threads)
            if self.torch is not None:
                self.torch.set_num_threads(torch_threads)

    # ---- the machine --------------------------------------------------------------------

    def machine(self, torch):
        load = os.getloadavg()
        others = running_elsewhere()
        machine = dict(
            fastbwd=fastbwd.__version__,
            numba=numba.__version__,
            numpy=np.__version__,
            python=platform.python_version(),
            cpu=cpu_name(),
            cpus=os.cpu_count(),
            threads=numba.get_num_threads(),
            threading_layer=threading_layer(),
            torch=getattr(torch, "__version__", None),
            load_average=list(load),
            running_elsewhere=others,
        )
        self.header = [
            f"fastbwd {machine['fastbwd']} ({os.path.dirname(os.path.abspath(fastbwd.__file__))}) | numba "
            f"{machine['numba']} | {machine['threads']} threads ({machine['threading_layer']}) | {machine['cpu']}, "
            f"{machine['cpus']} CPUs | torch {machine['torch'] or 'not installed'}"
        ]
        note = shadowing_note()
        if note:
            self.header.append(note)
        if load[0] > BUSY_LOAD or (others is not None and others >= BUSY_RUNNING):
            now = "" if others is None else f"; {others:.1f} other processes were running as it started"
            self.warn(
                f"the machine is busy: its load average over the last minute was {load[0]:.2f} on "
                f"{machine['cpus']} CPUs{now}. Other processes compete for the cores: expect wide spreads, and a "
                "parallel call can wait milliseconds for a descheduled worker thread."
            )
        machine["parallel_stall"] = stall = self.stall_now("the start")
        if stall > targets.STALL_LIMIT:
            then = (
                "so every case is timed on one thread on both sides, fastbwd's kernels against PyTorch's or JAX's"
                if self.threads == 1
                else f"and --threads {self.threads} keeps {self.threads}: rows timed in such a state are marked "
                "'stalled' and their targets get no verdict"
            )
            self.warn(
                f"parallel calls stall: a short parallel copy took {stall:.1f}x its one-thread time on "
                f"{machine['threads']} threads (at most about 1 on an idle machine), waiting for worker threads "
                f"that other processes keep off the cores; {then}."
            )
        return machine

    def warn(self, text):
        """A sign of a busy machine: saved with the results; the report says it once, in one line."""
        self.warnings.append(text)

    def bandwidth(self):
        """The copy yardstick (two readings, the higher one kept), the case-size copy and the streamed write."""
        yardstick_bytes = CASE_SIZE_COPY_BYTES if not self.full else 512 << 20
        self.progress("measuring the memory bandwidth")
        self.say(f"measuring memory bandwidth (a {yardstick_bytes >> 20} MB parallel copy, twice) ... ", end="")
        first = copy_bandwidth(yardstick_bytes)
        # The large copy's halves are above glibc's non-temporal threshold (192 MB per memcpy on
        # these machines), so it stores without reading the destination first; a copy the size of
        # the cases' results takes plain stores, as a kernel writing its result does (the small
        # shapes' yardstick is already that copy).
        case_size = copy_bandwidth(CASE_SIZE_COPY_BYTES) if self.full else None
        write = stream_write_bandwidth(CASE_SIZE_COPY_BYTES)
        second = copy_bandwidth(yardstick_bytes)
        bandwidth = max(first, second)
        self.say(
            f"{first:.1f} and {second:.1f} GB/s"
            + (f"; a 64 MB copy: {case_size:.1f} GB/s" if case_size is not None else "")
            + f"; a 64 MB streamed write: {write:.1f} GB/s written"
        )
        if _disagree(first, second):
            self.warn(
                f"two readings of the copy bandwidth, a second apart, differ by more than "
                f"{100 * BANDWIDTH_DISAGREEMENT:.0f}% ({first:.1f} and {second:.1f} GB/s): another process is using "
                f"the memory or the cores, so timings move within the run; % of copy bw uses the higher reading."
            )
        self.yardstick_bytes = yardstick_bytes
        return dict(
            bandwidth_gbps=bandwidth,
            bandwidth_readings_gbps=[first, second],
            case_size_copy_gbps=case_size if case_size is not None else bandwidth,
            stream_write_gbps=write,
        )

    # ---- the operators' cases -----------------------------------------------------------

    def operators(self, with_torch, bandwidth):
        for spec in OPS.values():
            if not self.selected(spec.name):
                continue
            self.progress(f"{spec.name}: checking a small case against the float64 reference")
            self.say(f"\n{spec.name}: checking a small case against the float64 reference ... ", end="")
            t0 = time.perf_counter()
            verdict = small_check(spec.name)
            self.checks.append((spec.name, verdict))
            self.say(f"{verdict} ({time.perf_counter() - t0:.1f} s)")
            cases = spec.cases if self.full else spec.quick_cases
            self.say(
                f"  {'dtype':<9} {'variant':<8} {'ms':>8} {'GB/s':>6} {'%bw':>5}  {'baseline':<21} {'ms':>9} "
                f"{'speed-up':>8} {'95% interval':>13} {'spread':>7} {'thr':>3}  "
                f"{'target' if self.full else 'target (for the --full shapes)'}"
            )
            for case in cases:
                self.operator_case(spec, case, with_torch, bandwidth)

    def operator_case(self, spec, case, with_torch, bandwidth):
        self.progress(f"  {spec.name}: timing {case.id} {case.dtype}")
        self.say(f"  {case.id} {case.dtype}: {case.label}")
        t0 = time.perf_counter()
        prepared = spec.prepare(case, with_torch)
        setup = time.perf_counter() - t0
        variants = [("alloc", prepared.run)] + ([("out=", prepared.run_out)] if prepared.run_out else [])
        named = variants + list(prepared.baselines.items())
        index = {name: i for i, (name, _) in enumerate(named)}
        # out= variants are compared with the out= baselines, everything else with the rest
        pairs = []
        for variant, _ in variants:
            matching = [name for name in prepared.baselines if name.endswith("out=") == (variant == "out=")]
            pairs += [(variant, baseline) for baseline in matching] or [(variant, None)]
        series = [(index[variant], None if baseline is None else index[baseline]) for variant, baseline in pairs]
        # fastbwd's variants and the baselines in alternating rounds: the load of a shared
        # machine moves within a case, and sequential medians put a change on one side
        timing, stall, threads = self.timed(f"{case.id} {case.dtype}", [function for _, function in named], series)
        shown = set()
        for (variant, baseline), (i, b) in zip(pairs, series):
            seconds = timing.median(i)
            gbps = prepared.nbytes / seconds / 1e9
            base_seconds = None if b is None else timing.median(b)
            speedup, interval = (None, None) if b is None else timing.speedup(i, b)
            row = self.finish_row(
                dict(
                    op=spec.name,
                    case=case.id,
                    label=case.label,
                    dtype=case.dtype,
                    variant=variant,
                    ms=seconds * 1e3,
                    gbps=gbps,
                    # small shapes stay in the caches: a share of the memory's copy rate means nothing there
                    pct_bandwidth=100 * gbps / bandwidth if self.full else None,
                    baseline=baseline,
                    baseline_ms=None if base_seconds is None else base_seconds * 1e3,
                    speedup=speedup,
                    speedup_interval=interval,
                    target=case.targets.get(baseline),  # the key None: a row without a baseline (a %bw target)
                    setup_s=setup,
                ),
                timing.series(i, b),
                timing,
                stall,
                threads,
            )
            left = (
                f"  {case.dtype:<9} {variant:<8} {seconds * 1e3:8.2f} {gbps:6.1f} {targets.percent_text(row['pct_bandwidth']):>5}"
                if variant not in shown
                else " " * 42
            )
            shown.add(variant)
            right = (
                f"  {baseline:<21} {row['baseline_ms']:9.2f} {targets.speedup_text(row['speedup']):>8} "
                f"{targets.interval_text(interval):>13}"
                if baseline
                else f"  {'':<21} {'':>9} {'':>8} {'':>13}"
            )
            self.say(f"{left}{right} {self.spread_text(row):>7} {threads:>3}  {self.verdict_text(row)}".rstrip())

    # ---- the bridges: fastbwd's way against the framework's own, case by case -------------

    def paired_cases(self, cases, baseline_attribute, op, variant, baseline_name, threads_for=None):
        """Time each case's ``fastbwd`` against its ``baseline_attribute`` callable (after its
        ``check()``) and print a row each: any case object with ``id``, ``label``, ``fastbwd``,
        ``check``, ``target`` and the baseline slots in. ``threads_for``: the thread count of
        every case, decided by the caller (JAX's, fixed when it starts); by default each case's
        own (:meth:`case_threads`)."""
        heading = "target" if self.full else "target (for the --full shapes)"
        width = max([len(case.label) for case in cases] + [60])
        self.say(
            f"{'case':<6} {'what':<{width}} {'fastbwd ms':>10} {baseline_name + ' ms':>10} {'speed-up':>8} "
            f"{'95% interval':>13} {'spread':>7} {'thr':>3}  {heading}"
        )
        for case in self.wanted(cases):
            self.progress(f"  {op}: checking and timing {case.id}")
            case.check()  # asserts: a wrong gradient ends the run
            self.bridge_checks += 1
            baseline = getattr(case, baseline_attribute)
            functions = [case.fastbwd] + ([baseline] if baseline is not None else [])
            pairs = [(0, 1 if baseline is not None else None)]
            if threads_for is None:
                timing, stall, threads = self.timed(case.id, functions, pairs)
            else:  # measured, to mark the row, but never switching: the thread count is the caller's
                threads, stall = threads_for, parallel_stall() if threads_for > 1 else None
                self.stalls += [stall] if stall is not None else []
                with self.on_threads(threads):
                    timing = alternating_rounds(functions, pairs, self.settings)
            seconds = timing.median(0)
            base_seconds = timing.median(1) if baseline is not None else None
            speedup, interval = timing.speedup(0, 1) if baseline is not None else (None, None)
            row = self.finish_row(
                dict(
                    op=op,
                    case=case.id,
                    label=case.label,
                    dtype="float32",
                    variant=variant,
                    ms=seconds * 1e3,
                    gbps=None,
                    pct_bandwidth=None,
                    baseline=baseline_name if baseline is not None else None,
                    baseline_ms=None if base_seconds is None else base_seconds * 1e3,
                    speedup=speedup,
                    speedup_interval=interval,
                    target=case.target,
                    note=getattr(case, "note", ""),
                ),
                timing.series(0, 1 if baseline is not None else None),
                timing,
                stall,
                threads,
            )
            other = (
                f"{base_seconds * 1e3:10.2f} {targets.speedup_text(row['speedup']):>8} "
                f"{targets.interval_text(interval):>13}"
                if base_seconds is not None
                else f"{'-':>10} {'-':>8} {'-':>13}"
            )
            self.say(
                f"{case.id:<6} {case.label:<{width}} {seconds * 1e3:10.2f} {other} {self.spread_text(row):>7} "
                f"{threads:>3}  {self.verdict_text(row)}".rstrip()
                + (f"  ({row['note']})" if row["note"] else "")
            )

    def prepared_cases(self, cases):
        """Time each prepared call against PyTorch's op(s) and its bare kernel call, alternating
        the three; a row each with the speed-up and the microseconds the call adds to its kernel."""
        heading = "target" if self.full else "target (for the --full shapes)"
        width = max([len(case.label) for case in cases] + [60])
        self.say(
            f"{'case':<6} {'what':<{width}} {'fastbwd us':>10} {'torch us':>9} {'kernel us':>9} {'adds us':>8} "
            f"{'speed-up':>8} {'95% interval':>13} {'spread':>7} {'thr':>3}  {heading}"
        )
        for case in self.wanted(cases):
            case.check()
            timing, stall, threads = self.timed(
                case.id, [case.fastbwd, case.torch, case.kernel], [(0, 1), (0, None)], rows=[(0, 1)]
            )
            seconds, base_seconds, kernel_seconds = (timing.median(index) for index in range(3))
            speedup, interval = timing.speedup(0, 1)
            row = self.finish_row(
                dict(
                    op="fastbwd",
                    case=case.id,
                    label=case.label,
                    dtype="float32",
                    variant="prepared",
                    ms=seconds * 1e3,
                    gbps=None,
                    pct_bandwidth=None,
                    baseline="torch",
                    baseline_ms=base_seconds * 1e3,
                    speedup=speedup,
                    speedup_interval=interval,
                    kernel_ms=kernel_seconds * 1e3,
                    overhead_us=(seconds - kernel_seconds) * 1e6,
                    target=case.target,
                    note="",
                ),
                timing.series(0, 1),
                timing,
                stall,
                threads,
            )
            self.say(
                f"{case.id:<6} {case.label:<{width}} {seconds * 1e6:10.2f} {base_seconds * 1e6:9.2f} "
                f"{kernel_seconds * 1e6:9.2f} {row['overhead_us']:8.2f} {targets.speedup_text(row['speedup']):>8} "
                f"{targets.interval_text(interval):>13} {self.spread_text(row):>7} {threads:>3}  "
                f"{self.verdict_text(row)}".rstrip()
            )

    def torch_bridge(self):
        """The PyTorch bridge's cases (``bench/torch_cases.py``) and the routing's per-call cost."""
        from .torch_cases import cases, direct_cases, measure_overhead, overhead_cases, prepared_cases

        self.progress("fastbwd.torch: checking and timing its cases")
        self.say(
            "\nfastbwd.torch (PyTorch models on fastbwd's backward): checking each case's gradients "
            "against plain PyTorch, then timing both in alternating rounds"
        )
        self.paired_cases(list(cases(quick=not self.full)), "torch", "fastbwd.torch", "autograd", "torch")
        if self.full:  # Inductor compiles each model twice: a minute or more on two cores
            from .torch_cases import compile_cases

            self.say(
                "\nfastbwd.torch under torch.compile (Inductor; fastbwd enabled before the first compiled call): "
                "checking each case's gradients against eager, then timing it against its baseline (the label says which)"
            )
            self.paired_cases(compile_cases(), "torch", "fastbwd.torch", "compiled", "baseline")
        self.say(
            "\nwarm direct calls on tiny inputs (NumPy arrays) against PyTorch's own ops on the same values, "
            "timed the same way"
        )
        self.paired_cases(direct_cases(), "torch", "fastbwd", "direct", "torch")
        self.say(
            "\nthe same calls prepared once (function.prepare, aclnn's two-phase call), timed the same way "
            "with the bare kernel call they end in"
        )
        self.prepared_cases(prepared_cases())
        self.say("\nper-call overhead of the routing, tiny inputs (median us of 2000 calls each way, interleaved)")
        self.say(f"{'case':<6} {'what':<62} {'routed':>7} {'direct':>7} {'adds':>6} {'PyTorch':>8} {'spread':>7}")
        for case in self.wanted(overhead_cases()):
            stall, threads = self.case_threads(case.id)
            with self.on_threads(threads):
                us = measure_overhead(case)
            # the widest of the three ways' spreads over their rounds of 100 calls
            spreads = [spread(values) for values in us.get("rounds", {}).values()]
            spreads = [value for value in spreads if value is not None]
            row = dict(
                op="fastbwd.torch overhead",
                case=case.id,
                label=case.label,
                dtype="float32",
                variant="routed",
                routed_us=us["routed"],
                direct_us=us["direct"],
                torch_us=us["torch"],
                spread=max(spreads) if spreads else None,
                stall=stall,
                threads=threads,
                target=None,
            )
            self.rows.append(row)
            self.say(
                f"{case.id:<6} {case.label:<62} {us['routed']:7.1f} {us['direct']:7.1f} "
                f"{us['routed'] - us['direct']:6.1f} {us['torch']:8.1f} {self.spread_text(row):>7}"
            )
        if self.full:
            self.sweep(compiled=False)
            self.sweep(compiled=True)

    def sweep(self, compiled):
        """The never-slower sweep (``bench/sweep.py``, issue 52): each operation at six sizes and
        one and two threads, fastbwd enabled (policy "auto") against plain PyTorch, eager or
        compiled; a row each, then the table of ratios."""
        from .sweep import cases

        what = "torch.compile (Inductor), with fastbwd against without" if compiled else "PyTorch eager"
        self.progress(f"fastbwd.torch sweep: {what}")
        self.say(
            f"\nnever slower, {what}: forward + backward of one call, fastbwd enabled (policy auto, around each "
            "round's steps) against plain PyTorch, alternating rounds; ratio = PyTorch's time / fastbwd's"
        )
        heading = "target" if self.full else "target (for the --full shapes)"
        self.say(
            f"{'case':<16} {'what':<64} {'fastbwd ms':>10} {'torch ms':>10} {'speed-up':>8} {'spread':>7}  {heading}"
        )
        rows = []
        for case in self.wanted(list(cases(compiled=compiled))):
            self.progress(f"  sweep: checking and timing {case.id}")
            case.check()
            self.bridge_checks += 1
            stall = parallel_stall()
            timing = alternating_rounds(
                [case.fastbwd, case.torch], [(0, 1)], self.settings, [case.fastbwd_context, case.torch_context]
            )
            seconds, base_seconds = timing.median(0), timing.median(1)
            row = self.finish_row(
                dict(
                    op="fastbwd.torch sweep",
                    case=case.id,
                    label=case.label,
                    dtype="float32",
                    variant="compiled" if compiled else "eager",
                    ms=seconds * 1e3,
                    gbps=None,
                    pct_bandwidth=None,
                    baseline="compiled" if compiled else "torch",
                    baseline_ms=base_seconds * 1e3,
                    speedup=base_seconds / seconds,
                    target=case.target,
                    note=case.note,
                    sweep_op=case.op,
                    shape=list(case.shape),
                ),
                timing.series(0, 1),
                timing,
                stall,
                case.threads,
            )
            rows.append(row)
            self.say(
                f"{case.id:<16} {case.label:<64} {seconds * 1e3:10.3f} {base_seconds * 1e3:10.3f} "
                f"{targets.speedup_text(row['speedup']):>8} {self.spread_text(row):>7}  {self.verdict_text(row)}".rstrip()
            )
        if rows:
            self.say("ratios (PyTorch's time / fastbwd's; ~: noisy or stalled), by size (N, C, H, W):")
            for line in targets.sweep_table(rows, "compiled" if compiled else "eager", self.max_spread):
                self.say(line)

    def jax_bridge(self):
        """The JAX bridge's cases (``bench/jax_cases.py``) and its per-call transport cost.
        Returns the jax version, None without jax.

        The thread count is decided once, before JAX starts: XLA sizes its own thread pool then.
        On one thread, XLA runs single-threaded (its flags) and fastbwd's kernels, which XLA calls
        from its own threads, run their serial twins (``_plans.launching``)."""
        flags = os.environ.get("XLA_FLAGS", "")
        stall, threads = self.case_threads("fastbwd.jax")
        started = "jax" in sys.modules
        if not started and "xla_force_host_platform_device_count" not in flags:
            # J9 splits a batch over two CPU devices, which XLA creates when jax starts; the
            # other cases run on the first, as with one
            flags = f"{flags} --xla_force_host_platform_device_count=2".strip()
        if not started and threads == 1:
            flags = f"{flags} {XLA_ONE_THREAD}"
        os.environ["XLA_FLAGS"] = flags
        try:
            import jax
        except ImportError:
            self.say("\nfastbwd.jax: jax is not installed, its cases are left out")
            return None
        from .jax_cases import cases, transport_overhead

        self.progress("fastbwd.jax: checking and timing its cases")

        self.say(
            f"\nfastbwd.jax (JAX {jax.__version__}, CPU: jax.jit(jax.grad(loss)) on fastbwd's backward): checking "
            "each case's gradients against JAX's own, then timing both"
        )
        if threads == 1 and XLA_ONE_THREAD not in os.environ.get("XLA_FLAGS", ""):
            self.say("(JAX started before this section with its own threads: only fastbwd's side runs on one)")
        chosen = list(cases(quick=not self.full))
        if threads == 1:  # two devices are two threads, whatever the flags say
            chosen = [case for case in chosen if case.id != "J9"]
            self.say("J9 (a batch split over two devices, a thread each) left out: timed on one thread")
        elif jax.device_count() < 2:
            self.say("J9 (a batch split over two devices) left out: jax started with one device (XLA_FLAGS)")
        one_thread = _plans.launching("serial") if threads == 1 else contextlib.nullcontext()
        transport = Settings(round_seconds=0.02, min_rounds=7, tolerance=0.05, budget=3.0)
        with one_thread:
            self.paired_cases(chosen, "jax", "fastbwd.jax", "jit(grad)", "jax", threads_for=threads)
            with self.on_threads(threads):
                timing = alternating_rounds(tuple(transport_overhead().values()), [(0, None), (1, None)], transport)
        one, many = timing.median(0), timing.median(1)
        per_call = (many - one) / 10
        slopes = [(m - o) / 10 for o, m in zip(timing.rounds[0], timing.rounds[1])]
        row = dict(
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
            spread=spread(slopes),
            rounds=len(slopes),
            settled=timing.settled,
            stall=stall,
            threads=threads,
        )
        self.rows.append(row)
        self.say(
            f"transport: {per_call * 1e6:.0f} us per FFI call (jitted programs of 1 and 11 chained calls on 4 KB "
            f"whose handler does nothing: {one * 1e6:.0f} and {many * 1e6:.0f} us), spread {self.spread_text(row)}"
        )
        if self.full:
            self.jax_sweep()
        return jax.__version__

    def jax_sweep(self):
        """The JAX bridge's never-slower sweep (``bench/jax_sweep.py``, issue 52): each thread
        count's rows checked and timed by a process of its own (on that many Numba threads and
        CPUs), a row each, then the table of ratios."""
        import types

        from .jax_sweep import THREADS, in_child, operations

        prefixes = self.args.cases
        ops = [
            op
            for op in operations()
            if not prefixes or any(f"SJ.{op}.".startswith(p) or p.startswith(f"SJ.{op}.") for p in prefixes)
        ]
        if not ops:  # --cases names none of the sweep's rows
            return
        self.say(
            "\nnever slower, JAX: jax.jit(jax.grad(loss)) of one call, fastbwd (policy auto: fastbwd.jax's functions; "
            "reach around the libraries' calls and models) against plain JAX, alternating rounds, each thread count in "
            "a process of its own on that many CPUs; ratio = JAX's time / fastbwd's"
        )
        heading = "target" if self.full else "target (for the --full shapes)"
        self.say(
            f"{'case':<18} {'what':<72} {'fastbwd ms':>10} {'jax ms':>10} {'speed-up':>8} {'spread':>7}  {heading}"
        )
        rows = []
        for threads in THREADS:
            self.progress(f"  sweep: JAX on {threads} thread(s), checking and timing its rows in a process of its own")
            for found in in_child(threads, self.settings, ops=ops):
                if prefixes and not found["id"].startswith(tuple(prefixes)):
                    continue
                self.bridge_checks += 1
                seconds, base_seconds = found["seconds"], found["base_seconds"]
                row = self.finish_row(
                    dict(
                        op="fastbwd.jax sweep",
                        case=found["id"],
                        label=found["label"],
                        dtype="float32",
                        variant="jit(grad)",
                        ms=seconds * 1e3,
                        gbps=None,
                        pct_bandwidth=None,
                        baseline="jax",
                        baseline_ms=base_seconds * 1e3,
                        speedup=base_seconds / seconds,
                        target=found["target"],
                        note=found["note"],
                        sweep_op=found["op"],
                        shape=found["shape"],
                    ),
                    found["series"],
                    types.SimpleNamespace(settled=found["settled"]),
                    found["stall"],
                    found["threads"],
                )
                rows.append(row)
                self.say(
                    f"{row['case']:<18} {row['label']:<72} {seconds * 1e3:10.3f} {base_seconds * 1e3:10.3f} "
                    f"{targets.speedup_text(row['speedup']):>8} {self.spread_text(row):>7}  "
                    f"{self.verdict_text(row)}  ({row['note']})".rstrip()
                )
        if rows:
            self.say(
                "ratios (JAX's time / fastbwd's; ~: noisy or stalled), by size (N, C, H, W; NHWC: the same numbers):"
            )
            for line in targets.sweep_table(rows, "jit(grad)", self.max_spread, op="fastbwd.jax sweep"):
                self.say(line)

    # ---- the whole run ------------------------------------------------------------------

    def run(self):
        args = self.args
        torch = None
        if not args.no_torch:
            try:
                import torch
            except ImportError:
                torch = None
        if torch is not None:
            torch.set_num_threads(numba.get_num_threads())
        self.torch = torch
        machine = self.machine(torch)
        self.progress("the main job: the report (a summary, then each row) prints when the run ends")
        try:
            measured = self.bandwidth()
            self.operators(torch is not None, measured["bandwidth_gbps"])
            if torch is not None and self.selected("torch"):
                self.torch_bridge()
            if not args.no_jax and self.selected("jax"):
                machine["jax"] = self.jax_bridge()
        except BaseException:  # a failed check or an interrupt: what was measured, then the error
            say("\n".join(self.header + self.details + [self._partial]))
            raise
        end = copy_bandwidth(self.yardstick_bytes)
        measured["bandwidth_readings_gbps"].append(end)
        if _disagree(measured["bandwidth_gbps"], end):
            self.warn(
                f"the copy bandwidth read {end:.1f} GB/s at the end of the run against "
                f"{measured['bandwidth_gbps']:.1f} at its start: the machine's speed changed during the run."
            )
        summary = targets.summarize(self.rows, self.max_spread, judge=self.full)
        self.progress("")
        if sys.stderr.isatty():
            sys.stderr.write("\r\x1b[K")
        report = [*self.header, self.machine_line(machine, measured), *self.threads_lines(), ""]
        report += [*self.summary_lines(), ""]
        report += self.reading_lines() + self.details + ["", targets.summary_text(summary, self.max_spread)]
        say("\n".join(report))
        machine["one_thread_since"], machine["one_thread_why"] = self.one_thread_since, self.one_thread_why
        results = dict(
            machine=machine,
            **measured,
            quick=not self.full,
            max_spread=self.max_spread,
            settings=dataclasses.asdict(self.settings),
            warnings=self.warnings,
            summary=summary,
            rows=self.rows,
        )
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=1)
                handle.write("\n")
            say(f"results saved to {args.json}")
        for path in args.write or ():
            to_table.write(path, results)
            say(f"{path}: benchmark tables regenerated from this run")
        return 0

    # ---- the report: the machine in a line, the summary, then each row -------------------

    def untrustworthy(self):
        return [row for row in self.rows if targets.noisy(row, self.max_spread) or targets.stalled(row)]

    def machine_line(self, machine, measured):
        """What the machine's load did to the run, said once, in one line."""
        load, others = machine["load_average"][0], machine.get("running_elsewhere")
        stalls = self.stalls or [machine["parallel_stall"]]
        readings = measured["bandwidth_readings_gbps"]
        unsure, rows = len(self.untrustworthy()), len(self.rows)
        state = (
            f"load average {load:.2f} on {machine['cpus']} CPUs at the start"
            + (f", {others:.1f} other processes running" if others is not None else "")
            + f"; parallel calls took up to {max(stalls):.1f}x their one-thread time"
            + f"; the copy bandwidth read {', '.join(f'{value:.1f}' for value in readings)} GB/s"
        )
        if not self.warnings and not unsure:
            return f"Machine: quiet enough ({state}); every row is trustworthy."
        if not unsure:
            return f"Machine: BUSY, other processes hold the cores ({state}); every row is trustworthy all the same."
        return (
            f"Machine: BUSY, other processes hold the cores ({state}): {unsure} of {rows} rows are untrustworthy "
            f"(a median not known to within {targets.spread_text(self.max_spread)}, or timed while parallel calls stalled "
            f"above {targets.STALL_LIMIT:g}x), marked below and left out of the standing and the verdicts."
        )

    def threads_lines(self):
        """What thread count the rows ran on, when parallel calls stalled (one line), or nothing."""
        if self.one_thread_since is None:
            return []
        ones = sum(1 for row in self.rows if row.get("threads") == 1)
        since = "from the start" if self.one_thread_since == "the start" else f"from {self.one_thread_since} on"
        cause = (
            "Parallel calls stalled"
            if self.one_thread_why == "stalled"
            else f"{self.one_thread_since}'s two-thread rounds disagreed (a load that came after the check for stalls)"
        )
        return [
            f"{cause}, so {since} the run timed kernel against kernel on ONE thread on both sides "
            f"(fastbwd's and PyTorch's or JAX's; {ones} of {len(self.rows)} rows, 'thr' 1 below)"
            + ("" if self.args.budget is not None else f", each case for up to {self.settings.budget:g} s")
            + ": the two-thread figures need a quiet machine (the published ones: docs/benchmarks.md; "
            "`--threads 2` forces two here)."
        ]

    def summary_lines(self):
        """Each operator and bridge: its speed-up against the framework's own code, its tiny calls'
        apart, how many of its rows the load made untrustworthy, its standing (and targets)."""
        groups = targets.group_summaries(self.rows, self.max_spread, judge=self.full)
        size = "full shapes" if self.full else "small shapes; the targets are for --full"
        lines = [
            f"Summary ({size}): fastbwd's speed-up against PyTorch's and JAX's own code, the median of the "
            f"trustworthy rows and their range; tiny calls (fastbwd under {targets.TINY_MS:g} ms: Python's per-call "
            "cost decides) apart",
            f"  {'operator or bridge':<30} {'against':<31} {'speed-up':<22} {'tiny calls':<20} {'rows':>4} "
            f"{'untrustworthy':>13} {'thr':>4}  {'standing' + ('; targets' if self.full else '')}",
        ]
        for group in groups:
            verdicts = f"; {targets.verdicts_text(group)}" if self.full else ""
            lines.append(
                f"  {group['name']:<30} {group['against']:<31} {targets.speedups_text(group['speedups']):<22} "
                f"{targets.speedups_text(group['tiny']):<20} {group['rows']:>4} {group['unsure']:>13} "
                f"{targets.threads_text(group['threads']):>4}  {targets.standing(group)}{verdicts}"
            )
        for name, worst in targets.sweep_worst(self.rows, self.max_spread).items():
            ratio = (
                "no trustworthy row"
                if worst["worst"] is None
                else "worst {} ({})".format(targets.speedup_text(worst["worst"][0]), worst["worst"][1])
            )
            lines.append(
                f"  never slower, {name}: {ratio} over {worst['rows'] - worst['unsure']} trustworthy rows"
                f" ({worst['unsure']} untrustworthy)"
            )
        mismatches = [f"{name}: {verdict}" for name, verdict in self.checks if verdict.startswith("MISMATCH")]
        checks = (
            f"Checks: {len(self.checks) - len(mismatches)} of {len(self.checks)} operators match the float64 "
            f"reference; {self.bridge_checks} bridge cases' results match plain PyTorch's and JAX's."
        )
        lines.append(checks + (f" MISMATCH: {'; '.join(mismatches)}" if mismatches else ""))
        return lines

    def reading_lines(self):
        """How to read the rows below."""
        lines = [
            f"Each row below: alternating rounds of fastbwd and its baseline (until the median is known to within "
            f"{100 * self.settings.tolerance:g}% or {self.settings.budget:g} s per case): ms, medians; speed-up, the "
            "median of the rounds' paired ratios, with its 95% interval (distribution-free); spread: half the "
            "interquartile range of the rounds' speed-ups (or times) over their median; 'noisy': a median not known to "
            f"within {targets.spread_text(self.max_spread)} (neither the spread nor the half-width of the median's 95% "
            "interval within it); 'stalled': timed on several threads while parallel calls waited "
            "for descheduled threads; thr: the threads of each side. A first run compiles each kernel it calls (seconds per "
            "operator; `python -m fastbwd --precompile` compiles them all ahead); the checks include that time, "
            "the timings do not."
        ]
        if not self.full:
            lines.append(
                "Small shapes: a case id ending in q is the --full case of that id at a small size (its shapes are "
                "printed); the data stays in the caches, so no % of the memory's copy rate; `python3 -m bench "
                "--full` runs the full-size cases and judges their targets."
            )
        return lines


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python3 -m bench",
        description="The main job: checks and benchmarks every operator against PyTorch and JAX (see bench/__main__.py).",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="the full-size docs/semantics.md §6 shapes (the published tables; tens of minutes)",
    )
    parser.add_argument("--json", metavar="FILE", help="save the results as JSON")
    parser.add_argument(
        "--write", nargs="+", metavar="FILE", help="regenerate the benchmark tables in these files from the run"
    )
    parser.add_argument(
        "--publish",
        action="store_true",
        help="with --full: save bench/results.json and regenerate the tables of README.md and docs/benchmarks.md",
    )
    parser.add_argument(
        "--ops",
        nargs="+",
        metavar="OP",
        choices=list(OPERATORS) + ["torch", "jax"],
        help=ops_help("; torch: the PyTorch bridge's cases; jax: the JAX bridge's cases"),
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        metavar="ID",
        help="only the bridges' cases whose id starts with one of these (T6 T8 O4 ...; with --ops torch or jax)",
    )
    parser.add_argument(
        "--threads",
        choices=["auto"] + [str(count) for count in range(1, numba.config.NUMBA_NUM_THREADS + 1)],
        help=(
            "the thread count of both sides (fastbwd's and PyTorch's or JAX's); auto (the default without "
            "--publish): all of Numba's, and one from the first case timed while parallel calls stall or whose "
            "two-thread rows are noisy (a busy machine); with --publish all of Numba's, rows timed while parallel calls stall marked"
        ),
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baselines and cases")
    parser.add_argument("--no-jax", action="store_true", help="skip the fastbwd.jax section")
    parser.add_argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help=f"the most seconds a case's rounds may take (default {FULL.budget:g} with --full, {QUICK.budget:g} without)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        help=(
            "rounds stop when each row's median is known to within this fraction "
            f"(default {FULL.tolerance:g} with --full, {QUICK.tolerance:g} without)"
        ),
    )
    parser.add_argument(
        "--max-spread",
        type=float,
        default=to_table.DEFAULT_MAX_SPREAD,
        help="a row whose median is not known to within this fraction (neither its rounds' spread nor the "
        "half-width of their median's 95%% interval within it) is noisy, its target unjudged (default %(default)g)",
    )
    args = parser.parse_args(argv)
    if args.publish:
        if not args.full or args.ops or args.cases or args.no_torch or args.no_jax:
            parser.error(
                "--publish records the whole --full run: give --full, and no --ops, --cases, --no-torch or --no-jax"
            )
        args.json = args.json or str(ROOT / "bench" / "results.json")
        # the published figures are the two-thread ones (a busy machine's rows are marked stalled)
        args.threads = args.threads or str(numba.config.NUMBA_NUM_THREADS)
        args.write = args.write or [str(ROOT / name) for name in PUBLISHED]
    for path in args.write or ():
        if not to_table.has_region(Path(path).read_text()):  # fail now rather than after the run
            parser.error(
                f"{path} has no benchmark tables to regenerate (no line {to_table.BEGIN!r} or {to_table.HEADLINE_BEGIN!r})"
            )
    return Run(args).run()


if __name__ == "__main__":
    sys.exit(main())
