"""Targets, verdicts and the end-of-run summary, shared by the main job (``python3 -m bench``)
and ``bench/to_table.py``.

A target is the text a case carries (``bench/cases.py``'s ``Case.targets``, the ``target`` of the
PyTorch and JAX bridges' cases): the first ``>= N x`` in it (``≥ N×`` too) is the speed-up the
row must reach; text without one (``report``, ``trains; report``) asks for the number alone and
gets no verdict. A row whose median is not known to within the run's limit (noisy: see
:func:`uncertainty`), or whose case was timed while parallel calls stalled, gets no verdict
either: its speed-up cannot be trusted this run, whichever side of the target it fell.
"""

import re

#: ``>= 5x``, ``>= 1.5x``, ``≥ 1.0×`` (anywhere in the text: "every pair fused; >= 1.0x" too).
_AT_LEAST = re.compile(r"(?:>=|≥)\s*(\d+(?:\.\d+)?)\s*(?:x|×)")
#: ``overhead <= 1 us``: a prepared call's microseconds over its bare kernel call (issue 46).
_OVERHEAD_AT_MOST = re.compile(r"overhead\s*(?:<=|≤)\s*(\d+(?:\.\d+)?)\s*(?:us|µs)")
#: ``>= 75% of copy``: the row's share of the copy yardstick's bandwidth, its ``%bw`` (issue 53).
_COPY_SHARE_AT_LEAST = re.compile(r"(?:>=|≥)\s*(\d+(?:\.\d+)?)\s*%\s*of\s*copy")

MET, MISSED, UNTRUSTED = "met", "missed", "not trustworthy"

#: A case timed while a short parallel call took more than this many times its one-thread time
#: (``timing.parallel_stall``) was timed while parallel calls stalled: its numbers are the
#: scheduler's, however small their spread.
STALL_LIMIT = 2.0


def threshold(target):
    """The speed-up ``target`` asks for, or None when it asks for none."""
    match = _AT_LEAST.search(target or "")
    return float(match.group(1)) if match else None


def copy_share(target):
    """The percentage of the copy yardstick's bandwidth ``target`` asks for, or None."""
    match = _COPY_SHARE_AT_LEAST.search(target or "")
    return float(match.group(1)) if match else None


def overhead_limit(target):
    """The microseconds over the bare kernel call ``target`` allows, or None."""
    match = _OVERHEAD_AT_MOST.search(target or "")
    return float(match.group(1)) if match else None


def uncertainty(row):
    """How well the row's median is known, as a fraction of it: the narrower of the rounds' spread
    and the half-width of their median's 95% interval (``error``; none below 6 rounds, nor in rows
    saved before the main job kept it); None when neither was measured. Rounds that agree (a
    quiet machine) show it, and so do enough rounds on a busy machine, whose noise widens the
    spread of the rounds but not the interval of their median, which more rounds narrow."""
    known = [value for value in (row.get("spread"), row.get("error")) if value is not None]
    return min(known) if known else None


def noisy(row, max_spread):
    """The row's median is not known to within ``max_spread`` (:func:`uncertainty`; rows saved
    before spreads were measured: never)."""
    known = uncertainty(row)
    return known is not None and known > max_spread


def stalled(row):
    """The row's case was timed on several threads while parallel calls stalled (rows saved before
    this was measured: never; rows timed on one thread on both sides: never, no call waits for a
    worker thread)."""
    stall = row.get("stall")
    return stall is not None and stall > STALL_LIMIT and row.get("threads") != 1


def trust_text(row, max_spread):
    """Why the row cannot be trusted ("noisy", "stalled", both), or "" when it can."""
    return " ".join(word for word, bad in (("noisy", noisy(row, max_spread)), ("stalled", stalled(row))) if bad)


def verdict(row, max_spread):
    """MET, MISSED or UNTRUSTED for a row with a target and what it asks about (a speed-up, or
    a share of the copy's bandwidth); None otherwise."""
    limit = threshold(row.get("target"))
    share = copy_share(row.get("target"))
    if limit is None and share is None:
        return None
    if (limit is not None and row.get("speedup") is None) or (share is not None and row.get("pct_bandwidth") is None):
        return None
    if noisy(row, max_spread) or stalled(row):
        return UNTRUSTED
    met = (limit is None or row["speedup"] >= limit) and (share is None or row["pct_bandwidth"] >= share)
    overhead = overhead_limit(row.get("target"))
    if overhead is not None and row.get("overhead_us") is not None:
        met = met and row["overhead_us"] <= overhead
    return MET if met else MISSED


def row_name(row):
    """How the summary names a row: its case, and for the operators' rows the dtype, variant and baseline."""
    if row["op"].startswith("fastbwd."):
        return row["case"]
    name = f"{row['case']} {row['dtype']} {row['variant']}"
    return f"{name} vs {row['baseline']}" if row.get("baseline") else name


def speedup_text(speedup):
    """Two decimals below 10 (targets such as 0.8x and 1.5x), one above."""
    return f"{speedup:.2f}x" if speedup < 10 else f"{speedup:.1f}x"


def judged_text(row):
    """What a row's verdict judged: its speed-up (``1.52x``), or its share of the copy's
    bandwidth (``71% of copy``) for a target that asks for one without a speed-up."""
    if row.get("speedup") is None and row.get("pct_bandwidth") is not None:
        return f"{percent_text(row['pct_bandwidth'])} of copy"
    return speedup_text(row["speedup"])


def interval_text(interval):
    """``1.80x-1.91x``: a speed-up's confidence interval; ``-`` when there is none."""
    if not interval:
        return "-"
    return f"{speedup_text(interval[0])}-{speedup_text(interval[1])}"


def threads_text(threads):
    """``2``, ``1``, ``1-2``: the thread counts of a group's rows; ``-`` when not recorded."""
    if not threads:
        return "-"
    return str(min(threads)) if min(threads) == max(threads) else f"{min(threads)}-{max(threads)}"


def percent_text(value):
    """``46%``; ``-`` when not measured (small shapes: their data stays in the caches)."""
    return "-" if value is None else f"{value:.0f}%"


def spread_text(spread):
    """``±4.2%`` (one decimal below 10%), ``±12%``; ``-`` when not measured."""
    if spread is None:
        return "-"
    return f"±{100 * spread:.1f}%" if spread < 0.1 else f"±{100 * spread:.0f}%"


def summarize(rows, max_spread, judge=True):
    """``{"met": [...], "missed": [...], "untrusted": [...], "noisy": [...], "rows": n, "judged": judge}``:
    the rows (as :func:`row_name` and numbers) of each verdict, and every row whose median is not
    known well enough (:func:`noisy`). ``judge=False`` (a run on small shapes, to which the
    targets do not apply): no verdicts."""
    result = {"met": [], "missed": [], "untrusted": [], "noisy": [], "stalled": [], "rows": len(rows)}
    result["judged"] = judge
    result["measured"] = any(row.get("spread") is not None for row in rows)
    for row in rows:
        name = row_name(row)
        outcome = verdict(row, max_spread) if judge else None
        if outcome == MET:
            result["met"].append(name)
        elif outcome == MISSED:
            result["missed"].append(f"{name}: {judged_text(row)}, target {row['target']}")
        elif outcome == UNTRUSTED:
            result["untrusted"].append(
                f"{name}: {judged_text(row)} {spread_text(uncertainty(row))} {trust_text(row, max_spread)}"
            )
        if noisy(row, max_spread):
            result["noisy"].append(f"{name} {spread_text(uncertainty(row))}")
        if stalled(row):
            result["stalled"].append(name)
    return result


def summary_text(summary, max_spread):
    """The summary as a paragraph (the main job's last lines and docs/benchmarks.md's)."""
    judged = len(summary["met"]) + len(summary["missed"]) + len(summary["untrusted"])
    if not summary["judged"]:
        text = "Targets: set for the --full shapes, so a run on small shapes gives them no verdict."
    else:
        parts = [f"Targets: {judged} rows have one; {len(summary['met'])} met"]
        if summary["missed"]:
            parts.append(f"{len(summary['missed'])} missed ({'; '.join(summary['missed'])})")
        else:
            parts.append("none missed")
        if summary["untrusted"]:
            parts.append(
                f"{len(summary['untrusted'])} not trustworthy this run, noisy (a median not known to within "
                f"{spread_text(max_spread)}) or stalled ({'; '.join(summary['untrusted'])})"
            )
        text = ", ".join(parts) + "."
    if summary.get("stalled"):
        text += (
            f" {len(summary['stalled'])} of {summary['rows']} rows were timed while parallel calls stalled (a short "
            f"parallel copy took more than {STALL_LIMIT:g}x its one-thread time: other processes held the cores), so "
            f"their times are the scheduler's: {', '.join(summary['stalled'])}."
        )
    if not summary.get("measured", True):
        text += " Spreads were not measured (the run was saved before the main job measured them)."
    elif summary["noisy"]:
        text += (
            f" {len(summary['noisy'])} of {summary['rows']} rows' medians were not known to within "
            f"{spread_text(max_spread)}"
            f" ({', '.join(summary['noisy'])})."
        )
    else:
        text += f" Every row's median was known to within {spread_text(max_spread)}."
    return text


# ---- the summary by operator and bridge (the main job's first lines, the README's headline) ----

#: Bridge cases whose baseline is not the plain framework: fastbwd's own NCHW call (T4-NHWC),
#: fastbwd eager (C3, C5, C7) or PyTorch's kernels eager (C8). Their rows count in their group's
#: verdicts but not in its speed-up against the framework.
NOT_AGAINST_THE_FRAMEWORK = ("T4-NHWC", "C3", "C5", "C7", "C8")

#: A row whose fastbwd call takes less than this many milliseconds is a tiny call: Python's
#: per-call cost (validation, dispatch, the bridge; 5-20 us) decides its ratio, not the kernels.
#: Its speed-up is summed up apart from the others.
TINY_MS = 0.1

#: The bridges' groups, in order: (op, variant) of their rows -> (group name, what it is timed against).
BRIDGES = {
    ("fastbwd.torch", "autograd"): ("fastbwd.torch", "PyTorch eager"),
    ("fastbwd.torch", "compiled"): ("torch.compile", "torch.compile without fastbwd"),
    ("fastbwd.jax", "jit(grad)"): ("fastbwd.jax", "JAX's own gradient"),
    ("fastbwd", "direct"): ("tiny direct calls", "PyTorch's own ops"),
    ("fastbwd.torch sweep", "eager"): ("sweep: PyTorch eager", "PyTorch eager (issue 52's sizes)"),
    ("fastbwd.torch sweep", "compiled"): ("sweep: torch.compile", "Inductor alone (issue 52's sizes)"),
    ("fastbwd.jax sweep", "jit(grad)"): ("sweep: JAX", "plain JAX (issue 52's sizes)"),
}

#: The groups of the never-slower sweep (issue 52), whose worst ratio the summary states.
SWEEPS = ("sweep: PyTorch eager", "sweep: torch.compile", "sweep: JAX")


def group_of(row):
    """The summary group of ``row`` (an operator's name or a bridge's), or None for rows outside
    the summary (per-call transport and routing costs, which have no speed-up)."""
    if (row["op"], row["variant"]) in BRIDGES:
        return BRIDGES[row["op"], row["variant"]][0]
    if row["op"].startswith("fastbwd"):
        return None
    return row["op"]


def against_the_framework(row):
    """The row times fastbwd against PyTorch or JAX themselves (not fastbwd's other layout, a
    serial loop, or the same kernels eager)."""
    if row.get("speedup") is None or row["case"] in NOT_AGAINST_THE_FRAMEWORK:
        return False
    baseline = row.get("baseline") or ""
    return baseline.startswith(("torch", "jax")) or row["variant"] == "compiled"


def group_summaries(rows, max_spread, judge=True):
    """One dict per group, operators first (in the rows' order), then the bridges: ``name``,
    ``against`` (what its speed-ups are measured against), ``rows``, ``speedups`` (its rows
    against the framework taking at least :data:`TINY_MS`, noisy and stalled ones left out),
    ``tiny`` (those taking less), ``met``, ``missed``, ``untrusted`` (verdict counts; zero when
    ``judge`` is False), ``unsure`` (rows noisy or stalled, whatever their target) and ``threads``
    (the set of thread counts its rows ran on)."""
    groups = {}
    for row in rows:
        name = group_of(row)
        if name is None:
            continue
        bridge = BRIDGES.get((row["op"], row["variant"]))
        group = groups.setdefault(
            name,
            dict(name=name, against=bridge[1] if bridge else "PyTorch", bridge=bridge is not None, rows=0)
            | dict(speedups=[], tiny=[], threads=set())
            | {MET: 0, MISSED: 0, UNTRUSTED: 0, "unsure": 0},
        )
        group["rows"] += 1
        if row.get("threads") is not None:
            group["threads"].add(row["threads"])
        trustworthy = not (noisy(row, max_spread) or stalled(row))
        if against_the_framework(row) and trustworthy:
            group["tiny" if row["ms"] < TINY_MS else "speedups"].append(row["speedup"])
        outcome = verdict(row, max_spread) if judge else None
        if outcome:
            group[outcome] += 1
        if not trustworthy:
            group["unsure"] += 1
    return sorted(groups.values(), key=lambda group: group["bridge"])


#: The median speed-up of a group's trustworthy rows (tiny calls aside) above this is "faster",
#: below its inverse "slower", between them "on par".
ON_PAR = 1.05


def standing(group):
    """A group's standing against the framework, from its trustworthy rows that are not tiny calls:
    "faster", "on par", "slower"; or why there is none."""
    if not group["speedups"]:
        return "tiny calls only" if group["tiny"] else "no trustworthy row"
    middle = median(group["speedups"])
    return "faster" if middle >= ON_PAR else "slower" if middle <= 1 / ON_PAR else "on par"


def _elements(shape):
    count = 1
    for size in shape:
        count *= size
    return count


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def speedups_text(speedups):
    """``11x (1.7x-14x)``: the median of a group's speed-ups and their range; ``-`` without any."""
    if not speedups:
        return "-"
    if len(speedups) == 1:
        return speedup_text(speedups[0])
    return f"{speedup_text(median(speedups))} ({speedup_text(min(speedups))}-{speedup_text(max(speedups))})"


def verdicts_text(group, judge=True):
    """``5 met, 1 missed, 2 not trustworthy`` for a group's targets (``-`` when none or not judged)."""
    if not judge:
        return "not judged (small shapes)"
    parts = [f"{group[key]} {key}" for key in (MET, MISSED, UNTRUSTED) if group[key]]
    return ", ".join(parts) or "-"


def sweep_worst(rows, max_spread):
    """Per sweep group (:data:`SWEEPS`) present in ``rows``: ``{"worst": (speed-up, case) or None,
    "rows": n, "unsure": n}``, the worst over its trustworthy rows that have a target (RoIAlign's
    rows, a report against a formulation in PyTorch ops, do not count)."""
    result = {}
    for row in rows:
        name = group_of(row)
        if name not in SWEEPS or threshold(row.get("target")) is None or row.get("speedup") is None:
            continue
        entry = result.setdefault(name, {"worst": None, "rows": 0, "unsure": 0})
        entry["rows"] += 1
        if noisy(row, max_spread) or stalled(row):
            entry["unsure"] += 1
        elif entry["worst"] is None or row["speedup"] < entry["worst"][0]:
            entry["worst"] = (row["speedup"], row["case"])
    return result


#: The issue's six sizes (N, C, H, W), smallest first (channels last: the same numbers as (N, H, W, C)).
SWEEP_SIZES = [(2, 8, 4, 4), (2, 16, 8, 8), (2, 32, 16, 16), (4, 32, 32, 32), (4, 64, 64, 64), (8, 64, 128, 128)]

#: The sweep's operations (bench/sweep.py's keys) as its tables name them, in order.
SWEEP_OPERATIONS = {
    "up": "bilinear x2",
    "pool": "avg-pool k3 s2 p1",
    "pad": "replicate pad (2,2,1,1)",
    "gn": "GroupNorm(8) -> SiLU, fused",
    "roi": "RoIAlign 7x7, 4 boxes per image, vs pure PyTorch",
}


#: The JAX sweep's operations (bench/jax_sweep.py's keys) as its table names them, in order.
JAX_SWEEP_OPERATIONS = {
    "up": "fastbwd.jax.upsample_bilinear2d x2",
    "pool": "fastbwd.jax.avg_pool2d k3 s2 p1",
    "pad": "fastbwd.jax.replication_pad2d (2,2,1,1)",
    "gn": "fastbwd.jax.group_norm_swish, 8 groups",
    "roi": "fastbwd.jax.roi_align 7x7, 4 boxes per image",
    "reach-up": "reach: jax.image.resize x2, NHWC",
    "reach-pool": "reach: nn.avg_pool 3x3 s2 pad 1, NHWC",
    "reach-pad": "reach: jnp.pad edge (1,1),(2,2), NHWC",
    "reach-gn": "reach: nn.GroupNorm(8) -> nn.swish, NHWC",
    "flax": "reach: Flax decoder block (J7's), NHWC",
    "eqx": "reach: Equinox ResNet block (J8's), vmap",
}

#: Each sweep's rows (their op) and variant -> the names of its operations.
_SWEEP_TABLES = {"fastbwd.torch sweep": SWEEP_OPERATIONS, "fastbwd.jax sweep": JAX_SWEEP_OPERATIONS}


def sweep_table(rows, variant, max_spread, op="fastbwd.torch sweep"):
    """The table of the sweep whose rows have ``op`` ("fastbwd.torch sweep" or "fastbwd.jax
    sweep") and ``variant`` ("eager" or "compiled"; the JAX one's "jit(grad)") as Markdown lines:
    a line per operation and thread count, a column per size (smallest first), each cell the
    ratio (the framework's time over fastbwd's; ``~`` after a noisy or stalled one)."""
    rows = [row for row in rows if row["op"] == op and row["variant"] == variant]
    shapes = []
    for row in rows:
        if tuple(row["shape"]) not in shapes:
            shapes.append(tuple(row["shape"]))
    shapes.sort(key=lambda shape: (_elements(shape), shape))
    if not rows:
        return []
    lines = [
        "| operation | threads | " + " | ".join(str(shape) for shape in shapes) + " |",
        "|---|---:|" + "---:|" * len(shapes),
    ]
    for operation, label in _SWEEP_TABLES[op].items():
        for threads in sorted({row["threads"] for row in rows}):
            cells = []
            for shape in shapes:
                found = [
                    r
                    for r in rows
                    if r["sweep_op"] == operation and r["threads"] == threads and tuple(r["shape"]) == shape
                ]
                row = found[0] if found else None
                if row is None or row.get("speedup") is None:
                    cells.append("-")
                else:
                    cells.append(speedup_text(row["speedup"]) + ("~" if trust_text(row, max_spread) else ""))
            if any(cell != "-" for cell in cells):
                lines.append(f"| {label} | {threads} | " + " | ".join(cells) + " |")
    return lines
