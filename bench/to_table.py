"""Turn the main job's JSON (``python3 -m bench --full --json results.json``) into Markdown: the
README's headline table (one row per operator and per bridge) and the full tables of the
documentation's benchmarks page, each put between its markers in the files that hold them.

Usage:
    python bench/to_table.py RESULTS.json                                       print both
    python bench/to_table.py RESULTS.json --write README.md docs/benchmarks.md  regenerate them in place

``python3 -m bench --full --publish`` runs the full benchmark, saves ``bench/results.json`` and
does the second; ``tests/test_readme.py`` checks that both files hold this module's
``headline()`` and ``table()`` of ``bench/results.json``.
"""

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # run as a script, python bench/to_table.py: the checkout's root holds bench
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import targets  # noqa: E402

#: The full tables (docs/benchmarks.md) lie between these two lines.
BEGIN = (
    "<!-- benchmark tables: generated from bench/results.json by `python3 -m bench --full --publish`; do not edit -->"
)
END = "<!-- end of the benchmark tables -->"
#: The headline table (README.md) lies between these two.
HEADLINE_BEGIN = (
    "<!-- headline table: generated from bench/results.json by `python3 -m bench --full --publish`; do not edit -->"
)
HEADLINE_END = "<!-- end of the headline table -->"

#: The spread above which a row is not trusted, for results saved before the run recorded its own.
DEFAULT_MAX_SPREAD = 0.10


def _machine_notes(results):
    """The machine line's note on the 64 MB copy and the 64 MB streamed write (results saved
    before they were measured have none)."""
    notes = [
        f"{what}: {results[key]:.1f} GB/s"
        for key, what in (("case_size_copy_gbps", "a 64 MB copy"), ("stream_write_gbps", "a 64 MB streamed write"))
        if results.get(key) is not None
    ]
    return f" ({'; '.join(notes)})" if notes else ""


def _readings(results):
    readings = results.get("bandwidth_readings_gbps")
    if not readings:
        return ""
    return f"; the copy read {', '.join(f'{value:.1f}' for value in readings)} GB/s at the run's start and end"


def _verdict_cell(row, results):
    """The target and, for a --full run, its verdict."""
    if not row.get("target"):
        return "-"
    if results.get("quick"):
        return f"{row['target']} (at full size)"
    outcome = targets.verdict(row, results.get("max_spread", DEFAULT_MAX_SPREAD))
    if outcome is None:
        return row["target"]
    return f"{row['target']}: {'**missed**' if outcome == targets.MISSED else outcome}"


def _speedup_cell(row):
    return f"**{targets.speedup_text(row['speedup'])}**" if row.get("speedup") is not None else "-"


def _spread_cell(row, results):
    trust = targets.trust_text(row, results.get("max_spread", DEFAULT_MAX_SPREAD))
    return f"{targets.spread_text(row.get('spread'))}, {trust}" if trust else targets.spread_text(row.get("spread"))


def table(results):
    """docs/benchmarks.md's tables (machine line, tables, summary) for ``results``."""
    machine = results["machine"]
    max_spread = results.get("max_spread", DEFAULT_MAX_SPREAD)
    size = "small shapes (not --full): " if results.get("quick") else ""
    lines = [
        f"Machine ({size}one `python3 -m bench{'' if results.get('quick') else ' --full'}` run): {machine['cpu']}, "
        f"{machine['threads']} threads ({machine['threading_layer']}), "
        f"parallel copy {results['bandwidth_gbps']:.1f} GB/s{_machine_notes(results)}{_readings(results)}; "
        f"fastbwd {machine['fastbwd']}, numba {machine['numba']}, torch {machine['torch'] or 'not installed'} "
        "(same thread count)."
    ]
    if machine.get("load_average") is not None:
        lines[0] += f" Load average at the start: {machine['load_average'][0]:.2f} (1 min) on {machine['cpus']} CPUs"
        if machine.get("running_elsewhere") is not None:
            lines[0] += f", {machine['running_elsewhere']:.1f} other processes running"
        if machine.get("parallel_stall") is not None:
            lines[0] += f"; a short parallel copy took {machine['parallel_stall']:.2f}x its one-thread time"
        lines[0] += "."
    lines[0] += _one_thread_note(machine)
    for warning in results.get("warnings", []):
        lines += ["", f"**Warning from this run:** {warning}"]
    lines += [
        "",
        "| case | operator | dtype | variant | fastbwd ms | GB/s | % of copy bw | baseline | baseline ms | speed-up "
        "| spread | target |",
        "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    bridge = [row for row in results["rows"] if row["op"] == "fastbwd.torch" and row["variant"] != "compiled"]
    compiled = [row for row in results["rows"] if row["op"] == "fastbwd.torch" and row["variant"] == "compiled"]
    overhead = [row for row in results["rows"] if row["op"] == "fastbwd.torch overhead"]
    jax_bridge = [row for row in results["rows"] if row["op"] == "fastbwd.jax"]
    direct = [row for row in results["rows"] if row["variant"] == "direct"]
    for row in results["rows"]:
        if row["op"].startswith(("fastbwd.torch", "fastbwd.jax")) or row["variant"] == "direct":
            continue
        baseline = row["baseline"] or "-"
        base_ms = f"{row['baseline_ms']:.2f}" if row["baseline_ms"] is not None else "-"
        lines.append(
            f"| {row['case']} | {row['op']} | {row['dtype']} | {row['variant']} | {row['ms']:.2f} | "
            f"{row['gbps']:.1f} | {targets.percent_text(row['pct_bandwidth'])} | {baseline} | {base_ms} | {_speedup_cell(row)} | "
            f"{_spread_cell(row, results)} | {_verdict_cell(row, results)} |"
        )
    if bridge:
        lines += [
            "",
            "PyTorch models through `fastbwd.torch` against plain PyTorch (autograd, same threads):",
            "",
            "| case | what | fastbwd.torch ms | PyTorch ms | speed-up | spread | target |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for row in bridge:
            lines.append(
                f"| {row['case']} | {row['label']} | {row['ms']:.2f} | {row['baseline_ms']:.2f} | "
                f"{_speedup_cell(row)} | {_spread_cell(row, results)} | {_verdict_cell(row, results)} |"
            )
    if compiled:
        lines += [
            "",
            "Models under `torch.compile` (Inductor) with fastbwd enabled before their first compiled call, against "
            "the baseline each row names (compiled without fastbwd, or eager):",
            "",
            "| case | what | fastbwd ms | baseline ms | speed-up | spread | target |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for row in compiled:
            note = f" ({row['note']})" if row.get("note") else ""
            lines.append(
                f"| {row['case']} | {row['label']}{note} | {row['ms']:.2f} | {row['baseline_ms']:.2f} | "
                f"{_speedup_cell(row)} | {_spread_cell(row, results)} | {_verdict_cell(row, results)} |"
            )
    if overhead:
        lines += [
            "",
            "Per-call cost of the routing on tiny inputs (median microseconds; the aten "
            "`.grad_input` call routed to fastbwd, the direct fastbwd call with `out=` on the "
            "same memory, and the same aten call on PyTorch's own kernel):",
            "",
            "| case | what | routed us | direct us | routing adds | PyTorch us | spread |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for row in overhead:
            lines.append(
                f"| {row['case']} | {row['label']} | {row['routed_us']:.1f} | {row['direct_us']:.1f} | "
                f"{row['routed_us'] - row['direct_us']:.1f} | {row['torch_us']:.1f} | {_spread_cell(row, results)} |"
            )
    if direct:
        lines += [
            "",
            "Warm direct calls on tiny inputs (NumPy arrays) against PyTorch's own ops on the same values "
            "(median microseconds):",
            "",
            "| case | what | fastbwd us | PyTorch us | speed-up | spread | target |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for row in direct:
            lines.append(
                f"| {row['case']} | {row['label']} | {row['ms'] * 1e3:.1f} | {row['baseline_ms'] * 1e3:.1f} | "
                f"{_speedup_cell(row)} | {_spread_cell(row, results)} | {_verdict_cell(row, results)} |"
            )
    if jax_bridge:
        lines += [
            "",
            f"JAX programs through `fastbwd.jax` against JAX's own gradients (jax "
            f"{machine.get('jax')}, CPU; `jax.jit(jax.grad(loss))`, same forward, same process):",
            "",
            "| case | what | fastbwd.jax ms | JAX ms | speed-up | spread | target |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for row in jax_bridge:
            if row["case"] == "overhead":
                continue
            jax_ms = f"{row['baseline_ms']:.2f}" if row["baseline_ms"] is not None else "-"
            lines.append(
                f"| {row['case']} | {row['label']} | {row['ms']:.2f} | {jax_ms} | {_speedup_cell(row)} | "
                f"{_spread_cell(row, results)} | {_verdict_cell(row, results)} |"
            )
        for row in jax_bridge:
            if row["case"] == "overhead":
                spread = f", spread {targets.spread_text(row['spread'])}" if row.get("spread") is not None else ""
                lines += [
                    "",
                    f"Transport cost: {row['ms'] * 1e3:.0f} us per FFI call (the slope between jitted "
                    f"programs of 1 and 11 chained calls whose handler does nothing; the 1-call program "
                    f"takes {row['baseline_ms'] * 1e3:.0f} us{spread}).",
                ]
    for op, variant, what, framework in (
        (
            "fastbwd.torch sweep",
            "eager",
            "PyTorch eager, fastbwd enabled (policy auto) against plain PyTorch",
            "PyTorch",
        ),
        (
            "fastbwd.torch sweep",
            "compiled",
            "torch.compile (Inductor), fastbwd enabled (policy auto) against Inductor alone",
            "PyTorch",
        ),
        (
            "fastbwd.jax sweep",
            "jit(grad)",
            "JAX, fastbwd.jax (policy auto; reach around the libraries' calls and models) against plain JAX",
            "JAX",
        ),
    ):
        sweep = targets.sweep_table(results["rows"], variant, max_spread, op=op)
        if sweep:
            lines += [
                "",
                f"Never slower (issue 52), {what}: forward + backward of one call, {framework}'s time over "
                "fastbwd's, by size (N, C, H, W; channels last: the same numbers) and thread count (~: noisy or "
                "stalled):",
                "",
                *sweep,
            ]
    summary = targets.summarize(results["rows"], max_spread, judge=not results.get("quick"))
    lines += ["", targets.summary_text(summary, max_spread)]
    return "\n".join(lines)


def _one_thread_note(machine):
    """`` Parallel calls stalled: from <case> on, one thread on both sides.`` for a run that timed
    kernel against kernel on one thread (``python3 -m bench``'s --threads auto; or "A case's
    two-thread rounds disagreed" when that switched it), else ""."""
    since = machine.get("one_thread_since")
    if not since:
        return ""
    cause = (
        "A case's two-thread rounds disagreed" if machine.get("one_thread_why") == "noisy" else "Parallel calls stalled"
    )
    since = "from the start" if since == "the start" else f"from {since} on"
    return f" {cause}: {since}, one thread on both sides (kernel against kernel)."


def headline(results):
    """The README's headline: one row per operator and per bridge (the median and range of its
    speed-ups against PyTorch or JAX, its targets' verdicts) and the machine it ran on."""
    max_spread = results.get("max_spread", DEFAULT_MAX_SPREAD)
    judge = not results.get("quick")
    machine = results["machine"]
    lines = [
        f"| operator or bridge | timed against | speed-up: median (range) | tiny calls (< {targets.TINY_MS:g} ms) "
        "| rows | targets |",
        "|---|---|---:|---:|---:|---|",
    ]
    for group in targets.group_summaries(results["rows"], max_spread, judge):
        lines.append(
            f"| `{group['name']}` | {group['against']} | {targets.speedups_text(group['speedups'])} | "
            f"{targets.speedups_text(group['tiny'])} | {group['rows']} | {targets.verdicts_text(group, judge)} |"
        )
    versions = ", ".join(
        f"{name} {machine[key]}"
        for name, key in (("torch", "torch"), ("jax", "jax"), ("numba", "numba"))
        if machine.get(key)
    )
    load = machine.get("load_average")
    load_text = f"; load average {load[0]:.2f} on {machine['cpus']} CPUs at its start" if load else ""
    note = _one_thread_note(machine).rstrip(".")
    load_text += f"; {note[1].lower()}{note[2:]}" if note else ""
    command = "python3 -m bench --full" if judge else "python3 -m bench` (small shapes, not `--full`"
    lines += [
        "",
        f"One `{command}` run on {machine['cpu']}, {machine['threads']} threads ({machine['threading_layer']}); "
        f"{versions}{load_text}. A row's speed-ups are its cases against PyTorch's or JAX's own code (an "
        "operator's: its allocating and `out=` calls against PyTorch's), rows marked noisy or stalled left out; a tiny call's, where fastbwd takes less than "
        f"{targets.TINY_MS:g} ms, is Python's per-call cost rather than the kernels'. The targets include the cases "
        "against fastbwd's other layout or eager mode. Each case, its baseline and its spread: "
        "[docs/benchmarks.md](docs/benchmarks.md).",
    ]
    return "\n".join(lines)


#: Each generated region: its markers and the function of the results that fills it.
REGIONS = ((HEADLINE_BEGIN, HEADLINE_END, headline), (BEGIN, END, table))


def region(text, begin, end):
    """The generated region of ``text`` between the markers ``begin`` and ``end`` (None when absent)."""
    if begin not in text:
        return None
    return text[text.index(begin) + len(begin) : text.index(end)].strip("\n")


def regenerated(text, results):
    """``text`` with each generated region it holds replaced from ``results``."""
    for begin, end, make in REGIONS:
        if begin in text:
            start, stop = text.index(begin) + len(begin), text.index(end)
            text = text[:start] + "\n" + make(results) + "\n" + text[stop:]
    return text


def has_region(text):
    return any(begin in text for begin, _, _ in REGIONS)


def write(path, results):
    """Regenerate the generated regions of the file ``path`` from ``results``."""
    path = Path(path)
    text = path.read_text()
    if not has_region(text):
        raise ValueError(f"{path} has no generated benchmark table (no line {HEADLINE_BEGIN!r} or {BEGIN!r})")
    path.write_text(regenerated(text, results))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python bench/to_table.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="the main job's JSON (python3 -m bench --json FILE)")
    parser.add_argument(
        "--write", nargs="+", metavar="FILE", help="regenerate the tables in these files instead of printing them"
    )
    args = parser.parse_args(argv)
    with open(args.results) as handle:
        results = json.load(handle)
    for path in args.write or ():
        try:
            write(path, results)
        except ValueError as error:
            parser.error(str(error))
        print(f"{path}: benchmark tables regenerated from {args.results}")
    if not args.write:
        print(headline(results) + "\n\n" + table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
