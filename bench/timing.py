"""Timing on a shared, noisy machine: alternating rounds until the noise settles.

A case's callables (fastbwd's variants and their baselines) run in rounds: in each round every
callable runs a few times in turn, so that a change in the machine's load lands on all of them
alike, and each round gives one median per callable. A row's *series* is its per-round values:
the baseline's median over fastbwd's in the same round (a speed-up) or fastbwd's median alone.
Rounds go on until every series' median is known to within ``tolerance`` (its standard error,
estimated from the spread of the rounds) or the case's time budget runs out.

A row's speed-up is the **median of its paired rounds' ratios** (each round's baseline median
over fastbwd's median in that same round, so a change of load lands on both sides of a ratio),
with a distribution-free 95% **confidence interval** from the order statistics of those ratios
(:func:`median_interval`: no assumption about the noise's shape, which on a shared machine is
anything but normal). Rounds go on until that interval is narrow (``tolerance``).

A row's **spread** is half the interquartile range of its series over its median: ``0.05`` means
that the middle half of the rounds lay within about ±5% of the median. On a quiet machine it is
a few percent; a busy one (another process on the cores, a descheduled worker thread that a
parallel region waits for) widens it, which is how the main job knows which rows it cannot trust.
"""

import contextlib
import math
import time
from dataclasses import dataclass

import numba
import numpy as np

from .bandwidth import parallel_copy

#: The confidence of the interval around a row's median.
CONFIDENCE = 0.95


def spread(values):
    """Half the interquartile range of ``values`` over their median; None for fewer than 3 values."""
    if len(values) < 3:
        return None
    low, middle, high = np.percentile(values, [25, 50, 75])
    return float((high - low) / 2 / abs(middle)) if middle else None


def _order_statistic_rank(count, confidence):
    """The largest k such that the k-th smallest and k-th largest of ``count`` independent values
    bracket their population's median with at least ``confidence`` (each value falls below the
    median with probability 1/2: the interval misses it with probability 2 P(Binomial(n, 1/2) < k));
    0 when no interval reaches that confidence (fewer than 6 values for 95%)."""
    below, k = 0.0, 0  # P(Binomial(count, 1/2) < k + 1), summed term by term
    while k < count // 2:
        below += math.comb(count, k) / 2.0**count
        if 2 * below > 1 - confidence:
            break
        k += 1
    return k


def median_interval(values, confidence=CONFIDENCE):
    """A distribution-free confidence interval ``(low, high)`` for the median of the population
    ``values`` (independent rounds) were drawn from: a pair of their order statistics, chosen by
    the binomial distribution (no assumption about the noise's shape). None when too few values
    give one at ``confidence`` (fewer than 6 at 95%)."""
    k = _order_statistic_rank(len(values), confidence)
    if k == 0:
        return None
    ordered = sorted(values)
    return float(ordered[k - 1]), float(ordered[-k])


def median_error(values):
    """Half the width of :func:`median_interval` relative to the median of ``values``: how well
    their median is known; None when there is no interval yet (too few values)."""
    interval = median_interval(values)
    if interval is None:
        return None
    middle = float(np.median(values))
    return (interval[1] - interval[0]) / 2 / abs(middle) if middle else None


def parallel_stall(calls=15):
    """How many times longer a short parallel call takes on all of Numba's threads than on one
    (a parallel copy of 8 MB, about a millisecond of work): at most about 1 on an idle machine,
    where the threads share the work; far more when other processes hold the cores and the call
    waits for a descheduled worker thread (70x measured at load 3.7 on 2 cores, where every
    kernel took 12 ms whatever its size, with a small spread). 1.0 with one thread."""
    threads = numba.get_num_threads()
    if threads == 1:
        return 1.0
    source = np.ones(1 << 21, np.float32)
    destination = np.empty_like(source)
    parallel_copy(source, destination)

    def median(count):
        numba.set_num_threads(count)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            parallel_copy(source, destination)
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    try:
        every, one = median(threads), median(1)
    finally:
        numba.set_num_threads(threads)
    return every / one


@dataclass(frozen=True)
class Settings:
    """How long to time a case: each callable runs about ``round_seconds`` per round, at least
    ``min_rounds`` rounds (3 when a round is long), until the confidence interval of every series'
    median is within ``tolerance`` of it either way (:func:`median_error`) or ``budget`` seconds
    have passed."""

    round_seconds: float
    min_rounds: int
    tolerance: float
    budget: float
    max_calls_per_round: int = 200
    max_rounds: int = 200


@dataclass
class Timing:
    """The rounds of one case: every call's seconds and each round's median, per callable."""

    samples: list
    rounds: list
    seconds: float
    settled: bool

    def median(self, index):
        """The median of every call of callable ``index`` (seconds)."""
        return float(np.median(self.samples[index]))

    def series(self, index, baseline=None):
        """Callable ``index``'s per-round medians, or with ``baseline`` the per-round speed-ups over it."""
        if baseline is None:
            return list(self.rounds[index])
        return [b / f for b, f in zip(self.rounds[baseline], self.rounds[index])]

    def speedup(self, index, baseline):
        """``(speed-up, (low, high) or None)``: the median of the paired rounds' speed-ups of callable
        ``index`` over ``baseline`` and its confidence interval (:func:`median_interval`)."""
        ratios = self.series(index, baseline)
        return float(np.median(ratios)), median_interval(ratios)


def _calls_per_round(function, settings):
    """Warm ``function`` up (the first call compiles and faults in pages) and return how many
    calls fill a round: two warm-up calls, the second one's time, unless the first took a second."""
    start = time.perf_counter()
    function()
    seconds = time.perf_counter() - start
    if seconds < 1.0:
        start = time.perf_counter()
        function()
        seconds = time.perf_counter() - start
    return max(1, min(settings.max_calls_per_round, int(settings.round_seconds / max(seconds, 1e-7))))


def alternating_rounds(functions, series, settings, contexts=None):
    """Time ``functions`` (zero-argument callables) in alternating rounds until the medians of
    ``series`` settle or the budget runs out. ``series`` lists ``(index, baseline index or None)``:
    the rows whose per-round values (:meth:`Timing.series`) must settle. ``contexts``: per
    function, a context manager factory (or None) entered around each of its rounds, not timed
    (``fastbwd.torch.enabled`` around a loop of steps, as a user enables it). Returns a
    :class:`Timing`."""
    contexts = contexts or [None] * len(functions)
    calls = []
    for function, context in zip(functions, contexts):
        with context() if context else _nothing():
            calls.append(_calls_per_round(function, settings))
    samples = [[] for _ in functions]
    rounds = [[] for _ in functions]
    start = time.perf_counter()
    settled = False
    while True:
        for function, count, times, medians, context in zip(functions, calls, samples, rounds, contexts):
            these = []
            with context() if context else _nothing():
                for _ in range(count):
                    t0 = time.perf_counter()
                    function()
                    these.append(time.perf_counter() - t0)
            times.extend(these)
            medians.append(float(np.median(these)))
        timing = Timing(samples, rounds, time.perf_counter() - start, False)
        done = len(rounds[0])
        errors = [median_error(timing.series(index, baseline)) for index, baseline in series]
        if done >= settings.min_rounds and all(error is not None and error <= settings.tolerance for error in errors):
            settled = True
            break
        # stop when the next round would overrun the budget (after at least 3 rounds, for a spread)
        if done >= settings.max_rounds or (done >= 3 and timing.seconds * (done + 1) / done > settings.budget):
            break
    return Timing(samples, rounds, time.perf_counter() - start, settled)


def _nothing():
    return contextlib.nullcontext()
