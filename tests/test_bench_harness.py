"""The main job's machinery (bench/): targets and verdicts, the noise measurement, the README's
tables, the one command that regenerates them, and the pytest-benchmark tracking workflow."""

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import time

import numba
import numpy as np
import pytest

from bench import __main__ as main_job
from bench import targets, timing, to_table

from conftest import child_environment

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---- targets ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (">= 5x", 5.0),
        (">= 1.5x", 1.5),
        (">=0.8x", 0.8),
        ("≥ 5×", 5.0),
        ("≥ 1.0×; report", 1.0),
        ("every pair fused; ≥ 1.0×", 1.0),
        (">= 1.0x; report the fused count", 1.0),
        ("report", None),
        ("trains; report", None),
        ("", None),
        (None, None),
    ],
)
def test_threshold_reads_every_way_the_cases_write_targets(text, expected):
    assert targets.threshold(text) == expected


def _row(speedup, target, spread=0.02, **more):
    return dict(op="fastbwd.torch", case="T9", dtype="float32", variant="autograd", baseline="torch",
                speedup=speedup, target=target, spread=spread, **more)  # fmt: skip


def test_verdicts():
    assert targets.verdict(_row(5.2, ">= 5x"), 0.1) == targets.MET
    assert targets.verdict(_row(5.0, ">= 5x"), 0.1) == targets.MET
    assert targets.verdict(_row(4.99, ">= 5x"), 0.1) == targets.MISSED
    # too noisy to judge, whichever side of the target it fell
    assert targets.verdict(_row(9.0, ">= 5x", spread=0.3), 0.1) == targets.UNTRUSTED
    assert targets.verdict(_row(1.0, ">= 5x", spread=0.3), 0.1) == targets.UNTRUSTED
    assert targets.verdict(_row(3.0, "trains; report"), 0.1) is None
    assert targets.verdict(_row(None, ">= 5x"), 0.1) is None
    # results saved before spreads were measured: judged on the speed-up alone
    assert targets.verdict(_row(6.0, ">= 5x", spread=None), 0.1) == targets.MET
    # timed while parallel calls stalled: the scheduler's numbers, however steady
    assert targets.verdict(_row(6.0, ">= 5x", stall=70.0), 0.1) == targets.UNTRUSTED
    assert targets.verdict(_row(6.0, ">= 5x", stall=1.2), 0.1) == targets.MET
    assert targets.trust_text(_row(6.0, ">= 5x", spread=0.5, stall=70.0), 0.1) == "noisy stalled"
    assert targets.trust_text(_row(6.0, ">= 5x", stall=0.8), 0.1) == ""
    # timed on one thread on both sides: no call waits for a worker thread, whatever the stall
    assert targets.verdict(_row(6.0, ">= 5x", stall=70.0, threads=1), 0.1) == targets.MET
    assert targets.verdict(_row(6.0, ">= 5x", stall=70.0, threads=2), 0.1) == targets.UNTRUSTED


def test_a_row_is_trusted_when_its_median_is_known():
    """Noisy means a median not known to within the limit: neither do the rounds agree (their
    spread) nor were there enough of them to pin the median down (the half-width of its 95%
    interval, ``error``): a busy machine widens the spread, more rounds narrow the interval."""
    busy = _row(9.0, ">= 5x", spread=0.3, error=0.06)
    assert targets.uncertainty(busy) == 0.06 and not targets.noisy(busy, 0.1)
    assert targets.verdict(busy, 0.1) == targets.MET and targets.trust_text(busy, 0.1) == ""
    assert targets.verdict(_row(4.0, ">= 5x", spread=0.3, error=0.06), 0.1) == targets.MISSED
    # few rounds that agree: a wide interval (the 2nd and 9th of 10 rounds), a narrow spread
    few = _row(80.0, ">= 5x", spread=0.03, error=0.12)
    assert targets.uncertainty(few) == 0.03 and targets.verdict(few, 0.1) == targets.MET
    both = _row(9.0, ">= 5x", spread=0.12, error=0.15)
    assert targets.noisy(both, 0.1) and targets.verdict(both, 0.1) == targets.UNTRUSTED
    assert targets.noisy(_row(9.0, ">= 5x", spread=0.3, error=0.1000001), 0.1)
    assert not targets.noisy(_row(9.0, ">= 5x", spread=0.5, error=0.1), 0.1)
    # no interval (fewer than 6 rounds, or saved before the main job kept it): the spread decides
    assert targets.uncertainty(_row(9.0, ">= 5x", spread=0.3, error=None)) == 0.3
    assert targets.noisy(_row(9.0, ">= 5x", spread=0.3), 0.1)
    assert targets.uncertainty(_row(9.0, ">= 5x", spread=None)) is None
    summary = targets.summarize([busy | {"case": "T1"}, both | {"case": "T2"}], 0.1)
    assert summary["met"] == ["T1"] and summary["untrusted"] == ["T2: 9.00x ±12% noisy"]
    assert summary["noisy"] == ["T2 ±12%"]


def test_a_share_of_the_copy_bandwidth_as_a_target():
    """``>= 75% of copy`` (issue 53) judges a row's %bw column, with or without a speed-up."""
    assert targets.copy_share(">= 75% of copy") == 75.0 and targets.threshold(">= 75% of copy") is None
    assert targets.copy_share("≥ 72.5 % of copy") == 72.5 and targets.copy_share(">= 2x") is None
    row = dict(_row(None, ">= 75% of copy"), pct_bandwidth=80.0)
    assert targets.verdict(row, 0.1) == targets.MET
    assert targets.verdict(row | {"pct_bandwidth": 74.9}, 0.1) == targets.MISSED
    assert targets.verdict(row | {"pct_bandwidth": None}, 0.1) is None  # a small-shape run: not measured
    assert targets.verdict(row | {"spread": 0.3}, 0.1) == targets.UNTRUSTED
    both = dict(_row(1.2, ">= 1.5x; >= 75% of copy"), pct_bandwidth=90.0)
    assert targets.verdict(both, 0.1) == targets.MISSED and targets.verdict(both | {"speedup": 1.6}, 0.1) == targets.MET
    summary = targets.summarize([row | {"pct_bandwidth": 60.0, "case": "G1"}], 0.1)
    assert summary["missed"] == ["G1: 60% of copy, target >= 75% of copy"]


def test_summary_names_what_was_missed_and_what_cannot_be_trusted():
    kernel = dict(op="avg_pool2d_backward", case="A1", dtype="float32", variant="out=", baseline="torch out=")
    rows = [
        _row(6.0, ">= 5x"),
        _row(0.79, ">= 1.0x") | {"case": "T6.2"},
        _row(2.0, ">= 1.4x", spread=0.25) | {"case": "T3"},
        _row(1.1, "report", spread=0.5) | {"case": "T5"},
        kernel | dict(speedup=5.5, target=">= 6x", spread=0.01),
        _row(9.0, ">= 3x", stall=12.0) | {"case": "T2"},
    ]
    summary = targets.summarize(rows, 0.1)
    assert summary["met"] == ["T9"]
    assert summary["missed"] == ["T6.2: 0.79x, target >= 1.0x", "A1 float32 out= vs torch out=: 5.50x, target >= 6x"]
    assert summary["untrusted"] == ["T3: 2.00x ±25% noisy", "T2: 9.00x ±2.0% stalled"]
    assert summary["noisy"] == ["T3 ±25%", "T5 ±50%"] and summary["stalled"] == ["T2"]
    text = targets.summary_text(summary, 0.1)
    assert "5 rows have one; 1 met" in text and "2 missed" in text and "2 not trustworthy this run" in text
    assert "2 of 6 rows' medians were not known to within ±10%" in text
    assert "1 of 6 rows were timed while parallel calls stalled" in text
    # small shapes: the targets do not apply, the noise is still reported
    quick = targets.summarize(rows, 0.1, judge=False)
    assert quick["met"] == quick["missed"] == quick["untrusted"] == [] and len(quick["noisy"]) == 2
    assert quick["stalled"] == ["T2"]
    assert "no verdict" in targets.summary_text(quick, 0.1)


# ---- the noise measurement -----------------------------------------------------------------


def test_spread_and_median_error():
    assert timing.spread([1.0, 1.0]) is None  # too few rounds to say
    assert timing.spread([1.0, 1.0, 1.0, 1.0]) == 0.0
    values = [0.9, 1.0, 1.0, 1.1, 1.2]
    assert timing.spread(values) == pytest.approx((1.1 - 1.0) / 2 / 1.0)
    assert timing.median_error(values) is None  # five rounds give no 95% interval
    # more rounds of the same noise: a narrower interval
    many = [1.0 + 0.01 * ((7 * i) % 21 - 10) for i in range(60)]
    assert timing.median_error(many) < timing.median_error(many[:12]) <= 0.1


def test_median_interval_is_the_binomial_order_statistics():
    """The ranks of the distribution-free 95% interval of the median (the tables' values: n = 6:
    the extremes, n = 10: the 2nd and 9th, n = 20: the 6th and 15th), and its coverage measured
    on skewed noise (a median 1, heavy upper tail: what a shared machine's rounds look like)."""
    assert timing.median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) is None
    assert timing.median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)
    assert timing.median_interval(list(range(1, 11))) == (2.0, 9.0)
    assert timing.median_interval(list(range(1, 21))) == (6.0, 15.0)
    rng = np.random.default_rng(0)
    trials = 2000
    covered = 0
    for _ in range(trials):
        rounds = rng.lognormal(0.0, 0.5, 15) ** 2  # the population's median is 1
        low, high = timing.median_interval(list(rounds))
        covered += low <= 1.0 <= high
    assert covered / trials >= 0.95 - 3 * (0.05 * 0.95 / trials) ** 0.5


def test_a_speedup_is_the_median_of_the_paired_rounds():
    result = timing.Timing(samples=[[], []], rounds=[[1.0, 2.0, 1.0, 1.0, 2.0, 1.0], [3.0, 4.0, 2.0, 3.0, 8.0, 3.0]],
                           seconds=0.0, settled=True)  # fmt: skip
    # ratios 3, 2, 2, 3, 4, 3: their median, and the extremes as the interval of six rounds
    assert result.speedup(0, 1) == (3.0, (2.0, 4.0))


def _run(threads="auto"):
    args = argparse.Namespace(full=False, tolerance=None, budget=None, max_spread=0.1, threads=threads, ops=None,
                              cases=None)  # fmt: skip
    return main_job.Run(args)


@pytest.mark.skipif(numba.get_num_threads() < 2, reason="one thread already")
def test_the_run_times_one_thread_on_both_sides_from_the_first_stall(monkeypatch):
    """--threads auto: each case measures whether parallel calls stall; from the first that does,
    the rest of the run runs one thread on each side (Numba's and PyTorch's), and says so."""
    stalls = iter([1.1, 5.0])
    monkeypatch.setattr(main_job, "parallel_stall", lambda: next(stalls))
    run = _run()
    threads = numba.get_num_threads()
    assert run.case_threads("U1q float32") == (1.1, threads)
    assert run.settings.budget == main_job.QUICK.budget
    assert run.case_threads("A1q float32") == (5.0, 1)
    # a busy machine: more rounds per case, whose median's interval they narrow
    assert run.settings.budget == main_job.BUSY_BUDGET * main_job.QUICK.budget
    assert run.case_threads("T1") == (None, 1)  # measured no more
    assert run.one_thread_since == "A1q float32" and run.stalls == [1.1, 5.0]
    torch = pytest.importorskip("torch")
    run.torch, torch_threads = torch, torch.get_num_threads()
    with run.on_threads(1):
        assert numba.get_num_threads() == 1 and torch.get_num_threads() == 1
    assert numba.get_num_threads() == threads and torch.get_num_threads() == torch_threads
    run.rows = [_row(3.0, None, threads=1), _row(2.0, None, stall=1.1, threads=threads)]
    (line,) = run.threads_lines()
    assert line.startswith("Parallel calls stalled, so from A1q float32 on the run timed kernel against kernel on ONE")
    assert "1 of 2 rows" in line and f"each case for up to {3 * main_job.QUICK.budget:g} s" in line


@pytest.mark.skipif(numba.get_num_threads() < 2, reason="one thread already")
def test_a_budget_given_stays_on_a_busy_machine(monkeypatch):
    monkeypatch.setattr(main_job, "parallel_stall", lambda: 5.0)
    run = main_job.Run(argparse.Namespace(**vars(_run().args) | {"budget": 0.5}))
    assert run.case_threads("U1q float32") == (5.0, 1) and run.settings.budget == 0.5
    run.rows = [_row(3.0, None, threads=1)]
    assert "each case for up to" not in run.threads_lines()[0]


@pytest.mark.skipif(numba.get_num_threads() < 2, reason="one thread already")
def test_fixed_threads_keep_their_count_and_mark_stalled_rows(monkeypatch):
    monkeypatch.setattr(main_job, "parallel_stall", lambda: 9.0)
    run = _run(str(numba.get_num_threads()))
    assert run.case_threads("U1q float32") == (9.0, numba.get_num_threads())
    assert run.one_thread_since is None and run.threads_lines() == []
    assert run.settings.budget == main_job.QUICK.budget  # the run chose its threads: nor is its budget changed
    assert targets.stalled(_row(3.0, None, stall=9.0, threads=numba.get_num_threads()))


class _Rounds:
    """A stand-in for timing.Timing: every pair's per-round values."""

    def __init__(self, values):
        self.values = values

    def series(self, index, baseline=None):
        return list(self.values)


def _timings(monkeypatch, *rounds):
    """``alternating_rounds`` answering with ``rounds`` in turn; returns the thread counts and
    budgets it was called with."""
    answers, calls = iter(rounds), []

    def fake(functions, series, settings):
        calls.append((numba.get_num_threads(), settings.budget))
        return _Rounds(next(answers))

    monkeypatch.setattr(main_job, "alternating_rounds", fake)
    return calls


NOISY = [1.0, 1.5, 0.6, 1.4, 0.7, 1.3, 0.8]  # spread and interval both wider than 10%
STEADY = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0]


@pytest.mark.skipif(numba.get_num_threads() < 2, reason="one thread already")
def test_a_case_noisy_on_two_threads_is_timed_again_on_one_and_the_run_stays_there(monkeypatch):
    """--threads auto: the stall check passed, but a load that came after it made the case's
    two-thread rounds disagree; the case is timed again on one thread (3x the budget), its rows are
    those, and so is every case after it."""
    monkeypatch.setattr(main_job, "parallel_stall", lambda: 1.1)
    threads = numba.get_num_threads()
    calls = _timings(monkeypatch, STEADY, NOISY, STEADY, NOISY)
    run = _run()
    budget = main_job.QUICK.budget
    assert run.timed("U1q float32", [None, None], [(0, 1)])[1:] == (1.1, threads)  # steady: kept
    assert run.one_thread_since is None and calls == [(threads, budget)]
    timing, stall, used = run.timed("A1q float32", [None, None], [(0, 1), (0, None)])
    assert (stall, used) == (None, 1) and timing.values == STEADY
    assert calls[1:] == [(threads, budget), (1, main_job.BUSY_BUDGET * budget)]
    assert run.one_thread_since == "A1q float32" and run.one_thread_why == "noisy"
    assert run.timed("P1q float32", [None, None], [(0, 1)])[1:] == (None, 1)  # one thread from now on,
    assert calls[3:] == [(1, main_job.BUSY_BUDGET * budget)]  # noisy or not: no third try
    run.rows = [_row(3.0, None, threads=1)]
    (line,) = run.threads_lines()
    assert line.startswith("A1q float32's two-thread rounds disagreed (a load that came after the check for stalls), "
                           "so from A1q float32 on the run timed kernel against kernel on ONE thread")  # fmt: skip


@pytest.mark.skipif(numba.get_num_threads() < 2, reason="one thread already")
def test_only_the_rows_a_case_prints_decide_whether_it_is_timed_again(monkeypatch):
    """A prepared call's rounds of its bare kernel (no row of their own) may scatter; its row, the
    speed-up over PyTorch, decides. Fixed thread counts are never switched."""
    monkeypatch.setattr(main_job, "parallel_stall", lambda: 1.1)
    threads = numba.get_num_threads()

    class Split(_Rounds):
        def series(self, index, baseline=None):
            return STEADY if baseline is not None else NOISY

    monkeypatch.setattr(main_job, "alternating_rounds", lambda functions, series, settings: Split(None))
    run = _run()
    assert run.timed("O1p", [None] * 3, [(0, 1), (0, None)], rows=[(0, 1)])[1:] == (1.1, threads)
    assert run.one_thread_since is None
    assert run.timed("O1p", [None] * 3, [(0, 1), (0, None)])[1:] == (None, 1)
    fixed = _run(str(threads))
    calls = _timings(monkeypatch, NOISY)
    assert fixed.timed("U1q float32", [None, None], [(0, 1)])[1:] == (1.1, threads) and len(calls) == 1
    assert fixed.one_thread_since is None


def test_interval_and_threads_texts():
    assert targets.interval_text((1.8, 12.0)) == "1.80x-12.0x" and targets.interval_text(None) == "-"
    assert targets.threads_text({2}) == "2" and targets.threads_text({1, 2}) == "1-2"
    assert targets.threads_text(set()) == "-"


def _sleeper(seconds):
    return lambda: time.sleep(seconds)


def test_steady_calls_settle_after_the_minimum_rounds():
    settings = timing.Settings(round_seconds=0.002, min_rounds=5, tolerance=0.1, budget=20.0)
    result = timing.alternating_rounds([_sleeper(0.002), _sleeper(0.004)], [(0, 1)], settings)
    assert result.settled and len(result.rounds[0]) == len(result.rounds[1]) >= 5
    assert result.median(1) / result.median(0) == pytest.approx(2.0, rel=0.5)
    assert len(result.series(0, 1)) == len(result.rounds[0])


def test_noisy_calls_run_until_the_budget_and_show_a_wide_spread():
    state = {"calls": 0}

    def erratic():  # alternately fast and 20x slower: one call a round, so round after round
        state["calls"] += 1
        time.sleep(0.0005 if state["calls"] % 2 else 0.01)

    settings = timing.Settings(round_seconds=0.001, min_rounds=3, tolerance=0.01, budget=0.5)
    start = time.perf_counter()
    result = timing.alternating_rounds([erratic], [(0, None)], settings)
    assert not result.settled and time.perf_counter() - start < 2.0
    # half the interquartile range over the median: about 0.9 when the median falls between a fast
    # and a slow call, (0.01 - 0.0005) / 2 / 0.01 = 0.475 when an odd count puts it on a slow one
    # (the bound 0.5 failed so in CI); either way far wider than the 10% that marks a row noisy
    assert timing.spread(result.series(0)) > 0.3


# ---- the published tables -------------------------------------------------------------------


def _results(quick=False):
    machine = dict(fastbwd="0.1.0", numba="0", numpy="0", python="3", cpu="CPU", cpus=2, threads=2,
                   threading_layer="omp", torch="2", jax="0.1", load_average=[2.5, 1.0, 0.5], running_elsewhere=1.5)  # fmt: skip
    kernel = dict(op="replication_pad2d_backward", case="P1", label="(16,64,128,128) pad 3", dtype="float32",
                  gbps=20.0, pct_bandwidth=50.0)  # fmt: skip
    rows = [
        kernel | dict(variant="alloc", ms=2.0, baseline="torch", baseline_ms=12.0, speedup=6.0, target=">= 5x", spread=0.01),
        kernel | dict(variant="out=", ms=1.0, baseline="torch out=", baseline_ms=2.0, speedup=2.0, target=">= 3x", spread=0.3, stall=5.0),
        dict(op="fastbwd.torch", case="C9", label="a new row", dtype="float32", variant="autograd", ms=1.0,
             gbps=None, pct_bandwidth=None, baseline="torch", baseline_ms=0.9, speedup=0.9, target="≥ 1.0×", spread=0.02),
        dict(op="fastbwd", case="O9", label="a tiny call", dtype="float32", variant="direct", ms=0.0075,
             gbps=None, pct_bandwidth=None, baseline="torch", baseline_ms=0.006, speedup=0.8, target=">= 1.0x", spread=0.01),
    ]  # fmt: skip
    return dict(machine=machine, bandwidth_gbps=40.0, bandwidth_readings_gbps=[40.0, 20.0, 39.0],
                case_size_copy_gbps=30.0, stream_write_gbps=25.0, quick=quick, max_spread=0.1,
                warnings=["the machine is busy"], rows=rows)  # fmt: skip


def test_table_shows_spreads_verdicts_warnings_and_the_summary():
    text = to_table.table(_results())
    assert "**Warning from this run:** the machine is busy" in text
    assert "40.0, 20.0, 39.0 GB/s" in text and "Load average at the start: 2.50 (1 min) on 2 CPUs, 1.5 other" in text
    assert "| **6.00x** | ±1.0% | >= 5x: met |" in text
    assert "| **2.00x** | ±30%, noisy stalled | >= 3x: not trustworthy |" in text
    assert "| C9 | a new row | 1.00 | 0.90 | **0.90x** | ±2.0% | ≥ 1.0×: **missed** |" in text  # a new row slots in
    assert "| O9 | a tiny call | 7.5 | 6.0 | **0.80x** | ±1.0% | >= 1.0x: **missed** |" in text  # in microseconds
    assert text.endswith(targets.summary_text(targets.summarize(_results()["rows"], 0.1), 0.1))
    quick = to_table.table(_results(quick=True))
    assert "small shapes" in quick and ">= 5x (at full size)" in quick and ": met" not in quick


def test_tables_say_when_the_run_timed_one_thread_on_both_sides():
    results = _results()
    assert "one thread" not in to_table.table(results) + to_table.headline(results)
    results["machine"]["one_thread_since"] = "P1 float32"
    note = "Parallel calls stalled: from P1 float32 on, one thread on both sides (kernel against kernel)."
    assert note in to_table.table(results)
    assert "; parallel calls stalled: from P1 float32 on, one thread on both sides" in to_table.headline(results)
    results["machine"]["one_thread_why"] = "noisy"
    note = "A case's two-thread rounds disagreed: from P1 float32 on, one thread on both sides (kernel against kernel)."
    assert note in to_table.table(results)
    assert "; a case's two-thread rounds disagreed: from P1 float32 on, one" in to_table.headline(results)


def test_regenerated_replaces_only_the_generated_regions():
    for begin, end, make in to_table.REGIONS:
        page = f"# title\\n\\nbefore\\n\\n{begin}\\nold table\\n{end}\\n\\nafter\\n"
        new = to_table.regenerated(page, _results())
        assert new.startswith("# title\\n\\nbefore\\n\\n") and new.endswith(f"{end}\\n\\nafter\\n")
        assert to_table.region(new, begin, end) == make(_results())
        assert to_table.regenerated(new, _results()) == new  # idempotent
    assert not to_table.has_region("# no tables\\n")


def test_headline_has_a_row_per_operator_and_bridge():
    text = to_table.headline(_results())
    # the pad's rows against PyTorch: 6x, and 2x noisy and stalled (left out of the speed-up); one target met,
    # one not trustworthy; a direct call of 7.5 us is a tiny call, its ratio Python's per-call cost
    assert "| `replication_pad2d_backward` | PyTorch | 6.00x | - | 2 | 1 met, 1 not trustworthy |" in text
    assert "| `fastbwd.torch` | PyTorch eager | 0.90x | - | 1 | 1 missed |" in text
    assert "| `tiny direct calls` | PyTorch's own ops | - | 0.80x | 1 | 1 missed |" in text
    assert (
        "One `python3 -m bench --full` run on CPU, 2 threads (omp); torch 2, jax 0.1, numba 0; load average 2.50"
        in text
    )
    quick = to_table.headline(_results(quick=True))
    assert "not judged (small shapes)" in quick and "small shapes, not `--full`" in quick


def _sweep_row(op, shape, threads, speedup, variant="eager", **extra):
    case = f"S{'C' if variant == 'compiled' else 'E'}.{op}.{shape[1]}.{threads}t"
    target = "report" if op == "roi" else ">= 0.97x"
    return (
        dict(
            op="fastbwd.torch sweep",
            case=case,
            label=case,
            variant=variant,
            speedup=speedup,
            ms=0.5,
            target=target,
            sweep_op=op,
            shape=list(shape),
            threads=threads,
            baseline="torch",
            spread=0.01,
            stall=1.0,
        )
        | extra
    )


def test_the_sweep_summary_names_its_worst_trustworthy_row_with_a_target():
    rows = [
        _sweep_row("pad", (2, 8, 4, 4), 1, 0.95),
        _sweep_row("pad", (2, 8, 4, 4), 2, 0.80, stall=9.0),  # stalled: not the worst
        _sweep_row("gn", (2, 8, 4, 4), 1, 0.93),
        _sweep_row("roi", (2, 8, 4, 4), 1, 0.5),  # a report: no target
        _sweep_row("up", (2, 8, 4, 4), 1, 0.99, variant="compiled"),
        _sweep_row("pool", (2, 16, 8, 8), 2, 0.40, variant="compiled", spread=0.5),  # noisy
    ]
    worst = targets.sweep_worst(rows, 0.1)
    assert worst["sweep: PyTorch eager"] == {"worst": (0.93, "SE.gn.8.1t"), "rows": 3, "unsure": 1}
    assert worst["sweep: torch.compile"] == {"worst": (0.99, "SC.up.8.1t"), "rows": 2, "unsure": 1}
    assert {group["name"] for group in targets.group_summaries(rows, 0.1)} == set(targets.SWEEPS) - {"sweep: JAX"}


def test_the_sweep_table_has_a_line_per_operation_and_thread_count():
    rows = [
        _sweep_row("pad", (2, 8, 4, 4), 1, 0.95),
        _sweep_row("pad", (2, 16, 8, 8), 1, 1.5, spread=0.5),  # noisy (one thread cannot stall)
        _sweep_row("gn", (2, 16, 8, 8), 2, 2.25),
    ]
    lines = targets.sweep_table(rows, "eager", 0.1)
    assert lines[0] == "| operation | threads | (2, 8, 4, 4) | (2, 16, 8, 8) |"
    assert "| replicate pad (2,2,1,1) | 1 | 0.95x | 1.50x~ |" in lines
    assert "| GroupNorm(8) -> SiLU, fused | 2 | - | 2.25x |" in lines
    assert len(lines) == 4 and targets.sweep_table(rows, "compiled", 0.1) == []
    assert "Never slower (issue 52), PyTorch eager" in to_table.table(_results() | {"rows": _results()["rows"] + rows})


def _jax_sweep_row(op, shape, threads, speedup, **extra):
    case = f"SJ.{op}.{shape[1]}.{threads}t"
    row = _sweep_row(op, shape, threads, speedup, **extra) | dict(op="fastbwd.jax sweep", case=case, label=case)
    return row | dict(variant="jit(grad)", baseline="jax", target=">= 0.97x")


def test_the_jax_sweep_has_its_table_and_worst_row():
    """The JAX sweep's rows (bench/jax_sweep.py): their own table (sizes smallest first, the
    models' sizes among the others), their worst trustworthy ratio in the summary, RoIAlign's
    rows judged too (plain JAX is what the policy "auto" runs below the crossover)."""
    rows = [
        _jax_sweep_row("up", (2, 16, 8, 8), 2, 1.02),
        _jax_sweep_row("up", (2, 8, 4, 4), 2, 0.99),
        _jax_sweep_row("roi", (2, 8, 4, 4), 1, 0.96),
        _jax_sweep_row("flax", (2, 32, 8, 8), 1, 0.5, spread=0.4),  # noisy: not the worst
        _jax_sweep_row("reach-gn", (2, 16, 8, 8), 1, 3.5),
        _sweep_row("pad", (2, 8, 4, 4), 1, 0.95),
    ]
    worst = targets.sweep_worst(rows, 0.1)
    assert worst["sweep: JAX"] == {"worst": (0.96, "SJ.roi.8.1t"), "rows": 5, "unsure": 1}
    assert worst["sweep: PyTorch eager"]["worst"] == (0.95, "SE.pad.8.1t")
    lines = targets.sweep_table(rows, "jit(grad)", 0.1, op="fastbwd.jax sweep")
    assert lines[0] == "| operation | threads | (2, 8, 4, 4) | (2, 16, 8, 8) | (2, 32, 8, 8) |"
    assert "| fastbwd.jax.upsample_bilinear2d x2 | 2 | 0.99x | 1.02x | - |" in lines
    assert "| reach: Flax decoder block (J7's), NHWC | 1 | - | - | 0.50x~ |" in lines
    assert len(lines) == 6 and targets.sweep_table(rows, "eager", 0.1, op="fastbwd.jax sweep") == []
    assert "Never slower (issue 52), JAX" in to_table.table(_results() | {"rows": _results()["rows"] + rows})
    assert "sweep: JAX" in {group["name"] for group in targets.group_summaries(rows, 0.1)}


def test_the_sweeps_make_their_rows_and_tables(monkeypatch):
    """``python3 -m bench --full``'s sweeps end to end, on stand-in cases: each row carries the
    thread count it ran on, and each sweep prints its table (the sweeps once called the row
    maker with arguments it no longer took, and the whole --full run ended there)."""
    pytest.importorskip("torch")
    from bench import sweep

    def torch_case(op, shape, threads):
        return sweep.SweepCase(id=f"SE.{op}.{shape[1]}.{threads}t", label=op, op=op, shape=shape, threads=threads,
                               fastbwd=lambda: None, torch=lambda: None, check=lambda: None, target=">= 0.97x")  # fmt: skip

    monkeypatch.setattr(sweep, "cases", lambda compiled: [torch_case("pad", (2, 8, 4, 4), t) for t in (1, 2)])
    monkeypatch.setattr(main_job, "parallel_stall", lambda: 1.0)
    monkeypatch.setattr(main_job, "alternating_rounds", lambda *args: _TwoSides([2.0] * 7, [1.0] * 7))
    run = _run()
    run.full = True
    run.sweep(compiled=False)
    assert [(row["case"], row["threads"], row["speedup"]) for row in run.rows] == [
        ("SE.pad.8.1t", 1, 0.5),
        ("SE.pad.8.2t", 2, 0.5),
    ]
    assert "| replicate pad (2,2,1,1) | 1 | 0.50x |" in "\n".join(run.details)
    pytest.importorskip("jax")
    from bench import jax_sweep

    found = dict(id="SJ.up.8.1t", label="up", op="up", shape=[2, 8, 4, 4], seconds=1.0, base_seconds=2.0,
                 target=">= 0.97x", note="", series=[2.0] * 7, settled=True, stall=None)  # fmt: skip
    monkeypatch.setattr(jax_sweep, "operations", lambda: ["up"])
    monkeypatch.setattr(jax_sweep, "in_child", lambda threads, settings, ops: [found | {"threads": threads}])
    run.jax_sweep()
    assert [(row["case"], row["threads"]) for row in run.rows[2:]] == [("SJ.up.8.1t", 1), ("SJ.up.8.1t", 2)]
    assert "fastbwd.jax.upsample_bilinear2d x2" in "\n".join(run.details)


class _TwoSides:
    """A stand-in for timing.Timing of two callables: their per-round times."""

    def __init__(self, first, second):
        self.rounds, self.settled = [first, second], True

    def median(self, index):
        return float(np.median(self.rounds[index]))

    def series(self, index, baseline=None):
        return timing.Timing.series(self, index, baseline)


def test_group_standing_uses_trustworthy_rows_that_are_not_tiny_calls():
    rows = _results()["rows"]
    groups = {group["name"]: group for group in targets.group_summaries(rows, 0.1)}
    assert (
        groups["replication_pad2d_backward"]["speedups"] == [6.0]
        and groups["replication_pad2d_backward"]["unsure"] == 1
    )
    assert targets.standing(groups["replication_pad2d_backward"]) == "faster"
    assert targets.standing(groups["fastbwd.torch"]) == "slower"  # 0.90x
    assert targets.standing(groups["tiny direct calls"]) == "tiny calls only"
    stalled = [row | dict(stall=9.0) for row in rows]
    assert all(targets.standing(group) == "no trustworthy row" for group in targets.group_summaries(stalled, 0.1))
    on_par = [rows[0] | dict(speedup=1.02)]
    assert targets.standing(targets.group_summaries(on_par, 0.1)[0]) == "on par"


def test_publish_refuses_a_partial_run(capsys):
    for argv in (
        ["--publish"],
        ["--full", "--publish", "--ops", "avg_pool2d_backward"],
        ["--full", "--publish", "--no-jax"],
        ["--full", "--publish", "--cases", "T6"],
    ):
        with pytest.raises(SystemExit):
            main_job.main(argv)
        assert "--publish records the whole --full run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main_job.main(["--ops", "roi_align"])  # not an operator name
    assert "invalid choice: 'roi_align'" in capsys.readouterr().err


def _environment():
    return child_environment()


@pytest.mark.slow
def test_a_reduced_run_regenerates_copies_of_the_published_tables(tmp_path):
    """The main job's whole path on one operator, into copies: the JSON saved, the copies'
    tables regenerated from it (what --publish does to bench/results.json, README.md and
    docs/benchmarks.md)."""
    copies = [tmp_path / "README.md", tmp_path / "benchmarks.md"]
    for name, copy in zip(main_job.PUBLISHED, copies):
        shutil.copy(ROOT / name, copy)
    saved = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--ops", "replication_pad2d_backward", "--no-jax", "--budget", "0.5",
         "--json", str(saved), "--write", *map(str, copies)],
        cwd=ROOT, env=_environment(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(saved.read_text())
    assert results["quick"] and {row["case"] for row in results["rows"]} == {"P1q"}
    assert all(row["spread"] is not None and row["rounds"] >= 3 for row in results["rows"])
    # a row's error is its median's 95% interval (from 6 rounds on), relative: the trust criterion
    assert all((row["error"] is None) == (row["rounds"] < 6) for row in results["rows"])
    # each case measures the stall before it, until one stalls: from then on one thread on both sides
    assert all((row["stall"] or 0) > 0 or row["threads"] == 1 for row in results["rows"])
    assert all(row["speedup_interval"] is None or len(row["speedup_interval"]) == 2 for row in results["rows"])
    assert results["machine"]["parallel_stall"] > 0 and results["machine"]["load_average"]
    assert len(results["bandwidth_readings_gbps"]) == 3
    for name, copy, (begin, end, make) in zip(main_job.PUBLISHED, copies, to_table.REGIONS):
        text, original = copy.read_text(), (ROOT / name).read_text()
        assert to_table.region(text, begin, end) == make(results)
        # everything outside the tables is the file's own
        assert text.split(begin)[0] == original.split(begin)[0]
        assert text.split(end)[1] == original.split(end)[1]
    # the report: the machine, its load in one line, the summary, then the rows (the small cases' shapes), the
    # compile hint once, the targets' paragraph at the end
    lines = done.stdout.splitlines()
    machine = next(i for i, line in enumerate(lines) if line.startswith("Machine: "))  # after a shadowing note
    # on a busy machine (parallel calls stalled, or a case's two-thread rounds disagreed), a line under the
    # machine's says the run timed one thread on both sides
    summary = machine + 2 + ("on ONE thread on both sides" in lines[machine + 1])
    assert lines[0].startswith("fastbwd ") and machine <= 2 and lines[summary].startswith("Summary (")
    assert lines[summary + 2].split()[:2] == ["replication_pad2d_backward", "PyTorch"]
    assert lines[summary + 3].startswith("Checks: 1 of 1 operators match the float64 reference")
    assert done.stdout.index("Summary (") < done.stdout.index("P1q float32: (4,32,64,64) pad 3")
    assert "WARNING" not in done.stdout
    assert done.stdout.count("--precompile") == 1
    assert "Targets: set for the --full shapes" in done.stdout


# ---- performance tracking with pytest-benchmark ---------------------------------------------


@pytest.mark.slow
def test_the_compare_workflow_on_two_smoke_cases(tmp_path):
    """The benchmarks page's workflow: save a run with --benchmark-autosave, compare the next one with it
    (--benchmark-compare), and fail on a regression (--benchmark-compare-fail); in a temporary
    folder, on the small shapes of one case: fastbwd beside its baseline."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()  # the workflow the benchmarks page shows
    assert "--benchmark-only --benchmark-autosave\n" in page
    assert "--benchmark-only --benchmark-compare --benchmark-compare-fail=median:10%\n" in page
    torch_installed = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0
    second = "bench_baseline[P1-float32-torch]" if torch_installed else "bench_fastbwd_out[P1-float32]"
    ids = [f"{ROOT}/bench/bench_replication_pad2d.py::{name}" for name in ("bench_fastbwd[P1-float32]", second)]
    common = [sys.executable, "-m", "pytest", *ids, "-p", "no:cacheprovider", "--benchmark-enable",
              "--benchmark-only", "--small-shapes", f"--benchmark-storage=file://{tmp_path}/.benchmarks"]  # fmt: skip

    def pytest_run(*more):
        return subprocess.run(
            [*common, *more], cwd=tmp_path, env=_environment(), capture_output=True, text=True, timeout=600
        )

    saved = pytest_run("--benchmark-autosave")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    (run_file,) = (tmp_path / ".benchmarks").glob("*/0001_*.json")
    benchmarks = json.loads(run_file.read_text())["benchmarks"]
    assert len(benchmarks) == 2 and len({b["group"] for b in benchmarks}) == 1  # one group, side by side
    assert {b["extra_info"]["variant"] for b in benchmarks} == {
        "fastbwd",
        "torch" if torch_installed else "fastbwd out=",
    }

    # a bound in seconds: a stalled machine can make tiny calls 100x slower from one run to the next
    compared = pytest_run("--benchmark-compare", "--benchmark-compare-fail=median:1")
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert "0001" in compared.stdout and "NOW" in compared.stdout

    # the saved run made 100x faster: now the current one has regressed, and the run fails
    data = json.loads(run_file.read_text())
    for benchmark in data["benchmarks"]:
        for key in ("min", "max", "mean", "median", "q1", "q3"):
            benchmark["stats"][key] /= 100
    run_file.write_text(json.dumps(data))
    regressed = pytest_run("--benchmark-compare", "--benchmark-compare-fail=median:50%")
    assert regressed.returncode != 0
    assert "Performance has regressed" in regressed.stdout + regressed.stderr
